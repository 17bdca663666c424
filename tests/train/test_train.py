"""Training behaviour on a real slice of ML-1M: the loss falls, resume equals an
uninterrupted run, checkpoints hold no pickle, the run loads back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hstu.config import TrainConfig, model_config_from_preset
from hstu.data.prepare import DataSpec, prepare_data
from hstu.runs import load_run
from hstu.train.evaluate import evaluate
from hstu.train.loop import fit


def tiny():
    return model_config_from_preset("small", max_seq_len=30, embedding_dim=16, d_qk=16, d_v=16)


def test_resume_equals_uninterrupted(ml1m_dir, tmp_path):
    spec = DataSpec("ml-1m", str(ml1m_dir), max_users=120)
    tc = lambda e: TrainConfig(epochs=e, batch_size=32, num_negatives=16, seed=3, early_stopping_patience=99)  # noqa: E731
    fit(tmp_path / "a", tiny(), tc(3), spec, progress=False)
    fit(tmp_path / "b", tiny(), tc(2), spec, progress=False)
    fit(tmp_path / "b", tiny(), tc(3), spec, resume=True, progress=False)
    ha = json.loads((tmp_path / "a" / "history.json").read_text())
    hb = json.loads((tmp_path / "b" / "history.json").read_text())
    assert [h["epoch"] for h in hb] == [1, 2, 3]
    assert [h["loss"] for h in ha] == pytest.approx([h["loss"] for h in hb], rel=1e-6)
    wa = load_file(str(tmp_path / "a" / "last.safetensors"))
    wb = load_file(str(tmp_path / "b" / "last.safetensors"))
    for k in wa:
        if k.startswith("model."):
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_loss_falls_and_run_loads_back(ml1m_dir, tmp_path):
    spec = DataSpec("ml-1m", str(ml1m_dir), max_users=300)
    m = fit(tmp_path / "r", tiny(), TrainConfig(epochs=4, batch_size=32, num_negatives=32), spec, progress=False)
    hist = json.loads((tmp_path / "r" / "history.json").read_text())
    assert hist[-1]["loss"] < hist[0]["loss"] * 0.9
    assert set(m["test"]) >= {"HR@1", "HR@10", "HR@50", "HR@200", "NDCG@10", "MRR"}
    assert m["test"]["users"] == 300
    model, cfg, ids = load_run(tmp_path / "r")
    assert cfg["model"]["num_items"] == len(ids["item_raw_ids"]) - 1
    log_, split = prepare_data(DataSpec(**cfg["data"]))
    again = evaluate(model, log_, split, "test")
    assert again["HR@10"] == pytest.approx(m["test"]["HR@10"])
    # the files are safetensors + JSON only, and the history as CSV
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted(
        ["config.json", "history.json", "idmap.json", "last.json", "last.safetensors", "metrics.csv", "metrics.json", "model.safetensors"]
    )


def test_existing_run_is_not_overwritten_silently(ml1m_dir, tmp_path):
    spec = DataSpec("ml-1m", str(ml1m_dir), max_users=40)
    fit(tmp_path, tiny(), TrainConfig(epochs=1, batch_size=32, num_negatives=8), spec, progress=False)
    with pytest.raises(FileExistsError, match="--resume"):
        fit(tmp_path, tiny(), TrainConfig(epochs=1), spec, progress=False, overwrite=False)


def test_sampled_softmax_masks_negative_equal_to_target():
    from hstu.train.losses import sampled_softmax_loss

    emb = torch.nn.Embedding(3, 4)
    out = torch.nn.functional.normalize(torch.randn(1, 3, 4), dim=-1)
    ids = torch.tensor([[1, 2, 1]])
    # with 2 items only, every negative equals a target or the other item; losses must stay finite
    loss, n = sampled_softmax_loss(out, ids, torch.tensor([3]), emb, num_negatives=8, temperature=0.05, num_items=2)
    assert n == 2 and torch.isfinite(loss)
    # hand check with one negative equal to the target everywhere: loss = 0 (only the positive remains)
    emb1 = torch.nn.Embedding(2, 4)
    loss1, _ = sampled_softmax_loss(
        out[:, :2], torch.tensor([[1, 1]]), torch.tensor([2]), emb1, num_negatives=4, temperature=0.05, num_items=1
    )
    assert float(loss1.detach()) == pytest.approx(0.0, abs=1e-6)


def test_per_position_dense_logits_equal_gathered_rows(monkeypatch):
    """chunk = 1: the dense-logits path (q · Ênᵀ, then pick) gives the loss and gradients of
    gathering each position's M negative rows, for the same negatives (float64)."""
    import hstu.train.losses as L

    torch.manual_seed(0)
    B, W, d, I, M = 3, 7, 5, 11, 6
    emb = torch.nn.Embedding(I + 1, d).double()
    out = torch.nn.functional.normalize(torch.randn(B, W, d, dtype=torch.float64), dim=-1).requires_grad_()
    ids = torch.randint(1, I + 1, (B, W))
    lengths = torch.tensor([7, 4, 1])  # a sequence with no supervised position too
    res = {}
    for name, limit in (("dense", 1 << 28), ("gather", 0)):
        monkeypatch.setattr(L, "DENSE_LOGITS_MAX", limit)
        emb.zero_grad()
        out.grad = None
        loss, n = L.sampled_softmax_loss(
            out, ids, lengths, emb, num_negatives=M, temperature=0.05, chunk=1, num_items=I, generator=torch.Generator().manual_seed(5)
        )
        loss.backward()
        res[name] = (loss.detach(), n, out.grad.clone(), emb.weight.grad.clone())
    assert res["dense"][1] == res["gather"][1] == 6 + 3
    for a, b in zip(res["dense"][::2] + res["dense"][3:], res["gather"][::2] + res["gather"][3:]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
