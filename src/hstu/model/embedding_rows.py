"""Rows of the sharded item table: stable hashing of ids to shards and overflow rows, dtypes, placements.

Symbols as in :mod:`hstu.model.embedding` (V vocabulary rows, O overflow rows, T = V + O, S shards).
:func:`splitmix64` is the 64-bit finaliser of SplitMix64 (Steele, Lea & Flood, "Fast Splittable
Pseudorandom Number Generators", OOPSLA 2014; constants as in Vigna's reference ``splitmix64.c``),
in torch int64 ops that wrap modulo 2**64; Python's ``hash()`` is salted per process and never used.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hstu.config import TABLE_PLACEMENTS

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
PLACEMENTS = TABLE_PLACEMENTS  # "device" | "host" (defined once, in hstu.config)


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


def read_rows_source(path: Path) -> tuple[Callable[[int, int], torch.Tensor], tuple[int, int]]:
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


# ---------------------------------------------------------------------------------------------
# Initial values
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def fill_shards(emb, init_from: Path | None) -> None:
    """Build ``emb``'s row index (``_local_row``) and write the initial values of its shards
    (``emb``: a :class:`hstu.model.embedding.ShardedEmbedding` just allocated), block by block over
    global rows: copied from ``init_from`` or drawn by :func:`init_rows` (embedding module docstring)."""
    V, O, S, d = emb.num_embeddings, emb.num_overflow_rows, emb.num_shards, emb.embedding_dim
    T = V + O
    read, file_rows = None, 0
    if init_from is not None:
        read, (file_rows, file_d) = read_rows_source(init_from)
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
                init_rows(emb, gen, gen_rows, stop, end, vals[stop - start :])
        else:
            init_rows(emb, gen, gen_rows, start, end, vals)
        if emb.padding_idx is not None and start <= emb.padding_idx < end:
            vals[emb.padding_idx - start].zero_()
        if S == 1:
            emb.shards[0].data[start:end].copy_(vals)
            continue
        by_dtype = {dt: vals if dt == torch.float32 else vals.to(dt) for dt in set(emb.dtypes)}
        del vals
        sh = shard_of(torch.arange(start, end), S)
        for s in range(S):
            pos = sh.eq(s).nonzero().squeeze(1)  # block rows of shard s, in ascending global order
            c = pos.numel()
            if c:
                dst = emb.shards[s].data[filled[s] : filled[s] + c]
                if dst.device == by_dtype[emb.dtypes[s]].device:  # a host shard: gather in place
                    torch.index_select(by_dtype[emb.dtypes[s]], 0, pos, out=dst)
                else:  # a device shard: gather on the host, one copy over
                    dst.copy_(by_dtype[emb.dtypes[s]].index_select(0, pos))
                emb._local_row[pos + start] = torch.arange(filled[s], filled[s] + c, dtype=emb._index_dtype)
                filled[s] += c
    if S > 1 and filled != emb.shard_rows:
        raise AssertionError(f"row index build mismatch: filled {filled} vs counted {emb.shard_rows}")


def init_rows(emb, gen: torch.Generator, gen_rows: int, start: int, end: int, out: torch.Tensor) -> None:
    """Write ``emb``'s random init of global rows [start, end) into ``out`` (end-start, d) float32.

    Row g comes from random block ``g // gen_rows``, drawn from a generator seeded with
    ``seed * 1_000_003 + block`` as normal(0, init_std). The model's
    ``nn.init.trunc_normal_(std=0.02)`` keeps its default absolute bounds (-2, 2), i.e. 100 sigma:
    the same distribution as this plain normal.
    """
    if emb.init_std == 0:
        out.zero_()
        return
    b0, b1 = start // gen_rows, (end - 1) // gen_rows
    for blk in range(b0, b1 + 1):
        lo, hi = blk * gen_rows, (blk + 1) * gen_rows
        gen.manual_seed((emb.seed * 1_000_003 + blk) % (1 << 63))
        a, z = max(lo, start), min(hi, end)
        if a == lo and z == hi:
            torch.randn(hi - lo, emb.embedding_dim, generator=gen, out=out[a - start : z - start])
        else:  # partial block: draw it whole (same numbers), keep the slice
            full = torch.randn(hi - lo, emb.embedding_dim, generator=gen)
            out[a - start : z - start] = full[a - lo : z - lo]
    out.mul_(emb.init_std)


class SparseRows(torch.autograd.Function):
    """rows = w[local].to(out_dtype): (c,) int64 local rows of a shard w (R_s, d) -> (c, d) ``out_dtype``;
    backward: dL/dw as an uncoalesced (R_s, d) float32 sparse COO tensor (duplicates summed later by
    ``coalesce``). ``F.embedding(sparse=True)`` would give a gradient in w's dtype: for fp16 rows that
    rounds each lookup's gradient to fp16 and, when a step looks the table up more than once, the
    engine's sum of the sparse gradients has no Half kernel on the CPU (PyTorch 2.13: "cadd_sparse" not
    implemented for 'Half'). With ``w.grad_dtype`` float32 (set by :meth:`hstu.model.embedding.ShardedEmbedding._gather`)
    the gradient is widened once, summed and kept in float32; the row-wise optimizer
    (:mod:`hstu.train.sparse_optim`) rounds the updated rows once to w's dtype."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(local)
        ctx.table_shape = w.shape
        return w.index_select(0, local).to(out_dtype)  # (c, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (local,) = ctx.saved_tensors
        g = torch.sparse_coo_tensor(local.unsqueeze(0), grad.to(torch.float32), ctx.table_shape, is_coalesced=False, check_invariants=False)
        return None, g, None
