"""The HTTP load generator of ``hstu bench --serve``, ``benchmarks/serve_load.py`` and
``benchmarks/soak.py``: starts ``hstu serve`` as a subprocess, offers open-loop Poisson arrivals at
increasing rates and finds the highest rate whose answers all came back 200 with P99 <= 100 ms.

Latency is measured from each request's *scheduled* send time, so a client or server that falls
behind is charged for it (no coordinated omission: Tene, "How NOT to measure latency", 2015). The
client is one asyncio process with aiohttp (about 1 ms of client CPU per request; httpx costs about
5 ms, a quarter of a core at 50 QPS taken from the server under test on a small machine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import psutil

import hstu

P99_TARGET_S = 0.100
SRC = Path(hstu.__file__).resolve().parents[1]  # the directory holding the hstu package (PYTHONPATH of the server)


class ServerStartError(RuntimeError):
    """``hstu serve`` did not start or did not become ready; the message says how to see why."""


def request_body(user_id: int, items, timestamps, k: int, beam_width: int = 0) -> bytes:
    """A pre-encoded ``POST /v1/generate`` body: original item ids and Unix-second timestamps, oldest
    first; greedy, or beam search of ``beam_width`` beams when > 0 (labelled "+beam" in the per-bucket
    figures, :func:`latency_label`)."""
    hist = [{"item_id": int(i), "timestamp": int(t)} for i, t in zip(items, timestamps)]
    body = {"user_id": int(user_id), "history": hist, "k": int(k)}
    if beam_width:
        body["decoding"] = {"strategy": "beam", "beam_width": int(beam_width)}
    return json.dumps(body).encode()


_BEAM = b'"strategy": "beam"'


def latency_label(request: bytes, answer: bytes) -> str | None:
    """The key of a 200's latency in ``p99_ms_by_bucket``: the answer's bucket (:func:`bucket_of`),
    with "+beam" for a beam-search request of :func:`request_body` (so greedy and beam P99 are apart)."""
    b = bucket_of(answer)
    return None if b is None else (b + "+beam" if _BEAM in request else b)


class Phase:
    """Results of one offered-load phase."""

    def __init__(self, name: str, offered: float, seconds: float) -> None:
        self.name, self.offered, self.seconds = name, offered, seconds
        self.lat: list[float] = []
        self.lat_by_bucket: dict[str, list[float]] = {}  # the "bucket" of each 200's body (the server's length bucket)
        self.codes: dict[str, int] = {}
        self.sent = 0
        self.dropped_client = 0  # not sent: client in-flight cap reached

    def add(self, code: str, latency: float | None, bucket: str | None = None) -> None:
        self.codes[code] = self.codes.get(code, 0) + 1
        if code == "200" and latency is not None:
            self.lat.append(latency)
            if bucket is not None:
                self.lat_by_bucket.setdefault(bucket, []).append(latency)

    server_cpu_s: float | None = None  # CPU seconds (user + system) of every server process during the phase
    http_cpu_s: float | None = None  # of the HTTP process alone (the rest: its model processes)
    client_cpu_s: float | None = None  # this (load generator) process's CPU seconds during the phase

    def summary(self) -> dict:
        lat = np.array(self.lat) if self.lat else np.array([np.nan])
        ok = self.codes.get("200", 0)
        per = lambda s: None if s is None or not self.sent else round(1e3 * s / self.sent, 3)  # noqa: E731
        pct = lambda q: None if not self.lat else round(float(np.percentile(lat, q)) * 1e3, 2)  # noqa: E731
        return {
            "phase": self.name,
            "offered_qps": round(self.offered, 1),
            "achieved_qps": round(ok / self.seconds, 1),
            "sent": self.sent,
            "p50_ms": pct(50),
            "p90_ms": pct(90),
            "p99_ms": pct(99),
            "max_ms": pct(100),
            "codes": dict(sorted(self.codes.items())),
            "client_dropped": self.dropped_client,
            "server_cpu_ms_per_request": per(self.server_cpu_s),
            "http_cpu_ms_per_request": per(self.http_cpu_s),
            "client_cpu_ms_per_request": per(self.client_cpu_s),
            "p99_ms_by_bucket": {b: round(float(np.percentile(v, 99)) * 1e3, 2) for b, v in sorted(self.lat_by_bucket.items(), key=_edge)},
            "answered_by_bucket": {b: len(v) for b, v in sorted(self.lat_by_bucket.items(), key=_edge)},
        }

    @property
    def p99(self) -> float:
        return float(np.percentile(self.lat, 99)) if self.lat else float("inf")

    @property
    def all_ok(self) -> bool:
        return set(self.codes) <= {"200"} and self.dropped_client == 0


def _edge(kv) -> tuple:
    head = kv[0].split("+")[0]
    return (0, int(head), kv[0]) if head.isdigit() else (1, 0, kv[0])


_BUCKET = re.compile(rb'"bucket":\s*(\d+|null)')


def bucket_of(body: bytes) -> str | None:
    """The ``bucket`` field of a /v1/generate answer ("cold_start" for null), None without one."""
    m = _BUCKET.search(body)
    return None if m is None else ("cold_start" if m.group(1) == b"null" else m.group(1).decode())


def _cpu(server) -> tuple[float, float] | None:
    """(CPU seconds of the server and all its live descendants, of the server process alone), or None.
    psutil's ``children_*`` times count only children that have exited, so the model processes'
    own times are summed here."""
    if server is None:
        return None
    t = server.cpu_times()
    own = t.user + t.system
    total = own + t.children_user + t.children_system
    for child in server.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += c.user + c.system
    return total, own


async def run_phase(
    client: aiohttp.ClientSession, bodies: list[bytes], phase: Phase, rng: random.Random, max_in_flight: int, server=None
) -> Phase:
    """Poisson arrivals at ``phase.offered`` per second for ``phase.seconds``; waits for every answer.
    ``server``: a psutil.Process of the server, to record its CPU time (None: not recorded)."""
    loop = asyncio.get_running_loop()
    cpu0 = _cpu(server)
    t0 = loop.time()
    tasks: set[asyncio.Task] = set()
    headers = {"content-type": "application/json"}
    client_cpu0 = time.process_time()

    async def one(body: bytes, scheduled: float) -> None:
        try:
            async with client.post("/v1/generate", data=body, headers=headers) as r:
                got = await r.read()
                phase.add(str(r.status), loop.time() - scheduled, latency_label(body, got) if r.status == 200 else None)
        except asyncio.TimeoutError:
            phase.add("client_timeout", None)
        except aiohttp.ClientError as exc:
            phase.add(f"transport_error:{type(exc).__name__}", None)

    t = t0
    end = t0 + phase.seconds
    while True:
        t += rng.expovariate(phase.offered)
        if t >= end:
            break
        delay = t - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= max_in_flight:
            phase.dropped_client += 1
            continue
        phase.sent += 1
        task = loop.create_task(one(bodies[rng.randrange(len(bodies))], t))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    if cpu0 is not None:
        cpu1 = _cpu(server)
        phase.server_cpu_s, phase.http_cpu_s = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    phase.client_cpu_s = time.process_time() - client_cpu0
    return phase


def stop_server(proc: subprocess.Popen) -> int | str:
    """SIGTERM (graceful drain), then the exit code; killed after 60 s (then that is the answer)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "killed after 60 s"


