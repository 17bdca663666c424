"""Admission control and model-process start-up (issue 22, faults 1 and 9).

The prediction is checked against numbers derived by hand from the cost table of
:mod:`hstu.serve.admission`; the service tests run the real app (uvicorn on 127.0.0.1 port 0, httpx)
over the tiny trained run of ``test_serve``, with a real BatchRunner. Slowness is injected by a
LocalModel whose batches take 0.5 s longer (a busy machine), and model processes are killed for real
(SIGKILL by pid). No assert is on a time.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
from conftest import REPO
from prometheus_client.parser import text_string_to_metric_families
from serving import BUCKETS, LiveServer, gather, metrics, post

from hstu.config import ServeConfig
from hstu.generate.recommend import Prepared
from hstu.serve import batcher as batcher_mod
from hstu.serve.admission import ALPHA, RATIO_CLIP, SCALE_BOUNDS, WAIT_MIN_S, WAIT_QUANTILE, WAIT_STEP, BucketCost, DelayModel, WorkTally
from hstu.serve.app import ServePolicy, create_app
from hstu.serve.batcher import MicroBatcher, Rejected
from hstu.serve.metrics import REASONS, ServeMetrics
from hstu.serve.runner import DecodeOptions, Job
from hstu.ops._common import model_processes
from hstu.serve.worker import LocalModel, ModelProcessDied, ProcessModel, WorkerSpec

BODY = {"history": [{"item_id": 1, "timestamp": 978300760}, {"item_id": 48, "timestamp": 978300761}], "k": 3}
MS = 1e-3


def _prep(n: int = 3) -> Prepared:
    ids = np.arange(1, n + 1, dtype=np.int64)
    return Prepared(ids, ids * 10, np.zeros(n, np.int64), np.zeros(n, np.int64), int(n * 10), [], [])


def _gen(k: int, strategy: str = "greedy", beam_width: int = 4) -> Job:
    return Job("generate", _prep(), k=k, decoding=DecodeOptions(strategy, beam_width=beam_width))


def _score() -> Job:
    return Job("score", _prep(), candidates=np.array([1, 2]))


# Hand-derived, bucket 20, M = 4 (F 2, F_k 0.5, R 1, R_k 0.1, S 3, S_r 0.25 ms):
#   greedy k 2,2,3,5,5: K 5, ceil(5/4) = 2 calls of 2 + 0.5*5 = 4.5, + 5 rows of 1 + 0.1*5 = 1.5  -> 16.5
#   beam W 2 k 4 x2:    u = 4 // 2 = 2 users a call: 1 call of 4, + 2*1, + 2*2*4*0.1 = 1.6        ->  7.6
#   beam W 4 k 3 x1:    1 call of 3.5, + 1, + 4*3*0.1 = 1.2                                        ->  5.7
#   top-k k 3 x2:       each alone: 2 + 1 + (0.5 + 0.1)*3 = 4.8                                     ->  9.6
#   score x3:           ceil(3/4) = 1 call of 3, + 3*0.25                                          ->  3.75
# bucket 10 (F 1, R 0.5, the rest 0): greedy k 1 x1                                                ->  1.5
COST20 = BucketCost(fixed=2 * MS, fixed_step=0.5 * MS, row=1 * MS, row_step=0.1 * MS, score_fixed=3 * MS, score_row=0.25 * MS)
COST10 = BucketCost(fixed=1 * MS, fixed_step=0.0, row=0.5 * MS, row_step=0.0, score_fixed=0.0, score_row=0.0)
GEN20_MS, SCORE20_MS, GEN10_MS = 16.5 + 7.6 + 5.7 + 9.6, 3.75, 1.5


def _jobs20() -> list[Job]:
    return (
        [_gen(k) for k in (2, 2, 3, 5, 5)]
        + [_gen(4, "beam", 2) for _ in range(2)]
        + [_gen(3, "beam", 4)]
        + [_gen(3, "topk") for _ in range(2)]
        + [_score() for _ in range(3)]
    )


def test_work_tally_predicts_the_hand_derived_cost() -> None:
    got = WorkTally(_jobs20()).seconds(COST20, max_batch=4)
    assert got["generate"] == pytest.approx(GEN20_MS * MS) and got["score"] == pytest.approx(SCORE20_MS * MS)
    t = WorkTally(_jobs20())
    for j in [_gen(5), _gen(5)]:  # removing the two k-5 greedy jobs: K 3, 1 call of 3.5 + 3 rows of 1.3
        t.remove(j)
    assert t.seconds(COST20, max_batch=4)["generate"] == pytest.approx((3.5 + 3 * 1.3 + 7.6 + 5.7 + 9.6) * MS)
    assert not WorkTally().seconds(COST20, 4)["generate"] and not WorkTally().seconds(COST20, 4)["score"]


def test_delay_model_learns_bounded_ratios() -> None:
    d = DelayModel(4, {20: COST20})
    pred = {"generate": 0.010, "score": 0.0}
    assert d.learn(20, pred, 0.040) == pytest.approx(4.0)  # measured 4x the prediction: the scale moves 4 ** ALPHA
    assert d.scale[(20, "generate")] == pytest.approx(4.0**ALPHA) and (20, "score") not in d.scale
    assert d.learn(20, pred, 100.0) == pytest.approx(8.0)  # one freak batch counts as 8x at most
    for _ in range(200):
        d.learn(20, pred, 100.0)
    assert d.scale[(20, "generate")] == pytest.approx(SCALE_BOUNDS[1])  # and the scale stays bounded
    assert d.learn(20, {"generate": 0.0, "score": 0.0}, 1.0) is None
    d.learn_wait(0.1, 0.2)  # an admitted request waited longer than predicted: up by step x q
    up = math.exp(WAIT_STEP * WAIT_QUANTILE)
    assert d.wait_scale == pytest.approx(up)
    d.learn_wait(0.1, 0.05)  # one waited less: down by step x (1 - q)
    assert d.wait_scale == pytest.approx(up * math.exp(-WAIT_STEP * (1 - WAIT_QUANTILE)))
    before = d.wait_scale
    d.learn_wait(WAIT_MIN_S / 2, 10.0)  # too short a prediction to teach anything
    assert d.wait_scale == before


class _FakeModel:
    """Only what the batcher reads of an executor; its dispatcher is never started, so jobs stay queued."""

    def __init__(self) -> None:
        self.buckets, self.warm = [10, 20], {10, 20}
        self.slots = self.available = 1
        self.costs: dict = {}
        self.cost_model = {10: COST10, 20: COST20}


async def _queue(b: MicroBatcher, bucket: int, job: Job, waited_s: float = 0.0) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(b.submit(bucket, job, waited_s))
    await asyncio.sleep(0)  # runs submit up to its wait
    return task


def test_predicted_delay_is_the_queued_work_and_the_running_rest() -> None:
    """MicroBatcher.predicted_delay over queued jobs in two buckets, with a learnt scale, a batch that
    runs past its prediction, and two live workers; a request over the bound is refused (429) and the
    batcher says it is shedding."""

    async def main() -> None:
        model = _FakeModel()
        b = MicroBatcher(
            model, ServeMetrics(model.buckets), max_batch=4, max_wait_ms=0, max_queue=64, request_timeout_s=30, max_queue_delay_s=0.1
        )
        assert b.predicted_delay() == 0.0
        tasks = [await _queue(b, 20, j) for j in _jobs20()] + [await _queue(b, 10, _gen(1))]
        assert b.predicted_delay() == pytest.approx((GEN20_MS + SCORE20_MS + GEN10_MS) * MS)
        b.delay.scale[(20, "generate")] = 2.0
        want = (2 * GEN20_MS + SCORE20_MS + GEN10_MS) * MS  # 84.05 ms
        assert b.predicted_delay() == pytest.approx(want)
        b._executing[1] = (time.monotonic() + 1e6, 0.02)  # a batch that has (as good as) not started: all of it
        assert b.predicted_delay() > want + 1e6
        b._executing[1] = (time.monotonic() - 10.0, 0.5)  # 10 s into a 0.5 s prediction: nothing left, but the
        assert b.predicted_delay() == pytest.approx(want * RATIO_CLIP[1])  # queued work is priced by its overrun (<= 8x)
        del b._executing[1]
        model.available = 2
        assert b.predicted_delay() == pytest.approx(want / 2)
        model.available = 1
        assert not b.shedding
        b.max_delay = 0.080
        with pytest.raises(Rejected) as exc:
            await b.submit(20, _gen(1))
        assert exc.value.status == 429 and "predicted queueing delay 0.084 s exceeds 0.08 s" in exc.value.message
        assert exc.value.retry_after == 1 and b.shedding
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_time_already_spent_counts_against_the_bound() -> None:
    """A request that spent 50 ms in the server before submit (reading, validating: the HTTP side is
    the bottleneck under overload) is refused when 50 ms + its predicted 84.05 ms of queueing exceed a
    100 ms bound, and admitted without that time; an idle server admits whatever was spent; the early
    check (no body read) refuses by the same prediction and nothing when idle."""

    async def main() -> None:
        model = _FakeModel()
        b = MicroBatcher(
            model, ServeMetrics(model.buckets), max_batch=4, max_wait_ms=0, max_queue=64, request_timeout_s=30, max_queue_delay_s=0.1
        )
        idle_task = await _queue(b, 20, _gen(1), waited_s=5.0)  # idle: admitted although 5 s > the bound
        assert not idle_task.done() and b.reject_early() is None
        idle_task.cancel()
        b.queues[20].clear()
        b.tallies[20] = WorkTally()
        tasks = [await _queue(b, 20, j) for j in _jobs20()] + [await _queue(b, 10, _gen(1))]
        b.delay.scale[(20, "generate")] = 2.0  # queued: 84.05 ms (the test above)
        assert all(not t.done() for t in tasks) and b.reject_early() is None  # 84 ms <= 100 ms
        with pytest.raises(Rejected) as exc:
            await b.submit(20, _gen(1), waited_s=0.050)
        assert exc.value.status == 429 and "0.084 s after 0.050 s already spent in the server exceeds 0.1 s" in exc.value.message
        ok = await _queue(b, 20, _gen(1), waited_s=0.010)  # 10 + 84.05 <= 100: admitted
        assert not ok.done()
        b.tallies[20].remove(b.queues[20].pop())  # that one is dropped again: 84.05 ms queued
        b.loop_lag_s = 0.004  # twice 4 ms of event-loop lag reserved: 10 + 84.05 + 8 > 100
        with pytest.raises(Rejected) as exc:
            await b.submit(20, _gen(1), waited_s=0.010)
        assert "(+ 0.008 s of event-loop lag)" in exc.value.message
        b.loop_lag_s = 0.0
        b.max_delay = 0.080
        early = b.reject_early()
        assert isinstance(early, Rejected) and early.status == 429 and "predicted queueing delay" in early.message
        for t in tasks + [ok]:
            t.cancel()
        await asyncio.gather(*tasks, ok, return_exceptions=True)

    asyncio.run(main())


def _rejected(m: ServeMetrics) -> dict[str, float]:
    """hstu_serve_rejected_requests_total by reason, parsed from the exposition text."""
    return {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(m.exposition()[0].decode())
        for s in fam.samples
        if s.name == "hstu_serve_rejected_requests_total"
    }


def test_a_full_queue_and_a_predicted_delay_are_two_429s() -> None:
    """The two causes of a 429 have their own error type and metric reason: ``queue_full`` when the
    bucket holds ``max_queue`` requests, ``queue_delay`` when the predicted queueing delay is over the
    bound (the early refusal too); they were both ``queue_full``."""

    async def main() -> None:
        model = _FakeModel()
        m = ServeMetrics(model.buckets)
        b = MicroBatcher(model, m, max_batch=4, max_wait_ms=0, max_queue=1, request_timeout_s=30, max_queue_delay_s=1.0)
        first = await _queue(b, 10, _gen(1))  # admitted: empty queue
        with pytest.raises(Rejected) as full:
            await b.submit(10, _gen(1))
        assert (full.value.status, full.value.reason) == (429, "queue_full")
        assert full.value.message == "overloaded: bucket 10 queue is full (1 waiting); retry later"
        b.max_delay = 0.001  # bucket 20 has room, but the 1.5 ms queued in bucket 10 is over the bound
        with pytest.raises(Rejected) as late:
            await b.submit(20, _gen(1))
        assert (late.value.status, late.value.reason) == (429, "queue_delay")
        assert late.value.message == "overloaded: predicted queueing delay 0.002 s exceeds 0.001 s; retry later"
        early = b.reject_early()
        assert (early.status, early.reason) == (429, "queue_delay")
        got = _rejected(m)
        assert (got["queue_full"], got["queue_delay"]) == (1, 2) and set(got) == set(REASONS)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)

    asyncio.run(main())


def test_edge_refuses_before_reading_the_body(rec) -> None:  # noqa: F811
    """While admission refuses every request, the HTTP edge answers 429 before the body is read: a
    body that is not even JSON gets 429 (Retry-After) instead of 422; GET and the probes are untouched,
    and once the prediction admits again the same body gets its 422."""
    app = _app(rec, delay_ms=100)
    with LiveServer(app) as s:
        b = s.app.state.service.batcher
        b.executing += 1  # a batch running, predicted to take 10 s more: nothing is admitted
        b._executing[1] = (time.monotonic(), 10.0)
        with httpx.Client(base_url=s.url) as c:
            r = c.post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 429 and r.json()["error"]["type"] == "queue_delay" and int(r.headers["retry-after"]) >= 1
            assert c.post("/v1/score", content=b"[]").status_code == 429
            assert c.get("/v1/generate").status_code == 405 and c.get("/healthz").status_code == 200
            del b._executing[1]
            b.executing -= 1
            assert c.post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422


def _app(rec, *, delay_ms: float, **cfg):  # noqa: F811 - rec is the fixture's value
    policy = ServePolicy(max_queue_delay_ms=delay_ms)
    return create_app(ServeConfig(**{"buckets": BUCKETS, **cfg}), rec, policy=policy)


def test_empty_queue_always_admits(rec) -> None:  # noqa: F811
    """A bound below any batch's cost (10 us) and the learnt scales at their maximum: one request at a
    time still gets 200 every time (the old predictor refused all: 'predicted queueing delay 0.01 s')."""
    with LiveServer(_app(rec, delay_ms=0.01)) as s:
        b = s.app.state.service.batcher
        for e in BUCKETS:
            for kind in ("generate", "score"):
                b.delay.scale[(e, kind)] = SCALE_BOUNDS[1]
        for _ in range(4):
            assert post(s.url, "/v1/generate", BODY).status_code == 200
            r = post(s.url, "/v1/score", {"history": BODY["history"], "candidates": [1, 2]})
            assert r.status_code == 200, r.text


class _SlowModel(LocalModel):
    """A LocalModel over the same real runner whose batches take ``extra_s`` longer while ``slow`` (a busy machine)."""

    def __init__(self, local: LocalModel, extra_s: float) -> None:
        super().__init__(local.runner, local.guard)
        self.extra_s, self.slow = extra_s, True

    async def run(self, edge, jobs):
        out = await super().run(edge, jobs)
        if self.slow:
            await asyncio.sleep(self.extra_s)
            out.seconds += self.extra_s
        return out


def test_slow_batches_then_idle_admits_and_the_scale_learns(rec) -> None:  # noqa: F811
    """Batches 0.5 s slower than warm-up measured, a 100 ms bound: each finished batch raises the learnt
    scale; once the queue is empty a normal request is admitted again, slow or not (the old running
    mean locked the server out after the first slow batch: every request 429 while idle)."""
    app = _app(rec, delay_ms=100)
    svc = app.state.service
    svc.model = slow = _SlowModel(svc.model, 0.5)
    with LiveServer(app) as s:
        codes = [post(s.url, "/v1/generate", BODY).status_code for _ in range(3)]
        assert codes == [200] * 3
        scale = metrics(s.url)[("hstu_serve_batch_cost_scale", (("bucket", "10"), ("kind", "generate")))]
        assert scale > 1.0 and scale == svc.batcher.delay.scale[(10, "generate")]
        resp = gather(s.url, "/v1/generate", [BODY] * 6)  # a burst while slow
        assert {r.status_code for r in resp} <= {200, 429} and 200 in {r.status_code for r in resp}
        deadline = time.monotonic() + 30
        while (svc.batcher.depth() or svc.batcher.executing) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert post(s.url, "/v1/generate", BODY).status_code == 200  # still slow, but idle: admitted
        learnt = svc.batcher.delay.scale[(10, "generate")]
        assert learnt > scale  # every slow batch raised it further
        slow.slow = False
        assert [post(s.url, "/v1/generate", BODY).status_code for _ in range(3)] == [200] * 3
        assert svc.batcher.delay.scale[(10, "generate")] < learnt  # fast batches pull it back


def test_shedding_makes_readyz_degraded_then_ready(rec, monkeypatch) -> None:  # noqa: F811
    """A burst within one 300 ms batch window and a bound of 10 us: the first request is admitted
    (empty queue), the rest get 429 while it waits; /readyz answers 200 "degraded" naming why, the
    shedding gauge is 1, and once no 429 was given for SHED_WINDOW_S /readyz is "ready" again."""
    monkeypatch.setattr(batcher_mod, "SHED_WINDOW_S", 1.0)
    with LiveServer(_app(rec, delay_ms=0.01, max_wait_ms=300, max_batch=64)) as s:
        assert httpx.get(s.url + "/readyz").json()["status"] == "ready"
        codes = sorted(r.status_code for r in gather(s.url, "/v1/generate", [BODY] * 6))
        assert codes[0] == 200 and 429 in codes, codes
        r = httpx.get(s.url + "/readyz")
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.json()
        assert r.json()["reason"].startswith("shedding load: predicted queueing delay") and r.json()["buckets"] == {
            "10": True,
            "20": True,
            "50": True,
        }
        m = metrics(s.url)
        assert m[("hstu_serve_shedding", ())] == 1 and m[("hstu_serve_queue_delay_limit_seconds", ())] == pytest.approx(1e-5)
        assert m[("hstu_serve_rejected_requests_total", (("reason", "queue_delay"),))] == codes.count(429)
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/readyz").json()["status"] != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert metrics(s.url)[("hstu_serve_shedding", ())] == 0


def test_metrics_publish_the_warm_up_costs_and_the_prediction(rec) -> None:  # noqa: F811
    with LiveServer(_app(rec, delay_ms=1000)) as s:
        svc = s.app.state.service
        m = metrics(s.url)
        assert svc.model.cost_model.keys() == set(BUCKETS)
        for e, cost in svc.model.cost_model.items():
            for term, v in cost.as_dict().items():
                assert m[("hstu_serve_batch_cost_seconds", (("bucket", str(e)), ("term", term)))] == pytest.approx(v)
            assert min(cost.as_dict().values()) >= 0 and cost.fixed + cost.row > 0 and cost.score_fixed + cost.score_row > 0
        assert m[("hstu_serve_predicted_queue_delay_seconds", ())] == 0.0  # idle
        assert m[("hstu_serve_queue_delay_limit_seconds", ())] == pytest.approx(1.0)


def _kill(pid: int) -> None:
    p = psutil.Process(pid)
    p.kill()
    p.wait(30)


def test_model_restart_then_a_normal_request_succeeds(run_dir, rec) -> None:  # noqa: F811
    """kill -9 of the model process; once it is back (/readyz 200), requests are admitted at once,
    even with a bound below any batch's cost (the old predictor refused them)."""
    policy = ServePolicy(model_process=True, threads=1, max_queue_delay_ms=0.01)
    with LiveServer(create_app(ServeConfig(buckets=BUCKETS, max_wait_ms=2), rec, run_dir=str(run_dir), policy=policy)) as s:
        svc = s.app.state.service
        assert post(s.url, "/v1/generate", BODY).status_code == 200
        _kill(svc.model.pid(0))
        deadline = time.monotonic() + 120
        while True:  # 503 model_restart until the new process is up, then 200
            r = post(s.url, "/v1/generate", BODY)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.json()["error"]["type"] == "model_restart", r.text
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert svc.model.restarts == 1
        assert [post(s.url, "/v1/generate", BODY).status_code for _ in range(3)] == [200] * 3
        assert httpx.get(s.url + "/readyz").json()["status"] == "ready"


