"""Triton HSTU attention for CUDA: SiLU(QKᵀ + rab) / n ⊙ mask, then · V, in one kernel.

Zhai et al. 2024, §3, eq. 2. No softmax, so there is no running max / normaliser as in
FlashAttention (Dao et al. 2022): each key block's contribution SiLU(s) / n · V simply adds
into the accumulator. The relative bias is formed inside the kernel from the two small tables
(position bias by key - query position, time bias by a precomputed bucket index), so the
(B, T, S) float bias is never written to memory.

Status: **off by default and unverified on a GPU** unless ``VERIFIED_ON`` says otherwise. The
kernel's arithmetic is checked against the PyTorch reference on the CPU with Triton's
interpreter (``TRITON_INTERPRET=1``, tests/model/test_kernels.py) where the ``triton`` package is
installed; a CUDA run of the same test marks it verified for that GPU. The engine only uses it
when asked for by name (``kernels="triton"``).

Importable without triton: ``available()`` says why it cannot run.

Grid: (ceil(T / BLOCK_M), B * H). Each program owns BLOCK_M query rows of one (batch, head)
and walks the keys in blocks of BLOCK_N. Head widths are padded to powers of two >= 16 with
masked loads (tl.dot needs each dimension >= 16). ``input_precision="ieee"`` keeps float32
dots exact enough for a 1e-5 comparison (TF32 would not).
"""

from __future__ import annotations

import os

import torch

try:  # optional dependency: pip install triton (ships with CUDA wheels of torch)
    import triton
    import triton.language as tl

    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _IMPORT_ERROR = f"triton is not installed ({exc}); pip install triton"

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