def scrape(url: str) -> dict:
    """Server-side view from /metrics: batches, mean batch size and model time, mean server
    latency of answered requests, rejections by reason."""
    text = httpx.get(url + "/metrics", timeout=10).text
    tot: dict[str, float] = {}
    rejected = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split()[0]
        if name in (
            "hstu_serve_batch_size_sum",
            "hstu_serve_batch_size_count",
            "hstu_serve_batch_duration_seconds_sum",
            "hstu_serve_request_duration_seconds_sum",
            "hstu_serve_request_duration_seconds_count",
        ):
            tot[name] = tot.get(name, 0.0) + float(line.split()[-1])
        elif name == "hstu_serve_rejected_requests_total":
            rejected[re.search(r'reason="([^"]+)"', line).group(1)] = float(line.split()[-1])
    n = tot.get("hstu_serve_batch_size_count", 0.0)
    r = tot.get("hstu_serve_request_duration_seconds_count", 0.0)
    return {
        "batches": int(n),
        "mean_batch_size": round(tot.get("hstu_serve_batch_size_sum", 0.0) / n, 2) if n else 0.0,
        "mean_batch_ms": round(1e3 * tot.get("hstu_serve_batch_duration_seconds_sum", 0.0) / n, 2) if n else None,
        "mean_server_latency_ms": round(1e3 * tot.get("hstu_serve_request_duration_seconds_sum", 0.0) / r, 2) if r else None,
        "rejected": rejected,
    }


