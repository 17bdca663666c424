"""The per-bucket KV-cache pool and static input buffers of the generation engine.

Symbols (as hstu.generate.engine): E a bucket's upper edge, C = E + 1 history capacity (row E
is a scratch row for padding writes), K = k_max generated slots, R = max_batch pool rows, Ly
layers, H heads, d_qk / d_v per-head widths.

Everything is allocated once at engine construction and written in place afterwards (the
torchtune KVCache habit): no growth, no factory call in a decode loop. The K/V themselves live in
one :class:`KVPool` (an ``nn.Module`` of non-persistent buffers, sized for the largest bucket) that
every bucket views: the engine runs one request group at a time, so the buckets never hold live
K/V at once, and the pool costs max(E) + 1 + K slots per row instead of the sum over the buckets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from hstu.generate.prefix_cache import PrefixEntry

if TYPE_CHECKING:
    from hstu.generate.engine import Engine

log = logging.getLogger(__name__)


def ladder(max_batch: int) -> tuple[int, ...]:
    """Batch sizes 1, 2, 4, ... up to and including max_batch (the graph-capture shapes)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


def batch_sizes_for(graphs: str, max_batch: int, batch_sizes=None) -> tuple[int, ...]:
    """The padded batch sizes of an engine, sorted: ``batch_sizes`` when given, else static shapes only
    where something is captured or compiled (``graphs`` "eager": every size 1..max_batch; a graph mode or
    "compile": :func:`ladder`, one graph per size). ValueError unless they lie in 1..max_batch and include max_batch."""
    if batch_sizes is None:
        batch_sizes = tuple(range(1, max_batch + 1)) if graphs == "eager" else ladder(max_batch)
    out = tuple(sorted(int(b) for b in batch_sizes))
    if out[-1] != max_batch or out[0] < 1:
        raise ValueError(f"batch_sizes must lie in 1..max_batch and include max_batch={max_batch}, got {list(batch_sizes)}")
    return out


