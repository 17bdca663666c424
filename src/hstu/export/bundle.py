"""``export_run``: a run's encoder as one exported program per bucket, the item table, a manifest.

The export directory (written whole or not at all: built in a temporary sibling, verified, then
renamed into place):

    export.json          the manifest: format, buckets and their files, input / output names,
                         dtypes and shapes, opset (onnx), versions, the run's config.json sha256,
                         each bucket's verification error, how to score
    encoder_E{E}.onnx    or .pt2: the prefill of bucket E, (B, E) inputs, B dynamic (or --batch)
    items.npy            (I + 1, d) float32 L2-normalised item rows, row 0 (padding) zero:
                         scores = user_vector @ items.T / temperature (Zhai et al. 2024, §4.1.1)
    idmap.json           the run's id map: dense id j <-> original id ``item_raw_ids[j]``,
                         ``action_names``, ``item_train_counts`` (0: never trained)
    items.npz            only for a large catalogue: idmap.json's per-item arrays (``items_file``;
                         read both with :func:`hstu.runs.read_idmap`)

Each program is checked on export: its output on seeded inputs of another batch size (lengths
1..E) against the eager model (:data:`TOLERANCE`); a larger error is an ExportError.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import torch

from hstu.export import onnx_export, pt2_export
from hstu.export.encoder import UserEncoder, example_inputs, max_abs_error
from hstu.model.checkpoint import dir_target, staged_dir
from hstu.model.run_files import CONFIG, IDMAP, ITEMS

log = logging.getLogger(__name__)

FORMATS = {"onnx": onnx_export, "pt2": pt2_export}
MANIFEST = "export.json"
TOLERANCE = 1e-4  # max |exported - eager| on the verification inputs, float32 (measured 3e-8 on the tiny run)
LOWP_EPS = 8  # 16-bit models: 8 machine epsilons of the model dtype (fp16 ONNX Runtime vs eager: 2.5e-4 measured)
CHECK_BATCH = 5  # verification rows (differs from the trace's 3: the dynamic axis is exercised)


class ExportError(RuntimeError):
    """The model could not be exported or its exported program disagrees with the eager model."""


def _check_request(fmt: str, run: Path, out: Path, overwrite: bool, batch: int | None) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"--format: unknown value {fmt!r}; valid: {', '.join(FORMATS)}")
    if fmt == "onnx" and (missing := onnx_export.missing_package()) is not None:
        raise ImportError(f"--format onnx needs the optional package {missing!r}: pip install 'hstu[{onnx_export.EXTRA}]'")
    out = dir_target(out)  # FileExistsError: a link to nothing
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out}: exists and is not a directory")
    r, o = run.resolve(), out.resolve()
    if o == r or o in r.parents:
        raise FileExistsError(f"--out {out}: is or contains the run {run} being exported; choose another directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"--out {out}: directory exists and is not empty (pass --overwrite to replace an earlier export)")
        if not (out / MANIFEST).is_file():  # --overwrite replaces an export, never a run or other files
            raise FileExistsError(
                f"--out {out}: holds files but no {MANIFEST}, so it is not an earlier export; --overwrite replaces only those"
            )
        if others := sorted(set(p.name for p in out.iterdir()) - _export_files(out)):
            raise FileExistsError(
                f"--out {out}: an earlier export, but also {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}, which "
                "no export wrote; --overwrite replaces only an export's own files: move those, or choose another --out"
            )
    if batch is not None and batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")


def _export_files(out: Path) -> set[str]:
    """The names an export in ``out`` wrote: its manifest, the programs it lists, items.npy and the id map; only the
    manifest when that is unreadable (then every other file counts as another's)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        programs = {str(b["file"]) for b in manifest["buckets"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {MANIFEST}
    return {MANIFEST, "items.npy", IDMAP, ITEMS, *programs}


def _buckets(buckets, max_seq_len: int) -> list[int]:
    from hstu.generate.recommend import default_buckets

    got = sorted({int(b) for b in buckets}) if buckets else list(default_buckets(max_seq_len))
    bad = [b for b in got if not 1 <= b <= max_seq_len]
    if bad:
        raise ValueError(f"--buckets {bad}: each edge must be in 1..the run's max_seq_len = {max_seq_len}")
    return got


def tolerance(dtype: torch.dtype) -> float:
    """The verification bound for a model of ``dtype``: :data:`TOLERANCE`, or :data:`LOWP_EPS` epsilons of a 16-bit dtype."""
    return max(TOLERANCE, LOWP_EPS * torch.finfo(dtype).eps)


def _export_bucket(fmt: str, enc: UserEncoder, E: int, folder: Path, batch: int | None) -> dict:
    """One bucket's program into ``folder``, verified; its manifest entry."""
    mod = FORMATS[fmt]
    path = folder / f"encoder_E{E}{mod.SUFFIX}"
    try:
        facts = mod.export(enc, example_inputs(enc, E, batch or 3, seed=0), path, batch)
    except Exception as exc:  # the exporters raise many kinds; one line naming the bucket
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"bucket {E}: {fmt} export failed: {type(exc).__name__}: {first}") from exc
    check = example_inputs(enc, E, batch or CHECK_BATCH, seed=1)
    with torch.no_grad():
        want = enc(*check)
    try:
        got = mod.run(path, enc.input_names, check)
    except Exception as exc:  # e.g. onnxruntime has no CPU kernel for a bfloat16 op
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"bucket {E}: the exported {fmt} program does not run here: {type(exc).__name__}: {first}") from exc
    err, tol = max_abs_error(got, want), tolerance(enc.model.pos_emb.weight.dtype)
    if not err <= tol:
        raise ExportError(f"bucket {E}: the {fmt} program differs from the model by {err:.3g} (> {tol:.3g})")
    log.info("bucket %d: %s (%d bytes), max |exported - eager| = %.3g", E, path.name, path.stat().st_size, err)
    return {"edge": E, "file": path.name, "bytes": path.stat().st_size, "max_abs_error": err, **facts}