if triton is not None:

    @triton.jit
    def _hstu_attn_fwd(
        Q,
        K,
        V,
        RAB,
        TB,
        QP,
        KP,
        KVALID,
        POSW,
        TSW,
        OUT,
        s_qb,
        s_qh,
        s_qt,
        s_qd,
        s_kb,
        s_kh,
        s_ks,
        s_kd,
        s_vb,
        s_vh,
        s_vs,
        s_vd,
        s_rb,
        s_rt,
        s_rs,
        s_tbb,
        s_tbt,
        s_tbs,
        s_qpb,
        s_kpb,
        s_kvb,
        s_ob,
        s_ot,
        T,
        S,
        H,
        DQK,
        DV,
        inv_n,
        pos_off,
        pos_max,
        HAS_RAB: tl.constexpr,
        HAS_POS: tl.constexpr,
        HAS_TS: tl.constexpr,
        HAS_VALID: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_DQK: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_dq = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_ok = offs_m < T
        q = tl.load(
            Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qt + offs_dq[None, :] * s_qd,
            mask=m_ok[:, None] & (offs_dq[None, :] < DQK),
            other=0.0,
        )  # (M, Dqk)
        qp = tl.load(QP + b * s_qpb + offs_m, mask=m_ok, other=0)  # (M,) query positions
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
        for n0 in range(0, S, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < S
            k = tl.load(
                K + b * s_kb + h * s_kh + offs_n[:, None] * s_ks + offs_dq[None, :] * s_kd,
                mask=n_ok[:, None] & (offs_dq[None, :] < DQK),
                other=0.0,
            )  # (N, Dqk)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N) float32
            kp = tl.load(KP + b * s_kpb + offs_n, mask=n_ok, other=0)  # (N,) key positions
            rel = kp[None, :] - qp[:, None]  # (M, N)
            keep = (rel <= 0) & m_ok[:, None] & n_ok[None, :]
            if HAS_VALID:
                kv = tl.load(KVALID + b * s_kvb + offs_n, mask=n_ok, other=0)
                keep = keep & (kv[None, :] != 0)
            if HAS_RAB:
                s += tl.load(RAB + b * s_rb + offs_m[:, None] * s_rt + offs_n[None, :] * s_rs, mask=keep, other=0.0)
            if HAS_POS:
                idx = tl.minimum(tl.maximum(rel + pos_off, 0), pos_max)
                s += tl.load(POSW + idx, mask=keep, other=0.0)
            if HAS_TS:
                tb = tl.load(TB + b * s_tbb + offs_m[:, None] * s_tbt + offs_n[None, :] * s_tbs, mask=keep, other=0)
                s += tl.load(TSW + tb, mask=keep, other=0.0)
            a = tl.where(keep, s * tl.sigmoid(s) * inv_n, 0.0)  # SiLU(s) / n, masked
            v = tl.load(
                V + b * s_vb + h * s_vh + offs_n[:, None] * s_vs + offs_dv[None, :] * s_vd,
                mask=n_ok[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )  # (N, Dv)
            acc += tl.dot(a.to(v.dtype), v, input_precision=PRECISION)
        tl.store(
            OUT + b * s_ob + offs_m[:, None] * s_ot + h * DV + offs_dv[None, :],
            acc.to(OUT.dtype.element_ty),
            mask=m_ok[:, None] & (offs_dv[None, :] < DV),
        )


def _pow2(x: int) -> int:
    return max(16, 1 << (int(x) - 1).bit_length())


def _launch(q, k, v, *, rab=None, tb=None, q_pos, k_pos, k_valid, pos_w, ts_w, n: int, precision: str = "ieee") -> torch.Tensor:
    why = available(q.device)
    if why is not None:
        raise RuntimeError(f"Triton HSTU attention unavailable: {why}")
    B, H, T, dqk = q.shape
    S, dv = k.shape[2], v.shape[-1]
    out = torch.empty(B, T, H * dv, dtype=q.dtype, device=q.device)  # (B, T, H*d_v)
    q_pos = q_pos.expand(B, T).contiguous()
    k_pos = k_pos.expand(B, S).contiguous()
    dummy = q_pos  # any tensor: pointers of disabled inputs are never read
    kv = k_valid.to(torch.int8).contiguous() if k_valid is not None else dummy
    rab_t = rab if rab is not None else dummy
    tb_t = tb if tb is not None else dummy
    posw = pos_w.contiguous() if pos_w is not None else dummy
    tsw = ts_w.contiguous() if ts_w is not None else dummy
    rs = rab.stride() if rab is not None else (0, 0, 0)
    ts = tb.stride() if tb is not None else (0, 0, 0)
    BLOCK_M = 16 if T <= 16 else 32
    BLOCK_N = 32
    grid = (triton.cdiv(T, BLOCK_M), B * H)
    _hstu_attn_fwd[grid](
        q,
        k,
        v,
        rab_t,
        tb_t,
        q_pos,
        k_pos,
        kv,
        posw,
        tsw,
        out,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *rs,
        *ts,
        q_pos.stride(0),
        k_pos.stride(0),
        kv.stride(0) if k_valid is not None else 0,
        out.stride(0),
        out.stride(1),
        T,
        S,
        H,
        dqk,
        dv,
        1.0 / n,
        (posw.shape[0] - 1) // 2 if pos_w is not None else 0,
        posw.shape[0] - 1 if pos_w is not None else 0,
        HAS_RAB=rab is not None,
        HAS_POS=pos_w is not None,
        HAS_TS=ts_w is not None,
        HAS_VALID=k_valid is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_DQK=_pow2(dqk),
        BLOCK_DV=_pow2(dv),
        PRECISION=precision,
    )
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor | None,
    tb: torch.Tensor | None,
    pos_w: torch.Tensor | None,
    ts_w: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    """Same contract as :func:`hstu.model.kernels.reference.attention` (bias built in-kernel).

    Raises:
        RuntimeError: triton missing, or tensors not on CUDA outside the interpreter.
    """
    return _launch(q, k, v, tb=tb if ts_w is not None else None, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid, pos_w=pos_w, ts_w=ts_w, n=n)


def square_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rab: torch.Tensor, *, n: int, causal: bool = True) -> torch.Tensor:
    """The model-registry signature (hstu.model.attention.hstu_attention_reference) on Triton:
    q (B, H, W, d_qk), k/v (B, H, S, ·), rab (B, W, S) -> (B, W, H*d_v)."""
    B, H, W, _ = q.shape
    S = k.shape[2]
    qp = torch.arange(W, device=q.device)
    kp = torch.arange(S, device=q.device) if causal else torch.full((S,), -(2**40), dtype=torch.int64, device=q.device)
    return _launch(q, k, v, rab=rab, q_pos=qp, k_pos=kp, k_valid=None, pos_w=None, ts_w=None, n=n)
