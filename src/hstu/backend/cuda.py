"""CUDA backend (NVIDIA GPUs) via torch.cuda: memory, graphs (CUDAGraph), page-locking in place."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from hstu.backend.base import Backend, MemoryInfo
from hstu.backend.graphs import GraphRunner
from hstu.backend.memory_guard import format_bytes

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Page-locking a host tensor in place
# ---------------------------------------------------------------------------------------------
# ``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds
# every allocation up to the next power of two (ATen/core/CachingHostAllocator.h: ``roundSize =
# PowerOf2Ceil(size)``): a 2.1 GiB embedding shard would pin 4 GiB. Large host tables are therefore
# allocated as ordinary CPU tensors and page-locked where they lie (CUDA Runtime API, "Memory
# Management": cudaHostRegister / cudaHostUnregister).
_REGISTERED: set[int] = set()
_REG_LOCK = threading.Lock()


class CUDABackend(Backend):
    """An NVIDIA GPU: nccl, CUDA graphs, cuBLASLt ``torch._int_mm``, TorchRec's FBGEMM kernels."""

    name = "cuda"
    dist_backend = "nccl"
    torchrec_kernels = True
    graph_mode = "cuda_graph"
    triton_kernels = True
    default_kernels = "triton"  # "auto": the Triton attention where triton imports (else "reference"); unverified on a GPU
    int8_gemms = ("int_mm",)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA wheel of torch"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False: no NVIDIA GPU or driver visible (check nvidia-smi)"
        return None

    @classmethod
    def current_index(cls) -> int:
        return int(torch.cuda.current_device()) if torch.cuda.is_available() else 0

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self.index)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.index))

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.index)

    def lowp_unavailable_reason(self, precision: str) -> str | None:
        ok = precision != "bf16" or torch.cuda.is_bf16_supported(including_emulation=False)
        return None if ok else f"{self.device_name()} has no native bf16 (compute capability < 8.0)"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def supports_pinned_memory(self) -> bool:
        return True

    def pin_in_place(self, tensor: torch.Tensor) -> bool:
        """Page-lock the CPU ``tensor`` with ``cudaHostRegister``; False (logged) on failure or for a
        non-CPU / empty tensor."""
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            log.warning("cudaHostRegister of %s failed (cudaError %d); host table stays pageable", format_bytes(nbytes), code)
            return False
        with _REG_LOCK:
            _REGISTERED.add(ptr)
        return True

    @staticmethod
    def unpin(ptr: int) -> None:
        with _REG_LOCK:
            if ptr not in _REGISTERED:
                return
            _REGISTERED.discard(ptr)
        torch.cuda.cudart().cudaHostUnregister(ptr)

    @property
    def supports_graphs(self) -> bool:
        return True

    def capture_graph(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return GraphRunner(fn, torch.cuda, torch.cuda.CUDAGraph)
