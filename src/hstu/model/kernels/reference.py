"""PyTorch reference of the fused HSTU pieces: the oracle and fallback of every backend.

Zhai et al. 2024, §3, eqs. 1-3, split into the pieces a backend may fuse:

    uvqk:       U, V, Q, K = Split(SiLU(LN(X) · W_uvqk))            (eq. 1)
    time_buckets: bucket(|t_q - t_k|) = clamp(floor(ln(max(|dt|, 1)) / log_base), 0, nb)
    attention:  A = SiLU(Q Kᵀ + rab) / n ⊙ mask;  out = A · V       (eq. 2, bias inside)
    ln_mul:     U ⊙ LN(A · V)                                         (eq. 3, before W_o)
    decode_bias + attention_bias: the same attention with the bias (mask folded in) formed once
                for every step of a decode loop, then read per step (inference only)
    bias_channels: FuXi-α's positional / temporal channels A_c · V ([model] multi_channel); channel_weights
                formed once for every step of a decode loop, then read per step (channels_av)

Symbols: B batch, H heads, T query rows, S key rows, d_qk / d_v per-head widths, N the model's
fixed width (the divisor n and the position table size 2N - 1).

Unlike :func:`hstu.model.attention.hstu_attention_reference` (square, causal by index), the
attention here takes the absolute position of every query and key row, so the same function
serves a full prefill (T = S), an extension of a cached prefix (T new rows against S cached
rows) and a decode step (T = 1), and splits over key segments: with a pointwise SiLU and no
softmax, out = A_1 · V_1 + A_2 · V_2 for keys split into two segments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstu.model.bias import log_bucket_


def uvqk(x: torch.Tensor, weight: torch.Tensor, *, num_heads: int, d_qk: int, d_v: int, eps: float) -> tuple[torch.Tensor, ...]:
    """LN (no affine) -> x · Wᵀ -> SiLU -> split.

    Args:
        x: (…, d) float rows. weight: (2H(d_v + d_qk), d), the ``uvqk`` Linear's weight.
    Returns:
        u, v (…, H*d_v) and q, k (…, H*d_qk), views of one (…, 2H(d_v+d_qk)) tensor.
    """
    h = F.linear(F.layer_norm(x, (x.shape[-1],), eps=eps), weight)  # (…, 2H(d_v+d_qk))
    h = F.silu(h, inplace=not h.requires_grad)  # in place at inference: no second (…, 2H(d_v+d_qk)) buffer
    hv, hq = num_heads * d_v, num_heads * d_qk
    return torch.split(h, [hv, hv, hq, hq], dim=-1)


def ln_mul(av: torch.Tensor, u: torch.Tensor, *, eps: float) -> torch.Tensor:
    """U ⊙ LN(A·V) over the last axis (no affine): (…, H*d_v), (…, H*d_v) -> (…, H*d_v)."""
    return u * F.layer_norm(av, (av.shape[-1],), eps=eps)


def time_buckets(t_q: torch.Tensor, t_k: torch.Tensor, *, num_buckets: int, log_base: float) -> torch.Tensor:
    """Log time bucket of every (query, key) pair, as :func:`hstu.model.bias.time_buckets`.

    Args:
        t_q: (B, T) int64 Unix seconds, each query row's t[i+1] (its next event's time; the
            request time for the last history row and for generated rows).
        t_k: (B, S) int64 Unix seconds of the key rows.
    Returns:
        (B, T, S) int64 in [0, num_buckets]. float64 keeps the floor exact up to 2^53 s.
    """
    return log_bucket_(t_q.unsqueeze(2) - t_k.unsqueeze(1), num_buckets, log_base)  # (B, T, S)


def masked_bias(dtype: torch.dtype) -> float:
    """The bias that masks a score at inference: -M with M = max(dtype) / 4, so s - M stays
    finite for any |s| < 3M / 4 and SiLU(s - M) = (s - M) · sigmoid(s - M) is exactly -0.0
    (exp(M) overflows to inf in float32, bfloat16 and float16 alike), the same contribution to
    A · V as a zero from masked_fill, one (B, T, S) pass instead of one per head."""
    return torch.finfo(dtype).min / 4


def _rab(rel: torch.Tensor, tb: torch.Tensor | None, pos_w: torch.Tensor | None, ts_w: torch.Tensor | None) -> torch.Tensor | None:
    """pos_w[N - 1 + rel] + ts_w[tb] (either term absent when its table is None); rel = k_pos - q_pos."""
    rab = None
    if pos_w is not None:
        rab = pos_w[(rel + (pos_w.shape[0] - 1) // 2).clamp(0, pos_w.shape[0] - 1)]
    if ts_w is not None:
        rab = ts_w[tb] if rab is None else ts_w[tb] + rab
    return rab


def _mask_and_rab(q_pos, k_pos, k_valid, tb, pos_w, ts_w, segments=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(drop, rab) of every (query, key) pair, shapes and arguments as :func:`attention`: drop (B, T, S)
    or (T, S) bool, True where key j is after query i (k_pos[j] > q_pos[i]), invalid, or (packed rows,
    ``segments`` (B, T = S)) in another segment; rab the summed bias of :func:`_rab` (None without
    tables). The one mask of :func:`attention` and :func:`decode_bias`."""
    rel = k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)  # (B, T, S) or (T, S): k_pos[j] - q_pos[i]
    drop = rel > 0
    if k_valid is not None:
        drop = drop | ~k_valid.unsqueeze(1)  # (B, T, S)
    if segments is not None:
        drop = drop | (segments.unsqueeze(-1) != segments.unsqueeze(-2))  # (B, T, S): another user's token
    return drop, _rab(rel, tb, pos_w, ts_w)


