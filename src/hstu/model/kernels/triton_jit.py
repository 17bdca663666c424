"""The Triton kernels and launch code of :mod:`hstu.model.kernels.triton_hstu` (its docstring has the
math, the grid and the status). Imported only when the Triton attention runs (``triton_hstu.attention``),
so that a CPU process never loads triton: its compiled extension prints reference-leak lines at exit.

Raises ImportError on import when triton is not installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hstu.model.kernels.triton_hstu import available


@triton.jit
def _ids(H, BLOCK: tl.constexpr):
    """(b, h, offs): this program's batch row and head (program_id 1) and its BLOCK rows (program_id 0)."""
    pid_bh = tl.program_id(1)
    return pid_bh // H, pid_bh % H, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _rows(PTR, st, b, h, offs, ok, offs_d, D):
    """(len(offs), len(offs_d)) tile of rows ``offs`` of (batch b, head h) of a (B, H, rows, D)
    tensor with strides st = (batch, head, row) and unit last stride; 0 outside."""
    return tl.load(
        PTR + b * st[0] + h * st[1] + offs[:, None] * st[2] + offs_d[None, :], mask=ok[:, None] & (offs_d[None, :] < D), other=0.0
    )


@triton.jit
def _store_rows(PTR, st, b, h, offs, ok, offs_d, D, x):
    tl.store(PTR + b * st[0] + h * st[1] + offs[:, None] * st[2] + offs_d[None, :], x, mask=ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _keys(K, V, KP, k_st, v_st, b, h, offs_n, S, offs_dq, offs_dv, DQK, DV):
    """The key block ``offs_n``: k (N, Dqk), v (N, Dv), key positions (N,) and which are in range."""
    n_ok = offs_n < S
    k = _rows(K, k_st, b, h, offs_n, n_ok, offs_dq, DQK)
    v = _rows(V, v_st, b, h, offs_n, n_ok, offs_dv, DV)
    return k, v, tl.load(KP + b * S + offs_n, mask=n_ok, other=0), n_ok


@triton.jit
def _tile(q, k, qp, kp, b, offs_m, offs_n, m_ok, n_ok, bias, tb_st, S, P, HAS: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of one (M query rows, N keys) tile: s = q·kᵀ + pos_w[pidx] + ts_w[tbv] (float32), the
    mask ``keep`` (key position <= query position, in range, key valid) and the bias indices
    pidx = clamp(k_pos - q_pos + (P - 1) / 2, 0, P - 1), tbv = the time buckets (pidx without a time
    bias). ``bias`` = (TB, QP, KP, KVALID, POSW, TSW) pointers; ``HAS`` the bits of the inputs present
    (1 position table, 2 time table, 4 key validity)."""
    TB, _, _, KVALID, POSW, TSW = bias
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N) float32
    rel = kp[None, :] - qp[:, None]  # (M, N)
    keep = (rel <= 0) & m_ok[:, None] & n_ok[None, :]
    if HAS & 4:
        keep = keep & (tl.load(KVALID + b * S + offs_n, mask=n_ok, other=0) != 0)[None, :]
    pidx = tl.minimum(tl.maximum(rel + (P - 1) // 2, 0), P - 1)
    if HAS & 1:
        s += tl.load(POSW + pidx, mask=keep, other=0.0)
    if HAS & 2:
        tbv = tl.load(TB + b * tb_st[0] + offs_m[:, None] * tb_st[1] + offs_n[None, :] * tb_st[2], mask=keep, other=0)
        s += tl.load(TSW + tbv, mask=keep, other=0.0)
    else:
        tbv = pidx
    return s, keep, pidx, tbv


@triton.jit
def _dscores(s, keep, da, inv_n):
    """dS = dA · SiLU'(s) / n, 0 where masked; SiLU'(s) = σ(s)(1 + s(1 - σ(s)))."""
    sig = tl.sigmoid(s)
    return tl.where(keep, da * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)


@triton.jit
def _by_query(
    Q,
    K,
    V,
    DO,
    bias,
    OUT,
    q_st,
    k_st,
    v_st,
    do_st,
    o_st,
    tb_st,
    dims,
    inv_n,
    GRAD: tl.constexpr,
    HAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One block of query rows against every key block: the forward out = Σ_j a_ij V_j (GRAD
    False, OUT (B, H, T, d_v)), or dQ = Σ_j dS_ij K_j (GRAD True, OUT (B, H, T, d_qk)).
    dims = (T, S, H, d_qk, d_v, P): rows, keys, heads, head widths, position table length."""
    T, S, H, DQK, DV, P = dims
    b, h, offs_m = _ids(H, BLOCK_M)
    offs_dq, offs_dv = tl.arange(0, BLOCK_DQK), tl.arange(0, BLOCK_DV)
    m_ok = offs_m < T
    q = _rows(Q, q_st, b, h, offs_m, m_ok, offs_dq, DQK)  # (M, Dqk)
    qp = tl.load(bias[1] + b * T + offs_m, mask=m_ok, other=0)  # (M,) query positions
    if GRAD:
        do = _rows(DO, do_st, b, h, offs_m, m_ok, offs_dv, DV)  # (M, Dv)
        acc = tl.zeros((BLOCK_M, BLOCK_DQK), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    for n0 in range(0, S, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k, v, kp, n_ok = _keys(K, V, bias[2], k_st, v_st, b, h, offs_n, S, offs_dq, offs_dv, DQK, DV)
        s, keep, _, _ = _tile(q, k, qp, kp, b, offs_m, offs_n, m_ok, n_ok, bias, tb_st, S, P, HAS, PRECISION)
        if GRAD:
            ds = _dscores(s, keep, tl.dot(do, tl.trans(v), input_precision=PRECISION), inv_n)  # (M, N)
            acc += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        else:
            a = tl.where(keep, s * tl.sigmoid(s) * inv_n, 0.0)  # SiLU(s) / n, masked
            acc += tl.dot(a.to(v.dtype), v, input_precision=PRECISION)
    if GRAD:
        _store_rows(OUT, o_st, b, h, offs_m, m_ok, offs_dq, DQK, acc.to(OUT.dtype.element_ty))
    else:
        _store_rows(OUT, o_st, b, h, offs_m, m_ok, offs_dv, DV, acc.to(OUT.dtype.element_ty))


@triton.jit
def _by_key(
    Q,
    K,
    V,
    DO,
    bias,
    DK,
    DVAL,
    DPOS,
    DTS,
    q_st,
    k_st,
    v_st,
    do_st,
    tb_st,
    dims,
    inv_n,
    HAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # this program's key block
    BLOCK_M: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One block of keys against every query block: dK_j = Σ_i dS_ij Q_i, dV_j = Σ_i a_ij dO_i
    into DK, DVAL (B, H, S, ·) contiguous, and the bias tables' gradients by atomic adds of dS
    into DPOS (P,) and DTS (nb + 1,) float32. dims as :func:`_by_query`."""
    T, S, H, DQK, DV, P = dims
    b, h, offs_n = _ids(H, BLOCK_N)
    offs_dq, offs_dv = tl.arange(0, BLOCK_DQK), tl.arange(0, BLOCK_DV)
    k, v, kp, n_ok = _keys(K, V, bias[2], k_st, v_st, b, h, offs_n, S, offs_dq, offs_dv, DQK, DV)
    dk = tl.zeros((BLOCK_N, BLOCK_DQK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    for m0 in range(0, T, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < T
        q = _rows(Q, q_st, b, h, offs_m, m_ok, offs_dq, DQK)  # (M, Dqk)
        do = _rows(DO, do_st, b, h, offs_m, m_ok, offs_dv, DV)  # (M, Dv)
        qp = tl.load(bias[1] + b * T + offs_m, mask=m_ok, other=0)  # (M,)
        s, keep, pidx, tbv = _tile(q, k, qp, kp, b, offs_m, offs_n, m_ok, n_ok, bias, tb_st, S, P, HAS, PRECISION)
        a = tl.where(keep, s * tl.sigmoid(s) * inv_n, 0.0)  # (M, N)
        dv += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision=PRECISION)
        ds = _dscores(s, keep, tl.dot(do, tl.trans(v), input_precision=PRECISION), inv_n)  # (M, N) float32
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        if HAS & 1:
            tl.atomic_add(DPOS + pidx, ds, mask=keep)
        if HAS & 2:
            tl.atomic_add(DTS + tbv, ds, mask=keep)
    dk_st = (H * S * DQK, S * DQK, DQK)
    dv_st = (H * S * DV, S * DV, DV)
    _store_rows(DK, dk_st, b, h, offs_n, n_ok, offs_dq, DQK, dk.to(DK.dtype.element_ty))
    _store_rows(DVAL, dv_st, b, h, offs_n, n_ok, offs_dv, DV, dv.to(DVAL.dtype.element_ty))


def _pow2(x: int) -> int:
    return max(16, 1 << (int(x) - 1).bit_length())


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _st(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B, H, rows, d) tensor (unit last stride)."""
    return t.stride(0), t.stride(1), t.stride(2)


class _Launch:
    """The arguments the three kernels share, prepared once per call: positions as contiguous
    (B, T) / (B, S) int64, key validity as (B, S) int8, the bias tables, sizes and flags."""

    def __init__(self, q, k, v, *, tb, q_pos, k_pos, k_valid, pos_w, ts_w, n: int, precision: str = "ieee") -> None:
        why = available(q.device)
        if why is not None:
            raise RuntimeError(f"Triton HSTU attention unavailable: {why}")
        B, H, T, dqk = q.shape
        S, dv = k.shape[2], v.shape[-1]
        self.q, self.k, self.v = _unit_last(q), _unit_last(k), _unit_last(v)
        qp, kp = q_pos.expand(B, T).contiguous(), k_pos.expand(B, S).contiguous()
        dummy = qp  # any tensor: pointers of disabled inputs are never read
        self.pos_w, self.ts_w = pos_w, ts_w
        self.tensors = (
            tb if ts_w is not None else dummy,
            qp,
            kp,
            k_valid.to(torch.int8).contiguous() if k_valid is not None else dummy,
            pos_w.contiguous() if pos_w is not None else dummy,
            ts_w.contiguous() if ts_w is not None else dummy,
        )
        self.tb_st = tuple(tb.stride()) if ts_w is not None else (0, 0, 0)
        self.shape = (B, H, T, S, dqk, dv)
        self.sizes = dict(dims=(T, S, H, dqk, dv, pos_w.shape[0] if pos_w is not None else 1), inv_n=1.0 / n)
        self.flags = dict(
            HAS=(pos_w is not None) * 1 + (ts_w is not None) * 2 + (k_valid is not None) * 4,
            BLOCK_M=16 if T <= 16 else 32,
            BLOCK_N=16 if S <= 16 else 32,
            BLOCK_DQK=_pow2(dqk),
            BLOCK_DV=_pow2(dv),
            PRECISION=precision,
        )

    def _query_pass(self, do: torch.Tensor | None, out: torch.Tensor, grad: bool) -> None:
        B, H, T = self.shape[:3]
        q, k, v = self.q, self.k, self.v
        grid = (triton.cdiv(T, self.flags["BLOCK_M"]), B * H)
        do_t, do_st = (do, _st(do)) if do is not None else (q, (0, 0, 0))
        _by_query[grid](
            q, k, v, do_t, self.tensors, out, _st(q), _st(k), _st(v), do_st, _st(out), self.tb_st, **self.sizes, GRAD=grad, **self.flags
        )

    def forward(self) -> torch.Tensor:
        """(B, T, H * d_v) in q's dtype."""
        B, H, T, S, dqk, dv = self.shape
        out = torch.empty(B, T, H * dv, dtype=self.q.dtype, device=self.q.device)  # (B, T, H*d_v)
        self._query_pass(None, out.view(B, T, H, dv).transpose(1, 2), grad=False)  # written as (B, H, T, d_v)
        return out

    def backward(self, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """dout (B, T, H * d_v) -> dq, dk, dv (shapes of q, k, v), d pos_w, d ts_w (None without the table)."""
        B, H, T, S, dqk, dv = self.shape
        do = _unit_last(dout).view(B, T, H, dv).transpose(1, 2)  # (B, H, T, d_v) view
        q, k, v = self.q, self.k, self.v
        dq = torch.empty(B, H, T, dqk, dtype=q.dtype, device=q.device)
        self._query_pass(do, dq, grad=True)
        dk = torch.empty(B, H, S, dqk, dtype=k.dtype, device=k.device)
        dval = torch.empty(B, H, S, dv, dtype=v.dtype, device=v.device)
        dpos = torch.zeros(self.sizes["dims"][-1], dtype=torch.float32, device=q.device)
        dts = torch.zeros(self.ts_w.shape[0] if self.ts_w is not None else 1, dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(S, self.flags["BLOCK_N"]), B * H)
        _by_key[grid](
            q, k, v, do, self.tensors, dk, dval, dpos, dts, _st(q), _st(k), _st(v), _st(do), self.tb_st, **self.sizes, **self.flags
        )
        dpos = dpos.to(self.pos_w.dtype) if self.pos_w is not None else None
        return dq, dk, dval, dpos, dts.to(self.ts_w.dtype) if self.ts_w is not None else None


class _HSTUAttention(torch.autograd.Function):
    """Autograd node of the Triton attention: forward ``_by_query``, backward ``_by_query`` (dQ) and
    ``_by_key`` (dK, dV, bias tables); nothing but the inputs is saved (scores are recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, ts_w, tb, q_pos, k_pos, k_valid, n):
        ctx.save_for_backward(q, k, v, pos_w, ts_w, tb, q_pos, k_pos, k_valid)
        ctx.n = n
        return _Launch(q, k, v, tb=tb, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid, pos_w=pos_w, ts_w=ts_w, n=n).forward()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pos_w, ts_w, tb, q_pos, k_pos, k_valid = ctx.saved_tensors
        launch = _Launch(q, k, v, tb=tb, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid, pos_w=pos_w, ts_w=ts_w, n=ctx.n)
        return (*launch.backward(dout), None, None, None, None, None)
