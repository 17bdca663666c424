"""Benchmark large item tables: build peak RSS, and lookup throughput device vs host vs host + cache.

    python benchmarks/embedding.py --quick                 # < 60 s: 1M-row table
    python benchmarks/embedding.py --full --json benchmarks/results/embedding_full_cpu.json
                                                           # 12M x 128 fp16 (3.07 GB), a few minutes

Build: a child process (``--child-build``) builds the table and reports its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``, the number ``/usr/bin/time -v`` prints as "Maximum resident
set size") and its RSS before the build. ``build_peak_rss_ratio`` = peak RSS / table bytes, counting
the whole process (interpreter, torch, row index); the issue's bar is <= 1.15.
``build_net_rss_ratio`` = (peak - RSS before) / table bytes.

Lookups: batches of ids drawn from a Zipf law (rank k with probability proportional to k^-s, ranks
scattered over the ids by a fixed permutation), run under ``torch.inference_mode``; rows/s = ids
looked up per second, median of --repeats timed passes, each over its own fresh batches (after a
warm-up pass over others). Three tables with the
same shape: all shards ``device``; all ``host`` (pinned in place on CUDA); ``host`` + a device-side
hot-row cache of ``--cache-fraction`` of the table bytes (LRU), whose hit rate is reported over the
timed passes (the warm-up pass fills it). On a CPU-only machine device and host are the same memory:
there the comparison shows the cost of the host path and of the cache bookkeeping, not a PCIe gain.

JSON keys: build_peak_rss_ratio, build_net_rss_ratio, lookup_rows_per_s_device, lookup_rows_per_s_host,
lookup_rows_per_s_host_cached, cache_hit_rate, plus the configuration and environment.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hstu.backend import Backend, select
from hstu.backend.memory_guard import format_bytes
from hstu.model.embedding import ShardedEmbedding, parse_dtype

log = logging.getLogger("bench.embedding")


def child_build(rows: int, dim: int, dtype: str, shards: int) -> None:
    """Run in a fresh process: build one table on the CPU, print RSS figures as JSON."""
    import psutil

    ShardedEmbedding(1000, 8, num_shards=2, dtype=dtype)  # warm up torch's allocator and kernels
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    e = ShardedEmbedding(rows, dim, num_shards=shards, dtype=dtype, device="cpu")
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    table = sum(p.numel() * p.element_size() for p in e.shards)
    print(json.dumps({"rss_before": before, "peak_rss": peak, "table_bytes": table, "build_s": seconds}))


def measure_build(rows: int, dim: int, dtype: str, shards: int, threads: int | None) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-build", str(rows), str(dim), dtype, str(shards)]
    if threads:
        cmd += ["--threads", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"build child failed ({res.returncode}): {res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["build_peak_rss_ratio"] = out["peak_rss"] / out["table_bytes"]
    out["build_net_rss_ratio"] = (out["peak_rss"] - out["rss_before"]) / out["table_bytes"]
    return out


def zipf_batches(vocab: int, batch: int, n_batches: int, s: float, seed: int) -> list[torch.Tensor]:
    """``n_batches`` int64 tensors of ``batch`` ids in [1, vocab): Zipf(s) over ranks, ranks permuted to ids."""
    ranks = np.arange(1, vocab, dtype=np.float64)
    cdf = np.cumsum(ranks**-s)
    cdf /= cdf[-1]
    perm = np.random.default_rng(12345).permutation(vocab - 1) + 1  # rank k -> id perm[k], the same for every seed
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        k = np.minimum(np.searchsorted(cdf, rng.random(batch)), vocab - 2)
        out.append(torch.from_numpy(perm[k].astype(np.int64)))
    return out


def time_lookups(emb: ShardedEmbedding, passes: list[list[torch.Tensor]]) -> float:
    """Median rows/s over ``passes[1:]``; ``passes[0]`` warms up (pages, allocator, cache).

    Every pass has its own batches (fresh Zipf draws), so the cache hit rate is measured on ids
    it has not been shown before, not on a replay.
    """
    backend = emb.backend
    rates = []
    with torch.inference_mode():
        for i, batches in enumerate(passes):
            dev = [b.to(emb.compute_device) for b in batches]
            if i == 1:
                emb.reset_cache_metrics()
            backend.synchronize()
            t0 = time.perf_counter()
            for b in dev:
                emb(b)
            backend.synchronize()
            if i:
                rates.append(sum(b.numel() for b in dev) / (time.perf_counter() - t0))
    return statistics.median(rates)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="1M x 128 fp16 table (default)")
    size.add_argument("--full", action="store_true", help="12M x 128 fp16 table (3.07 GB), a few minutes")
    ap.add_argument("--rows", type=int, default=None, help="override the table rows")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--device", default="auto", help="compute device for lookups: auto, cpu, cuda, npu")
    ap.add_argument("--batch", type=int, default=16384, help="ids per lookup batch")
    ap.add_argument("--batches", type=int, default=None, help="batches per timed pass (default 10 quick / 40 full)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent s of id popularity")
    ap.add_argument("--cache-fraction", type=float, default=0.05, help="cache bytes as a fraction of the table")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for lookups (default: torch's)")
    ap.add_argument("--skip-build", action="store_true", help="skip the peak-RSS build measurement")
    ap.add_argument("--json", type=Path, default=None, help="write results to this JSON file")
    ap.add_argument("--child-build", nargs=4, metavar=("ROWS", "DIM", "DTYPE", "SHARDS"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def time_placements(args: argparse.Namespace, rows: int, n_batches: int, backend: Backend, results: dict) -> None:
    """Lookup rows/s per placement (device, host, host + hot-row cache) into ``results``, with the cache's hit rate."""
    passes = [zipf_batches(rows, args.batch, n_batches, args.zipf, seed=i) for i in range(args.repeats + 1)]
    table_bytes = rows * args.dim * torch.tensor([], dtype=parse_dtype(args.dtype)).element_size()
    cache_bytes = int(table_bytes * args.cache_fraction)
    configs = [
        ("device", dict(placement="device")),
        ("host", dict(placement="host")),
        ("host_cached", dict(placement="host", cache_bytes=cache_bytes)),
    ]
    for name, kw in configs:
        t0 = time.perf_counter()
        emb = ShardedEmbedding(rows, args.dim, num_shards=args.shards, dtype=args.dtype, device=backend, **kw)
        build_s = time.perf_counter() - t0
        emb.requires_grad_(False)
        rate = time_lookups(emb, passes)
        results[f"lookup_rows_per_s_{name}"] = rate
        results[f"table_build_s_{name}"] = build_s
        if emb.caches:
            m = emb.cache_metrics()
            results["cache_hit_rate"] = m["hit_rate"]
            results["cache_bytes"] = int(m["bytes"])
            results["cache_rows"] = int(m["capacity_rows"])
        del emb
        gc.collect()
        backend.empty_cache()


