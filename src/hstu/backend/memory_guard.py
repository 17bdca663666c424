"""Memory guard: check free device (or host) memory before a forward and act when it is low.

Shared by training, evaluation and serving. Before a forward, :meth:`MemoryGuard.check` asks
the backend for free memory (``Backend.memory_info()``: ``torch.cuda.mem_get_info`` on CUDA,
``torch.npu.mem_get_info`` on Ascend, available host memory on CPU). Below the threshold it logs
a warning and runs the configured action:

- ``"empty_cache"`` (default): ``gc.collect()`` then ``Backend.empty_cache()`` (releases cached
  allocator blocks; see the PyTorch docs "CUDA semantics / memory management"), then re-reads
  free memory and reports whether that was enough;
- ``"raise"``: raise :class:`MemoryPressureError` before the forward allocates anything;
- ``"log"``: only log;
- a callable ``action(info: MemoryInfo, guard: MemoryGuard) -> None`` of your own.

Thresholds: ``min_free_bytes`` (absolute, bytes; strings such as ``"2GiB"`` accepted) and/or
``min_free_ratio`` (fraction of total, 0..1). Free memory below either one triggers the action.
"""

from __future__ import annotations

import gc
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hstu.backend.base import Backend, MemoryInfo

log = logging.getLogger(__name__)

ACTIONS = ("empty_cache", "raise", "log")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, field: str = "size") -> int:
    """Parse a byte count: an int, or a string such as ``"32GiB"``, ``"1.5 GB"``, ``"512MiB"``, ``"4096"``.

    Decimal units (kB, MB, GB, TB = powers of 1000) and binary units (KiB, MiB, GiB, TiB = powers
    of 1024), case-insensitive (IEC 80000-13). Returns bytes (int, >= 0).

    Raises:
        ValueError: negative, not a number, or an unknown unit; the message names ``field`` and the value.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{field}: must be >= 0 bytes, got {value!r}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if m is None:
        raise ValueError(f"{field}: cannot parse {value!r} as a size (examples: 4096, 512MiB, 32GiB, 1.5GB)")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"{field}: unknown unit {m.group(2)!r} in {value!r}; use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB")
    return int(number * _UNITS[unit])


def format_bytes(n: int | float) -> str:
    """``n`` bytes as a short binary-unit string, e.g. ``2.86 GiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class MemoryPressureError(RuntimeError):
    """Free memory is below the guard's threshold and the action is ``"raise"``."""


@dataclass(frozen=True)
class GuardResult:
    """Outcome of one :meth:`MemoryGuard.check`.

    ``free_before``/``free_after`` in bytes (equal when nothing ran); ``triggered`` when free
    memory was below the threshold; ``recovered`` when, after the action, it no longer is.
    """

    free_before: int
    free_after: int
    total: int
    threshold: int
    triggered: bool
    recovered: bool
    action: str


