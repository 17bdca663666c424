"""Micro-batcher: one bounded queue per length bucket, batches closed by size or deadline,
executed one at a time on a single model thread.

Per bucket (edge E), requests whose history has <= E events (and > the previous edge) wait in
that bucket's queue. A collector task closes a batch when ``max_batch`` requests wait or when the
oldest one has waited ``max_wait_ms``, whichever comes first (LitServe's batching loop habit:
fill to size or deadline), and hands it to the model thread (a one-worker thread pool, since
one process drives one device; torch releases the GIL while it computes, so the event loop keeps
parsing requests meanwhile). While a batch runs, the next one fills.

Backpressure: a request is refused at once, never queued, when its bucket already holds
``max_queue`` waiting requests, or when the predicted wait (requests ahead / ``max_batch`` batches
of the recent mean batch time) exceeds ``max_queue_delay_s`` (default: the request timeout):
:class:`Rejected` 429 with a Retry-After in seconds. A queued request that is not answered within ``request_timeout_s`` gets
503 and is skipped if its batch has not started. Before each batch the memory guard checks free
memory (device, or host on CPU): below the threshold it releases caches; if memory is still low
the whole batch is shed with 503 (reason "memory") and the process keeps running.

Shutdown: :meth:`MicroBatcher.drain` refuses new requests (503 "draining"), lets the queued
ones finish, then stops the collectors and the model thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hstu.backend.memory_guard import MemoryGuard
from hstu.serve.metrics import ServeMetrics
from hstu.serve.runner import BatchRunner, Job

log = logging.getLogger(__name__)


class Rejected(Exception):
    """A request the service will not (or can no longer) answer with a result.

    ``status`` 429 or 503, ``reason`` one of :data:`hstu.serve.metrics.REASONS`, ``retry_after``
    whole seconds (>= 1) for the Retry-After header.
    """

    def __init__(self, status: int, reason: str, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, max(1, int(retry_after))


@dataclass
class _Bucket:
    edge: int
    queue: deque
    event: asyncio.Event
    task: asyncio.Task | None = None


class MicroBatcher:
    """Queues, collectors and the model thread for one :class:`BatchRunner`.

    Args:
        runner: executes a batch (``run_batch``) and warms buckets (``warmup``).
        metrics: where queue depth, batch size / duration and rejections are recorded.
        guard: memory guard checked before each batch (``None`` disables the check).
        max_batch: requests per batch (>= 1). max_wait_ms: deadline from the oldest request (>= 0).
        max_queue: waiting requests per bucket before 429 (>= 1).
        request_timeout_s: time a request may wait for its result before 503 (> 0).
        max_queue_delay_s: refuse (429) when the predicted queueing delay is longer (> 0;
            default ``request_timeout_s``).

    Raises:
        ValueError: a setting out of range (the message names it).

    Create and use it inside a running event loop (the app's lifespan does).
    """

    def __init__(self, runner: BatchRunner, metrics: ServeMetrics, guard: MemoryGuard | None, *, max_batch: int, max_wait_ms: float,
                 max_queue: int, request_timeout_s: float, max_queue_delay_s: float | None = None) -> None:
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1)):
            if int(value) < low:
                raise ValueError(f"{name} must be >= {low}, got {value!r}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
        if max_queue_delay_s is not None and max_queue_delay_s <= 0:
            raise ValueError(f"max_queue_delay_s must be > 0, got {max_queue_delay_s!r}")
        self.runner, self.metrics, self.guard = runner, metrics, guard
        self.max_batch, self.max_wait = int(max_batch), float(max_wait_ms) / 1000.0
        self.max_queue, self.timeout = int(max_queue), float(request_timeout_s)
        self.max_delay = float(max_queue_delay_s) if max_queue_delay_s is not None else self.timeout
        self.buckets = {e: _Bucket(e, deque(), asyncio.Event()) for e in runner.buckets}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hstu-model")
        self.draining = False
        self.in_flight = 0  # submitted and not yet answered
        self.executing = 0  # batches on the model thread
        self.batch_time_s = 0.01  # running mean of a batch's model time (s), for Retry-After / admission
        self.warmup_error: str | None = None

    # ----- lifecycle -----
    def start(self) -> None:
        for b in self.buckets.values():
            b.task = asyncio.get_running_loop().create_task(self._collect(b), name=f"hstu-batcher-{b.edge}")

    async def warmup(self) -> None:
        """Warm every bucket on the model thread (smallest first); sets the readiness metrics."""
        loop = asyncio.get_running_loop()
        for edge in self.runner.buckets:
            try:
                secs = await loop.run_in_executor(self.pool, self.runner.warmup, edge)
            except Exception as exc:  # noqa: BLE001 - the process stays up and /readyz says why
                self.warmup_error = f"bucket {edge}: {exc}"
                log.exception("warm-up of bucket %d failed", edge)
                return
            self.metrics.bucket_warm.labels(bucket=str(edge)).set(1)
            log.info("bucket %d warm (%.2f s)", edge, secs)
        self.metrics.ready.set(1)

    @property
    def ready(self) -> bool:
        return not self.draining and self.warmup_error is None and all(e in self.runner.warm for e in self.buckets)

    def depth(self) -> int:
        return sum(len(b.queue) for b in self.buckets.values())

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, wait up to ``timeout_s`` for queued and running ones, then stop.
        Returns True when everything finished in time."""
        self.draining = True
        self.metrics.ready.set(0)
        deadline = time.monotonic() + timeout_s
        while (self.in_flight or self.executing) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        done = not (self.in_flight or self.executing)
        for b in self.buckets.values():
            if b.task is not None:
                b.task.cancel()
        for b in self.buckets.values():
            if b.task is not None:
                try:
                    await b.task
                except asyncio.CancelledError:
                    pass
        self.pool.shutdown(wait=True, cancel_futures=True)
        if not done:
            log.warning("shutdown: %d request(s) still in flight after %.1f s", self.in_flight, timeout_s)
        return done

    # ----- requests -----
    def retry_after(self) -> int:
        """Seconds until the queues are likely empty (>= 1)."""
        return max(1, math.ceil((self.depth() / self.max_batch + 1) * self.batch_time_s))

    async def submit(self, bucket: int, job: Job) -> Any:
        """Queue ``job`` in ``bucket`` and wait for its result.

        Raises:
            Rejected: 429 queue full / predicted wait over ``max_queue_delay_s``; 503 draining, timed out,
                or shed by the memory guard.
            Exception: whatever ``run_batch`` reported for this job.
        """
        if self.draining:
            self.metrics.reject("draining")
            raise Rejected(503, "draining", "the server is shutting down", 1)
        b = self.buckets[bucket]
        predicted = (self.depth() / self.max_batch + 1) * self.batch_time_s
        if len(b.queue) >= self.max_queue or predicted > self.max_delay:
            self.metrics.reject("queue_full")
            why = (f"bucket {bucket} queue is full ({len(b.queue)} waiting)" if len(b.queue) >= self.max_queue
                   else f"predicted queueing delay {predicted:.2f} s exceeds {self.max_delay:g} s")
            raise Rejected(429, "queue_full", f"overloaded: {why}; retry later", self.retry_after())
        loop = asyncio.get_running_loop()
        job.future = loop.create_future()
        job.enqueued_at = loop.time()
        b.queue.append(job)
        self.metrics.queue_depth.labels(bucket=str(bucket)).set(len(b.queue))
        b.event.set()
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
    async def _collect(self, b: _Bucket) -> None:
        loop = asyncio.get_running_loop()
        gauge = self.metrics.queue_depth.labels(bucket=str(b.edge))
        while True:
            while not b.queue:
                b.event.clear()
                await b.event.wait()
            deadline = b.queue[0].enqueued_at + self.max_wait
            while len(b.queue) < self.max_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                b.event.clear()
                try:
                    await asyncio.wait_for(b.event.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch = [b.queue.popleft() for _ in range(min(self.max_batch, len(b.queue)))]
            gauge.set(len(b.queue))
            live = [j for j in batch if not j.expired and not j.future.done()]
            if live:
                await self._execute(b.edge, live)

    async def _execute(self, edge: int, batch: list[Job]) -> None:
        loop = asyncio.get_running_loop()
        self.executing += 1
        try:
            results = await loop.run_in_executor(self.pool, self._run, edge, batch)
        except Rejected as exc:
            results = [exc] * len(batch)
        except Exception as exc:  # noqa: BLE001 - reported to every request of the batch
            log.exception("batch of %d in bucket %d failed", len(batch), edge)
            results = [exc] * len(batch)
        finally:
            self.executing -= 1
        for job, res in zip(batch, results):
            if job.expired or job.future.done():
                continue
            if isinstance(res, BaseException):
                job.future.set_exception(res)
            else:
                job.future.set_result(res)

    def _run(self, edge: int, batch: list[Job]) -> list[Any]:
        """On the model thread: memory guard, then the runner; records batch metrics."""
        if self.guard is not None:
            res = self.guard.check()
            if res is not None:
                self.metrics.set_memory(self.metrics.memory_kinds[0], res.free_after, res.total)
                if res.triggered:
                    self.metrics.guard_triggers.inc()
                    if not res.recovered:
                        for _ in batch:
                            self.metrics.reject("memory")
                        raise Rejected(503, "memory", f"free memory {res.free_after} B is below the guard threshold {res.threshold} B; "
                                       "load shed", max(1, math.ceil(self.batch_time_s * 10)))
        t0 = time.perf_counter()
        out = self.runner.run_batch(edge, batch)
        dt = time.perf_counter() - t0
        self.batch_time_s = 0.8 * self.batch_time_s + 0.2 * dt
        self.metrics.batch_size.labels(bucket=str(edge)).observe(len(batch))
        self.metrics.batch_duration.labels(bucket=str(edge)).observe(dt)
        return out


__all__ = ["MicroBatcher", "Rejected"]
