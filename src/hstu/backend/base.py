"""The backend contract shared by the CPU, CUDA and NPU classes.

A backend answers every question whose answer depends on the device kind, so that no code outside
``hstu.backend`` compares device names (vLLM's ``platforms/interface.py`` habit): memory
(``memory_info``, ``peak_memory_bytes``, ``is_host``), synchronisation, seeding, page-locked host
memory, graph capture (``graph_mode``, ``supports_graphs``, ``capture_graph``), distributed
training (``dist_backend``, ``torchrec_kernels``, ``ddp_device_ids``, ``set_current``), and the
default kernel choices (``default_kernels``, ``int8_gemms``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hstu.backend.graphs import GRAPH_MODES, compile_graph

log = logging.getLogger(__name__)

# graph mode -> the device kind that owns it (for the error message of a mode asked on another device)
_GRAPH_OWNERS = {"cuda_graph": "cuda", "npu_graph": "npu"}


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
    """A device handle: name, ``torch.device``, memory info, synchronisation, graphs, distributed names.

    Subclasses implement ``unavailable_reason`` (None when usable) and the memory calls, and set the
    class attributes below.

    Class attributes:
        name: device kind, also ``torch.device(name).type``.
        is_host: the compute device's memory is host memory (CPU): one budget for "device" and "host".
        dist_backend: the ``torch.distributed`` backend for this device (PyTorch docs, "Backends").
        torchrec_kernels: FBGEMM / TorchRec have embedding kernels here (else the table stays on the CPU).
        graph_mode: the engine graph mode that captures on this device ("cuda_graph", ...), or None.
        triton_kernels: Triton compiles kernels for this device (outside the CPU interpreter).
        default_kernels: the HSTU kernel set ``[model] attention = "auto"`` picks here where that set can
            run, else "reference" (``hstu.model.kernels.get_kernels``).
        int8_gemms: integer GEMMs ``hstu.quant`` tries for "auto", in order (empty: float fallback).
    """

    name: str = "base"
    is_host: bool = False
    dist_backend: str = "gloo"
    torchrec_kernels: bool = False
    graph_mode: str | None = None
    triton_kernels: bool = False
    default_kernels: str = "reference"
    int8_gemms: tuple[str, ...] = ()

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @classmethod
    def unavailable_reason(cls) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    @classmethod
    def current_index(cls) -> int:
        """Index of the current device of this kind (what ``torch.device(name)`` without an index means)."""
        return 0

    @property
    def device(self) -> torch.device:
        return torch.device(self.name, self.index)

    # ----- memory -----
    def memory_info(self) -> MemoryInfo:  # pragma: no cover - overridden
        raise NotImplementedError

    def peak_memory_bytes(self) -> int | None:
        """Peak bytes allocated by torch on this device since start (or the last reset); None on the host."""
        return None

    def reset_peak_memory(self) -> None:
        """Start :meth:`peak_memory_bytes` again from what is allocated now (no-op on the host)."""

    def device_name(self) -> str:
        """The hardware's name, e.g. "NVIDIA H100 80GB HBM3", "Ascend910B3" (the host: its CPU model)."""
        return str(self.device)

    def lowp_unavailable_reason(self, precision: str) -> str | None:
        """Why 16-bit float ("bf16" | "fp16") matrix products have no fast kernel here, or None."""
        return None

    def empty_cache(self) -> None:
        """Release cached allocator blocks (no-op on CPU)."""

    def supports_pinned_memory(self) -> bool:
        """True when host -> device copies can go through page-locked (pinned) host buffers."""
        return False

    def pin_in_place(self, tensor: torch.Tensor) -> bool:
        """Page-lock the CPU ``tensor``'s memory without copying it; True when it is now pinned.

        Only CUDA has an in-place call (``cudaHostRegister``); elsewhere the table stays pageable
        (transfers use pinned staging buffers) and this returns False. Undo with :meth:`unpin`.
        """
        if self.supports_pinned_memory():
            log.info("%s: no in-place page-locking; host table stays pageable (transfers use pinned staging)", self.device)
        return False

    @staticmethod
    def unpin(ptr: int) -> None:
        """Undo :meth:`pin_in_place` for the memory starting at ``ptr`` (no-op if it was not pinned)."""

    # ----- execution -----
    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_current(self) -> None:
        """Make this the current device of its kind (nccl / hccl bind to the current device)."""
        torch.accelerator.set_device_index(self.index)

    def ddp_device_ids(self) -> list[int] | None:
        """``device_ids`` for ``DistributedDataParallel``: None on the host, else ``[index]``."""
        return None if self.is_host else [self.index]

    # ----- graphs -----
    @property
    def supports_graphs(self) -> bool:
        """True when :meth:`capture_graph` works here."""
        return False

    def graphs_unavailable_reason(self) -> str:
        return f"no device graphs on {self.device}"

    def resolve_graph_mode(self, requested: str) -> str:
        """The engine graph mode for ``requested`` ("auto" | "eager" | "compiled" | "compile" | "cuda_graph" | "npu_graph").

        "auto" gives this device's ``graph_mode`` where it can capture, else "eager"; "compiled" gives
        that graph mode where it can capture, else "compile" (torch.compile: Inductor's C++ code on
        the CPU, or NPU without NPUGraph).

        Raises:
            ValueError: an unknown mode, or a device graph mode this device cannot capture (says why).
        """
        if requested not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {GRAPH_MODES}, got {requested!r}")
        if requested in ("auto", "compiled"):
            captures = self.graph_mode is not None and self.supports_graphs
            return self.graph_mode if captures else ("eager" if requested == "auto" else "compile")
        owner = _GRAPH_OWNERS.get(requested)
        if owner is None:
            return requested
        if requested != self.graph_mode:
            raise ValueError(f"graphs={requested!r} needs a {owner} device, got {self.device}")
        if not self.supports_graphs:
            raise ValueError(f"graphs={requested!r}: {self.graphs_unavailable_reason()}")
        return requested

    def compile_graph(self, fn: Callable[[], torch.Tensor], name: str, backend: str | Callable = "inductor") -> Callable[[], torch.Tensor]:
        """``fn`` compiled for this device (:func:`hstu.backend.graphs.compile_graph`: torch.compile,
        static shapes, one graph; Inductor generates C++ on the CPU and Triton on CUDA). Compiles on
        the first call; wrap it in :class:`hstu.backend.graphs.CompiledRunner` for the eager fallback."""
        return compile_graph(fn, name, backend)

    def capture_graph(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture ``fn`` (reads only static buffers, idempotent) into a device graph; the result replays it.

        Raises:
            BackendUnavailableError: this device has no graph capture (see :attr:`supports_graphs`).
        """
        raise BackendUnavailableError(self.graphs_unavailable_reason())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"
