"""Soak test of ``hstu serve``: overload, a steady phase, a model-process kill, recovery checks.

    python benchmarks/soak.py --run RUN_DIR [--quick] [--out benchmarks/results/soak.json]

Starts ``hstu serve --run RUN_DIR --port 0`` on 127.0.0.1 itself (``serve_load.start_server``,
model processes on), replays ML-1M histories (``serve_load.load_histories``: 200 most recent
events, k 5; ``--heavy-fraction`` of them beam width 16, k = the model's max) over aiohttp, and
stops by itself; every phase is bounded in time and in requests in flight:

1. capacity: closed loop, ``--concurrency`` clients back to back for ``--capacity-s``: 200s per
   second is the measured capacity C.
2. overload: open-loop Poisson arrivals at 2 C for ``--overload-s``: counts of 200 / 429 / 503 /
   other 5xx / transport errors, and the admitted (200) requests' P99 latency (from scheduled send
   times) against the queueing-delay bound plus one batch (the largest mean batch time of a bucket
   during the phase, from /metrics).
3. recovery check: once the server's queues are empty (/metrics), one normal request must be
   answered 200 within 1 s.
4. steady: C / 2 for ``--steady-s``; RSS of the server and its model processes sampled every
   ``--rss-every-s`` (10 s), growth reported (last - first sample).
5. kill: C / 2 for ``--kill-s``; ``kill -9`` of one model process at a third of the phase: counts
   of the answers, seconds until /readyz is 200 again and until the next 200 answer.
6. recovery check again, then SIGTERM to the server (its exit code is reported).

``--quick``: the same phases shortened (about a minute in all). The JSON (``--out``) holds every
figure with the git commit, the load average before and after, the core count and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import psutil

from hstu.ops._common import model_processes
from serve_load import REPO, Phase, default_data_dir, load_histories, run_phase, scrape, start_server, stop_server

HEADERS = {"content-type": "application/json"}


def heavy_bodies(bodies: list[bytes], fraction: float, k: int, seed: int) -> list[bytes]:
    """``bodies`` with a ``fraction`` of them turned into beam-16 next-``k`` requests."""
    rng = random.Random(seed)
    out = []
    for b in bodies:
        if rng.random() < fraction:
            d = json.loads(b)
            d.update(k=k, decoding={"strategy": "beam", "beam_width": 16})
            b = json.dumps(d).encode()
        out.append(b)
    return out


async def capacity(client: aiohttp.ClientSession, bodies: list[bytes], seconds: float, concurrency: int) -> dict:
    """Closed loop: ``concurrency`` clients send back to back for ``seconds``; 200s per second."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    codes: dict[str, int] = {}
    rng = random.Random(1)

    async def worker() -> None:
        while loop.time() < end:
            try:
                async with client.post("/v1/generate", data=bodies[rng.randrange(len(bodies))], headers=HEADERS) as r:
                    await r.read()
                    codes[str(r.status)] = codes.get(str(r.status), 0) + 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1

    t0 = loop.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    took = loop.time() - t0
    return {"qps": round(codes.get("200", 0) / took, 1), "seconds": round(took, 2), "concurrency": concurrency, "codes": codes}


def batch_means(before: dict, after: dict) -> dict[str, float]:
    """Mean batch seconds per bucket between two /metrics scrapes (raw samples)."""
    out = {}
    for (name, labels), v in after.items():
        if name == "hstu_serve_batch_duration_seconds_count":
            n = v - before.get((name, labels), 0.0)
            key = ("hstu_serve_batch_duration_seconds_sum", labels)
            if n > 0:
                out[dict(labels)["bucket"]] = (after[key] - before.get(key, 0.0)) / n
    return out


def hist_quantile(before: dict, after: dict, name: str, q: float) -> float | None:
    """Upper bucket bound (s) holding quantile ``q`` of histogram ``name`` (all label sets summed)
    between two scrapes; None when nothing was observed."""
    counts: dict[float, float] = {}
    for (n, labels), v in after.items():
        if n == name + "_bucket":
            le = float(dict(labels)["le"])
            counts[le] = counts.get(le, 0.0) + v - before.get((n, labels), 0.0)
    total = counts.get(float("inf"), 0.0)
    if total <= 0:
        return None
    return next(le for le in sorted(counts) if counts[le] >= q * total)


