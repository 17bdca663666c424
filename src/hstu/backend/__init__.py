"""Device backends: ``select("auto" | "cpu" | "cuda" | "npu")``.

One class per device (CPU, CUDA, Ascend NPU), each with classmethods for availability,
memory and synchronisation, after vLLM's ``platforms`` (one probe per platform that returns
a reason instead of raising). No ``if device == ...`` outside this package.
"""

from __future__ import annotations

import logging

from hstu.backend.base import Backend, BackendUnavailableError, MemoryInfo
from hstu.backend.cpu import CPUBackend
from hstu.backend.cuda import CUDABackend
from hstu.backend.npu import NPUBackend

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[Backend]] = {"cpu": CPUBackend, "cuda": CUDABackend, "npu": NPUBackend}
AUTO_ORDER = ("npu", "cuda", "cpu")
_cache: dict[str, Backend] = {}


def select(name: str = "auto") -> Backend:
    """Return the backend named ``name`` ("auto", "cpu", "cuda", "npu", or "cuda:1"-style).

    "auto" tries NPU, then CUDA, then CPU, logging why each one it skips is unavailable.
    The choice is cached per name.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
        BackendUnavailableError: a named device is not usable; the message says what is missing.
    """
    key = name.strip().lower()
    if key in _cache:
        return _cache[key]
    kind, _, index = key.partition(":")
    if kind == "auto":
        reasons = []
        for cand in AUTO_ORDER:
            why = BACKENDS[cand].unavailable_reason()
            if why is None:
                _cache[key] = BACKENDS[cand](0)
                log.info("backend auto -> %s", cand)
                return _cache[key]
            reasons.append(f"{cand}: {why}")
            log.debug("backend %s skipped: %s", cand, why)
        raise BackendUnavailableError("no backend available: " + "; ".join(reasons))
    if kind not in BACKENDS:
        raise ValueError(f"unknown device {name!r}; valid: auto, {', '.join(BACKENDS)} (optionally with :INDEX)")
    cls = BACKENDS[kind]
    why = cls.unavailable_reason()
    if why is not None:
        raise BackendUnavailableError(f"device {name!r} is not available: {why}")
    try:
        idx = int(index) if index else 0
    except ValueError as exc:
        raise ValueError(f"bad device index in {name!r}: expected an integer after ':'") from exc
    _cache[key] = cls(idx)
    return _cache[key]


__all__ = ["Backend", "BackendUnavailableError", "MemoryInfo", "select", "BACKENDS"]
