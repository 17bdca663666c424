"""Where the service's batches run: a model thread of the serving process, or a model process.

Both executors take one bucket's batch (:class:`~hstu.serve.runner.Job` list), check memory with
the guard, run :meth:`BatchRunner.run_batch` and return a :class:`BatchOutcome`; the micro-batcher
turns outcomes into responses and metrics. One batch at a time, since one process drives one
device.

- :class:`LocalModel`: a one-worker thread pool in the serving process (what tests and
  ``create_app(cfg, recommender)`` use). The event loop and the model share one interpreter:
  the model thread needs the GIL for each of the ~1,000 ATen calls of a small generate call, so
  HTTP parsing and the model serialise; measured on the 2-core dev box: 11.7 ms of model-thread
  CPU per request at 60 QPS against 5-8 ms for the same batches alone.
- :class:`ProcessModel`: model processes of their own (``spawn``; each loads the run and builds
  the runner once), so the event loop and the model run on separate cores in parallel (vLLM V1
  splits its API server and engine core the same way). Each process has one duplex
  ``multiprocessing`` pipe: the event loop sends a call (pickled: a 200-event history is ~5 KB)
  and reads the answer in a ``loop.add_reader`` callback, so no thread of this process takes part
  (``ProcessPoolExecutor`` routes every call through a manager and a feeder thread, each waiting
  for the GIL behind the event loop: 0.7 ms per round trip alone, more under load; a bare pipe
  0.3 ms). A process that dies (killed, out of memory) is seen as the pipe's end, is replaced
  in the background and takes batches again once loaded and warm; its batch is retried on
  another live process, or answers 503 (reason ``model_restart``) when none is live, as do new
  requests while none is (``/readyz`` says "restarting" then).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import logging
import multiprocessing
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from hstu.backend.memory_guard import MemoryGuard
from hstu.serve.admission import BucketCost, measure_bucket_cost
from hstu.serve.runner import BatchRunner, Job, smallest_bucket

log = logging.getLogger(__name__)


@dataclass
class BatchOutcome:
    """What one batch produced.

    results: per job, a result or the exception it raised (None when the batch was shed).
    seconds: model time of the batch (s). memory: (free bytes after the guard's action, total
    bytes) when the guard checked. triggered: free memory was below the threshold.
    shed: the message when memory stayed low and the batch was not run.
    """

    results: list[Any] | None
    seconds: float = 0.0
    memory: tuple[int, int] | None = None
    triggered: bool = False
    shed: str | None = None


def execute(runner: BatchRunner, guard: MemoryGuard | None, edge: int, jobs: list[Job]) -> BatchOutcome:
    """Memory guard, then ``runner.run_batch``: the body of a batch on either executor."""
    memory, triggered = None, False
    if guard is not None:
        res = guard.check()
        if res is not None:
            memory, triggered = (res.free_after, res.total), res.triggered
            if res.triggered and not res.recovered:
                return BatchOutcome(None, 0.0, memory, True, f"free memory {res.free_after} B is below the guard threshold "
                                    f"{res.threshold} B; load shed")
    t0 = time.perf_counter()
    results = runner.run_batch(edge, jobs)
    return BatchOutcome(results, time.perf_counter() - t0, memory, triggered)


def batch_guard(runner: BatchRunner, backend, min_free_ratio: float) -> MemoryGuard:
    """The memory guard checked before each batch: below ``min_free_ratio`` free, it drops the
    runner's rebuildable caches and the backend's allocator cache."""
    def release(info, guard) -> None:
        runner.release_caches()
        backend.empty_cache()

    return MemoryGuard(backend, min_free_ratio=min_free_ratio, action=release)


@dataclass
class WorkerSpec:
    """Everything a model process needs to build its runner (picklable).

    run_dir, device, precision: as ``Recommender.from_run``. buckets, max_batch, use_engine: as
    :class:`BatchRunner`. threads: torch intra-op threads in the worker (None: torch's default).
    memory_threshold: the guard's minimum free fraction. workers: model processes (each loads
    the run and runs one batch at a time; more than one only where memory allows a copy each).
    """

    run_dir: str
    device: str = "cpu"
    precision: str | None = None
    buckets: tuple[int, ...] = (20, 50, 100, 200)
    max_batch: int = 16
    use_engine: str = "auto"
    threads: int | None = None
    memory_threshold: float = 0.10
    workers: int = 1


class LocalModel:
    """Batches on a one-worker thread pool of this process. ``runner`` / ``guard`` as :func:`execute`."""

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

    async def run(self, edge: int, jobs: list[Job]) -> BatchOutcome:
        return await asyncio.get_running_loop().run_in_executor(self.pool, execute, self.runner, self.guard, edge, jobs)

    async def warmup(self, edge: int) -> float:
        """Warm one bucket and measure its admission costs (seconds taken); raises what the warm-up raised."""
        secs, self.cost_model[edge] = await asyncio.get_running_loop().run_in_executor(self.pool, _warm_and_measure, self.runner, edge)
        self.warm.add(edge)
        return secs

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _warm_and_measure(runner: BatchRunner, edge: int) -> tuple[float, BucketCost]:
    """Warm ``edge``, then measure its admission cost line: (seconds of both, cost)."""
    t0 = time.perf_counter()
    runner.warmup(edge)
    cost = measure_bucket_cost(runner, edge)
    return time.perf_counter() - t0, cost


# ----- the model process -----
_WORKER: dict[str, Any] = {}


def _worker_init(spec: WorkerSpec, warm: tuple[int, ...]) -> None:
    """In the model process: load the run, build runner and guard, warm ``warm`` buckets."""
    import torch

    from hstu import backend as backends
    from hstu.generate.recommend import Recommender

    threads = spec.threads or (max(1, (os.cpu_count() or 1) // spec.workers) if spec.workers > 1 else None)
    if threads:  # several model processes share the cores instead of each taking all of them
        torch.set_num_threads(threads)
    try:
        rec = Recommender.from_run(spec.run_dir, spec.device, spec.precision)
    except Exception as exc:  # noqa: BLE001 - kept and raised by the first call, in the parent, as itself
        _WORKER["load_error"] = exc  # answered to the first call ("info" at start-up)
        return
    runner = BatchRunner(rec, list(spec.buckets), spec.max_batch, use_engine=spec.use_engine)
    _WORKER.update(runner=runner, guard=batch_guard(runner, backends.select(spec.device), spec.memory_threshold))
    for edge in warm:
        runner.warmup(edge)
    gc.collect()
    gc.freeze()  # the loaded model never becomes garbage: keep it out of full collections (app.py)


def _loaded() -> None:
    if "load_error" in _WORKER:
        raise _WORKER["load_error"]


def _worker_info() -> dict:
    _loaded()
    r = _WORKER["runner"]
    return {"buckets": list(r.buckets), "max_k": r.max_k, "has_engine": r.engine is not None, "backend_name": r.backend_name,
            "precision": r.precision}


def _worker_execute(edge: int, jobs: list[Job]) -> BatchOutcome:
    return execute(_WORKER["runner"], _WORKER["guard"], edge, jobs)


def _worker_warmup(edge: int) -> tuple[float, tuple[float, float], BucketCost]:
    r = _WORKER["runner"]
    secs, cost = _warm_and_measure(r, edge)
    return secs, r.costs[edge], cost


_OPS = {"info": _worker_info, "execute": _worker_execute, "warmup": _worker_warmup}


def _worker_main(conn, spec: WorkerSpec, warm: tuple[int, ...]) -> None:
    """The model process: load, then answer calls ``(op, args)`` in order with ``("ok", value)``
    or ``("err", exception)`` until "stop" or the pipe's end (the serving process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the server drains, then stops us
    _worker_init(spec, warm)
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "stop":
            return
        try:
            reply = ("ok", _OPS[op](*args))
        except Exception as exc:  # noqa: BLE001 - raised again in the serving process, as itself
            reply = ("err", exc)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - an answer that does not pickle (send writes nothing then)
            conn.send(("err", RuntimeError(f"model process: cannot send the {op} answer: {type(exc).__name__}: {exc}")))


