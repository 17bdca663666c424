"""Ascend NPU backend via the optional ``torch_npu`` package.

``torch_npu`` without CANN breaks ``import torch`` when autoloaded, so the probe sets
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (unless the user set it) and catches ImportError and
RuntimeError (and OSError for missing shared libraries), returning the reason instead.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from hstu.backend.base import Backend, MemoryInfo
from hstu.backend.graphs import GraphRunner

_probe: tuple[object | None, str | None] | None = None


def probe_torch_npu() -> tuple[object | None, str | None]:
    """Import torch_npu once; return (module, None) or (None, reason). Never raises."""
    global _probe
    if _probe is not None:
        return _probe
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    if importlib.util.find_spec("torch_npu") is None:
        _probe = (None, "torch_npu is not installed (pip install torch-npu matching your torch and CANN)")
        return _probe
    try:
        import torch_npu  # noqa: F401

        if not torch.npu.is_available():  # type: ignore[attr-defined]
            _probe = (None, "torch_npu imported but torch.npu.is_available() is False (check npu-smi info, CANN env: source set_env.sh)")
        else:
            _probe = (torch_npu, None)
    except (ImportError, RuntimeError, OSError) as exc:
        _probe = (None, f"import torch_npu failed: {type(exc).__name__}: {exc}")
    return _probe


class NPUBackend(Backend):
    """An Ascend NPU: hccl, NPU graphs where torch_npu has them, the "npu" kernel set; TorchRec's
    kernels do not exist here (the item table stays on the CPU) and there is no integer GEMM."""

    name = "npu"
    dist_backend = "hccl"  # comes with torch_npu
    graph_mode = "npu_graph"
    default_kernels = "npu"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return probe_torch_npu()[1]

    @classmethod
    def current_index(cls) -> int:
        npu = getattr(torch, "npu", None)
        return int(npu.current_device()) if npu is not None and npu.is_available() else 0

    def memory_info(self) -> MemoryInfo:
        free, total = torch.npu.mem_get_info(self.index)  # type: ignore[attr-defined]
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def peak_memory_bytes(self) -> int | None:
        return int(torch.npu.max_memory_allocated(self.index))  # type: ignore[attr-defined]

    def reset_peak_memory(self) -> None:
        torch.npu.reset_peak_memory_stats(self.index)  # type: ignore[attr-defined]

    def device_name(self) -> str:
        return torch.npu.get_device_name(self.index)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        torch.npu.synchronize(self.index)  # type: ignore[attr-defined]

    def empty_cache(self) -> None:
        torch.npu.empty_cache()  # type: ignore[attr-defined]

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.npu.manual_seed_all(seed)  # type: ignore[attr-defined]

    def supports_pinned_memory(self) -> bool:
        return True

    @property
    def supports_graphs(self) -> bool:
        return hasattr(getattr(torch, "npu", None), "NPUGraph")

    def graphs_unavailable_reason(self) -> str:
        return "needs torch_npu with torch.npu.NPUGraph (torch_npu >= 2.5)"

    def capture_graph(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if not self.supports_graphs:
            return super().capture_graph(fn)
        return GraphRunner(fn, torch.npu, torch.npu.NPUGraph)  # type: ignore[attr-defined]
