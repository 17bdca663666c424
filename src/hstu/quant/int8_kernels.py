"""INT8 arithmetic and GEMM kernels for :mod:`hstu.quant.int8`: symmetric per-output-channel
weights, per-row activations, and which integer GEMM runs them on this device.

Symbols: N output features (rows of a Linear weight), K input features, M activation rows
(all leading axes flattened), V table rows, d embedding width.

Weights (per output channel n, symmetric, narrow range):
    s[n] = max_k |W[n, k]| / 127            (s[n] = 1 for an all-zero row)
    Q[n, k] = clamp(round(W[n, k] / s[n]), -127, 127)      round half to even (torch.round)
    W[n, k] ≈ Q[n, k] · s[n]
The same formula per row gives the row-wise INT8 embedding table.

Kernels (``Int8Kernel.name``), chosen by :func:`select_int8_kernel`:
    "fbgemm": a prepacked per-channel qint8 weight (PyTorch quantization, docs:
        pytorch.org/docs/stable/quantization.html), the GEMM in integers (u8 × s8 → s32), the int32
        result rescaled to float32 (:func:`packed_linear`). Each activation row r is divided by its
        max |x_r| and quantized at the fixed scale 1/63, zero point 64
        (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``), the output row multiplied
        back: per-row scales, so a row's result never depends on the other rows of the call (batch,
        chunk or decode step); 7 bits (u8 1..127), since without VNNI (AVX2, ``vpmaddubsw``) pairs
        of u8·s8 products are summed into int16 with saturation and 255·127·2 > 32767 would clip.
        Measured (prod 3200 x 256 -> 1024, one thread): 6.2 ms against 4.8 for per-tensor dynamic
        activations and 12.4 for float32, max error 0.066 against 0.093.
    "onednn": the same recipe, with calls of at least ``ONEDNN_MIN_OUTPUTS`` outputs (M·N) run on
        oneDNN's integer GEMM (``onednn::qlinear_pointwise``, the op Inductor's x86 INT8 lowering
        calls; AMX or AVX-512 VNNI): the rows are quantized by ``torch.quantize_per_tensor`` at the
        same scale and zero point, the integer sums are exact, and the float epilogue is FBGEMM's
        (fl(acc · fl(fl(1/63) · s[n])), :func:`prepack`), so the result equals FBGEMM's bit for bit
        and a row's result still does not depend on the call (checked at the first use on each
        machine, :func:`_probe_onednn`). Smaller calls stay on FBGEMM, where oneDNN's fixed cost per
        call is higher. Chosen by "auto" on CPUs with AVX-512 VNNI (``torch.cpu._is_vnni_supported``;
        AVX-VNNI alone is not detected). ``benchmarks/int8_kernels.py`` measures both sides
        (``benchmarks/results/int8_kernels.json``, a 2-core Xeon with AMX, one thread, FBGEMM time /
        oneDNN time): 0.66-0.80 at M = 1-16 on every shape; from about 2^16 outputs 1.0-2.2 on the
        wide Linears (256 -> 1024: 1.01 at M = 64, 2.18 at M = 3200, which varied 1.1-2.2 between
        runs; the 3706-row item table: 1.25 at M = 64, 1.59 at 256) and 0.97-1.2 on the narrow ones
        (N <= 256). The threshold sits near the wide Linears' break-even.
    "qnnpack": ``linear_dynamic`` on ARM, 8-bit activations per call (per tensor).
    "int_mm": per-row symmetric int8 activations and ``torch._int_mm`` (s8 × s8 → s32); on CUDA
        that is cuBLASLt's integer GEMM. On CPU ``torch._int_mm`` is a slow reference loop
        (measured ~40x slower than the float32 GEMM), so it is only chosen on CUDA.
    "dequant": no integer kernel for this device: the INT8 weight is dequantized to float at
        each call (memory saving only, no speed-up). Chosen only when nothing else works, and
        logged as a WARNING naming the reason.

Why not torchao: torchao 0.18's ``Int8DynamicActivationInt8WeightConfig`` runs eager on CPU
through ``torch._int_mm`` (measured 20x slower than float32 here) and needs ``torch.compile``
to be fast; its weight-only INT8 dequantizes (1.3x slower). ``torch.ops.quantized`` (FBGEMM)
is the integer kernel that runs eager in torch 2.13. Its quantized-tensor constructors warn
that they are deprecated (pytorch/pytorch#184982); that warning is expected once per process.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from functools import cache

import torch

from hstu import backend

QMAX = 127  # symmetric narrow range [-127, 127]: -128 is never used, so negation is exact
KERNELS = ("auto", "fbgemm", "onednn", "qnnpack", "int_mm", "dequant")
ONEDNN_MIN_OUTPUTS = 1 << 16  # M·N from which the "onednn" kernel runs oneDNN's GEMM (module docstring)
_X_SCALE, _X_ZERO = 1 / 63, 64  # 7-bit per-row activations: (x / max|x|) / (1/63) + 64 in 1..127


# ---------------------------------------------------------------------------------------------
# Quantization arithmetic
# ---------------------------------------------------------------------------------------------


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel (per-row) INT8 quantization.

    Args:
        weight: (N, K) float tensor (any float dtype).
    Returns:
        q (N, K) int8 in [-127, 127] and scale (N,) float32 with weight ≈ q * scale[:, None].
        All-zero rows get scale 1 and q = 0.
    Raises:
        ValueError: weight is not 2-D or not floating point, or holds NaN/inf.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_per_channel needs a 2-D float weight, got shape {tuple(weight.shape)} dtype {weight.dtype}")
    w = weight.detach().to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("quantize_per_channel: weight holds NaN or inf")
    amax = w.abs().amax(dim=1)  # (N,)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))  # (N,)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)  # (N, K)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (N, K) int8, scale (N,) -> (N, K) ``dtype`` = q * scale[:, None]."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int8Kernel:
    """Which GEMM an Int8Linear runs: ``name`` (see module docstring), ``integer`` (True when the
    GEMM itself runs on int8 operands), ``reason`` (why this one was chosen)."""

    name: str
    integer: bool
    reason: str


@dataclass(frozen=True)
class PackedInt8:
    """One Linear's INT8 weight prepacked for a CPU kernel: ``engine`` ("fbgemm" or "qnnpack", the
    ``torch.ops.quantized`` packed params in ``packed``, None where every call goes to oneDNN) and,
    for the "onednn" kernel, ``onednn`` (oneDNN's packed (N, K) int8 weight), ``scale`` (N,) float32
    (the activation step 1/63 times the weight scale, rounded to float32 as FBGEMM does) and ``zeros``
    (N,) int32. ``copies``: packed weight copies held (for memory reports)."""

    engine: str
    out_features: int
    packed: object | None
    onednn: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zeros: torch.Tensor | None = None

    @property
    def copies(self) -> int:
        return int(self.packed is not None) + int(self.onednn is not None)


@contextlib.contextmanager
def _engine(name: str):
    """Temporarily set ``torch.backends.quantized.engine`` (prepacking reads it)."""
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def prepack(q: torch.Tensor, scale: torch.Tensor, kernel: str) -> PackedInt8:
    """Prepack a per-channel INT8 weight, exactly (q (N, K) int8, scale (N,) float32), for ``kernel``
    ("fbgemm", "onednn" or "qnnpack"); the bias is added after the GEMM. The "onednn" kernel keeps the
    FBGEMM copy only when some call can be below ``ONEDNN_MIN_OUTPUTS`` (N < 2^16)."""
    N = q.shape[0]
    engine = "qnnpack" if kernel == "qnnpack" else "fbgemm"
    packed = None
    if kernel != "onednn" or N < ONEDNN_MIN_OUTPUTS:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated.*")
            qw = torch._make_per_channel_quantized_tensor(q.cpu(), scale.cpu().to(torch.float64), torch.zeros(N, dtype=torch.int64), 0)
        with _engine(engine):
            packed = torch.ops.quantized.linear_prepack(qw, None)
    if kernel != "onednn":
        return PackedInt8(engine, N, packed)
    onednn = torch.ops.onednn.qlinear_prepack(q.cpu().contiguous(), None)
    # oneDNN forms x_scale * w_scale[n] * float(acc); with x_scale = 1 and w_scale[n] = fl(fl(1/63) · s[n]) that is
    # fl(acc · fl(fl(1/63) · s[n])), FBGEMM's float-output epilogue exactly (checked by _probe_onednn)
    mult = torch.tensor(_X_SCALE, dtype=torch.float32) * scale.cpu().to(torch.float32)  # (N,)
    return PackedInt8(engine, N, packed, onednn, mult.contiguous(), torch.zeros(N, dtype=torch.int32))


def _onednn_gemm(a: torch.Tensor, p: PackedInt8) -> torch.Tensor:
    """(M, K) float32 rows already divided by their max |x| -> (M, N) float32, on oneDNN (7-bit u8 rows).
    quantize_per_tensor's deprecation warning is emitted once per process; :func:`_probe_onednn` takes it."""
    xq = torch.quantize_per_tensor(a, _X_SCALE, _X_ZERO, torch.quint8).int_repr()  # (M, K) uint8
    out = (None, 1.0, 0, torch.float32, "none", [], "")  # no bias; float32 output, no post-op
    return torch.ops.onednn.qlinear_pointwise(xq, 1.0, _X_ZERO, p.onednn, p.scale, p.zeros, *out)


def packed_linear(x2: torch.Tensor, p: PackedInt8, bias: torch.Tensor | None, *, force_onednn: bool | None = None) -> torch.Tensor:
    """(M, K) float32 -> (M, N) float32 on a :func:`prepack` weight (module docstring: per-row
    activations on FBGEMM / oneDNN, per-call on QNNPACK). ``force_onednn`` (the probe) overrides
    the M·N rule."""
    if p.engine == "fbgemm":
        r = x2.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)  # (M, 1); zero rows stay 0
        a = x2 / r
        big = x2.shape[0] * p.out_features >= ONEDNN_MIN_OUTPUTS if force_onednn is None else force_onednn
        if p.onednn is not None and (big or p.packed is None):
            y = _onednn_gemm(a, p)
        else:
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(a, _X_SCALE, _X_ZERO, p.packed)
        y = y.mul_(r)
    else:
        y = torch.ops.quantized.linear_dynamic(x2.contiguous(), p.packed, False)  # (M, N)
    return y if bias is None else y.add_(bias.to(torch.float32))


