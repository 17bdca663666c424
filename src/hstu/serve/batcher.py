"""Micro-batcher: one bounded queue per length bucket, one dispatcher, one batch at a time.

Per bucket (edge E), requests whose history has <= E events (and > the previous edge) wait in
that bucket's queue. A single dispatcher forms batches for the model executor
(:class:`hstu.serve.executor.Executor`: a model thread of this process, or model processes), each
model worker running one batch at a time since one process drives one device:

1. Window: the oldest waiting request may wait up to ``max_wait_ms`` for companions, unless
   ``max_batch`` requests already wait (LitServe's fill-to-size-or-deadline habit). While a
   batch runs, the next one fills, so under load batches grow by themselves (vLLM-style: the
   scheduler takes what has arrived whenever the executor is free).
2. Plan (:func:`plan_batch`): the batch runs at one bucket's static shape. It starts from the
   largest bucket with waiting requests and takes in the smaller buckets' requests, oldest
   first, while that costs less than running them as a batch of their own, by the cost line
   (fixed + per request) that warm-up measured per bucket; if the oldest request of all would
   not be in that batch, its own bucket's batch runs instead (no starvation). Without costs
   (warm-up off) buckets never mix. Which jobs fill it (:func:`pick_fair`): at most ``max_batch``
   rows (a beam-W request counts W), narrow jobs before wide ones unless a job has waited
   ``aging_ms`` (then oldest first), so a burst of beam requests or long histories never starves
   short greedy ones, and no job waits past the aging bound plus the aged jobs ahead of it. Measured on the 2-core box (small ML-1M model, next-5): a
   call costs ~5 ms fixed at any bucket, ~0.2 ms per request at 20 events and ~2 ms at 200, so
   a few short requests ride along with long ones nearly free, while 16 short ones keep their
   own batch.

Backpressure: a request is refused at once, never queued, when its bucket already holds
``max_queue`` waiting requests, or when its predicted queueing delay, plus the time it already spent
in the server (reading, validating) and twice the event loop's recent lag (in and out), exceeds
``max_queue_delay_s`` (default: the request timeout): :class:`Rejected` 429 with a Retry-After in
seconds, reason "queue_full" or "queue_delay"; :meth:`MicroBatcher.reject_early` lets the HTTP edge refuse before the body is read. The delay is
predicted from the work actually queued, per bucket and per runner group (a beam-16 job costs ~16
rows), plus what is left of the running batches, with per-bucket costs measured at warm-up and
corrected by every finished batch (:mod:`hstu.serve.admission`); an empty queue with no batch
running always admits, so no stale estimate can lock the service out. While 429s for load were
given in the last ``SHED_WINDOW_S`` seconds, :attr:`MicroBatcher.shedding` is true (``/readyz``
says "degraded"). A queued request that is not answered within ``request_timeout_s`` gets
503 and is skipped if its batch has not started. Before each batch the memory guard checks free
memory (device, or host on CPU): below the threshold it releases caches; if memory is still low
the whole batch is shed with 503 (reason "memory") and the process keeps running.

Shutdown: :meth:`MicroBatcher.drain` refuses new requests (503 "draining"), lets the queued
ones finish, then stops the dispatcher and the model executor.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from typing import Any

from hstu.serve.admission import RATIO_CLIP, DelayModel, WorkTally
from hstu.serve.metrics import ServeMetrics
from hstu.serve.runner import Job
from hstu.serve.executor import BatchOutcome, Executor, ModelRestart

log = logging.getLogger(__name__)

SHED_WINDOW_S = 5.0  # "shedding" (/readyz degraded) for this long after the last 429 for load
LAG_PERIOD_S = 0.02  # the event-loop lag probe sleeps this long and measures its oversleep
FAIR_AGING_MS = 50.0  # pick_fair: a job waiting this long goes before narrower, younger ones (half a 100 ms P99 goal)
LAG_DECAY = 0.99  # per probe: the lag estimate is a peak that halves in ~1.4 s of a lag-free loop


class Rejected(Exception):
    """A request the service will not (or can no longer) answer with a result.

    ``status`` 429 or 503, ``reason`` one of :data:`hstu.serve.metrics.REASONS`, ``retry_after``
    whole seconds (>= 1) for the Retry-After header.
    """

    def __init__(self, status: int, reason: str, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, max(1, int(retry_after))


def plan_batch(waiting: dict[int, int], oldest: int, max_batch: int, costs: dict[int, tuple[float, float]]) -> tuple[int, dict[int, int]]:
    """Which waiting requests form the next batch, and at which bucket it runs.

    Args:
        waiting: bucket edge -> requests waiting there (> 0 for at least one edge).
        oldest: the edge of the bucket holding the oldest waiting request.
        max_batch: the most requests in one batch.
        costs: edge -> (fixed s, s per request) of a batch at that edge; an edge missing here
            never takes in other buckets' requests.
    Returns:
        (edge the batch runs at, {edge: how many of its oldest requests to take}).
    """

    def take_into(edge: int) -> dict[int, int]:
        take = {edge: min(max_batch, waiting[edge])}
        room = max_batch - take[edge]
        if edge not in costs:
            return take
        per_row = costs[edge][1]
        for e in sorted((e for e in waiting if e < edge and waiting[e]), reverse=True):
            n = min(room, waiting[e])
            fixed_e, per_row_e = costs.get(e, (0.0, 0.0))
            if n and per_row * n < fixed_e + per_row_e * n:  # riding along is cheaper than a batch of their own
                take[e] = n
                room -= n
        return take

    top = max(e for e, n in waiting.items() if n)
    plan = take_into(top)
    if oldest in plan:
        return top, plan
    return oldest, take_into(oldest)


def job_rows(job: Job) -> int:
    """Rows ``job`` takes in a batch: a beam job its beam width (the engine holds W rows per user),
    any other job 1."""
    d = job.decoding
    return max(1, int(d.beam_width)) if job.kind == "generate" and d.strategy == "beam" else 1


def fair_key(job: Job, now: float, aging_s: float) -> tuple[int, int, float]:
    """Priority of a queued job (smaller first) under the fair policy (:func:`pick_fair`): a job
    that has waited ``aging_s`` or longer goes first, oldest first; below that age, fewer rows first,
    then oldest first. ``now`` and ``job.enqueued_at`` on the event loop's clock (s)."""
    if now - job.enqueued_at >= aging_s:
        return (0, 0, job.enqueued_at)
    return (1, job_rows(job), job.enqueued_at)


