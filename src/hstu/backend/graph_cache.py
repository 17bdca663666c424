"""An on-disk cache of the engine's compiled bucket graphs beside a run: AOTInductor packages that a
server start loads (milliseconds each) instead of compiling (15-110 s each on a 2-core CPU).

Why not the runner as is. An engine runner (hstu.generate.runners) is a closure of no arguments
over static buffers: the bucket's inputs, the KV pool it writes in place, the engine's position
table. ``torch.export`` of such a closure lifts every captured tensor as a constant: the package
would embed its own copy of the buffers (the engine's per-request ``BucketPool.load`` would never
reach it) and the in-place KV writes would land in that copy. The nearest working form,
:class:`StaticInputs`: the same runner rebuilt inside ``forward`` from its buffers given as inputs
(each view re-made with ``as_strided`` on its base tensor), the model a submodule (its weights the
package's constants). ``torch.export.export(strict=False)`` keeps the in-place writes (its training
IR is not functionalised) and AOTInductor compiles them as writes into the input buffers, so a call
with the engine's own buffers computes what the eager runner computes, in place.

PyTorch docs, "AOTInductor: Ahead-Of-Time Compilation for Torch.Export-ed Models"
(``torch._inductor.aoti_compile_and_package``, ``torch._inductor.aoti_load_package``) and
"torch.export" (non-strict mode).

Layout: ``RUN/graphs/manifest.json`` (``{"format": 2, "entries": {name: entry}}``) and one
``NAME.pt2`` per graph. ``name`` = step kind, bucket edge, batch size (and T or W), and a hash of
the runner's interface (every input's shape, dtype, stride and offset, the engine's settings that
shape the graph, the model config). An entry records what it was built for: the run's weights
(sha256 of the state dict), precision, device, torch version, the source of the code the graph
traces; and its file's bytes and sha256. :meth:`GraphCache.check` compares all of them: a
mismatch (other weights, other torch version, edited code) or a truncated / corrupt file is never
loaded; the entry is rebuilt (``build=True``) or refused (``build=False``), with a warning that
says which field differs. A failed load or build falls back to torch.compile, then eager, with a
warning (:class:`CachedRunner`).
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from hstu.backend.graphs import CompiledRunner, describe_failure
from hstu.model.checkpoint import file_sha256

log = logging.getLogger(__name__)

FORMAT = 2  # 2: packages without the weights (AOTInductor.load supplies them)
MANIFEST = "manifest.json"
LAYOUT = "layout.json"  # the engine layouts graphs were built for: {"layouts": [{"buckets": [...], "max_batch": N}, ...]}
DIRNAME = "graphs"  # RUN/graphs
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # an entry's precision (a float model's dtype) -> the flag's name


def model_precision(model: torch.nn.Module) -> str:
    """The precision an entry records: the quantization scheme ("int8", "bf16", ...), else the float model's dtype."""
    q = getattr(model, "quant_meta", None) or {}
    return q.get("scheme", str(model.pos_emb.weight.dtype).removeprefix("torch."))


def _short(precision) -> str:
    return _SHORT.get(str(precision), str(precision))


_CODE = ("model", "ops", "generate/runners.py", "generate/pool.py")  # sources the graphs trace (relative to hstu/)


class GraphCacheError(RuntimeError):
    """A cache entry that must not be used; the message names the file and the field that differs."""