class _Killer(threading.Thread):
    """Kills the first ``n`` model processes ``parent`` spawns, each as soon as it appears (while it loads)."""

    def __init__(self, parent_pid: int, n: int) -> None:
        super().__init__(daemon=True)
        self.parent, self.n, self.killed = psutil.Process(parent_pid), n, []
        self.stop = threading.Event()

    def run(self) -> None:
        while len(self.killed) < self.n and not self.stop.is_set():
            try:
                for c in model_processes(self.parent):
                    if c.pid not in self.killed and len(self.killed) < self.n:
                        c.kill()
                        self.killed.append(c.pid)
            except psutil.Error:
                return
            time.sleep(0.01)


def test_model_process_killed_while_loading_is_started_again(run_dir) -> None:  # noqa: F811
    """The model process is killed (SIGKILL, by pid) while it loads the run: ProcessModel starts a new
    one and comes up (the old code raised ModelProcessDied out of the constructor)."""
    killer = _Killer(os.getpid(), 1)
    killer.start()
    model = ProcessModel(WorkerSpec(str(run_dir), buckets=tuple(BUCKETS), max_batch=4, threads=1))
    try:
        killer.stop.set()
        assert len(killer.killed) == 1 and model.pid(0) not in killer.killed
        assert model.restarts == 1 and model.available == 1 and model.buckets == BUCKETS
    finally:
        model.close()


