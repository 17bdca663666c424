"""Mixed negative sampling (TrainConfig.in_batch_negatives, hstu.train.mixed_negatives) and the learning-rate
warm-up (TrainConfig.lr_warmup_steps, hstu.train.recipe.warmed_up), issue 20's levers.

The loss is checked against a float64 loop written here from the definition (each negative's logit / tau lowered
by log((M + N I c_j / P) / (M + N)), c_j counted by hand); the correction against its defining property: summed
over a position's draws, exp(s_j - offset_j) estimates (M + N) / I x the sum of exp(s_j) over all items whatever the
mix, which the uncorrected sum does not.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from test_negatives_pool import _batch

from hstu.config import TrainConfig
from hstu.data.prepare import DataSpec, prepare_data
from hstu.train import losses as L
from hstu.train.loop import epoch_batches, fit
from hstu.train.mixed_negatives import draw_mixed, mixed_softmax_loss
from hstu.train.recipe import decay_on_plateau, model_text, recipe, recipe_text, recipe_warnings, warmed_up

TAU = 0.05


def _loop_loss(out, ids, lengths, emb, neg, M, N, I) -> torch.Tensor:
    """The definition, one position at a time, with the correction counted by hand."""
    tgts = [int(ids[b, t + 1]) for b in range(out.shape[0]) for t in range(int(lengths[b]) - 1)]
    count, P = Counter(tgts), len(tgts)
    terms, p = [], 0
    for b in range(out.shape[0]):
        for t in range(int(lengths[b]) - 1):
            q, tgt = out[b, t], tgts[p]
            cos = lambda j, q=q: torch.dot(q, emb.weight[j] / emb.weight[j].norm())  # noqa: E731
            logits = [cos(tgt) / TAU]
            for j in neg[p].tolist():
                if j != tgt:
                    logits.append(cos(j) / TAU - math.log((M + N * I * count[j] / P) / (M + N)))
            z = torch.stack(logits)
            terms.append(torch.logsumexp(z, 0) - z[0])
            p += 1
    return torch.stack(terms).mean()


def _targets(ids, lengths):
    mask = L.supervised_mask(lengths, ids.shape[1] - 1)
    return ids[:, 1:][mask], mask


def test_loss_is_the_float64_definition() -> None:
    emb, out, ids, lengths = _batch()
    got, n = mixed_softmax_loss(
        out, ids, lengths, emb, num_negatives=3, in_batch=4, temperature=TAU, num_items=13, generator=torch.Generator().manual_seed(5)
    )
    tgt, mask = _targets(ids, lengths)
    neg, _ = draw_mixed(tgt, mask, num_negatives=3, in_batch=4, num_items=13, generator=torch.Generator().manual_seed(5))
    assert n == 6 + 3 and neg.shape == (n, 7)
    assert set(neg[:, 3:].flatten().tolist()) <= set(tgt.tolist())  # the in-batch draws are targets of the batch
    torch.testing.assert_close(got, _loop_loss(out, ids, lengths, emb, neg, 3, 4, 13), rtol=1e-12, atol=1e-12)
    got.backward()
    assert out.grad is not None and torch.isfinite(out.grad).all() and emb.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dense", [True, False])  # dense logits over the table; the distinct ids drawn (P x (I + 1) above the cap)
def test_no_in_batch_draws_is_the_per_position_loss_draw_for_draw(dense, monkeypatch) -> None:
    I = 400
    if not dense:
        monkeypatch.setattr(L, "DENSE_LOGITS_MAX", 118 * I)
    emb, out, ids, lengths = _batch(B=3, W=70, I=I, seed=1)
    lengths = torch.tensor([70, 50, 1])
    ids = ids * (torch.arange(70) < lengths.view(3, 1))
    kw = dict(num_negatives=6, temperature=TAU, num_items=I)
    a, na = mixed_softmax_loss(out, ids, lengths, emb, in_batch=0, generator=torch.Generator().manual_seed(9), **kw)
    b, nb = L.sampled_softmax_loss(out, ids, lengths, emb, chunk=1, generator=torch.Generator().manual_seed(9), **kw)
    assert na == nb == 118
    assert L.uses_dense_logits(na, 1, I) == dense
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_correction_keeps_the_uniform_samplers_estimate() -> None:
    """E[sum over one position's M + N draws of exp(s_j - offset_j)] = (M + N) / I x sum_j exp(s_j), for a popularity-skewed
    batch; 20,000 positions' draws average it to within 2 %, while without the offsets the in-batch draws overweight
    the popular items (here by more than 30 %)."""
    I, M, N = 20, 2, 6
    g = torch.Generator().manual_seed(0)
    s = torch.randn(I + 1, generator=g, dtype=torch.float64) * 1.5
    s[1:4] += 2.0  # the three popular items score high: in-batch draws pick them often
    rest = torch.randint(4, I + 1, (1_000,), generator=g)
    tgt = torch.cat([torch.full((12_000,), 1), torch.full((5_000,), 2), torch.full((2_000,), 3), rest])
    mask = torch.ones(1, tgt.shape[0], dtype=torch.bool)
    neg, off = draw_mixed(tgt, mask, num_negatives=M, in_batch=N, num_items=I, generator=g)
    want = (M + N) / I * s[1:].exp().sum()
    corrected = (s[neg] - off.double()).exp().sum(1).mean()
    plain = s[neg].exp().sum(1).mean()
    assert float(corrected / want) == pytest.approx(1.0, abs=0.02)
    assert float(plain / want) > 1.3


def test_config_recipe_and_training_loss_route() -> None:
    for kw, msg in [
        ({"in_batch_negatives": -1}, "in_batch_negatives must be >= 0"),
        ({"in_batch_negatives": 4, "softmax": "full"}, "in_batch_negatives is a sampled-softmax option"),
        ({"in_batch_negatives": 4, "negatives_pool": 64}, "in_batch_negatives, negatives_pool: set one to 0"),
        ({"lr_warmup_steps": -1}, "lr_warmup_steps must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**kw).validate()
    r = recipe(TrainConfig(in_batch_negatives=32, lr_warmup_steps=100))
    assert (r["negatives"], r["in_batch_negatives"], r["negatives_chunk"], r["lr_warmup_steps"]) == ("mixed", 32, None, 100)
    text = recipe_text(TrainConfig(in_batch_negatives=32, lr_warmup_steps=100))
    assert "negatives mixed (128 uniform + 32 in-batch per position, logQ-corrected)" in text
    assert "linear lr warm-up over 100 steps, lr x 0.5" in text
    assert recipe(TrainConfig())["in_batch_negatives"] == 0 and recipe(TrainConfig(softmax="full"))["in_batch_negatives"] is None


def test_warm_up_by_hand() -> None:
    """SGD at rate 1 on a gradient of 1 moves the parameter by the step's rate: (step + 1) / 4 for the first 4 steps,
    then 1; a plateau decay at step 2 halves the run's rate, warmed or not, and the group keeps the run's rate."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    moves, kept = [], []
    for step in range(6):
        if step == 2:
            decay_on_plateau(opt.param_groups, TrainConfig(lr_decay_patience=1), 1, epoch=1)
        before = float(p.detach())
        p.grad = torch.ones(1)
        with warmed_up(opt.param_groups, TrainConfig(lr_warmup_steps=4), step):
            opt.step()
        moves.append(before - float(p.detach()))
        kept.append(opt.param_groups[0]["lr"])
    assert moves == pytest.approx([0.25, 0.5, 0.75 * 0.5, 1.0 * 0.5, 0.5, 0.5])
    assert kept == [1.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    groups = [{"lr": 1e-3}]
    with warmed_up(groups, TrainConfig(), 0):
        assert groups == [{"lr": 1e-3}]


def test_warm_up_and_mixed_negatives_resume_as_uninterrupted(ml1m_dir, tmp_path) -> None:
    """A warm-up spanning three epochs and mixed negatives: 2 epochs + --resume to 3 give the uninterrupted run's
    losses and weights; the checkpoint holds the run's own rate throughout."""
    from hstu.config import model_config_from_preset

    mcfg = model_config_from_preset("small", max_seq_len=30, embedding_dim=16, d_qk=16, d_v=16)
    spec = DataSpec("ml-1m", str(ml1m_dir), max_users=120)
    tc = lambda e: TrainConfig(  # noqa: E731
        epochs=e, batch_size=32, num_negatives=8, in_batch_negatives=4, lr_warmup_steps=10, seed=3, early_stopping_patience=99
    )
    log_, split = prepare_data(spec)
    per_epoch = len(epoch_batches(log_, split, tc(1), mcfg.max_seq_len, 1))
    assert 3 * per_epoch > 10 > 2 * per_epoch  # the warm-up ends inside epoch 3
    fit(tmp_path / "a", mcfg, tc(3), spec, progress=False)
    fit(tmp_path / "b", mcfg, tc(2), spec, progress=False)
    assert [g["lr"] for g in json.loads((tmp_path / "b" / "last.json").read_text())["param_groups"]] == [1e-3]
    fit(tmp_path / "b", mcfg, tc(3), spec, resume=True, progress=False)
    ha, hb = (json.loads((tmp_path / r / "history.json").read_text()) for r in "ab")
    assert [h["loss"] for h in ha] == pytest.approx([h["loss"] for h in hb], rel=1e-6)
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["recipe"]["negatives"] == "mixed"
    with pytest.raises(ValueError, match=r"--resume: \[train\] lr_warmup_steps is 0 here, 10 in the run"):
        fit(tmp_path / "b", mcfg, replace(tc(4), lr_warmup_steps=0), spec, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"--resume: \[train\] learning_rate is 0.005 here, 0.001 in the run"):
        fit(tmp_path / "b", mcfg, replace(tc(4), learning_rate=5e-3), spec, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"--resume: \[train\] in_batch_negatives is 8 here, 4 in the run"):
        fit(tmp_path / "b", mcfg, replace(tc(4), in_batch_negatives=8), spec, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"--resume: \[train\] batch_size is 16 here, 32 in the run .* warm-up counts steps"):
        fit(tmp_path / "b", mcfg, replace(tc(4), batch_size=16), spec, resume=True, progress=False)
    assert len(json.loads((tmp_path / "b" / "history.json").read_text())) == 3


def test_the_python_api_refuses_before_writing_and_a_failed_first_epoch_leaves_nothing(ml1m_dir, tmp_path) -> None:
    from hstu.config import model_config_from_preset

    spec = DataSpec("ml-1m", str(ml1m_dir), max_users=40)
    small = lambda **kw: model_config_from_preset("small", max_seq_len=30, embedding_dim=16, d_qk=16, d_v=16, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"\[train\] in_batch_negatives \(--in-batch-negatives\) is not supported with a repeat head"):
        fit(tmp_path / "r", small(repeat_window=5), TrainConfig(epochs=1, batch_size=16, in_batch_negatives=4), spec, progress=False)
    assert not (tmp_path / "r").exists()

    def boom(epoch, step, loss):
        raise RuntimeError("out of memory (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        fit(tmp_path / "f", small(), TrainConfig(epochs=1, batch_size=16, num_negatives=8), spec, progress=False, on_step=boom)
    assert not (tmp_path / "f").exists()


def test_warnings_and_bounds() -> None:
    assert recipe_warnings(TrainConfig(in_batch_negatives=8, negatives_chunk=16)) == [
        "[train] in_batch_negatives draws negatives per position: negatives_chunk = 16 unused"
    ]
    assert recipe_warnings(TrainConfig(negatives_pool=64, negatives_chunk=4))[0].startswith("[train] negatives_pool draws")
    late = recipe_warnings(TrainConfig(epochs=2, lr_warmup_steps=100), steps_per_epoch=47)
    assert late == [
        "[train] lr_warmup_steps = 100 is more than this run's 94 optimizer steps (2 epoch(s) x 47 batch(es)): "
        "the learning rate never reaches learning_rate = 0.001"
    ]
    assert recipe_warnings(TrainConfig(epochs=3, lr_warmup_steps=94), steps_per_epoch=47) == []
    for name in ("num_negatives", "in_batch_negatives"):
        with pytest.raises(ValueError, match=f"TrainConfig.{name} must be <= 8192"):
            TrainConfig(**{name: 8193}).validate()


def test_hstu_train_flags_reach_the_run(tmp_path) -> None:
    """--in-batch-negatives / --lr-warmup-steps reach config.json's train table, metrics.json's recipe and the log."""
    import subprocess
    import sys

    from conftest import tiny_csv_flags

    flags = tiny_csv_flags(tmp_path, train={"epochs": 1}) + ["--in-batch-negatives", "3", "--lr-warmup-steps", "2", "--threads", "1"]
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "hstu", "train", *flags, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    train = json.loads((out / "config.json").read_text())["train"]
    assert (train["in_batch_negatives"], train["lr_warmup_steps"]) == (3, 2)
    rec = json.loads((out / "metrics.json").read_text())["recipe"]
    assert (rec["negatives"], rec["in_batch_negatives"], rec["lr_warmup_steps"]) == ("mixed", 3, 2)
    assert "negatives mixed (4 uniform + 3 in-batch per position, logQ-corrected)" in r.stderr
    assert "model: hstu, " in r.stderr and " parameters" in r.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "hstu", "train", *flags[:-6], "--in-batch-negatives", "-1", "--out", str(tmp_path / "b")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--in-batch-negatives" in bad.stderr


def test_the_log_names_the_block() -> None:
    from hstu.config import model_config_from_preset

    small = lambda **kw: model_text(model_config_from_preset("small", **kw), 1234)  # noqa: E731
    assert (
        small()
        == "hstu, FuXi-alpha block (semantic, position and time channels), 2 blocks x 1 head, d 50, max_seq_len 200, 1,234 parameters"
    )
    assert "FuXi-beta block (position and time channels, no query-key map)" in small(query_key_map=False)
    assert "FuXi-beta block (position channel, no query-key map)" in small(query_key_map=False, use_time_bias=False)
    assert "FuXi-alpha block (semantic and time channels)" in small(use_position_bias=False)
    assert small(multi_channel=False).startswith("hstu, HSTU block, 2 blocks")
    assert "HSTU block without the query-key map" in small(multi_channel=False, query_key_map=False)
    assert "+ SwiGLU FFN stage (hidden 200), 8 blocks x 2 heads" in model_text(model_config_from_preset("large", ffn_hidden=200))
    assert "channels) + repeat head (window 20) + next-action head, 2 blocks" in small(repeat_window=20, num_actions=4)
    assert small(architecture="sasrec").startswith("sasrec, 2 blocks x 1 head")


@pytest.mark.parametrize("flag", ["--in-batch-negatives", "--negatives-pool"])
def test_a_repeat_head_refuses_the_batch_negative_schemes_before_writing(tmp_path, flag) -> None:
    import subprocess
    import sys

    from conftest import tiny_csv_flags

    flags = tiny_csv_flags(tmp_path, model={"repeat_window": 3}, train={"epochs": 1})
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "hstu", "train", *flags, flag, "4", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and f"({flag}) is not supported with a repeat head (repeat_window > 0); set it to 0" in r.stderr
    assert not out.exists()


def test_resume_accepts_the_preset_the_run_was_trained_with(tmp_path) -> None:
    """A second fresh-user finding: `hstu train --resume --preset small` on a small run was refused ("drop --preset small");
    the command that trained a run, with --resume added, goes on; another preset is refused naming the fields."""
    import argparse

    from hstu.config import model_config_from_preset, to_dict
    from hstu.train.cli import _check_resume_flags

    def check(preset, config=None, arch=None):
        _check_resume_flags(argparse.Namespace(resume=True, out=str(tmp_path), preset=preset, config=config, arch=arch))

    (tmp_path / "config.json").write_text(json.dumps({"model": to_dict(model_config_from_preset("small"))}))
    check("small")
    with pytest.raises(ValueError, match=r"the flags give num_blocks = 8 \(the run: 2\), .*; drop --preset large$"):
        check("large")
    # a third: the flags together, as the run was trained (`--preset large --config F`, F's [model] over the preset)
    f = tmp_path / "f.toml"
    f.write_text("[model]\nmulti_channel = false\n")
    (tmp_path / "config.json").write_text(json.dumps({"model": to_dict(model_config_from_preset("large", multi_channel=False))}))
    check("large", str(f))  # was refused: "multi_channel True in the preset, False in the run, query_key_map ..."
    with pytest.raises(ValueError, match=r"give multi_channel = false \(the run: true\); drop .*f.toml's \[model\] multi_channel$"):
        (tmp_path / "config.json").write_text(json.dumps({"model": to_dict(model_config_from_preset("small"))}))
        check("small", str(f))
    sas = to_dict(model_config_from_preset("large", architecture="sasrec"))
    (tmp_path / "config.json").write_text(json.dumps({"model": sas}))
    check("large", arch="sasrec")  # was refused: "drop --arch sasrec"
    check(None, arch="sasrec")
    with pytest.raises(ValueError, match=r"give architecture = \"hstu\" \(the run: \"sasrec\"\); drop --arch hstu$"):
        check(None, arch="hstu")
