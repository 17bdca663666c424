"""Per-batch attention metadata and KV-cache views: what one HSTU layer forward needs besides X.

Every path runs the same :meth:`hstu.model.hstu.HSTULayer.forward` (x, meta, kv): T query rows
against S key rows. The caller (the model's encoder, the generation engine) builds one
:class:`AttentionMeta` per batch or per decode step, and passes each layer a :class:`KVView` of
its slice of a KV-cache pool (or nothing: the keys are the rows of this pass, training):

    path      T                  S                           writes into the cache
    train     W (padded width)   W (this pass's rows)        nothing (kv None)
    prefill   W                  W                           rows 0..W-1            (write None)
    extend    new rows           the cached history C        rows at write_rows (B, T)
    decode    1                  history + generated slots   slot write_slot (1,)

:func:`hstu_attention` is the one contract under which a backend's kernels run
(:class:`hstu.model.kernels.KernelSet`: reference, Triton, NPU), as vLLM's model code calls
``self.attn(q, k, v)`` with per-step metadata and leaves the implementation to the platform.

Symbols: B batch, T query rows, S key rows, H heads, d_qk / d_v per-head widths, Ly layers,
N the model's fixed width (the divisor n of "fixed" attention_norm and the position table 2N - 1).
Source: Zhai et al. 2024, §3, eq. 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hstu.model.bias import RelativeBias
from hstu.model.kernels import REFERENCE, KernelSet
from hstu.model.kernels.reference import bias_channels, channel_weights, channels_av


@dataclass
class AttentionMeta:
    """What every layer's attention needs for one batch or one decode step (built once, shared by
    the layers; the tensors may be static buffers rewritten in place between steps).

    Fields:
        q_pos: (B, T) or (T,) int64 absolute positions of the query rows.
        k_pos: (B, S) or (S,) int64 absolute positions of the key rows.
        k_valid: (B, S) bool, False masks key j (a cache's padding rows); None: all valid.
        tb: (B, T, S) or (B, 1, S) int64 time buckets of (query, key) pairs
            (:func:`hstu.model.kernels.reference.time_buckets`), None without a time bias.
        valid: (B, T, 1) float, 1 at live query rows: the layer output is multiplied by it so
            padding rows stay 0; None: every row is live.
        kernels: the backend's kernel set (projection, attention, LN·U).
        rows: (B,) int64: only this query row of each sequence is computed (a prefill's last
            layer, whose one read row is the user vector); output (B, 1, d), and q_pos, tb
            describe that row: (B, 1), (B, 1, S). None: all T rows.
        write_rows: (B, T) int64 cache rows the T new keys go to (extend); write_slot: (1,)
            int64 the one slot a decode step's keys go to; both None: rows 0..T-1 (prefill).
        bias: per layer (B, K, S) bias with the mask folded in (kernels.decode_bias), formed
            once per request group; row ``bias_row`` (1,) int64 is this step's. None: the bias
            is formed inside the attention from positions and time buckets.
        channels: per layer (B, C, K, S) FuXi-α channel weights of the decode loop's steps
            (kernels.reference.channel_weights), formed with ``bias``; row ``bias_row`` is this step's.
        blocks: causal row blocks (a, b) of a square prefill: block queries a..b-1 against keys
            0..b-1 only, each with its own time buckets ``block_tb[j]`` (B, b - a, b).
        shared: beam search: the history segment shared by groups of G query rows (the beams of
            a user), attended with this meta's q_pos viewed (B / G, G) against ``kv.shared``.
        segments: (B, W) int64 packed training rows (TrainConfig.packing "pack"): the segment
            (user) id of each row, -1 after the last; a query attends only keys of its own segment,
            and q_pos = k_pos (B, W) count from each segment's first row. Needs a kernel set with
            ``segments`` (the reference); None: one sequence per row.
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    k_valid: torch.Tensor | None = None
    tb: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    kernels: KernelSet = REFERENCE
    rows: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    write_slot: torch.Tensor | None = None
    bias: Sequence[torch.Tensor] | None = None
    bias_row: torch.Tensor | None = None
    channels: Sequence[torch.Tensor] | None = None
    blocks: Sequence[tuple[int, int]] | None = None
    block_tb: Sequence[torch.Tensor] | None = None
    shared: AttentionMeta | None = None
    segments: torch.Tensor | None = None


@dataclass
class KVView:
    """One layer's keys and values to attend: (B, H, S, d_qk) and (B, H, S, d_v) views of a pool
    (never copied; :meth:`append` writes the new rows in place). ``shared``: beam search's
    history view (B / G, H, S_h, ·) attended by groups of G query rows, read only."""

    k: torch.Tensor
    v: torch.Tensor
    shared: KVView | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> None:
        """Write a pass's new keys k (B, H, T, d_qk) and values v (B, H, T, d_v) where ``meta``
        says (rows 0..T-1, ``write_rows`` or ``write_slot``); in place, no allocation."""
        B, H, T, _ = k.shape
        if meta.write_slot is not None:
            self.k.index_copy_(2, meta.write_slot, k)
            self.v.index_copy_(2, meta.write_slot, v)
        elif meta.write_rows is not None:
            idx = meta.write_rows.view(B, 1, T, 1)
            self.k.scatter_(2, idx.expand(B, H, T, k.shape[-1]), k)
            self.v.scatter_(2, idx.expand(B, H, T, v.shape[-1]), v)
        else:
            self.k[:, :, :T].copy_(k)
            self.v[:, :, :T].copy_(v)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, pos_w, ts_w, layer_index: int, n: int) -> torch.Tensor:
    """One key segment: (B, H, T, d_qk), (B, H, S, ·) -> (B, T, H*d_v) through meta.kernels."""
    ks = meta.kernels
    if meta.bias is not None and ks.attention_bias is not None:  # formed once per request group
        return ks.attention_bias(q, k, v, bias=meta.bias[layer_index].index_select(1, meta.bias_row), n=n)
    if meta.segments is not None:  # packed rows: the same contract plus the same-segment mask
        if not ks.segments:
            raise ValueError(f"[train] packing = 'pack' needs a kernel set with segment masks; {ks.name!r} has none (use 'reference')")
        return ks.attention(
            q, k, v, q_pos=meta.q_pos, k_pos=meta.k_pos, k_valid=meta.k_valid, tb=meta.tb, pos_w=pos_w, ts_w=ts_w, n=n,
            segments=meta.segments,
        )  # fmt: skip
    if meta.blocks is None:
        return ks.attention(
            q, k, v, q_pos=meta.q_pos, k_pos=meta.k_pos, k_valid=meta.k_valid, tb=meta.tb, pos_w=pos_w, ts_w=ts_w, n=n
        )  # (B, T, H*d_v)
    # causal row blocks: keys past a block's last row contribute exactly 0 to it, so they are skipped
    parts = [
        ks.attention(
            q[:, :, a:b],
            k[:, :, :b],
            v[:, :, :b],
            q_pos=meta.q_pos[a:b],
            k_pos=meta.k_pos[:b],
            k_valid=None,
            tb=None if meta.block_tb is None else meta.block_tb[j],
            pos_w=pos_w,
            ts_w=ts_w,
            n=n,
        )
        for j, (a, b) in enumerate(meta.blocks)
    ]  # (B, b - a, H*d_v) each
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (B, T, H*d_v)


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, W) int64 segment ids of packed rows -> (B, W) int64 position of each row within its
    segment (0 at a segment's first row: where the id differs from the row before it).
    E.g. [[0, 0, 0, 1, 1, -1]] -> [[0, 1, 2, 0, 1, 0]]."""
    B, W = segments.shape
    idx = torch.arange(W, device=segments.device).expand(B, W)  # (B, W)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, W)


def hstu_attention(
    q: torch.Tensor,
    kv: KVView,
    meta: AttentionMeta,
    *,
    rel_bias: RelativeBias,
    width: int,
    fixed_norm: bool,
    layer_index: int = 0,
    rab: bool = True,
) -> torch.Tensor:
    """A = SiLU(Q Kᵀ + rab) / n ⊙ mask, out = A · V  (Zhai et al. 2024, §3, eq. 2), the one call
    every layer forward makes, dispatched to ``meta.kernels``.

    Args:
        q: (B, H, T, d_qk) float queries; kv: the keys / values to attend (S rows, plus a
            shared history segment for beams); meta: positions, mask, time buckets.
        rel_bias: the layer's position (2N - 1,) and time (nb + 1,) bias tables (hstu.model.bias),
            read only where the bias is formed here (not when meta.bias holds it).
        width: N. fixed_norm: n = N for every row (ModelConfig.attention_norm "fixed"), else
            n = q_pos + 1 per row ("causal": every position it attends is live).
        layer_index: which of meta.bias to read.
        rab: False: no relative bias inside (A = SiLU(Q Kᵀ) / n, the semantic channel of
            :func:`multi_channel`; a meta.bias then holds the mask alone).
    Returns:
        (B, T, H * d_v) float, heads concatenated. Segments add: SiLU is pointwise, no softmax.
    """
    n = width if fixed_norm else 1
    pos_w = ts_w = None
    if rab and (meta.bias is None or meta.kernels.attention_bias is None):  # the bias is formed here: read the tables
        pos_w = rel_bias.pos_w if rel_bias.use_position else None
        ts_w = rel_bias.ts_w if rel_bias.use_time else None
    has_tb = meta.tb is not None or meta.block_tb is not None
    av = _attend(q, kv.k, kv.v, meta, pos_w, ts_w if has_tb else None, layer_index, n)  # (B, T, H*d_v)
    if meta.shared is not None:  # beams: the history keys of each group of G query rows
        B, H, _, d = q.shape
        sh = meta.shared
        G = sh.q_pos.shape[-1]
        qh = q.transpose(1, 2).reshape(B // G, G, H, d).transpose(1, 2)  # (B / G, H, G, d_qk)
        av_h = _attend(qh, kv.shared.k, kv.shared.v, sh, pos_w, ts_w if sh.tb is not None else None, layer_index, n)
        av = av + av_h.reshape(av.shape)  # (B, T, H*d_v)
    if fixed_norm:
        return av
    div = (meta.q_pos + 1).to(av.dtype).expand(av.shape[:2]).unsqueeze(-1)  # (B, T, 1)
    return av / div if av.requires_grad else av.div_(div)


def _channels(v: torch.Tensor, meta: AttentionMeta, tables: tuple) -> list[torch.Tensor]:
    """:func:`hstu.model.kernels.reference.bias_channels` of one key segment, over meta's causal
    row blocks where it has them: (B, H, S, d_v) -> C x (B, T, H*d_v)."""
    if meta.blocks is None or meta.segments is not None:  # as _attend: packed rows are never split in blocks
        return bias_channels(v, q_pos=meta.q_pos, k_pos=meta.k_pos, k_valid=meta.k_valid, tb=meta.tb, tables=tables, segments=meta.segments)
    parts = [
        bias_channels(
            v[:, :, :b],
            q_pos=meta.q_pos[a:b],
            k_pos=meta.k_pos[:b],
            k_valid=None,
            tb=None if meta.block_tb is None else meta.block_tb[j],
            tables=tables,
        )
        for j, (a, b) in enumerate(meta.blocks)
    ]  # per block, C x (B, b - a, H*d_v)
    return [torch.cat(p, dim=1) for p in zip(*parts)] if len(parts) > 1 else parts[0]


def multi_channel(kv: KVView, meta: AttentionMeta, *, rel_bias: RelativeBias, layer_index: int = 0) -> list[torch.Tensor]:
    """FuXi-α's positional and temporal channels (Ye et al., WWW 2025, §4.2): A_p · V and A_t · V,
    A_p[i, j] = pos_w[N - 1 + j - i] and A_t[i, j] = ts_w[bucket(t[i+1] - t[j])] where query i
    attends key j, else 0 (the layer's own tables; a channel whose table is off is absent), for
    the same (query, key) pairs as :func:`hstu_attention` (prefill blocks, cached keys, decode
    steps, a beam's shared history, packed segments). Where ``meta.channels`` holds the weights of
    a decode loop (formed once per request group), row ``meta.bias_row`` of layer ``layer_index``'s
    is read instead.

    Returns:
        C = 1 or 2 tensors (B, T, H * d_v) float (position, then time), heads concatenated; read
        from ``meta.channels``: one tensor (B, T, C * H * d_v), the same values side by side.
    Raises:
        ValueError: the layer has a time bias and ``meta`` no time buckets.
    """
    if meta.channels is not None:
        return [channels_av(meta.channels[layer_index].index_select(2, meta.bias_row), kv.v)]  # (B, T, C*H*d_v)
    tables = _tables(meta, rel_bias)
    out = _channels(kv.v, meta, tables)  # C x (B, T, H*d_v)
    if meta.shared is not None:  # beams: the history keys of each group of G query rows
        out_h = _channels(kv.shared.v, meta.shared, tables)  # C x (B / G, G, H*d_v)
        out = [o + h.reshape(o.shape) for o, h in zip(out, out_h)]
    return out


def _tables(meta: AttentionMeta, rel_bias: RelativeBias) -> tuple:
    """The channels' bias tables, position then time (those the layer has): (pos_w, None), (None, ts_w)."""
    tables = []
    if rel_bias.use_position:
        tables.append((rel_bias.pos_w, None))
    if rel_bias.use_time:
        if meta.tb is None and meta.block_tb is None:
            raise ValueError("multi_channel: the layer has a time bias but the AttentionMeta has no time buckets")
        tables.append((None, rel_bias.ts_w))
    return tuple(tables)


def decode_channels(meta: AttentionMeta, rel_bias: RelativeBias, dtype: torch.dtype) -> torch.Tensor:
    """The weights :func:`multi_channel` reads from ``AttentionMeta.channels``: meta's T query rows
    (a decode loop's steps, one row each) against its S keys, (B, C, T, S) ``dtype``, formed once
    per request group (:func:`hstu.model.kernels.reference.channel_weights`)."""
    return channel_weights(meta.q_pos, meta.k_pos, meta.k_valid, meta.tb, _tables(meta, rel_bias)).to(dtype)


__all__ = ["AttentionMeta", "KVView", "decode_channels", "hstu_attention", "multi_channel", "segment_positions"]