class ModelProcessDied(RuntimeError):
    """The model process ended (killed, out of memory) before answering."""


class _Channel:
    """One model process and its duplex pipe; calls are answered in the order sent. Before an
    event loop runs (start-up): :meth:`call_sync`; then :meth:`call`, answered from a
    ``loop.add_reader`` callback on the pipe."""

    def __init__(self, spec: WorkerSpec, warm: tuple[int, ...]) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process whose torch has started threads
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, warm), name="hstu-model", daemon=True)
        self.proc.start()
        child.close()
        self.pending: collections.deque[asyncio.Future] = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead = False

    @staticmethod
    def _unwrap(reply: tuple[str, Any]) -> Any:
        status, value = reply
        if status == "err":
            raise value
        return value

    def call_sync(self, op: str, *args: Any, timeout: float) -> Any:
        """Send a call and wait up to ``timeout`` s for its answer (no event loop needed)."""
        try:
            self.conn.send((op, args))
            if not self.conn.poll(timeout):
                raise TimeoutError(f"the model process did not answer {op!r} within {timeout:.0f} s")
            reply = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.dead = True
            raise ModelProcessDied(f"the model process ended (exit code {self.proc.exitcode})") from exc
        return self._unwrap(reply)

    def call(self, op: str, *args: Any) -> asyncio.Future:
        """Send a call; the future resolves with its answer, its exception, or ModelProcessDied."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self.loop is not loop and not self.dead:  # first call in this loop
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_reader(self.conn.fileno())
            self.loop = loop
            loop.add_reader(self.conn.fileno(), self._on_readable)
        if not self.dead:
            try:
                self.conn.send((op, args))
            except OSError:  # BrokenPipeError: the process is gone
                self._died()
        if self.dead:
            fut.set_exception(ModelProcessDied(f"the model process ended (exit code {self.proc.exitcode})"))
        else:
            self.pending.append(fut)
        return fut

    def _on_readable(self) -> None:
        try:
            while self.pending and self.conn.poll():
                buf = self.conn.recv_bytes()
                fut = self.pending.popleft()
                try:
                    status, value = ForkingPickler.loads(buf)
                except Exception as exc:  # noqa: BLE001 - e.g. an exception type that does not unpickle
                    status, value = "err", RuntimeError(f"cannot read the model process's answer: {type(exc).__name__}: {exc}")
                if not fut.done():  # a cancelled waiter's answer is dropped
                    fut.set_result(value) if status == "ok" else fut.set_exception(value)
            if not self.pending and self.conn.poll():  # readable with nothing asked: the pipe's end
                self.conn.recv_bytes()
        except (EOFError, OSError):
            self._died()

    def _died(self) -> None:
        self.dead = True
        if self.loop is not None:
            self.loop.remove_reader(self.conn.fileno())
            self.loop = None
        while self.pending:
            fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(ModelProcessDied(f"the model process ended (exit code {self.proc.exitcode})"))

    def ended(self, timeout: float = 5.0) -> str:
        """How the (dead) process ended, e.g. "exit code 1" or "killed by SIGKILL"."""
        self.proc.join(timeout)
        code = self.proc.exitcode
        if code is None:
            return "exit code unknown"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def close(self, timeout: float = 10.0) -> None:
        """Stop the process (after the call it is running, if any) and close the pipe."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.conn.fileno())
        self.loop = None
        if not self.dead:
            try:
                self.conn.send(("stop", ()))
            except OSError:
                pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)
        self.conn.close()
        self.dead = True


