"""Kernel registry per backend for HSTU attention and the fused pieces of a layer.

A :class:`KernelSet` bundles the pieces every HSTULayer.forward calls, through
:func:`hstu.model.meta.hstu_attention` for the attention (see ``kernels/reference.py`` for their
contracts; the set travels in the batch's AttentionMeta): ``uvqk`` (LN + projection + SiLU + split),
``time_buckets`` (log time buckets), ``attention`` (HSTU attention with the relative bias
formed inside) and ``ln_mul`` (U ⊙ LN(A·V)). Sets are registered per backend by name, after
vLLM's attention-backend registry (unknown names raise ValueError listing the valid ones):

    backend  name        status
    cpu      reference   PyTorch reference: the oracle and the fallback everywhere
    cuda     reference   same
    cuda     triton      Triton attention kernel (triton_hstu.py); off by default, unverified
                         on a GPU until tests/model/test_kernels.py runs on one (VERIFIED_ON)
    npu      reference   same as cpu (float64 time buckets: may fall back to the host)
    npu      npu         float32-exact time buckets, ops with torch_npu kernels only (npu.py)

``default_kernels(backend)`` is that backend's ``Backend.default_kernels`` ("npu" on NPU, "reference"
elsewhere, :mod:`hstu.backend`): the Triton set is used
only when asked for by name. Each set also registers its square-attention variant in
:mod:`hstu.model.attention` (the model's own registry) under the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hstu.backend import BACKENDS
from hstu.model import attention as _model_attention
from hstu.model.kernels import npu as _npu
from hstu.model.kernels import reference as _ref
from hstu.model.kernels import triton_hstu as _triton


@dataclass(frozen=True)
class KernelSet:
    """One backend's implementation of the fused pieces (contracts in kernels/reference.py).

    ``verified``: checked against the reference on the target device; ``note``: why not, or
    what it needs. ``available``: () -> None or the reason it cannot run here.
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
    available: Callable[[], str | None] = lambda: None


_KERNELS: dict[str, dict[str, KernelSet]] = {name: {} for name in BACKENDS}


def register_kernels(backend: str, kset: KernelSet, square_attention: Callable | None = None) -> None:
    """Register ``kset`` for ``backend`` ("cpu" | "cuda" | "npu"); a duplicate name raises.

    ``square_attention`` (model-registry signature) is added to hstu.model.attention too.
    """
    if backend not in _KERNELS:
        raise ValueError(f"unknown backend {backend!r}; valid: {sorted(_KERNELS)}")
    if kset.name in _KERNELS[backend]:
        raise ValueError(f"kernel set {kset.name!r} is already registered for backend {backend!r}")
    _KERNELS[backend][kset.name] = kset
    if square_attention is not None and kset.name not in _model_attention.available_attention(backend):
        _model_attention.register_attention(backend, kset.name, square_attention)


def get_kernels(backend: str, name: str = "auto") -> KernelSet:
    """The set ``name`` for ``backend``; "auto" = :func:`default_kernels`. ValueError lists valid names;
    RuntimeError says why a registered set cannot run here."""
    if backend not in _KERNELS:
        raise ValueError(f"unknown backend {backend!r}; valid: {sorted(_KERNELS)}")
    if name == "auto":
        name = default_kernels(backend)
    if name not in _KERNELS[backend]:
        raise ValueError(f"no kernel set {name!r} for backend {backend!r}; valid: {sorted(_KERNELS[backend])}")
    kset = _KERNELS[backend][name]
    why = kset.available()
    if why is not None:
        raise RuntimeError(f"kernel set {name!r} cannot run on {backend}: {why}")
    return kset


def available_kernels(backend: str) -> list[str]:
    return sorted(_KERNELS.get(backend, {}))


def default_kernels(backend: str) -> str:
    """The backend's ``default_kernels``: "npu" on NPU, else "reference" (the Triton set is opt-in while
    unverified). ValueError for an unknown backend."""
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
    else "Triton attention kernel, checked with the Triton CPU interpreter only; unverified on a GPU",
    available=lambda: _triton.available("cuda"),
)

for _b in BACKENDS:
    register_kernels(_b, REFERENCE)
register_kernels("npu", NPU, square_attention=_npu.square_attention)
register_kernels("cuda", TRITON, square_attention=_triton.square_attention)

__all__ = ["KernelSet", "register_kernels", "get_kernels", "available_kernels", "default_kernels", "REFERENCE", "NPU", "TRITON"]
