"""Large item-embedding tables: hash-sharded, explicitly placed, memory-planned, with a hot-row cache.

Symbols (declared once for this module):
    V  vocabulary rows (``num_embeddings``; row ``padding_idx`` = 0 is padding and looks up as zeros)
    O  overflow rows (``num_overflow_rows``); ids outside [0, V) map to rows V .. V+O-1
    T  = V + O table rows in all ("global rows")
    S  shards (``num_shards``); shard s holds the global rows g with ``shard_of(g) == s``
    R_s rows of shard s (sum over s = T)
    d  embedding width (``embedding_dim``)
    n  number of looked-up ids

Why: a 120M x 128 table handed to a framework that silently made a dense float32 copy of it took
a process down hours later. Here the table is never materialised in one piece: each shard is
allocated on its own, in its own dtype and place, filled in blocks of at most ``_INIT_BLOCK_ELEMS``
values, and the memory needed is planned and checked before anything is allocated
(:func:`plan_memory`).

Hashing (stable across processes, runs and machines; Python's ``hash()`` is salted per process and
is never used): :func:`splitmix64` is the 64-bit finaliser of SplitMix64 (Steele, Lea & Flood,
"Fast Splittable Pseudorandom Number Generators", OOPSLA 2014; constants as in Vigna's reference
``splitmix64.c``), computed with torch int64 ops that wrap modulo 2**64, logical right shifts made
from arithmetic shifts plus a mask. ``shard_of(g) = (splitmix64(g ^ SHARD_SALT) & (2**63-1)) % S``,
and an out-of-vocabulary id x goes to overflow row ``V + (splitmix64(x ^ OVERFLOW_SALT) & (2**63-1)) % O``.
Within shard s, rows are stored in increasing global-row order, so shard s's local row of g is the
number of rows g' < g with ``shard_of(g') == s``: a deterministic function of (T, S), kept in an
int32 index (4 bytes per row) on the compute device.

Initialisation does not depend on S, the placements or the dtypes: global rows are drawn in fixed
blocks of ``max(1, _INIT_BLOCK_ELEMS // d)`` rows, block b from a ``torch.Generator`` seeded with
``seed * 1_000_003 + b``, as normal(0, init_std) (the distribution of the model's
``nn.init.trunc_normal_(std=0.02)``, whose default bounds +-2 are 100 sigma away), then rounded to
each shard's dtype. So a table with S=1 and one with
S=8 and the same seed hold the same values.

Placement: ``"device"`` = the compute device; ``"host"`` = CPU memory, page-locked in place where the
backend supports pinning (see :meth:`hstu.backend.Backend.pin_in_place`); on a CPU backend
both are plain CPU memory. Placement and per-shard dtype survive ``module.to(...)``, ``.cuda()``,
``.half()``: those change only the compute device and compute dtype (a host shard is never moved
to the device; an fp16 shard is never widened).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hstu.backend import Backend, select
from hstu.backend.cpu import host_memory_info
from hstu.backend.memory_guard import format_bytes, parse_bytes, unpin
from hstu.model.embedding_plan import (
    MemoryPlan,
    MemoryPlanError,
    ShardPlan,
    _index_itemsize,
    cache_bytes_of_shard,
    index_ranges,
    plan_memory,
)
from hstu.model.embedding_rows import (
    _DTYPE_NAMES,
    OVERFLOW_SALT,
    PLACEMENTS,
    SHARD_SALT,
    SparseRows,
    _per_shard,
    dtype_name,
    fill_shards,
    parse_dtype,
    shard_of,
    shard_row_counts,
    splitmix64,
    splitmix64_py,
    to_global_rows,
)
from hstu.model.hot_rows import CACHE_POLICIES, HotRowCache, gather_staged

log = logging.getLogger(__name__)

# hashing, dtypes, reading a rows file: embedding_rows; memory planning: embedding_plan; hot-row cache: hot_rows


class ShardedEmbedding(nn.Module):
    """A V x d embedding table split into S hash-chosen shards, each with its own placement and dtype.

    Drop-in for ``nn.Embedding(V, d, padding_idx=0)`` in the model: ``forward(ids)`` returns rows in
    input order; ``rows(start, end)`` reads a dense range for full-ranking scoring.

    Args:
        num_embeddings: V, rows addressed by ids 0 .. V-1 (row ``padding_idx`` included).
        embedding_dim: d.
        num_shards: S >= 1.
        placement: "device" | "host", or one per shard (see the module docstring).
        dtype: storage dtype "fp32" | "fp16" | "bf16" (or torch dtype), or one per shard.
        num_overflow_rows: O >= 1 rows for ids outside [0, V), chosen by hash (never an IndexError).
        padding_idx: id whose lookup is all zeros (its row is zero-initialised), or None.
        device: compute device: a backend name ("cpu", "cuda", "npu:1", "auto"), torch.device or Backend.
        compute_dtype: dtype of looked-up rows (default float32).
        seed / init_std: deterministic normal(0, init_std) init (see module docstring); ``init_std=0`` gives zeros.
        init_from: optional path to a (V, d) or (V + O, d) table (.npy memory-mapped or .safetensors),
            copied block by block instead of random init (missing overflow rows get the random init).
        cache_bytes: bytes of device-side hot-row cache shared (pro rata by rows) by the host shards; 0 = none.
        cache_policy: "lru" | "lfu"; cache_ways: set associativity.
        sparse: sparse gradients: each shard's ``grad`` a float32 sparse COO tensor whatever its dtype
            (``grad_dtype`` float32; :class:`SparseRows`), for the row-wise optimizer of :mod:`hstu.train.sparse_optim`.
        check_memory: plan and check memory (free device memory, available host memory) before allocating.
        reserve_ratio: fraction of memory left free by that check.

    Raises:
        ValueError: a field out of range or an unknown dtype / placement (the message names it).
        MemoryPlanError: the table does not fit (raised before allocation).

    Parameters: ``shards.{s}``, (R_s, d) in shard s's dtype; ``state_dict()`` holds only these
    (contiguous, no shared storage: safetensors can save it). The row index is a non-persistent buffer
    recomputed from (V, O, S).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        num_shards: int = 1,
        placement: str | Sequence[str] = "device",
        dtype: str | torch.dtype | Sequence[str | torch.dtype] = "fp32",
        num_overflow_rows: int = 1024,
        padding_idx: int | None = 0,
        *,
        device: str | torch.device | Backend = "cpu",
        compute_dtype: str | torch.dtype = torch.float32,
        seed: int = 0,
        init_std: float = 0.02,
        init_from: str | os.PathLike[str] | None = None,
        cache_bytes: int | str = 0,
        cache_policy: str = "lru",
        cache_ways: int = 16,
        sparse: bool = False,
        check_memory: bool = True,
        reserve_ratio: float = 0.05,
    ) -> None:
        super().__init__()
        V, d, S, O = int(num_embeddings), int(embedding_dim), int(num_shards), int(num_overflow_rows)
        for name, val, lo in (("num_embeddings", V, 1), ("embedding_dim", d, 1), ("num_shards", S, 1), ("num_overflow_rows", O, 1)):
            if val < lo:
                raise ValueError(f"ShardedEmbedding: {name} must be >= {lo}, got {val}")
        if padding_idx is not None and not 0 <= padding_idx < V:
            raise ValueError(f"ShardedEmbedding: padding_idx must be in [0, {V}) or None, got {padding_idx}")
        if init_std < 0:
            raise ValueError(f"ShardedEmbedding: init_std must be >= 0, got {init_std}")
        self.num_embeddings, self.embedding_dim, self.num_shards, self.num_overflow_rows = V, d, S, O
        self.padding_idx = padding_idx
        self.sparse = bool(sparse)
        self.seed = int(seed)
        self.init_std = float(init_std)
        self.backend = device if isinstance(device, Backend) else select(str(device))
        self.compute_device = self.backend.device
        self.compute_dtype = parse_dtype(compute_dtype, field="compute_dtype")
        self.placements: list[str] = _per_shard(placement, S, "placement")
        for i, p in enumerate(self.placements):
            if p not in PLACEMENTS:
                raise ValueError(f"ShardedEmbedding: placement[{i}] {p!r} unknown; valid: {', '.join(PLACEMENTS)}")
        self.dtypes = [parse_dtype(x, field=f"dtype[{i}]") for i, x in enumerate(_per_shard(dtype, S, "dtype"))]
        if cache_policy not in CACHE_POLICIES:
            raise ValueError(f"ShardedEmbedding: cache_policy {cache_policy!r} unknown; valid: {', '.join(CACHE_POLICIES)}")
        T = V + O
        cache_total = parse_bytes(cache_bytes, field="cache_bytes")
        device_is_host = self.backend.is_host

        # 1. plan and check memory before any allocation
        self.plan = plan_memory(
            V, d, dtype=self.dtypes, num_shards=S, num_overflow_rows=O, placement=self.placements,
            device_mem=None if device_is_host else self.backend.memory_info().free_bytes,
            host_mem=host_memory_info().free_bytes, device_is_host=device_is_host,
            reserve_ratio=reserve_ratio, cache_bytes=cache_total,
        )  # fmt: skip
        log.info("ShardedEmbedding plan:\n%s", self.plan.format())
        if check_memory:
            self.plan.require()
        self.shard_rows = [sh.rows for sh in self.plan.shards] if self.plan.rows_exact else shard_row_counts(T, S)

        # 2. allocate shard by shard (untouched pages cost no RSS until filled)
        self._pin = self.backend.supports_pinned_memory()
        self._pinned: dict[int, int] = {}
        self._allocate(T)

        # 3. one pass over global rows in blocks: build the row index and fill the shards
        fill_shards(self, Path(init_from) if init_from is not None else None)
        self._local_row = self._local_row.to(self.compute_device)
        for s in range(S):
            if self.placements[s] == "host" and self._pin:
                self._pin_shard(s)
        self._finalizer = weakref.finalize(self, _unpin_all, self._pinned)

        # 4. hot-row caches for host shards, budget split by rows
        self.cache_policy, self.cache_ways = cache_policy, int(cache_ways)
        self.cache_bytes = cache_total
        self.caches: dict[int, HotRowCache] = self._build_caches(cache_total)

    # -- construction helpers ------------------------------------------------------------------

    def _allocate(self, total_rows: int) -> None:
        """Empty shards (R_s, d) in their dtype and place, and the (T,) row index buffer (empty when S = 1)."""
        S = self.num_shards
        self.shards = nn.ParameterList()
        for s in range(S):
            dev = self.compute_device if self.placements[s] == "device" else torch.device("cpu")
            t = torch.empty(self.shard_rows[s], self.embedding_dim, dtype=self.dtypes[s], device=dev)
            self.shards.append(nn.Parameter(t, requires_grad=True))
        self._index_dtype = torch.int32 if _index_itemsize(self.shard_rows, S) == 4 else torch.int64
        self.register_buffer("_local_row", torch.empty(total_rows if S > 1 else 0, dtype=self._index_dtype), persistent=False)

    def _build_caches(self, cache_total: int) -> dict[int, HotRowCache]:
        """One hot-row cache per host shard on the compute device, ``cache_total`` bytes split by rows."""
        host_ids = [s for s in range(self.num_shards) if self.placements[s] == "host"]
        if not cache_total or not host_ids:
            if cache_total:
                log.info("cache_bytes=%d ignored: no host-placed shard", cache_total)
            return {}
        host_rows = sum(self.shard_rows[s] for s in host_ids)
        share = {s: cache_bytes_of_shard(cache_total, self.shard_rows[s], host_rows, self.shards[s].nbytes) for s in host_ids}
        if self.backend.is_host:  # it was said to cost only bookkeeping while it allocated the whole cache_bytes
            log.info("hot-row cache on a CPU compute device: copies of up to %d bytes of rows, no transfer saved", sum(share.values()))
        return {
            s: HotRowCache(
                self.embedding_dim,
                self.dtypes[s],
                self.compute_device,
                share[s],
                ways=self.cache_ways,
                policy=self.cache_policy,
                pin_staging=self._pin,
            )
            for s in host_ids
        }

    def _pin_shard(self, s: int) -> None:
        p = self.shards[s]
        if self.backend.pin_in_place(p.data):
            self._pinned[s] = p.data_ptr()

    # -- lookups -------------------------------------------------------------------------------

    def _shard_rows_for(self, s: int, local: torch.Tensor) -> torch.Tensor:
        """Rows ``shards[s][local]`` as (c, d) on the compute device in the shard dtype (autograd kept)."""
        w = self.shards[s]
        if self.placements[s] == "device":
            return self._gather(local, w)
        cache = self.caches.get(s)
        training = torch.is_grad_enabled() and w.requires_grad
        if cache is not None and not training:
            return cache.lookup(local, w)
        if not training and self._pin and self.backend.supports_pinned_memory():
            return gather_staged(w, local.to(w.device), self.compute_device)
        rows = self._gather(local.to(w.device), w)
        return rows.to(self.compute_device)

    def _gather(self, local: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``w[local]`` (c, d): a dense-gradient ``F.embedding``, or with ``sparse`` rows in the compute dtype
        whose gradient reaches ``w`` as a float32 sparse COO tensor (:class:`SparseRows`)."""
        if not self.sparse:
            return F.embedding(local, w)
        if w.grad_dtype != torch.float32:
            w.grad_dtype = torch.float32  # the engine sums the lookups' sparse gradients in float32
        return SparseRows.apply(local, w, self.compute_dtype)

    def _lookup_global(self, g: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """(n,) global rows on the compute device -> (n, d) compute-dtype rows in the same order.

        ``pad``: optional (p,) positions to zero (padding ids). Each shard gathers its rows (one
        gather and one cast per shard, S masks instead of a sort). Without autograd they are written
        straight into the output; with it the pieces are concatenated and put back in input order by
        one gather with the inverse permutation, since autograd copies the whole (n, d) gradient once
        per in-place write (IndexCopyBackward). Measured on an ML-1M training batch's lookups (25.6k +
        213k ids, S = 4, 1 thread, busy 2-core VM, old and new alternating): forward + backward 945 ->
        655-705 ms (dense table: ~400); a cat would make lookups without autograd slower instead.
        """
        S = self.num_shards
        if S == 1:
            out = self._shard_rows_for(0, g).to(self.compute_dtype)
            return out if pad is None or pad.numel() == 0 else out.index_fill(0, pad, 0)
        n = g.numel()
        sh = shard_of(g, S)  # (n,)
        local = self._local_row[g]  # (n,) int32/int64
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.shards)
        out = None if grad else torch.empty(n, self.embedding_dim, dtype=self.compute_dtype, device=g.device)  # (n, d)
        parts, where = [], []
        for s in range(S):
            pos = sh.eq(s).nonzero().squeeze(1)  # (c,) input positions served by shard s
            if pos.numel():
                rows = self._shard_rows_for(s, local.index_select(0, pos).long()).to(self.compute_dtype)  # (c, d)
                if out is None:
                    parts.append(rows)
                    where.append(pos)
                else:
                    out.index_copy_(0, pos, rows)
        if out is None:
            order = torch.cat(where)  # (n,) input position of each gathered row
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(n, device=order.device)
            out = torch.cat(parts).index_select(0, inverse)
        return out if pad is None or pad.numel() == 0 else out.index_fill(0, pad, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up ``ids``.

        Args:
            ids: integer tensor, any shape (...), any device; ids outside [0, V) use overflow rows.
        Returns:
            (..., d) tensor on the compute device in the compute dtype; rows of ``padding_idx`` are 0.
        Raises:
            TypeError: ``ids`` is not an integer tensor.
        """
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ShardedEmbedding: ids must be an integer tensor, got {ids.dtype}")
        shape = ids.shape
        flat = ids.reshape(-1).to(self.compute_device, torch.int64)  # (n,)
        if flat.numel() == 0:
            return torch.zeros(*shape, self.embedding_dim, dtype=self.compute_dtype, device=self.compute_device)
        g = to_global_rows(flat, self.num_embeddings, self.num_overflow_rows)
        pad = None if self.padding_idx is None else flat.eq(self.padding_idx).nonzero().squeeze(1)
        out = self._lookup_global(g, pad)  # (n, d)
        return out.reshape(*shape, self.embedding_dim)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Dense rows for ids ``start .. end-1`` (0 <= start <= end <= V), as (end-start, d) compute-dtype.

        For full-ranking scoring in chunks; the padding row reads as zeros.

        Raises:
            ValueError: the range is outside [0, V].
        """
        if not 0 <= start <= end <= self.num_embeddings:
            raise ValueError(f"rows({start}, {end}): need 0 <= start <= end <= num_embeddings={self.num_embeddings}")
        return self(torch.arange(start, end, device=self.compute_device))

    def storage_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Where each id's row is stored, with the shards laid end to end in shard order: (n,) int64 ids
        (any, as :meth:`forward`) -> (n,) int64 positions in [0, T), shard s's local row r at
        ``sum(R_0 .. R_{s-1}) + r``. Scoring the shards in storage order (``item_index.ShardIndex``)
        reads the rows without hashing or gathering them."""
        g = to_global_rows(ids.reshape(-1).to(self.compute_device, torch.int64), self.num_embeddings, self.num_overflow_rows)
        if self.num_shards == 1:
            return g
        starts = torch.tensor([0, *np.cumsum(self.shard_rows)[:-1].tolist()], dtype=torch.int64, device=g.device)
        return starts[shard_of(g, self.num_shards)] + self._local_row[g].long()

    @torch.no_grad()
    def write_rows(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the rows of ``ids`` (n,) with ``values`` (n, d), keeping hot-row caches coherent.

        Rounds to each shard's dtype. Ids outside [0, V) write their overflow rows.
        """
        flat = ids.reshape(-1).to(self.compute_device, torch.int64)
        values = values.reshape(-1, self.embedding_dim)
        if values.shape[0] != flat.numel():
            raise ValueError(f"write_rows: {flat.numel()} ids but values has shape {tuple(values.shape)}")
        g = to_global_rows(flat, self.num_embeddings, self.num_overflow_rows)
        sh = shard_of(g, self.num_shards)
        local = g if self.num_shards == 1 else self._local_row[g].long()
        for s in range(self.num_shards):
            m = sh.eq(s)
            if not bool(m.any()):
                continue
            w = self.shards[s]
            rows_s, vals_s = local[m], values[m.to(values.device)]
            if s in self.caches:
                self.caches[s].update(rows_s, vals_s, w)
            else:
                w.index_copy_(0, rows_s.to(w.device), vals_s.to(w.device, w.dtype))

    # -- caches, metrics, I/O ------------------------------------------------------------------

    def cache_metrics(self) -> dict[str, float]:
        """Summed metrics of all hot-row caches (see :meth:`HotRowCache.metrics`); zeros when none."""
        keys = ("hits", "misses", "evictions", "invalidations", "capacity_rows", "bytes")
        tot = {k: sum(c.metrics()[k] for c in self.caches.values()) for k in keys}
        n = tot["hits"] + tot["misses"]
        tot["hit_rate"] = tot["hits"] / n if n else 0.0
        return tot

    def reset_cache_metrics(self) -> None:
        for c in self.caches.values():
            c.reset_metrics()

    def invalidate_caches(self) -> None:
        for c in self.caches.values():
            c.invalidate()

    @torch.no_grad()
    def cast_storage(self, dtype: str | torch.dtype) -> None:
        """Store every shard's rows in ``dtype`` ("fp32" | "fp16" | "bf16" or a torch dtype), rounded to
        nearest, in place of the old ones: placement kept (host shards re-pinned where the backend
        pins), hot-row caches rebuilt empty in the new dtype; the compute dtype is unchanged. What
        quantizing a hashed table means (:mod:`hstu.quant`: the INT8 scheme's item-table storage, the
        16-bit schemes). Raises ValueError for another dtype."""
        dt = parse_dtype(dtype, field="dtype")
        for s, p in enumerate(self.shards):
            if p.dtype == dt:
                continue
            if s in self._pinned:
                unpin(self._pinned.pop(s))
            p.data = p.data.to(dt)
            if self.placements[s] == "host" and self._pin:
                self._pin_shard(s)
        self.dtypes = [dt] * self.num_shards
        self.caches = self._build_caches(self.cache_bytes)

    def host_tensors(self) -> list[str]:
        """Names (as in ``named_parameters()``) of the shards kept in host memory on purpose: an
        inference device check (:func:`hstu.generate.hardening.check_device`) skips them."""
        return [f"shards.{s}" for s, p in enumerate(self.placements) if p == "host"]

    @torch.no_grad()
    def save_dense(self, path: str | os.PathLike[str], *, dtype: str | torch.dtype = "fp32", chunk_rows: int = 1 << 16) -> None:
        """Write all V + O rows, in global order, to a .npy file (memory-mapped, chunk by chunk).

        The file loads back with ``init_from=path`` into any number of shards. bf16 is stored as float32
        (NumPy has no bfloat16).
        """
        dt = parse_dtype(dtype)
        np_dt = np.float16 if dt == torch.float16 else np.float32
        T = self.num_embeddings + self.num_overflow_rows
        out = np.lib.format.open_memmap(os.fspath(path), mode="w+", dtype=np_dt, shape=(T, self.embedding_dim))
        for a in range(0, T, chunk_rows):
            b = min(a + chunk_rows, T)
            g = torch.arange(a, b, device=self.compute_device)
            out[a:b] = self._lookup_global(g).to("cpu", torch.float32).numpy().astype(np_dt, copy=False)
        out.flush()
        del out

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, shards={self.num_shards}, overflow={self.num_overflow_rows}, "
            f"padding_idx={self.padding_idx}, placements={self.placements}, "
            f"dtypes={[dtype_name(x) for x in self.dtypes]}, compute={self.compute_device}/{dtype_name(self.compute_dtype)}"
            + (f", cache={format_bytes(sum(c.bytes for c in self.caches.values()))} {self.cache_policy}" if self.caches else "")
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ShardedEmbedding:
        """``.to()``, ``.cuda()``, ``.half()`` ...: change only the compute device / dtype (see module doc)."""
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=self.compute_device))
        new_dev, new_dtype = probe.device, probe.dtype
        if new_dtype.is_floating_point and new_dtype in _DTYPE_NAMES:
            self.compute_dtype = new_dtype
        if new_dev != self.compute_device:
            self.backend = select(str(new_dev))
            self.compute_device = self.backend.device
            for s, p in enumerate(self.shards):
                if self.placements[s] == "device":
                    p.data = p.data.to(self.compute_device)
                    if p.grad is not None:
                        p.grad = p.grad.to(self.compute_device)
            self._local_row = self._local_row.to(self.compute_device)
            for c in self.caches.values():
                c.to(self.compute_device)
                c.pin_staging = self.backend.supports_pinned_memory()
            if self.backend.supports_pinned_memory() and not self._pin:
                self._pin = True
                for s in range(self.num_shards):
                    if self.placements[s] == "host":
                        self._pin_shard(s)
        return self


def _unpin_all(pinned: dict[int, int]) -> None:
    for ptr in pinned.values():
        unpin(ptr)
    pinned.clear()


__all__ = [
    "ShardedEmbedding",
    "HotRowCache",
    "MemoryPlan",
    "MemoryPlanError",
    "ShardPlan",
    "plan_memory",
    "splitmix64",
    "splitmix64_py",
    "shard_of",
    "to_global_rows",
    "shard_row_counts",
    "parse_dtype",
    "CACHE_POLICIES",
    "PLACEMENTS",
    # re-exported from the split modules (embedding_rows, embedding_plan, hot_rows) for old imports
    "SHARD_SALT",
    "OVERFLOW_SALT",
    "dtype_name",
    "index_ranges",
]
