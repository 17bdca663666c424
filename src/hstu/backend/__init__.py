"""Device backends: ``select("auto" | "cpu" | "cuda" | "npu")``.

One class per device (CPU, CUDA, Ascend NPU), each with classmethods for availability,
memory, synchronisation, graph capture and distributed names, after vLLM's ``platforms`` (one
probe per platform that returns a reason instead of raising). No ``if device == ...`` outside this
package: code holding a tensor asks ``for_device(t.device)``, code holding a name asks ``select(name)``.
"""

from __future__ import annotations

import logging

import torch

from hstu.backend.base import Backend, BackendUnavailableError, MemoryInfo
from hstu.backend.cpu import CPUBackend
from hstu.backend.cuda import CUDABackend
from hstu.backend.graphs import GRAPH_MODES, GraphRunner
from hstu.backend.npu import NPUBackend

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[Backend]] = {"cpu": CPUBackend, "cuda": CUDABackend, "npu": NPUBackend}
AUTO_ORDER = ("npu", "cuda", "cpu")
_cache: dict[str, Backend] = {}
_by_device: dict[tuple[str, int], Backend] = {}


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


def for_device(device: torch.device | str | Backend) -> Backend:
    """The backend of a device a tensor or module is already on, e.g. ``for_device(x.device).synchronize()``.

    A device without an index ("cuda") means the current device of its kind. No availability probe
    (the device is in use); the instance is cached per (kind, index). A Backend is returned as is.

    Raises:
        ValueError: a device kind with no backend (e.g. "meta"); the message lists the valid ones.
    """
    if isinstance(device, Backend):
        return device
    if isinstance(device, str):  # parsed here: torch.device("npu") needs torch_npu imported
        kind, _, idx = device.strip().lower().partition(":")
        if idx and not idx.isdigit():
            raise ValueError(f"bad device index in {device!r}: expected an integer after ':'")
        index = int(idx) if idx else None
    else:
        kind, index = device.type, device.index
    cls = BACKENDS.get(kind)
    if cls is None:
        raise ValueError(f"no backend for device {str(device)!r}; valid kinds: {', '.join(BACKENDS)}")
    key = (kind, cls.current_index() if index is None else int(index))
    if key not in _by_device:
        _by_device[key] = cls(key[1])
    return _by_device[key]


def select_local(name: str, local_rank: int) -> Backend:
    """The backend of one torchrun rank: device ``local_rank`` of the kind ``name`` names ("auto"
    resolved first; an index in ``name`` is replaced). The host is one device shared by all ranks.

    Raises:
        ValueError / BackendUnavailableError: as :func:`select`.
    """
    key = name.strip().lower()
    kind = select(key).name if key == "auto" else key.partition(":")[0]
    cls = BACKENDS.get(kind)
    return select(kind if cls is None or cls.is_host else f"{kind}:{int(local_rank)}")


__all__ = [
    "Backend",
    "BackendUnavailableError",
    "MemoryInfo",
    "select",
    "select_local",
    "for_device",
    "BACKENDS",
    "GRAPH_MODES",
    "GraphRunner",
]