def start_server(args) -> tuple[subprocess.Popen | None, str, list[int] | None]:
    """``hstu serve`` on 127.0.0.1, an OS-chosen port, waited for until /readyz answers 200 (120 s), or
    ``args.url`` when set. ``args`` fields: url, run, max_batch, max_wait_ms, threads, buckets,
    precision, model_workers (0: no model process), server_args (more flags), server_cpus ("0,1"),
    client_cpus_rest, verbose, server_src (optional: the src/ directory the server imports hstu from;
    default the one this module is in), ready_timeout_s (optional, default 120; a start that compiles
    its graphs takes longer). Returns (process or None, base URL, the server's CPUs or None).

    Raises:
        ServerStartError: the server printed no "listening on" line or was not ready in time.
    """
    if args.url:
        url = args.url.rstrip("/")
        try:
            httpx.get(url + "/readyz", timeout=10)
        except httpx.HTTPError as exc:
            raise ServerStartError(f"--url {url}: no server answers there ({type(exc).__name__}: {exc})") from None
        return None, url, None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per /readyz poll in the caller's log
    cmd = [
        sys.executable,
        "-m",
        "hstu.cli",
        "serve",
        "--run",
        args.run,
        "--port",
        "0",
        "--max-batch",
        str(args.max_batch),
        "--max-wait-ms",
        str(args.max_wait_ms),
        "--cold-start",
        "reject",
        "--threads",
        str(args.threads),
    ]
    if args.buckets:
        cmd += ["--buckets", args.buckets]
    if args.precision:
        cmd += ["--precision", args.precision]
    cmd += ["--model-workers", str(args.model_workers)] if args.model_workers else ["--no-model-process"]
    cmd += list(getattr(args, "server_args", None) or [])  # further `hstu serve` flags of a caller (benchmarks/soak.py)
    cpus = None
    ncpu = os.cpu_count() or 1
    if args.server_cpus:
        cpus = [int(c) for c in args.server_cpus.split(",")]
    elif ncpu > 2:
        cpus = [0, 1]
    src = getattr(args, "server_src", None) or str(SRC)
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if not args.verbose else None, text=True, env=env, preexec_fn=pre
    )
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://\S+)", line)
    if not m:
        proc.kill()
        raise ServerStartError(f"hstu serve did not start (got {line!r}); run `{' '.join(cmd)}` to see why")
    url = m.group(1)
    ready_s = getattr(args, "ready_timeout_s", None) or 120
    deadline = time.monotonic() + ready_s
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise ServerStartError(f"hstu serve was not ready within {ready_s:g} s")
        time.sleep(0.2)
    if cpus is not None and args.client_cpus_rest:
        rest = [c for c in range(ncpu) if c not in cpus]
        if rest:
            os.sched_setaffinity(0, rest)
    return proc, url, cpus


def _passed(ph: Phase) -> bool:
    return ph.p99 <= P99_TARGET_S and ph.all_ok


def knee_bracket(phases: list[Phase]) -> tuple[float | None, float | None]:
    """(highest offered load that passed: P99 <= 100 ms, only 200s; lowest failing offered load above
    it), requests/s; None where there is none (hi None: the knee was not reached)."""
    lo = max((p.offered for p in phases if _passed(p)), default=None)
    hi = min((p.offered for p in phases if not _passed(p) and lo is not None and p.offered > lo), default=None)
    return lo, hi


