"""The full softmax (TrainConfig.softmax = "full", hstu.train.full_softmax): cross-entropy over every item.

The loss and its gradients are checked against float64 autograd of the definition written here one
position at a time: position p predicts ids[b, t+1] from row (b, t); its logits are the cosines of the
row with every item 1..I (L2-normalised embeddings) over tau; loss = mean over p of
logsumexp(logits) - logits[target]. Blocks of one position (a tiny SCORE_BLOCK) give the same values.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_csv_flags

from hstu.config import TrainConfig
from hstu.train import full_softmax as FS
from hstu.train import losses as L
from hstu.train.recipe import recipe, recipe_text, recipe_warnings

TAU = 0.05


def _batch(B=3, W=7, d=5, I=13, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Embedding(I + 1, d).to(dtype)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(I + 1, d, generator=g, dtype=torch.float64))
    out = torch.nn.functional.normalize(torch.randn(B, W, d, generator=g, dtype=torch.float64), dim=-1).to(dtype).requires_grad_()
    lengths = torch.tensor([W, 4, 1][:B])  # a sequence without supervised positions too
    ids = torch.randint(1, I + 1, (B, W), generator=g) * (torch.arange(W) < lengths.view(B, 1))
    return emb, out, ids, lengths


def _loop_loss(out, ids, lengths, weight) -> torch.Tensor:
    """The definition, one position at a time, on float64 copies."""
    out, weight = out.double(), weight.double()
    rows = weight[1:] / weight[1:].norm(dim=1, keepdim=True)  # items 1..I
    terms = []
    for b in range(out.shape[0]):
        for t in range(int(lengths[b]) - 1):
            z = rows @ out[b, t] / TAU  # (I,)
            terms.append(torch.logsumexp(z, 0) - z[int(ids[b, t + 1]) - 1])
    return torch.stack(terms).mean()


def _grads(loss, out, emb):
    return torch.autograd.grad(loss, [out, emb.weight])


@pytest.mark.parametrize("block", [L.SCORE_BLOCK, 7])
def test_loss_and_gradients_equal_a_float64_loop(block, monkeypatch) -> None:
    """full_softmax_loss = the loop, and so are the gradients of the encoder rows and of the item table (row 0, the
    padding, gets none); block 7: one position per block (K = 14 > 7)."""
    monkeypatch.setattr(FS, "SCORE_BLOCK", block)
    emb, out, ids, lengths = _batch()
    loss, n = FS.full_softmax_loss(out, ids, lengths, emb, temperature=TAU, num_items=13)
    want = _loop_loss(out, ids, lengths, emb.weight)
    assert n == 6 + 3
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    got_g, want_g = _grads(loss, out, emb), _grads(want, out, emb)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert float(got_g[1][0].abs().sum()) == 0.0


def test_float32_agrees_with_float64_and_packed_rows_equal_padded_ones() -> None:
    """float32 within float32 rounding of the float64 loop; two users packed in one row (segments) give the
    padded batch's loss: positions whose next row is another user's are not supervised."""
    emb, out, ids, lengths = _batch(dtype=torch.float32)
    loss, _ = FS.full_softmax_loss(out, ids, lengths, emb, temperature=TAU, num_items=13)
    torch.testing.assert_close(loss.double(), _loop_loss(out, ids, lengths, emb.weight), rtol=1e-5, atol=1e-5)
    emb, out, ids, lengths = _batch(B=2, W=7)
    packed_out = torch.cat([out[0, :7], out[1, :4]]).unsqueeze(0)  # (1, 11, d): user 0 then user 1
    packed_ids = torch.cat([ids[0, :7], ids[1, :4]]).unsqueeze(0)
    segments = torch.tensor([[0] * 7 + [1] * 4])
    got, n = FS.full_softmax_loss(packed_out, packed_ids, torch.tensor([11]), emb, temperature=TAU, num_items=13, segments=segments)
    want, m = FS.full_softmax_loss(out, ids, lengths, emb, temperature=TAU, num_items=13)
    assert n == m == 9
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_training_loss_takes_the_full_softmax_of_the_config() -> None:
    emb, out, ids, lengths = _batch()
    model = torch.nn.Module()
    model.item_emb, model.repeat, model.action_head = emb, None, None
    model.cfg = type("Cfg", (), {"num_items": 13, "temperature": TAU})()
    got, n = L.training_loss(model, out, ids, lengths, None, TrainConfig(softmax="full"))
    assert n == 9
    torch.testing.assert_close(got, _loop_loss(out, ids, lengths, emb.weight), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="not supported by the distributed trainer"):
        L.training_loss(model, out, ids, lengths, None, TrainConfig(softmax="full"), neg=torch.ones(3, 6, 6, dtype=torch.long), chunk=1)
    model.repeat = object()
    with pytest.raises(ValueError, match="softmax = 'full' is not supported with a repeat head"):
        L.training_loss(model, out, ids, lengths, None, TrainConfig(softmax="full"))


def test_config_errors_and_recipe() -> None:
    with pytest.raises(ValueError, match=r"softmax \(\[train\] softmax\) must be 'sampled' or 'full'"):
        TrainConfig(softmax="exact").validate()
    with pytest.raises(ValueError, match="negatives_pool is a sampled-softmax option"):
        TrainConfig(softmax="full", negatives_pool=64).validate()
    tcfg = TrainConfig(softmax="full")
    assert recipe(tcfg)["negatives"] == "full"
    assert [recipe(tcfg)[k] for k in ("num_negatives", "negatives_chunk", "negatives_pool")] == [None] * 3  # nothing sampled
    assert recipe_text(tcfg).startswith("negatives full (every item: full softmax), batching random")
    assert recipe(TrainConfig())["negatives"] == "per-position"  # the default stays the sampled softmax
    assert recipe_warnings(TrainConfig(softmax="full", num_negatives=512)) == [
        "[train] softmax = 'full' samples no negatives: num_negatives = 512 unused"
    ]
    assert recipe_warnings(TrainConfig(softmax="full")) == recipe_warnings(TrainConfig(num_negatives=512)) == []


def test_hstu_train_softmax_full(tmp_path) -> None:
    """`hstu train --softmax full` records the field and the recipe, logs it, and trains to finite metrics."""
    out = tmp_path / "run"
    flags = [*tiny_csv_flags(tmp_path, train={"epochs": 2}), "--softmax", "full", "--negatives-chunk", "4"]  # unused, warned
    cmd = [sys.executable, "-m", "hstu", "train", *flags]
    r = subprocess.run([*cmd, "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["train"]["softmax"] == "full"
    met = json.loads((out / "metrics.json").read_text())
    assert met["recipe"]["negatives"] == "full"
    assert "recipe: negatives full (every item: full softmax)" in r.stderr
    assert "samples no negatives: num_negatives = 4, negatives_chunk = 4 unused" in r.stderr  # the tiny config sets 4 negatives
    assert 0.0 <= met["test"]["HR@10"] <= 1.0


def test_hstu_train_refuses_full_softmax_with_a_repeat_head_before_writing(tmp_path) -> None:
    """The refusal comes before the run directory is written, and a refused --resume leaves the run's softmax as it was."""
    flags = tiny_csv_flags(tmp_path, model={"repeat_window": 3}, train={"epochs": 1})
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "hstu", "train", *flags, "--softmax", "full", "--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "softmax = 'full' (--softmax full) is not supported with a repeat head" in r.stderr
    assert not (out / "config.json").exists()
    ok = subprocess.run(
        [sys.executable, "-m", "hstu", "train", *flags, "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert ok.returncode == 0, ok.stderr
    before = (out / "config.json").read_text()
    r = subprocess.run(
        [sys.executable, "-m", "hstu", "train", "--out", str(out), "--resume", "--epochs", "2", "--softmax", "full", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "repeat head" in r.stderr
    assert json.loads((out / "config.json").read_text())["train"]["softmax"] == json.loads(before)["train"]["softmax"] == "sampled"
    again = subprocess.run(
        [sys.executable, "-m", "hstu", "train", "--out", str(out), "--resume", "--epochs", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr  # the refused resume left the run resumable as it was


def test_resume_keeps_the_runs_softmax(tmp_path) -> None:
    """--resume with another --softmax than the run's is refused before anything is written; the run resumes as it was."""
    out = tmp_path / "run"
    base = [sys.executable, "-m", "hstu", "train", "--threads", "1", "--out", str(out)]
    ok = subprocess.run([*base, *tiny_csv_flags(tmp_path, train={"epochs": 1})], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    before = {f: (out / f).read_bytes() for f in ("config.json", "metrics.json", "last.json")}
    r = subprocess.run([*base, "--resume", "--epochs", "2", "--softmax", "full"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--resume: [train] softmax is 'full' here, 'sampled' in the run" in r.stderr
    assert {f: (out / f).read_bytes() for f in before} == before
    again = subprocess.run([*base, "--resume", "--epochs", "2", "--softmax", "sampled"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr  # the run's own softmax, named, resumes
    assert json.loads((out / "metrics.json").read_text())["recipe"]["negatives"] != "full"


def test_resume_accepts_the_runs_own_model_table_and_refuses_another(tmp_path) -> None:
    """The command that trained a run resumes with its --config [model] table; a table with another value is refused,
    naming the field and the run's value, before anything is written."""
    out = tmp_path / "run"
    flags = tiny_csv_flags(tmp_path, train={"epochs": 1})
    base = [sys.executable, "-m", "hstu", "train", "--threads", "1", "--out", str(out)]
    assert subprocess.run([*base, *flags], capture_output=True, text=True, timeout=300).returncode == 0
    again = subprocess.run([*base, *flags, "--resume", "--epochs", "2"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    before = (out / "last.json").read_bytes()
    other = tiny_csv_flags(tmp_path, model={"num_heads": 2}, train={"epochs": 1})
    r = subprocess.run([*base, *other, "--resume", "--epochs", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "[model] sets num_heads = 2 (the run: 1)" in r.stderr
    assert (out / "last.json").read_bytes() == before
