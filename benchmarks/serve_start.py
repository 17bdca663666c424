"""Start-to-ready time of ``hstu serve``: eager and compiled graphs, with the run's graph cache and without one.

    python benchmarks/serve_start.py --run RUN_DIR [--rounds 3] [--buckets 20] [--max-batch 2] [--json PATH]

What it does:

1. Copies the run twice into a temporary directory (without any ``graphs/`` of its own): one copy
   gets a graph cache built by ``hstu export --run COPY --graphs`` for the same buckets, max batch
   and device as the server (its wall time and bytes are reported), the other stays without one.
2. ``--rounds`` rounds; each round starts the server once per setting, in an order rotated every
   round (so that a slow minute of a shared machine does not land on one setting): ``eager`` and
   ``compiled`` (``hstu serve --graphs``), each on the copy with the cache and on a fresh copy
   without one (made anew every round: a compiled start may leave files behind). The time is from
   just before the server process is spawned to the first 200 of ``/readyz``, which answers 200 once
   the model process has loaded the run and warmed every bucket
   (:func:`hstu.bench.load.start_server`: it polls every 0.2 s, the resolution of these figures);
   then the server is stopped (SIGTERM, drained) and its exit code kept. Each start gets an empty
   TORCHINDUCTOR_CACHE_DIR of its own: Inductor's own on-disk cache (FX graphs, kernels) would
   otherwise make every compiled start after the first one warm (``--shared-inductor-cache`` keeps
   the user's cache, shared by all starts, to measure that case). A cached start that rewrote the
   cache's manifest (it found an entry stale: the sources the graphs trace were edited after the
   export) is flagged ``cache_rebuilt``, and ``code_as_exported`` says whether those sources
   still hash as at the export: a round with either false is not a cached start.
3. Reports per setting the median and every round, and the ratios of the medians: a compiled start
   without the cache against one with it, and a compiled start with the cache against an eager one.
   The load average before and after is recorded: on a shared machine the absolute seconds move
   with the other jobs, the ratios of interleaved starts less.

Only ``--graphs compiled`` reads the cache (an eager server never compiles), so the two eager
settings should agree: their ratio is the noise floor of the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hstu.backend.graph_cache import code_sha256
from hstu.bench import load

SETTINGS = (("eager", False), ("eager", True), ("compiled", False), ("compiled", True))


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("graphs"))
    return dst


def _build_cache(args, run: Path) -> dict:
    """``hstu export --run RUN --graphs`` for the server's settings: seconds, graphs, bytes."""
    cmd = [sys.executable, "-m", "hstu.cli", "export", "--run", str(run), "--graphs", "--max-batch", str(args.max_batch)]
    cmd += ["--buckets", args.buckets] if args.buckets else []
    cmd += ["--device", args.device] + (["--precision", args.precision] if args.precision else [])
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    secs = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"serve_start: `{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    files = sorted((run / "graphs").glob("*.pt2"))
    return {"command": " ".join(cmd[1:]), "seconds": round(secs, 2), "graphs": len(files), "bytes": sum(f.stat().st_size for f in files)}