def report(args: argparse.Namespace, rows: int, n_batches: int, backend: Backend, results: dict) -> None:
    """Print the build and lookup figures; write ``results`` to --json."""
    print(f"embedding benchmark: {rows:,} x {args.dim} {args.dtype}, {args.shards} shards, lookups on {backend.device}")
    if "build_peak_rss_ratio" in results:
        print(
            f"  build: peak RSS {format_bytes(results['peak_rss'])} for a {format_bytes(results['table_bytes'])} table "
            f"-> ratio {results['build_peak_rss_ratio']:.3f} (net of interpreter {results['build_net_rss_ratio']:.3f}), "
            f"{results['build_s']:.1f} s"
        )
    print(f"  lookups: batches of {args.batch} ids, Zipf s={args.zipf}, median of {args.repeats} passes x {n_batches} fresh batches")
    print(f"  {'placement':<22}{'rows/s':>14}{'vs device':>11}")
    dev_rate = results["lookup_rows_per_s_device"]
    for name, label in (("device", "device"), ("host", "host"), ("host_cached", "host + cache")):
        r = results[f"lookup_rows_per_s_{name}"]
        print(f"  {label:<22}{r:>14,.0f}{r / dev_rate:>10.2f}x")
    print(
        f"  cache: {results['cache_rows']:,} rows ({format_bytes(results['cache_bytes'])}, "
        f"{args.cache_fraction:.0%} of table), hit rate {results['cache_hit_rate']:.3f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"  wrote {args.json}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_build:
        if args.threads:
            torch.set_num_threads(args.threads)
        r, d, dt, s = args.child_build
        child_build(int(r), int(d), dt, int(s))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = args.rows or (12_000_000 if args.full else 1_000_000)
    n_batches = args.batches or (40 if args.full else 10)
    backend = select(args.device)
    results: dict[str, object] = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "rows": rows,
        "dim": args.dim,
        "dtype": args.dtype,
        "shards": args.shards,
        "device": str(backend.device),
        "batch": args.batch,
        "batches": n_batches,
        "zipf_s": args.zipf,
        "cache_fraction": args.cache_fraction,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_avg_1m_at_start": os.getloadavg()[0],  # shared CI/dev cores: context for the timings
    }
    if not args.skip_build:
        b = measure_build(rows, args.dim, args.dtype, args.shards, args.threads)
        keys = ("build_peak_rss_ratio", "build_net_rss_ratio", "peak_rss", "rss_before", "table_bytes", "build_s")
        results.update({k: b[k] for k in keys})
    time_placements(args, rows, n_batches, backend, results)
    report(args, rows, n_batches, backend, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
