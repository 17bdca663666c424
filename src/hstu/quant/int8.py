"""Layer-wise INT8: symmetric per-output-channel INT8 Linear weights on an integer GEMM kernel,
and row-wise INT8 embedding tables; the whole-model conversion (:func:`quantize_model_int8`).

The arithmetic (weights per output channel, activations per row) and the kernels (FBGEMM, oneDNN,
QNNPACK, ``torch._int_mm``, the dequantizing fallback) are in :mod:`hstu.quant.int8_kernels`.
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from hstu.model.embedding import ShardedEmbedding
from hstu.quant.int8_kernels import (  # noqa: F401  (QMAX, Int8Kernel, KERNELS re-exported)
    KERNELS,
    QMAX,
    Int8Kernel,
    PackedInt8,
    dequantize_per_channel,
    packed_linear,
    prepack,
    quantize_per_channel,
    select_int8_kernel,
)

log = logging.getLogger(__name__)
CPU_KERNELS = ("fbgemm", "onednn", "qnnpack")  # run on a prepacked weight (int8_kernels.prepack)
# Int8Linear.key -> (packed weight, bias) of every Linear prepared in this process (kept for the process's life: a graph
# loaded from the cache calls them by key, whichever copy of the model is alive; equal keys share one entry)
_LIVE: dict[str, tuple[PackedInt8, torch.Tensor | None]] = {}

# ---------------------------------------------------------------------------------------------
# The prepacked GEMM as one opaque op in compiled graphs
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("hstu::int8_linear", mutates_args=())
def int8_linear(x2: torch.Tensor, key: str) -> torch.Tensor:
    """(M, K) float32 -> (M, N) float32: the prepacked GEMM of the Int8Linear whose ``key`` is ``key``
    (the same kernel, so the same result, as its eager call). How a compiled graph (torch.compile, or an
    AOTInductor package of the graph cache, hstu.backend.graph_cache) calls a weight that torch.export
    cannot trace (packed FBGEMM params / a oneDNN packed tensor): the graph holds the key, a hash of the
    weights and kernel, and the packed weight this process prepared under that key runs the call (PyTorch docs, "Custom
    Python operators", ``torch.library.custom_op``; AOTInductor calls it through its proxy executor).

    Raises:
        RuntimeError: no Int8Linear with this key in this process (another run's or kernel's graph).
    """
    if key not in _LIVE:
        raise RuntimeError(f"INT8 Linear {key} is not loaded in this process (a graph built for other weights or another kernel)")
    return packed_linear(x2, *_LIVE[key])


@int8_linear.register_fake
def _int8_linear_fake(x2: torch.Tensor, key: str) -> torch.Tensor:
    return x2.new_empty(x2.shape[0], int(key.split("x", 1)[0]))


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
    Activations are quantized per row (FBGEMM, oneDNN, int_mm): a row's result is the same in any batch.
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
        self._packed: PackedInt8 | None = None
        self.key: str | None = None  # "{N}x{K}:{kernel}:{hash}" once prepared (int8_linear)

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
        return m.to(dev).prepare()

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

    # new weights or device: prepared again at once where it was (a compiled graph's tracing cannot prepack)
    def _unprepare(self) -> bool:
        was, (self._kernel, self._packed, self.key) = self._packed is not None, (None, None, None)
        return was

    def _apply(self, fn, *args, **kwargs):
        was = self._unprepare()
        out = super()._apply(fn, *args, **kwargs)
        return out.prepare() if was else out

    def _load_from_state_dict(self, *args, **kwargs):
        was = self._unprepare()
        super()._load_from_state_dict(*args, **kwargs)
        if was:
            self.prepare()

    def prepare(self) -> Int8Linear:
        """Select the kernel and prepack now (otherwise done at the first call)."""
        k = self.kernel
        if k.name in CPU_KERNELS and self._packed is None:
            self._packed = prepack(self.weight_int8, self.weight_scale, k.name)
            h = hashlib.sha256(k.name.encode())
            for t in (self.weight_int8, self.weight_scale, self.bias):
                h.update(b"-" if t is None else t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            self.key = f"{self.out_features}x{self.in_features}:{k.name}:{h.hexdigest()[:24]}"
            _LIVE.setdefault(self.key, (self._packed, self.bias))  # equal keys: equal weights and kernel, equal results
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K, N = self.in_features, self.out_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K).to(torch.float32)  # (M, K)
        k = self.kernel
        if k.name in CPU_KERNELS:
            if self._packed is None:
                self.prepare()
            if torch.compiler.is_compiling():  # traced for a compiled graph: the packed weight stays outside it
                y = torch.ops.hstu.int8_linear(x2, self.key)
            else:
                y = packed_linear(x2, self._packed, self.bias)  # (M, N)
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
    elif isinstance(emb, ShardedEmbedding):  # every shard in the item-table dtype, placement kept; "fp32" widens a 16-bit
        emb.cast_storage(_FLOAT[embeddings])  # table exactly (it was left as it was and recorded as fp32)
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