def time_start(args, run: Path, graphs: str, inductor_dir: Path | None) -> dict:
    """Seconds from spawning ``hstu serve --graphs GRAPHS`` on ``run`` to its first 200 on /readyz;
    ``inductor_dir``: the server's TORCHINDUCTOR_CACHE_DIR (None: the user's, shared by every start)."""
    opts = argparse.Namespace(**{**vars(args), "run": str(run), "server_args": ["--graphs", graphs, "--device", args.device]})
    if inductor_dir is not None:  # start_server's child inherits this process's environment
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    t0 = time.perf_counter()
    try:
        proc, url, _ = load.start_server(opts)
    except load.ServerStartError as exc:
        sys.exit(f"serve_start: --graphs {graphs} on {run}: {exc}")
    secs = time.perf_counter() - t0
    try:
        ready = httpx.get(url + "/readyz", timeout=10).json()
    finally:
        code = load.stop_server(proc)
    return {"seconds": round(secs, 3), "generation": ready.get("generation"), "exit_code": code}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory written by `hstu train` (copied, never changed)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the four settings (default 3)")
    p.add_argument("--buckets", default="20", help="server buckets (default 20: each compiled bucket costs minutes)")
    p.add_argument("--max-batch", type=int, default=2, help="the server's --max-batch (its ladder: 1, 2, 4, ... graphs per bucket)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the model process (default 1)")
    p.add_argument("--model-workers", type=int, default=1, help="model processes (0: the model in the HTTP process)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="server and cache precision (default the run's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--ready-timeout-s", type=float, default=900.0, help="longest wait for /readyz per start")
    p.add_argument(
        "--shared-inductor-cache",
        action="store_true",
        help="let every start share Inductor's own on-disk cache (default: a fresh TORCHINDUCTOR_CACHE_DIR per start, a cold start)",
    )
    p.add_argument("--note", default="", help="free text stored in the result (e.g. what else ran on the machine)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--verbose", action="store_true", help="show the servers' logs")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if not (Path(args.run) / "config.json").exists():
        p.error(f"--run {args.run}: no config.json (not a run directory written by `hstu train`)")
    # the fields hstu.bench.load.start_server reads
    args.url, args.max_wait_ms, args.server_cpus, args.client_cpus_rest = None, 5.0, None, False
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out: dict = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "load_avg_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "note": args.note,
        "inductor_cache": "shared by every start" if args.shared_inductor_cache else "fresh per start",
    }
    import torch

    out["torch"] = torch.__version__
    with tempfile.TemporaryDirectory(prefix="serve_start_") as tmp:
        tmp = Path(tmp)
        cached = _copy_run(Path(args.run), tmp / "cached")
        out["cache"] = {**_build_cache(args, cached), "code_sha256": code_sha256()}
        c = out["cache"]
        print(f"graph cache: {c['graphs']} graphs, {c['bytes'] / 1e6:.1f} MB in {c['seconds']:.0f} s", flush=True)
        rounds: dict[str, list[dict]] = {f"{g}_{'cache' if c else 'no_cache'}": [] for g, c in SETTINGS}
        for r in range(args.rounds):
            order = SETTINGS[r % len(SETTINGS) :] + SETTINGS[: r % len(SETTINGS)]
            for graphs, with_cache in order:
                run = cached if with_cache else _copy_run(Path(args.run), tmp / f"bare_{r}_{graphs}")
                fresh = None if args.shared_inductor_cache else tmp / f"inductor_{r}_{graphs}_{with_cache}"
                manifest = (cached / "graphs" / "manifest.json").read_bytes()
                res = time_start(args, run, graphs, fresh)
                # a start that found the cache stale (sources edited since the export) rebuilt entries: not a cached start
                res["cache_rebuilt"] = with_cache and (cached / "graphs" / "manifest.json").read_bytes() != manifest
                res["code_as_exported"] = code_sha256() == out["cache"]["code_sha256"]
                name = f"{graphs}_{'cache' if with_cache else 'no_cache'}"
                rounds[name].append(res)
                flags = f"exit {res['exit_code']}, rebuilt {res['cache_rebuilt']}, code as exported {res['code_as_exported']}"
                print(f"round {r + 1}: {name:18s} {res['seconds']:8.2f} s  ({flags})", flush=True)
    med = {k: statistics.median(x["seconds"] for x in v) for k, v in rounds.items()}
    out.update(
        rounds=rounds,
        median_s=med,
        ratios={
            "compiled_no_cache_over_cache": round(med["compiled_no_cache"] / med["compiled_cache"], 2),
            "compiled_cache_over_eager": round(med["compiled_cache"] / med["eager_no_cache"], 2),
            "eager_cache_over_no_cache": round(med["eager_cache"] / med["eager_no_cache"], 2),
        },
        load_avg_end=os.getloadavg(),
    )
    print(json.dumps({"median_s": med, "ratios": out["ratios"]}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
