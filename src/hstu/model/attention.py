"""HSTU pointwise (SiLU) attention, square and causal by index: the test oracle of the kernels.

A = SiLU(Q Kᵀ + rab) / n ⊙ causal mask;  out = A · V     (Zhai et al. 2024, §3, eq. 2)

n is the model's fixed width N (not the live length), there is no 1/sqrt(d_qk) scaling and
no softmax, so softmax kernels (SDPA, FlashAttention, npu_fusion_attention) do not apply.
Symbols: B batch, H heads, W padded width (query rows), S key positions, d_qk, d_v.

The model runs :func:`hstu.model.kernels.reference.attention` (or a backend's set, chosen by
``[model] attention``, :mod:`hstu.model.kernels`), which forms the bias inside from positions and
time buckets; this function takes a whole (B, W, S) bias instead (built by
:class:`hstu.model.bias.RelativeBias`), a second way to the same values that tests compare with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hstu_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rab: torch.Tensor, *, n: int, causal: bool = True
) -> torch.Tensor:
    """Square HSTU attention with a precomputed bias (a test oracle; the model runs kernels/).

    Args:
        q: (B, H, W, d_qk); k: (B, H, S, d_qk); v: (B, H, S, d_v), float.
        rab: (B, W, S) relative bias, shared by the heads.
        n: divisor (the model's fixed width N).
        causal: zero A[i, j] for j > i (query row i at position i; needs W == S).
    Returns:
        (B, W, H * d_v): heads concatenated along the last axis.
    """
    B, H, W, _ = q.shape
    S = k.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2))  # (B, H, W, S)
    if s.requires_grad:
        a = F.silu(s + rab.unsqueeze(1)) / n  # (B, H, W, S)
        if causal:
            a = a * torch.ones(W, S, dtype=torch.bool, device=q.device).tril()
        out = torch.matmul(a, v)  # (B, H, W, d_v)
    else:  # inference: in place on the scores, 1/n applied to the (B, H, W, d_v) output
        a = F.silu(s.add_(rab.unsqueeze(1)), inplace=True)
        if causal:
            a.masked_fill_(torch.ones(W, S, dtype=torch.bool, device=q.device).triu_(1), 0.0)
        out = torch.matmul(a, v).div_(n)  # (B, H, W, d_v)
    return out.transpose(1, 2).reshape(B, W, H * v.shape[-1])  # (B, W, H*d_v)
