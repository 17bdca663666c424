"""Memory planning for the sharded item table: per-shard bytes and placement, checked before allocation.

Symbols as in :mod:`hstu.model.embedding`. :func:`plan_memory` is also the ``hstu plan-memory`` command's
core (:mod:`hstu.model.embedding_cli`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hstu.backend.memory_guard import format_bytes, parse_bytes
from hstu.config import LOCAL_TABLE_OPTIMIZERS
from hstu.model.embedding_rows import PLACEMENTS, _per_shard, dtype_name, parse_dtype, shard_row_counts

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
    optimizer: str | None = None  # training table optimizer planned for (None: the table alone)
    # its state + the table's gradient + the step's temporaries (:func:`state_bytes`, :func:`grad_bytes`, :func:`step_bytes`), in the totals
    optimizer_bytes: int = 0
    # the similarity index evaluation, generation and serving build over the table (:func:`scoring_bytes`), on the
    # device, beside the totals (the table's fit and placement are the table's; the index exists while scoring)
    scoring_bytes: int = 0

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
        shown = self.shards if len(self.shards) <= FORMAT_MAX_SHARDS else self.shards[: FORMAT_MAX_SHARDS - 4] + self.shards[-4:]
        for j, s in enumerate(shown):
            if j == FORMAT_MAX_SHARDS - 4 and len(shown) < len(self.shards):
                lines.append(f"{'...':>5}  ({len(self.shards) - len(shown):,} more shards; --json lists them all)")
            lines.append(f"{s.index:>5}  {s.rows:>13,}  {s.dtype:>5}  {s.bytes:>15,}  {format_bytes(s.bytes):>10}  {s.placement}")
        lines.append(f"row index ({T:,} rows) on device: {format_bytes(self.index_bytes)}")
        if self.cache_bytes:
            lines.append(f"hot-row cache on device: {format_bytes(self.cache_bytes)}")
        lines.append(f"exact scoring index (eval / generate / serve; not counted below): {format_bytes(self.scoring_bytes)}")
        if self.optimizer is not None:
            opt = format_bytes(self.optimizer_bytes)
            lines.append(f"training with {self.optimizer}: state + table gradient + step temporaries {opt} (with each shard)")

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


MAX_SHARDS = 65_536  # the most shards a plan (and a hashed table) may have
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


def cache_bytes_of_shard(cache_bytes: int, rows: int, host_rows: int, shard_bytes: int) -> int:
    """A host shard's part of the hot-row cache: ``cache_bytes`` split by rows over the host shards (``host_rows``),
    at most the shard itself (a 1 GB cache over a 300 KiB shard allocated the whole GB)."""
    return min(cache_bytes * rows // max(1, host_rows), shard_bytes)


def _shard_count(num_shards: int | None, dtype: Any, values: int, max_shard: int) -> int:
    """S: ``num_shards``, or (None) ceil(table bytes at the widest dtype / ``max_shard``), at least 1.

    Raises:
        ValueError: S < 1.
    """
    if num_shards is None:
        given = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype]
        widest = max(torch.tensor([], dtype=parse_dtype(x)).element_size() for x in given)
        num_shards = max(1, math.ceil(values * widest / max(1, max_shard)))
    if int(num_shards) < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards!r}")
    if int(num_shards) > MAX_SHARDS:  # a plan lists every shard: 1e12 x 65,536 fp32 in 1 GiB shards ran for minutes, growing
        raise ValueError(
            f"num_shards {int(num_shards):,} is more than {MAX_SHARDS:,} shards (the table is {format_bytes(values * 4)} at fp32): "
            "give fewer shards or a larger max_shard_bytes (--max-shard-bytes)"
        )
    return int(num_shards)


def _plan_rows(
    T: int,
    S: int,
    d: int,
    itemsize: int,
    shard_rows: Sequence[int] | None,
    device_mem: int | str | None,
    host_mem: int | str | None,
    device_is_host: bool,
) -> tuple[list[int], bool]:
    """[R_s] and whether they are exact: given, counted by hashing, or (when even the whole table at
    ``itemsize`` bytes per value fits no budget given) an even-split estimate, without hashing T rows."""
    if shard_rows is not None:
        return list(shard_rows), True
    if S == 1:
        return [T], True
    total_budget = None
    if device_is_host and host_mem is not None:
        total_budget = parse_bytes(host_mem, field="host_mem")
    elif not device_is_host and device_mem is not None and host_mem is not None:
        total_budget = parse_bytes(device_mem, field="device_mem") + parse_bytes(host_mem, field="host_mem")
    if total_budget is not None and T * d * itemsize > total_budget:
        return [T // S + (1 if i < T % S else 0) for i in range(S)], False  # even split: an estimate
    return shard_row_counts(T, S), True


def _auto_placement(sizes: Sequence[int], index_bytes: int, cache: int, room: int | None) -> list[str]:
    """ "device" for shards in order while they fit ``room`` bytes (with the index, and the cache once a
    shard goes to host), "host" for the rest; ``room`` None = unknown (all on the device)."""
    places: list[str] = []
    used = index_bytes
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
    return places


def _given_placement(placement: str | Sequence[str], S: int) -> list[str]:
    """One placement per shard from one name or a list. ValueError names an unknown one."""
    places = _per_shard(placement, S, "placement")
    for i, p in enumerate(places):
        if p not in PLACEMENTS:
            raise ValueError(f"placement[{i}]: unknown placement {p!r}; valid: device, host (or auto for all)")
    return places


def _budget_problems(
    shards: Sequence[ShardPlan],
    index_bytes: int,
    cache_used: int,
    device_bytes: int,
    host_bytes: int,
    dev_budget: int | None,
    host_budget: int | None,
) -> list[str]:
    """Why a table on a separate device does not fit: one line per exceeded budget (none: it fits)."""
    problems: list[str] = []
    if dev_budget is not None and device_bytes > dev_budget:
        on_dev = index_ranges([s.index for s in shards if s.placement == "device"])
        problems.append(
            f"device needs {format_bytes(device_bytes)} (shards {on_dev}, index {format_bytes(index_bytes)}, "
            f"cache {format_bytes(cache_used)}), budget is {format_bytes(dev_budget)}"
        )
    if host_budget is not None and host_bytes > host_budget:
        on_host = index_ranges([s.index for s in shards if s.placement == "host"])
        problems.append(f"host needs {format_bytes(host_bytes)} (shards {on_host}), budget is {format_bytes(host_budget)}")
    return problems


def _shared_memory_problems(need: int, host_budget: int | None, host_mem: int | str | None, reserve_ratio: float) -> list[str]:
    """Why a table on a CPU compute device (device and host shards in one memory) does not fit: [] or one line."""
    if host_budget is None or need <= host_budget:
        return []
    mem = format_bytes(parse_bytes(host_mem or 0))
    return [
        f"needs {format_bytes(need)} of host memory (compute device is the CPU), budget is "
        f"{format_bytes(host_budget)} ({mem} less {reserve_ratio:.0%} reserve)"
    ]


def state_bytes(table_optimizer: str, rows: int, dim: int, itemsize: int = 4) -> int:
    """Bytes of the optimizer state of an R x d table with rows of ``itemsize`` bytes: AdamW two
    moments in the rows' dtype (``torch.optim.AdamW`` allocates them like the parameter: R * d * 2 *
    itemsize), row-wise AdaGrad one float32 per row (R * 4). ValueError for an unknown optimizer."""
    if table_optimizer == "adamw":
        return int(rows) * int(dim) * 2 * int(itemsize)
    if table_optimizer == "rowwise_adagrad":
        return int(rows) * 4
    raise ValueError(f"[train] table_optimizer: unknown {table_optimizer!r}; valid: {', '.join(LOCAL_TABLE_OPTIMIZERS)}")


def grad_bytes(table_optimizer: str, rows: int, dim: int, itemsize: int) -> int:
    """Bytes of the table's gradient during a step: dense under AdamW (R * d * itemsize, the row
    dtype), sparse (only the looked-up rows: bounded by the batch, counted 0 here) under row-wise AdaGrad."""
    return int(rows) * int(dim) * int(itemsize) if table_optimizer == "adamw" else 0


def step_bytes(table_optimizer: str, rows: int, dim: int, itemsize: int) -> int:
    """Bytes of the table-sized temporaries alive during one optimizer step, besides state and gradient.
    AdamW (``torch.optim.AdamW``, foreach on CPU and CUDA: ``torch.optim.adam._multi_tensor_adam``,
    torch 2.13): ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``, one R x d tensor in the
    moments' (the rows') dtype, alive until the ``_foreach_addcdiv_`` into the parameters; every other
    op is in place (``_foreach_lerp_`` of exp_avg, ``_foreach_mul_`` / ``_foreach_addcmul_`` of
    exp_avg_sq, the decoupled weight decay's ``_foreach_mul_``; ``_foreach_mul(grads, 1 - beta2)`` only
    when beta2 is a tensor, never here): R * d * itemsize. Row-wise AdaGrad's temporaries are the
    batch's rows only (counted 0)."""
    return int(rows) * int(dim) * int(itemsize) if table_optimizer == "adamw" else 0


