"""Serving in layers (issue 18, target shape 6): app → service → executor, the executor contract
declared once, and model processes that start and stop in the app's lifespan, never when the app
is built.

Expected values come from outside the code under test: the members the batcher and the service
use are read from their source text (every ``self.model.<name>``), and model processes are
counted by the operating system (psutil, the children spawned by this process).
"""

from __future__ import annotations

import ast
import inspect
import os
import re
from pathlib import Path

import httpx
import psutil
import pytest
from serving import BUCKETS, LiveServer, post

from hstu.config import ServeConfig
from hstu.ops._common import model_processes
from hstu.serve import batcher as batcher_mod
from hstu.serve import service as service_mod
from hstu.serve.app import ServePolicy, create_app
from hstu.serve.executor import Executor, LocalModel
from hstu.serve.worker import ProcessModel, WorkerSpec

SERVE = Path(service_mod.__file__).parent
BODY = {"history": [{"item_id": 1, "timestamp": 978300760}, {"item_id": 48, "timestamp": 978300761}], "k": 3}


def _declared(proto: type) -> set[str]:
    """Members a Protocol class declares: its annotations and the functions / properties in its body."""
    names = set(proto.__annotations__)
    names |= {n for n, v in vars(proto).items() if inspect.isfunction(v) or isinstance(v, property)}
    return {n for n in names if not n.startswith("_")}


def _used_on_model(module) -> set[str]:
    """Every ``self.model.<name>`` in a module's source (what it uses of its executor)."""
    return set(re.findall(r"self\.model\.(\w+)", inspect.getsource(module)))


def test_the_executor_protocol_declares_everything_the_batcher_and_the_service_use() -> None:
    declared = _declared(Executor)
    used = _used_on_model(batcher_mod) | _used_on_model(service_mod)
    assert {"buckets", "warm", "available", "costs", "cost_model", "slots", "run", "warmup", "close"} <= used  # the source is read
    assert used <= declared, f"used but not declared in Executor: {sorted(used - declared)}"
    hints = inspect.signature(batcher_mod.MicroBatcher.__init__).parameters["model"].annotation
    assert hints in ("Executor", Executor)  # the batcher is typed against the contract, not a union of classes


def test_local_and_process_executors_implement_the_protocol(rec, run_dir) -> None:
    from hstu.serve.runner import BatchRunner

    local = LocalModel(BatchRunner(rec, BUCKETS, 4), None)
    procs = ProcessModel(WorkerSpec(str(run_dir), buckets=tuple(BUCKETS), max_batch=4, threads=1), start=False)
    try:
        for ex in (local, procs):
            assert isinstance(ex, Executor)
            for name in _declared(Executor):
                proto_member = getattr(Executor, name, None)
                if inspect.isfunction(proto_member):  # same kind of call: coroutine or plain, same parameters
                    impl = getattr(type(ex), name)
                    assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(proto_member), (type(ex), name)
                    want = list(inspect.signature(proto_member).parameters)
                    assert list(inspect.signature(impl).parameters)[: len(want)] == want, (type(ex), name)
                else:
                    assert hasattr(ex, name), (type(ex), name)
        assert procs.available == 0 and procs.buckets == BUCKETS and procs.channels == []  # built, not started
    finally:
        local.close()
        procs.close()


def test_warm_up_names_how_the_graphs_run(run_dir) -> None:
    """A model process's description is made before warm-up loads or compiles any graph, so the
    warm-up's answer carries it again (graphs counted): /readyz "generation" and the serving log
    say how many graphs loaded from the cache and how many run eager."""
    import asyncio

    from hstu.serve.admission import BucketCost

    cost = BucketCost(1e-3, 1e-4, 1e-4, 1e-5, 1e-3, 1e-4)
    said = "engine, graphs from the run's graph cache (eager where it has none): 2 eager, 58 loaded"

    class Channel:  # the two processes answer the warm-up op as worker._worker_warmup does
        async def call(self, op, edge):
            assert op == "warmup"
            return 0.5, (1e-3, 1e-4), cost, said

    procs = ProcessModel(WorkerSpec(str(run_dir), buckets=tuple(BUCKETS), workers=2), start=False)
    procs.channels, procs.up = [Channel(), Channel()], {0, 1}
    asyncio.run(procs.warmup(BUCKETS[0]))
    assert procs.backend_name == said + " (2 model processes)" and procs.warm == {BUCKETS[0]}


def test_building_an_app_with_model_processes_starts_none_until_its_lifespan(rec, run_dir) -> None:
    """create_app(model_process=True) spawns nothing (the OS sees no new child); the lifespan's
    start-up starts the two model processes, its shutdown stops them."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in model_processes(me)}
    policy = ServePolicy(model_process=True, threads=1, model_workers=2)
    app = create_app(ServeConfig(buckets=BUCKETS, max_wait_ms=2), rec, run_dir=str(run_dir), policy=policy)
    svc = app.state.service
    assert {p.pid for p in model_processes(me)} == before
    assert svc.model.available == 0 and svc.batcher is None
    with LiveServer(app) as s:
        started = {p.pid for p in model_processes(me)} - before
        assert started == {svc.model.pid(0), svc.model.pid(1)}
        assert post(s.url, "/v1/generate", BODY).status_code == 200
        assert httpx.get(s.url + "/readyz").json()["generation"].endswith("(2 model processes)")
    for pid in started:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert {p.pid for p in model_processes(me)} == before


def test_model_process_settings_are_checked_when_the_app_is_built(rec, run_dir) -> None:
    """A bucket past the model's max_seq_len (50) is refused by create_app itself, before any model
    process could say so; so is model_process without a run directory."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in model_processes(me)}
    with pytest.raises(ValueError, match=r"bucket 100 exceeds the model's max_seq_len=50"):
        create_app(ServeConfig(buckets=[10, 100]), rec, run_dir=str(run_dir), policy=ServePolicy(model_process=True))
    with pytest.raises(ValueError, match="needs run_dir"):
        create_app(ServeConfig(buckets=BUCKETS), rec, policy=ServePolicy(model_process=True))
    assert {p.pid for p in model_processes(me)} == before


def _functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (f"{path.name}:{n.name}", n.end_lineno - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def test_serve_modules_are_layered_and_small() -> None:
    """Routes, error handlers and middleware in app.py; no serve module over 500 lines, no function
    over 80 (counted from the source, decorators excluded)."""
    for path in sorted(SERVE.glob("*.py")):
        assert len(path.read_text().splitlines()) <= 500, path.name
        long = [(name, n) for name, n in _functions(path) if n > 80]
        assert not long, long
    app_src = (SERVE / "app.py").read_text()
    for below in ("class Service", "class EdgeMiddleware", "def read_body", "ProcessModel", "MicroBatcher("):
        assert below not in app_src, below
