"""HSTU pointwise (SiLU) attention: the PyTorch reference and a per-backend registry.

A = SiLU(Q Kᵀ + rab) / n ⊙ causal mask;  out = A · V     (Zhai et al. 2024, §3, eq. 2)

n is the model's fixed width N (not the live length), there is no 1/sqrt(d_qk) scaling and
no softmax, so softmax kernels (SDPA, FlashAttention, npu_fusion_attention) do not apply.
Symbols: B batch, H heads, W padded width (query rows), S key positions, d_qk, d_v.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[..., torch.Tensor]


def hstu_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rab: torch.Tensor, *, n: int, causal: bool = True
) -> torch.Tensor:
    """Reference HSTU attention (the oracle and fallback of every backend).

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


_REGISTRY: dict[str, dict[str, AttentionFn]] = {
    "cpu": {"reference": hstu_attention_reference},
    "cuda": {"reference": hstu_attention_reference},
    "npu": {"reference": hstu_attention_reference},
}


def _load_kernel_sets() -> None:
    """Import hstu.model.kernels once, which registers its backends' square-attention variants
    ("triton" on cuda, "npu" on npu) here; imported lazily because it imports this module."""
    import hstu.model.kernels  # noqa: F401


def register_attention(backend: str, name: str, fn: AttentionFn) -> None:
    """Add an HSTU attention implementation for a backend ("cpu" | "cuda" | "npu")."""
    if backend not in _REGISTRY:
        raise ValueError(f"unknown backend {backend!r}; valid: {sorted(_REGISTRY)}")
    _REGISTRY[backend][name] = fn


def get_attention(backend: str, name: str = "reference") -> AttentionFn:
    """Look up an implementation; ValueError lists the valid names for that backend."""
    _load_kernel_sets()
    impls = _REGISTRY.get(backend)
    if impls is None:
        raise ValueError(f"unknown backend {backend!r}; valid: {sorted(_REGISTRY)}")
    if name not in impls:
        raise ValueError(f"no HSTU attention {name!r} for backend {backend!r}; valid: {sorted(impls)}")
    return impls[name]


def available_attention(backend: str) -> list[str]:
    _load_kernel_sets()
    return sorted(_REGISTRY.get(backend, {}))
