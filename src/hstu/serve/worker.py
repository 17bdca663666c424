"""Model processes: the :class:`~hstu.serve.executor.Executor` whose batches run in processes of their own.

:class:`ProcessModel` runs ``spec.workers`` model processes (``spawn``; each loads the run and
builds the runner once), so the event loop and the model run on separate cores in parallel (vLLM
V1 splits its API server and engine core the same way). Each process has one duplex
``multiprocessing`` pipe: the event loop sends a call (a batch packed as one header and its arrays'
bytes, :mod:`hstu.serve.wire`, answered the same way: dense item ids, scores and action ids, or an
error; the rare calls and their answers pickled) and reads the answer in a ``loop.add_reader``
callback, both without blocking the loop (:class:`hstu.serve.pipe.PipeEnd`), so no thread of this process takes part
(``ProcessPoolExecutor`` routes every call through a manager and a feeder thread, each waiting for
the GIL behind the event loop: 0.7 ms per round trip alone, more under load; a bare pipe 0.3 ms).
A process that dies (killed, out of memory) is seen as the pipe's end, is replaced in the
background and takes batches again once loaded and warm; its batch is retried on another live
process, or answers 503 (reason ``model_restart``) when none is live, as do new requests while
none is (``/readyz`` says "restarting" then).

The processes start in :meth:`ProcessModel.start` (the service calls it in the app's lifespan)
or, for a ``ProcessModel(spec)`` built on its own, in the constructor; :meth:`ProcessModel.close`
stops them. The in-process executor, :class:`~hstu.serve.executor.LocalModel`, and the batch
body both share (:func:`~hstu.serve.executor.execute`) are in :mod:`hstu.serve.executor`
(re-exported here).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from hstu.serve.admission import BucketCost
from hstu.serve.affinity import UserAffinity
from hstu.serve.executor import BatchOutcome, LocalModel, ModelRestart, batch_guard, execute, warm_and_measure
from hstu.generate.requests import smallest_edge
from hstu.serve.pipe import PipeEnd
from hstu.serve.runner import BatchRunner, Job
from hstu.serve.wire import ANSWER, TAG, pack_answer, pack_jobs, unpack_answer, unpack_jobs

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a model process needs to build its runner (picklable).

    run_dir, device, precision: as ``Recommender.from_run``. buckets, max_batch, use_engine, graphs: as
    :class:`BatchRunner`. threads: torch intra-op threads in the worker (None: torch's default).
    memory_threshold: the guard's minimum free fraction. workers: model processes (each loads
    the run and runs one batch at a time; more than one only where memory allows a copy each).
    ann, ann_nprobe, ann_candidates: approximate candidates (``Recommender.attach_ann``; "" = exact). prefix_cache_mb: as
    :class:`BatchRunner`.
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
    graphs: str = "auto"
    ann: str = ""  # approximate candidates: ServeConfig.ann, ann_nprobe, ann_candidates
    ann_nprobe: int = 16
    ann_candidates: int = 256
    prefix_cache_mb: float = 0.0  # ServeConfig.prefix_cache_mb


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
        if spec.ann:
            rec.attach_ann(spec.ann, spec.ann_nprobe, spec.ann_candidates)
    except Exception as exc:  # noqa: BLE001 - kept and raised by the first call, in the parent, as itself
        _WORKER["load_error"] = exc  # answered to the first call ("info" at start-up)
        return
    runner = BatchRunner(
        rec, list(spec.buckets), spec.max_batch, use_engine=spec.use_engine, graphs=spec.graphs, prefix_cache_mb=spec.prefix_cache_mb
    )
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
    return {
        "buckets": list(r.buckets),
        "max_k": r.max_k,
        "has_engine": r.engine is not None,
        "backend_name": r.backend_name,
        "precision": r.precision,
    }


def _worker_execute(edge: int, jobs: list[Job]) -> BatchOutcome:
    return execute(_WORKER["runner"], _WORKER["guard"], edge, jobs)


def _worker_warmup(edge: int) -> tuple[float, tuple[float, float], BucketCost, str]:
    r = _WORKER["runner"]
    secs, cost = warm_and_measure(r, edge)
    return secs, r.costs[edge], cost, r.backend_name  # the name now counts the graphs warmed


_OPS = {"info": _worker_info, "execute": _worker_execute, "warmup": _worker_warmup}


def exit_with_parent(interval: float = 0.5) -> None:
    """End this process once its parent (the serving process) is gone, even mid-load: a daemon
    thread polls ``os.getppid()`` every ``interval`` seconds and exits when it changes (the
    process was re-parented). Without it, a server killed while a model process still loads a
    large run (minutes, GBs) leaves that process running; after loading, the pipe's end does it.
    The parent is the one that spawned us (``multiprocessing.parent_process``), so a parent that
    died before this call is noticed too."""
    spawner = multiprocessing.parent_process()
    parent = spawner.pid if spawner is not None else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="hstu-parent-watch", daemon=True).start()


def _worker_main(conn, spec: WorkerSpec, warm: tuple[int, ...]) -> None:
    """The model process: load, then answer calls in order until "stop" or the pipe's end (the
    serving process is gone): a packed batch with a packed answer (its outcome or its error,
    :func:`hstu.serve.wire.pack_answer`), a pickled ``(op, args)`` with ``("ok", value)`` or
    ``("err", exception)``."""
    # Ctrl-C, and SIGTERM to the process group (systemd's KillMode=control-group, `timeout`), reach us with the server:
    # it drains, then stops us ("stop", the pipe's end, SIGKILL after close()'s timeout; exit_with_parent if it dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a spawned process starts with no logging set up (its warnings were bare stderr lines): the server's format, warnings up
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s [model process] %(name)s: %(message)s")
    exit_with_parent()
    _worker_init(spec, warm)
    while True:
        try:
            buf = conn.recv_bytes()
        except (EOFError, OSError):
            return
        packed = buf[:1] == TAG  # a batch comes packed and is answered packed (hstu.serve.wire), any other call pickled
        try:
            op, args = ("execute", unpack_jobs(buf)) if packed else ForkingPickler.loads(buf)
        except Exception as exc:  # noqa: BLE001 - a message that does not decode: answered, the process keeps serving
            _reply_error(conn, packed, RuntimeError(f"model process: cannot read the call: {type(exc).__name__}: {exc}"))
            continue
        if op == "stop":
            return
        try:
            value, ok = _OPS[op](*args), True
        except Exception as exc:  # noqa: BLE001 - raised again in the serving process (wire.error_from / pickled as itself)
            value, ok = exc, False
        try:
            if packed:
                conn.send_bytes(pack_answer(value))
            else:
                conn.send(("ok", value) if ok else ("err", value))
        except Exception as exc:  # noqa: BLE001 - an answer that does not encode (nothing was written then)
            _reply_error(conn, packed, RuntimeError(f"model process: cannot send the {op} answer: {type(exc).__name__}: {exc}"))


def _reply_error(conn, packed: bool, err: Exception) -> None:
    if packed:
        conn.send_bytes(pack_answer(err))
    else:
        conn.send(("err", err))


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
        self.pipe = PipeEnd(self.conn, self._on_message, self._died)
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
        return self.send(bytes(ForkingPickler.dumps((op, args))))

    def send(self, message: bytes) -> asyncio.Future:
        """Send one encoded call (pickled ``(op, args)``, or a packed batch of :mod:`hstu.serve.wire`); as :meth:`call`.
        Written through :class:`hstu.serve.pipe.PipeEnd` (whatever its size, without blocking the loop)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.dead:
            self.pipe.attach(loop)  # first call in this loop: the pipe is watched from now on
            self.pending.append(fut)
            self.pipe.send(message)  # a pipe found closed: _died has failed fut
        elif not fut.done():
            fut.set_exception(ModelProcessDied(f"the model process ended (exit code {self.proc.exitcode})"))
        return fut

    def _on_message(self, buf: bytes) -> None:
        if not self.pending:  # nothing asked: not an answer of ours
            log.warning("model process sent %d bytes nobody asked for; dropped", len(buf))
            return
        fut = self.pending.popleft()
        try:
            if buf[:1] == ANSWER:  # a batch's answer (hstu.serve.wire): an outcome, or the call's error
                value = unpack_answer(buf)
                status = "err" if isinstance(value, BaseException) else "ok"
            else:
                status, value = ForkingPickler.loads(buf)
        except Exception as exc:  # noqa: BLE001 - a frame that does not decode, an exception type that does not unpickle
            status, value = "err", RuntimeError(f"cannot read the model process's answer: {type(exc).__name__}: {exc}")
        if not fut.done():  # a cancelled waiter's answer is dropped
            fut.set_result(value) if status == "ok" else fut.set_exception(value)

    def _died(self) -> None:
        self.dead = True
        self.pipe.detach()
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
        self.pipe.detach()  # blocking again: the Connection calls below
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
    """The :class:`~hstu.serve.executor.Executor` on ``spec.workers`` model processes of their
    own (module docstring), one batch each at a time.

    Args:
        spec: what each process loads and builds.
        start_timeout_s: the longest a process may take to load the run.
        start_retries: a process that dies while loading (killed, out of memory) is started again
            up to this many times.
        start: start the processes in the constructor (blocking until loaded); False leaves it to
            :meth:`start` (the service's lifespan), so that building one starts nothing.

    Raises (from the start): what loading raised (FileNotFoundError, ValueError, ...);
    TimeoutError after ``start_timeout_s``; ModelProcessDied, in one line, when a process kept
    dying while loading. ValueError: ``spec.workers`` < 1 (at once).

    Until started: ``buckets`` are ``spec.buckets``, ``available`` is 0, ``max_k`` 0,
    ``precision`` empty and ``backend_name`` says "not started".
    """

    def __init__(self, spec: WorkerSpec, start_timeout_s: float = 300.0, start_retries: int = 2, *, start: bool = True) -> None:
        if spec.workers < 1:
            raise ValueError(f"WorkerSpec.workers must be >= 1, got {spec.workers}")
        self.spec, self.start_timeout_s, self.start_retries = spec, start_timeout_s, max(0, int(start_retries))
        self.slots = spec.workers
        self.buckets, self.max_k = list(spec.buckets), 0
        self.has_engine, self.backend_name, self.precision = False, "model process (not started)", {}
        self._suffix = " (model process)" if spec.workers == 1 else f" ({spec.workers} model processes)"  # of backend_name
        self.warm: set[int] = set()
        self.costs: dict[int, tuple[float, float]] = {}
        self.cost_model: dict[int, BucketCost] = {}  # bucket -> admission cost line, measured at warm-up
        self.restarts = 0
        self.channels: list[_Channel] = []
        self.up: set[int] = set()  # loaded and not restarting
        self._free: asyncio.Queue | None = None  # indices of idle live processes, made in the running loop
        self.affinity = UserAffinity() if spec.prefix_cache_mb > 0 and spec.workers > 1 else None  # per-process caches
        self._tasks: set[asyncio.Task] = set()
        if start:
            self.start_now()

    async def start(self) -> None:
        """:meth:`start_now` from the app's lifespan. It blocks the event loop while the processes
        load, on purpose: nothing is served before the lifespan's start-up ends, and Ctrl-C then
        reaches the waiting call as KeyboardInterrupt, which stops the processes (a thread would
        go on loading while the interpreter waits for it)."""
        self.start_now()

    def start_now(self) -> None:
        """Start the model processes and wait until each has loaded the run (a no-op once started).
        Raises as the class docstring says; the processes are stopped then."""
        if self.channels:
            return
        spec = self.spec
        self.channels = [_Channel(spec, ()) for _ in range(spec.workers)]
        try:
            info = [self._load(i) for i in range(spec.workers)][0]  # noqa: RUF015 - waits for every process
        except BaseException:
            self.close()
            raise
        self.buckets, self.max_k = info["buckets"], info["max_k"]
        self.has_engine, self.backend_name = info["has_engine"], info["backend_name"] + self._suffix
        self.precision = info["precision"]  # as loaded by the model process
        self.up = set(range(spec.workers))

    def _load(self, i: int) -> dict:
        """Wait for process ``i`` to load the run (its "info"); start it again when it died meanwhile."""
        for attempt in range(self.start_retries + 1):
            try:
                return self.channels[i].call_sync("info", timeout=self.start_timeout_s)
            except ModelProcessDied:
                how = self.channels[i].ended()
                if attempt == self.start_retries:
                    raise ModelProcessDied(
                        f"the model process ended while loading the run {attempt + 1} time(s) (last: {how}); "
                        f"see the log above for why (memory? a killed process?)"
                    ) from None
                log.error(
                    "model process %d ended while loading the run (%s); starting it again (%d of %d)",
                    i,
                    how,
                    attempt + 1,
                    self.start_retries,
                )
                self.restarts += 1
                self.channels[i].close(timeout=1.0)
                self.channels[i] = _Channel(self.spec, ())
        raise AssertionError("unreachable")

    def pid(self, i: int = 0) -> int | None:
        """Process id of model process ``i`` (tests kill it through this)."""
        return self.channels[i].proc.pid

    def bucket_for(self, length: int) -> int:
        return smallest_edge(self.buckets, length)

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
        with none live, raises ModelRestart (503). With per-process prefix caches, of several idle
        processes the one that last ran most of the batch's users (:mod:`hstu.serve.affinity`)."""
        free = self._free_queue()
        i = await free.get()
        if self.affinity is not None:  # the other idle ones go back, in their order
            idle = [i]
            while not free.empty():
                idle.append(free.get_nowait())
            i = self.affinity.choose(idle, (j.user_id for j in jobs))
            for p in idle:
                if p != i:
                    free.put_nowait(p)
        message = pack_jobs(edge, jobs)  # arrays in one buffer, no pickled Job (the asyncio future stays here)
        died = False
        try:
            return await self.channels[i].send(message)
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

        async def one(i: int) -> tuple[float, tuple[float, float], BucketCost, str]:
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
        self.backend_name = res[0][3] + self._suffix  # the first process's graphs (each loads the same cache)
        self.warm.add(edge)
        return max(r[0] for r in res)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


__all__ = ["BatchOutcome", "LocalModel", "ModelProcessDied", "ModelRestart", "ProcessModel", "WorkerSpec", "batch_guard", "execute"]
