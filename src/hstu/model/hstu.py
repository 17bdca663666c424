"""HSTU encoder: Hierarchical Sequential Transduction Units (Zhai et al. 2024, §3).

Symbols: B batch, W padded width (<= N), N = max_seq_len + max_output_len the fixed width,
d embedding width, H heads, d_qk / d_v per-head widths, S KV-cache capacity (<= N).

Per layer, for input X (B, W, d)                                        (§3, eqs. 1-3)
    U, V, Q, K = Split(SiLU(LN(X) · W_uvqk))        split order u, v, q, k
    A = SiLU(Q Kᵀ + rab) / n ⊙ causal mask           (see attention.py, bias.py)
        n = N for every row ("fixed", the reference), or i + 1 for row i ("causal", an ablation)
    Y = X + W_o · Dropout(U ⊙ LN(A · V))
Rows at positions >= length are zero after every layer, so padding never changes live rows.
Input: item_emb · √d + pos_emb (+ action and category embeddings); output rows L2-normalised.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from hstu.config import ATTENTION_NORMS, ModelConfig
from hstu.model.attention import AttentionFn, hstu_attention_reference
from hstu.model.base import SequentialRecommender, l2_normalize
from hstu.model.repeat import RepeatBias
from hstu.model.bias import RelativeBias, time_buckets, time_buckets_row


class HSTULayer(nn.Module):
    """One HSTU block. Keyword-only sizes, checked at construction."""

    def __init__(self, *, dim: int, num_heads: int, d_qk: int, d_v: int, width: int, num_buckets: int,
                 dropout: float = 0.0, eps: float = 1e-6, use_position_bias: bool = True, use_time_bias: bool = True,
                 attention_norm: str = "fixed") -> None:
        super().__init__()
        if min(dim, num_heads, d_qk, d_v, width) <= 0:
            raise ValueError(f"HSTULayer sizes must be > 0: dim={dim} heads={num_heads} d_qk={d_qk} d_v={d_v} width={width}")
        if attention_norm not in ATTENTION_NORMS:
            raise ValueError(f"HSTULayer attention_norm must be one of {ATTENTION_NORMS}, got {attention_norm!r}")
        self.dim, self.num_heads, self.d_qk, self.d_v, self.width, self.eps = dim, num_heads, d_qk, d_v, width, eps
        self.attention_norm = attention_norm
        self.uvqk = nn.Linear(dim, 2 * num_heads * (d_v + d_qk), bias=False)
        self.o = nn.Linear(num_heads * d_v, dim)
        self.rel_bias = RelativeBias(width=width, num_buckets=num_buckets, use_position=use_position_bias, use_time=use_time_bias)
        self.dropout = nn.Dropout(dropout)
        # Initialisation as in the reference implementation: W_uvqk ~ N(0, 0.02²), W_o Xavier-uniform.
        nn.init.normal_(self.uvqk.weight, std=0.02)
        nn.init.xavier_uniform_(self.o.weight)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, W, d) -> u (B, W, H*d_v), v (B, W, H*d_v), q (B, W, H*d_qk), k (B, W, H*d_qk)."""
        h = self.uvqk(F.layer_norm(x, (self.dim,), eps=self.eps))  # (B, W, 2H(d_v+d_qk))
        h = F.silu(h, inplace=not h.requires_grad)  # in place at inference (no grad)
        hv, hq = self.num_heads * self.d_v, self.num_heads * self.d_qk
        return torch.split(h, [hv, hv, hq, hq], dim=-1)

    def output(self, x: torch.Tensor, u: torch.Tensor, av: torch.Tensor) -> torch.Tensor:
        """Y = X + W_o · Dropout(U ⊙ LN(A·V)); all (B, W, ·)."""
        return x + self.o(self.dropout(u * F.layer_norm(av, (av.shape[-1],), eps=self.eps)))

    def heads(self, t: torch.Tensor, d: int) -> torch.Tensor:
        B, W, _ = t.shape
        return t.view(B, W, self.num_heads, d).transpose(1, 2)  # (B, H, W, d)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, valid: torch.Tensor, attn: AttentionFn = hstu_attention_reference,
                kv_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Full (prefill) pass.

        Args:
            x: (B, W, d) float, padding rows 0.
            buckets: (B, W, W) int64 time buckets.
            valid: (B, W, 1) float, 1 at live rows.
            attn: HSTU attention implementation (reference by default).
            kv_out: optional cache views (B, H, S, d_qk) and (B, H, S, d_v), S >= W; keys and
                values of rows 0..W-1 are written into them in place.
        Returns:
            (B, W, d), padding rows 0.
        """
        u, v, q, k = self.project(x)
        q, k, v = self.heads(q, self.d_qk), self.heads(k, self.d_qk), self.heads(v, self.d_v)  # (B, H, W, ·)
        if kv_out is not None:
            W = x.shape[1]
            kv_out[0][:, :, :W].copy_(k)
            kv_out[1][:, :, :W].copy_(v)
        rab = self.rel_bias(buckets)  # (B, W, W)
        if self.attention_norm == "fixed":
            av = attn(q, k, v, rab, n=self.width)  # (B, W, H*d_v)
        else:  # row i attends keys 0..i: n_i = i + 1, a per-row scale applied to A·V (any kernel, n = 1)
            W = x.shape[1]
            av = attn(q, k, v, rab, n=1) / torch.arange(1, W + 1, device=x.device, dtype=x.dtype).view(1, W, 1)
        return self.output(x, u, av) * valid  # (B, W, d)

    def step(self, x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, buckets_row: torch.Tensor) -> torch.Tensor:
        """One decode step: the row at position ``pos`` attends to cached rows 0..pos.

        Args:
            x: (B, d) the new row's input.
            pos: (B,) int64 its position (< S).
            k_cache, v_cache: (B, H, S, d_qk), (B, H, S, d_v); row ``pos`` is written in place.
            buckets_row: (B, S) int64 time buckets of this row against keys 0..S-1.
        Returns:
            (B, d) the row's output.
        """
        B, S = buckets_row.shape
        u, v, q, k = self.project(x.unsqueeze(1))  # (B, 1, ·)
        bidx = torch.arange(B, device=x.device)
        k_cache[bidx, :, pos] = k.view(B, self.num_heads, self.d_qk)
        v_cache[bidx, :, pos] = v.view(B, self.num_heads, self.d_v)
        q = q.view(B, self.num_heads, 1, self.d_qk)
        s = torch.matmul(q, k_cache.transpose(-1, -2)).squeeze(2)  # (B, H, S)
        s = s + self.rel_bias.row(pos, buckets_row).unsqueeze(1)  # (B, H, S)
        keep = torch.arange(S, device=x.device).view(1, S) <= pos.view(B, 1)  # (B, S)
        n = self.width if self.attention_norm == "fixed" else (pos + 1).to(s.dtype).view(B, 1, 1)
        a = F.silu(s) / n * keep.unsqueeze(1)  # (B, H, S)
        av = torch.matmul(a.unsqueeze(2), v_cache).reshape(B, 1, self.num_heads * self.d_v)  # (B, 1, H*d_v)
        return self.output(x.unsqueeze(1), u, av).squeeze(1)  # (B, d)


class HSTUModel(SequentialRecommender):
    """Embeddings + HSTU blocks + L2-normalised output, with scoring by cosine / temperature
    (embeddings, checks and scoring in :class:`hstu.model.base.SequentialRecommender`).

    ``item_embedding`` may be passed in (e.g. a ShardedEmbedding); it maps (…) int64 ids to
    (…, d) rows and has row 0 for padding.
    """

    def __init__(self, cfg: ModelConfig, *, item_embedding: nn.Module | None = None) -> None:
        super().__init__(cfg, item_embedding=item_embedding)
        d, N = cfg.embedding_dim, cfg.width
        self.layers = nn.ModuleList(
            HSTULayer(dim=d, num_heads=cfg.num_heads, d_qk=cfg.d_qk, d_v=cfg.d_v, width=N, num_buckets=cfg.num_time_buckets,
                      dropout=cfg.dropout, eps=cfg.layer_norm_eps, use_position_bias=cfg.use_position_bias, use_time_bias=cfg.use_time_bias,
                      attention_norm=cfg.attention_norm)
            for _ in range(cfg.num_blocks)
        )
        self.attention: AttentionFn = hstu_attention_reference

    def _init_extra_heads(self) -> None:
        c = self.cfg
        self.repeat = RepeatBias(c.repeat_window, c.num_actions, c.embedding_dim, c.temperature) if c.repeat_window > 0 else None

    # ----- input -----
    def buckets(self, timestamps: torch.Tensor) -> torch.Tensor:
        return time_buckets(timestamps, self.cfg.num_time_buckets, self.cfg.time_bucket_log_base)

    # ----- encoder -----
    def encode(self, ids: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor, *, actions: torch.Tensor | None = None,
               categories: torch.Tensor | None = None, kv_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               normalize: bool = True) -> torch.Tensor:
        """Run the encoder over padded sequences.

        Args:
            ids: (B, W) int64 dense item ids, oldest first, 0 after the sequence.
            timestamps: (B, W) int64 Unix seconds; position ``length`` (when < W) holds the
                query time used by the last live row's time bias; other padding is ignored.
            lengths: (B,) int64 live lengths (1..W).
            actions, categories: optional (B, W) int64 feature ids (0 = none).
            kv_cache: optional per-layer (k, v) views (B, H, S, d), S >= W, written in place.
            normalize: L2-normalise the output rows.
        Returns:
            (B, W, d) output rows (padding rows 0).
        Raises:
            TypeError: non-int64 inputs. ValueError: shapes disagree or W > N.
        """
        x, valid = self.inputs(ids, timestamps, lengths, actions, categories)  # (B, W, d), (B, W, 1)
        buckets = self.buckets(timestamps)  # (B, W, W)
        for li, layer in enumerate(self.layers):
            x = layer(x, buckets, valid, self.attention, None if kv_cache is None else kv_cache[li])
        return l2_normalize(x) if normalize else x

    def step(self, ids: torch.Tensor, pos: torch.Tensor, timestamps: torch.Tensor, t_query: torch.Tensor,
             kv_cache: list[tuple[torch.Tensor, torch.Tensor]], *, actions: torch.Tensor | None = None,
             categories: torch.Tensor | None = None) -> torch.Tensor:
        """Append one token per sequence through every layer using the KV cache.

        Args:
            ids: (B,) int64 new item ids; pos: (B,) int64 their positions.
            timestamps: (B, S) int64 cache timestamps, with the new token's time already at ``pos``.
            t_query: (B,) int64 the time the new row's bias compares against (its t[i+1]).
            kv_cache: per-layer (k, v) caches (B, H, S, d), rows < pos filled; row pos written.
        Returns:
            (B, d) L2-normalised output row of the new token.
        """
        x = self.embed(ids, pos, actions, categories)  # (B, d)
        brow = time_buckets_row(t_query, timestamps, self.cfg.num_time_buckets, self.cfg.time_bucket_log_base)  # (B, S)
        for li, layer in enumerate(self.layers):
            x = layer.step(x, pos, kv_cache[li][0], kv_cache[li][1], brow)
        return l2_normalize(x)


def build_hstu(cfg: ModelConfig, **kwargs) -> HSTUModel:
    """The one builder; presets only fix numbers (config.PRESETS). ``cfg.architecture``
    "sasrec" builds the SASRec baseline, which has the same interface."""
    if cfg.architecture == "sasrec":
        from hstu.model.sasrec import SASRecModel

        return SASRecModel(cfg, **kwargs)
    if cfg.architecture != "hstu":
        raise ValueError(f"unknown ModelConfig.architecture {cfg.architecture!r}; valid: hstu, sasrec")
    return HSTUModel(cfg, **kwargs)