def _check_sizes(num_embeddings, embedding_dim, num_overflow_rows, reserve_ratio) -> tuple[int, int, int]:
    """(V, d, O) as ints; ValueError naming a field below 1 or a reserve_ratio outside [0, 1)."""
    V, d, O = int(num_embeddings), int(embedding_dim), int(num_overflow_rows)
    for name, value, ok in (
        ("num_embeddings", num_embeddings, V >= 1),
        ("embedding_dim", embedding_dim, d >= 1),
        ("num_overflow_rows", num_overflow_rows, O >= 1),
    ):
        if not ok:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    if not 0.0 <= reserve_ratio < 1.0:
        raise ValueError(f"reserve_ratio must be in [0, 1), got {reserve_ratio!r}")
    return V, d, O


def scoring_bytes(num_embeddings: int, shard_rows: Sequence[int], dim: int) -> int:
    """Bytes of the similarity index :func:`hstu.model.item_index.build_item_index` builds over a hashed
    table for evaluation and generation: a float32 (V, d) copy (``FloatIndex``) up to
    ``ROWS_INDEX_BYTES``, above it ``ShardIndex``: per stored row a float32 inverse norm and an int32
    (int64 from 2**31 rows) item id, plus one float32 block buffer of ``block`` x d per shard."""
    from hstu.model.item_index import ROWS_INDEX_BYTES

    if num_embeddings * dim * 4 <= ROWS_INDEX_BYTES:
        return num_embeddings * dim * 4
    T = sum(shard_rows)
    return T * (4 + (4 if T < 2**31 else 8)) + len(shard_rows) * min(8192, max(shard_rows)) * dim * 4