def pick_fair(queues: dict[int, deque], take: dict[int, int], rows: int, now: float, aging_s: float) -> list[tuple[int, Job]]:
    """The jobs of the next batch, removed from ``queues`` (the others keep their order).

    Policy (fair batching under mixed traffic): a batch holds at most ``rows`` rows
    (:func:`job_rows`: a beam-W request counts W), and at most ``take[e]`` jobs of bucket ``e``
    (:func:`plan_batch`). Candidates from the buckets in ``take`` are taken in :func:`fair_key`
    order, first fit: a job wider than the room left is passed over (it keeps its place and age)
    and narrower ones fill the room; the first job is taken whatever its width (a beam wider than
    ``rows`` runs alone). So a short greedy request never waits behind a burst of beam requests
    younger than ``aging_s``; a passed-over job is at most ``aging_s`` from going first, and then
    waits only for the aged jobs older than itself (no starvation either way).

    Args:
        queues: bucket edge -> waiting jobs, oldest first (``enqueued_at`` set).
        take: bucket edge -> the most jobs to take from it.
        rows: the batch's row budget (>= 1; the batcher's ``max_batch``).
        now: the current time on the clock of ``enqueued_at`` (s). aging_s: the aging bound (s, >= 0).
    Returns:
        [(edge, job), ...] in the order taken.
    """
    cands = sorted(((fair_key(j, now, aging_s), e, i) for e in take for i, j in enumerate(queues[e])), key=lambda c: c[0])
    room, left, chosen = rows, dict(take), []
    for _, e, i in cands:
        job = queues[e][i]
        r = job_rows(job)
        if left[e] > 0 and (r <= room or not chosen):
            chosen.append((e, i))
            room, left[e] = room - r, left[e] - 1
        if room <= 0 or not any(left.values()):
            break
    picked = [(e, queues[e][i]) for e, i in chosen]
    for e in take:
        gone = {i for ce, i in chosen if ce == e}
        if gone:
            kept = [j for i, j in enumerate(queues[e]) if i not in gone]
            queues[e].clear()
            queues[e].extend(kept)
    return picked


