"""SASRec baseline (Kang & McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018) with
the same interface as :class:`~hstu.model.hstu.HSTUModel`, so the training loop, evaluation and
generation treat both alike (same data, split, sampled-softmax loss, full-ranking evaluation).

Symbols: B batch, W padded width (<= N), N = max_seq_len + max_output_len, d embedding width,
H heads, d_qk / d_v per-head widths (``ModelConfig``), S KV-cache capacity.

Per block, for input X (B, W, d)                                   (Kang & McAuley 2018, §III-B..D)
    g(x) = x + Dropout(g(LayerNorm(x)))              residual + layer norm + dropout, §III-D
    S = X + Dropout(MHA(LN(X)))                      causal softmax attention, Q K V = LN(X)·W
    Y = S + Dropout(FFN(LN(S)))                      FFN = W2 · Dropout(ReLU(W1 · x)), d → d → d
Input: item_emb · √d + pos_emb (+ action and category embeddings, as HSTUModel, so both models
see the same tokens); output: LN of the last block, L2-normalised (as in the HSTU paper's SASRec
runs with sampled softmax, Zhai et al. 2024 §4.1.1). Timestamps are accepted and ignored:
SASRec has no time features. Rows at positions >= length are zero after every block.

Multi-head attention has its own projections (d → H·d_qk for Q and K, d → H·d_v for V, and an
output projection H·d_v → d), so the KV cache of :mod:`hstu.generate.kv_cache` fits it as is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hstu.config import ModelConfig
from hstu.model.base import SequentialRecommender
from hstu.model.kernels import REFERENCE, KernelSet
from hstu.model.meta import AttentionMeta, KVView


def sasrec_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal scaled dot-product softmax attention (Vaswani et al. 2017, eq. 1).

    Args:
        q, k: (B, H, W, d_qk); v: (B, H, W, d_v) float.
        dropout_p: dropout on the attention weights (training only).
    Returns:
        (B, W, H * d_v): heads concatenated along the last axis.
    """
    B, H, W, _ = q.shape
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, H, W, d_v)
    return out.transpose(1, 2).reshape(B, W, H * v.shape[-1])  # (B, W, H*d_v)


