"""Full-catalogue similarity by table storage (hstu.model.item_index), against float64 cosines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hstu.config import ModelConfig
from hstu.model.hstu import build_hstu
from hstu.model.item_index import FloatIndex, HalfIndex, Int8Index, build_item_index
from hstu.quant import apply_precision, quantize_per_channel, select_int8_kernel


def _rows(V=30, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(V, d, generator=g)
    rows[0] = 0  # padding row
    return rows


def _users(B=5, d=16, seed=1):
    return F.normalize(torch.randn(B, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def _cos64(u, rows):
    return u.double() @ F.normalize(rows.double(), dim=1).T


def test_float_index_is_the_cosine():
    rows, u = _rows(), _users()
    got = FloatIndex(F.normalize(rows, dim=1)).cosine(u)
    assert torch.allclose(got.double(), _cos64(u, rows), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_index_blocks_write_into_a_slice_of_a_larger_buffer(dtype):
    rows, u = _rows().to(dtype), _users()
    big = torch.full((u.shape[0] + 2, rows.shape[0]), 7.0)
    view = big[1:-1]
    out = HalfIndex(rows, block=7).cosine(u, out=view)  # 30 rows in blocks of 7: the last block is short
    assert out.data_ptr() == view.data_ptr()
    assert torch.allclose(out.double(), _cos64(u, rows), atol=1e-6)  # float32 math on the stored 16-bit rows
    assert (big[0] == 7).all() and (big[-1] == 7).all()  # rows outside the slice untouched


@pytest.mark.skipif(select_int8_kernel("cpu").name not in ("onednn", "fbgemm", "qnnpack"), reason="no integer kernel on this CPU")
def test_int8_index_is_the_normalised_int8_table_within_activation_rounding():
    rows, u = _rows(), _users()
    q, _ = quantize_per_channel(rows)
    kern = select_int8_kernel("cpu").name
    got = Int8Index(q, kern).cosine(u).double()
    ref = _cos64(u, q.to(torch.float32))  # Q[r] / ||Q[r]|| exactly: the per-row scale cancels
    # the user vectors are quantized per call over [min(u, 0), max(u, 0)] in 127 steps (7 bits on x86):
    # each element moves by at most half a step, so each cosine by half a step times ||row||_1
    levels = 127 if kern in ("fbgemm", "onednn") else 255
    step = (u.max().clamp(min=0) - u.min().clamp(max=0)).double() / levels
    bound = step / 2 * F.normalize(q.double(), dim=1).abs().sum(1)  # (V,)
    assert ((got - ref).abs() <= bound * 1.01 + 1e-6).all()
    assert (got[:, 0] == 0).all()  # the padding row
    assert (got - ref).abs().max() > 0  # really the integer path, not a float copy


def _model():
    cfg = ModelConfig(
        num_items=40, max_seq_len=12, max_output_len=3, embedding_dim=16, num_blocks=1, num_heads=2, d_qk=8, d_v=8, dropout=0.0
    )
    torch.manual_seed(0)
    return build_hstu(cfg).eval()


def test_build_item_index_follows_the_table_storage():
    assert isinstance(build_item_index(_model()), FloatIndex)
    m16 = apply_precision(_model(), "int8")  # the INT8 scheme's default: fp16 item table
    assert m16.item_emb.weight.dtype == torch.float16 and isinstance(build_item_index(m16), HalfIndex)
    m8 = apply_precision(_model(), "int8", embeddings="int8")
    expect = Int8Index if select_int8_kernel("cpu").name in ("onednn", "fbgemm", "qnnpack") else FloatIndex
    assert isinstance(build_item_index(m8), expect)


def test_score_all_of_an_fp16_table_equals_float_scoring_of_the_same_rows():
    m = apply_precision(_model(), "int8")
    u = _users(B=3)
    got = m.score_all(u)
    ref = _cos64(u, m.item_emb.weight.to(torch.float32)) / m.cfg.temperature
    assert torch.isinf(got[:, 0]).all()
    assert torch.allclose(got[:, 1:].double(), ref[:, 1:], atol=1e-4)
