"""Kernel registry per backend for HSTU attention and the fused pieces of a layer.

A :class:`KernelSet` bundles the pieces every HSTULayer.forward calls, through
:func:`hstu.model.meta.hstu_attention` for the attention (see ``kernels/reference.py`` for their
contracts; the set travels in the batch's AttentionMeta): ``uvqk`` (LN + projection + SiLU + split),
``time_buckets`` (log time buckets), ``attention`` (HSTU attention with the relative bias
formed inside) and ``ln_mul`` (U ⊙ LN(A·V)). Sets are registered per backend by name, after
vLLM's attention-backend registry (unknown names raise ValueError listing the valid ones):

    backend  name        status
    cpu      reference   PyTorch reference: the oracle and the fallback everywhere
    cpu      triton      the Triton kernels under the Triton CPU interpreter (TRITON_INTERPRET=1) only
    cuda     reference   same
    cuda     triton      Triton attention, forward and backward (triton_hstu.py); unverified on a
                         GPU until tests/model/test_kernels.py runs on one (VERIFIED_ON)
    npu      reference   same as cpu (float64 time buckets: may fall back to the host)
    npu      npu         float32-exact time buckets, ops with torch_npu kernels only (npu.py)

The name comes from ``[model] attention`` (:class:`hstu.config.ModelConfig`), resolved by
:func:`get_kernels` for the backend of the device the model runs on (``HSTUModel.kernels``), the
same for training, evaluation, generation and serving. "auto" is the backend's
``Backend.default_kernels`` ("triton" on CUDA, "npu" on NPU, "reference" on the CPU,
:mod:`hstu.backend`) where that set can run, else "reference", with the reason logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from hstu.backend import BACKENDS, BackendUnavailableError
from hstu.model.kernels import npu as _npu
from hstu.model.kernels import reference as _ref
from hstu.model.kernels import triton_hstu as _triton

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelSet:
    """One backend's implementation of the fused pieces (contracts in kernels/reference.py).

    ``verified``: checked against the reference on the target device; ``note``: why not, or
    what it needs. ``available``: (backend name) -> None, or the reason the set cannot run there.
    """

    name: str
    uvqk: Callable
    time_buckets: Callable
    attention: Callable
    ln_mul: Callable
    verified: bool = True
    note: str = ""
    # optional: attention with a bias formed once per decode loop (reference.decode_bias /
    # attention_bias); None = the engine forms the bias inside ``attention`` every step
    decode_bias: Callable | None = None
    attention_bias: Callable | None = None
    available: Callable[[str], str | None] = lambda backend: None
    # whether ``attention`` takes ``segments`` (packed training rows, TrainConfig.packing)
    segments: bool = False


_KERNELS: dict[str, dict[str, KernelSet]] = {name: {} for name in BACKENDS}


def register_kernels(backend: str, kset: KernelSet) -> None:
    """Register ``kset`` for ``backend`` ("cpu" | "cuda" | "npu"); a duplicate name raises ValueError."""
    if backend not in _KERNELS:
        raise ValueError(f"unknown backend {backend!r}; valid: {sorted(_KERNELS)}")
    if kset.name in _KERNELS[backend]:
        raise ValueError(f"kernel set {kset.name!r} is already registered for backend {backend!r}")
    _KERNELS[backend][kset.name] = kset


_AUTO_LOGGED: set[tuple[str, str]] = set()


def get_kernels(backend: str, name: str = "auto", *, field: str = "kernels") -> KernelSet:
    """The set ``name`` for ``backend``; "auto" = :func:`default_kernels` where its ``available``
    says it can run, else "reference" (the reason logged once per backend and set).

    ``field`` names the setting in the errors ("[model] attention" for the model's).

    Raises:
        ValueError: unknown backend, or no set ``name`` for it (lists the valid names).
        BackendUnavailableError (a RuntimeError; the CLI prints it as one line): a set named explicitly
            that cannot run here, with the reason.
    """
    if backend not in _KERNELS:
        raise ValueError(f"unknown backend {backend!r}; valid: {sorted(_KERNELS)}")
    if name == "auto":
        kset = _KERNELS[backend][default_kernels(backend)]
        why = kset.available(backend)
        if why is None:
            return kset
        if (backend, kset.name) not in _AUTO_LOGGED:
            _AUTO_LOGGED.add((backend, kset.name))
            log.warning("%s = 'auto' on %s: kernel set %r cannot run (%s); using 'reference'", field, backend, kset.name, why)
        return _KERNELS[backend]["reference"]
    if name not in _KERNELS[backend]:
        valid = ["auto", *sorted(_KERNELS[backend])]
        raise ValueError(f"{field} = {name!r}: no such kernel set for backend {backend!r}; valid: {valid}")
    kset = _KERNELS[backend][name]
    why = kset.available(backend)
    if why is not None:
        raise BackendUnavailableError(f"{field} = {name!r}: kernel set {name!r} cannot run on {backend}: {why}")
    return kset


def available_kernels(backend: str) -> list[str]:
    return sorted(_KERNELS.get(backend, {}))


def default_kernels(backend: str) -> str:
    """The backend's ``default_kernels`` ("triton" on CUDA, "npu" on NPU, "reference" on the CPU): what
    "auto" asks for before checking that the set can run. ValueError for an unknown backend."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {sorted(BACKENDS)}")
    return BACKENDS[backend].default_kernels


REFERENCE = KernelSet(
    "reference",
    _ref.uvqk,
    _ref.time_buckets,
    _ref.attention,
    _ref.ln_mul,
    note="PyTorch reference (oracle and fallback)",
    decode_bias=_ref.decode_bias,
    attention_bias=_ref.attention_bias,
    segments=True,
)
NPU = KernelSet(
    "npu",
    _npu.uvqk,
    _npu.time_buckets,
    _npu.attention,
    _npu.ln_mul,
    verified=False,
    note="ops with torch_npu kernels, no float64; values checked on CPU, unverified on an NPU",
)
TRITON = KernelSet(
    "triton",
    _ref.uvqk,
    _npu.time_buckets,
    _triton.attention,
    _ref.ln_mul,
    verified=bool(_triton.VERIFIED_ON),
    note=("verified on " + ", ".join(_triton.VERIFIED_ON))
    if _triton.VERIFIED_ON
    else "Triton attention kernels (forward and backward), checked with the Triton CPU interpreter only; unverified on a GPU",
    available=_triton.available,
)

for _b in BACKENDS:
    register_kernels(_b, REFERENCE)
register_kernels("npu", NPU)
register_kernels("cuda", TRITON)
register_kernels("cpu", TRITON)  # runs only under the Triton interpreter (TRITON.available("cpu") says so otherwise)

__all__ = ["KernelSet", "register_kernels", "get_kernels", "available_kernels", "default_kernels", "REFERENCE", "NPU", "TRITON"]
