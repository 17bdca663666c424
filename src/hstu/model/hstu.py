"""HSTU encoder: Hierarchical Sequential Transduction Units (Zhai et al. 2024, §3).

Symbols: B batch, W padded width (<= N), N = max_seq_len + max_output_len the fixed width,
d embedding width, H heads, d_qk / d_v per-head widths, S KV-cache capacity (<= N).

Per layer, for input X (B, W, d)                                        (§3, eqs. 1-3)
    U, V, Q, K = Split(SiLU(LN(X) · W_uvqk))        split order u, v, q, k
    A = SiLU(Q Kᵀ + rab) / n ⊙ causal mask           (see attention.py, bias.py)
        n = N for every row ("fixed", the reference), or i + 1 for row i ("causal", an ablation)
    Y = X + W_o · Dropout(U ⊙ LN(A · V))
    [model] query_key_map = false: Q = K = 0, so A = SiLU(rab) / n (FuXi-beta's attention-free mixing)
    [model] ffn_hidden = F > 0: then Y += W_down · Dropout(SiLU(W_gate RMSNorm(Y)) ⊙ W_up RMSNorm(Y)) (FuXi-alpha §4.3)
    [model] multi_channel = true (FuXi-alpha §4.2, adaptive multi-channel self-attention): rab leaves the scores and
        becomes channels of its own, A·V := [SiLU(Q Kᵀ) / n · V, A_p · V, A_t · V] (A_p, A_t the masked position and
        time biases, meta.multi_channel), U is C + 1 times as wide, and W_o maps the C + 1 channels back to d
    [model] multi_channel = true with query_key_map = false (FuXi-beta's attention-free token mixer on FuXi-alpha's
        channels, Ye et al. 2025, arXiv:2508.10615): no semantic channel, A·V := [A_p · V, A_t · V], U C times as wide
Rows at positions >= length are zero after every layer, so padding never changes live rows.
Input: item_emb · √d + pos_emb (+ action and category embeddings); output rows L2-normalised.

``HSTULayer.forward(x, meta, kv)`` is the only implementation of these equations, for every
path: training and evaluation (T = S = W), a prefill, an extension of a cached prefix (T new
rows against S cached ones) and a decode step (T = 1). ``meta`` (hstu.model.meta.AttentionMeta)
holds the batch's positions, mask, time buckets and kernel set; ``kv`` (KVView) the layer's slice
of a KV-cache pool. The attention itself runs through the kernel registry (model/kernels/).
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

from hstu.backend import Backend, for_device
from hstu.config import ARCHITECTURES, ATTENTION_NORMS, ModelConfig
from hstu.model.base import SequentialRecommender, l2_normalize  # noqa: F401 (l2_normalize: imported from here by model, train, quant)
from hstu.model.bias import RelativeBias, time_buckets, time_buckets_row
from hstu.model.kernels import REFERENCE, KernelSet, get_kernels
from hstu.model.meta import AttentionMeta, KVView, hstu_attention, multi_channel, segment_positions
from hstu.model.repeat import RepeatBias

log = logging.getLogger(__name__)


class SwiGLUFFN(nn.Module):
    """FuXi-alpha's second FFN stage (Ye et al., WWW 2025, §4.3, "multi-stage feedforward network"), a
    SwiGLU (Shazeer 2020) with RMSNorm and a residual: (B, T, d) -> (B, T, d) float,
    y + W_down · Dropout(SiLU(W_gate · RMSNorm(y)) ⊙ (W_up · RMSNorm(y))). Row by row, so padding
    rows stay what the block's mask makes them and a decode row needs nothing cached."""

    def __init__(self, dim: int, hidden: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(y)).chunk(2, dim=-1)  # (B, T, hidden) x 2
        return y + self.down(self.dropout(F.silu(gate) * up))