class ProcessModel:
    """Batches in ``spec.workers`` model processes of their own (module docstring), one batch
    each at a time. Blocks until every process has loaded the run (raises what loading raised:
    FileNotFoundError, ValueError, ...; TimeoutError after ``start_timeout_s``). A process that
    dies while loading (killed, out of memory) is started again up to ``start_retries`` times;
    then ModelProcessDied says so in one line."""

    def __init__(self, spec: WorkerSpec, start_timeout_s: float = 300.0, start_retries: int = 2) -> None:
        if spec.workers < 1:
            raise ValueError(f"WorkerSpec.workers must be >= 1, got {spec.workers}")
        self.spec, self.start_timeout_s, self.start_retries = spec, start_timeout_s, max(0, int(start_retries))
        self.slots = spec.workers
        self.warm: set[int] = set()
        self.costs: dict[int, tuple[float, float]] = {}
        self.cost_model: dict[int, BucketCost] = {}  # bucket -> admission cost line, measured at warm-up
        self.restarts = 0
        self.channels = [_Channel(spec, ()) for _ in range(spec.workers)]
        try:
            info = [self._load(i) for i in range(spec.workers)][0]  # noqa: RUF015 - waits for every process
        except BaseException:
            self.close()
            raise
        self.buckets, self.max_k = info["buckets"], info["max_k"]
        suffix = " (model process)" if spec.workers == 1 else f" ({spec.workers} model processes)"
        self.has_engine, self.backend_name = info["has_engine"], info["backend_name"] + suffix
        self.precision = info["precision"]  # as loaded by the model process
        self.up = set(range(spec.workers))  # loaded and not restarting
        self._free: asyncio.Queue | None = None  # indices of idle live processes, made in the running loop
        self._tasks: set[asyncio.Task] = set()

    def _load(self, i: int) -> dict:
        """Wait for process ``i`` to load the run (its "info"); start it again when it died meanwhile."""
        for attempt in range(self.start_retries + 1):
            try:
                return self.channels[i].call_sync("info", timeout=self.start_timeout_s)
            except ModelProcessDied:
                how = self.channels[i].ended()
                if attempt == self.start_retries:
                    raise ModelProcessDied(f"the model process ended while loading the run {attempt + 1} time(s) (last: {how}); "
                                           f"see the log above for why (memory? a killed process?)") from None
                log.error("model process %d ended while loading the run (%s); starting it again (%d of %d)", i, how, attempt + 1,
                          self.start_retries)
                self.restarts += 1
                self.channels[i].close(timeout=1.0)
                self.channels[i] = _Channel(self.spec, ())
        raise AssertionError("unreachable")

    def pid(self, i: int = 0) -> int | None:
        """Process id of model process ``i`` (tests kill it through this)."""
        return self.channels[i].proc.pid

    def bucket_for(self, length: int) -> int:
        return smallest_bucket(self.buckets, length)

    @property
    def available(self) -> int:
        """Model processes loaded and warm (the others are restarting)."""
        return len(self.up)

    def _free_queue(self) -> asyncio.Queue:
        if self._free is None:  # made lazily: it belongs to the running loop
            self._free = asyncio.Queue()
            for i in sorted(self.up):
                self._free.put_nowait(i)
        return self._free

    async def run(self, edge: int, jobs: list[Job], retry: bool = True) -> BatchOutcome:
        """Run a batch on an idle model process (waits for one). When the process has died, it
        is replaced in the background and the batch is retried once on another live process;
        with none live, raises ModelRestart (503)."""
        free = self._free_queue()
        i = await free.get()
        sent = [dataclasses.replace(j, future=None) for j in jobs]  # the asyncio future stays here
        died = False
        try:
            return await self.channels[i].call("execute", edge, sent)
        except ModelProcessDied:
            died = True
        finally:
            if not died:
                free.put_nowait(i)
        self._restart(i)
        if retry and self.up:
            return await self.run(edge, jobs, retry=False)
        raise ModelRestart(f"the model process stopped while running a batch of {len(jobs)}; a new one is starting, retry")

    def _restart(self, i: int) -> None:
        """Replace dead process ``i``; it rejoins (warm) in the background."""
        log.error("model process %d died; starting a new one (restart %d)", i, self.restarts + 1)
        self.restarts += 1
        self.up.discard(i)
        self.channels[i].close(timeout=1.0)
        self.channels[i] = _Channel(self.spec, tuple(sorted(self.warm)))  # the new process warms before it answers
        task = asyncio.get_running_loop().create_task(self._rejoin(i))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _rejoin(self, i: int) -> None:
        try:
            await self.channels[i].call("info")  # answered once loaded and warm
        except Exception:  # noqa: BLE001 - a process that cannot even start: try again a little later
            log.exception("model process %d failed to start; retrying in 5 s", i)
            await asyncio.sleep(5.0)
            self._restart(i)
            return
        log.info("model process %d is back", i)
        self.up.add(i)
        if self._free is not None:  # else the queue, made later, starts from self.up
            self._free.put_nowait(i)

    async def warmup(self, edge: int) -> float:
        """Warm ``edge`` in every model process (seconds of the slowest); costs from the first.
        A process that dies meanwhile is replaced and warmed again (up to 2 times each)."""
        async def one(i: int) -> tuple[float, tuple[float, float], BucketCost]:
            for attempt in range(3):
                try:
                    return await self.channels[i].call("warmup", edge)
                except ModelProcessDied:
                    if attempt == 2:
                        raise
                    self._restart(i)
                    while i not in self.up:
                        await asyncio.sleep(0.05)
            raise AssertionError("unreachable")

        res = await asyncio.gather(*(one(i) for i in range(len(self.channels))))
        self.costs[edge], self.cost_model[edge] = res[0][1], res[0][2]
        self.warm.add(edge)
        return max(r[0] for r in res)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


class ModelRestart(RuntimeError):
    """The model process died during a batch; a new one has been started."""


__all__ = ["BatchOutcome", "LocalModel", "ModelProcessDied", "ModelRestart", "ProcessModel", "WorkerSpec", "batch_guard", "execute"]