def training_bytes(optimizer: str | None, rows: int, dim: int, itemsize: int) -> int:
    """Bytes a shard of ``rows`` x ``dim`` needs beyond its rows while ``optimizer`` trains it:
    :func:`state_bytes` + :func:`grad_bytes` + :func:`step_bytes`; 0 for None (serving)."""
    if optimizer is None:
        return 0
    return sum(f(optimizer, rows, dim, itemsize) for f in (state_bytes, grad_bytes, step_bytes))


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
    optimizer: str | None = None,
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
        optimizer: None (serving: the table alone) or the training table optimizer
            (``[train] table_optimizer``: "adamw" or "rowwise_adagrad"): its state, the table's gradient and
            the step's table-sized temporaries, :func:`state_bytes` + :func:`grad_bytes` + :func:`step_bytes`
            per shard, are added to the shard's memory.
    Returns:
        :class:`MemoryPlan`; check ``.fits`` or call ``.require()``.
    Raises:
        ValueError: a field out of range (the message names it).
    """
    V, d, O = _check_sizes(num_embeddings, embedding_dim, num_overflow_rows, reserve_ratio)
    T = V + O
    cache = parse_bytes(cache_bytes, field="cache_bytes")
    S = _shard_count(num_shards, dtype, T * d, parse_bytes(max_shard_bytes, field="max_shard_bytes"))
    dtypes = [parse_dtype(x, field=f"dtype[{i}]") for i, x in enumerate(_per_shard(dtype, S, "dtype"))]
    itemsizes = [torch.tensor([], dtype=dt).element_size() for dt in dtypes]
    rows, rows_exact = _plan_rows(T, S, d, min(itemsizes), shard_rows, device_mem, host_mem, device_is_host)
    if len(rows) != S or sum(rows) != T:
        raise ValueError(f"shard_rows must be {S} counts summing to {T}, got {len(rows)} summing to {sum(rows)}")
    sizes = [r * d * it for r, it in zip(rows, itemsizes)]
    index_bytes = T * _index_itemsize(rows, S)
    dev_budget = None if device_mem is None else int(parse_bytes(device_mem, field="device_mem") * (1 - reserve_ratio))
    host_budget = None if host_mem is None else int(parse_bytes(host_mem, field="host_mem") * (1 - reserve_ratio))

    if isinstance(placement, str) and placement == "auto":
        places = ["device"] * S if device_is_host else _auto_placement(sizes, index_bytes, cache, dev_budget)
    else:
        places = _given_placement(placement, S)

    host_rows = sum(r for r, pl in zip(rows, places) if pl == "host")
    cache_used = sum(cache_bytes_of_shard(cache, rows[i], host_rows, sizes[i]) for i in range(S) if places[i] == "host")
    shards = [ShardPlan(i, rows[i], dtype_name(dtypes[i]), sizes[i], places[i]) for i in range(S)]
    opt = [training_bytes(optimizer, r, d, it) for r, it in zip(rows, itemsizes)]
    scoring = scoring_bytes(V, rows, d)
    device_bytes = index_bytes + cache_used + sum(s.bytes + o for s, o in zip(shards, opt) if s.placement == "device")
    host_bytes = sum(s.bytes + o for s, o in zip(shards, opt) if s.placement == "host")
    if device_is_host:
        problems = _shared_memory_problems(device_bytes + host_bytes, host_budget, host_mem, reserve_ratio)
    else:
        problems = _budget_problems(shards, index_bytes, cache_used, device_bytes, host_bytes, dev_budget, host_budget)
    return MemoryPlan(
        num_embeddings=V, num_overflow_rows=O, embedding_dim=d, shards=shards, index_bytes=index_bytes, cache_bytes=cache_used,
        device_bytes=device_bytes, host_bytes=host_bytes, device_budget=dev_budget, host_budget=host_budget,
        device_is_host=device_is_host, reserve_ratio=reserve_ratio, problems=problems, rows_exact=rows_exact,
        optimizer=optimizer, optimizer_bytes=sum(opt), scoring_bytes=scoring,
    )  # fmt: skip
