"""Load test of ``hstu serve``: replays ML-1M histories at increasing offered loads over loopback.

    python benchmarks/serve_load.py --run RUN_DIR [--quick] [--json PATH]

What it does (stops by itself; every phase is bounded in time and in requests in flight):

1. Starts ``hstu serve --run RUN_DIR --port 0`` as a subprocess on 127.0.0.1 (pinned to
   ``--server-cpus``, default the first two cores, when the machine has more than two), waits
   for /readyz. ``--url`` targets an already running server instead.
2. Builds request bodies from ML-1M (``ratings.dat``): a random user, the history cut at a random
   point (the request "happens" then), the most recent ``--history`` (200) events kept by the
   client (``--history`` >= 1: the server runs with ``--cold-start reject``), ``k`` items asked
   for; every bucket of the small preset (20, 50, 100, 200) gets traffic. ``--beam-share F``
   makes a fraction F of them beam-search requests (``--beam-width``, 16): mixed traffic, whose greedy and
   beam P99 are reported apart per bucket (``p99_ms_by_bucket``: "200" and "200+beam").
3. Steps of open-loop Poisson arrivals at increasing rates (``--steps``), ``--step-s`` seconds
   each. Latency is measured from each request's *scheduled* send time, so a client or server
   that falls behind is charged for it (no coordinated omission). Per step: offered and
   achieved QPS (200s per second), P50/P90/P99 latency of the 200s, status counts. The steps
   stop after two steps in a row with P99 > 100 ms or any non-200 answer (when the last listed step
   still passes, the load keeps rising by x1.25 per step until two fail; when none passes, it halves
   below the lowest until one does); then the knee is
   refined by bisection between the highest passing and the lowest failing offered load until
   they are within ``--resolution`` (5 %). ``knee_bracket`` in the JSON is that final pair of
   *offered* loads (``[x, null]``: no step failed within the time budget), while
   ``max_qps_p99_under_100ms`` is the *achieved* QPS (200s per second) of the best passing step,
   whose offered load is ``offered_qps_at_max``: Poisson arrivals over a short step make the two
   differ by a few per cent (e.g. 138 achieved in a bracket of [149, 155] offered).
   ``--steps`` values must be positive (write ``--steps=...`` for a list that argparse could read as a flag).
   ``--graphs eager|compiled|auto`` is passed to ``hstu serve`` (its per-bucket graphs; compiled loads
   the run's graph cache that ``hstu export --run RUN --graphs`` built, else compiles at warm-up).
4. Overload: 2 x the highest QPS that kept P99 <= 100 ms, for ``--overload-s`` seconds: every
   request must be answered with 200, 429 or 503 (counts of anything else are reported:
   ``overload_5xx_other_than_503``, ``overload_non_http_errors`` = connection errors / client
   timeouts).
5. Recovery: half that QPS (half the first step if none passed); the server should be back to
   200s within P99 <= 100 ms.
6. SIGTERM to the server; its exit code (0 = drained and stopped) is reported.

The client is one asyncio process using aiohttp (pre-encoded bodies, a bounded keep-alive
connection pool; httpx, which this script used first, costs ~5 ms of client CPU per request, a
quarter of a core at 50 QPS, taken from the server under test on a 2-core box); on a 2-core
machine it shares the cores with the server, which lowers the figure: the output records the
core count, the server's CPU affinity and the client's CPU time per request.

Each phase also reports the server's CPU time per request (psutil): every server process together
(``server_cpu_ms_per_request``) and the HTTP process alone (``http_cpu_ms_per_request``; the rest is
its model processes), a figure that a busy machine disturbs less than latency: 2 cores / that
time bounds the QPS of an idle 2-core box.

``--json PATH`` writes the result with keys ``max_qps_p99_under_100ms``,
``overload_non_http_errors``, ``overload_5xx_other_than_503`` (and the per-step table, the
server's own metrics: mean batch size, rejections by reason, the exact command).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pandas as pd

from hstu.backend import CPUBackend
from hstu.bench import load
from hstu.bench.load import P99_TARGET_S, Phase, ServerStartError, knee_bracket, request_body, run_phase, scrape, step_up, stop_server

REPO = Path(__file__).resolve().parents[1]
__all__ = ["REPO", "Phase", "default_data_dir", "load_histories", "run_phase", "scrape", "start_server", "stop_server"]  # soak.py


def load_histories(data_dir: Path, keep: int, n: int, seed: int, k: int, beam_share: float = 0.0, beam_width: int = 16) -> list[bytes]:
    """``n`` pre-encoded /v1/generate bodies from ML-1M users' histories cut at random points; a
    ``beam_share`` fraction of them (drawn with the same seed) asks for beam search of ``beam_width`` beams."""
    path = data_dir / "ratings.dat"
    if not path.exists():
        sys.exit(f"serve_load: {path} not found; pass --data-dir PATH/ml-1m (MovieLens-1M, GroupLens)")
    df = pd.read_csv(path, sep=":", header=None, usecols=[0, 2, 6], names=["user", "item", "ts"], encoding="latin-1")
    df = df.sort_values(["user", "ts"], kind="stable")
    users = df.user.to_numpy()
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    items, ts = df.item.to_numpy(), df.ts.to_numpy()
    rng = random.Random(seed)
    bodies = []
    for _ in range(n):
        u = rng.randrange(len(starts))
        s, e = int(starts[u]), int(ends[u])
        cut = rng.randint(s + 1, e)  # history = events before the cut (>= 1 event)
        lo = max(s, cut - keep)
        beam = beam_width if beam_share and rng.random() < beam_share else 0
        bodies.append(request_body(users[s], items[lo:cut], ts[lo:cut], k, beam))
    return bodies


def start_server(args) -> tuple[subprocess.Popen | None, str, list[int] | None]:
    """:func:`hstu.bench.load.start_server`, exiting with its message when the server does not start."""
    try:
        return load.start_server(args)
    except ServerStartError as exc:
        sys.exit(f"serve_load: {exc}")


async def main_async(args, url: str, bodies: list[bytes], server=None) -> dict:
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=args.connections)
    t_start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=args.client_timeout_s)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as client:
        # warm the connections and the server's code paths (not measured)
        await run_phase(client, bodies, Phase("warmup", min(50.0, args.steps[0]), 1.0), rng, args.max_in_flight)
        steps, best = await step_up(
            client,
            bodies,
            args.steps,
            args.step_s,
            rng,
            max_in_flight=args.max_in_flight,
            server=server,
            deadline=t_start + args.budget_s * 0.6,
            echo=True,
            resolution=args.resolution,
        )
        best_qps = best.summary()["achieved_qps"] if best else 0.0
        over_qps = 2 * (best_qps if best_qps > 0 else args.steps[0])
        await asyncio.sleep(1.0)
        over = await run_phase(client, bodies, Phase(f"overload {over_qps:g}", over_qps, args.overload_s), rng, args.max_in_flight, server)
        print(json.dumps(over.summary()), flush=True)
        await asyncio.sleep(1.0)
        rec_qps = best_qps / 2 if best_qps > 0 else args.steps[0] / 2
        recov = await run_phase(client, bodies, Phase(f"recovery {rec_qps:g}", rec_qps, args.recovery_s), rng, args.max_in_flight, server)
        print(json.dumps(recov.summary()), flush=True)
    codes = over.codes
    other_5xx = sum(n for c, n in codes.items() if c.isdigit() and c.startswith("5") and c != "503")
    non_http = sum(n for c, n in codes.items() if not c.isdigit())
    unexpected_4xx = sum(n for c, n in codes.items() if c.isdigit() and c.startswith("4") and c != "429")
    return {
        "max_qps_p99_under_100ms": best_qps,  # achieved (200s per second) at the best passing step
        "offered_qps_at_max": best.summary()["offered_qps"] if best else None,
        "p99_ms_at_max": best.summary()["p99_ms"] if best else None,
        "knee_bracket": list(knee_bracket(steps)),
        "overload_non_http_errors": non_http,
        "overload_5xx_other_than_503": other_5xx,
        "overload_4xx_other_than_429": unexpected_4xx,
        "overload_answered_ratio": round(sum(n for c, n in codes.items() if c in ("200", "429", "503")) / max(1, over.sent), 4),
        "recovered": recov.all_ok and recov.p99 <= P99_TARGET_S,
        "steps": [p.summary() for p in steps],
        "overload": over.summary(),
        "recovery": recov.summary(),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="run directory to serve (small preset trained on ML-1M)")
    p.add_argument("--url", help="use a running server instead of starting one")
    p.add_argument(
        "--data-dir",
        help="MovieLens-1M directory (ratings.dat); default: the run's training data, else "
        "$HSTU_DATA_DIR, else ../shared/data/ml-1m beside the repository",
    )
    p.add_argument("--quick", action="store_true", help="short steps; the whole run stays within ~90 s")
    p.add_argument("--steps", help="offered loads in requests/s, comma-separated (default by mode)")
    p.add_argument("--step-s", type=float, help="seconds per step (default 3 quick, 10 full)")
    p.add_argument(
        "--resolution",
        type=float,
        default=0.05,
        help="refine the knee until its bracket is within this ratio (default 0.05; 0: steps only)",
    )
    p.add_argument(
        "--server-src",
        help="the src/ directory of the hstu tree the server runs from (default: this one's), for before/after comparisons "
        "with one load generator",
    )
    p.add_argument("--overload-s", type=float, help="seconds of 2x overload (default 6 quick, 20 full)")
    p.add_argument("--recovery-s", type=float, help="seconds of the recovery phase (default 3 quick, 10 full)")
    p.add_argument("-k", type=int, default=5, help="items per request")
    p.add_argument("--history", type=int, default=200, help="most recent events a client sends")
    p.add_argument(
        "--beam-share",
        type=float,
        default=0.0,
        help="fraction of requests asking for beam search (mixed traffic; their P99 is reported apart as '<bucket>+beam')",
    )
    p.add_argument("--beam-width", type=int, default=16, help="beams of a --beam-share request (default 16)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--buckets", help="server buckets (default: the server's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each model process (default 1)")
    p.add_argument(
        "--model-workers",
        type=int,
        default=1,
        help="server model processes (hstu serve --model-workers); 0 = the model on a thread of the HTTP process",
    )
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16", "int8"], help="server inference precision (hstu serve --precision)")
    p.add_argument("--device", default="cpu", help="the server's device (hstu serve --device: cpu, cuda, npu)")
    p.add_argument(
        "--graphs", choices=["auto", "eager", "compiled"], help="per-bucket graphs of the server (hstu serve --graphs; default: its own)"
    )
    p.add_argument("--ready-timeout-s", type=float, default=600.0, help="seconds to wait for /readyz (a start that compiles takes minutes)")
    p.add_argument("--server-cpus", help="CPU ids for the server, e.g. 0,1 (default: 0,1 when the machine has more than 2 cores)")
    p.add_argument("--client-cpus-rest", action="store_true", default=True, help=argparse.SUPPRESS)
    p.add_argument("--connections", type=int, default=256, help="client connection pool size")
    p.add_argument(
        "--max-in-flight", type=int, default=2000, help="client cap on outstanding requests (beyond it, arrivals are counted as dropped)"
    )
    p.add_argument("--client-timeout-s", type=float, default=30.0)
    p.add_argument("--bodies", type=int, default=3000, help="distinct pre-encoded request bodies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--verbose", action="store_true", help="show the server's log")
    args = p.parse_args(argv)
    if not args.run and not args.url:
        p.error("give --run RUN_DIR (or --url of a running server)")
    if args.run and not (Path(args.run) / "config.json").is_file():
        p.error(f"--run {args.run}: not a run directory (no config.json there); give the directory `hstu train` wrote")
    quick = args.quick
    args.steps = parse_steps(
        p, args.steps or ("10,25,50,100,150,200,250,300,400,500,600" if quick else "25,50,100,150,200,250,300,350,400,500,600,800,1000")
    )
    check_ranges(p, args)
    args.step_s = (3.0 if quick else 10.0) if args.step_s is None else args.step_s
    args.overload_s = (6.0 if quick else 20.0) if args.overload_s is None else args.overload_s
    args.recovery_s = (3.0 if quick else 10.0) if args.recovery_s is None else args.recovery_s
    args.budget_s = 90.0 if quick else 900.0
    return args


def check_ranges(p: argparse.ArgumentParser, args) -> None:
    """``p.error`` (exit 2, naming the flag) for a setting under which no request could succeed or no
    step could run: k outside 1..the run's max_output_len (every request would be a 422), an empty
    --history (the server runs with --cold-start reject: an empty history is a 422 too), a phase
    of no time, a share outside [0, 1], a resolution outside [0, 1)."""
    max_k = 10
    if args.run:
        max_k = int(json.loads((Path(args.run) / "config.json").read_text())["model"].get("max_output_len", 10))
    if not 1 <= args.k <= max_k:
        p.error(f"-k: items per request must be in 1..{max_k} (the run's max_output_len), got {args.k}")
    for flag, value in (("--history", args.history), ("--beam-width", args.beam_width), ("--bodies", args.bodies)):
        if value < 1:
            p.error(f"{flag}: must be >= 1, got {value}")
    for flag, value in (("--step-s", args.step_s), ("--overload-s", args.overload_s), ("--recovery-s", args.recovery_s)):
        if value is not None and not value > 0:
            p.error(f"{flag}: seconds must be > 0, got {value}")
    if not 0.0 <= args.beam_share <= 1.0:
        p.error(f"--beam-share: a fraction in [0, 1], got {args.beam_share}")
    if not 0.0 <= args.resolution < 1.0:
        p.error(f"--resolution: a ratio in [0, 1) (0: the listed steps only), got {args.resolution}")


def readyz(url: str) -> dict:
    """The server's /readyz body ({} when it does not answer 200 with JSON)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/readyz", timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


