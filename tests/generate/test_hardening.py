"""Inference hardening: eval, frozen parameters (asserted), every tensor on the device (a stray
one named), inference mode used by the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hstu.config import ModelConfig
from hstu.generate import hardening
from hstu.generate.engine import Engine
from hstu.generate.hardening import StrayTensorError, TrainableParameterError, check_device, check_frozen, check_inputs_on, harden
from hstu.model import build_hstu


def model():
    torch.manual_seed(0)
    return build_hstu(
        ModelConfig(num_items=50, max_seq_len=20, max_output_len=3, embedding_dim=8, num_blocks=1, num_heads=1, d_qk=4, d_v=4, dropout=0.1)
    )


def test_harden_freezes_and_evals():
    m = model().train()
    assert any(p.requires_grad for p in m.parameters())
    out = harden(m, "cpu")
    assert out is m and not m.training and not any(p.requires_grad for p in m.parameters())
    check_frozen(m)


def test_stray_parameter_and_buffer_named():
    m = model()
    m.register_buffer("calib", torch.zeros(3, device="meta"))
    with pytest.raises(StrayTensorError, match=r"1 tensor\(s\) not on cpu: calib on meta"):
        check_device(m, "cpu")
    m = model()
    m.layers[0].rel_bias.ts_w = nn.Parameter(torch.zeros(4, device="meta"))
    with pytest.raises(StrayTensorError, match=r"layers\.0\.rel_bias\.ts_w on meta"):
        harden(m, "cpu")


def test_trainable_parameter_named():
    m = model()
    with pytest.raises(TrainableParameterError, match="item_emb.weight"):
        check_frozen(m)


def test_inputs_on_device_named():
    check_inputs_on("cpu", ids=torch.zeros(2), none=None)
    with pytest.raises(StrayTensorError, match="timestamps on meta"):
        check_inputs_on("cpu", ids=torch.zeros(2), timestamps=torch.zeros(2, device="meta"))


def test_engine_hardens_at_load_and_runs_in_inference_mode(monkeypatch):
    m = model().train()
    eng = Engine(m, buckets=(20,), max_batch=2, k_max=3)
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    seen = []
    orig = Engine._decode

    def spy(self, *a, **kw):
        seen.append(torch.is_inference_mode_enabled())
        return orig(self, *a, **kw)

    monkeypatch.setattr(Engine, "_decode", spy)
    res = eng.generate(torch.tensor([[1, 2, 3]]), torch.tensor([[10, 20, 30]]), torch.tensor([3]), 2)
    assert seen == [True] and res.items.is_inference()
    with pytest.raises(StrayTensorError, match="ids on meta"):
        eng.generate(torch.zeros(1, 3, dtype=torch.int64, device="meta"), torch.tensor([[10, 20, 30]]), torch.tensor([3]), 2)
    assert hardening.inference is torch.inference_mode