class ManifestError(GraphCacheError):
    """The cache's manifest cannot be read (every entry unusable until a build writes a new one); ``what`` says
    which file and why, the message adds how to rebuild it."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}; rebuild it: hstu export --graphs")
        self.what = what


def manifest_entries(path: Path) -> dict:
    """The entries of the manifest at ``path`` ({} when there is none). ManifestError: unreadable, naming it."""
    if not path.exists():
        return {}
    try:
        return dict(json.loads(path.read_text())["entries"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{path}: not a graph-cache manifest ({exc})") from None


def torch_version() -> str:
    """The running torch's version (a function so that tests can pretend another one)."""
    return torch.__version__


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over the state dict's names, dtypes, shapes and bytes (sorted by name): the run's
    weights as this process holds them (after any precision conversion)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def code_sha256() -> str:
    """sha256 of the hstu sources a graph traces (hstu/model, hstu/ops, the engine's runners and pool)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in _CODE:
        p = root / rel
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _tensor_attrs(obj) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """The tensor attributes of ``obj`` (and its lists of tensors), by name."""
    out = {}
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor) or (isinstance(v, list) and v and all(isinstance(x, torch.Tensor) for x in v)):
            out[k] = v
    return out


class StaticInputs(torch.nn.Module):
    """A runner as a module of its buffers: ``forward(*roots)`` rebuilds ``make(eng, b)`` on shallow
    copies of ``eng`` and ``b`` whose tensor attributes are views of the given roots (the base
    tensors of every tensor attribute of both, in first-seen order), and runs it.

    ``roots`` holds the real base tensors (pass them to the exported program: it writes into them).
    ``signature()`` lists what the compiled graph depends on besides the weights.
    """

    def __init__(self, make: Callable, eng, b) -> None:
        super().__init__()
        self.model = eng.model  # a submodule: its parameters are the program's, not inputs
        self._eng, self._b, self._make = eng, b, make
        self.roots: list[torch.Tensor] = []
        seen: dict[int, int] = {}
        self.spec: dict[tuple[str, str], tuple[bool, list[tuple]]] = {}
        for which, obj in (("eng", eng), ("b", b)):
            for name, v in _tensor_attrs(obj).items():
                parts = []
                for t in v if isinstance(v, list) else [v]:
                    base = t if t._base is None else t._base
                    if id(base) not in seen:
                        seen[id(base)] = len(self.roots)
                        self.roots.append(base)
                    parts.append((seen[id(base)], tuple(t.shape), t.stride(), t.storage_offset()))
                self.spec[(which, name)] = (isinstance(v, list), parts)

    def forward(self, *roots: torch.Tensor) -> torch.Tensor:
        e, p = copy.copy(self._eng), copy.copy(self._b)
        for (which, name), (is_list, parts) in self.spec.items():
            views = [roots[i].as_strided(size, stride, off) for i, size, stride, off in parts]
            setattr(e if which == "eng" else p, name, views if is_list else views[0])
        return self._make(e, p)()

    def signature(self) -> list:
        roots = [(tuple(r.shape), str(r.dtype), r.stride()) for r in self.roots]
        return [roots, sorted((f"{w}.{n}", parts) for (w, n), (_, parts) in self.spec.items())]


class AOTInductor:
    """The default compiler: ``torch.export`` (non-strict) then AOTInductor into a .pt2 package
    without the weights (``aot_inductor.package_constants_in_so=False``): :meth:`load` points the
    package's constants at the module's own parameters (``load_constants(user_managed=True)``), so
    a package's bytes do not grow with the item table and the loaded graphs share one copy of the
    weights. GraphCacheError when the package needs a constant the module does not have."""

    name = "aotinductor"

    def build(self, module: StaticInputs, path: Path) -> None:
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # torch 2.13's export copies pytree specs through a deprecated isinstance check: one FutureWarning
            # per graph (60 for a server's cache), about torch's own code, nothing a user can act on
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
            ep = torch.export.export(module, tuple(module.roots), strict=False)
            no_weights = {"aot_inductor.package_constants_in_so": False}
            torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=no_weights)

    def load(self, path: Path, module: StaticInputs) -> Callable[..., torch.Tensor]:
        runner = torch._inductor.aoti_load_package(str(path))
        state = dict(module.named_parameters()) | dict(module.named_buffers())
        need = runner.get_constant_fqns()
        missing = [f for f in need if f not in state]
        if missing:
            raise GraphCacheError(f"{path}: needs constants the model does not have: {missing[:3]}")
        runner.load_constants({f: state[f] for f in need}, check_full_update=True, user_managed=True)
        return _flat_call(runner)


def _flat_call(runner) -> Callable[..., torch.Tensor]:
    """``runner(*tensors)`` without its per-call spec parsing: ``AOTICompiledModel.__call__`` reads
    the package's input / output specs from JSON and flattens its arguments on every call (about 30 us
    on a 2-core CPU, more than a decode step's own kernels at batch 1); the specs are read once here
    and the tensors go straight to the loader (``boxed_run`` takes the list it is given)."""
    import torch.utils._pytree as pytree

    out_spec = pytree.treespec_loads(runner.loader.get_call_spec()[1])
    boxed_run = runner.loader.boxed_run
    return lambda *tensors: pytree.tree_unflatten(boxed_run(list(tensors)), out_spec)


class GraphCache:
    """The graph cache of one run on one device at one precision (see the module docstring).

    Args:
        directory: the cache folder (``RUN/graphs``; created on the first store).
        model: the engine's (hardened) model: its weights hash and precision key the entries.
        device: the engine's device. build: rebuild missing / stale entries (False: refuse them,
            the caller compiles in memory). compiler: builds and loads packages (:class:`AOTInductor`).
        layout: (buckets, max_batch) of the engine using it, recorded (:meth:`add_layout`) with each graph stored; None: not.
    """

    def __init__(
        self, directory, model: torch.nn.Module, device, *, build: bool = True, compiler=None, layout: tuple | None = None
    ) -> None:
        self.dir = Path(directory)
        self.layout = layout
        self.build = build
        self.compiler = compiler or AOTInductor()
        self.env = {
            "format": FORMAT,
            "torch": torch_version(),
            "weights_sha256": weights_sha256(model),
            "precision": model_precision(model),
            "device": str(torch.device(device)),
            "code_sha256": code_sha256(),
            "compiler": self.compiler.name,
        }

    @staticmethod
    def layout_of(buckets, max_batch: int) -> dict:
        """An engine layout as :meth:`layout` returns it: {"buckets": [int, ...], "max_batch": int}."""
        return {"buckets": [int(e) for e in buckets], "max_batch": int(max_batch)}

    @staticmethod
    def add_layout(run_dir, buckets, max_batch: int) -> None:
        """Record in RUN/graphs an engine layout graphs were built for (``hstu export --graphs``; a compiled engine
        with each graph it stores): graph names hash the pools' shapes, so only an engine of a recorded layout finds
        them. :meth:`layouts` reads them back."""
        d = Path(run_dir) / DIRNAME
        lays = GraphCache.layouts(run_dir)
        if (new := GraphCache.layout_of(buckets, max_batch)) in lays:
            return
        tmp = d / f".{LAYOUT}.{os.getpid()}"
        tmp.write_text(json.dumps({"layouts": [*lays, new]}))
        os.replace(tmp, d / LAYOUT)

    @staticmethod
    def layouts(run_dir) -> list[dict]:
        """The engine layouts the run's graphs were built for ({"buckets", "max_batch"} each; a file from before
        several were kept holds one), or [] (no cache, an older one, or an unreadable file)."""
        p = Path(run_dir) / DIRNAME / LAYOUT if run_dir is not None else None
        try:
            raw = json.loads(p.read_text()) if p is not None and p.is_file() else {"layouts": []}
            lays = raw["layouts"] if "layouts" in raw else [raw]
            return [GraphCache.layout_of(x["buckets"], x["max_batch"]) for x in lays]
        except (ValueError, KeyError, TypeError):
            return []

    @staticmethod
    def unrecorded(run_dir, precision: str | None = None) -> bool:
        """True when ``RUN/graphs`` lists graphs (at ``precision``, else at any) but its layout.json is missing or
        unreadable: no engine layout can be matched to them (:meth:`layouts` is [])."""
        built = GraphCache.precisions(run_dir)
        return not GraphCache.layouts(run_dir) and (_short(precision) in built if precision else bool(built))

    @staticmethod
    def precisions(run_dir) -> set[str]:
        """The precisions ("fp32", "bf16", "fp16", "int8") of the entries in ``RUN/graphs`` (empty: none, or an
        unreadable manifest)."""
        try:
            entries = json.loads((Path(run_dir) / DIRNAME / MANIFEST).read_text())["entries"].values()
            return {_short(e.get("precision")) for e in entries}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return set()

    @classmethod
    def beside(
        cls, run_dir, model: torch.nn.Module, device, *, holding: bool = False, layout: tuple | None = None, **kw
    ) -> GraphCache | None:
        """The cache of ``run_dir`` if one was built there (``RUN/graphs/manifest.json``), else None; with
        ``holding``, None also when it holds no graph at the model's precision or, given the engine's ``layout``
        (buckets, max batch), when :meth:`layouts` records others only (graphs "auto": run eager at once instead of
        a warning per graph: a graph's name covers its pools' shapes, so no graph of another layout loads), and when
        no entry was built for this process (:meth:`stale`: one warning). The cache records ``layout`` with each graph it stores."""
        if run_dir is None or not (Path(run_dir) / DIRNAME / MANIFEST).is_file():
            return None
        if holding and _short(model_precision(model)) not in cls.precisions(run_dir):  # before hashing the weights
            return None
        lays = cls.layouts(run_dir) if holding and layout is not None else []
        if lays and cls.layout_of(*layout) not in lays:
            return None
        cache = cls(Path(run_dir) / DIRNAME, model, device, layout=layout, **kw)
        if holding and (why := cache.stale()):
            flags = f" --buckets {','.join(map(str, layout[0]))} --max-batch {layout[1]}" if layout is not None else ""
            flags += "" if (p := _short(model_precision(model))) == "fp32" else f" --precision {p}"
            log.warning("%s: running eager; `hstu export --run %s --graphs%s` rebuilds it", why, run_dir, flags)
            return None
        return cache

    def stale(self) -> str | None:
        """Why no entry can load here, when none was built for this process (other hstu code, torch, weights, device
        or compiler: every field of ``env`` equal), e.g. "...: built for code_sha256 9028673f..., this is 89e604d5...";
        None when one was, or when the manifest is unreadable (the first store starts it anew)."""
        try:
            entries = list(self.entries().values())
        except GraphCacheError:
            return None
        if any(all(e.get(f) == v for f, v in self.env.items()) for e in entries):
            return None
        for e in entries:  # the first field that differs, as check() names it
            for f, v in self.env.items():
                if e.get(f) != v and f != "precision":
                    return f"graph cache {self.dir} is stale: built for {f} {str(e.get(f))[:16]}, this is {str(v)[:16]}"
        return f"graph cache {self.dir} holds no graph for this model"

    @staticmethod
    def create(run_dir) -> Path:
        """Make ``RUN/graphs`` with an empty manifest unless it has one; returns the folder."""
        d = Path(run_dir) / DIRNAME
        d.mkdir(exist_ok=True)
        if not (d / MANIFEST).exists():
            tmp = d / f".{MANIFEST}.{os.getpid()}"
            tmp.write_text(json.dumps({"format": FORMAT, "entries": {}}))
            os.replace(tmp, d / MANIFEST)
        return d

    def entries(self) -> dict:
        """The manifest's entries (empty when there is none). GraphCacheError: unreadable manifest."""
        return manifest_entries(self.dir / MANIFEST)

    def check(self, name: str) -> Path:
        """The package file of entry ``name``, verified against this process. Raises GraphCacheError
        (missing entry, a field that differs, a missing / truncated / corrupt file)."""
        e = self.entries().get(name)
        if e is None:
            raise GraphCacheError(f"{self.dir}: no entry {name}")
        for field, want in self.env.items():
            if e.get(field) != want:
                got, now = str(e.get(field))[:16], str(want)[:16]
                raise GraphCacheError(f"{self.dir}/{name}.pt2 is stale: built for {field} {got}, this is {now}")
        path = self.dir / e["file"]
        size = path.stat().st_size if path.exists() else -1
        if size != e["bytes"] or file_sha256(path) != e["sha256"]:
            what = "missing" if size < 0 else f"truncated or corrupt ({size} bytes, sha256 differs; the manifest says {e['bytes']})"
            raise GraphCacheError(f"{path} is {what}")
        return path

    @contextmanager
    def _locked(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _clear(self, keep: str) -> int:
        """Remove every graph file but ``keep`` and layout.json (under the lock); returns the files removed."""
        stale = [p for p in self.dir.glob("*.pt2") if p.name != keep]
        for p in stale:
            p.unlink(missing_ok=True)
        (self.dir / LAYOUT).unlink(missing_ok=True)
        return len(stale)

    def store(self, name: str, module: StaticInputs) -> dict:
        """Build entry ``name`` from ``module`` (a temporary file, renamed when complete) and record
        it in the manifest (an unreadable manifest is replaced, with a warning, by a new cache: the other
        graph files and layout.json go, as nothing vouches for them; graphs are rebuilt when next needed).
        Returns the entry (with compile_s, bytes)."""
        with self._locked():
            try:  # another process (a second model worker) built it while this one waited
                self.check(name)
                return self.entries()[name]
            except GraphCacheError:
                pass
            tmp = self.dir / f".{name}.{os.getpid()}.pt2"
            t0 = time.perf_counter()
            try:
                self.compiler.build(module, tmp)
                os.replace(tmp, self.dir / f"{name}.pt2")
            finally:
                tmp.unlink(missing_ok=True)
            path = self.dir / f"{name}.pt2"
            entry = {**self.env, "file": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path)}
            entry["compile_s"] = round(time.perf_counter() - t0, 3)
            try:
                entries = self.entries()
            except ManifestError as exc:  # unreadable: nothing on disk can be verified any more
                removed = self._clear(keep=path.name)
                log.warning(
                    "%s: started a new cache with this graph, removing %d other graph files and layout.json (graphs are "
                    "built again as needed; all at once: hstu export --graphs)",
                    exc.what,
                    removed,
                )
                entries = {}
            entries[name] = entry
            tmp_m = self.dir / f".{MANIFEST}.{os.getpid()}"
            tmp_m.write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True))
            os.replace(tmp_m, self.dir / MANIFEST)
            if self.layout is not None:
                self.add_layout(self.dir.parent, *self.layout)
        return entry