def parse_steps(p: argparse.ArgumentParser, text: str) -> list[float]:
    """ "25,50,100" -> [25.0, 50.0, 100.0]; ``p.error`` (exit 2, naming --steps) on anything but positive numbers."""
    try:
        steps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"--steps: expected comma-separated offered loads in requests/s such as 25,50,100, got {text!r}")
    if not steps or any(not (x > 0 and x < float("inf")) for x in steps):
        p.error(f"--steps: every offered load must be a positive number of requests/s, got {text!r}")
    return steps


def default_data_dir(run: str | None) -> Path:
    """The run's own training data (config.json ``data.data_dir``) when it holds ratings.dat,
    else $HSTU_DATA_DIR, else ../shared/data/ml-1m beside the repository."""
    if run and (Path(run) / "config.json").exists():
        d = (json.loads((Path(run) / "config.json").read_text()).get("data") or {}).get("data_dir")
        if d and (Path(d) / "ratings.dat").exists():
            return Path(d)
    if os.environ.get("HSTU_DATA_DIR"):
        return Path(os.environ["HSTU_DATA_DIR"])
    return REPO.parent / "shared" / "data" / "ml-1m"


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    args.data_dir = args.data_dir or str(default_data_dir(args.run))
    bodies = load_histories(Path(args.data_dir), args.history, args.bodies, args.seed, args.k, args.beam_share, args.beam_width)
    args.server_args = ([] if args.device == "cpu" else ["--device", args.device]) + (["--graphs", args.graphs] if args.graphs else [])
    proc, url, cpus = start_server(args)
    try:
        try:
            import psutil

            server = psutil.Process(proc.pid) if proc is not None else None
        except ImportError:
            server = None
        try:  # uvloop (uvicorn[standard] brings it) cuts the client's own CPU per request
            import uvloop

            res = uvloop.run(main_async(args, url, bodies, server))
        except ImportError:
            res = asyncio.run(main_async(args, url, bodies, server))
        res["server_metrics"] = scrape(url)
        res["server_readyz"] = readyz(url)  # what the server resolved: "generation" names its graph mode, with the precision
    finally:
        rc = stop_server(proc) if proc is not None else None
    run_info = None
    if args.run:
        cfg = json.loads((Path(args.run) / "config.json").read_text())
        met = json.loads((Path(args.run) / "metrics.json").read_text()) if (Path(args.run) / "metrics.json").exists() else {}
        run_info = {
            "dir": args.run,
            "model": {k: cfg["model"].get(k) for k in ("num_items", "max_seq_len", "num_blocks", "embedding_dim")},
            "data": cfg.get("data"),
            "epochs": met.get("epochs"),
            "test_NDCG@10": (met.get("test") or {}).get("NDCG@10"),
        }
    from hstu.bench.env import git_commit  # after the run: the client never imports torch while it measures

    res.update(
        {
            "git_commit": git_commit(),
            "run": run_info,
            "server_exit_code_after_sigterm": rc,
            "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + (argv if argv is not None else sys.argv[1:])),
            "settings": {
                "k": args.k,
                "history": args.history,
                "beam_share": args.beam_share,
                "beam_width": args.beam_width,
                "max_batch": args.max_batch,
                "max_wait_ms": args.max_wait_ms,
                "server_threads": args.threads,
                "model_workers": args.model_workers,
                "server_cpus": cpus,
                "device": args.device,
                "graphs": args.graphs or "server default",
                "graphs_resolved": res["server_readyz"].get("generation"),
                "precision": args.precision or "server default",
                "precision_resolved": res["server_readyz"].get("precision"),
                "step_s": args.step_s,
                "resolution": args.resolution,
                "server_src": args.server_src,
                "overload_s": args.overload_s,
                "recovery_s": args.recovery_s,
            },
            "machine": {
                "cpu": CPUBackend().device_name(),
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_at_start": load_before,
                "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            },
            "wall_s": round(time.monotonic() - t0, 1),
            "note": "client (one asyncio/aiohttp process) and server share this machine; P99 from scheduled send times (open loop)",
        }
    )
    print(
        json.dumps(
            {
                k: res[k]
                for k in (
                    "max_qps_p99_under_100ms",
                    "p99_ms_at_max",
                    "knee_bracket",
                    "overload_non_http_errors",
                    "overload_5xx_other_than_503",
                    "recovered",
                    "wall_s",
                )
            }
        )
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