def samples(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def queue_depth(url: str) -> float:
    return sum(v for (name, _), v in samples(url).items() if name == "hstu_serve_queue_depth")


async def recovery_check(url: str, body: bytes, timeout_s: float = 30.0) -> dict:
    """Wait for empty queues, then time one normal request (it must be 200 within 1 s)."""
    t0 = time.monotonic()
    while await asyncio.to_thread(queue_depth, url) > 0 and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(0.02)
    empty = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/generate", content=body, headers=HEADERS)
    took = time.monotonic() - empty
    return {
        "status": r.status_code,
        "seconds_after_queue_empty": round(took, 3),
        "ok": r.status_code == 200 and took <= 1.0,
        "waited_for_empty_s": round(empty - t0, 3),
    }


def rss_mb(server: psutil.Process) -> dict:
    procs = [server, *model_processes(server)]
    per = {}
    for p in procs:
        try:
            per[p.pid] = p.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return {
        "t_s": None,
        "total_mb": round(sum(per.values()), 1),
        "server_mb": round(per.get(server.pid, 0.0), 1),
        "model_mb": [round(v, 1) for pid, v in per.items() if pid != server.pid],
    }


async def steady(client, bodies, rng, args, qps: float, server: psutil.Process) -> dict:
    ph = Phase(f"steady {qps:g}", qps, args.steady_s)
    t0 = time.monotonic()
    rss = []

    async def sampler() -> None:
        while True:
            s = rss_mb(server)
            s["t_s"] = round(time.monotonic() - t0, 1)
            rss.append(s)
            await asyncio.sleep(args.rss_every_s)

    task = asyncio.get_running_loop().create_task(sampler())
    await run_phase(client, bodies, ph, rng, args.max_in_flight, server)
    task.cancel()
    last = rss_mb(server)
    last["t_s"] = round(time.monotonic() - t0, 1)
    rss.append(last)
    return {**ph.summary(), "rss": rss, "rss_growth_mb": round(rss[-1]["total_mb"] - rss[0]["total_mb"], 1)}


async def kill_phase(client, bodies, rng, args, qps: float, server: psutil.Process, url: str) -> dict:
    ph = Phase(f"kill {qps:g}", qps, args.kill_s)
    info: dict = {}
    answers: list[tuple[float, str]] = []  # (time answered, code) after the kill, from a probe
    orig_add = ph.add

    def add(code: str, latency):
        answers.append((time.monotonic(), code))
        orig_add(code, latency)

    ph.add = add

    async def killer() -> None:
        await asyncio.sleep(args.kill_s / 3)
        victims = model_processes(server)
        if not victims:
            info["error"] = "no model process found"
            return
        info["killed_pid"] = victims[0].pid
        info["t_kill"] = time.monotonic()
        victims[0].kill()
        seen_down = False  # /readyz stays 200 until the server notices the death (the pipe's end, at the next batch)
        async with httpx.AsyncClient(base_url=url, timeout=5) as c:
            while time.monotonic() - info["t_kill"] < args.kill_s * 3:
                try:
                    up = (await c.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    up = False
                if not up and not seen_down:
                    seen_down, info["readyz_down_s"] = True, round(time.monotonic() - info["t_kill"], 3)
                if up and seen_down:
                    info["readyz_back_s"] = round(time.monotonic() - info["t_kill"], 3)
                    return
                await asyncio.sleep(0.05)

    task = asyncio.get_running_loop().create_task(killer())
    await run_phase(client, bodies, ph, rng, args.max_in_flight, server)
    await task
    t_kill = info.get("t_kill")
    after = [(t, c) for t, c in answers if t_kill is not None and t > t_kill]
    failed = [t for t, c in after if c != "200"]
    back = next((t for t, c in after if c == "200" and (not failed or t > failed[0])), None)  # first 200 after the first failure
    return {
        **ph.summary(),
        "killed_pid": info.get("killed_pid"),
        "error": info.get("error"),
        "failed_after_kill": len(failed),
        "failed_codes": {c: sum(1 for _, x in after if x == c) for c in sorted({c for _, c in after if c != "200"})},
        "readyz_down_s": info.get("readyz_down_s"),
        "readyz_back_s": info.get("readyz_back_s"),
        "first_200_after_kill_s": round(back - t_kill, 3) if back and t_kill else None,
    }


def overload_summary(ph: Phase, bound_s: float, means: dict[str, float]) -> dict:
    s = ph.summary()
    codes = ph.codes
    one_batch = max(means.values()) if means else 0.0
    return {
        **s,
        "count_200": codes.get("200", 0),
        "count_429": codes.get("429", 0),
        "count_503": codes.get("503", 0),
        "count_other_5xx": sum(n for c, n in codes.items() if c.isdigit() and c.startswith("5") and c != "503"),
        "count_non_http": sum(n for c, n in codes.items() if not c.isdigit()),
        "bound_ms": round(bound_s * 1e3, 1),
        "one_batch_ms": round(one_batch * 1e3, 2),
        "mean_batch_ms_by_bucket": {b: round(v * 1e3, 2) for b, v in sorted(means.items(), key=lambda x: int(x[0]))},
        "admitted_p99_within_bound_plus_one_batch": bool(ph.lat) and ph.p99 <= bound_s + one_batch,
    }


async def main_async(args, url: str, bodies: list[bytes], normal: bytes, server: psutil.Process) -> dict:
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=args.client_timeout_s)
    res: dict = {}
    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=args.connections), timeout=timeout) as client:
        await run_phase(client, bodies, Phase("warmup", 20.0, 1.0), rng, args.max_in_flight)
        cap = res["capacity"] = await capacity(client, bodies, args.capacity_s, args.concurrency)
        print(json.dumps({"capacity": cap}), flush=True)
        c = max(1.0, cap["qps"])
        before = await asyncio.to_thread(samples, url)
        over = await run_phase(client, bodies, Phase(f"overload {2 * c:g}", 2 * c, args.overload_s), rng, args.max_in_flight, server)
        after = await asyncio.to_thread(samples, url)
        res["overload"] = overload_summary(over, args.max_queue_delay_ms / 1e3, batch_means(before, after))
        for key, name in (
            ("server_p99_s_le", "hstu_serve_request_duration_seconds"),
            ("queue_wait_p99_s_le", "hstu_serve_queue_wait_seconds"),
        ):
            res["overload"][key] = hist_quantile(before, after, name, 0.99)  # from the server's histograms: a bucket bound
        print(json.dumps({"overload": res["overload"]}), flush=True)
        res["recovery_after_overload"] = await recovery_check(url, normal)
        res["steady"] = await steady(client, bodies, rng, args, c / 2, server)
        print(json.dumps({"steady": {k: res["steady"][k] for k in ("p99_ms", "codes", "rss_growth_mb")}}), flush=True)
        res["kill"] = await kill_phase(client, bodies, rng, args, c / 2, server, url)
        print(json.dumps({"kill": res["kill"]}), flush=True)
        res["recovery_after_kill"] = await recovery_check(url, normal)
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory to serve")
    p.add_argument("--data-dir", help="MovieLens-1M directory (default: the run's, else $HSTU_DATA_DIR, else ../shared/data/ml-1m)")
    p.add_argument("--quick", action="store_true", help="every phase shortened: about a minute in all")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak.json"), help="result JSON")
    p.add_argument("--max-queue-delay-ms", type=float, default=1000.0, help="the server's bound (hstu serve --max-queue-delay-ms)")
    p.add_argument("--heavy-fraction", type=float, default=0.1, help="share of requests with beam width 16, k = the model's max")
    p.add_argument("--capacity-s", type=float)
    p.add_argument("--overload-s", type=float)
    p.add_argument("--steady-s", type=float)
    p.add_argument("--kill-s", type=float)
    p.add_argument("--rss-every-s", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients of the capacity phase")
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--history", type=int, default=200)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model-workers", type=int, default=1, help="model processes (>= 1: the kill phase needs one)")
    p.add_argument("--server-cpus", help="CPU ids for the server (default: 0,1 when the machine has more than 2 cores)")
    p.add_argument(
        "--connections",
        type=int,
        default=2000,
        help="client connection pool: above the requests in flight at 2x overload (~C x bound), else requests "
        "wait for a connection in the client and that wait counts as latency",
    )
    p.add_argument("--max-in-flight", type=int, default=2000)
    p.add_argument("--client-timeout-s", type=float, default=30.0)
    p.add_argument("--bodies", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="show the server's log")
    args = p.parse_args(argv)
    if args.model_workers < 1:
        p.error("--model-workers must be >= 1 (the kill phase kills a model process)")
    q = args.quick
    for name, quick, full in (("capacity_s", 4, 8), ("overload_s", 10, 20), ("steady_s", 20, 60), ("kill_s", 12, 20)):
        if getattr(args, name) is None:
            setattr(args, name, float(quick if q else full))
    # what serve_load.start_server reads
    args.url, args.buckets, args.precision, args.client_cpus_rest = None, None, None, True
    args.server_args = ["--max-queue-delay-ms", str(args.max_queue_delay_ms)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    data_dir = Path(args.data_dir or default_data_dir(args.run))
    cfg = json.loads((Path(args.run) / "config.json").read_text())
    kmax = int(cfg["model"].get("max_output_len", 10))
    plain = load_histories(data_dir, args.history, args.bodies, args.seed, args.k)
    bodies = heavy_bodies(plain, args.heavy_fraction, kmax, args.seed)
    normal = json.dumps({**json.loads(plain[0]), "history": json.loads(plain[0])["history"][-20:]}).encode()
    proc, url, cpus = start_server(args)
    server = psutil.Process(proc.pid)
    try:
        try:
            import uvloop

            res = uvloop.run(main_async(args, url, bodies, normal, server))
        except ImportError:
            res = asyncio.run(main_async(args, url, bodies, normal, server))
        res["server_metrics"] = scrape(url)
        res["readyz_at_end"] = httpx.get(url + "/readyz", timeout=10).json().get("status")
    finally:
        rc = stop_server(proc)
    from _quality import git_commit  # after the run: the client never imports torch while it measures

    res.update(
        {
            "git_commit": git_commit(),
            "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + (argv if argv is not None else sys.argv[1:])),
            "server_exit_code_after_sigterm": rc,
            "settings": {
                k: getattr(args, k)
                for k in (
                    "quick",
                    "max_queue_delay_ms",
                    "heavy_fraction",
                    "capacity_s",
                    "overload_s",
                    "steady_s",
                    "kill_s",
                    "rss_every_s",
                    "concurrency",
                    "k",
                    "history",
                    "max_batch",
                    "max_wait_ms",
                    "threads",
                    "model_workers",
                )
            }
            | {"server_cpus": cpus, "heavy_k": kmax},
            "run": {
                "dir": args.run,
                "model": {k: cfg["model"].get(k) for k in ("num_items", "max_seq_len", "num_blocks", "embedding_dim")},
            },
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_before": load_before,
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            },
            "wall_s": round(time.monotonic() - t0, 1),
            "note": "client (one asyncio/aiohttp process) and server share this machine; latency from scheduled send times (open loop)",
        }
    )
    summary = {
        "capacity_qps": res["capacity"]["qps"],
        "overload_codes": res["overload"]["codes"],
        "overload_p99_ms": res["overload"]["p99_ms"],
        "bound_plus_one_batch_ms": res["overload"]["bound_ms"] + res["overload"]["one_batch_ms"],
        "recovery_after_overload": res["recovery_after_overload"]["ok"],
        "steady_rss_growth_mb": res["steady"]["rss_growth_mb"],
        "kill_failed": res["kill"]["failed_after_kill"],
        "kill_readyz_back_s": res["kill"]["readyz_back_s"],
        "recovery_after_kill": res["recovery_after_kill"]["ok"],
        "wall_s": res["wall_s"],
    }
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
