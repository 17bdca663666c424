"""Triton HSTU attention for CUDA, forward and backward: SiLU(QKᵀ + rab) / n ⊙ mask, then · V.

Zhai et al. 2024, §3, eq. 2. No softmax, so there is no running max / normaliser as in
FlashAttention (Dao et al. 2022): each key block's contribution SiLU(s) / n · V simply adds
into the accumulator, and the backward needs no saved statistics either: it recomputes the
scores tile by tile from q, k and the two bias tables (FlashAttention-2's recomputation, Dao 2023,
§3.1.2), so the (B, H, T, S) scores, weights or bias are never written to memory in either pass.
The relative bias is formed inside the kernels from the position table (by key - query position)
and the time table (by a precomputed bucket index).

Backward, per (batch, head) with dO the output gradient, a = SiLU(s) / n, σ = sigmoid(s):
    dV_j = Σ_i a_ij dO_i                 dA_ij = dO_i · V_j
    dS_ij = dA_ij · σ(s_ij) (1 + s_ij (1 - σ(s_ij))) / n    (SiLU' ; 0 where masked)
    dQ_i = Σ_j dS_ij K_j                 dK_j = Σ_i dS_ij Q_i
    d pos_w[r] = Σ_{b,h,i,j: idx_ij = r} dS_ij     d ts_w[t] = Σ_{b,h,i,j: tb_ij = t} dS_ij
Two kernels, as FlashAttention-2's backward: one program per key block (``_by_key``: dK, dV,
each written once, no atomics) and one per query block (``_by_query`` with GRAD: dQ). The bias
tables' gradients are float32 atomic adds from ``_by_key``, which visits every (b, h, i, j) pair
exactly once. Chosen over writing dS and reducing it with torch: that needs the (B, H, T, S)
buffer this kernel exists to avoid (B = 128, H = 2, T = S = 200: 41 MB per layer in float32),
while the tables are 2N - 1 and nb + 1 floats that stay in L2. The cost is contention on those
few addresses and a summation order that varies between runs (float32 rounding only); both are
unmeasured on a GPU.

Status: **unverified on a GPU** unless ``VERIFIED_ON`` says otherwise. The arithmetic of both
passes is checked against the PyTorch reference on the CPU with Triton's interpreter
(``TRITON_INTERPRET=1``; tests/model/test_kernels.py, tests/model/test_attention_config.py,
which also trains a tiny model with ``[model] attention = "triton"``); a CUDA run of the same tests
marks it verified for that GPU. ``attention = "auto"`` picks it on CUDA where triton is installed.

Importable without triton, and triton is imported only when the kernel runs (the kernels live in
``triton_jit.py``): ``available()`` says why it cannot run.

Grid: (ceil(rows / BLOCK), B * H): each program owns a block of query (or key) rows of one
(batch, head) and walks the other axis in blocks. Head widths are padded to powers of two >= 16
with masked loads (tl.dot needs each dimension >= 16); the last axis of q, k, v must have stride 1
(copied if not). ``input_precision="ieee"`` keeps float32 dots exact enough for a 1e-5
comparison (TF32 would not).
"""

from __future__ import annotations

import importlib.util
import os

import torch

# optional dependency: pip install triton (ships with CUDA wheels of torch); found, not imported
_IMPORT_ERROR: str | None = None if importlib.util.find_spec("triton") is not None else "triton is not installed; pip install triton"

# GPUs on which tests/model/test_kernels.py passed with this kernel; empty = unverified on any GPU.
VERIFIED_ON: tuple[str, ...] = ()


def available(device: torch.device | str | None = None) -> str | None:
    """None when the kernel can run on ``device`` (CUDA, or any device under the interpreter),
    else the reason."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return f"the Triton kernel runs on CUDA tensors (got {dev}); set TRITON_INTERPRET=1 to run it on the CPU interpreter"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


def attention(q, k, v, *, q_pos, k_pos, k_valid, tb, pos_w, ts_w, n: int) -> torch.Tensor:
    """:func:`hstu.model.kernels.reference.attention` (same arguments, shapes and result: (B, T, H * d_v))
    on Triton, differentiable in q, k, v, pos_w and ts_w (the backward kernels of ``triton_jit.py``).

    Raises:
        RuntimeError: triton missing, or tensors not on CUDA outside the interpreter.
    """
    from hstu.model.kernels.triton_jit import _HSTUAttention  # imports triton: only where the kernel runs

    return _HSTUAttention.apply(q, k, v, pos_w, ts_w, tb if ts_w is not None else None, q_pos, k_pos, k_valid, n)