def test_model_process_that_keeps_dying_fails_with_one_line(run_dir) -> None:  # noqa: F811
    with pytest.raises(ModelProcessDied, match=r"ended while loading the run 1 time\(s\) \(last: killed by SIGKILL\)"):
        killer = _Killer(os.getpid(), 1)
        killer.start()
        ProcessModel(WorkerSpec(str(run_dir), buckets=tuple(BUCKETS), max_batch=4, threads=1), start_retries=0)


def test_cli_serve_exits_with_one_line_when_the_model_process_keeps_dying(run_dir) -> None:  # noqa: F811
    """`hstu serve`: each model process is killed while it loads (3 = 1 + 2 retries): the server
    never says "listening", exits 1 and prints `hstu serve: error: ...` with no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "hstu.cli", "serve", "--run", str(run_dir), "--port", "0", "--buckets", "10,20,50", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    killer = _Killer(proc.pid, 3)
    killer.start()
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(killer.killed) == 3
    assert proc.returncode == 1 and "listening" not in out and "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("hstu serve: error:")]
    want = (
        "hstu serve: error: the model process ended while loading the run 3 time(s) (last: killed by SIGKILL); "
        "see the log above for why (memory? a killed process?)"
    )
    assert errors == [want], err


class _SlowWarmup(LocalModel):
    """A LocalModel over the same real runner whose bucket warm-ups wait until ``release`` is set."""

    def __init__(self, local: LocalModel) -> None:
        super().__init__(local.runner, local.guard)
        self.release = threading.Event()

    async def warmup(self, edge):
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 60)
        return await super().warmup(edge)


def test_requests_while_warming_get_503_at_once(rec) -> None:  # noqa: F811
    """While a bucket warms (/readyz 503 'warming'), a request for it is answered 503 'warming' with a
    Retry-After at once (it waited behind the warm-up until its 10 s timeout, or got a 429 for a
    predicted delay); once warm, the same request is served."""
    app = _app(rec, delay_ms=1000)
    svc = app.state.service
    svc.model = slow = _SlowWarmup(svc.model)
    with LiveServer(app, wait_ready=False) as s:
        assert httpx.get(s.url + "/readyz").json()["status"] == "warming"
        r = post(s.url, "/v1/generate", BODY)
        assert r.status_code == 503 and r.json()["error"]["type"] == "warming" and int(r.headers["retry-after"]) >= 1
        assert metrics(s.url)[("hstu_serve_rejected_requests_total", (("reason", "warming"),))] == 1
        slow.release.set()
        deadline = time.monotonic() + 60
        while httpx.get(s.url + "/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert post(s.url, "/v1/generate", BODY).status_code == 200


def test_every_labelled_series_exists_at_zero_from_the_start() -> None:
    """A trial's finding: a fresh server's /metrics had only `# TYPE` lines for the batch durations and the prefix-cache
    lookups, so rate() and alert rules saw no series until the first batch / lookup."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hstu.serve.metrics import ServeMetrics

    m = ServeMetrics([20, 50])
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(generate_latest(m.registry).decode())
        for s in f.samples
    }
    for b in ("20", "50"):
        assert samples[("hstu_serve_batch_duration_seconds_count", (("bucket", b),))] == 0.0
    for result in ("hit", "miss"):
        assert samples[("hstu_serve_prefix_cache_lookups_total", (("result", result),))] == 0.0