class HSTULayer(nn.Module):
    """One HSTU block. Keyword-only sizes, checked at construction; ``index`` is the block's
    place in the encoder (which per-layer precomputed bias of an AttentionMeta it reads)."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        d_qk: int,
        d_v: int,
        width: int,
        num_buckets: int,
        dropout: float = 0.0,
        eps: float = 1e-6,
        use_position_bias: bool = True,
        use_time_bias: bool = True,
        attention_norm: str = "fixed",
        query_key_map: bool = True,
        ffn_hidden: int = 0,
        multi_channel: bool = False,
        index: int = 0,
    ) -> None:
        super().__init__()
        if min(dim, num_heads, d_qk, d_v, width) <= 0:
            raise ValueError(f"HSTULayer sizes must be > 0: dim={dim} heads={num_heads} d_qk={d_qk} d_v={d_v} width={width}")
        if attention_norm not in ATTENTION_NORMS:
            raise ValueError(f"HSTULayer attention_norm must be one of {ATTENTION_NORMS}, got {attention_norm!r}")
        self.dim, self.num_heads, self.d_qk, self.d_v, self.width, self.eps = dim, num_heads, d_qk, d_v, width, eps
        self.attention_norm, self.index, self.query_key_map = attention_norm, index, query_key_map
        # FuXi-alpha's bias channels (position, time: those whose bias is on) beside the semantic one, which
        # FuXi-beta's attention-free block (multi_channel without the query-key map) drops
        self.bias_channels = int(use_position_bias) + int(use_time_bias) if multi_channel else 0
        self.semantic = query_key_map or not multi_channel  # SiLU(Q Kᵀ + rab) / n · V (rab alone without the map)
        self.channels = int(self.semantic) + self.bias_channels
        hu = self.channels * num_heads * d_v  # U's width, that of the concatenated channels
        self.uvqk = nn.Linear(dim, hu + num_heads * d_v + 2 * num_heads * (d_qk if query_key_map else 0), bias=False)
        self.o = nn.Linear(hu, dim)
        self.rel_bias = RelativeBias(width=width, num_buckets=num_buckets, use_position=use_position_bias, use_time=use_time_bias)
        self.dropout = nn.Dropout(dropout)
        self.ffn = SwiGLUFFN(dim, ffn_hidden, dropout, eps) if ffn_hidden > 0 else None
        # Initialisation as in the reference implementation: W_uvqk ~ N(0, 0.02²), W_o Xavier-uniform.
        nn.init.normal_(self.uvqk.weight, std=0.02)
        nn.init.xavier_uniform_(self.o.weight)

    def project(self, x: torch.Tensor, kernels: KernelSet = REFERENCE) -> tuple[torch.Tensor, ...]:
        """U, V, Q, K = Split(SiLU(LN(X) · W_uvqk)) (eq. 1): (B, T, d) -> u, v (B, T, H*d_v), q, k (B, T, H*d_qk).
        Without the query-key map (``query_key_map`` False) W_uvqk gives U, V only and q, k are zeros
        (a stride-0 view, nothing allocated), so that every kernel's Q Kᵀ + rab is rab.

        A plain float ``nn.Linear`` runs the backend's (possibly fused) ``kernels.uvqk`` on its weight;
        any other projection module runs itself (quant/int8.Int8Linear keeps no float weight), and so
        does a Linear with forward hooks (quant.calibrate's layer report), which then see every call."""
        lin = self.uvqk
        fusable = self.query_key_map and self.bias_channels == 0 and type(lin) is nn.Linear
        if fusable and not (lin._forward_hooks or lin._forward_pre_hooks):
            return kernels.uvqk(x, self.uvqk.weight, num_heads=self.num_heads, d_qk=self.d_qk, d_v=self.d_v, eps=self.eps)
        h = self.uvqk(F.layer_norm(x, (self.dim,), eps=self.eps))  # (B, T, 2H(d_v+d_qk))
        h = F.silu(h, inplace=not h.requires_grad)  # in place at inference (no grad)
        hv, hq = self.num_heads * self.d_v, self.num_heads * self.d_qk
        if not self.query_key_map:
            zero = h.new_zeros(()).expand(*h.shape[:-1], hq)  # (B, T, H*d_qk), stride 0
            return (*torch.split(h, [self.channels * hv, hv], dim=-1), zero, zero)
        return torch.split(h, [self.channels * hv, hv, hq, hq], dim=-1)

    def heads(self, t: torch.Tensor, d: int) -> torch.Tensor:
        B, T, _ = t.shape
        if T == 1:  # a decode row: the same layout as a plain view (one op instead of two)
            return t.view(B, self.num_heads, 1, d)  # (B, H, 1, d)
        return t.view(B, T, self.num_heads, d).transpose(1, 2)  # (B, H, T, d)

    def relative_bias(self, meta: AttentionMeta, dtype: torch.dtype) -> torch.Tensor:
        """rab of meta's (query, key) pairs with the mask folded in (kernels.decode_bias): the
        (B, T, S) ``dtype`` bias an AttentionMeta.bias holds, formed once for a decode loop."""
        rb, inside = self.rel_bias, self.bias_channels == 0  # multi-channel: the semantic scores' bias is the mask alone
        return meta.kernels.decode_bias(
            meta.q_pos,
            meta.k_pos,
            meta.k_valid,
            meta.tb,
            rb.pos_w if rb.use_position and inside else None,
            rb.ts_w if rb.use_time and meta.tb is not None and inside else None,
            dtype,
        )

    def forward(self, x: torch.Tensor, meta: AttentionMeta, kv: KVView | None = None) -> torch.Tensor:
        """The layer, for every path: T query rows against S keys (prefill and training T = S,
        extend T new rows after a cached prefix, decode T = 1); §3, eqs. 1-3.

        Args:
            x: (B, T, d) float input rows, padding rows 0.
            meta: positions, mask, time buckets, kernels (:class:`hstu.model.meta.AttentionMeta`).
            kv: the cache view this layer attends to, S rows; the T new keys / values are written
                into it in place where ``meta`` says. None: the keys are the T rows (training).
        Returns:
            (B, T, d), padding rows 0; (B, 1, d) when ``meta.rows`` picks one row per sequence.
        """
        u, v, q, k = self.project(x, meta.kernels)  # (B, T, H*d_v) x 2, (B, T, H*d_qk) x 2
        q, k, v = self.heads(q, self.d_qk), self.heads(k, self.d_qk), self.heads(v, self.d_v)  # (B, H, T, ·)
        own = KVView(k, v)  # this pass's rows
        if kv is None:
            kv = own  # S = T: training
        else:
            kv.append(k, v, meta)  # the T new rows into the cache; attend to its S rows
        if meta.rows is not None:  # only one row per sequence is read: its query alone
            B, H, _, _ = q.shape
            r = meta.rows.view(B, 1, 1)
            q = q.gather(2, r.unsqueeze(1).expand(B, H, 1, self.d_qk))  # (B, H, 1, d_qk)
            u, x = u.gather(1, r.expand(B, 1, u.shape[-1])), x.gather(1, r.expand(B, 1, self.dim))  # (B, 1, ·)
        fixed, one = self.attention_norm == "fixed", self.bias_channels == 0
        parts = []  # the channels' A·V, each (B, T, H*d_v) (or several side by side), concatenated
        if self.semantic:
            sem = hstu_attention(q, kv, meta, rel_bias=self.rel_bias, width=self.width, fixed_norm=fixed, layer_index=self.index, rab=one)
            parts.append(sem)
        if not one:  # FuXi-alpha's position and time channels (beside the semantic A·V): (B, T, channels*H*d_v)
            # a prefill's keys are its own rows (cache rows 0..T-1): read in the pass's (B, T, H*d_v) layout, where
            # one GEMM covers every head (kernels.reference.channels_av), not the cache's (B, H, S, d_v)
            src = own if meta.write_rows is None and meta.write_slot is None and kv.v.shape[2] == v.shape[2] else kv
            parts += multi_channel(src, meta, rel_bias=self.rel_bias, layer_index=self.index)
        av = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        h = meta.kernels.ln_mul(av, u, eps=self.eps)  # U ⊙ LN(A·V), (B, T, channels*H*d_v)
        y = x + self.o(self.dropout(h) if self.training else h)  # Y = X + W_o · Dropout(U ⊙ LN(A·V)), (B, T, d)
        y = y if self.ffn is None else self.ffn(y)  # FuXi-alpha's second FFN stage, row by row
        return y if meta.valid is None or meta.rows is not None else y * meta.valid  # (B, T, d)


class HSTUModel(SequentialRecommender):
    """Embeddings + HSTU blocks + L2-normalised output, with scoring by cosine / temperature
    (embeddings, checks and scoring in :class:`hstu.model.base.SequentialRecommender`).

    The item table comes from ``cfg.item_table`` (:func:`hstu.model.base.build_item_table`) unless
    ``item_embedding`` is passed in; it maps (…) int64 ids to (…, d) rows and has row 0 for padding.
    """

    def __init__(self, cfg: ModelConfig, *, item_embedding: nn.Module | None = None, device: str | torch.device | None = None) -> None:
        super().__init__(cfg, item_embedding=item_embedding, device=device)  # device: a hashed item table's compute device
        d, N = cfg.embedding_dim, cfg.width
        self.layers = nn.ModuleList(
            HSTULayer(
                dim=d,
                num_heads=cfg.num_heads,
                d_qk=cfg.d_qk,
                d_v=cfg.d_v,
                width=N,
                num_buckets=cfg.num_time_buckets,
                dropout=cfg.dropout,
                eps=cfg.layer_norm_eps,
                use_position_bias=cfg.use_position_bias,
                use_time_bias=cfg.use_time_bias,
                attention_norm=cfg.attention_norm,
                query_key_map=cfg.query_key_map,
                ffn_hidden=cfg.ffn_hidden,
                multi_channel=cfg.multi_channel,
                index=i,
            )
            for i in range(cfg.num_blocks)
        )
        self._kernels: tuple[Backend, KernelSet] | None = None  # (platform, set) resolved for; see ``kernels``

    @property
    def kernels(self) -> KernelSet:
        """The kernel set of :meth:`encode` / :meth:`step` and the engine's default: ``cfg.attention``
        ([model] attention) resolved by :func:`hstu.model.kernels.get_kernels` for the backend of the
        device the parameters are on, again after a move to another device; or the set assigned here.

        Raises:
            ValueError / BackendUnavailableError naming ``[model] attention``: no such set on this backend,
            or a named set that cannot run here (e.g. "triton" on the CPU without TRITON_INTERPRET=1).
        """
        platform = for_device(self.pos_emb.weight.device)
        if self._kernels is None or self._kernels[0] is not platform:
            kset = get_kernels(platform.name, self.cfg.attention, field="[model] attention")
            level = logging.DEBUG if kset.name == "reference" else logging.INFO  # a fused set is worth a line
            log.log(level, "[model] attention = %r on %s: kernel set %r (%s)", self.cfg.attention, platform.device, kset.name, kset.note)
            self._kernels = (platform, kset)
        return self._kernels[1]

    @kernels.setter
    def kernels(self, kset: KernelSet) -> None:
        self._kernels = (for_device(self.pos_emb.weight.device), kset)

    def to(self, *args, **kwargs) -> HSTUModel:
        """``nn.Module.to``, then :attr:`kernels` resolved for the new device, so that a ``[model]
        attention`` that cannot run there fails at the move (train, eval, generate and serve all move
        the built model to their device before anything is written), not at the first batch."""
        out = super().to(*args, **kwargs)
        _ = out.kernels
        return out

    def _init_extra_heads(self) -> None:
        c = self.cfg
        self.repeat = RepeatBias(c.repeat_window, c.num_actions, c.embedding_dim, c.temperature) if c.repeat_window > 0 else None

    # ----- input -----
    def buckets(self, timestamps: torch.Tensor) -> torch.Tensor:
        return time_buckets(timestamps, self.cfg.num_time_buckets, self.cfg.time_bucket_log_base)

    def attention_meta(self, timestamps: torch.Tensor, valid: torch.Tensor, segments: torch.Tensor | None = None) -> AttentionMeta:
        """The metadata of a full padded pass (training, evaluation, a plain prefill): row i at
        position i attends rows 0..i. timestamps (B, W) int64 seconds as :meth:`encode`;
        valid (B, W, 1) float, 1 at live rows. ``segments`` (B, W) int64, packed training rows:
        row i attends the rows of its own segment up to i, positions count within the segment
        (:func:`hstu.model.meta.segment_positions`); time buckets are formed over the whole row,
        and within a segment they are the padded pass's, except at its last row, whose query time
        is the next segment's first (a row that predicts nothing and only it attends)."""
        tb = self.buckets(timestamps) if self.cfg.use_time_bias else None  # (B, W, W)
        if segments is not None:
            pos = segment_positions(segments)  # (B, W)
            return AttentionMeta(q_pos=pos, k_pos=pos, tb=tb, valid=valid, kernels=self.kernels, segments=segments)
        pos = torch.arange(timestamps.shape[1], device=timestamps.device)  # (W,)
        return AttentionMeta(q_pos=pos, k_pos=pos, tb=tb, valid=valid, kernels=self.kernels)

    # ----- encoder (encode: SequentialRecommender.encode over attention_meta and forward_layers) -----
    def forward_layers(
        self, x: torch.Tensor, meta: AttentionMeta, kv: list[KVView] | None = None, last: AttentionMeta | None = None
    ) -> torch.Tensor:
        """Every block's :meth:`HSTULayer.forward` in order: (B, T, d) -> (B, T, d).

        ``kv``: one view per layer (or None); ``last``: the last layer's meta when it differs
        (a prefill computes only the user-vector row there, ``last.rows``: then (B, 1, d))."""
        n = len(self.layers)
        for li, layer in enumerate(self.layers):
            x = layer(x, last if last is not None and li == n - 1 else meta, None if kv is None else kv[li])
        return x

    def step_meta(self, pos: torch.Tensor, timestamps: torch.Tensor, t_query: torch.Tensor) -> AttentionMeta:
        """The metadata of :meth:`SequentialRecommender.step` (the oracle's decode step): one query row
        per sequence at ``pos`` (B,) int64, written there, against the S cached keys; time buckets of
        t_query (B,) against timestamps (B, S) int64 seconds (the new token's time already at pos)."""
        tb = None
        if self.cfg.use_time_bias:
            tb = time_buckets_row(t_query, timestamps, self.cfg.num_time_buckets, self.cfg.time_bucket_log_base).unsqueeze(1)  # (B, 1, S)
        k_pos = torch.arange(timestamps.shape[1], device=pos.device)
        return AttentionMeta(q_pos=pos.view(-1, 1), k_pos=k_pos, tb=tb, write_rows=pos.view(-1, 1), kernels=self.kernels)


def build_hstu(cfg: ModelConfig, **kwargs) -> HSTUModel:
    """The one builder; presets only fix numbers (config.PRESETS). ``cfg.architecture``
    "sasrec" builds the SASRec baseline, which has the same interface; ``cfg.item_table`` the item
    table (dense, or hashed on ``device=``: :func:`hstu.model.base.build_item_table`).
    Raises MemoryError naming the model's sizes when its tensors cannot be allocated (or a size overflows int64)."""
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"unknown ModelConfig.architecture {cfg.architecture!r}; valid: {', '.join(ARCHITECTURES)}")
    if cfg.architecture == "sasrec":
        from hstu.model.sasrec import SASRecModel as cls
    else:
        cls = HSTUModel
    try:
        return cls(cfg, **kwargs)
    except (RuntimeError, TypeError) as exc:  # the allocator's or the int64 unpacking's C++ message, made one line
        text = str(exc)
        if not (isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in text or "Overflow when unpacking" in text):
            raise
        names = ("num_items", "embedding_dim", "num_blocks", "num_heads", "d_qk", "d_v", "max_seq_len", "num_time_buckets", "ffn_hidden")
        sizes = ", ".join(f"{k} = {getattr(cfg, k)}" for k in names)  # every size a parameter's shape follows (a trial: the buckets)
        asked = re.search(r"allocate (\d+) bytes", text)
        why = "a tensor size overflows int64" if "Overflow" in text else text.splitlines()[0][-200:]
        why = f"one tensor needs {int(asked[1]) / 2**30:,.1f} GiB" if asked else why
        raise MemoryError(f"the model's tensors do not fit ({why}): [model] {sizes}; make them smaller") from None
