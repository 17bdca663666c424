"""The model-process pipe side by side: packed frames (hstu.serve.wire) against pickle, per batch.

    python benchmarks/serve_wire.py --run RUN_DIR [--batch 16] [--k 5] [--json PATH]

One process, one thread, rounds interleaved, median of ``--rounds``. A batch of ``--batch`` generate
jobs of 20..200 ML-1M-sized events (dense ids drawn from the run's items) and its answer:

- ``call``: the serving process encodes the batch, the model process decodes it. Pickle of the Job
  list (``multiprocessing``'s ForkingPickler, what a pipe ``send`` does) against
  :func:`~hstu.serve.wire.pack_jobs` / :func:`~hstu.serve.wire.unpack_jobs`.
- ``answer``: the model process encodes the outcome, the serving process decodes it and has the
  item dicts of every job. Before: the model process described the items (``Recommender.describe``)
  and pickled ``("ok", BatchOutcome)`` of dict lists; now it packs the dense ids, scores and actions
  (:func:`~hstu.serve.wire.pack_answer`) and the serving process unpacks and describes them. The
  figures are split by process (``model_us``, ``serving_us``): the serving process's share is the
  one the HTTP event loop pays.
- ``request``: a 200-event /v1/generate body validated by pydantic (``model_validate_json``) against
  msgspec's mirror of the schema (:mod:`hstu.serve.fast_body`, what ``edge.read_body`` tries first),
  each with the service's per-event attribute reads.
- ``response``: a 5-item /v1/generate body encoded by orjson (``edge.json_response``) against
  ``json.dumps`` (Starlette's JSONResponse).
- ``edge_cold_start``, ``edge_invalid``: one whole ASGI request to the app of ``create_app`` (in
  process, no socket), /v1/generate with a 100-event history of unknown items (dropped: the
  cold-start answer, 200) and with a bad field (422): through the framework's route (the app
  with ``app.state.direct_routes`` cleared) against the edge's direct route (``EdgeMiddleware``
  ``routes``). The same status and body either way, ``latency_ms`` aside (asserted); the difference
  is the framework layers' CPU per request, which the HTTP event loop pays.

The load average before and after is recorded; on a shared machine the ratios of interleaved
timings move less than the microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import msgspec
import numpy as np
import orjson

from hstu.config import DecodeOptions
from hstu.generate.recommend import Prepared, Ranked, Recommender
from hstu.serve import fast_body
from hstu.serve.executor import BatchOutcome
from hstu.serve.runner import Job
from hstu.serve.schemas import GenerateRequest
from hstu.serve.wire import pack_answer, pack_jobs, unpack_answer, unpack_jobs


def _batch(n_items: int, batch: int, k: int, seed: int) -> tuple[list[Job], list[Ranked]]:
    rng = np.random.default_rng(seed)
    jobs, ranked = [], []
    for _ in range(batch):
        n = int(rng.integers(20, 201))
        ids = rng.integers(1, n_items + 1, n).astype(np.int64)
        ts = np.sort(rng.integers(9e8, 1e9, n)).astype(np.int64)
        prep = Prepared(ids, ts, np.zeros(n, np.int64), np.zeros(n, np.int64), 10**9, [], [])
        jobs.append(Job("generate", prep, k=k, decoding=DecodeOptions()))
        items = rng.choice(np.arange(1, n_items + 1), k, replace=False).astype(np.int64)
        ranked.append(Ranked(items, np.sort(rng.standard_normal(k).astype(np.float32))[::-1].copy(), None))
    return jobs, ranked


def _request_case(rec: Recommender) -> tuple:
    """(before, now) for ``request``: a 200-event /v1/generate body validated by pydantic
    (``GenerateRequest.model_validate_json``) against msgspec's mirror (:mod:`hstu.serve.fast_body`),
    each followed by the service's per-event reads (``Service.prepare``'s four lists)."""
    raw = rec.raw_ids
    body = orjson.dumps(
        {
            "user_id": 7,
            "history": [{"item_id": int(raw[1 + i % (len(raw) - 1)]), "timestamp": 978300000 + 60 * i} for i in range(200)],
            "k": 5,
        }
    )

    def read(req) -> int:
        h = req.history
        return len([e.item_id for e in h]) + len([e.timestamp for e in h]) + len([e.action for e in h]) + len([e.features for e in h])

    assert msgspec.to_builtins(fast_body.decode("GenerateRequest", body)) == GenerateRequest.model_validate_json(body).model_dump()
    return (lambda: read(GenerateRequest.model_validate_json(body)), lambda: read(fast_body.decode("GenerateRequest", body)))


def _us(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


async def _asgi_post(app, path: str, body: bytes) -> tuple[int, bytes]:
    """One POST through the ASGI ``app``: (status, response body). A bare ASGI call rather than
    httpx's ASGITransport, whose client-side CPU per request would swamp the server's being measured."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http"}
    scope |= {"path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1)}
    scope |= {
        "server": ("127.0.0.1", 8000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    sent, out = False, {"status": 0, "body": b""}

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out["status"], out["body"]


def edge_cases(run: str, rounds: int, reps: int) -> dict[str, dict]:
    """The ``edge_*`` figures (module docstring): median us per request over ``rounds`` of ``reps``,
    framework route then direct route in each round."""
    import asyncio

    from hstu.config import ServeConfig
    from hstu.model.checkpoint import read_json
    from hstu.serve.app import ServePolicy, create_app
    from hstu.serve.popularity import popularity_for_run

    rec = Recommender.from_run(run, "cpu")
    pop = popularity_for_run(read_json(Path(run) / "config.json"), rec.idmap)
    app = create_app(ServeConfig(), rec, policy=ServePolicy(warmup=False, model_process=False), popularity=pop)
    history = [{"item_id": 10**9 + i, "timestamp": 978300000 + i} for i in range(100)]  # unknown ids: dropped, cold start
    bodies = {
        "edge_cold_start": (orjson.dumps({"history": history, "k": 5}), 200),
        "edge_invalid": (orjson.dumps({"history": history, "k": "five"}), 422),
    }
    routes = dict(app.state.direct_routes)

    async def timed(body: bytes) -> tuple[float, tuple[int, bytes]]:
        t0 = time.perf_counter()
        for _ in range(reps):
            got = await _asgi_post(app, "/v1/generate", body)
        return (time.perf_counter() - t0) / reps * 1e6, got

    async def run_all() -> dict[str, dict]:
        svc = app.state.service
        await svc.start()
        times = {name: ([], []) for name in bodies}
        try:
            for _ in range(rounds):
                for name, (body, status) in bodies.items():
                    app.state.direct_routes.clear()
                    t_old, old = await timed(body)
                    app.state.direct_routes.update(routes)
                    t_new, new = await timed(body)
                    a, b = orjson.loads(old[1]), orjson.loads(new[1])
                    a.pop("latency_ms", None), b.pop("latency_ms", None)
                    assert old[0] == new[0] == status and a == b, (old, new)
                    times[name][0].append(t_old)
                    times[name][1].append(t_new)
        finally:
            await svc.stop()
        return times

    times = asyncio.run(run_all())
    out = {}
    for name, (old, new) in times.items():
        o, n = statistics.median(old), statistics.median(new)
        out[name] = {"framework_us": round(o, 1), "direct_us": round(n, 1), "ratio": round(o / n, 2)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory (its id map and titles describe the items)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    for flag, value in (("--batch", args.batch), ("--k", args.k), ("--rounds", args.rounds), ("--reps", args.reps)):
        if value < 1:
            p.error(f"{flag}: must be >= 1, got {value}")
    if not (Path(args.run) / "config.json").is_file():
        p.error(f"--run {args.run}: not a run directory (no config.json there); give the directory `hstu train` wrote")
    import torch

    torch.set_num_threads(1)
    load_start = os.getloadavg()
    rec = Recommender.mapping_only(args.run)
    jobs, ranked = _batch(rec.model.cfg.num_items, args.batch, args.k, 0)
    seconds, memory = 0.0123, (1 << 33, 1 << 34)
    dumps, loads = (lambda o: bytes(ForkingPickler.dumps(o))), ForkingPickler.loads

    def old_model() -> bytes:  # describe in the model process, pickle the dict lists
        return dumps(("ok", BatchOutcome([rec.describe_ranked(r) for r in ranked], seconds, memory)))

    def new_model() -> bytes:
        return pack_answer(BatchOutcome(ranked, seconds, memory))

    old_answer, new_answer = old_model(), new_model()
    old_call, new_call = dumps(("execute", (50, jobs))), pack_jobs(50, jobs)
    cases = {
        "call_encode": (lambda: dumps(("execute", (50, jobs))), lambda: pack_jobs(50, jobs)),
        "call_decode": (lambda: loads(old_call), lambda: unpack_jobs(new_call)),
        "answer_model": (old_model, new_model),
        "answer_serving": (lambda: loads(old_answer), lambda: [rec.describe_ranked(r) for r in unpack_answer(new_answer).results]),
    }
    cases["request"] = _request_case(rec)
    body = {"user_id": 7, "items": rec.describe_ranked(ranked[0]), "bucket": 50, "latency_ms": 3.2, "history_length": 44, "warnings": []}
    cases["response"] = (lambda: json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(), lambda: orjson.dumps(body))
    assert loads(old_answer)[1].results == [rec.describe_ranked(r) for r in unpack_answer(new_answer).results]
    times: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in cases}
    for _ in range(args.rounds):
        for name, (old, new) in cases.items():
            times[name][0].append(_us(old, args.reps))
            times[name][1].append(_us(new, args.reps))
    out = {
        "command": "benchmarks/serve_wire.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "batch": args.batch,
        "k": args.k,
        "bytes": {"call_pickle": len(old_call), "call_packed": len(new_call)}
        | {"answer_pickle": len(old_answer), "answer_packed": len(new_answer)},
        "load_avg_start": load_start,
    }
    for name, (old, new) in times.items():
        o, n = statistics.median(old), statistics.median(new)
        out[name] = {"before_us": round(o, 1), "now_us": round(n, 1), "ratio": round(o / n, 2)}
    out |= edge_cases(args.run, args.rounds, max(1, args.reps // 3))  # whole requests: a third of the reps
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
