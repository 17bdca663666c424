"""The engine's forward passes per bucket: prefill, extend (prefix-cache hit) and decode steps,
each a closure over a bucket's static buffers (graph-capturable), built from the model's own
:meth:`hstu.model.hstu.HSTUModel.forward_layers` with an :class:`hstu.model.meta.AttentionMeta`
and per-layer :class:`hstu.model.meta.KVView` slices of the pool. Nothing here reads a layer's
parts: the engine builds metadata and cache views, the model computes.

Symbols as hstu.generate.engine: Bp users in a chunk, W beams per user, R = Bp * W rows, E the
bucket edge, C = E + 1 history slots, K generated slots, T rows of an extension.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hstu.backend.graph_cache import CachedRunner, StaticInputs, entry_name
from hstu.backend.graphs import CompiledRunner
from hstu.generate.pool import BucketPool
from hstu.model.base import l2_normalize
from hstu.model.meta import AttentionMeta, KVView, decode_channels

if TYPE_CHECKING:
    from hstu.generate.engine import Engine

Runner = Callable[[], torch.Tensor]
log = logging.getLogger(__name__)


def graph_runner(eng: Engine, b: BucketPool, key: tuple, make: Callable[[Engine, BucketPool], Runner]) -> Runner:
    """The runner of ``key`` (kind, batch size[, T | W]) in ``eng.graphs`` mode: ``make(eng, b)`` as
    is ("eager"); captured into a device graph ("cuda_graph", "npu_graph"); compiled ("compile":
    :class:`hstu.backend.graphs.CompiledRunner`, eager if compiling fails), loaded from or built
    into ``eng.graph_cache`` when the engine has one (:class:`hstu.backend.graph_cache.CachedRunner`,
    the compiled runner its fallback; ``eng.cache_only``, or ``eng.compile_new`` False: loaded where
    the cache holds it, else eager, never compiled or built now)."""
    fn = make(eng, b)
    if eng.graphs in ("cuda_graph", "npu_graph"):
        return eng.platform.capture_graph(fn)
    if eng.graphs != "compile":
        return fn
    name = "_".join([key[0], f"E{b.E}", *map(str, key[1:])])
    fixed = eng.cache_only or not eng.compile_new  # no compilation now: what the graph cache holds, else eager
    if fixed:  # graphs "auto" with a graph cache, or a server past its warm-up
        compiled = fn
        if not eng.cache_only:
            log.info("engine graph %s: first needed after warm-up: eager (or the graph cache's), not compiled now", name)
    else:
        compiled = CompiledRunner(eng.platform.compile_graph(fn, name, eng.compile_backend), fn, f"engine graph {name}")
    if eng.graph_cache is None:
        return compiled
    module = StaticInputs(make, eng, b)
    settings = {
        "kernels": eng.kernels.name,
        **{a: str(getattr(eng, a)) for a in ("prefill_blocks", "tb_chunk_elements", "chunk_time_buckets", "k_max", "dtype", "score_dtype")},
        "cfg": repr(eng.model.cfg),
    }
    if eng.graph_cache.env["precision"] != "float32":  # one run's fp32 and INT8 / bf16 graphs side by side (fp32 names as before)
        settings["precision"] = eng.graph_cache.env["precision"]
    label = f"engine graph {name}"
    return CachedRunner(eng.graph_cache, entry_name(key, b.E, module, settings), module, compiled, label, build=not fixed)


def time_buckets(eng: Engine, t_q: torch.Tensor, t_k: torch.Tensor) -> torch.Tensor | None:
    """Time buckets (B, T, S) int64 of t_q (B, T) against t_k (B, S), or None without a time
    bias. In groups of at most ``eng.tb_chunk_elements`` (query, key) pairs where the platform
    says so (CPU: the bucket formula is ~10 elementwise passes over (B, T, S) int64 / float64,
    memory-bound once the tensors outgrow the L2 cache; a (16, 200, 200) prefill: ~10-25 ms at
    one thread, as much as the rest of a small model's generate call)."""
    c = eng.model.cfg
    if not c.use_time_bias:
        return None
    B, T, S = t_q.shape[0], t_q.shape[1], t_k.shape[1]
    step = max(1, eng.tb_chunk_elements // max(1, T * S)) if eng.chunk_time_buckets and eng.tb_chunk_elements > 0 else B
    parts = [
        eng.kernels.time_buckets(t_q[a : a + step], t_k[a : a + step], num_buckets=c.num_time_buckets, log_base=c.time_bucket_log_base)
        for a in range(0, B, step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def row_blocks(eng: Engine, E: int) -> list[tuple[int, int]]:
    """Causal row blocks (a, b) of a prefill's square attention: from 64 rows, ``eng.prefill_blocks``
    blocks (None: 2, or 4 from 150 rows); block (a, b)'s queries against keys 0 .. b - 1 only,
    which skips (n - 1) / 2n of the (Bp, H, E, E) scores for n blocks (same result: keys beyond
    a query row contribute exactly 0 either way)."""
    n = (4 if E >= 150 else 2) if eng.prefill_blocks is None else eng.prefill_blocks
    n = n if E >= 64 else 1
    return [(E * j // n, E * (j + 1) // n) for j in range(max(1, n))]


def _feat(b: BucketPool, a: torch.Tensor, cat: torch.Tensor):
    return (a if b.has_features[0] else None), (cat if b.has_features[1] else None)


def prefill_fn(eng: Engine, b: BucketPool, Bp: int) -> Runner:
    """Every row through every layer (their K/V fill pool rows 0..E-1), except that the last layer
    computes only the last live row, whose output is the user vector: () -> (Bp, d) L2-normalised."""
    m = eng.model
    E = b.E
    ids, t, lengths, acts, cats = b.ids[:Bp], b.t[:Bp], b.lengths[:Bp], b.actions[:Bp], b.categories[:Bp]
    kv = [KVView(k[:Bp, :, :E], v[:Bp, :, :E]) for k, v in zip(b.hk, b.hv)]  # rows 0..E-1 of the pool
    pos = eng._arange[:E]
    bidx = eng._arange[:Bp]
    blocks = row_blocks(eng, E)

    def prefill() -> torch.Tensor:
        valid = (pos.view(1, E) < lengths.view(Bp, 1)).unsqueeze(-1).to(eng.dtype)  # (Bp, E, 1)
        x = m.embed(ids, pos, *_feat(b, acts, cats)) * valid  # (Bp, E, d)
        t_q, t_k = t[:, 1 : E + 1], t[:, :E]  # row i's query time t[i+1]; key times
        last = lengths - 1  # (Bp,) the row whose output is the user vector
        tb_last = time_buckets(eng, t_q[bidx, last].view(Bp, 1), t_k)  # (Bp, 1, E): the last row's buckets
        # each causal row block's buckets (Bp, b - a, b): |t[i+1] - t[j]| for the pairs it computes
        tbs = None if tb_last is None or len(m.layers) == 1 else [time_buckets(eng, t_q[:, a:z], t_k[:, :z]) for a, z in blocks]
        meta = AttentionMeta(q_pos=pos, k_pos=pos, valid=valid, kernels=eng.kernels, blocks=blocks, block_tb=tbs)
        last_meta = AttentionMeta(q_pos=last.view(Bp, 1), k_pos=pos, tb=tb_last, kernels=eng.kernels, rows=last)
        x = m.forward_layers(x, meta, kv, last=last_meta)  # (Bp, 1, d)
        return l2_normalize(x.squeeze(1).to(eng.score_dtype))  # (Bp, d)

    return prefill


def extend_fn(eng: Engine, b: BucketPool, Bp: int, T: int) -> Runner:
    """Rows start[b] .. start[b] + T - 1 against the cached rows (a prefix-cache hit); padding
    rows write to the scratch row E. () -> (Bp, d) the last live row, L2-normalised."""
    m = eng.model
    E, C = b.E, b.C
    ids, t, lengths, acts, cats = b.ids[:Bp], b.t[:Bp], b.lengths[:Bp], b.actions[:Bp], b.categories[:Bp]
    start, kvalid = b.start[:Bp], b.kvalid[:Bp]
    kv = [KVView(k[:Bp, :, :C], v[:Bp, :, :C]) for k, v in zip(b.hk, b.hv)]  # the history slots
    ar_T, kpos = eng._arange[:T], eng._arange[:C]
    bidx = eng._arange[:Bp]

    def extend() -> torch.Tensor:
        raw = start.view(Bp, 1) + ar_T.view(1, T)  # (Bp, T) positions
        live = raw < lengths.view(Bp, 1)  # (Bp, T)
        p = torch.where(live, raw, torch.full_like(raw, E))  # padding rows -> scratch row E
        g = p.clamp(max=E - 1)
        valid = live.unsqueeze(-1).to(eng.dtype)  # (Bp, T, 1)
        gc = g.view(Bp, T, *[1] * (cats.dim() - 2)).expand(Bp, T, *cats.shape[2:])  # categories may carry feature columns
        x = m.embed(ids.gather(1, g), p, *_feat(b, acts.gather(1, g), cats.gather(1, gc))) * valid  # (Bp, T, d)
        meta = AttentionMeta(
            q_pos=p,
            k_pos=kpos,
            k_valid=kvalid,
            tb=time_buckets(eng, t.gather(1, p + 1), t[:, :C]),
            valid=valid,
            kernels=eng.kernels,
            write_rows=p,
        )  # tb (Bp, T, C)
        x = m.forward_layers(x, meta, kv)  # (Bp, T, d)
        return l2_normalize(x[bidx, lengths - 1 - start].to(eng.score_dtype))  # (Bp, d)

    return extend


def step_fn(eng: Engine, b: BucketPool, Bp: int, W: int) -> Runner:
    """One decode step for Bp users x W beams: R = Bp * W new rows at positions ``b.pos``; beam
    r's generated keys in gk / gv row r, the history shared by a user's beams in hk / hv row b
    (two key segments, added: HSTU attention is pointwise SiLU, no softmax). () -> (R, d)."""
    if W == 1:
        return step_fn_one_beam(eng, b, Bp)
    m, c = eng.model, eng.model.cfg
    C, R = b.C, Bp * W
    item, pos, act, cat = b.item[:R], b.pos[:R], b.act[:R], b.cat[:R]
    tb_h = b.tb_hist[:Bp].expand(Bp, W, C) if c.use_time_bias else None  # (Bp, W, C), the same for every beam
    kv = [KVView(gk[:R], gv[:R], shared=KVView(hk[:Bp, :, :C], hv[:Bp, :, :C])) for gk, gv, hk, hv in zip(b.gk, b.gv, b.hk, b.hv)]
    shared = AttentionMeta(q_pos=pos.view(Bp, W), k_pos=eng._arange[:C], k_valid=b.kvalid[:Bp], tb=tb_h, kernels=eng.kernels)
    meta = AttentionMeta(
        q_pos=pos.view(R, 1),
        k_pos=b.gpos[:R],
        tb=eng._zero_tb[:R] if c.use_time_bias else None,
        kernels=eng.kernels,
        write_slot=b.s_idx,
        shared=shared,
    )

    def step() -> torch.Tensor:
        x = m.embed(item, pos, *_feat(b, act, cat))  # (R, d)
        x = m.forward_layers(x.unsqueeze(1), meta, kv)  # (R, 1, d)
        return l2_normalize(x.squeeze(1).to(eng.score_dtype))  # (R, d)

    return step


def setup_fn(eng: Engine, b: BucketPool, Bp: int, one_beam: bool, steps: int) -> Runner:
    """A request group's fixed decode inputs, after :meth:`BucketPool.load` and before the encode:
    the history's time buckets against the request time (b.tb_hist (Bp, 1, C)); with one beam per
    user, the generated rows' key positions L, L + 1, ... (b.kpos_j[:, C:]) and, when the kernels
    take a bias, :func:`decode_biases` for ``steps`` decode steps (0: none, as without a KV cache).
    () -> b.lengths[:Bp] (written nothing; a graph needs an output)."""
    c, C, K = eng.model.cfg, b.C, eng.k_max
    ar_K = eng._arange[:K].view(1, K)
    biases = one_beam and (b.bias_j is not None or b.chan_j is not None) and steps > 0

    def setup() -> torch.Tensor:
        if c.use_time_bias:
            b.tb_hist[:Bp] = time_buckets(eng, b.rt[:Bp].view(Bp, 1), b.t[:Bp, :C])  # (Bp, 1, C)
        if one_beam:  # generated rows at positions L, L + 1, ... (kvalid, tb_hist: views of the history part)
            b.kpos_j[:Bp, C:] = b.lengths[:Bp].view(Bp, 1) + ar_K
        if biases:
            decode_biases(eng, b, Bp, steps)
        return b.lengths[:Bp]

    return setup


def decode_biases(eng: Engine, b: BucketPool, Bp: int, steps: int) -> None:
    """Fill b.bias_j[layer][:Bp, :steps] (and b.chan_j[layer][:Bp, :, :steps], FuXi-alpha's channel
    weights): decode step s's query (position L + s, slot C + s) against the C + K keys, for every
    layer: the relative-bias gathers and the mask, formed once per request group instead of once
    per step and layer."""
    C = b.C
    meta = AttentionMeta(
        q_pos=b.kpos_j[:Bp, C : C + steps],
        k_pos=b.kpos_j[:Bp],
        k_valid=b.kvalid_j[:Bp],
        tb=b.tb_j[:Bp] if eng.model.cfg.use_time_bias else None,
        kernels=eng.kernels,
    )  # q_pos (Bp, steps)
    for li, layer in enumerate(eng.model.layers):
        if b.bias_j is not None:
            b.bias_j[li][:Bp, :steps] = layer.relative_bias(meta, eng.dtype)
        if b.chan_j is not None:
            b.chan_j[li][:Bp, :, :steps] = decode_channels(meta, layer.rel_bias, eng.dtype)  # (Bp, channels, steps, C + K)


def step_fn_one_beam(eng: Engine, b: BucketPool, Bp: int) -> Runner:
    """A decode step with one beam per user (greedy, top-k): generated row s is written to slot
    C + s of the history cache, so each layer attends to history and generated keys in one
    call (key positions kpos_j, validity kvalid_j, time buckets tb_j: set per request in
    Engine._run_group; the per-layer bias from :func:`decode_biases` when the kernels take one)."""
    m, c = eng.model, eng.model.cfg
    item, pos, act, cat = b.item[:Bp], b.pos[:Bp], b.act[:Bp], b.cat[:Bp]
    kv = [KVView(k[:Bp], v[:Bp]) for k, v in zip(b.hk, b.hv)]  # (Bp, H, C + K, ·)
    meta = AttentionMeta(
        q_pos=pos.view(Bp, 1),
        k_pos=b.kpos_j[:Bp],
        k_valid=b.kvalid_j[:Bp],
        tb=b.tb_j[:Bp] if c.use_time_bias else None,
        kernels=eng.kernels,
        write_slot=b.s_idx_j,
        bias=[t[:Bp] for t in b.bias_j] if b.bias_j is not None else None,
        bias_row=b.s_idx,
        channels=[t[:Bp] for t in b.chan_j] if b.chan_j is not None else None,
    )

    def step() -> torch.Tensor:
        x = m.embed(item, pos, *_feat(b, act, cat))  # (Bp, d)
        x = m.forward_layers(x.unsqueeze(1), meta, kv)  # (Bp, 1, d)
        return l2_normalize(x.squeeze(1).to(eng.score_dtype))  # (Bp, d)

    return step