def _channel_list(q_pos, k_pos, k_valid, tb, tables, segments=None) -> list[torch.Tensor]:
    """Per channel, its weights A_c (…, T, S): the channel's relative bias where query i may attend key j, else 0."""
    drop, _ = _mask_and_rab(q_pos, k_pos, k_valid, None, None, None, segments)  # (B, T, S) or (T, S)
    rel = k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)
    return [_rab(rel, tb, pos_w, ts_w).masked_fill(drop, 0.0) for pos_w, ts_w in tables]  # (B, T, S) or (T, S) each


def channel_weights(q_pos, k_pos, k_valid, tb, tables, segments=None) -> torch.Tensor:
    """FuXi-α's positional and temporal attention weights (Ye et al., WWW 2025, §4.2, adaptive
    multi-channel self-attention): A_c[…, i, j] = channel c's relative bias where query i may attend
    key j, else 0; no SiLU, no 1/n (its weights are the bias itself).

    Args:
        q_pos, k_pos, k_valid, tb, segments: the mask and time buckets, as :func:`attention`.
        tables: per channel (pos_w, None) or (None, ts_w), as :func:`attention`'s tables.
    Returns:
        (B, C, T, S) float, or (C, T, S) when every input is unbatched; channels in ``tables`` order.
    """
    a = _channel_list(q_pos, k_pos, k_valid, tb, tables, segments)
    shape = torch.broadcast_shapes(*(x.shape for x in a))
    return torch.stack([x.expand(shape) for x in a], dim=-3)  # (…, C, T, S)