class MemoryGuard:
    """Check free memory on ``backend`` and act below a threshold; see the module docstring.

    Args:
        backend: a :class:`hstu.backend.Backend` (``hstu.backend.select(...)``).
        min_free_bytes: absolute threshold in bytes (int or size string); ``None`` to use only the ratio.
        min_free_ratio: threshold as a fraction of total memory in [0, 1]; ``None`` to use only bytes.
            With both given, the larger threshold applies. Default: 5 % of total.
        action: ``"empty_cache"``, ``"raise"``, ``"log"`` or a callable ``(MemoryInfo, MemoryGuard) -> None``.
        every: check only every ``every``-th call of :meth:`check` (>= 1), to keep the query off the hot path.

    Raises:
        ValueError: a threshold out of range, ``every < 1``, or an unknown action (the message lists valid ones).

    Thread-safe: counters are updated under a lock (the serving batcher may call from several threads).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        min_free_bytes: int | str | None = None,
        min_free_ratio: float | None = 0.05,
        action: str | Callable[[MemoryInfo, MemoryGuard], None] = "empty_cache",
        every: int = 1,
    ) -> None:
        if min_free_bytes is None and min_free_ratio is None:
            raise ValueError("MemoryGuard: give min_free_bytes, min_free_ratio or both")
        self.min_free_bytes = None if min_free_bytes is None else parse_bytes(min_free_bytes, field="min_free_bytes")
        if min_free_ratio is not None and not 0.0 <= float(min_free_ratio) <= 1.0:
            raise ValueError(f"MemoryGuard: min_free_ratio must be in [0, 1], got {min_free_ratio!r}")
        self.min_free_ratio = None if min_free_ratio is None else float(min_free_ratio)
        if not callable(action) and action not in ACTIONS:
            raise ValueError(f"MemoryGuard: unknown action {action!r}; valid: {', '.join(ACTIONS)} or a callable")
        if int(every) < 1:
            raise ValueError(f"MemoryGuard: every must be >= 1, got {every!r}")
        self.backend = backend
        self.action = action
        self.every = int(every)
        self._lock = threading.Lock()
        self._calls = 0
        self.checks = 0
        self.triggers = 0
        self.last: GuardResult | None = None

    def threshold_bytes(self, total: int) -> int:
        """The threshold in bytes for a device with ``total`` bytes: max of the absolute and ratio thresholds."""
        parts = []
        if self.min_free_bytes is not None:
            parts.append(self.min_free_bytes)
        if self.min_free_ratio is not None:
            parts.append(int(self.min_free_ratio * total))
        return max(parts)

    def check(self) -> GuardResult | None:
        """Query free memory; below the threshold, log and run the action.

        Returns the :class:`GuardResult`, or None when skipped by ``every``.

        Raises:
            MemoryPressureError: below the threshold with ``action="raise"``.
        """
        with self._lock:
            self._calls += 1
            if (self._calls - 1) % self.every:
                return None
            self.checks += 1
        info = self.backend.memory_info()
        threshold = self.threshold_bytes(info.total_bytes)
        if info.free_bytes >= threshold:
            result = GuardResult(info.free_bytes, info.free_bytes, info.total_bytes, threshold, False, True, "none")
            self.last = result
            return result
        with self._lock:
            self.triggers += 1
        name = self.action if isinstance(self.action, str) else getattr(self.action, "__name__", "callable")
        log.warning(
            "memory guard on %s: %s free of %s, below threshold %s; action: %s",
            self.backend.device,
            format_bytes(info.free_bytes),
            format_bytes(info.total_bytes),
            format_bytes(threshold),
            name,
        )
        if self.action == "raise":
            self.last = GuardResult(info.free_bytes, info.free_bytes, info.total_bytes, threshold, True, False, "raise")
            raise MemoryPressureError(
                f"free memory on {self.backend.device} is {format_bytes(info.free_bytes)}, below the guard "
                f"threshold {format_bytes(threshold)} (total {format_bytes(info.total_bytes)}); "
                "reduce batch size or table placement on the device, or lower min_free_bytes/min_free_ratio"
            )
        if self.action == "empty_cache":
            gc.collect()
            self.backend.empty_cache()
        elif callable(self.action):
            self.action(info, self)
        after = self.backend.memory_info() if self.action != "log" else info
        recovered = after.free_bytes >= threshold
        if self.action != "log":
            log.log(
                logging.INFO if recovered else logging.WARNING,
                "memory guard on %s: after %s, %s free (%s)",
                self.backend.device,
                name,
                format_bytes(after.free_bytes),
                "above threshold" if recovered else "still below threshold",
            )
        result = GuardResult(info.free_bytes, after.free_bytes, info.total_bytes, threshold, True, recovered, name)
        self.last = result
        return result

    def attach(self, module: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Run :meth:`check` before every ``module`` forward (a forward pre-hook); returns the hook handle."""

        def _hook(_mod: torch.nn.Module, _args: Any) -> None:
            self.check()

        return module.register_forward_pre_hook(_hook)

    def stats(self) -> dict[str, int]:
        """Counters: ``checks`` (memory queries made), ``triggers`` (times below threshold)."""
        return {"checks": self.checks, "triggers": self.triggers}


def pin_in_place(tensor: torch.Tensor, backend: Backend) -> bool:
    """Page-lock the CPU ``tensor``'s memory without copying it: ``backend.pin_in_place(tensor)``
    (kept for callers of the old name)."""
    return backend.pin_in_place(tensor)


def unpin(ptr: int) -> None:
    """Undo :func:`pin_in_place` for the memory starting at ``ptr`` (no-op if it was not pinned)."""
    from hstu.backend.cuda import CUDABackend  # the only backend that pins in place

    CUDABackend.unpin(ptr)


__all__ = [
    "MemoryGuard",
    "MemoryPressureError",
    "GuardResult",
    "parse_bytes",
    "format_bytes",
    "ACTIONS",
    "pin_in_place",
    "unpin",
]
