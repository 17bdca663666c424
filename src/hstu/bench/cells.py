"""One measured column of ``hstu bench`` per precision: next-k generation latency at the batch size,
the length sweep, memory, model bytes and test quality.

Generation runs the one engine the service runs (:class:`hstu.generate.recommend.Recommender` with
an engine from :meth:`~hstu.generate.recommend.Recommender.build_engine`, called through
``Recommender.recommend`` on prepared histories: exclusion masks and id maps included, as a
request pays them); quality is :func:`hstu.train.evaluate.evaluate` on the run's test split (what
``hstu eval --precision`` prints); the model is loaded at each precision by
:func:`hstu.runs.load_run` (``Recommender.from_run``). Memory: the process's peak RSS
(:class:`hstu.bench.timing.PeakRSS`) and the device's peak allocation since the cell began
(``Backend.reset_peak_memory`` / ``peak_memory_bytes``). Each precision is measured in a fresh
process (:func:`measure_isolated`, multiprocessing "spawn"), so a column's peak RSS is its own, not
the peak of every column before it (glibc and the CPU allocator keep freed pages mapped). The reference port measured next-5 at
batch 16 and the growth from 50 to 200 events at batch 32; those are the defaults.
"""

from __future__ import annotations

import gc
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hstu.bench.timing import PeakRSS, interleaved, latency_stats

PRECISIONS = ("fp32", "fp16", "bf16", "int8")


@dataclass
class Settings:
    """What one ``hstu bench`` measures (see ``hstu bench --help`` for each field)."""

    device: str = "auto"
    precisions: tuple[str, ...] = PRECISIONS
    batch: int = 16
    lengths: tuple[int, ...] = (50, 100, 200)
    sweep_batch: int = 32
    k: int = 5
    repeats: int = 30
    warmup: int = 2
    graphs: str = "auto"
    quality: bool = True
    seed: int = 0


@dataclass
class Source:
    """The run measured: its directory (a ``--preset``'s is written to a temporary one), a label,
    and the run's data (EventLog, Split) when it has any (None: random histories, no quality)."""

    run: Path
    label: str
    data: tuple | None = None
    notes: list[str] = field(default_factory=list)


def write_preset_run(preset: str, num_items: int, out: Path, seed: int = 0) -> Path:
    """A run directory at ``out`` holding ``preset``'s model with random weights (torch seed ``seed``)
    over ``num_items`` items with original ids 1..num_items; no data, metrics or train state.
    Raises ValueError for an unknown preset."""
    from hstu.config import model_config_from_preset
    from hstu.model.checkpoint import save_weights, write_json
    from hstu.model.hstu import build_hstu
    from hstu.runs import write_idmap_dict

    torch.manual_seed(seed)
    cfg = model_config_from_preset(preset, num_items=num_items, dropout=0.0)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(out / "model.safetensors", build_hstu(cfg).eval())
    write_json(out / "config.json", {"model": cfg.__dict__})
    write_idmap_dict(out, {"item_raw_ids": np.arange(num_items + 1, dtype=np.int64)})  # items.npz past runs.INLINE_ITEM_ROWS
    return out


def open_run(run: Path, data_dir: str | None = None) -> Source:
    """A Source for a trained run: its data set read as ``hstu eval`` reads it (``--data-dir``, else
    $HSTU_DATA_DIR, else where it was trained). Raises FileNotFoundError / ValueError as the loaders."""
    from hstu.cli import _run_data
    from hstu.runs import read_run

    cfg, _ = read_run(run)
    from hstu.quant.checkpoint import read_quant_meta

    read_quant_meta(run)  # a quantized run's quant.json: a broken one is the run's error (exit 2), not an n/a column
    check_weights(run)  # so is a truncated weights file (it was an n/a in every column, exit 0)
    if "data" not in cfg:
        return Source(run, f"run {run}", None, ["the run records no data set: random histories, no quality"])
    log_, split, _ = _run_data(cfg, data_dir)
    return Source(run, f"run {run}", (log_, split))


def check_weights(run: Path) -> None:
    """The run's weights file (model.quant.safetensors for a quantized run, else model.safetensors) opens as
    safetensors: its header is read, which checks that it covers the whole file, the tensors are not. Raises
    FileNotFoundError (absent) or ValueError naming the file (truncated, corrupt): the run's error, one line
    before anything is measured, not an n/a footnote in every column."""
    from hstu.model.checkpoint import read_safetensors_metadata
    from hstu.model.run_files import WEIGHTS
    from hstu.quant.checkpoint import WEIGHTS as QUANT_WEIGHTS
    from hstu.runs import is_quantized

    path = Path(run) / (QUANT_WEIGHTS if is_quantized(run) else WEIGHTS)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights not found; the run is incomplete")
    read_safetensors_metadata(path)


