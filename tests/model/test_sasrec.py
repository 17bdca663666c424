"""SASRec baseline: float64 attention reference, padding/causality invariants, cached decoding equal
to recomputation, and the shared training / evaluation / run-directory path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hstu.config import ModelConfig, TrainConfig, model_config_from_preset
from hstu.generate.decode import exclusion_mask, generate, generate_recompute
from hstu.generate.kv_cache import KVCache
from hstu.model.hstu import build_hstu
from hstu.model.sasrec import SASRecModel, sasrec_attention
from hstu.runs import load_run


def tiny(**kw) -> ModelConfig:
    base = dict(
        architecture="sasrec",
        num_items=40,
        max_seq_len=12,
        max_output_len=4,
        embedding_dim=16,
        num_blocks=2,
        num_heads=2,
        d_qk=8,
        d_v=8,
        dropout=0.0,
    )
    return ModelConfig(**{**base, **kw})


def batch(B: int, W: int, lengths: list[int], num_items: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, num_items + 1, (B, W), generator=g)
    ts = torch.cumsum(torch.randint(1, 5000, (B, W), generator=g), dim=1)
    L = torch.tensor(lengths, dtype=torch.int64)
    live = torch.arange(W).view(1, -1) < L.view(-1, 1)
    return ids * live, ts * live, L


def test_builder_dispatch_and_interface():
    m = build_hstu(tiny())
    assert isinstance(m, SASRecModel)
    for name in ("item_emb", "pos_emb", "action_head", "category_emb", "layers", "cfg", "attention"):
        assert hasattr(m, name), name
    with pytest.raises(ValueError, match="architecture"):
        build_hstu(tiny(architecture="gru4rec"))
    with pytest.raises(ValueError, match="num_items"):
        SASRecModel(tiny(num_items=0))


def test_attention_matches_float64_reference():
    torch.manual_seed(0)
    B, H, W, dq, dv = 2, 3, 7, 5, 4
    q, k, v = torch.randn(B, H, W, dq), torch.randn(B, H, W, dq), torch.randn(B, H, W, dv)
    out = sasrec_attention(q, k, v)
    q64, k64, v64 = q.double(), k.double(), v.double()
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(dq)
    s = s.masked_fill(~torch.ones(W, W, dtype=torch.bool).tril(), float("-inf"))
    ref = (torch.softmax(s, -1) @ v64).transpose(1, 2).reshape(B, W, H * dv)
    # float32 softmax-attention vs float64: ~1e-7 relative; 1e-5 absolute leaves margin.
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_block_matches_hand_written_float64_forward():
    """One block, written out from Kang & McAuley 2018 §III-B..D in float64."""
    torch.manual_seed(1)
    m = SASRecModel(tiny(num_blocks=1, num_heads=1, d_qk=16, d_v=16)).double().eval()
    ids, ts, L = batch(2, 6, [6, 4])
    out = m.encode(ids, ts, L, normalize=False)
    blk = m.layers[0]
    x = (m.item_emb.weight[ids] * 4.0 + m.pos_emb.weight[:6]) * (torch.arange(6).view(1, -1, 1) < L.view(-1, 1, 1))
    ln = lambda t, mod: torch.nn.functional.layer_norm(t, (16,), mod.weight, mod.bias, eps=1e-6)  # noqa: E731
    h = ln(x, blk.attn_norm)
    q, k, v = h @ blk.q.weight.T + blk.q.bias, h @ blk.k.weight.T + blk.k.bias, h @ blk.v.weight.T + blk.v.bias
    a = (q @ k.transpose(1, 2) / 4.0).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    s = x + (a @ v) @ blk.o.weight.T + blk.o.bias
    f = torch.relu(ln(s, blk.ffn_norm) @ blk.ffn1.weight.T + blk.ffn1.bias) @ blk.ffn2.weight.T + blk.ffn2.bias
    y = (s + f) * (torch.arange(6).view(1, -1, 1) < L.view(-1, 1, 1))
    ref = ln(y, m.final_norm) * (torch.arange(6).view(1, -1, 1) < L.view(-1, 1, 1))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=4), extra=st.integers(0, 4))
def test_padding_never_changes_live_rows(lengths, extra):
    torch.manual_seed(0)
    m = SASRecModel(tiny()).eval()
    W = max(lengths)
    ids, ts, L = batch(len(lengths), W, lengths)
    a = m.encode(ids, ts, L)
    pad = lambda t: torch.nn.functional.pad(t, (0, extra))  # noqa: E731
    b = m.encode(pad(ids), pad(ts), L)
    live = torch.arange(W).view(1, -1) < L.view(-1, 1)
    torch.testing.assert_close(a[live], b[:, :W][live], atol=1e-6, rtol=1e-6)
    assert (b[:, W:] == 0).all() and (a[~live] == 0).all()
    torch.testing.assert_close(a.norm(dim=-1)[live], torch.ones(int(live.sum())), atol=1e-5, rtol=0)


def test_causal_and_time_free():
    torch.manual_seed(0)
    m = SASRecModel(tiny()).eval()
    ids, ts, L = batch(1, 8, [8])
    a = m.encode(ids, ts, L)
    ids2 = ids.clone()
    ids2[0, 5] = (ids2[0, 5] % 40) + 1
    b = m.encode(ids2, ts, L)
    torch.testing.assert_close(a[:, :5], b[:, :5])  # rows before the change are untouched
    assert not torch.allclose(a[:, 5:], b[:, 5:])
    torch.testing.assert_close(m.encode(ids, ts * 7 + 3, L), a)  # SASRec has no time features


@pytest.mark.parametrize("features", [False, True])
def test_cached_generation_equals_recompute(features):
    torch.manual_seed(0)
    m = SASRecModel(tiny(num_categories=5 if features else 0)).eval()
    ids, ts, L = batch(3, 8, [8, 5, 1])
    rt = ts.max(dim=1).values + 100
    a = generate(m, ids, ts, L, 4, request_time=rt, exclude=exclusion_mask(40, 3, ids, L))
    b = generate_recompute(m, ids, ts, L, 4, request_time=rt, exclude=exclusion_mask(40, 3, ids, L))
    if not features:  # the recompute oracle feeds no category features
        assert torch.equal(a.items, b.items)
        torch.testing.assert_close(a.scores, b.scores, atol=1e-4, rtol=1e-5)
    cache = KVCache.for_model(m, 3 * 4, 12)
    beam = generate(m, ids, ts, L, 4, request_time=rt, exclude=exclusion_mask(40, 3, ids, L), strategy="beam", beam_width=4, cache=cache)
    assert beam.items.shape == (3, 4)
    for row, hist in zip(beam.items.tolist(), ids.tolist()):
        assert len(set(row)) == 4 and not set(row) & (set(hist) - {0})


@torch.no_grad()
def test_step_equals_full_pass_row():
    """The cached row at position p equals row p of a full pass over the grown sequence."""
    torch.manual_seed(2)
    m = SASRecModel(tiny()).eval()
    ids, ts, L = batch(2, 6, [6, 3])
    cache = KVCache.for_model(m, 2, 10)
    kv, _ = cache.views(2)
    m.encode(ids, ts, L, kv_cache=kv)
    new = torch.tensor([7, 9])
    row = m.step(new, L.clone(), torch.zeros(2, 10, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), kv)
    grown = torch.nn.functional.pad(ids, (0, 1))
    grown[torch.arange(2), L] = new
    full = m.encode(grown, torch.zeros_like(grown), L + 1)
    torch.testing.assert_close(row, full[torch.arange(2), L], atol=1e-5, rtol=1e-5)


def test_fit_evaluate_and_load_run(tmp_path):
    """SASRec through the shared loop (sampled softmax, next-action head), evaluation and run dir,
    on a small synthetic event log read by the generic CSV loader."""
    from hstu.data.prepare import DataSpec, prepare_data
    from hstu.generate.recommend import History, Recommender
    from hstu.train.evaluate import evaluate
    from hstu.train.loop import fit

    rng = np.random.default_rng(0)
    rows = ["user,item,ts,event"]
    for u in range(30):
        for j in range(int(rng.integers(4, 15))):
            rows.append(f"{u},{int(rng.integers(1, 60))},{1000 + 10 * j},{'view' if rng.random() < 0.8 else 'buy'}")
    (tmp_path / "log.csv").write_text("\n".join(rows) + "\n")
    spec = DataSpec("csv", str(tmp_path / "log.csv"), options={"columns": "user=user,item=item,time=ts,action=event"})
    mcfg = model_config_from_preset("small", architecture="sasrec", max_seq_len=16)
    metrics = fit(tmp_path / "run", mcfg, TrainConfig(epochs=2, num_negatives=16), spec, progress=False)
    assert metrics["epochs"] == 2 and 0 <= metrics["test"]["HR@10"] <= 1
    model, cfg, _ = load_run(tmp_path / "run")
    assert isinstance(model, SASRecModel) and cfg["model"]["architecture"] == "sasrec"
    assert model.action_head is not None and model.cfg.num_actions == 2
    log_, split = prepare_data(spec)
    again = evaluate(model, log_, split, "test")
    assert again["HR@10"] == pytest.approx(metrics["test"]["HR@10"])
    rec = Recommender.from_run(tmp_path / "run")
    items = rec.recommend([rec.prepare(History([1, 2, 3], [1000, 1010, 1020], ["view", "view", "buy"]))], 3)[0]
    assert len(items) == 3 and all(it["action"] in ("view", "buy") for it in items)