class MicroBatcher:
    """Queues and collectors in front of one model executor.

    Args:
        model: the :class:`~hstu.serve.executor.Executor`, started (a
            :class:`~hstu.serve.executor.LocalModel` or :class:`~hstu.serve.worker.ProcessModel`:
            runs a batch with its memory guard, warms buckets).
        metrics: where queue depth, batch size / duration and rejections are recorded.
        max_batch: requests per batch (>= 1). max_wait_ms: deadline from the oldest request (>= 0).
        max_queue: waiting requests per bucket before 429 (>= 1).
        request_timeout_s: time a request may wait for its result before 503 (> 0).
        max_queue_delay_s: refuse (429) when the predicted queueing delay is longer (> 0;
            default ``request_timeout_s``).
        aging_ms: fair batching's aging bound (:func:`pick_fair`; >= 0; 0 = oldest first, rows
            still budgeted).

    Raises:
        ValueError: a setting out of range (the message names it).

    Create and use it inside a running event loop (the app's lifespan does).
    """

    def __init__(
        self,
        model: Executor,
        metrics: ServeMetrics,
        *,
        max_batch: int,
        max_wait_ms: float,
        max_queue: int,
        request_timeout_s: float,
        max_queue_delay_s: float | None = None,
        aging_ms: float = FAIR_AGING_MS,
    ) -> None:
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1)):
            if int(value) < low:
                raise ValueError(f"{name} must be >= {low}, got {value!r}")
        if aging_ms < 0:
            raise ValueError(f"aging_ms must be >= 0, got {aging_ms!r}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
        if max_queue_delay_s is not None and max_queue_delay_s <= 0:
            raise ValueError(f"max_queue_delay_s must be > 0, got {max_queue_delay_s!r}")
        self.model, self.metrics = model, metrics
        self.max_batch, self.max_wait = int(max_batch), float(max_wait_ms) / 1000.0
        self.max_queue, self.timeout = int(max_queue), float(request_timeout_s)
        self.aging_s = float(aging_ms) / 1000.0  # fair batching's aging bound (pick_fair)
        self.max_delay = float(max_queue_delay_s) if max_queue_delay_s is not None else self.timeout
        self.queues: dict[int, deque] = {e: deque() for e in model.buckets}
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.draining = False
        self.in_flight = 0  # submitted and not yet answered
        self.executing = 0  # batches on the model thread
        self.batch_time_s = 0.01  # running mean of a batch's model time (s), for the memory shed's Retry-After
        self.warmup_error: str | None = None
        self.delay = DelayModel(self.max_batch, model.cost_model)  # costs measured at warm-up, scales learnt per batch
        self.tallies: dict[int, WorkTally] = {e: WorkTally() for e in model.buckets}  # queued work per bucket
        self._executing: dict[int, tuple[float, float]] = {}  # running batch -> (start, predicted s), monotonic clock
        self._admitted: dict[int, float] = {}  # queued job -> the delay predicted when it was admitted (s)
        self.last_shed, self.shed_reason = -math.inf, ""  # the last 429 for load: when, and why
        metrics.predicted_delay.set_function(self.predicted_delay)
        metrics.shedding.set_function(lambda: float(self.shedding))
        metrics.delay_limit.set(self.max_delay)
        self.loop_lag_s = 0.0  # decaying peak of the event loop's lag (s): what a request loses getting in and out
        metrics.loop_lag.set_function(lambda: self.loop_lag_s)

    # ----- lifecycle -----
    def start(self) -> None:
        self._slots = asyncio.Semaphore(self.model.slots)  # batches in flight: one per model worker
        self._running: set[asyncio.Task] = set()
        self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="hstu-batcher")
        self._lag_task = asyncio.get_running_loop().create_task(self._probe_lag(), name="hstu-loop-lag")

    async def _probe_lag(self) -> None:
        """Track the event loop's lag: a request's bytes wait that long before the app sees them and
        its answer that long before it is written, time the queue prediction does not see."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(LAG_PERIOD_S)
            self.loop_lag_s = max(loop.time() - t - LAG_PERIOD_S, self.loop_lag_s * LAG_DECAY)

    async def warmup(self) -> None:
        """Warm every bucket on the model executor (smallest first); sets the readiness metrics."""
        for edge in self.model.buckets:
            try:
                secs = await self.model.warmup(edge)
            except Exception as exc:  # noqa: BLE001 - the process stays up and /readyz says why
                self.warmup_error = f"bucket {edge}: {exc}"
                log.exception("warm-up of bucket %d failed", edge)
                return
            self.metrics.bucket_warm.labels(bucket=str(edge)).set(1)
            if edge in self.model.cost_model:
                self.metrics.set_cost(edge, self.model.cost_model[edge].as_dict())
            log.info("bucket %d warm (%.2f s)", edge, secs)
        self.metrics.ready.set(1)

    @property
    def ready(self) -> bool:
        return (
            not self.draining and self.warmup_error is None and self.model.available > 0 and all(e in self.model.warm for e in self.queues)
        )

    def depth(self) -> int:
        return sum(len(q) for q in self.queues.values())

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, wait up to ``timeout_s`` for queued and running ones, then stop.
        Returns True when everything finished in time."""
        self.draining = True
        self.metrics.ready.set(0)
        deadline = time.monotonic() + timeout_s
        while (self.in_flight or self.executing) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        done = not (self.in_flight or self.executing)
        if getattr(self, "_lag_task", None) is not None:
            self._lag_task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.model.close()
        if not done:
            log.warning("shutdown: %d request(s) still in flight after %.1f s", self.in_flight, timeout_s)
        return done

    # ----- requests -----
    def predicted_delay(self) -> float:
        """Predicted queueing delay (s) of a request arriving now: the corrected cost of every queued
        job plus what is left of the running batches, over the live model workers; 0 when idle."""
        now = time.monotonic()
        running = sum(max(0.0, pred - (now - t0)) for t0, pred in self._executing.values())
        queued = sum(sum(self.delay.predict(e, t).values()) for e, t in self.tallies.items() if t.groups)
        # a batch running past its prediction is evidence before it ends: the queued work is priced by its overrun
        overrun = max([(now - t0) / pred for t0, pred in self._executing.values() if pred > 0] or [1.0])
        queued *= min(max(1.0, overrun), RATIO_CLIP[1])
        return self.delay.wait_scale * (running + queued) / max(1, self.model.available)

    @property
    def shedding(self) -> bool:
        """True while a request was refused (429) for load in the last ``SHED_WINDOW_S`` seconds."""
        return time.monotonic() - self.last_shed < SHED_WINDOW_S

    def retry_after(self) -> int:
        """Seconds until the queues are likely empty (>= 1)."""
        return max(1, math.ceil(self.predicted_delay()))

    def _overloaded(self, predicted: float, waited_s: float, full: str | None = None) -> Rejected | None:
        """The 429 for a request predicted to wait ``predicted`` s more after ``waited_s`` s already
        spent in this server (``full``: why its bucket's queue is full), recorded as shedding; None
        to admit. Its reason: "queue_full" for a full queue, "queue_delay" for a predicted delay over
        the bound."""
        reserve = 2 * self.loop_lag_s  # getting in (already spent, unseen) and getting out through a busy event loop
        if full is None and waited_s + predicted + reserve <= self.max_delay:
            return None
        reason = "queue_full" if full else "queue_delay"
        self.metrics.reject(reason)
        spent = f" after {waited_s:.3f} s already spent in the server" if waited_s >= 0.001 else ""
        lag = f" (+ {reserve:.3f} s of event-loop lag)" if reserve >= 0.001 else ""
        why = full or f"predicted queueing delay {predicted:.3f} s{spent}{lag} exceeds {self.max_delay:g} s"
        self.last_shed, self.shed_reason = time.monotonic(), why
        return Rejected(429, reason, f"overloaded: {why}; retry later", max(1, math.ceil(predicted)))

    def reject_early(self) -> Rejected | None:
        """The 429 every request would get now, whatever its bucket (the predicted delay counts all
        queued work), so that the HTTP edge can refuse it before reading and validating its body (the
        CPU a refused request costs is what an overloaded 2-core box lacks); None when it may be
        admitted. An empty queue with no batch running never refuses."""
        if self.draining or self.model.available == 0 or (not self.executing and not self.depth()):
            return None
        return self._overloaded(self.predicted_delay(), 0.0)

    async def submit(self, bucket: int, job: Job, waited_s: float = 0.0) -> Any:
        """Queue ``job`` in ``bucket`` and wait for its result.

        ``waited_s``: seconds the request already spent in this server (arrival to now: reading,
        validating); it counts against the delay bound, so that an admitted request's time in the
        server before its batch starts stays within ``max_queue_delay_s`` also when the HTTP side is
        the bottleneck.

        Raises:
            Rejected: 429 "queue_full" (its bucket holds ``max_queue``) / "queue_delay" (predicted wait
                over ``max_queue_delay_s``); 503 draining, timed out,
                or shed by the memory guard.
            Exception: whatever ``run_batch`` reported for this job.
        """
        if self.draining:
            self.metrics.reject("draining")
            raise Rejected(503, "draining", "the server is shutting down", 1)
        if self.model.available == 0:
            self.metrics.reject("model_restart")
            raise Rejected(503, "model_restart", "the model process is restarting; retry in a few seconds", 5)
        if bucket not in self.model.warm:  # its first batches would wait behind the warm-up (tens of seconds)
            self.metrics.reject("warming")
            raise Rejected(503, "warming", f"bucket {bucket} is still warming up (see /readyz); retry in a few seconds", 5)
        q = self.queues[bucket]
        if not self.executing and not self.depth():  # an empty queue with no batch running always admits
            predicted = 0.0
        else:
            predicted = self.predicted_delay()
            full = f"bucket {bucket} queue is full ({len(q)} waiting)" if len(q) >= self.max_queue else None
            refused = self._overloaded(predicted, max(0.0, waited_s), full)
            if refused is not None:
                raise refused
        loop = asyncio.get_running_loop()
        job.future = loop.create_future()
        job.enqueued_at = loop.time()
        q.append(job)
        self.tallies[bucket].add(job)
        self._admitted[id(job)] = predicted
        self.metrics.queue_depth.labels(bucket=str(bucket)).set(len(q))
        self._arrived.set()
        self.in_flight += 1
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), self.timeout)
        except asyncio.TimeoutError:
            job.expired = True
            self.metrics.reject("timeout")
            raise Rejected(503, "timeout", f"no result within the request timeout of {self.timeout:g} s", self.retry_after()) from None
        finally:
            self.in_flight -= 1

    # ----- collector and execution -----
    async def _dispatch(self) -> None:
        """Form batches whenever a model worker is free, for as long as the service runs."""
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            while not self.depth():
                self._arrived.clear()
                await self._arrived.wait()
            deadline = min(q[0].enqueued_at for q in self.queues.values() if q) + self.max_wait
            while self.depth() < self.max_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            now = loop.time()
            first = min((e for e, q in self.queues.items() if q), key=lambda e: min(fair_key(j, now, self.aging_s) for j in self.queues[e]))
            edge, take = plan_batch({e: len(q) for e, q in self.queues.items()}, first, self.max_batch, self.model.costs)
            picked = pick_fair(self.queues, take, self.max_batch, now, self.aging_s)
            batch = [j for _, j in picked]
            for e, j in picked:
                self.tallies[e].remove(j)
                predicted = self._admitted.pop(id(j), 0.0)
                if not j.expired:
                    self.metrics.queue_wait.labels(bucket=str(e)).observe(now - j.enqueued_at)
                    self.delay.learn_wait(predicted, now - j.enqueued_at)
            for e in take:
                self.metrics.queue_depth.labels(bucket=str(e)).set(len(self.queues[e]))
            live = [j for j in batch if not j.expired and not j.future.done()]
            if not live:
                self._slots.release()
                continue
            self.executing += 1  # counted from now, so that drain never sees a formed batch as done
            task = loop.create_task(self._execute(edge, live))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            task.add_done_callback(lambda _: self._slots.release())

    async def _execute(self, edge: int, batch: list[Job]) -> None:
        predicted = self.delay.predict(edge, WorkTally(batch))
        token, t0 = id(batch), time.monotonic()
        self._executing[token] = (t0, sum(predicted.values()))
        try:
            out = await self.model.run(edge, batch)
            results = self._record(edge, batch, out, predicted, time.monotonic() - t0)
        except ModelRestart as exc:
            for _ in batch:
                self.metrics.reject("model_restart")
            results = [Rejected(503, "model_restart", str(exc), 1)] * len(batch)
        except Rejected as exc:
            results = [exc] * len(batch)
        except Exception as exc:  # noqa: BLE001 - reported to every request of the batch
            log.exception("batch of %d in bucket %d failed", len(batch), edge)
            results = [exc] * len(batch)
        finally:
            self.executing -= 1
            self._executing.pop(token, None)
        for job, res in zip(batch, results):
            if job.expired or job.future.done():
                continue
            if isinstance(res, BaseException):
                job.future.set_exception(res)
            else:
                job.future.set_result(res)

    def _record(self, edge: int, batch: list[Job], out: BatchOutcome, predicted: dict[str, float], wall_s: float) -> list[Any]:
        """Metrics and cost scales of a finished batch (``predicted``: its predicted seconds by
        kind; ``wall_s``: from its start here to its answer, pipe and event loop included: what
        drains the queue); raises Rejected (503 "memory") when the guard shed it."""
        if out.memory is not None:
            self.metrics.set_memory(self.metrics.memory_kinds[0], *out.memory)
        if out.triggered:
            self.metrics.guard_triggers.inc()
        if out.prefix is not None:  # the engine's user-prefix cache (BatchOutcome.prefix)
            self.metrics.record_prefix(*out.prefix)
        if out.shed is not None:
            for _ in batch:
                self.metrics.reject("memory")
            raise Rejected(503, "memory", out.shed, max(1, math.ceil(self.batch_time_s * 10)))
        self.batch_time_s = 0.8 * self.batch_time_s + 0.2 * out.seconds
        if self.delay.learn(edge, predicted, wall_s) is not None:
            for kind, p in predicted.items():
                if p > 0:
                    self.metrics.cost_scale.labels(bucket=str(edge), kind=kind).set(self.delay.scale[(edge, kind)])
        self.metrics.batch_size.labels(bucket=str(edge)).observe(len(batch))
        self.metrics.batch_duration.labels(bucket=str(edge)).observe(out.seconds)
        return out.results


__all__ = ["MicroBatcher", "Rejected"]
