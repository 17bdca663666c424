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
from hstu.model.base import SequentialRecommender, l2_normalize


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

    def forward(self, x: torch.Tensor, valid: torch.Tensor, kv_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Full pass. x (B, W, d), valid (B, W, 1) float; kv_out: optional cache views
        (B, H, S, d_qk), (B, H, S, d_v), S >= W, rows 0..W-1 written in place. Returns (B, W, d)."""
        h = self.attn_norm(x)  # (B, W, d)
        q, k, v = self.heads(self.q(h), self.d_qk), self.heads(self.k(h), self.d_qk), self.heads(self.v(h), self.d_v)  # (B, H, W, ·)
        if kv_out is not None:
            W = x.shape[1]
            kv_out[0][:, :, :W].copy_(k)
            kv_out[1][:, :, :W].copy_(v)
        av = sasrec_attention(q, k, v, dropout_p=self.p if self.training else 0.0)  # (B, W, H*d_v)
        s = x + self.dropout(self.o(av))  # (B, W, d)
        return self.ffn(s) * valid  # (B, W, d)

    def step(self, x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One decode step (eval mode): x (B, d) at positions pos (B,) attends to cached rows
        0..pos; row ``pos`` of the caches (B, H, S, ·) is written in place. Returns (B, d)."""
        B = x.shape[0]
        S = k_cache.shape[2]
        h = self.attn_norm(x)  # (B, d)
        bidx = torch.arange(B, device=x.device)
        k_cache[bidx, :, pos] = self.k(h).view(B, self.num_heads, self.d_qk)
        v_cache[bidx, :, pos] = self.v(h).view(B, self.num_heads, self.d_v)
        q = self.q(h).view(B, self.num_heads, 1, self.d_qk)  # (B, H, 1, d_qk)
        s = torch.matmul(q, k_cache.transpose(-1, -2)).squeeze(2) / math.sqrt(self.d_qk)  # (B, H, S)
        keep = torch.arange(S, device=x.device).view(1, 1, S) <= pos.view(B, 1, 1)  # (B, 1, S)
        a = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)  # (B, H, S)
        av = torch.matmul(a.unsqueeze(2), v_cache).reshape(B, self.num_heads * self.d_v)  # (B, H*d_v)
        return self.ffn(x + self.o(av))  # (B, d)


class SASRecModel(SequentialRecommender):
    """SASRec encoder with HSTUModel's interface (encode / last_rows / step / item_vectors /
    score_all / score_items, item_emb, pos_emb, action_emb, category_emb, action_head, layers, cfg).

    ``cfg.architecture`` must be "sasrec"; ``num_time_buckets`` and the bias switches are unused.
    """

    def __init__(self, cfg: ModelConfig, *, item_embedding: nn.Module | None = None) -> None:
        super().__init__(cfg, item_embedding=item_embedding)
        d = cfg.embedding_dim
        self.layers = nn.ModuleList(
            SASRecBlock(dim=d, num_heads=cfg.num_heads, d_qk=cfg.d_qk, d_v=cfg.d_v, dropout=cfg.dropout, eps=cfg.layer_norm_eps)
            for _ in range(cfg.num_blocks)
        )
        self.final_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attention = sasrec_attention

    def encode(self, ids: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor, *, actions: torch.Tensor | None = None,
               categories: torch.Tensor | None = None, kv_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               normalize: bool = True) -> torch.Tensor:
        """Run the encoder over padded sequences (same contract as HSTUModel.encode).

        Args:
            ids: (B, W) int64 dense item ids, oldest first, 0 after the sequence.
            timestamps: (B, W) int64, checked for shape and ignored (no time features).
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
        for li, layer in enumerate(self.layers):
            x = layer(x, valid, None if kv_cache is None else kv_cache[li])  # (B, W, d)
        x = self.final_norm(x) * valid  # (B, W, d)
        return l2_normalize(x) if normalize else x

    def step(self, ids: torch.Tensor, pos: torch.Tensor, timestamps: torch.Tensor, t_query: torch.Tensor,
             kv_cache: list[tuple[torch.Tensor, torch.Tensor]], *, actions: torch.Tensor | None = None,
             categories: torch.Tensor | None = None) -> torch.Tensor:
        """Append one token per sequence using the KV cache (eval mode; same contract as
        HSTUModel.step, timestamps ignored). ids, pos: (B,) int64. Returns (B, d) L2-normalised."""
        x = self.embed(ids, pos, actions, categories)  # (B, d)
        for li, layer in enumerate(self.layers):
            x = layer.step(x, pos, kv_cache[li][0], kv_cache[li][1])  # (B, d)
        return l2_normalize(self.final_norm(x))
