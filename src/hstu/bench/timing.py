"""Timing primitives shared by ``hstu bench`` and the scripts in ``benchmarks/``.

Calls are timed in rounds: each round makes one call of every function (the order rotated from
round to round), so that a change of load on a shared machine hits every variant alike. Wall time
per call is ``time.perf_counter`` around the call with the backend's ``synchronize`` on both sides
(device work is queued asynchronously; PyTorch docs, "CUDA semantics: asynchronous execution").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 0,
    sync: Callable[[], None] | None = None,
    setup: Callable[[str], None] | None = None,
    rotate: bool = True,
) -> dict[str, np.ndarray]:
    """Seconds per call of each function: ``warmup`` untimed rounds, then ``repeats`` timed rounds of
    one call each (order rotated per round unless ``rotate`` is False).

    Args:
        fns: name -> a function of no arguments (its result is ignored).
        repeats: timed rounds (>= 1).
        warmup: untimed rounds first (compilation, allocator, caches).
        sync: waits for queued device work (``Backend.synchronize``); None on the host.
        setup: called with the name before each timed call, outside the timed span.
    Returns:
        name -> float64 array (repeats,) of seconds.
    Raises:
        ValueError: repeats < 1 or no functions.
    """
    if repeats < 1 or not fns:
        raise ValueError(f"interleaved: need repeats >= 1 and at least one function, got {repeats} and {list(fns)}")
    sync = sync or (lambda: None)
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)] if rotate else names
        for n in order:
            if setup is not None:
                setup(n)
            sync()
            t0 = time.perf_counter()
            fns[n]()
            sync()
            times[n].append(time.perf_counter() - t0)
    return {n: np.asarray(v, dtype=np.float64) for n, v in times.items()}


def percentile_ms(seconds, q: float) -> float:
    """The q-th percentile (0..100, linear interpolation as NumPy's default) of ``seconds``, in ms."""
    return float(np.percentile(np.asarray(seconds, dtype=np.float64) * 1e3, q))


def latency_stats(seconds, batch: int) -> dict:
    """Per-call latency figures of calls that each served ``batch`` users.

    Returns ms for ``p50_ms``, ``p99_ms``, ``mean_ms``, ``min_ms``, ``max_ms``; ``qps`` = users per
    second over all calls (batch x calls / total seconds, so batch / max <= qps <= batch / min);
    ``calls``. Raises ValueError for no calls or batch < 1.
    """
    t = np.asarray(seconds, dtype=np.float64)
    if t.size == 0 or batch < 1:
        raise ValueError(f"latency_stats: need at least one call and batch >= 1, got {t.size} calls, batch {batch}")
    return {
        "p50_ms": percentile_ms(t, 50),
        "p99_ms": percentile_ms(t, 99),
        "mean_ms": float(t.mean() * 1e3),
        "min_ms": float(t.min() * 1e3),
        "max_ms": float(t.max() * 1e3),
        "qps": float(batch * t.size / t.sum()),
        "calls": int(t.size),
    }


class PeakRSS:
    """Peak resident set size of this process while the ``with`` block runs (psutil, sampled every
    ``interval_s`` by a daemon thread, plus one sample on entry and on exit; ``base_bytes``: the one on
    entry). ``peak_bytes`` is None
    when psutil is not installed (the ``bench`` / ``ops`` extras bring it)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak_bytes: int | None = None
        self.base_bytes: int | None = None  # RSS on entry
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import psutil

            self._proc = psutil.Process()
        except ImportError:
            self._proc = None

    def _sample(self) -> None:
        rss = int(self._proc.memory_info().rss)
        self.peak_bytes = rss if self.peak_bytes is None else max(self.peak_bytes, rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRSS:
        if self._proc is not None:
            self._sample()
            self.base_bytes = self.peak_bytes
            self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
