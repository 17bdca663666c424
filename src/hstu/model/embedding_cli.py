"""``hstu plan-memory``: print a per-shard plan for an item table and refuse one that does not fit.

Example::

    hstu plan-memory --items 120000000 --dim 128 --dtype fp16 --device-mem 32GiB

Nothing is allocated: the plan hashes row ids in small chunks to count rows per shard
(:func:`hstu.model.embedding.plan_memory`). Exit codes: 0 fits, 3 does not fit (the reasons go to
stderr), 2 bad arguments (as for argparse's own usage errors).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from hstu.backend.memory_guard import format_bytes, parse_bytes
from hstu.model.embedding import PLACEMENTS, plan_memory

log = logging.getLogger(__name__)

MAX_ITEMS = 10**12  # rows the plan hashes in chunks (a trillion: minutes; more would not finish)
MAX_DIM = 65_536
MIN_SHARD_BYTES = 2**20  # 1 MiB: smaller shards only multiply the shard count


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan-memory`` to an argparse subparsers object (``handler(args) -> int`` as ``func``)."""
    p = subparsers.add_parser(
        "plan-memory",
        help="plan per-shard bytes and placement of an item embedding table; refuse if it does not fit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--items", type=int, required=True, help="number of item ids; the table has items + 1 rows (row 0 = padding)")
    p.add_argument("--dim", type=int, required=True, help="embedding width d")
    p.add_argument("--dtype", default="fp32", help="storage dtype: fp32, fp16 or bf16 (default fp32)")
    p.add_argument("--shards", type=int, default=None, help="number of shards (default: table bytes / --max-shard-bytes)")
    p.add_argument(
        "--max-shard-bytes", type=_size, default=parse_bytes("1GiB"), help="largest shard when --shards is not given (default 1GiB)"
    )
    p.add_argument(
        "--overflow-rows", type=int, default=1, help="hashed rows for out-of-vocabulary ids (default 1, as a run's table is built)"
    )
    p.add_argument(
        "--placement",
        default="auto",
        help="auto (device first, rest on host), device, host, or a comma list with one per shard",
    )
    p.add_argument(
        "--device-mem",
        type=_size,
        default=None,
        help="accelerator memory, e.g. 32GiB (default: free memory of --device, if it is an accelerator)",
    )
    p.add_argument("--device", default="auto", help="backend to query when --device-mem is absent: auto, cpu, cuda, npu")
    p.add_argument("--host-mem", type=_size, default=None, help="host memory (default: available memory of this machine)")
    p.add_argument("--cache-bytes", type=_size, default=0, help="device-side hot-row cache for host shards (default 0)")
    p.add_argument(
        "--reserve", type=float, default=0.05, help="fraction of each memory kept free (default 0.05, as a run's table is checked)"
    )
    p.add_argument(
        "--optimizer",
        choices=["adamw", "rowwise_adagrad"],
        default=None,
        help="plan for training with this table optimizer ([train] table_optimizer): adds its state, gradient and step temporaries",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=plan_memory_command)


def plan_memory_command(args: argparse.Namespace) -> int:
    """Handler of ``hstu plan-memory``; returns 0 (fits), 3 (refused) or 2 (bad arguments)."""
    from hstu.backend import BackendUnavailableError, select
    from hstu.backend.cpu import host_memory_info

    if not (1 <= args.items <= MAX_ITEMS and 1 <= args.dim <= MAX_DIM):
        print(
            f"hstu plan-memory: error: --items must be in 1..{MAX_ITEMS:,} and --dim in 1..{MAX_DIM:,} (got {args.items}, {args.dim})",
            file=sys.stderr,
        )
        return 2
    if args.max_shard_bytes < MIN_SHARD_BYTES:
        print(
            f"hstu plan-memory: error: --max-shard-bytes must be >= {format_bytes(MIN_SHARD_BYTES)}, got {args.max_shard_bytes}",
            file=sys.stderr,
        )
        return 2
    if args.optimizer == "adamw" and "fp16" in args.dtype.replace(" ", "").split(","):  # as hstu train refuses it
        print(
            "hstu plan-memory: error: --dtype fp16 under --optimizer adamw cannot be trained (AdamW's second moment underflows "
            "in fp16); plan fp32 / bf16 rows, or fp16 rows with --optimizer rowwise_adagrad",
            file=sys.stderr,
        )
        return 2
    device_mem, device_is_host = args.device_mem, False
    if device_mem is None:
        try:
            backend = select(args.device)
        except (ValueError, BackendUnavailableError) as exc:
            print(f"hstu plan-memory: error: {exc}", file=sys.stderr)
            return 2
        if backend.is_host:
            device_is_host = True
        else:
            device_mem = backend.memory_info().free_bytes
    host_mem = args.host_mem if args.host_mem is not None else host_memory_info().free_bytes
    placement = args.placement
    if "," in placement:
        placement = [x.strip() for x in placement.split(",")]
    elif placement not in ("auto", *PLACEMENTS):
        print(f"hstu plan-memory: error: --placement {placement!r} unknown; use auto, device, host or a comma list", file=sys.stderr)
        return 2
    try:
        plan = plan_memory(
            args.items + 1,
            args.dim,
            dtype=args.dtype,
            num_shards=args.shards,
            num_overflow_rows=args.overflow_rows,
            placement=placement,
            device_mem=device_mem,
            host_mem=host_mem,
            device_is_host=device_is_host,
            reserve_ratio=args.reserve,
            cache_bytes=args.cache_bytes,
            max_shard_bytes=args.max_shard_bytes,
            optimizer=args.optimizer,
        )
    except ValueError as exc:
        print(f"hstu plan-memory: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.format())
    if not plan.fits:
        print(
            "hstu plan-memory: refused: "
            + "; ".join(plan.problems)
            + f". Try {'--dtype fp16/bf16, ' if args.dtype == 'fp32' else ''}more --host-mem, --placement host for some shards, "
            "or more devices "
            f"(table is {format_bytes(plan.table_bytes)}).",
            file=sys.stderr,
        )
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hstu.model.embedding_cli plan-memory ...`` until the lead's ``hstu`` CLI wires it in."""
    parser = argparse.ArgumentParser(prog="hstu")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