async def step_up(
    client,
    bodies: list[bytes],
    steps: list[float],
    step_s: float,
    rng: random.Random,
    *,
    max_in_flight: int = 2000,
    server=None,
    deadline: float = float("inf"),
    echo: bool = False,
    resolution: float = 0.05,
    extend: float = 1.25,
    max_extra: int = 16,
) -> tuple[list[Phase], Phase | None]:
    """Find the knee: offered loads ``steps`` (requests/s) for ``step_s`` seconds each, stopping after
    two steps in a row with P99 > 100 ms or any answer other than 200 (one alone may be a noisy
    neighbour), then bisection (geometric midpoints) between the highest passing offered load and
    the lowest failing one above it until they are within ``resolution`` (0.05: 5 %; 0 or above
    the steps' spacing: no refinement). When the last listed step still passes, the offered load keeps
    rising by ``extend`` (x1.25) per step, at most ``max_extra`` steps, until two fail in a row: the
    knee is found above any list; when no step passes, the load halves below the lowest until one
    does (``extend`` 0: the list only). Everything stops at ``deadline``
    (time.monotonic()).
    Returns (the phases run, the one with the highest achieved QPS that kept P99 <= 100 ms with
    only 200s, or None)."""
    done: list[Phase] = []

    async def phase(name: str, qps: float) -> Phase:
        ph = await run_phase(client, bodies, Phase(name, qps, step_s), rng, max_in_flight, server)
        done.append(ph)
        if echo:
            print(json.dumps(ph.summary()), flush=True)
        return ph

    misses, qps, extra = 0, 0.0, 0
    for qps in steps:
        if time.monotonic() > deadline:
            break
        misses = 0 if _passed(await phase(f"step {qps:g}", qps)) else misses + 1
        if misses == 2:
            break
    rising = extend > 1 and done and misses == 0  # the last listed step passed: the knee lies above the list
    while rising and misses < 2 and extra < max_extra and time.monotonic() <= deadline:
        qps, extra = round(qps * extend, 1), extra + 1
        misses = 0 if _passed(await phase(f"step {qps:g}", qps)) else misses + 1
    qps = min((p.offered for p in done), default=0.0)
    while extend > 1 and done and not any(map(_passed, done)) and extra < max_extra and time.monotonic() <= deadline:
        qps, extra = round(qps / 2, 1), extra + 1  # nothing passed: halve below the lowest step until one does
        if qps < 0.5 or _passed(await phase(f"step {qps:g}", qps)):
            break
    lo, hi = knee_bracket(done)
    while lo is not None and hi is not None and resolution > 0 and hi / lo > 1 + resolution and time.monotonic() <= deadline:
        mid = round((lo * hi) ** 0.5, 1)
        if _passed(await phase(f"refine {mid:g}", mid)):
            lo = mid
        else:
            hi = mid
    good = [p for p in done if _passed(p)]
    return done, (max(good, key=lambda p: p.summary()["achieved_qps"]) if good else None)


async def _max_qps(url: str, bodies: list[bytes], steps: list[float], step_s: float, seed: int, deadline: float) -> dict:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(
        base_url=url, connector=aiohttp.TCPConnector(limit=256), timeout=aiohttp.ClientTimeout(total=30)
    ) as client:
        await run_phase(client, bodies, Phase("warmup", min(20.0, steps[0]), 1.0), rng, 2000)
        done, _ = await step_up(client, bodies, steps, step_s, rng, deadline=deadline)
    # the highest *offered* rate that passed (knee_bracket's lower end): a short step's achieved rate is a Poisson count
    # over its window and overstates it (73.0 achieved at the 62.5 offered over 2 s)
    best = max((p for p in done if _passed(p)), key=lambda p: p.offered, default=None)
    s = best.summary() if best else None
    return {
        "max_qps": best.offered if best else 0.0,
        "offered_qps": best.offered if best else None,
        "achieved_qps": s["achieved_qps"] if s else None,
        "p50_ms": s["p50_ms"] if s else None,
        "p99_ms": s["p99_ms"] if s else None,
        "steps": [p.summary() for p in done],
    }


def serve_figures(
    run,
    precision: str,
    bodies: list[bytes],
    *,
    steps: list[float],
    step_s: float,
    max_batch: int = 16,
    buckets: str | None = None,
    threads: int = 1,
    budget_s: float = 120.0,
    seed: int = 0,
) -> dict:
    """The HTTP figures of one precision: ``hstu serve --run run --precision precision`` (one model
    process, ``threads`` torch threads) under :func:`step_up`; returns ``max_qps`` = ``offered_qps`` (the highest
    offered rate, requests/s, whose step kept P99 <= 100 ms with only 200s; 0.0 / None when no step did),
    ``achieved_qps`` (200s per second of that step: a Poisson count over ``step_s``, above or below the offered
    rate), ``p50_ms`` / ``p99_ms`` there (None then), ``steps``, ``server_exit_code``.
    Raises ServerStartError when the server does not start."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        url=None,
        run=str(run),
        max_batch=max_batch,
        max_wait_ms=5.0,
        threads=threads,
        buckets=buckets,
        precision=precision,
        model_workers=1,
        server_args=[],
        server_cpus=",".join(str(c) for c in range(os.cpu_count() or 1)),  # the whole machine (no pinning)
        client_cpus_rest=False,
        verbose=False,
    )
    proc, url, _ = start_server(args)
    try:
        out = asyncio.run(_max_qps(url, bodies, steps, step_s, seed, time.monotonic() + budget_s))
    finally:
        out_rc = stop_server(proc)
    return {**out, "server_exit_code": out_rc}