def _probe_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
    q, s = quantize_per_channel(w)
    return q, s, torch.linspace(-1.0, 1.0, 4 * 16).reshape(4, 16)


@cache
def _probe_engine(engine: str) -> str | None:
    """None if ``engine`` prepacks and runs a tiny per-channel Linear correctly, else why not."""
    if engine not in torch.backends.quantized.supported_engines:
        return f"quantized engine {engine!r} not in this torch build ({torch.backends.quantized.supported_engines})"
    try:
        q, s, x = _probe_inputs()
        y = packed_linear(x, prepack(q, s, engine), None)
        ref = x @ dequantize_per_channel(q, s).T
        if (y - ref).abs().max() > 0.1:
            return f"engine {engine!r} ran but its result is off by {(y - ref).abs().max():.3g}"
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        return f"engine {engine!r} failed: {exc}".splitlines()[0]
    return None


@cache
def _probe_onednn() -> str | None:
    """None if oneDNN's integer GEMM runs here and equals FBGEMM's result bit for bit, else why not.
    Needs a CPU with AVX-512 VNNI (AMX CPUs have it; torch does not detect AVX-VNNI alone): where it
    was measured faster."""
    why = _probe_engine("fbgemm")
    if why:
        return why
    if not getattr(torch.cpu, "_is_vnni_supported", lambda: False)():
        return "this CPU has no AVX-512 VNNI (oneDNN's INT8 GEMM was measured only there, with AMX)"
    g = torch.Generator().manual_seed(0)
    q2, s2 = quantize_per_channel(torch.randn(1024, 64, generator=g))
    for q, s, x in (_probe_inputs(), (q2, s2, torch.randn(64, 64, generator=g))):  # tiny, and at ONEDNN_MIN_OUTPUTS
        try:
            p = prepack(q, s, "onednn")
            with warnings.catch_warnings():  # the once-per-process deprecation of quantize_per_tensor, taken here
                warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated.*")
                a = packed_linear(x, p, None, force_onednn=True)
            b = packed_linear(x, p, None, force_onednn=False)
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            return f"oneDNN qlinear failed: {exc}".splitlines()[0]
        if not torch.equal(a, b):
            return f"oneDNN's result differs from FBGEMM's by {(a - b).abs().max():.3g} (not bit-identical)"
    return None


