"""The backend contract shared by the CPU, CUDA and NPU classes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class BackendUnavailableError(RuntimeError):
    """A requested device cannot be used; the message names what is missing."""


@dataclass(frozen=True)
class MemoryInfo:
    """Device (or host, for CPU) memory in bytes."""

    free_bytes: int
    total_bytes: int

    @property
    def used_ratio(self) -> float:
        return 1.0 - self.free_bytes / self.total_bytes if self.total_bytes else 0.0


class Backend:
    """A device handle: name, ``torch.device``, memory info, synchronisation, cache release.

    Subclasses implement ``unavailable_reason`` (None when usable) and the memory calls.
    """

    name: str = "base"

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @classmethod
    def unavailable_reason(cls) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return torch.device(self.name, self.index)

    def memory_info(self) -> MemoryInfo:  # pragma: no cover - overridden
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def empty_cache(self) -> None:
        """Release cached allocator blocks (no-op on CPU)."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def supports_pinned_memory(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"
