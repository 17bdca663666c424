"""Device paths of the engine (CUDA graphs, Triton kernels, NPU graph mode) against the eager CPU
reference. They skip with a reason where no device is present (the CPU CI has none)."""

from __future__ import annotations

import pytest
import torch

from hstu.backend import select
from hstu.backend.base import BackendUnavailableError
from hstu.config import ModelConfig
from hstu.generate.decode import exclusion_mask, generate
from hstu.generate.engine import Engine
from hstu.model import build_hstu


def device_or_skip(name: str) -> torch.device:
    try:
        return select(name).device
    except BackendUnavailableError as exc:
        pytest.skip(f"no {name} device: {exc}")


def case():
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=300, max_seq_len=60, max_output_len=6, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0
    )
    m = build_hstu(cfg).eval()
    g = torch.Generator().manual_seed(1)
    L = torch.tensor([1, 7, 20, 21, 60])
    ids = torch.randint(1, 301, (5, 60), generator=g) * (torch.arange(60).view(1, -1) < L.view(-1, 1))
    ts = torch.sort(torch.randint(10**8, 10**8 + 10**7, (5, 60), generator=g), dim=1).values
    rt = ts.max(dim=1).values + 60
    ref = generate(m, ids, ts, L, 5, request_time=rt, exclude=exclusion_mask(300, 5, None, None))
    return m, (ids, ts, L, rt), ref


def run_on(dev: torch.device, graphs: str, kernels: str = "auto"):
    m, (ids, ts, L, rt), ref = case()
    eng = Engine(m, buckets=(20, 40, 60), max_batch=4, k_max=6, device=dev, graphs=graphs, kernels=kernels)
    eng.warmup()
    for strategy in ("greedy", "beam"):
        got = eng.generate(ids.to(dev), ts.to(dev), L.to(dev), 5, request_time=rt.to(dev), strategy=strategy, beam_width=2)
        want = (
            ref
            if strategy == "greedy"
            else generate(
                m.cpu(), ids, ts, L, 5, request_time=rt, strategy="beam", beam_width=2, exclude=exclusion_mask(300, 5, None, None)
            )
        )
        m.to(dev)
        assert torch.equal(got.items.cpu(), want.items)
        torch.testing.assert_close(got.scores.cpu(), want.scores, rtol=1e-4, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", ["eager", "cuda_graph"])
def test_cuda_engine_matches_cpu_reference(graphs):
    run_on(device_or_skip("cuda"), graphs)


@pytest.mark.cuda
def test_cuda_engine_with_triton_kernels():
    pytest.importorskip("triton")
    run_on(device_or_skip("cuda"), "cuda_graph", kernels="triton")


@pytest.mark.npu
def test_npu_engine_matches_cpu_reference():
    dev = device_or_skip("npu")
    run_on(dev, "auto")