def entry_name(kind_key: tuple, edge: int, module: StaticInputs, settings: dict) -> str:
    """``{kind}_E{edge}_{batch}[_{T|W}]_{interface hash}``: one file name per graph and engine layout."""
    h = hashlib.sha256(json.dumps([module.signature(), settings], sort_keys=True, default=str).encode()).hexdigest()[:12]
    return "_".join([str(kind_key[0]), f"E{edge}", *map(str, kind_key[1:]), h])


class CachedRunner:
    """A runner served from the graph cache, with the same report attributes as
    :class:`hstu.backend.graphs.CompiledRunner`. The first call loads the entry (``mode`` "loaded")
    or, where it is missing or stale and the cache and ``build`` allow, compiles and stores it ("built"); when
    that fails (or the cache refuses a stale entry) a warning names why and ``fallback`` (a
    CompiledRunner: torch.compile, then eager) runs this and every later call.

    Attributes: mode, compile_s (seconds of the first call), error (why it fell back, or None),
    bytes (the package's size), name (the entry).
    """

    def __init__(
        self, cache: GraphCache, name: str, module: StaticInputs, fallback: Callable[[], torch.Tensor], label: str, build: bool = True
    ) -> None:
        self.cache, self.name, self.module, self.fallback, self.label = cache, name, module, fallback, label
        self.build = build and cache.build
        self.mode, self.compile_s, self.error, self.bytes = "pending", 0.0, None, 0
        self._fn: Callable[[], torch.Tensor] | None = None

    def _open(self) -> Callable[[], torch.Tensor]:
        try:
            path, self.mode = self.cache.check(self.name), "loaded"
        except GraphCacheError as exc:
            if not self.build:
                raise
            if not isinstance(exc, ManifestError) and self.name in self.cache.entries():  # unreadable: store() says so
                log.warning("%s; rebuilding it", exc)
            self.cache.store(self.name, self.module)
            path, self.mode = self.cache.check(self.name), "built"
        self.bytes = path.stat().st_size
        loaded, roots = self.cache.compiler.load(path, self.module), tuple(self.module.roots)
        return lambda: loaded(*roots)

    def __call__(self) -> torch.Tensor:
        if self._fn is not None:
            return self._fn()
        t0 = time.perf_counter()
        try:
            fn = self._open()
            out = fn()
            self._fn = fn
        except Exception as exc:  # stale and refused, export / AOTInductor / load failure: torch.compile, then eager
            self.error = describe_failure(exc)
            how = "compiling it in memory" if isinstance(self.fallback, CompiledRunner) else "running it eager"
            log.warning("graph cache for %s not used (%s); %s", self.label, self.error, how)
            self.mode, self._fn = "fallback", self.fallback
            out = self.fallback()
        self.compile_s = time.perf_counter() - t0
        log.info("%s: %s in %.2f s", self.label, self.mode, self.compile_s)
        return out


__all__ = ["AOTInductor", "CachedRunner", "GraphCache", "GraphCacheError", "ManifestError", "StaticInputs", "entry_name", "weights_sha256"]
