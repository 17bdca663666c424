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
import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hstu.backend import Backend, select
from hstu.backend.cpu import host_memory_info
from hstu.backend.memory_guard import format_bytes, parse_bytes, unpin

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Stable hashing (splitmix64 finaliser in torch int64 arithmetic)
# ---------------------------------------------------------------------------------------------

_U64 = 1 << 64


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - _U64 if c >= 1 << 63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)  # golden-ratio increment of SplitMix64
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_MAX63 = (1 << 63) - 1
SHARD_SALT = 0x5348_4152_445F_5341  # "SHARD_SA": separates the shard hash from the others
OVERFLOW_SALT = 0x4F56_4552_464C_4F57  # "OVERFLOW"
CACHE_SALT = 0x4341_4348_455F_5345  # "CACHE_SE"
_INIT_BLOCK_ELEMS = 1 << 20  # values per init block (4 MiB as float32); fixed so init is reproducible
_COUNT_CHUNK = 1 << 15  # global rows hashed per chunk (<= 32768 keeps torch ops single-threaded and in cache: fastest here)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits by k (torch's >> on int64 is arithmetic)."""
    return torch.bitwise_and(torch.bitwise_right_shift(x, k), (1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 output function of ``x``: a stable 64-bit mix, bit-identical on every process.

    Args:
        x: int64 tensor, any shape, any device.
    Returns:
        int64 tensor, same shape: the 64 output bits as a signed int64 (two's complement).
    Source: Steele, Lea & Flood, OOPSLA 2014; constants from Vigna's ``splitmix64.c``.
    Raises:
        TypeError: ``x`` is not int64.
    """
    if x.dtype != torch.int64:
        raise TypeError(f"splitmix64 needs an int64 tensor, got {x.dtype}")
    z = x + _GAMMA
    z = torch.bitwise_xor(z, _lsr(z, 30)) * _M1
    z = torch.bitwise_xor(z, _lsr(z, 27)) * _M2
    return torch.bitwise_xor(z, _lsr(z, 31))


def splitmix64_py(x: int) -> int:
    """Pure-Python SplitMix64 output function (unsigned 64-bit result); the reference for tests."""
    z = (x + 0x9E3779B97F4A7C15) % _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _U64
    return z ^ (z >> 31)


def _hash_mod(x: torch.Tensor, salt: int, m: int) -> torch.Tensor:
    """``(splitmix64(x ^ salt) & (2**63 - 1)) % m`` as int64; ``m >= 1``."""
    if m == 1:
        return torch.zeros_like(x)
    return torch.remainder(torch.bitwise_and(splitmix64(torch.bitwise_xor(x, salt)), _MAX63), m)


def shard_of(rows: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Shard index in [0, S) of each global row (int64 tensor, any shape); see the module docstring."""
    return _hash_mod(rows, SHARD_SALT, num_shards)


def to_global_rows(ids: torch.Tensor, num_embeddings: int, num_overflow_rows: int) -> torch.Tensor:
    """Map ids to global rows: ids in [0, V) stay, all others go to hashed overflow rows in [V, V+O).

    Args:
        ids: int64 tensor, any shape (negative and too-large ids allowed).
    Returns:
        int64 tensor, same shape, values in [0, V + O).
    """
    outside = ((ids < 0) | (ids >= num_embeddings)).nonzero(as_tuple=True)
    if outside[0].numel() == 0:
        return ids  # the usual case: hash nothing
    g = ids.clone()
    g[outside] = num_embeddings + _hash_mod(ids[outside], OVERFLOW_SALT, num_overflow_rows)
    return g


def shard_row_counts(total_rows: int, num_shards: int, *, chunk: int = _COUNT_CHUNK) -> list[int]:
    """Rows per shard, [R_0 .. R_{S-1}], for a table of ``total_rows`` global rows, hashed in chunks.

    Allocates only O(chunk) int64 scratch; exact (not an estimate), so a plan matches the table.
    """
    if num_shards == 1:
        return [int(total_rows)]
    counts = torch.zeros(num_shards, dtype=torch.int64)
    for start in range(0, total_rows, chunk):
        g = torch.arange(start, min(start + chunk, total_rows), dtype=torch.int64)
        counts += torch.bincount(shard_of(g, num_shards), minlength=num_shards)
    return [int(c) for c in counts.tolist()]


# ---------------------------------------------------------------------------------------------
# Dtypes and placements
# ---------------------------------------------------------------------------------------------

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
PLACEMENTS = ("device", "host")


def parse_dtype(value: str | torch.dtype, *, field: str = "dtype") -> torch.dtype:
    """``"fp32" | "fp16" | "bf16"`` (or their torch names, or a torch.dtype) -> torch.dtype.

    Raises:
        ValueError: anything else; the message names ``field`` and the valid values.
    """
    if isinstance(value, torch.dtype):
        if value in _DTYPE_NAMES:
            return value
    elif isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(f"{field}: unsupported dtype {value!r}; valid: fp32, fp16, bf16")


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _per_shard(value: Any, num_shards: int, field: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != num_shards:
            raise ValueError(f"{field}: got {len(value)} values for {num_shards} shards: {list(value)!r}")
        return list(value)
    return [value] * num_shards


# ---------------------------------------------------------------------------------------------
# Memory planning
# ---------------------------------------------------------------------------------------------


class MemoryPlanError(ValueError):
    """A table does not fit the memory it would be placed in; raised before anything is allocated."""


@dataclass(frozen=True)
class ShardPlan:
    """One shard: ``rows`` (R_s), ``dtype`` name, ``bytes`` (R_s * d * itemsize), ``placement``."""

    index: int
    rows: int
    dtype: str
    bytes: int
    placement: str


@dataclass
class MemoryPlan:
    """Per-shard bytes and placement of a table, and whether it fits its memory budgets.

    ``device_bytes`` covers device shards + the row index (4 or 8 bytes per global row, on the compute
    device) + the hot-row cache; ``host_bytes`` covers host shards. Budgets are the given memory
    times ``1 - reserve_ratio`` (the rest is left for activations, the optimizer, the OS).
    When ``device_is_host`` (a CPU compute device) both draw from the host budget.
    """

    num_embeddings: int
    num_overflow_rows: int
    embedding_dim: int
    shards: list[ShardPlan]
    index_bytes: int
    cache_bytes: int
    device_bytes: int
    host_bytes: int
    device_budget: int | None
    host_budget: int | None
    device_is_host: bool
    reserve_ratio: float
    problems: list[str] = field(default_factory=list)
    rows_exact: bool = True  # False: rows per shard estimated (the table was refused before counting)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def table_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def require(self) -> MemoryPlan:
        """Return self if it fits, else raise :class:`MemoryPlanError` listing every problem."""
        if self.problems:
            raise MemoryPlanError("embedding table does not fit: " + "; ".join(self.problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fits"] = self.fits
        d["table_bytes"] = self.table_bytes
        return d

    def format(self) -> str:
        """The plan as an aligned text table (one line per shard) with totals and a verdict."""
        T = self.num_embeddings + self.num_overflow_rows
        lines = [
            f"table: {self.num_embeddings:,} rows (+{self.num_overflow_rows:,} overflow) x {self.embedding_dim} "
            f"= {format_bytes(self.table_bytes)} in {len(self.shards)} shard(s)",
            f"{'shard':>5}  {'rows':>13}  {'dtype':>5}  {'bytes':>15}  {'size':>10}  placement",
        ]
        shown = self.shards if len(self.shards) <= FORMAT_MAX_SHARDS else self.shards[:FORMAT_MAX_SHARDS - 4] + self.shards[-4:]
        for j, s in enumerate(shown):
            if j == FORMAT_MAX_SHARDS - 4 and len(shown) < len(self.shards):
                lines.append(f"{'...':>5}  ({len(self.shards) - len(shown):,} more shards; --json lists them all)")
            lines.append(
                f"{s.index:>5}  {s.rows:>13,}  {s.dtype:>5}  {s.bytes:>15,}  {format_bytes(s.bytes):>10}  {s.placement}"
            )
        lines.append(f"row index ({T:,} rows) on device: {format_bytes(self.index_bytes)}")
        if self.cache_bytes:
            lines.append(f"hot-row cache on device: {format_bytes(self.cache_bytes)}")

        def budget(b: int | None) -> str:
            return "unknown" if b is None else format_bytes(b)

        if self.device_is_host:
            lines.append(
                f"host (= compute device): {format_bytes(self.device_bytes + self.host_bytes)} "
                f"of {budget(self.host_budget)} budget (reserve {self.reserve_ratio:.0%})"
            )
        else:
            lines.append(
                f"device: {format_bytes(self.device_bytes)} of {budget(self.device_budget)} budget; "
                f"host: {format_bytes(self.host_bytes)} of {budget(self.host_budget)} budget "
                f"(reserve {self.reserve_ratio:.0%} each)"
            )
        lines.append("fits: yes" if self.fits else "fits: NO - " + "; ".join(self.problems))
        return "\n".join(lines)


def _index_itemsize(shard_rows: Sequence[int], num_shards: int) -> int:
    if num_shards == 1:
        return 0  # S = 1 needs no index: local row = global row
    return 4 if max(shard_rows) < 2**31 else 8


FORMAT_MAX_SHARDS = 24  # MemoryPlan.format lists at most this many shard lines (first and last ones)


def index_ranges(idx: list[int]) -> str:
    """Ascending shard indices as compact ranges: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    parts, start = [], None
    for j, v in enumerate(idx):
        if start is None:
            start = v
        if j + 1 == len(idx) or idx[j + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts) or "none"


def plan_memory(
    num_embeddings: int,
    embedding_dim: int,
    *,
    dtype: str | torch.dtype | Sequence[str | torch.dtype] = "fp32",
    num_shards: int | None = None,
    num_overflow_rows: int = 1024,
    placement: str | Sequence[str] = "auto",
    device_mem: int | str | None = None,
    host_mem: int | str | None = None,
    device_is_host: bool = False,
    reserve_ratio: float = 0.1,
    cache_bytes: int | str = 0,
    max_shard_bytes: int | str = "1GiB",
    shard_rows: Sequence[int] | None = None,
) -> MemoryPlan:
    """Plan per-shard rows, bytes and placement of a V x d table; allocates nothing (O(chunk) scratch).

    Args:
        num_embeddings: V (includes the padding row 0), >= 1.
        embedding_dim: d, >= 1.
        dtype: storage dtype, one for all shards or one per shard ("fp32", "fp16", "bf16").
        num_shards: S; None chooses ceil(table bytes / max_shard_bytes) (at least 1).
        num_overflow_rows: O, >= 1.
        placement: "device", "host", one per shard, or "auto": device shards first while they fit the
            device budget, the rest on host (on a CPU compute device, "auto" means all "device").
        device_mem / host_mem: memory in bytes (or "32GiB"-style strings); None means unknown (not checked).
        device_is_host: the compute device is the CPU, so device and host shards share ``host_mem``.
        reserve_ratio: fraction of each memory kept free, in [0, 1).
        cache_bytes: bytes of the hot-row cache on the device (counted when any shard is on host).
        max_shard_bytes: upper size of one shard when S is chosen automatically.
        shard_rows: exact [R_s] if already known (else counted by :func:`shard_row_counts`, unless the
            whole table exceeds all the memory given: then refused at once with an even-split estimate).
    Returns:
        :class:`MemoryPlan`; check ``.fits`` or call ``.require()``.
    Raises:
        ValueError: a field out of range (the message names it).
    """
    V, d, O = int(num_embeddings), int(embedding_dim), int(num_overflow_rows)
    if V < 1:
        raise ValueError(f"num_embeddings must be >= 1, got {num_embeddings!r}")
    if d < 1:
        raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim!r}")
    if O < 1:
        raise ValueError(f"num_overflow_rows must be >= 1, got {num_overflow_rows!r}")
    if not 0.0 <= reserve_ratio < 1.0:
        raise ValueError(f"reserve_ratio must be in [0, 1), got {reserve_ratio!r}")
    T = V + O
    max_shard = parse_bytes(max_shard_bytes, field="max_shard_bytes")
    cache = parse_bytes(cache_bytes, field="cache_bytes")
    if num_shards is None:
        given = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype]
        widest = max(torch.tensor([], dtype=parse_dtype(x)).element_size() for x in given)
        num_shards = max(1, math.ceil(T * d * widest / max(1, max_shard)))
    S = int(num_shards)
    if S < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards!r}")
    dtypes = [parse_dtype(x, field=f"dtype[{i}]") for i, x in enumerate(_per_shard(dtype, S, "dtype"))]
    itemsizes = [torch.tensor([], dtype=dt).element_size() for dt in dtypes]
    rows_exact = True
    if shard_rows is not None:
        rows = list(shard_rows)
    elif S == 1:
        rows = [T]
    else:
        # refuse at once (without hashing T rows) when even the whole table cannot fit anywhere
        total_budget = None
        if device_is_host and host_mem is not None:
            total_budget = parse_bytes(host_mem, field="host_mem")
        elif not device_is_host and device_mem is not None and host_mem is not None:
            total_budget = parse_bytes(device_mem, field="device_mem") + parse_bytes(host_mem, field="host_mem")
        if total_budget is not None and T * d * min(itemsizes) > total_budget:
            rows = [T // S + (1 if i < T % S else 0) for i in range(S)]  # even split: an estimate
            rows_exact = False
        else:
            rows = shard_row_counts(T, S)
    if len(rows) != S or sum(rows) != T:
        raise ValueError(f"shard_rows must be {S} counts summing to {T}, got {len(rows)} summing to {sum(rows)}")
    sizes = [r * d * it for r, it in zip(rows, itemsizes)]
    index_bytes = T * _index_itemsize(rows, S)
    dev_budget = None if device_mem is None else int(parse_bytes(device_mem, field="device_mem") * (1 - reserve_ratio))
    host_budget = None if host_mem is None else int(parse_bytes(host_mem, field="host_mem") * (1 - reserve_ratio))

    if isinstance(placement, str) and placement == "auto":
        if device_is_host:
            places = ["device"] * S
        else:
            places, used = [], index_bytes
            room = dev_budget
            for b in sizes:
                # keep room for the cache as soon as a shard goes to host
                if room is None or used + b + (cache if "host" in places else 0) <= room:
                    places.append("device")
                    used += b
                else:
                    places.append("host")
            if "host" in places and room is not None and used + cache > room:
                # the cache pushes the last device shard(s) out
                while places.count("device") and used + cache > room:
                    k = max(i for i, p in enumerate(places) if p == "device")
                    places[k] = "host"
                    used -= sizes[k]
    else:
        places = _per_shard(placement, S, "placement")
        for i, p in enumerate(places):
            if p not in PLACEMENTS:
                raise ValueError(f"placement[{i}]: unknown placement {p!r}; valid: device, host (or auto for all)")

    any_host = "host" in places
    cache_used = cache if any_host else 0
    shards = [ShardPlan(i, rows[i], dtype_name(dtypes[i]), sizes[i], places[i]) for i in range(S)]
    device_bytes = index_bytes + cache_used + sum(s.bytes for s in shards if s.placement == "device")
    host_bytes = sum(s.bytes for s in shards if s.placement == "host")
    problems: list[str] = []
    if device_is_host:
        need = device_bytes + host_bytes
        if host_budget is not None and need > host_budget:
            problems.append(
                f"needs {format_bytes(need)} of host memory (compute device is the CPU), budget is "
                f"{format_bytes(host_budget)} ({format_bytes(parse_bytes(host_mem or 0))} less {reserve_ratio:.0%} reserve)"
            )
    else:
        if dev_budget is not None and device_bytes > dev_budget:
            on_dev = index_ranges([s.index for s in shards if s.placement == "device"])
            problems.append(
                f"device needs {format_bytes(device_bytes)} (shards {on_dev}, index {format_bytes(index_bytes)}, "
                f"cache {format_bytes(cache_used)}), budget is {format_bytes(dev_budget)}"
            )
        if host_budget is not None and host_bytes > host_budget:
            on_host = index_ranges([s.index for s in shards if s.placement == "host"])
            problems.append(
                f"host needs {format_bytes(host_bytes)} (shards {on_host}), budget is {format_bytes(host_budget)}"
            )
    return MemoryPlan(
        num_embeddings=V,
        num_overflow_rows=O,
        embedding_dim=d,
        shards=shards,
        index_bytes=index_bytes,
        cache_bytes=cache_used,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        device_budget=dev_budget,
        host_budget=host_budget,
        device_is_host=device_is_host,
        reserve_ratio=reserve_ratio,
        problems=problems,
        rows_exact=rows_exact,
    )


# ---------------------------------------------------------------------------------------------
# Hot-row cache
# ---------------------------------------------------------------------------------------------

CACHE_POLICIES = ("lru", "lfu")


class HotRowCache:
    """Device-side, set-associative cache of rows of one host-placed table (R, d).

    ``capacity_bytes // (d * itemsize)`` rows in ``num_sets`` sets of ``ways`` slots; row r may only
    live in set ``hash(r) % num_sets``. On a miss the row is read from the host table and admitted,
    evicting the slot with the oldest use (``"lru"``) or the fewest uses (``"lfu"``, counts halved
    after every 4 x ``capacity`` admissions so old favourites age out). This is the layout of
    FBGEMM's TBE LRU/LFU caches (set-associative, 32 ways), re-done here in plain torch ops.

    Coherence: lookups return exactly what the host table holds. The cache remembers the host
    tensor's storage pointer and autograd version counter (``Tensor._version``, bumped by every
    in-place write: ``optimizer.step``, ``copy_``, ``load_state_dict``); on any change it is
    flushed. :meth:`update` writes rows through to both host table and cache without a flush.
    Writes made through ``tensor.data`` bypass the version counter: call :meth:`invalidate` after them.

    Metrics (:meth:`metrics`): ``hits``, ``misses`` (per looked-up id, duplicates counted),
    ``hit_rate``, ``evictions``, ``invalidations``, ``capacity_rows``, ``bytes``.
    """

    def __init__(
        self,
        embedding_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity_bytes: int | str,
        *,
        ways: int = 16,
        policy: str = "lru",
        pin_staging: bool = False,
    ) -> None:
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy {policy!r} unknown; valid: {', '.join(CACHE_POLICIES)}")
        if int(ways) < 1:
            raise ValueError(f"cache ways must be >= 1, got {ways!r}")
        row_bytes = int(embedding_dim) * torch.tensor([], dtype=dtype).element_size()
        cap = parse_bytes(capacity_bytes, field="cache_bytes") // row_bytes
        if cap < 1:
            raise ValueError(
                f"cache_bytes={capacity_bytes!r} holds no row of {row_bytes} bytes (d={embedding_dim}, {dtype_name(dtype)})"
            )
        W = min(int(ways), cap)
        self.num_sets = cap // W
        self.ways = W
        self.capacity = self.num_sets * W
        self.dim = int(embedding_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.policy = policy
        self.pin_staging = pin_staging
        self.keys = torch.full((self.num_sets, W), -1, dtype=torch.int64, device=self.device)  # (sets, W)
        self.score = torch.full((self.num_sets, W), -1, dtype=torch.int64, device=self.device)  # (sets, W)
        self.data = torch.zeros(self.capacity, self.dim, dtype=dtype, device=self.device)  # (sets * W, d)
        self._tick = 0
        self._admitted_since_aging = 0
        self._seen: tuple[int, int] | None = None
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.invalidations = 0

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size() + 2 * self.keys.numel() * 8

    def to(self, device: torch.device | str) -> HotRowCache:
        """Move the cache to another device (it is emptied)."""
        self.device = torch.device(device)
        self.keys = torch.full_like(self.keys, -1, device=self.device)
        self.score = torch.full_like(self.score, -1, device=self.device)
        self.data = torch.zeros_like(self.data, device=self.device)
        self._seen = None
        return self

    def invalidate(self) -> None:
        """Empty the cache (keeps metrics; counts one invalidation)."""
        self.keys.fill_(-1)
        self.score.fill_(-1)
        self._seen = None
        self.invalidations += 1

    def reset_metrics(self) -> None:
        self.hits = self.misses = self.evictions = self.invalidations = 0

    def metrics(self) -> dict[str, float]:
        total = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / total if total else 0.0,
            "evictions": self.evictions,
            "invalidations": self.invalidations,
            "capacity_rows": self.capacity,
            "bytes": self.bytes,
        }

    def _check_coherent(self, weight: torch.Tensor) -> None:
        state = (weight.data_ptr(), weight._version)
        if self._seen is not None and self._seen != state:
            log.debug("hot-row cache flushed: host table changed (ptr/version %s -> %s)", self._seen, state)
            self.invalidate()
        self._seen = state

    def _sets(self, rows: torch.Tensor) -> torch.Tensor:
        return _hash_mod(rows, CACHE_SALT, self.num_sets)

    def _fetch(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        idx = rows.to(weight.device)
        if self.pin_staging:
            return _gather_staged(weight, idx, self.device)
        return weight.detach().index_select(0, idx).to(self.device)

    @torch.no_grad()
    def lookup(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows ``weight[rows]`` through the cache.

        Args:
            rows: (n,) int64 local rows of ``weight``, on the cache device; trusted to be in [0, R).
            weight: (R, d) host table (CPU), dtype = the cache dtype.
        Returns:
            (n, d) tensor on the cache device, dtype of ``weight``, equal to ``weight[rows]``; no autograd.
        """
        self._check_coherent(weight)
        n = rows.numel()
        out = torch.empty(n, self.dim, dtype=self.dtype, device=self.device)  # (n, d)
        if n == 0:
            return out
        self._tick += 1
        sets = self._sets(rows)  # (n,)
        match = self.keys[sets].eq(rows.unsqueeze(1))  # (n, W)
        hit = match.any(1)  # (n,)
        hit_idx = hit.nonzero().squeeze(1)
        miss_idx = (~hit).nonzero().squeeze(1)
        if hit_idx.numel():
            h_sets = sets[hit_idx]
            h_ways = match[hit_idx].to(torch.uint8).argmax(1)
            out[hit_idx] = self.data[h_sets * self.ways + h_ways]
            if self.policy == "lru":
                self.score[h_sets, h_ways] = self._tick
            else:
                self.score.index_put_((h_sets, h_ways), torch.ones_like(h_sets), accumulate=True)
        if miss_idx.numel():
            uniq, inverse, counts = torch.unique(rows[miss_idx], return_inverse=True, return_counts=True)
            fetched = self._fetch(uniq, weight)  # (u, d)
            out[miss_idx] = fetched[inverse]
            self._admit(uniq, fetched, counts)
        self.hits += int(hit_idx.numel())
        self.misses += int(miss_idx.numel())
        return out

    def _admit(self, rows: torch.Tensor, values: torch.Tensor, counts: torch.Tensor) -> None:
        """Insert distinct ``rows`` (u,) with ``values`` (u, d); at most ``ways`` per set per call."""
        sets = self._sets(rows)
        order = torch.argsort(sets, stable=True)
        s_sorted = sets[order]
        m = s_sorted.numel()
        pos = torch.arange(m, device=self.device)
        first = torch.ones(m, dtype=torch.bool, device=self.device)
        first[1:] = s_sorted[1:] != s_sorted[:-1]
        rank = pos - torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), 0).values  # rank within its set
        keep = rank < self.ways
        sel = order[keep]
        k_sets, k_rank = s_sorted[keep], rank[keep]
        # the rank-th least recently / frequently used way of each set (empty ways score -1: first)
        victims = torch.argsort(self.score[k_sets], dim=1, stable=True).gather(1, k_rank.unsqueeze(1)).squeeze(1)
        old = self.keys[k_sets, victims]
        self.evictions += int((old >= 0).sum())
        self.keys[k_sets, victims] = rows[sel]
        self.data[k_sets * self.ways + victims] = values[sel]
        self.score[k_sets, victims] = self._tick if self.policy == "lru" else counts[sel]
        if self.policy == "lfu":
            self._admitted_since_aging += int(sel.numel())
            if self._admitted_since_aging >= 4 * self.capacity:
                live = self.score >= 0
                self.score[live] = torch.bitwise_right_shift(self.score[live], 1)
                self._admitted_since_aging = 0

    @torch.no_grad()
    def update(self, rows: torch.Tensor, values: torch.Tensor, weight: torch.Tensor) -> None:
        """Write ``values`` (n, d) to host rows ``rows`` (n,) and to any cached copies (write-through)."""
        self._check_coherent(weight)
        weight.index_copy_(0, rows.to(weight.device), values.to(weight.device, weight.dtype))
        sets = self._sets(rows.to(self.device))
        match = self.keys[sets].eq(rows.to(self.device).unsqueeze(1))  # (n, W)
        hit = match.any(1)
        if hit.any():
            idx = hit.nonzero().squeeze(1)
            ways = match[idx].to(torch.uint8).argmax(1)
            self.data[sets[idx] * self.ways + ways] = values[idx].to(self.device, self.dtype)
        self._seen = (weight.data_ptr(), weight._version)


# ---------------------------------------------------------------------------------------------
# The sharded table
# ---------------------------------------------------------------------------------------------


def _read_rows_source(path: Path) -> tuple[Callable[[int, int], torch.Tensor], tuple[int, int]]:
    """Open a (rows, d) table in ``path`` (.npy memory-mapped, or .safetensors sliced) for block reads."""
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 2:
            raise ValueError(f"{path}: expected a 2-D (rows, d) array, got shape {arr.shape}")
        # np.array copies the memory-mapped slice (the file stays read-only and untouched)
        return (lambda a, b: torch.from_numpy(np.array(arr[a:b], dtype=np.float32))), (arr.shape[0], arr.shape[1])
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        fh = safe_open(str(path), framework="pt")
        keys = list(fh.keys())
        key = "weight" if "weight" in keys else (keys[0] if len(keys) == 1 else None)
        if key is None:
            raise ValueError(f"{path}: expected a tensor named 'weight' or exactly one tensor, found {keys}")
        sl = fh.get_slice(key)
        shape = sl.get_shape()
        if len(shape) != 2:
            raise ValueError(f"{path}: tensor {key!r} must be 2-D (rows, d), got shape {shape}")
        return (lambda a, b: sl[a:b].float()), (shape[0], shape[1])
    raise ValueError(f"{path}: unsupported table file; use .npy or .safetensors")


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
        sparse: produce sparse gradients (``F.embedding(sparse=True)``; use SGD/SparseAdam).
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
        self.shards = nn.ParameterList()
        for s in range(S):
            dev = self.compute_device if self.placements[s] == "device" else torch.device("cpu")
            t = torch.empty(self.shard_rows[s], d, dtype=self.dtypes[s], device=dev)
            self.shards.append(nn.Parameter(t, requires_grad=True))
        idx_size = _index_itemsize(self.shard_rows, S)
        self._index_dtype = torch.int32 if idx_size == 4 else torch.int64
        index = torch.empty(T if S > 1 else 0, dtype=self._index_dtype)
        self.register_buffer("_local_row", index, persistent=False)

        # 3. one pass over global rows in blocks: build the row index and fill the shards
        self._fill(Path(init_from) if init_from is not None else None)
        self._local_row = self._local_row.to(self.compute_device)
        for s in range(S):
            if self.placements[s] == "host" and self._pin:
                self._pin_shard(s)
        self._finalizer = weakref.finalize(self, _unpin_all, self._pinned)

        # 4. hot-row caches for host shards, budget split by rows
        self.caches: dict[int, HotRowCache] = {}
        self.cache_policy, self.cache_ways = cache_policy, int(cache_ways)
        host_ids = [s for s in range(S) if self.placements[s] == "host"]
        if cache_total and host_ids:
            if device_is_host:
                log.info("hot-row cache on a CPU compute device: host and device are one memory, so it adds only bookkeeping")
            host_rows = sum(self.shard_rows[s] for s in host_ids)
            for s in host_ids:
                share = cache_total * self.shard_rows[s] // host_rows
                self.caches[s] = HotRowCache(
                    d, self.dtypes[s], self.compute_device, share, ways=cache_ways, policy=cache_policy,
                    pin_staging=self._pin,
                )  # fmt: skip
        elif cache_total:
            log.info("cache_bytes=%d ignored: no host-placed shard", cache_total)

    # -- construction helpers ------------------------------------------------------------------

    def _pin_shard(self, s: int) -> None:
        p = self.shards[s]
        if self.backend.pin_in_place(p.data):
            self._pinned[s] = p.data_ptr()

    @torch.no_grad()
    def _fill(self, init_from: Path | None) -> None:
        """Build the row index and write initial values, block by block over global rows."""
        V, O, S, d = self.num_embeddings, self.num_overflow_rows, self.num_shards, self.embedding_dim
        T = V + O
        read, file_rows = None, 0
        if init_from is not None:
            read, (file_rows, file_d) = _read_rows_source(init_from)
            if file_d != d or file_rows not in (V, T):
                raise ValueError(
                    f"{init_from}: table shape ({file_rows}, {file_d}) does not match embedding_dim={d} "
                    f"and num_embeddings={V} (or {T} with overflow rows)"
                )
        gen_rows = max(1, _INIT_BLOCK_ELEMS // d)  # rows per random block (fixed: reproducible init)
        # process k random blocks at a time: fewer, larger ops; scratch stays <= ~1/256 of the table
        k = min(8, max(1, (T * d) // (256 * gen_rows * d)))
        block = gen_rows * k
        filled = [0] * S
        gen = torch.Generator()
        for start in range(0, T, block):
            end = min(start + block, T)
            vals = torch.empty(end - start, d)  # (rows, d) float32 scratch
            if read is not None and start < file_rows:
                stop = min(end, file_rows)
                vals[: stop - start] = read(start, stop)
                if stop < end:
                    self._init_rows(gen, gen_rows, stop, end, vals[stop - start :])
            else:
                self._init_rows(gen, gen_rows, start, end, vals)
            if self.padding_idx is not None and start <= self.padding_idx < end:
                vals[self.padding_idx - start].zero_()
            if S == 1:
                self.shards[0].data[start:end].copy_(vals)
                continue
            by_dtype = {dt: vals if dt == torch.float32 else vals.to(dt) for dt in set(self.dtypes)}
            del vals
            sh = shard_of(torch.arange(start, end), S)
            for s in range(S):
                pos = sh.eq(s).nonzero().squeeze(1)  # block rows of shard s, in ascending global order
                c = pos.numel()
                if c:
                    dst = self.shards[s].data[filled[s] : filled[s] + c]
                    if dst.device == by_dtype[self.dtypes[s]].device:  # a host shard: gather in place
                        torch.index_select(by_dtype[self.dtypes[s]], 0, pos, out=dst)
                    else:  # a device shard: gather on the host, one copy over
                        dst.copy_(by_dtype[self.dtypes[s]].index_select(0, pos))
                    self._local_row[pos + start] = torch.arange(filled[s], filled[s] + c, dtype=self._index_dtype)
                    filled[s] += c
        if S > 1 and filled != self.shard_rows:
            raise AssertionError(f"row index build mismatch: filled {filled} vs counted {self.shard_rows}")

    def _init_rows(self, gen: torch.Generator, gen_rows: int, start: int, end: int, out: torch.Tensor) -> None:
        """Write the random init of global rows [start, end) into ``out`` (end-start, d) float32.

        Row g comes from random block ``g // gen_rows``, drawn from a generator seeded with
        ``seed * 1_000_003 + block`` as normal(0, init_std). The model's
        ``nn.init.trunc_normal_(std=0.02)`` keeps its default absolute bounds (-2, 2), i.e. 100 sigma:
        the same distribution as this plain normal.
        """
        if self.init_std == 0:
            out.zero_()
            return
        b0, b1 = start // gen_rows, (end - 1) // gen_rows
        for blk in range(b0, b1 + 1):
            lo, hi = blk * gen_rows, (blk + 1) * gen_rows
            gen.manual_seed((self.seed * 1_000_003 + blk) % (1 << 63))
            a, z = max(lo, start), min(hi, end)
            if a == lo and z == hi:
                torch.randn(hi - lo, self.embedding_dim, generator=gen, out=out[a - start : z - start])
            else:  # partial block: draw it whole (same numbers), keep the slice
                full = torch.randn(hi - lo, self.embedding_dim, generator=gen)
                out[a - start : z - start] = full[a - lo : z - lo]
        out.mul_(self.init_std)

    # -- lookups -------------------------------------------------------------------------------

    def _shard_rows_for(self, s: int, local: torch.Tensor) -> torch.Tensor:
        """Rows ``shards[s][local]`` as (c, d) on the compute device in the shard dtype (autograd kept)."""
        w = self.shards[s]
        if self.placements[s] == "device":
            return F.embedding(local, w, sparse=self.sparse)
        cache = self.caches.get(s)
        training = torch.is_grad_enabled() and w.requires_grad
        if cache is not None and not training:
            return cache.lookup(local, w)
        if not training and self._pin and self.backend.supports_pinned_memory():
            return _gather_staged(w, local.to(w.device), self.compute_device)
        rows = F.embedding(local.to(w.device), w, sparse=self.sparse)
        return rows.to(self.compute_device)

    def _lookup_global(self, g: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """(n,) global rows on the compute device -> (n, d) compute-dtype rows in the same order.

        ``pad``: optional (p,) positions to zero (padding ids). Each shard's rows are written straight
        into the output at their positions (one gather, one cast, one scatter per shard; no sort).
        """
        S = self.num_shards
        if S == 1:
            out = self._shard_rows_for(0, g).to(self.compute_dtype)
            return out if pad is None or pad.numel() == 0 else out.index_fill(0, pad, 0)
        n = g.numel()
        sh = shard_of(g, S)  # (n,)
        local = self._local_row[g]  # (n,) int32/int64
        out = torch.empty(n, self.embedding_dim, dtype=self.compute_dtype, device=g.device)  # (n, d)
        for s in range(S):  # S masks instead of a sort: cheaper for the few shards a table has
            pos = sh.eq(s).nonzero().squeeze(1)  # (c,) input positions served by shard s
            if pos.numel():
                rows = self._shard_rows_for(s, local.index_select(0, pos).long())  # (c, d) shard dtype
                out.index_copy_(0, pos, rows.to(self.compute_dtype))
        if pad is not None and pad.numel():
            out.index_fill_(0, pad, 0)
        return out

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


def _gather_staged(weight: torch.Tensor, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host rows ``weight[idx]`` (n, d) gathered into a pinned staging buffer, then copied to ``device``
    asynchronously (non_blocking); no autograd."""
    staging = torch.empty(idx.numel(), weight.shape[1], dtype=weight.dtype, pin_memory=True)
    torch.index_select(weight.detach(), 0, idx, out=staging)
    return staging.to(device, non_blocking=True)


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
]
