"""The executor contract: where the service's batches run, declared once (:class:`Executor`).

The micro-batcher (:mod:`hstu.serve.batcher`) hands one bucket's batch (a list of
:class:`~hstu.serve.runner.Job`) to an executor, which checks memory with its guard, runs
:meth:`BatchRunner.run_batch <hstu.serve.runner.BatchRunner.run_batch>` and answers a
:class:`BatchOutcome`. Two executors implement the contract:

- :class:`LocalModel` (here): a one-worker thread pool of the serving process (what tests and
  ``create_app(cfg, recommender)`` use). The event loop and the model share one interpreter: the
  model thread needs the GIL for each of the ~1,000 ATen calls of a small generate call, so HTTP
  parsing and the model serialise; measured on the 2-core dev box: 11.7 ms of model-thread CPU
  per request at 60 QPS against 5-8 ms for the same batches alone.
- :class:`hstu.serve.worker.ProcessModel`: model processes of their own, in parallel with the
  event loop (that module's docstring).

Lifecycle, driven by the service in the app's lifespan: :meth:`Executor.start` (a model
process loads the run then; building an executor starts nothing), :meth:`Executor.warmup` per
bucket, :meth:`Executor.run` per batch, :meth:`Executor.close` after the drain.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hstu.backend.memory_guard import MemoryGuard
from hstu.serve.admission import BucketCost, measure_bucket_cost
from hstu.serve.runner import BatchRunner, Job


@dataclass
class BatchOutcome:
    """What one batch produced.

    results: per job, a result (generate: :class:`~hstu.generate.recommend.Ranked`; score: (C,)
    float64 scores) or the exception it raised (None when the batch was shed).
    seconds: model time of the batch (s). memory: (free bytes after the guard's action, total
    bytes) when the guard checked. triggered: free memory was below the threshold.
    shed: the message when memory stayed low and the batch was not run.
    prefix: the user-prefix cache's (hits, misses, rows reused, evictions) in this batch and (bytes, entries)
        after it, or None without a cache.
    """

    results: list[Any] | None
    seconds: float = 0.0
    memory: tuple[int, int] | None = None
    triggered: bool = False
    shed: str | None = None
    prefix: tuple[int, ...] | None = None


class ModelRestart(RuntimeError):
    """The model process died during a batch; a new one has been started (the batch answers 503)."""


@runtime_checkable
class Executor(Protocol):
    """What the micro-batcher and the service use of an executor.

    Attributes (valid once :meth:`start` has returned):
        buckets: ascending bucket edges (events) the executor runs batches at.
        max_k: the most items one generate job may ask for (the model's max_output_len).
        has_engine: generation runs through the static-shape engine (beam width <= max batch).
        backend_name: what generates, for /readyz and the start-up log.
        precision: {"precision": "fp32" | "bf16" | "fp16" | "int8", "embeddings": the item table's storage}.
        warm: buckets warmed and measured so far.
        costs: bucket -> (fixed s, s per request) of a batch, measured at warm-up (batch planning).
        cost_model: bucket -> admission cost line (:class:`~hstu.serve.admission.BucketCost`), from warm-up.
        slots: batches that may run at once (one per model worker).
    """

    buckets: list[int]
    max_k: int
    has_engine: bool
    backend_name: str
    precision: dict[str, str]
    warm: set[int]
    costs: dict[int, tuple[float, float]]
    cost_model: dict[int, BucketCost]
    slots: int

    @property
    def available(self) -> int:
        """Model workers that take batches now (0 while all are restarting)."""
        ...

    def bucket_for(self, length: int) -> int:
        """The smallest bucket edge >= ``length`` events. Raises ValueError past the largest."""
        ...

    async def start(self) -> None:
        """Make the executor ready to run batches (load the run in the model processes); a no-op
        once started. Raises what loading raised."""
        ...

    async def run(self, edge: int, jobs: list[Job]) -> BatchOutcome:
        """Run one batch at bucket ``edge``. Raises ModelRestart when its model process died."""
        ...

    async def warmup(self, edge: int) -> float:
        """Warm bucket ``edge`` and measure its costs; seconds taken. Raises what the warm-up raised."""
        ...

    def close(self) -> None:
        """Stop: no batch runs afterwards."""
        ...


def execute(runner: BatchRunner, guard: MemoryGuard | None, edge: int, jobs: list[Job]) -> BatchOutcome:
    """Memory guard, then ``runner.run_batch``: the body of a batch on either executor. Generate
    results stay :class:`~hstu.generate.recommend.Ranked` (the service describes them)."""
    memory, triggered = None, False
    if guard is not None:
        res = guard.check()
        if res is not None:
            memory, triggered = (res.free_after, res.total), res.triggered
            if res.triggered and not res.recovered:
                return BatchOutcome(
                    None, 0.0, memory, True, f"free memory {res.free_after} B is below the guard threshold {res.threshold} B; load shed"
                )
    t0, before = time.perf_counter(), runner.prefix_counts()
    results = runner.run_batch(edge, jobs, describe=False)
    after = runner.prefix_counts()
    prefix = None if after is None else tuple(a - b for a, b in zip(after[:4], before)) + after[4:]  # counts: this batch's
    return BatchOutcome(results, time.perf_counter() - t0, memory, triggered, prefix=prefix)


def batch_guard(runner: BatchRunner, backend, min_free_ratio: float) -> MemoryGuard:
    """The memory guard checked before each batch: below ``min_free_ratio`` free, it drops the
    runner's rebuildable caches and the backend's allocator cache."""

    def release(info, guard) -> None:
        runner.release_caches()
        backend.empty_cache()

    return MemoryGuard(backend, min_free_ratio=min_free_ratio, action=release)


def warm_and_measure(runner: BatchRunner, edge: int) -> tuple[float, BucketCost]:
    """Warm ``edge``, then measure its admission cost line: (seconds of both, cost)."""
    t0 = time.perf_counter()
    runner.warmup(edge)
    cost = measure_bucket_cost(runner, edge)
    return time.perf_counter() - t0, cost


class LocalModel:
    """The :class:`Executor` on a one-worker thread pool of this process (module docstring).
    ``runner`` / ``guard`` as :func:`execute`; the pool's thread starts with the first batch."""

    def __init__(self, runner: BatchRunner, guard: MemoryGuard | None) -> None:
        self.runner, self.guard = runner, guard
        self.buckets, self.max_k = list(runner.buckets), runner.max_k
        self.has_engine, self.backend_name = runner.engine is not None, runner.backend_name
        self.precision = runner.precision
        self.costs = runner.costs
        self.warm: set[int] = set()  # warm and measured (runner.warm is set before the measurement)
        self.cost_model: dict[int, BucketCost] = {}  # bucket -> admission cost line, measured at warm-up
        self.slots, self.available = 1, 1
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hstu-model")

    def bucket_for(self, length: int) -> int:
        return self.runner.bucket_for(length)

    async def start(self) -> None:
        """Nothing to start: the runner was built with the executor."""

    async def run(self, edge: int, jobs: list[Job]) -> BatchOutcome:
        return await asyncio.get_running_loop().run_in_executor(self.pool, execute, self.runner, self.guard, edge, jobs)

    async def warmup(self, edge: int) -> float:
        """Warm one bucket and measure its admission costs (seconds taken); raises what the warm-up raised."""
        secs, self.cost_model[edge] = await asyncio.get_running_loop().run_in_executor(self.pool, warm_and_measure, self.runner, edge)
        self.warm.add(edge)
        self.backend_name = self.runner.backend_name  # with the graphs warmed so far
        return secs

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["BatchOutcome", "Executor", "LocalModel", "ModelRestart", "batch_guard", "execute", "warm_and_measure"]
