"""Backend selection and the platform methods (CPU here; CUDA / NPU tests skip without the device)."""

from __future__ import annotations

import pytest
import torch

from hstu import backend
from hstu.backend import GRAPH_MODES, BackendUnavailableError, GraphRunner, for_device, select_local
from hstu.backend.cpu import CPUBackend
from hstu.backend.cuda import CUDABackend
from hstu.backend.npu import NPUBackend


def test_cpu_and_auto():
    b = backend.select("cpu")
    assert b.device == torch.device("cpu")
    mem = b.memory_info()
    assert 0 < mem.free_bytes <= mem.total_bytes
    b.synchronize()
    b.empty_cache()
    if not torch.cuda.is_available():
        assert backend.select("auto").name in ("cpu", "npu")


def test_unknown_device_lists_valid_names():
    with pytest.raises(ValueError, match="valid: auto, cpu, cuda, npu"):
        backend.select("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_missing_cuda_names_the_cause():
    with pytest.raises(BackendUnavailableError, match="cuda"):
        backend.select("cuda")


def test_npu_probe_never_raises():
    why = NPUBackend.unavailable_reason()
    assert why is None or "torch_npu" in why
    if why is not None:
        with pytest.raises(BackendUnavailableError, match="torch_npu"):
            backend.select("npu")


# ----- platform methods: every device decision is a Backend attribute or method -----

needs_cuda = pytest.mark.skipif(CUDABackend.unavailable_reason() is not None, reason="no CUDA device")
needs_npu = pytest.mark.skipif(NPUBackend.unavailable_reason() is not None, reason="no Ascend NPU with torch_npu")


def test_cpu_platform_answers():
    b = backend.select("cpu")
    assert b.is_host and b.dist_backend == "gloo" and b.torchrec_kernels
    assert b.ddp_device_ids() is None and b.peak_memory_bytes() is None
    assert b.int8_gemms == ("onednn", "fbgemm", "qnnpack") and b.default_kernels == "reference"
    b.set_current()  # no current device on the host: a no-op
    assert not b.supports_graphs and b.graph_mode is None
    assert not b.pin_in_place(torch.ones(4))  # no page-locking on the host
    with pytest.raises(BackendUnavailableError, match="no device graphs on cpu"):
        b.capture_graph(lambda: torch.zeros(1))


def test_accelerator_class_attributes_need_no_device():
    # the names every caller used to spell out by device type (PyTorch docs, "Backends")
    assert {n: c.dist_backend for n, c in backend.BACKENDS.items()} == {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
    assert [n for n, c in backend.BACKENDS.items() if c.torchrec_kernels] == ["cpu", "cuda"]
    assert {n: c.graph_mode for n, c in backend.BACKENDS.items()} == {"cpu": None, "cuda": "cuda_graph", "npu": "npu_graph"}
    assert {n: c.default_kernels for n, c in backend.BACKENDS.items()} == {"cpu": "reference", "cuda": "triton", "npu": "npu"}
    assert CUDABackend.int8_gemms == ("int_mm",) and NPUBackend.int8_gemms == ()
    assert [n for n, c in backend.BACKENDS.items() if c.is_host] == ["cpu"]
    assert [n for n, c in backend.BACKENDS.items() if c.triton_kernels] == ["cuda"]


def test_resolve_graph_mode_on_cpu():
    b = backend.select("cpu")
    assert GRAPH_MODES == ("auto", "eager", "compiled", "compile", "cuda_graph", "npu_graph")
    assert [b.resolve_graph_mode(m) for m in ("auto", "eager", "compiled", "compile")] == ["eager", "eager", "compile", "compile"]
    with pytest.raises(ValueError, match="graphs must be one of"):
        b.resolve_graph_mode("turbo")
    with pytest.raises(ValueError, match="needs a cuda device, got cpu"):
        b.resolve_graph_mode("cuda_graph")
    with pytest.raises(ValueError, match="needs a npu device, got cpu"):
        b.resolve_graph_mode("npu_graph")


@pytest.mark.skipif(hasattr(getattr(torch, "npu", None), "NPUGraph"), reason="torch_npu with NPUGraph is installed")
def test_npu_without_graphs_falls_back_to_eager():
    b = NPUBackend(0)  # no device needed for the decision itself
    assert not b.supports_graphs and b.resolve_graph_mode("auto") == "eager"
    with pytest.raises(ValueError, match="NPUGraph"):
        b.resolve_graph_mode("npu_graph")
    with pytest.raises(BackendUnavailableError, match="NPUGraph"):
        b.capture_graph(lambda: torch.zeros(1))


def test_for_device_maps_a_tensor_device_to_its_backend():
    x = torch.zeros(2)
    b = for_device(x.device)
    assert isinstance(b, CPUBackend) and b is for_device("cpu") and for_device(b) is b
    g = for_device("cuda:1")  # no probe: the kind's answers hold without the device
    assert isinstance(g, CUDABackend) and g.device == torch.device("cuda", 1)
    assert g.ddp_device_ids() == [1] and g.dist_backend == "nccl" and not g.is_host
    assert isinstance(for_device("npu:2"), NPUBackend) and for_device("npu:2").index == 2  # a string: no torch_npu needed
    with pytest.raises(ValueError, match="valid kinds: cpu, cuda, npu"):
        for_device("meta")


def test_select_local_gives_one_host_for_every_rank():
    assert select_local("cpu", 3) is backend.select("cpu") and select_local("CPU:7", 1).device == torch.device("cpu")
    if CUDABackend.unavailable_reason() is not None and NPUBackend.unavailable_reason() is not None:
        assert select_local("auto", 5).is_host
        with pytest.raises(BackendUnavailableError, match="cuda"):
            select_local("cuda", 1)
    with pytest.raises(ValueError, match="valid: auto, cpu, cuda, npu"):
        select_local("tpu", 0)


def test_graph_runner_warms_up_twice_then_replays():
    """The capture protocol on a stand-in device API (streams, graph context, replay) without a GPU."""
    calls: list[str] = []

    class FakeStream:
        def wait_stream(self, other):
            calls.append("wait")

    class Graph:
        def replay(self):
            calls.append("replay")

    class Api:
        Stream = FakeStream
        _current = FakeStream()

        @staticmethod
        def current_stream():
            return Api._current

        @staticmethod
        def stream(s):
            import contextlib

            calls.append("side")
            return contextlib.nullcontext()

        @staticmethod
        def graph(g):
            import contextlib

            calls.append("capture")
            return contextlib.nullcontext()

    out = torch.zeros(1)

    def fn():
        calls.append("fn")
        return out.add_(1)

    r = GraphRunner(fn, Api, Graph)
    assert calls == ["wait", "side", "fn", "fn", "wait", "capture", "fn"]
    assert r() is out and float(out) == 3.0 and calls[-1] == "replay"


def test_kernel_and_int8_defaults_come_from_the_backend():
    from hstu.model.kernels import default_kernels
    from hstu.quant import select_int8_kernel

    assert [default_kernels(n) for n in ("cpu", "cuda", "npu")] == ["reference", "triton", "npu"]
    with pytest.raises(ValueError, match="unknown backend"):
        default_kernels("tpu")
    assert select_int8_kernel("cpu").name in (*CPUBackend.int8_gemms, "dequant")
    if hasattr(torch, "_int_mm"):  # CUDABackend.int8_gemms, decided without a GPU
        assert select_int8_kernel("cuda").name == "int_mm"


@needs_cuda
def test_cuda_platform_methods():
    b = backend.select("cuda")
    b.set_current()
    assert b.resolve_graph_mode("auto") == "cuda_graph" and b.supports_graphs
    x = torch.ones(8, device=b.device)
    out = torch.zeros(8, device=b.device)
    replay = b.capture_graph(lambda: torch.mul(x, 2, out=out))
    x.fill_(3.0)
    replay()
    b.synchronize()
    assert out.tolist() == [6.0] * 8
    assert b.peak_memory_bytes() >= 2 * 8 * 4
    info = b.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    host = torch.zeros(1024)
    assert b.pin_in_place(host) and host.is_pinned()
    b.unpin(host.data_ptr())
    assert not host.is_pinned()


@needs_npu
def test_npu_platform_methods():
    b = backend.select("npu")
    b.set_current()
    assert b.dist_backend == "hccl" and b.ddp_device_ids() == [b.index]
    info = b.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    torch.ones(8, device=b.device).sum()
    b.synchronize()
    assert b.peak_memory_bytes() >= 8 * 4