class SASRecBlock(nn.Module):
    """One SASRec block (pre-LN self-attention + point-wise feed-forward). Keyword-only sizes."""

    def __init__(self, *, dim: int, num_heads: int, d_qk: int, d_v: int, dropout: float = 0.0, eps: float = 1e-6) -> None:
        super().__init__()
        if min(dim, num_heads, d_qk, d_v) <= 0:
            raise ValueError(f"SASRecBlock sizes must be > 0: dim={dim} heads={num_heads} d_qk={d_qk} d_v={d_v}")
        self.dim, self.num_heads, self.d_qk, self.d_v, self.eps, self.p = dim, num_heads, d_qk, d_v, eps, dropout
        self.attn_norm = nn.LayerNorm(dim, eps=eps)
        self.q = nn.Linear(dim, num_heads * d_qk)
        self.k = nn.Linear(dim, num_heads * d_qk)
        self.v = nn.Linear(dim, num_heads * d_v)
        self.o = nn.Linear(num_heads * d_v, dim)
        self.ffn_norm = nn.LayerNorm(dim, eps=eps)
        self.ffn1 = nn.Linear(dim, dim)
        self.ffn2 = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)
        for lin in (self.q, self.k, self.v, self.o, self.ffn1, self.ffn2):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def heads(self, t: torch.Tensor, d: int) -> torch.Tensor:
        B, W, _ = t.shape
        return t.view(B, W, self.num_heads, d).transpose(1, 2)  # (B, H, W, d)

    def ffn(self, s: torch.Tensor) -> torch.Tensor:
        """S + Dropout(FFN(LN(S))); (…, d) -> (…, d)."""
        return s + self.dropout(self.ffn2(self.dropout(F.relu(self.ffn1(self.ffn_norm(s))))))

    def relative_bias(self, meta: AttentionMeta, dtype: torch.dtype) -> torch.Tensor:
        """SASRec has no relative bias: zeros (B, T, S) ``dtype`` for an AttentionMeta.bias (unread)."""
        B, T = meta.q_pos.shape  # (B, T) query positions of a decode loop
        return torch.zeros(B, T, meta.k_pos.shape[-1], dtype=dtype, device=meta.q_pos.device)

    def _scores(self, q: torch.Tensor, k: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """q·kᵀ / √d_qk (B, H, T, S), -inf where k_pos > q_pos or a key is not valid."""
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d_qk)  # (B, H, T, S)
        drop = meta.k_pos.unsqueeze(-2) > meta.q_pos.unsqueeze(-1)  # (B, T, S) or (T, S)
        if meta.k_valid is not None:
            drop = drop | ~meta.k_valid.unsqueeze(1)
        return s.masked_fill(drop.unsqueeze(-3), float("-inf"))

    def attention(self, q: torch.Tensor, kv: KVView, meta: AttentionMeta) -> torch.Tensor:
        """Causal softmax attention of T query rows (B, H, T, d_qk) against kv's S keys (and, for beams,
        one softmax over kv.shared's history keys too): (B, T, H*d_v)."""
        B, H, T, _ = q.shape
        full = meta.rows is None and meta.shared is None and meta.k_valid is None and kv.k.shape[2] == T
        if full:  # a square causal pass (training, prefill): the fused kernel
            return sasrec_attention(q, kv.k, kv.v, dropout_p=self.p if self.training else 0.0)  # (B, T, H*d_v)
        s = self._scores(q, kv.k, meta)  # (B, H, T, S)
        if meta.shared is None:
            av = torch.matmul(torch.softmax(s, dim=-1), kv.v)  # (B, H, T, d_v)
            return av.transpose(1, 2).reshape(B, T, H * self.d_v)
        G = meta.shared.q_pos.shape[-1]  # beams per user; decode rows T = 1
        qh = q.transpose(1, 2).reshape(B // G, G, H, -1).transpose(1, 2)  # (B / G, H, G, d_qk)
        s_h = self._scores(qh, kv.shared.k, meta.shared).transpose(1, 2).reshape(B, H, 1, -1)  # (B, H, 1, S_h)
        a = torch.softmax(torch.cat([s_h, s], dim=-1), dim=-1)  # one softmax over both segments
        a_h, a_g = a.split([s_h.shape[-1], s.shape[-1]], dim=-1)
        av_h = torch.matmul(a_h.reshape(B // G, G, H, -1).transpose(1, 2), kv.shared.v)  # (B / G, H, G, d_v)
        av = av_h.transpose(1, 2).reshape(B, 1, H * self.d_v) + torch.matmul(a_g, kv.v).transpose(1, 2).reshape(B, 1, H * self.d_v)
        return av  # (B, 1, H*d_v)

    def forward(self, x: torch.Tensor, meta: AttentionMeta, kv: KVView | None = None) -> torch.Tensor:
        """The block for every path, as :meth:`hstu.model.hstu.HSTULayer.forward`: x (B, T, d) against
        S keys (kv None: this pass's rows; else the cache view, new rows written where meta says).
        Returns (B, T, d), padding rows 0; (B, 1, d) when ``meta.rows`` picks one row."""
        h = self.attn_norm(x)  # (B, T, d)
        q, k, v = self.heads(self.q(h), self.d_qk), self.heads(self.k(h), self.d_qk), self.heads(self.v(h), self.d_v)  # (B, H, T, ·)
        if kv is None:
            kv = KVView(k, v)
        else:
            kv.append(k, v, meta)
        if meta.rows is not None:  # only one row per sequence is read
            B, H, _, _ = q.shape
            r = meta.rows.view(B, 1, 1)
            q, x = q.gather(2, r.unsqueeze(1).expand(B, H, 1, self.d_qk)), x.gather(1, r.expand(B, 1, self.dim))
        s = x + self.dropout(self.o(self.attention(q, kv, meta)))  # (B, T, d)
        y = self.ffn(s)  # (B, T, d)
        return y if meta.valid is None or meta.rows is not None else y * meta.valid


class SASRecModel(SequentialRecommender):
    """SASRec encoder with HSTUModel's interface (encode / last_rows / step / item_vectors /
    score_all / score_items, item_emb, pos_emb, action_emb, category_emb, action_head, layers, cfg).

    ``cfg.architecture`` must be "sasrec"; ``num_time_buckets`` and the bias switches are unused.
    """

    def __init__(self, cfg: ModelConfig, *, item_embedding: nn.Module | None = None, device: str | torch.device | None = None) -> None:
        super().__init__(cfg, item_embedding=item_embedding, device=device)  # device: a hashed item table's compute device
        d = cfg.embedding_dim
        self.layers = nn.ModuleList(
            SASRecBlock(dim=d, num_heads=cfg.num_heads, d_qk=cfg.d_qk, d_v=cfg.d_v, dropout=cfg.dropout, eps=cfg.layer_norm_eps)
            for _ in range(cfg.num_blocks)
        )
        self.final_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attention = sasrec_attention
        # the set an engine's metadata carries (as HSTUModel.kernels); SASRec's blocks run their own
        # softmax attention and read none of it
        self.kernels: KernelSet = REFERENCE

    def attention_meta(self, timestamps: torch.Tensor, valid: torch.Tensor) -> AttentionMeta:
        """The metadata of a full padded pass (as HSTUModel's; no time buckets): row i attends rows
        0..i. timestamps (B, W) int64 (shape only); valid (B, W, 1) float, 1 at live rows."""
        pos = torch.arange(timestamps.shape[1], device=timestamps.device)  # (W,)
        return AttentionMeta(q_pos=pos, k_pos=pos, valid=valid)

    def forward_layers(
        self, x: torch.Tensor, meta: AttentionMeta, kv: list[KVView] | None = None, last: AttentionMeta | None = None
    ) -> torch.Tensor:
        """Every block's forward, then the final LayerNorm: (B, T, d) -> (B, T, d), or (B, 1, d)
        with ``last.rows`` (the contract of :meth:`hstu.model.hstu.HSTUModel.forward_layers`)."""
        n = len(self.layers)
        for li, layer in enumerate(self.layers):
            x = layer(x, last if last is not None and li == n - 1 else meta, None if kv is None else kv[li])
        return self.final_norm(x)

    def step_meta(self, pos: torch.Tensor, timestamps: torch.Tensor, t_query: torch.Tensor) -> AttentionMeta:
        """As HSTUModel.step_meta without time buckets (timestamps (B, S): the key count only)."""
        return AttentionMeta(q_pos=pos.view(-1, 1), k_pos=torch.arange(timestamps.shape[1], device=pos.device), write_rows=pos.view(-1, 1))
