"""Layer-wise INT8: symmetric per-output-channel INT8 Linear weights on an integer GEMM kernel,
and row-wise INT8 embedding tables.

Symbols: N output features (rows of a Linear weight), K input features, M activation rows
(all leading axes flattened), V table rows, d embedding width.

Weights (per output channel n, symmetric, narrow range):
    s[n] = max_k |W[n, k]| / 127            (s[n] = 1 for an all-zero row)
    Q[n, k] = clamp(round(W[n, k] / s[n]), -127, 127)      round half to even (torch.round)
    W[n, k] ≈ Q[n, k] · s[n]
The same formula per row gives the row-wise INT8 embedding table.

Kernels (``Int8Kernel.name``), chosen by :func:`select_int8_kernel`:
    "fbgemm" / "qnnpack": a prepacked per-channel qint8 weight (PyTorch quantization, docs:
        pytorch.org/docs/stable/quantization.html), the GEMM in integers (u8 × s8 → s32, FBGEMM on
        x86, QNNPACK on ARM), the int32 result rescaled to float32 (:func:`_packed_linear`). FBGEMM:
        each activation row r is divided by its max |x_r| and quantized at the fixed scale 1/63, zero
        point 64 (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``), the output row
        multiplied back: per-row scales, so a row's result never depends on the other rows of the
        call (batch, chunk or decode step); 7 bits (u8 1..127), since without VNNI (AVX2,
        ``vpmaddubsw``) pairs of u8·s8 products are summed into int16 with saturation and 255·127·2 >
        32767 would clip. Measured (prod 3200 x 256 -> 1024, one thread): 6.2 ms against 4.8 for
        per-tensor dynamic activations and 12.4 for float32, max error 0.066 against 0.093.
        QNNPACK: ``linear_dynamic``, 8-bit activations per call (per tensor).
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
import logging
import warnings
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from hstu import backend
from hstu.model.embedding import ShardedEmbedding

log = logging.getLogger(__name__)

QMAX = 127  # symmetric narrow range [-127, 127]: -128 is never used, so negation is exact
KERNELS = ("auto", "fbgemm", "qnnpack", "int_mm", "dequant")


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
# Kernel selection
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int8Kernel:
    """Which GEMM an Int8Linear runs: ``name`` (see module docstring), ``integer`` (True when the
    GEMM itself runs on int8 operands), ``reason`` (why this one was chosen)."""

    name: str
    integer: bool
    reason: str


@contextlib.contextmanager
def _engine(name: str):
    """Temporarily set ``torch.backends.quantized.engine`` (prepacking reads it)."""
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def _prepack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, engine: str):
    """Per-channel qint8 weight (exactly q, scale) prepacked for :func:`_packed_linear` (bias None: added after)."""
    N = q.shape[0]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated.*")
        qw = torch._make_per_channel_quantized_tensor(q.cpu(), scale.cpu().to(torch.float64), torch.zeros(N, dtype=torch.int64), 0)
    with _engine(engine):
        return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().cpu().to(torch.float32))


def _packed_linear(x2: torch.Tensor, packed, engine: str, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) float32 -> (M, N) float32 on a :func:`_prepack` weight (module docstring: per-row activations on FBGEMM)."""
    if engine == "fbgemm":
        r = x2.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)  # (M, 1); zero rows stay 0
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x2 / r, 1 / 63, 64, packed).mul_(r)
    else:
        y = torch.ops.quantized.linear_dynamic(x2.contiguous(), packed, False)  # (M, N)
    return y if bias is None else y.add_(bias.to(torch.float32))


@cache
def _probe_engine(engine: str) -> str | None:
    """None if ``engine`` prepacks and runs a tiny per-channel dynamic Linear correctly, else why not."""
    if engine not in torch.backends.quantized.supported_engines:
        return f"quantized engine {engine!r} not in this torch build ({torch.backends.quantized.supported_engines})"
    try:
        w = torch.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
        q, s = quantize_per_channel(w)
        packed = _prepack(q, s, None, engine)
        x = torch.linspace(-1.0, 1.0, 4 * 16).reshape(4, 16)
        y = _packed_linear(x, packed, engine, None)
        ref = x @ dequantize_per_channel(q, s).T
        if (y - ref).abs().max() > 0.1:
            return f"engine {engine!r} ran but its result is off by {(y - ref).abs().max():.3g}"
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        return f"engine {engine!r} failed: {exc}".splitlines()[0]
    return None