def histories(src: Source, rec, length: int, batch: int, seed: int) -> tuple[list, str]:
    """``batch`` prepared histories of exactly ``length`` events and where they came from: the last
    ``length`` events before the test target of users of the run's data that have that many (drawn
    with replacement when fewer than ``batch`` do), else random items at increasing timestamps."""
    from hstu.generate.recommend import History

    rng = np.random.default_rng(seed + length)
    if src.data is not None:
        log_, split = src.data
        ends = split.targets("test")
        ok = np.nonzero((ends >= 0) & (ends - log_.offsets[:-1] >= length))[0]
        if len(ok):
            users = rng.choice(ok, size=batch, replace=len(ok) < batch)
            out = []
            for u in users:
                e = int(ends[u])
                acts = [log_.action_names[a - 1] for a in log_.actions[e - length : e]] if log_.num_actions else None
                raw = log_.item_raw_ids[log_.items[e - length : e]].tolist()
                out.append(rec.prepare(History(raw, log_.timestamps[e - length : e].tolist(), acts)))
            return out, f"{len(ok)} users of the run's data with >= {length} events"
    items = rec.raw_ids[1:]
    out = []
    for _ in range(batch):
        ts = (1_600_000_000 + np.cumsum(rng.integers(1, 86_400, size=length))).tolist()
        out.append(rec.prepare(History(rng.choice(items, size=length).tolist(), ts)))
    return out, "random items at increasing timestamps"


def precision_unavailable(be, precision: str) -> str | None:
    """Why ``precision`` has no fast kernel on the backend ``be`` (the cell is then not run), or None:
    int8 without an integer GEMM (:func:`hstu.quant.select_int8_kernel` falls back to dequantizing),
    bf16 / fp16 without a native 16-bit matmul (``Backend.lowp_unavailable_reason``)."""
    if precision == "int8":
        from hstu.quant import select_int8_kernel

        kern = select_int8_kernel(be.device)
        return None if kern.integer else f"no INT8 GEMM kernel on {be.device}: {kern.reason}"
    if precision in ("bf16", "fp16"):
        return be.lowp_unavailable_reason(precision)
    return None


def model_unavailable(run: Path, precision: str) -> str | None:
    """Why the run's model cannot run at ``precision`` (the cell is then not run), or None: a quantized run
    runs at its own scheme only (every other precision gets the same reason, before the device's kernels are
    asked: FP16 said "no fp16 kernel" where BF16 said "quantized"); low-precision inference
    (:func:`hstu.quant.apply_precision`) converts HSTU models only, so a SASRec run is fp32 only."""
    from hstu.model.checkpoint import read_json
    from hstu.quant.checkpoint import read_quant_meta

    meta = read_quant_meta(run)
    if meta is not None and precision != meta.get("scheme"):
        source = f" ({meta['source_run']})" if meta.get("source_run") else ""
        return (
            f"checkpoint is quantized with scheme {meta.get('scheme')!r}: it runs at {meta.get('scheme')} only; "
            f"bench the float run it was made from{source} for {precision}"
        )
    arch = read_json(Path(run) / "config.json")["model"].get("architecture", "hstu")
    if precision == "fp32" or arch == "hstu":
        return None
    return f"a {arch} model runs at fp32 only (low-precision inference converts HSTU models)"


def unavailable(src: Source, be, precision: str) -> str | None:
    """Why the column ``precision`` is not measured: :func:`model_unavailable`, else :func:`precision_unavailable`."""
    return model_unavailable(src.run, precision) or precision_unavailable(be, precision)


def model_bytes(model) -> int:
    """Bytes of the model's tensors as stored at its precision (:func:`hstu.quant.tensor_bytes` of
    the quantized state for a converted model, of the state dict for a float one)."""
    from hstu.quant import tensor_bytes
    from hstu.quant.checkpoint import quantized_state

    state = quantized_state(model) if getattr(model, "quant_meta", None) is not None else model.state_dict()
    return int(tensor_bytes(state)["total"])


def _timed(rec, engine_for: dict, preps: dict, st: Settings, be) -> dict[str, np.ndarray]:
    """Seconds per ``rec.recommend`` call of each named batch of histories on its engine, interleaved."""
    fns = {n: (lambda n=n: rec.recommend(preps[n], st.k, engine=engine_for[n])) for n in preps}
    return interleaved(fns, st.repeats, warmup=st.warmup, sync=be.synchronize)


def _engine(rec, buckets, max_batch: int, st: Settings):
    eng = rec.build_engine(tuple(buckets), max_batch=max_batch, graphs=st.graphs)
    if eng.graphs != "eager":
        eng.warmup()
    return eng