def _manifest(fmt: str, run: Path, enc: UserEncoder, entries: list[dict], batch: int | None, precision: str, exclude_history: bool) -> dict:
    from hstu.quant.checkpoint import versions

    ins, outs = enc.signature("E", batch)
    m = enc.model.cfg
    notes = ["inputs are dense ids: map original item ids with idmap.json item_raw_ids (unknown ids: drop the event)"]
    if exclude_history:  # the run's policy (idmap.json exclude_history_default), as hstu generate / serve apply it
        notes.append("the engine never recommends history items (exclude_history_default) or untrained items: mask them yourself")
    else:
        notes.append("the engine never recommends untrained items: mask them yourself (this run's exclude_history_default is off)")
    if getattr(enc.model, "repeat", None) is not None:
        notes.append("this run has a repeat head (repeat_window > 0): its history-dependent bias is not in these scores")
    return {
        "format": fmt,
        "run": str(run.resolve()),
        "config_sha256": hashlib.sha256((run / CONFIG).read_bytes()).hexdigest(),
        "architecture": m.architecture,
        "precision": precision,
        "batch": "dynamic" if batch is None else batch,
        "buckets": entries,
        "inputs": [t.as_dict() for t in ins],
        "outputs": [t.as_dict() for t in outs],
        "items": {"file": "items.npy", "dtype": "float32", "shape": [m.num_items + 1, m.embedding_dim]},
        "scoring": {"temperature": m.temperature, "formula": "scores = user_vector @ items.T / temperature; column 0 is padding"},
        "idmap": IDMAP,
        "versions": versions(),
        "notes": notes,
    }


INT8_NOT_PORTABLE = "a program for another runtime cannot carry the INT8 Linears' packed weights"


def export_run(
    run: str | Path,
    out: str | Path,
    fmt: str = "onnx",
    *,
    buckets=None,
    precision: str | None = None,
    batch: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Export run ``run``'s encoder to directory ``out`` as ``fmt`` ("onnx" | "pt2"), one program
    per bucket edge (default: the Recommender's default buckets, hstu.generate.recommend), batch
    axis dynamic unless ``batch``; the model at ``precision`` as :func:`hstu.runs.load_run`.
    Returns the manifest (also written to ``out``/export.json; layout: module docstring).

    Raises:
        ValueError: unknown format, bucket outside 1..max_seq_len, bad precision or run files.
        FileNotFoundError: no run. FileExistsError: ``out`` is or contains ``run``, or is not empty and either not
            ``overwrite`` or not an earlier export (no export.json): ``overwrite`` replaces only an export.
        ImportError: onnx without the ``export`` extra. ExportError: export or verification failed.
    On any error nothing is left at ``out`` (an old export there is kept).
    """
    from hstu.runs import load_run

    run, out = Path(run), Path(out)
    _check_request(fmt, run, out, overwrite, batch)
    model, cfg, ids = load_run(run, "cpu", precision)
    scheme = precision or (cfg.get("quant") or {}).get("scheme") or "fp32"
    if scheme == "int8":
        raise ValueError(
            f"{'--precision int8' if precision else f'{run} is an INT8 run (quant.json)'}: not exportable ({INT8_NOT_PORTABLE}; "
            "`hstu export --graphs` caches INT8 graphs for hstu serve); "
            + ("export the float run, or --precision fp16 / bf16" if precision else "export the float run it was quantized from")
        )
    if model.cfg.item_table == "hashed":  # torch.export stopped on its shard routing's data-dependent shapes, a page of trace
        raise ValueError(
            f"{run} has a hashed item table (item_table = 'hashed'): not exportable as ONNX / pt2 (its shard routing has "
            "data-dependent shapes); generate and serve it with hstu generate / hstu serve"
        )
    edges = _buckets(buckets, model.cfg.max_seq_len)
    cat = ids.get("item_category")
    enc = UserEncoder(model, None if cat is None else torch.as_tensor(cat, dtype=torch.int64))
    with staged_dir(out, last=MANIFEST) as tmp:
        entries = [_export_bucket(fmt, enc, E, tmp, batch) for E in edges]
        with torch.no_grad():
            np.save(tmp / "items.npy", model.item_vectors().to(torch.float32).cpu().numpy())
        for name in (ITEMS, IDMAP):  # a large catalogue's per-item arrays (items.npz) beside its idmap.json
            if name == IDMAP or (run / name).exists():
                shutil.copyfile(run / name, tmp / name)
        manifest = _manifest(fmt, run, enc, entries, batch, scheme, bool(ids.get("exclude_history_default", True)))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


__all__ = ["FORMATS", "MANIFEST", "TOLERANCE", "ExportError", "export_run", "tolerance"]