def _int8_gemms(dev: torch.device) -> tuple[str, ...]:
    """The integer GEMMs the backend of ``dev`` offers, in order of preference (none for an unknown kind)."""
    try:
        return backend.for_device(dev).int8_gemms
    except ValueError:  # a device kind without a backend ("meta"): float fallback
        return ()


def _auto_kernel(engine: str) -> Int8Kernel | str:
    """The Int8Kernel "auto" gives for ``engine``, or the reason it cannot run in this torch build."""
    if engine == "int_mm":
        if not hasattr(torch, "_int_mm"):
            return f"torch._int_mm is absent in torch {torch.__version__}"
        return Int8Kernel("int_mm", True, "torch._int_mm (cuBLASLt s8 x s8 -> s32) with per-row int8 activations")
    why = _probe_engine(engine)
    if why is not None:
        return why
    return Int8Kernel(
        engine,
        True,
        f"torch.ops.quantized ({engine}, per-channel qint8 weights, "
        f"{'7-bit per-row' if engine == 'fbgemm' else '8-bit per-tensor dynamic'} activations)",
    )


def select_int8_kernel(device: torch.device | str = "cpu", kernel: str = "auto") -> Int8Kernel:
    """The INT8 GEMM for ``device``: "auto" tries the backend's ``int8_gemms`` in order (FBGEMM (x86)
    then QNNPACK (ARM) on CPU, ``_int_mm`` on CUDA), else the visible float fallback.

    Raises:
        ValueError: unknown ``kernel`` name, or a forced kernel that cannot run here (says why).
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown INT8 kernel {kernel!r}; valid: {list(KERNELS)}")
    dev = torch.device(device)
    if kernel == "dequant":
        return Int8Kernel("dequant", False, "forced: INT8 weights dequantized to float at each call (no integer GEMM)")
    if kernel == "int_mm":
        if not hasattr(torch, "_int_mm"):
            raise ValueError(f"INT8 kernel 'int_mm' needs torch._int_mm, absent in torch {torch.__version__}")
        return Int8Kernel("int_mm", True, f"torch._int_mm (s8 x s8 -> s32) on {dev.type}")
    gemms = _int8_gemms(dev)
    if kernel in ("fbgemm", "qnnpack"):
        if kernel not in gemms:
            raise ValueError(f"INT8 kernel {kernel!r} runs on CPU only, not on {dev}")
        why = _probe_engine(kernel)
        if why:
            raise ValueError(f"INT8 kernel {kernel!r} cannot run: {why}")
        return Int8Kernel(kernel, True, f"torch.ops.quantized.linear_dynamic ({kernel}, per-channel qint8 weights)")
    reasons = []  # auto
    for engine in gemms:
        found = _auto_kernel(engine)
        if isinstance(found, Int8Kernel):
            return found
        reasons.append(found)
    if not gemms:
        reasons.append(f"no integer GEMM kernel known for device type {dev.type!r} in torch {torch.__version__}")
    return Int8Kernel(
        "dequant", False, "; ".join(reasons) + ": INT8 weights are dequantized to float at each call (memory saving only, no speed-up)"
    )


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """y = x · (Q · s)ᵀ + b with Q int8 (N, K) per-output-channel, run on an integer GEMM.

    Buffers (saved in the state dict): ``weight_int8`` (N, K) int8, ``weight_scale`` (N,) float32,
    ``bias`` (N,) float32 or None. The prepacked kernel weight is derived, never saved, and is
    rebuilt after ``.to()`` or ``load_state_dict``.

    forward: x (…, K) float -> (…, N) in x's dtype; the GEMM runs on float32 activations
    quantized per call (see module docstring). Input is trusted (no shape check beyond K).
    Activations are quantized per row (FBGEMM, int_mm): a row's result is the same in any batch.
    QNNPACK quantizes per call (per tensor): there a row can move by an activation rounding step
    when the other rows of the call change.
    There is deliberately no float ``weight`` attribute: code that reads ``layer.uvqk.weight`` to
    run its own float GEMM must call the module instead (AttributeError says so).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, kernel: str = "auto") -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Int8Linear sizes must be > 0: in_features={in_features} out_features={out_features}")
        if kernel not in KERNELS:
            raise ValueError(f"unknown INT8 kernel {kernel!r}; valid: {list(KERNELS)}")
        self.in_features, self.out_features, self.kernel_request = in_features, out_features, kernel
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32))
        else:
            self.bias = None
        self._kernel: Int8Kernel | None = None
        self._packed = None

    @classmethod
    def from_float(cls, linear: nn.Linear, *, kernel: str = "auto") -> Int8Linear:
        """Quantize an ``nn.Linear`` (weights per output channel; bias kept in float32)."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, kernel=kernel)
        q, s = quantize_per_channel(linear.weight)
        dev = linear.weight.device
        m.weight_int8.copy_(q)
        m.weight_scale.copy_(s)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach().to(torch.float32))
        return m.to(dev)

    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(
                "Int8Linear has no float 'weight' (it holds 'weight_int8' and 'weight_scale'); "
                "call the module to run the integer GEMM, or use dequantized_weight() for a float copy"
            )
        return super().__getattr__(name)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) float copy Q · s."""
        return dequantize_per_channel(self.weight_int8, self.weight_scale, dtype)

    @property
    def kernel(self) -> Int8Kernel:
        if self._kernel is None:
            self._kernel = select_int8_kernel(self.weight_int8.device, self.kernel_request)
            if not self._kernel.integer:
                log.warning(
                    "Int8Linear(%d -> %d) on %s: %s", self.in_features, self.out_features, self.weight_int8.device, self._kernel.reason
                )
        return self._kernel

    def _apply(self, fn, *args, **kwargs):
        self._kernel, self._packed = None, None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._kernel, self._packed = None, None
        return super()._load_from_state_dict(*args, **kwargs)

    def prepare(self) -> Int8Linear:
        """Select the kernel and prepack now (otherwise done at the first call)."""
        k = self.kernel
        if k.name in ("fbgemm", "qnnpack") and self._packed is None:
            self._packed = _prepack(self.weight_int8, self.weight_scale, None, k.name)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K, N = self.in_features, self.out_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K).to(torch.float32)  # (M, K)
        k = self.kernel
        if k.name in ("fbgemm", "qnnpack"):
            if self._packed is None:
                self.prepare()
            y = _packed_linear(x2, self._packed, k.name, self.bias)  # (M, N)
        elif k.name == "int_mm":
            y = self._int_mm(x2)
        else:
            y = F.linear(x2, self.dequantized_weight(), self.bias)
        return y.reshape(*lead, N).to(x.dtype)

    def _int_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """Per-row symmetric int8 activations, torch._int_mm, rescale: (M, K) float32 -> (M, N)."""
        M = x2.shape[0]
        xs = (x2.abs().amax(dim=1) / QMAX).clamp(min=1e-12)  # (M,)
        xq = torch.round(x2 / xs[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)  # (M, K)
        pad = max(0, 17 - M)  # cuBLASLt's _int_mm needs M > 16
        if pad:
            xq = F.pad(xq, (0, 0, 0, pad))
        acc = torch._int_mm(xq, self.weight_int8.t())[:M]  # (M, N) int32
        y = acc.to(torch.float32) * xs[:, None] * self.weight_scale[None, :].to(torch.float32)
        return y if self.bias is None else y + self.bias.to(torch.float32)

    def extra_repr(self) -> str:
        kern = self._kernel.name if self._kernel else self.kernel_request
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, kernel={kern}"


class Int8Embedding(nn.Module):
    """Row-wise symmetric INT8 table: row r = Q[r] · s[r] (same formula as per output channel).

    Buffers: ``weight_int8`` (V, d) int8, ``weight_scale`` (V,) float32. forward: (…) int64 ids ->
    (…, d) float32; ``rows(start, end)`` -> (end - start, d) float32 (used by
    ``HSTUModel.item_vectors``). Row ``padding_idx`` quantizes to exact zeros.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = 0) -> None:
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"Int8Embedding sizes must be > 0: num_embeddings={num_embeddings} embedding_dim={embedding_dim}")
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.register_buffer("weight_int8", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(num_embeddings, dtype=torch.float32))

    @classmethod
    def from_float(cls, emb: nn.Embedding) -> Int8Embedding:
        m = cls(emb.num_embeddings, emb.embedding_dim, emb.padding_idx)
        q, s = quantize_per_channel(emb.weight)
        m.weight_int8.copy_(q)
        m.weight_scale.copy_(s)
        return m.to(emb.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight_int8).to(torch.float32) * self.weight_scale[ids].unsqueeze(-1)  # (…, d)

    def rows(self, start: int, end: int) -> torch.Tensor:
        return dequantize_per_channel(self.weight_int8[start:end], self.weight_scale[start:end])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, int8 row-wise"


# ---------------------------------------------------------------------------------------------
# Whole-model conversion
# ---------------------------------------------------------------------------------------------

EMBEDDING_STORAGE = ("fp16", "bf16", "int8", "fp32")
_FLOAT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def quantizable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Names -> modules of the HSTU block Linears: ``layers.{i}.uvqk`` and ``layers.{i}.o``, in order, and
    with ``[model] ffn_hidden`` > 0 the FFN's ``layers.{i}.ffn.gate_up`` and ``layers.{i}.ffn.down``."""
    out = {}
    for i, layer in enumerate(model.layers):
        out[f"layers.{i}.uvqk"] = layer.uvqk
        out[f"layers.{i}.o"] = layer.o
        if getattr(layer, "ffn", None) is not None:
            out[f"layers.{i}.ffn.gate_up"] = layer.ffn.gate_up
            out[f"layers.{i}.ffn.down"] = layer.ffn.down
    return out


def resolve_keep_float(model: nn.Module, keep_float) -> list[str]:
    """Expand ``keep_float`` (names like ``layers.1.o`` or whole blocks ``layers.1``; a string is
    split on commas) to Linear names. Raises ValueError naming an unknown entry and the valid ones."""
    if isinstance(keep_float, str):
        keep_float = [s for s in keep_float.split(",")]
    names = list(quantizable_linears(model))
    out: list[str] = []
    for raw in keep_float or ():
        name = raw.strip()
        if not name:
            continue
        hit = [n for n in names if n == name or n.startswith(name + ".")]
        if not hit:
            raise ValueError(f"--keep-float: unknown layer {name!r}; valid: {', '.join(names)} (or a block such as 'layers.0')")
        out += [n for n in hit if n not in out]
    return out


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def small_tables(model: nn.Module) -> list[str]:
    """State-dict keys of the small float lookup tables (position, action, category and side-feature
    embeddings, the per-layer relative-bias tables) that the INT8 scheme stores in the
    embedding float dtype and computes with in float32."""
    keys = ["pos_emb.weight"]
    keys += [f"{n}.weight" for n in ("action_emb", "category_emb") if getattr(model, n, None) is not None]
    keys += [f"feature_emb.{j}.weight" for j in range(len(getattr(model, "feature_emb", None) or ()))]  # side features
    for i in range(len(model.layers)):
        keys += [f"layers.{i}.rel_bias.pos_w", f"layers.{i}.rel_bias.ts_w"]
    return keys


@torch.no_grad()
def quantize_model_int8(
    model: nn.Module, *, embeddings: str = "fp16", keep_float=(), kernel: str = "auto", structure_only: bool = False
) -> nn.Module:
    """Convert an HSTUModel in place to the layer-wise INT8 scheme and return it.

    - every HSTU block Linear (``layers.{i}.uvqk``, ``layers.{i}.o``) not named in ``keep_float``
      becomes an :class:`Int8Linear` (per-output-channel symmetric INT8 weights, float32 bias);
    - the item table is stored as ``embeddings``: "fp16" | "bf16" (kept in that dtype in memory;
      lookups are widened to float32 by the model), "int8" (:class:`Int8Embedding`, row-wise) or
      "fp32" (unchanged); a hashed table (ShardedEmbedding) keeps its shards and placement and stores
      them in "fp16" / "bf16" / "fp32" (``cast_storage``; "int8" is refused: ValueError);
    - the small tables of :func:`small_tables` are rounded through fp16 (bf16 when
      ``embeddings="bf16"``, unchanged for "fp32") and kept in float32 for compute, so that the
      saved checkpoint (which stores them in that dtype) reloads bit-identically;
    - layer norms, SiLU attention, relative bias, the action head and similarity stay in float32.
    ``structure_only`` swaps the modules without quantizing values (to load a checkpoint into).
    Records what it did in ``model.quant_meta`` (dict). Raises ValueError for an unknown
    ``embeddings`` / ``keep_float`` / ``kernel`` value, TypeError for a non-float32 model.
    """
    if embeddings not in EMBEDDING_STORAGE:
        raise ValueError(f"embeddings: unsupported storage {embeddings!r}; valid: {list(EMBEDDING_STORAGE)}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown INT8 kernel {kernel!r}; valid: {list(KERNELS)}")
    if model.pos_emb.weight.dtype != torch.float32:
        raise TypeError(f"INT8 quantization needs a float32 model, got {model.pos_emb.weight.dtype}")
    if isinstance(model.item_emb, ShardedEmbedding) and embeddings == "int8":
        raise ValueError(
            "embeddings: 'int8' (row-wise) is for a dense item table; this run's table is hashed "
            "(item_table = 'hashed'): use --embeddings fp16, bf16 or fp32 (its shards are stored in that dtype)"
        )
    keep = resolve_keep_float(model, keep_float)
    quantized = []
    for name, lin in quantizable_linears(model).items():
        if name in keep or isinstance(lin, Int8Linear):
            continue
        if structure_only:
            q = Int8Linear(lin.in_features, lin.out_features, lin.bias is not None, kernel=kernel).to(lin.weight.device)
        else:
            q = Int8Linear.from_float(lin, kernel=kernel)
        _set_module(model, name, q)
        quantized.append(name)
    stored_as: dict[str, str] = {}
    emb = model.item_emb
    if isinstance(emb, nn.Embedding):
        if embeddings == "int8":
            model.item_emb = (
                Int8Embedding(emb.num_embeddings, emb.embedding_dim, emb.padding_idx).to(emb.weight.device)
                if structure_only
                else Int8Embedding.from_float(emb)
            )
        elif embeddings != "fp32":
            emb.weight.data = emb.weight.data.to(_FLOAT[embeddings])
    elif isinstance(emb, ShardedEmbedding):
        if embeddings != "fp32":
            emb.cast_storage(_FLOAT[embeddings])  # every shard in the item-table dtype, placement kept
    elif embeddings != "fp32":
        log.warning(
            "item_emb is a %s, not nn.Embedding: its own storage dtypes are kept (embeddings=%s ignored)", type(emb).__name__, embeddings
        )
    if embeddings != "fp32":
        small = _FLOAT["bf16" if embeddings == "bf16" else "fp16"]
        state = dict(model.named_parameters())
        for key in small_tables(model):
            p = state[key]
            if not structure_only:
                p.data = p.data.to(small).to(torch.float32)
            stored_as[key] = "bf16" if small == torch.bfloat16 else "fp16"
    model.quant_meta = {"scheme": "int8", "embeddings": embeddings, "keep_float": keep, "quantized": quantized, "stored_as": stored_as}
    return model
