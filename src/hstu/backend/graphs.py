"""Device graphs and compiled graphs of the engine's static-shape runners.

Two ways to run a runner (a function of no arguments over static buffers) without re-dispatching
every op from Python:

- capture once, replay (:class:`GraphRunner`): CUDA graphs; NPU graphs under torch_npu. PyTorch
  docs, "CUDA Graphs" (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs); torch_npu
  mirrors the API as ``torch.npu.NPUGraph`` / ``torch.npu.graph``. ``Backend.capture_graph(fn)``.
- compile (:func:`compile_graph`, :class:`CompiledRunner`): ``torch.compile(dynamic=False,
  fullgraph=True)``, Inductor by default (C++ / OpenMP code on the CPU, Triton on GPUs; PyTorch
  docs, "torch.compile"). ``Backend.compile_graph(fn, name, backend)``. A failed compilation
  falls back to the eager function with a warning: eager is the fallback and the oracle.

Graph modes: "eager"; "compile" (torch.compile); "cuda_graph" / "npu_graph" (owned by one backend
each, ``Backend.graph_mode``); "auto" (the device's graph mode where it can capture, else eager);
"compiled" (the device's graph mode where it can capture, else torch.compile:
``Backend.resolve_graph_mode``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# graph modes an engine may ask for; the device ones are owned by one backend each (Backend.graph_mode)
GRAPH_MODES = ("auto", "eager", "compiled", "compile", "cuda_graph", "npu_graph")


class GraphRunner:
    """Capture ``fn`` (it must read only static buffers) into a device graph; calls replay it.

    Device-generic over ``api`` = ``torch.cuda`` or ``torch.npu`` (``Stream``, ``current_stream``,
    ``stream``, ``graph``) with ``graph_cls`` = its graph class. Two warm-up runs on a side stream
    first, as the PyTorch docs require; ``fn`` must be idempotent (it is run three times before the
    first replay).

    Calling returns the tensor ``fn`` returned at capture, refreshed in place by the replay.
    """

    def __init__(self, fn: Callable[[], torch.Tensor], api: ModuleType, graph_cls: type) -> None:
        side = api.Stream()
        side.wait_stream(api.current_stream())
        with api.stream(side):
            for _ in range(2):
                fn()
        api.current_stream().wait_stream(side)
        self.graph = graph_cls()
        with api.graph(self.graph):
            self.out = fn()

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


def compile_graph(fn: Callable[[], torch.Tensor], name: str, backend: str | Callable = "inductor") -> Callable[[], torch.Tensor]:
    """``torch.compile(dynamic=False, fullgraph=True)`` of ``fn`` under its own code object ``name``.

    The engine builds every (bucket, batch size, step kind) runner from one closure per kind, so all
    of them share a code object; TorchDynamo caches graphs per code object and, past its
    ``recompile_limit`` (8), silently runs eager. A copy of the code object per runner gives each
    runner its own cache with one entry (one guard check per call) and names the frame in profiles.
    ``fullgraph=True``: a graph break raises (and :class:`CompiledRunner` falls back) instead of
    running a partly compiled function.

    Args:
        fn: a function of no arguments (reads static buffers); name: a Python identifier.
        backend: a torch.compile backend ("inductor"; "aot_eager" traces without code generation).
    Returns:
        the compiled function; it compiles on its first call (exceptions surface there).
    """
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    own = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    return torch.compile(own, dynamic=False, fullgraph=True, backend=backend)


def describe_failure(exc: BaseException) -> str:
    """One line for a compiler exception: its type, and the innermost cause's type and first line
    (torch.compile wraps a backend's error in BackendCompilerFailed, ``inner_exception``)."""
    root = exc
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner
    first = next((ln.strip() for ln in str(root).splitlines() if ln.strip()), "")[:300]
    return f"{type(exc).__name__}" + (f" <- {type(root).__name__}" if root is not exc else "") + f": {first}"


def replay_stance(skip_guards: bool):
    """The context an engine call runs its compiled graphs in: with ``skip_guards``, TorchDynamo's
    ``skip_guard_eval_unsafe`` stance (``torch.compiler.set_stance``), else a no-op context.

    Each engine runner is compiled with static shapes under its own code object (one cache entry,
    :func:`compile_graph`) over buffers allocated once, and every call runs inside the engine's
    ``inference_mode``: the guards that TorchDynamo checks before each call (every captured tensor's
    identity, size, stride, dtype, device, and the grad mode) hold by construction, so checking them is
    pure overhead: measured ~125 us per call, ~10 % of a compiled next-5 (small preset, batch 1, one
    thread). The stance's own enter/exit (~20-30 us) is paid once per engine call. PyTorch docs,
    ``torch.compiler.set_stance``: safe only when no recompilation can be needed after warm-up, which
    holds for these runners. A first call, which compiles, leaves the stance for its duration
    (TorchDynamo refuses to compile under it): :class:`CompiledRunner`. The stance is process-wide,
    not per thread: another thread compiling during an engine call would be refused (a server's model
    process runs one engine thread)."""
    if not skip_guards:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


def runs_as(runner) -> str:
    """What a called :class:`CompiledRunner` or graph-cache ``CachedRunner`` runs now: "compiled",
    "loaded" / "built" (from / into the graph cache), "eager" (a fallback or, under a cache alone,
    a graph it lacks) or "pending" (not called yet)."""
    mode = runner.mode
    if mode == "fallback":  # a CachedRunner's: its CompiledRunner, or the eager function itself
        fb = runner.fallback
        return runs_as(fb) if isinstance(fb, CompiledRunner) else "eager"
    return "eager" if mode.startswith("eager") else mode


class CompiledRunner:
    """A compiled runner with an eager fallback: the first call compiles (and runs) ``compiled``;
    if that raises, a warning names ``label`` and the error, and this and every later call runs
    ``eager`` (the runners are idempotent: they read static buffers and write the same cache rows,
    so running eager after a failed attempt gives the eager result).

    Attributes:
        mode: "pending" before the first call, then "compiled" or "eager (fallback)".
        compile_s: seconds of the first call (compilation + one run; the failed attempt on fallback).
        error: ``"Type: message"`` of the failed compilation, else None.
    """

    def __init__(self, compiled: Callable[[], torch.Tensor], eager: Callable[[], torch.Tensor], label: str) -> None:
        self.compiled, self.eager, self.label = compiled, eager, label
        self.mode, self.compile_s, self.error, self.bytes = "pending", 0.0, None, 0  # bytes: none on disk
        self._fn: Callable[[], torch.Tensor] | None = None

    def __call__(self) -> torch.Tensor:
        if self._fn is not None:
            return self._fn()
        t0 = time.perf_counter()
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=False):  # compiling: out of replay_stance
                out = self.compiled()
            self.mode, self._fn = "compiled", self.compiled
        except Exception as exc:  # any compiler failure (inductor, C++ toolchain, dynamo): eager stays correct
            self.error = describe_failure(exc)
            log.warning("compiling %s failed (%s); running it eager", self.label, self.error)
            self.mode, self._fn = "eager (fallback)", self.eager
            out = self.eager()
        self.compile_s = time.perf_counter() - t0
        log.info("%s: %s in %.2f s", self.label, self.mode, self.compile_s)
        return out


__all__ = ["GRAPH_MODES", "CompiledRunner", "GraphRunner", "compile_graph", "replay_stance"]