class KVPool(nn.Module):
    """The engine's KV cache: per layer one key and one value buffer (R, H, S, d_qk / d_v) with S
    slots, plus the beam-reorder scratch (R, H, K, ·), all non-persistent buffers (not in a
    state_dict; ``.to`` moves them). Buckets take views of the first C + K slots (:meth:`views`).

    Args: layers Ly, rows R (max_batch), heads H, slots S (the largest bucket's C + K), generated
    slots K (k_max), widths d_qk / d_v, dtype and device of the model's activations.
    """

    def __init__(self, *, layers: int, rows: int, heads: int, slots: int, k_max: int, d_qk: int, d_v: int, dtype, device) -> None:
        super().__init__()
        self.layers, self.slots = layers, slots
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.zeros(rows, heads, slots, d_qk, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(rows, heads, slots, d_v, dtype=dtype, device=device), persistent=False)
        self.register_buffer("k_scratch", torch.zeros(rows, heads, k_max, d_qk, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_scratch", torch.zeros(rows, heads, k_max, d_v, dtype=dtype, device=device), persistent=False)

    def views(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer the keys and values of slots 0 .. n-1, (R, H, n, ·) views (ValueError past S)."""
        if not 0 < n <= self.slots:
            raise ValueError(f"a bucket of {n} slots does not fit the pool's {self.slots}")
        keys = [getattr(self, f"k{i}")[:, :, :n] for i in range(self.layers)]
        return keys, [getattr(self, f"v{i}")[:, :, :n] for i in range(self.layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())


def kv_pool_for(eng: Engine, widest: int) -> KVPool:
    """A pool for buckets of up to ``widest`` history slots (C = E + 1) plus the engine's k_max."""
    c = eng.model.cfg
    return KVPool(
        layers=c.num_blocks,
        rows=eng.max_batch,
        heads=c.num_heads,
        slots=widest + eng.k_max,
        k_max=eng.k_max,
        d_qk=c.d_qk,
        d_v=c.d_v,
        dtype=eng.dtype,
        device=eng.device,
    )


def log_setup(eng: Engine) -> None:
    """Debug lines: each bucket's view of the KV pool, and the engine's device, kernels, graphs and caches."""
    for E, b in eng._buckets.items():
        log.debug(
            "engine bucket %d: view of the KV pool %.2f MiB (history %d x %d rows + %d generated slots, %d layers), total %.2f MiB",
            *(E, b.kv_bytes() / 2**20, eng.max_batch, b.C, eng.k_max, eng.model.cfg.num_blocks, b.total_bytes() / 2**20),
        )
    cache = f"{eng.prefix.max_bytes / 2**20:.1f} MiB" if eng.prefix else "off"
    log.debug(
        "engine on %s: kernels=%s (%s), graphs=%s, batch sizes %s, KV pool %.2f MiB (one, viewed by every bucket), prefix cache %s",
        *(eng.device, eng.kernels.name, eng.kernels.note, eng.graphs, list(eng.batch_sizes), eng.kv_pool.nbytes() / 2**20, cache),
    )


class BucketPool:
    """Views of the engine's :class:`KVPool` and the static input buffers of one bucket (edge E);
    see the module docstring."""

    def __init__(self, eng: Engine, E: int, kv: KVPool) -> None:
        m, c = eng.model, eng.model.cfg
        R, K, dev = eng.max_batch, eng.k_max, eng.device
        dt = eng.dtype
        self.E, self.C = E, E + 1
        C = self.C
        z = lambda *s, d=dt: torch.zeros(*s, dtype=d, device=dev)
        # KV cache per layer: history slots 0 .. C-1, then K slots for generated rows. One-beam
        # decoding (greedy, top-k) writes user b's generated row s to [b, :, C + s], so a decode step
        # attends to history and generated keys in one call; beam search keeps each beam's generated
        # rows in gk / gv = the same K slots viewed per beam row (beam r = user * W + w; the history of
        # user b stays in [b, :, :C]), so both share one allocation, itself a view of the engine's pool
        self.kv = kv
        self.hk, self.hv = kv.views(C + K)  # (R, H, C + K, ·) per layer
        self.gk = [t[:, :, C:] for t in self.hk]  # (R, H, K, d_qk) views
        self.gv = [t[:, :, C:] for t in self.hv]
        self.gk_scratch, self.gv_scratch = kv.k_scratch, kv.v_scratch  # beam reorder (R, H, K, ·)
        # static inputs (prefill / extend)
        i64 = torch.int64
        self.ids = z(R, E, d=i64)
        self.t = z(R, E + 2, d=i64)  # event times, request time at L and after
        self.lengths = torch.ones(R, dtype=i64, device=dev)
        self.actions = z(R, E, d=i64)
        tok = m.token_shape  # () or (1 + F,): categories carry the side-feature columns (hstu.data.features)
        self.categories = z(R, E, *tok, d=i64)
        # keys of a one-beam decode step over hk / hv's C + K slots: positions, validity, time buckets;
        # the history parts are what the prefill, extend and beam paths use (kvalid, tb_hist: views)
        self.kpos_j = z(R, C + K, d=i64)
        self.kpos_j[:, :C] = torch.arange(C, dtype=i64, device=dev)  # history slot j holds position j
        self.kvalid_j = z(R, C + K, d=torch.bool)
        self.kvalid_j[:, C:] = True  # a generated row later than the query is masked by position
        self.tb_j = z(R, 1, C + K, d=i64)  # generated rows keep bucket(|rt - rt|) = 0
        # per layer, the bias of the one-beam decode step s (query at position L + s) against the C + K
        # keys, mask folded in: formed once per request group when the kernel set can take it
        # (none without a semantic channel: FuXi-beta's block attends through its bias channels alone)
        semantic = getattr(m.layers[0], "semantic", True)
        self.bias_j = [z(R, K, C + K) for _ in range(c.num_blocks)] if eng.kernels.attention_bias is not None and semantic else None
        # and, with FuXi-alpha's channels ([model] multi_channel), their weights per layer (R, channels, K, C + K)
        Cc = getattr(m.layers[0], "bias_channels", 0)
        self.chan_j = [z(R, Cc, K, C + K) for _ in range(c.num_blocks)] if Cc > 0 else None
        self.kvalid = self.kvalid_j[:, :C]  # (R, C) set per request
        self.start = z(R, d=i64)
        # static inputs (decode step)
        self.item = z(R, d=i64)
        self.pos = z(R, d=i64)
        self.s_idx = z(1, d=i64)
        self.rt = z(R, d=i64)
        self.act = z(R, d=i64)
        self.cat = z(R, *tok, d=i64)
        self.len_r = torch.ones(R, dtype=i64, device=dev)
        self.gpos = z(R, K, d=i64)
        self.tb_hist = self.tb_j[:, :, :C]  # |request time - t_j| buckets: fixed for a request, set before the loop
        self.s_idx_j = z(1, d=i64)  # C + s: the slot of generated row s
        self.runners: dict[tuple, Callable[[], torch.Tensor]] = {}
        self.has_features = (m.action_emb is not None, m.reads_categories)

    def kv_bytes(self) -> int:
        """Bytes of this bucket's K/V views and the beam scratch (a share of the engine's one pool)."""
        views = [*self.hk, *self.hv, self.gk_scratch, self.gv_scratch]  # gk / gv are views into hk / hv
        return sum(t.numel() * t.element_size() for t in views)

    def total_bytes(self) -> int:
        io = [
            self.ids,
            self.t,
            self.lengths,
            self.actions,
            self.categories,
            self.start,
            self.item,
            self.pos,
            self.s_idx,
            self.rt,
            self.act,
            self.cat,
            self.len_r,
            self.gpos,
            self.kpos_j,
            self.kvalid_j,
            self.tb_j,
            self.s_idx_j,
            *(self.bias_j or []),
            *(self.chan_j or []),
        ]
        return self.kv_bytes() + sum(t.numel() * t.element_size() for t in io)

    def prefix_entry(self, j: int, events: torch.Tensor, old: PrefixEntry | None = None, most: int = 0) -> PrefixEntry:
        """Row j's history ``events`` (n, 3 + F) int64 (:func:`hstu.generate.prefix_cache.history_events`)
        and the K/V of its first n - 1 rows in every layer, copied out for the user-prefix cache (the
        last row is recomputed on a hit: its time bias used this request's time).

        ``old``: the user's entry this row loaded, unchanged since (its rows 0..P-1 and events 0..P
        are this history's): where its room holds n events, the rows from P and the events from P + 1
        are written into it and it is returned (a returning user's store copies its new rows only, no
        allocation). Otherwise a new entry with room for max(4, n // 16) more events, at most ``most``
        (the largest bucket's edge). One copy per layer and K / V (a single (Ly, R, ...) pool, one copy
        per K / V, made Inductor fail on the beam step's writes into its views: torch 2.13)."""
        n = events.shape[0]
        e = old if old is not None and old.room >= n else None
        a, a_ev = (e.rows, e.length) if e is not None else (0, 0)  # the rows / events to write
        if e is None:
            room = max(n, min(most, n + max(4, n // 16)))
            (_, H, _, dk), dv = self.hk[0].shape, self.hv[0].shape[-1]
            k, v = self.hk[0].new_empty(len(self.hk), H, room - 1, dk), self.hv[0].new_empty(len(self.hv), H, room - 1, dv)
            e = PrefixEntry(events=events.new_empty(room, events.shape[1]), k=k, v=v, length=n)
        for li, (tk, tv) in enumerate(zip(self.hk, self.hv)):
            e.k[li, :, a : n - 1].copy_(tk[j, :, a : n - 1])  # (H, n - 1 - a, d_qk)
            e.v[li, :, a : n - 1].copy_(tv[j, :, a : n - 1])
        e.events[a_ev:n].copy_(events[a_ev:])
        e.length = n
        return e

    def load_prefixes(self, entries: list[PrefixEntry], rows: list[int]) -> None:
        """Prefix-cache hits into the history slots: ``entries[j]``'s rows 0..rows[j]-1 of every layer
        into row j (the rows the lookup found: an entry a row before this one extended keeps them), one
        copy per user, layer and K / V (no stacked intermediate)."""
        for j, (e, P) in enumerate(zip(entries, rows)):
            for li, (tk, tv) in enumerate(zip(self.hk, self.hv)):
                tk[j, :, :P].copy_(e.k[li, :, :P])
                tv[j, :, :P].copy_(e.v[li, :, :P])

    def load(self, req: dict, ri: torch.Tensor, L: torch.Tensor, rt: torch.Tensor, Bp: int, arange: torch.Tensor) -> None:
        """Copy request rows ``ri`` (Bu,) into the static inputs, then Bp - Bu padding users (length 1,
        item 1): ids / actions / categories (Bp, E) int64 zero past each length, times (Bp, E + 2) with
        the request time rt (Bu,) at L and after, lengths, request times and history key validity."""
        Bu, E = len(ri), self.E
        w = min(req["ids"].shape[1], E)
        live = arange[:w].view(1, w) < L.view(Bu, 1)
        self.ids[:Bp].zero_()
        self.ids[Bu:Bp, 0] = 1
        self.ids[:Bu, :w] = req["ids"][ri, :w] * live
        self.actions[:Bp].zero_()
        self.actions[:Bu, :w] = req["actions"][ri, :w] * live
        self.categories[:Bp].zero_()
        self.categories[:Bu, :w] = req["categories"][ri, :w] * live.view(Bu, w, *[1] * (self.categories.dim() - 2))
        self.lengths[:Bp].fill_(1)
        self.lengths[:Bu] = L
        self.rt[:Bp].zero_()
        self.rt[:Bu] = rt
        self.t[:Bp].copy_(self.rt[:Bp].view(Bp, 1).expand(Bp, E + 2))  # request time at L and after
        self.t[:Bu, :w] = torch.where(live, req["timestamps"][ri, :w], rt.view(Bu, 1))
        self.kvalid[:Bp] = arange[: self.C].view(1, self.C) < self.lengths[:Bp].view(Bp, 1)