def _int8_gemms(dev: torch.device) -> tuple[str, ...]:
    """The integer GEMMs the backend of ``dev`` offers, in order of preference (none for an unknown kind)."""
    try:
        return backend.for_device(dev).int8_gemms
    except ValueError:  # a device kind without a backend ("meta"): float fallback
        return ()


_REASON = {
    "fbgemm": "torch.ops.quantized (fbgemm, per-channel qint8 weights, 7-bit per-row activations)",
    "onednn": "fbgemm's recipe with oneDNN's u8 x s8 GEMM (VNNI / AMX) for calls of >= 2^16 outputs, bit-identical",
    "qnnpack": "torch.ops.quantized (qnnpack, per-channel qint8 weights, 8-bit per-tensor dynamic activations)",
}


def _why_not(kernel: str) -> str | None:
    """None if CPU ``kernel`` runs in this torch build and on this CPU, else why not."""
    return _probe_onednn() if kernel == "onednn" else _probe_engine(kernel)


def select_int8_kernel(device: torch.device | str = "cpu", kernel: str = "auto") -> Int8Kernel:
    """The INT8 GEMM for ``device``: "auto" tries the backend's ``int8_gemms`` in order (oneDNN with
    VNNI, then FBGEMM (x86), then QNNPACK (ARM) on CPU; ``_int_mm`` on CUDA), else the visible float
    fallback.

    Raises:
        ValueError: unknown ``kernel`` name, or a forced kernel that cannot run here (says why).
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown INT8 kernel {kernel!r}; valid: {list(KERNELS)}")
    dev = torch.device(device)
    if kernel == "dequant":
        return Int8Kernel("dequant", False, "forced: INT8 weights dequantized to float at each call (no integer GEMM)")
    int_mm = f"torch._int_mm is absent in torch {torch.__version__}" if not hasattr(torch, "_int_mm") else None
    if kernel == "int_mm":
        if int_mm:
            raise ValueError(f"INT8 kernel 'int_mm' cannot run: {int_mm}")
        return Int8Kernel("int_mm", True, f"torch._int_mm (s8 x s8 -> s32) on {dev.type}")
    gemms = _int8_gemms(dev)
    if kernel != "auto":
        why = f"it runs on CPU only, not on {dev}" if kernel not in gemms else _why_not(kernel)
        if why:
            raise ValueError(f"INT8 kernel {kernel!r} cannot run: {why}")
        return Int8Kernel(kernel, True, "forced: " + _REASON[kernel])
    reasons = []
    for name in gemms:
        why = int_mm if name == "int_mm" else _why_not(name)
        if why is None:
            reason = "torch._int_mm (cuBLASLt s8 x s8 -> s32) with per-row int8 activations" if name == "int_mm" else _REASON[name]
            return Int8Kernel(name, True, reason)
        reasons.append(f"{name}: {why}")
    if not gemms:
        reasons.append(f"no integer GEMM kernel known for device type {dev.type!r} in torch {torch.__version__}")
    return Int8Kernel(
        "dequant", False, "; ".join(reasons) + ": INT8 weights are dequantized to float at each call (memory saving only, no speed-up)"
    )