def _generation(src: Source, rec, st: Settings, be) -> dict:
    """Latency at the batch size (the longest fitting length) and the sweep at the sweep batch."""
    fit = [L for L in st.lengths if L <= rec.max_len]
    skipped = {str(L): f"history {L} > the model's max_seq_len {rec.max_len}" for L in st.lengths if L > rec.max_len}
    if not fit:
        return {"unavailable": f"every --lengths value exceeds the model's max_seq_len {rec.max_len}"}
    H = max(fit)
    preps, where = histories(src, rec, H, st.batch, st.seed)
    t = _timed(rec, {"main": _engine(rec, (H,), st.batch, st)}, {"main": preps}, st, be)["main"]
    out = {"history": H, "batch": st.batch, "histories": where, **latency_stats(t, st.batch), "times_ms": (t * 1e3).round(4).tolist()}
    eng = _engine(rec, fit, st.sweep_batch, st)
    sweep_preps = {str(L): histories(src, rec, L, st.sweep_batch, st.seed)[0] for L in fit}
    ts = _timed(rec, dict.fromkeys(sweep_preps, eng), sweep_preps, st, be)
    sweep = {L: {**latency_stats(v, st.sweep_batch), "times_ms": (v * 1e3).round(4).tolist()} for L, v in ts.items()}
    lo, hi = str(min(fit)), str(max(fit))
    growth = 100.0 * (sweep[hi]["p50_ms"] / sweep[lo]["p50_ms"] - 1.0) if lo != hi else None
    out["sweep"] = {"batch": st.sweep_batch, "lengths": sweep, "unavailable": skipped, "growth_percent": growth, "from": lo, "to": hi}
    return out


def _quality(src: Source, rec) -> dict | str:
    from hstu.train.evaluate import evaluate

    if src.data is None:
        return "no data set (random weights or a run without data): no quality"
    log_, split = src.data
    ev = evaluate(rec.model, log_, split, "test", device=rec.device)
    return {"HR@10": float(ev["HR@10"]), "NDCG@10": float(ev["NDCG@10"]), "users": int(ev["users"])}


def measure_precision(src: Source, precision: str, st: Settings, be) -> dict:
    """One column: ``{"precision", "unavailable": reason}`` when it cannot run here (:func:`unavailable`), else the
    generation figures (:func:`latency_stats` keys, ``times_ms``, ``sweep``), ``model_bytes``,
    ``memory`` (``host_rss_peak_bytes``, ``device_peak_bytes`` or None on the host) and ``quality``
    (HR@10 / NDCG@10 on the test split, or the reason there is none). Never raises for a precision
    that cannot be loaded (the loader's message becomes the reason)."""
    from hstu.generate.recommend import Recommender

    reason = unavailable(src, be, precision)
    if reason is not None:
        return {"precision": precision, "unavailable": reason}
    gc.collect()
    be.empty_cache()
    be.reset_peak_memory()
    with PeakRSS() as rss:
        try:
            rec = Recommender.from_run(src.run, str(be.device), precision)
        except (ValueError, RuntimeError) as exc:  # QuantCheckpointError (another scheme), a failed conversion
            return {"precision": precision, "unavailable": str(exc)}
        cell = {"precision": precision, "model_bytes": model_bytes(rec.model), **_generation(src, rec, st, be)}
        if "unavailable" not in cell:
            cell["quality"] = _quality(src, rec) if st.quality else "not measured (--no-quality)"
    cell["memory"] = {
        "host_rss_base_bytes": rss.base_bytes,
        "host_rss_peak_bytes": rss.peak_bytes,
        "device_peak_bytes": be.peak_memory_bytes(),
    }
    return cell


def _cell_in_child(src: Source, precision: str, st: Settings, threads: int) -> dict:
    from hstu.backend import select

    if threads:
        torch.set_num_threads(threads)
    return measure_precision(src, precision, st, select(st.device))


def measure_isolated(src: Source, precision: str, st: Settings, be, threads: int = 0) -> dict:
    """:func:`measure_precision` in a fresh "spawn" process (``threads`` intra-op threads there, 0:
    torch's default; the backend selected from ``st.device``), so that its memory figures are this
    precision's alone: ``host_rss_base_bytes`` is that process's RSS with torch, the run's data and
    this module loaded, before the model; ``host_rss_peak_bytes`` its peak while the cell ran. A
    precision without a fast kernel on ``be``, or one the model does not support (:func:`unavailable`),
    is reported from here, without a process. An error in
    the child is raised here as it was raised there."""
    reason = unavailable(src, be, precision)
    if reason is not None:
        return {"precision": precision, "unavailable": reason}
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_cell_in_child, src, precision, st, threads).result()
