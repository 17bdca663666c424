"""CUDA backend (NVIDIA GPUs) via torch.cuda."""

from __future__ import annotations

import torch

from hstu.backend.base import Backend, MemoryInfo


class CUDABackend(Backend):
    name = "cuda"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA wheel of torch"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False: no NVIDIA GPU or driver visible (check nvidia-smi)"
        return None

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self.index)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def supports_pinned_memory(self) -> bool:
        return True