def channels_av(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A_c · V of every channel in one batched GEMM: w (B, C, T, S) or (C, T, S) float
    (:func:`channel_weights`; the bias is shared by the heads), v (B, H, S, d_v) ->
    (B, T, C * H * d_v), channel-major then heads (the layout of concatenating each channel's
    (B, T, H * d_v))."""
    C, T, S = w.shape[-3:]
    B, H, _, d = v.shape
    w, vt = w.to(v.dtype), v.transpose(1, 2)  # vt (B, S, H, d_v)
    if H == 1 or vt.stride(2) == d * vt.stride(3):  # a pass's own rows: (B, S, H*d_v) is a view, every head in one GEMM
        out = torch.matmul(w.reshape(*w.shape[:-3], C * T, S), vt.reshape(B, S, H * d))  # (B, C*T, H*d_v)
        return out if C == 1 else out.view(B, C, T, H * d).transpose(1, 2).reshape(B, T, C * H * d)
    # a cache's (B, H, S, d_v) rows: per head (the weights broadcast over H, C*T rows each)
    out = torch.matmul(w.reshape(*w.shape[:-3], 1, C * T, S), v)  # (B, H, C*T, d_v)
    return out.view(B, H, C, T, d).permute(0, 3, 2, 1, 4).reshape(B, T, C * H * d)


def bias_channels(
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor | None,
    tb: torch.Tensor | None,
    tables: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...],
    segments: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """FuXi-α's positional and temporal channels A_c · V, one channel at a time (:func:`channel_weights`
    formed once for a decode loop's steps and read with :func:`channels_av` is the other way).

    Args:
        v: (B, H, S, d_v) float values; the rest as :func:`channel_weights`.
    Returns:
        C tensors (B, T, H * d_v), in ``tables`` order, heads concatenated. No factory or
        concatenation (a decode loop's ops are checked for them).
    """
    return [channels_av(a.unsqueeze(-3), v) for a in _channel_list(q_pos, k_pos, k_valid, tb, tables, segments)]


def decode_bias(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    tb: torch.Tensor | None,
    pos_w: torch.Tensor | None,
    ts_w: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The additive bias of :func:`attention` with its mask folded in, for every query row at once.

    Args:
        q_pos: (B, T) int64 positions of the query rows (a decode loop: one row per step).
        k_pos: (B, S) int64 key positions; k_valid: (B, S) bool.
        tb: (B, 1, S) or (B, T, S) int64 time buckets, or None; pos_w, ts_w: as :func:`attention`.
        dtype: the scores' dtype.
    Returns:
        (B, T, S) ``dtype``: rab where key j is valid and k_pos[j] <= q_pos[i], else
        :func:`masked_bias` (SiLU of the masked score is exactly -0.0).
    """
    drop, rab = _mask_and_rab(q_pos, k_pos, k_valid, tb, pos_w, ts_w)  # (B, T, S) each
    if rab is None:
        return torch.zeros(drop.shape, dtype=dtype, device=drop.device).masked_fill_(drop, masked_bias(dtype))
    return torch.where(drop, masked_bias(dtype), rab.to(dtype))


def attention_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor, n: int) -> torch.Tensor:
    """Inference HSTU attention with a precomputed bias (:func:`decode_bias`):
    A = SiLU(q·k + bias) / n, out = A · V; the same values as :func:`attention` with that bias
    formed inside. q: (B, H, T, d_qk); k: (B, H, S, d_qk); v: (B, H, S, d_v); bias: (B, T, S).
    Returns (B, T, H * d_v). No factory call (graph-capturable)."""
    B, H, T, _ = q.shape
    if H == 1:  # 3-D, the bias added inside the batched GEMM (baddbmm): equal to the 4-D path, measured
        # 20 vs 27-31 us per call at one decode row against 211 keys (d 50, one thread), 30 vs 39-48 at 4
        S = k.shape[-2]
        s = torch.baddbmm(bias, q.view(B, T, -1), k.view(B, S, -1).transpose(1, 2))  # (B, T, S)
        return torch.bmm(F.silu(s, inplace=True), v.view(B, S, -1)).div_(n)  # (B, T, d_v)
    s = torch.matmul(q, k.transpose(-1, -2)).add_(bias.unsqueeze(-3))  # (B, H, T, S)
    out = torch.matmul(F.silu(s, inplace=True), v).div_(n)  # (B, H, T, d_v)
    return out.transpose(1, 2).reshape(B, T, H * v.shape[-1])


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
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """HSTU attention with the relative bias computed inside (eq. 2).

    rab[b, i, j] = pos_w[N - 1 + k_pos[j] - q_pos[i]] + ts_w[tb[b, i, j]]
    A[b, h, i, j] = SiLU(q·k + rab) / n, kept where k_pos[j] <= q_pos[i] and k_valid[b, j].

    Args:
        q: (B, H, T, d_qk); k: (B, H, S, d_qk); v: (B, H, S, d_v), float.
        q_pos: (B, T) or (T,) int64 absolute positions of the query rows.
        k_pos: (B, S) or (S,) int64 absolute positions of the key rows.
        k_valid: (B, S) bool, False masks key j (padding rows of a cache); None: all keys valid.
        tb: (B, T, S) int64 time buckets (:func:`time_buckets`) or None when ``ts_w`` is None.
        pos_w: (2N - 1,) position table or None (no position bias); ts_w: (nb + 1,) or None.
        n: the divisor, the model's fixed width N.
        segments: (B, T) int64 segment ids of packed rows (T = S, keys are the query rows): key j is
            also masked where segments[b, j] != segments[b, i]; q_pos / k_pos then count within
            each segment. None: one sequence per row.
    Returns:
        (B, T, H * d_v), heads concatenated. Masked scores are set to exactly 0 (masked_fill in
        training; at inference a -M bias (:func:`masked_bias`) whose SiLU is exactly -0.0), never
        a multiply of SiLU(s), so finite stale cache rows contribute exactly 0 (a cache is
        zero-initialised and only ever holds finite K/V). No factory call
        (no arange / zeros), so it can run inside a decode loop that is checked for them.
    """
    B, H, T, _ = q.shape
    s = torch.matmul(q, k.transpose(-1, -2))  # (B, H, T, S)
    drop, rab = _mask_and_rab(q_pos, k_pos, k_valid, tb, pos_w, ts_w, segments)  # rab summed once, added to every head
    if s.requires_grad:
        if rab is not None:
            s = s + rab.unsqueeze(-3)  # (B, H, T, S)
        a = (F.silu(s) / n).masked_fill_(drop.unsqueeze(-3), 0.0)  # (B, H, T, S)
        out = torch.matmul(a, v)  # (B, H, T, d_v)
    else:  # inference: in place on the (B, H, T, S) scores, 1/n applied to the (B, H, T, d_v) output
        if rab is not None and H > 1:  # mask folded into the bias: one pass over (B, T, S), not (B, H, T, S)
            s.add_(torch.where(drop, masked_bias(s.dtype), rab).unsqueeze(-3))
            a = F.silu(s, inplace=True)  # masked: SiLU(s - M) = -0.0 exactly
        else:  # one head (or no bias): the fold saves nothing, masked_fill is the cheaper op
            if rab is not None:
                s.add_(rab.unsqueeze(-3))
            a = F.silu(s, inplace=True).masked_fill_(drop.unsqueeze(-3), 0.0)  # (B, H, T, S)
        out = torch.matmul(a, v).div_(n)  # (B, H, T, d_v)
    return out.transpose(1, 2).reshape(B, T, H * v.shape[-1])  # (B, T, H*d_v)
