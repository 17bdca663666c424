"""``hstu doctor --conformance``: every ATen op the model runs, replayed on a device against the CPU
reference, each bucket's device graphs against eager, next-5 timed; one report file to send back.

What it does (issue 19, "the same checks for Ascend owners"):

1. **Record** (CPU): the model's training forward and backward (``HSTUModel.encode`` of a padded batch
   and the gradient of a scalar of it) and the engine's eager greedy next-5 are run under a
   ``TorchDispatchMode`` (https://pytorch.org/docs/stable/notes/extending.html) that keeps, per ATen
   op, the first ``calls_per_op`` calls: inputs cloned before the call, outputs after it.
2. **Replay** (device): each recorded call runs again with its tensors (and ``device=`` keywords) moved
   to the device; every tensor output is compared with the CPU one. Floating outputs: relative error
   ``max|dev - cpu| / max(max|cpu|, tiny)`` (NaN where CPU has none counts as inf) against
   :data:`TOLERANCE` of the output dtype; integer / bool outputs must be equal. Uninitialised outputs
   (``aten.empty*``) and random ops are listed, not compared.
3. **End to end**: the user vectors of ``encode`` on the device against CPU (relative error) and the
   next-5 items of an eager engine on the device against the CPU engine's (identical items).
4. **Graphs**: per bucket, an engine in the device's graph mode (``Backend.graph_mode``: CUDA graphs,
   NPU graphs) against a device eager engine: identical items, and next-5 P50 of both at batch 1 and
   16 (alternated calls, :func:`hstu.bench.timing.interleaved`). A device without a graph mode (CPU)
   reports the section as skipped.

The device defaults to ``npu``; where it is not usable the command says why and exits 2 (nothing is
written). ``--device cpu`` replays on the CPU itself (a check of the tool: every error is 0). A quantized run
(``hstu quantize``) is refused, naming the float run it came from (:func:`refuse_quantized` says why), as are
a ``--report`` directory or missing parent, before anything runs.
Exit 0: every compared op and check within tolerance; 1: some are not (the report lists them).
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}
"""Relative error allowed per floating output dtype (fp32: 2e-3 allows reduced-precision (HF32 / TF32)
matmul accumulation on NPU and CUDA; the model's own output tolerance is the end-to-end check)."""

NOT_COMPARED = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided", "aten.rand", "aten.randn", "aten.randint")
NOT_COMPARED += ("aten.normal", "aten.uniform", "aten.bernoulli", "aten.multinomial", "aten.exponential", "aten.set_", "aten.resize_")


@dataclass
class OpCall:
    """One recorded call: the op, its CPU inputs (cloned before the call) and CPU outputs."""

    op: Any
    args: tuple
    kwargs: dict
    out: Any


class OpRecorder(TorchDispatchMode):
    """Keeps the first ``calls_per_op`` calls of every ATen op dispatched under it (by overload name)."""

    def __init__(self, calls_per_op: int = 3) -> None:
        super().__init__()
        self.calls_per_op = calls_per_op
        self.calls: dict[str, list[OpCall]] = {}
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        self.counts[name] = self.counts.get(name, 0) + 1
        keep = len(self.calls.setdefault(name, [])) < self.calls_per_op
        saved = (tree_map(_clone, args), tree_map(_clone, kwargs)) if keep else None
        out = func(*args, **kwargs)
        if keep:
            self.calls[name].append(OpCall(func, saved[0], saved[1], tree_map(_clone, out)))
        return out


def op_name(func) -> str:
    """``aten.mm.default``-style name of an ATen overload."""
    return str(func)


def _clone(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _to(device: torch.device) -> Callable:
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, torch.device) and x.type == "cpu":
            return device
        return x

    return move


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Floating tensors: max|got - want| / max(max|want|, tiny), in float64; inf for a shape mismatch or
    a NaN / inf where ``want`` has a finite value. Other dtypes: 0.0 when equal, else 1.0 (the
    fraction of differing elements, at least one element's worth)."""
    got = got.detach().to("cpu")
    if got.shape != want.shape:
        return float("inf")
    if not want.is_floating_point():
        diff = (got != want).sum().item()
        return 0.0 if diff == 0 else max(diff / max(want.numel(), 1), 1e-12)
    g, w = got.double(), want.double()
    finite = torch.isfinite(w)
    if bool((~torch.isfinite(g) & finite).any()) or not torch.equal(torch.isnan(g), torch.isnan(w)):
        return float("inf")
    if not bool(finite.any()):
        return 0.0
    scale = max(w[finite].abs().max().item(), torch.finfo(torch.float32).tiny)
    return (g[finite] - w[finite]).abs().max().item() / scale


def replay(calls: dict[str, list[OpCall]], device: torch.device, run: Callable | None = None) -> list[dict]:
    """Each recorded call again on ``device``; one row per op: calls recorded / compared, the largest
    relative error over its tensor outputs, the tolerance and status ("pass", "fail", "error",
    "not compared"). ``run(func, args, kwargs)`` executes a call (default: ``func(*args, **kwargs)``)."""
    run = run or (lambda f, a, k: f(*a, **k))
    move = _to(device)
    rows = []
    for name in sorted(calls):
        row: dict[str, Any] = {"op": name, "calls_checked": len(calls[name])}
        if name.startswith(NOT_COMPARED):
            rows.append(row | {"status": "not compared", "why": "uninitialised or random output"})
            continue
        worst, tol = 0.0, 0.0
        try:
            for c in calls[name]:
                with torch.inference_mode():
                    out = run(c.op, tree_map(move, c.args), tree_map(move, c.kwargs))
                for g, w in zip(tree_flatten(out)[0], tree_flatten(c.out)[0], strict=True):
                    if isinstance(w, torch.Tensor):
                        worst = max(worst, relative_error(g, w))
                        tol = max(tol, TOLERANCE.get(w.dtype, 0.0))
        except Exception as exc:  # noqa: BLE001 - an op the device cannot run is the finding
            rows.append(row | {"status": "error", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        rows.append(row | {"max_rel_error": worst, "tolerance": tol, "status": "pass" if worst <= tol else "fail"})
    return rows


def tiny_batch(num_items: int, width: int, batch: int = 4, seed: int = 0):
    """(ids, timestamps, lengths) of ``batch`` histories of mixed lengths in 1..width (int64, CPU)."""
    g = torch.Generator().manual_seed(seed)
    L = torch.linspace(max(1, width // 4), width, batch).round().long()
    ids = torch.randint(1, num_items + 1, (batch, width), generator=g)
    ts = 10**9 + torch.cumsum(torch.randint(1, 10**5, (batch, width), generator=g), dim=1)
    live = torch.arange(width).view(1, -1) < L.view(-1, 1)
    return ids * live, ts * live, L


@dataclass
class Conformance:
    """The checks of one model on one device (see the module docstring). ``model`` is on the CPU in
    eval mode; ``buckets`` the engine's edges; ``calls_per_op`` recorded calls per op; ``reps`` timed
    next-5 rounds per side."""

    model: torch.nn.Module
    device: torch.device
    buckets: tuple[int, ...] = (20, 50, 100, 200)
    calls_per_op: int = 3
    reps: int = 20
    counts: dict[str, int] = field(default_factory=dict)

    def record(self) -> dict[str, list[OpCall]]:
        """Record the training forward + backward and the engine's next-5 (all on the CPU)."""
        from copy import deepcopy

        from hstu.generate.engine import Engine

        m, W = self.model, min(self.buckets[-1], self.model.cfg.max_seq_len)
        ids, ts, L = tiny_batch(m.cfg.num_items, W)
        rec = OpRecorder(self.calls_per_op)
        with rec:
            with torch.enable_grad():
                m.encode(ids, ts, L).pow(2).mean().backward()
            m.zero_grad(set_to_none=True)
            # the engine hardens the model it is given: a copy, so encode above keeps its gradients
            eng = Engine(deepcopy(m), buckets=self.buckets, max_batch=4, k_max=5, graphs="eager", device="cpu")
            eng.generate(ids, ts, L, 5)
        self.counts = rec.counts
        return rec.calls

    def end_to_end(self) -> dict:
        """encode's user vectors and eager next-5 items, device against CPU."""
        from copy import deepcopy

        from hstu.generate.engine import Engine

        W = min(self.buckets[-1], self.model.cfg.max_seq_len)
        ids, ts, L = tiny_batch(self.model.cfg.num_items, W, seed=1)
        dev_model = deepcopy(self.model).to(self.device)
        with torch.inference_mode():
            want = self.model.encode(ids, ts, L)
            got = dev_model.encode(ids.to(self.device), ts.to(self.device), L.to(self.device))
            out = {"encode_rel_error": relative_error(got, want)}
            cpu = Engine(deepcopy(self.model), buckets=self.buckets, max_batch=4, k_max=5, graphs="eager", device="cpu")
            dev = Engine(dev_model, buckets=self.buckets, max_batch=4, k_max=5, graphs="eager", device=self.device)
            a, b = cpu.generate(ids, ts, L, 5), dev.generate(ids.to(self.device), ts.to(self.device), L.to(self.device), 5)
        same = (a.items == b.items.cpu()).float().mean().item()
        out |= {"next5_same_items_ratio": same, "next5_score_rel_error": relative_error(b.scores, a.scores)}
        tol = TOLERANCE[torch.float32]
        out["status"] = "pass" if same == 1.0 and out["encode_rel_error"] <= tol else "fail"
        return out

    def graphs(self) -> dict:
        """Per bucket: device graphs against device eager (identical items) and next-5 P50 at batch 1 / 16."""
        from copy import deepcopy

        from hstu.backend import for_device
        from hstu.bench.timing import interleaved
        from hstu.bench.timing import percentile_ms as pct
        from hstu.generate.engine import Engine

        be = for_device(self.device)
        if be.graph_mode is None or not be.supports_graphs:
            return {"status": "skipped", "why": f"{be.name}: no device graph mode ({be.graphs_unavailable_reason()})"}
        m = deepcopy(self.model).to(self.device)
        kw = dict(buckets=self.buckets, max_batch=16, k_max=5, batch_sizes=(1, 16), device=self.device)
        eng = {"eager": Engine(m, graphs="eager", **kw), be.graph_mode: Engine(m, graphs=be.graph_mode, **kw)}
        eng[be.graph_mode].warmup()
        rows, ok = {}, True
        for E in self.buckets:
            for B in (1, 16):
                ids, ts, L = (t.to(self.device) for t in tiny_batch(m.cfg.num_items, E, batch=B, seed=E + B))
                res = {k: e.generate(ids, ts, L, 5) for k, e in eng.items()}
                same = torch.equal(res["eager"].items, res[be.graph_mode].items)
                fns = {k: (lambda e=e, x=(ids, ts, L): e.generate(*x, 5)) for k, e in eng.items()}
                t = interleaved(fns, self.reps, warmup=1, sync=be.synchronize)
                rows[f"E{E}_B{B}"] = {"same_items": same} | {f"{k}_p50_ms": round(pct(v, 50), 3) for k, v in t.items()}
                ok &= same
        return {"status": "pass" if ok else "fail", "mode": be.graph_mode, "next5": rows}

    def run(self, run_op: Callable | None = None) -> dict:
        """All sections; returns the report (a JSON-ready dict) with ``status`` "pass" or "fail"."""
        t0 = time.perf_counter()
        ops = replay(self.record(), self.device, run_op)
        for r in ops:
            r["calls_in_model"] = self.counts.get(r["op"], 0)
        e2e, graphs = self.end_to_end(), self.graphs()
        bad = [r["op"] for r in ops if r["status"] in ("fail", "error")]
        failed = bool(bad) or e2e["status"] == "fail" or graphs["status"] == "fail"
        return {
            "status": "fail" if failed else "pass",
            "device": device_facts(self.device),
            "model": {"cfg": repr(self.model.cfg), "buckets": list(self.buckets)},
            "ops_failed": bad,
            "ops": ops,
            "end_to_end": e2e,
            "graphs": graphs,
            "seconds": round(time.perf_counter() - t0, 1),
        }


def device_facts(device: torch.device) -> dict:
    """Host, torch (and torch_npu where importable) versions and the device's name."""
    from hstu.backend import for_device

    facts = {"device": str(device), "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__}
    try:
        import torch_npu  # noqa: F401 - only its version

        facts["torch_npu"] = getattr(torch_npu, "__version__", "?")
    except ImportError:
        pass
    facts["name"] = for_device(device).device_name()
    return facts


def refuse_quantized(run: str | Path) -> None:
    """ValueError naming ``run`` and the float run it was made from where ``run`` is quantized (holds quant.json).

    The checks need the float model: the training forward and backward (a quantized model has no trainable
    weights), float ops replayed within :data:`TOLERANCE` and an fp32 end-to-end bound; an INT8 copy also runs a
    CPU-only prepacked GEMM (:mod:`hstu.quant.int8_kernels`) where a device runs another kernel, so there is no
    op-for-op reference. The float run exercises every op the device runs for it."""
    from hstu.runs import read_quant_meta

    meta = read_quant_meta(run)
    if meta is None:
        return
    src = meta.get("source_run")
    raise ValueError(
        f"--run {run} is a quantized run ({meta.get('scheme', '?')}, quant.json): conformance checks float weights only; "
        f"check the float run it was made from{f' (--run {src})' if src else ''}"
    )


def check_report_path(path: Path) -> Path:
    """``path`` if a report can be written there; ValueError naming it for a directory or a missing parent
    (checked before the run, which takes minutes)."""
    if path.is_dir():
        raise ValueError(f"--report {path}: is a directory; give a file path, e.g. {path / 'hstu_conformance.json'}")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"--report {path}: {parent} {'is not a directory' if parent.exists() else 'does not exist'}")
    return path


def write_report(report: dict, path: Path) -> Path:
    """Write ``report`` as JSON to ``path`` whole or not at all (:func:`hstu.generate.batch_parts.atomic_write`: a
    temporary file, renamed, removed on any failure). Raises OSError (e.g. ``path`` a directory, no parent)."""
    from hstu.generate.batch_parts import atomic_write

    data = (json.dumps(report, indent=2, default=str) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(data))
    return path


def render(report: dict) -> str:
    """A few lines for the terminal: counts per status, the failed ops, end to end, graphs."""
    ops = report["ops"]
    by = {s: sum(r["status"] == s for r in ops) for s in ("pass", "fail", "error", "not compared")}
    lines = [f"conformance on {report['device']['device']} ({report['device']['name']}): {report['status'].upper()}"]
    lines.append(f"  ops: {len(ops)} distinct, " + ", ".join(f"{n} {s}" for s, n in by.items()))
    for r in ops:
        if r["status"] in ("fail", "error"):
            what = r.get("error") or f"rel error {r['max_rel_error']:.2e} > {r['tolerance']:.0e}"
            lines.append(f"    {r['status']}: {r['op']} {what}")
    e = report["end_to_end"]
    same = e["next5_same_items_ratio"]
    lines.append(f"  end to end: encode rel error {e['encode_rel_error']:.2e}, next-5 same items {same:.3f}: {e['status']}")
    g = report["graphs"]
    lines.append(f"  graphs: {g['status']}" + (f" ({g['why']})" if "why" in g else f" ({g['mode']}, {len(g['next5'])} shapes)"))
    return "\n".join(lines)
