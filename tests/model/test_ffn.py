"""``[model] ffn_hidden`` (issue 20, Part B: FuXi-alpha's multi-stage FFN, its second stage): a SwiGLU with
RMSNorm and a residual after each block. Checked against a float64 hand computation, for padding
invariance, on the generation paths (cached = recompute = the serving engine) and under INT8."""

from __future__ import annotations

import torch
from conftest import three_histories

from hstu.config import ModelConfig
from hstu.generate.decode import exclusion_mask, generate, generate_recompute
from hstu.generate.engine import Engine
from hstu.model import HSTUModel
from hstu.quant.int8 import Int8Linear, quantizable_linears, quantize_model_int8

T0 = 978_300_000


def _model(seed: int = 0, **kw) -> HSTUModel:
    torch.manual_seed(seed)
    base = dict(num_items=40, max_seq_len=10, max_output_len=4, embedding_dim=12, num_blocks=2, num_heads=2, d_qk=6, d_v=6, dropout=0.0)
    m = HSTUModel(ModelConfig(**{**base, "ffn_hidden": 20, **kw})).eval()
    with torch.no_grad():
        for layer in m.layers:
            layer.ffn.norm.weight.uniform_(0.5, 1.5)  # not the ones it starts at: the scale is checked too
    return m


def test_the_ffn_stage_equals_a_float64_hand_computation() -> None:
    """y = z + W_down(SiLU(W_gate r) ⊙ W_up r), r = z / sqrt(mean(z²) + eps) ⊙ g, z the block without the FFN."""
    m = _model(1, num_blocks=1).double()
    layer = m.layers[0]
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    meta = m.attention_meta(T0 + torch.arange(6).repeat(2, 1) * 100, torch.ones(2, 6, 1, dtype=torch.float64))
    got = layer(x, meta)
    ffn, layer.ffn = layer.ffn, None
    z = layer(x, meta)  # the HSTU block alone
    r = z / torch.sqrt(z.square().mean(-1, keepdim=True) + layer.eps) * ffn.norm.weight
    w = ffn.gate_up.weight
    want = z + (torch.nn.functional.silu(r @ w[:20].T) * (r @ w[20:].T)) @ ffn.down.weight.T
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert sum(p.numel() for p in ffn.parameters()) == 12 + 12 * 40 + 20 * 12


def test_padding_does_not_change_live_rows() -> None:
    """Padded to width 8 or not, the live rows agree; the padding holds each row's last time (its query time)."""
    m = _model(2)
    ids, ts, lengths, _ = three_histories(T0)
    ts = torch.where(torch.arange(8) < lengths.view(-1, 1), ts, ts.gather(1, (lengths - 1).view(-1, 1)))
    full = m.encode(ids, ts, lengths)
    for b in range(3):
        L = int(lengths[b])
        one = m.encode(ids[b : b + 1, :L], ts[b : b + 1, :L], lengths[b : b + 1])
        torch.testing.assert_close(one[0], full[b, :L], rtol=1e-5, atol=1e-6)
        assert not full[b, L:].any()


def test_generation_paths_agree() -> None:
    m = _model(3)
    ids, ts, lengths, req = three_histories(T0)

    def ex():
        return exclusion_mask(40, 3, ids, lengths)

    cached = generate(m, ids, ts, lengths, 4, request_time=req, exclude=ex())
    again = generate_recompute(m, ids, ts, lengths, 4, request_time=req, exclude=ex())
    assert torch.equal(cached.items, again.items)
    torch.testing.assert_close(cached.scores, again.scores, rtol=1e-5, atol=1e-5)
    served = Engine(m, buckets=(8,), max_batch=4, k_max=4).generate(ids, ts, lengths, 4, request_time=req, exclude=ex())
    assert torch.equal(served.items, cached.items)


def test_int8_quantizes_the_ffn_linears() -> None:
    m = _model(4)
    names = list(quantizable_linears(m))
    assert names[:4] == ["layers.0.uvqk", "layers.0.o", "layers.0.ffn.gate_up", "layers.0.ffn.down"]
    ids, ts, lengths, _ = three_histories(T0)
    want = m.encode(ids, ts, lengths)
    q = quantize_model_int8(m, embeddings="fp32")
    assert all(isinstance(lin, Int8Linear) for lin in quantizable_linears(q).values())
    got = q.encode(ids, ts, lengths)
    assert (got - want).abs().max() < 0.05  # per-channel INT8 weights on unit-norm outputs
