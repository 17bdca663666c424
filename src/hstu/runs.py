"""The run directory: its layout and every read and write of it, for train, eval, generate,
quantize and serve alike.

RUN_DIR/ (``hstu train``)
  config.json             model, train and data settings (+ ``distributed``), hstu version
  idmap.json              dense id -> original item id, titles, categories, action names, the history
                          exclusion default, training-item counts, data facts
  items.npz               only above INLINE_ITEM_ROWS items: idmap.json's per-item lists (ids, categories,
                          counts, side features) as NumPy arrays; idmap.json names it (items_file)
  model.safetensors       best weights (by valid NDCG@10; last epoch under --protocol paper)
  metrics.json            {"valid": {...}, "test": {...}, "epochs": n, "train_seconds": s, ...}
  history.json            per-epoch loss, throughput and metrics
  metrics.csv             the same per-epoch history as a table (:mod:`hstu.model.curves`)
  last.safetensors/.json  last epoch's weights, AdamW moments and RNG state (for --resume); the
                          manifest (epoch, early-stopping state, param_groups, history) is in
                          last.safetensors' metadata, written in one rename: last.json and
                          history.json are copies of it, repaired on resume (:func:`repair_run_files`)
RUN_DIR_Q/ (``hstu quantize``): config.json and idmap.json copied, model.quant.safetensors and
  quant.json instead of model.safetensors (format: :mod:`hstu.quant.checkpoint`).

No pickle: tensors in safetensors, a large catalogue's per-item arrays in items.npz (read with
allow_pickle=False), everything else in JSON. Every file is written to NAME.tmp and
renamed into place; JSON run files are checked field by field as they are read
(:mod:`hstu.model.run_files`), so a malformed file is one ValueError naming file and field.

Place in the import order: config → backend → data → model → quant → **runs** → generate → train
→ serve/ops/bench → cli. Loading a run at a precision builds the model (model/) and loads or
converts quantized weights (quant/); generate, train, serve and the CLI use runs through this
module. The file primitives it uses (atomic JSON and safetensors I/O, the field checks) stay in
:mod:`hstu.model.checkpoint` and :mod:`hstu.model.run_files`, below quant, because the quantized
weights format (:mod:`hstu.quant.checkpoint`) reads and writes files too.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hstu
from hstu import backend
from hstu.config import ModelConfig, TrainConfig, model_config_from_dict, to_dict
from hstu.data import EventLog, Split
from hstu.data.prepare import DataSpec, train_item_counts
from hstu.data.sequences import is_text, same_item_ids
from hstu.model.checkpoint import (
    load_state,
    load_weights,
    read_idmap,
    read_json,
    read_safetensors,
    read_safetensors_metadata,
    save_tensors,
    save_weights,
    write_json,
    write_npz,
)
from hstu.model.curves import METRICS_CSV, render, write_curves
from hstu.model.run_files import (
    CONFIG,
    HISTORY,
    IDMAP,
    ITEM_FIELDS,
    ITEMS,
    LAST_JSON,
    LAST_WEIGHTS,
    METRICS,
    WEIGHTS,
    check_history,
    check_last,
    require_run_dir,
)
from hstu.quant.checkpoint import META as QUANT_META
from hstu.quant.checkpoint import (  # noqa: F401 (check_quantized_out, save_quantized_run: the quantized variant, re-exported)
    PRECISIONS,
    QuantCheckpointError,
    check_quantized_out,
    load_quantized_run,
    prepare_kernels,
    read_quant_meta,
    save_quantized_run,
)
from hstu.quant.checkpoint import WEIGHTS as QUANT_WEIGHTS

log = logging.getLogger(__name__)

RUN_FILES = (WEIGHTS, LAST_JSON, LAST_WEIGHTS, HISTORY, METRICS_CSV, METRICS)  # what training writes per epoch / at the end
MANIFEST_KEY = "hstu_train_state"  # last.safetensors metadata: the JSON manifest
# idmap.json holds the per-item lists up to this many rows (I+1); a larger catalogue's go to items.npz (issue 21:
# 120M items are > 1 GB of JSON and 4-13 GB of Python lists once read); tests monkeypatch it small
INLINE_ITEM_ROWS = 1_000_000
__all__ = [
    "CONFIG",
    "HISTORY",
    "IDMAP",
    "INLINE_ITEM_ROWS",
    "ITEMS",
    "ITEM_FIELDS",
    "LAST_JSON",
    "LAST_WEIGHTS",
    "METRICS",
    "QUANT_META",
    "QUANT_WEIGHTS",
    "RUN_FILES",
    "WEIGHTS",
    "check_items_match",
    "check_quantized_out",
    "check_resume_data",
    "check_resume_items",
    "config_json",
    "has_train_state",
    "is_quantized",
    "load_best_weights",
    "load_float_run",
    "load_run",
    "load_train_state",
    "make_idmap",
    "read_config",
    "read_history",
    "read_idmap",
    "read_run",
    "remove_run_files",
    "repair_run_files",
    "save_best_weights",
    "save_quantized_run",
    "save_train_state",
    "training_lock",
    "write_config",
    "write_idmap",
    "write_idmap_dict",
    "write_metrics",
]


# -- config.json, idmap.json, history.json, metrics.json, model.safetensors ----------------------------------------


def config_json(mcfg: ModelConfig, tcfg: TrainConfig, spec: DataSpec, **extra: Any) -> dict:
    """config.json's object: the model, train and data tables, ``extra`` tables (e.g.
    ``distributed``) and the hstu version."""
    return {"model": to_dict(mcfg), "train": to_dict(tcfg), "data": to_dict(spec), **extra, "hstu_version": hstu.__version__}


def write_config(run: Path, obj: dict) -> None:
    """Write config.json (atomically; ``obj`` from :func:`config_json`)."""
    write_json(Path(run) / CONFIG, obj)


def read_config(run: str | Path) -> dict:
    """config.json, checked field by field. Raises FileNotFoundError / ValueError naming file and field."""
    return read_json(Path(run) / CONFIG)


def make_idmap(log_: EventLog, split: Split | None = None) -> dict:
    """idmap.json's object for ``log_``: ``item_raw_ids`` (I+1 original ids, 0 for padding; text
    ids as JSON strings, "" for padding), ``user_ids`` ("int" | "text": the kind of the user ids),
    ``item_category`` (I+1), titles, ``item_meta`` (the items file's columns, when given), action
    names, side-feature maps (``features``: categorical values / numeric quantile edges, and
    ``item_features``: (I+1, F) the items' last values; :mod:`hstu.data.features`), the exclusion default, the last timestamp
    (Unix s), data facts, and with ``split`` ``item_train_counts`` (I+1 training events per item).
    Above :data:`INLINE_ITEM_ROWS` rows (I+1) the four per-item values stay NumPy arrays, no Python
    lists of them built (:func:`write_idmap` puts them in items.npz)."""
    inline = len(log_.item_raw_ids) <= INLINE_ITEM_ROWS
    per_item = (lambda a: a.tolist()) if inline else (lambda a: a)  # noqa: E731
    raw = per_item(log_.item_raw_ids)
    titles = {str(r): log_.titles[r] for r in raw[1:] if r in log_.titles} if log_.titles else {}
    return {
        "dataset": log_.name,
        "item_raw_ids": raw,
        "user_ids": "text" if is_text(log_.users) else "int",
        "item_category": per_item(log_.item_category),
        "category_raw_ids": None if log_.category_raw_ids is None else log_.category_raw_ids.tolist(),
        "action_names": log_.action_names,
        "titles": {
            **titles,
            **{r: m["title"] for r, m in log_.item_meta.items() if isinstance(m.get("title"), str)},  # --items FILE titles
        },
        **({"item_meta": log_.item_meta} if log_.item_meta else {}),
        **({"features": log_.feature_maps, "item_features": per_item(log_.item_features[:, 1:])} if log_.feature_maps else {}),
        "exclude_history_default": log_.exclude_history_default,
        "last_timestamp": int(log_.timestamps.max()),
        "data_facts": {"events": log_.num_events, "users": log_.num_users, "skipped_rows": log_.skipped_rows, **log_.facts},
        **({"item_train_counts": per_item(train_item_counts(log_, split))} if split is not None else {}),
    }


def write_idmap(run: Path, log_: EventLog, split: Split | None = None) -> None:
    """Write idmap.json (:func:`make_idmap`) atomically, a large catalogue's items.npz first
    (:func:`write_idmap_dict`)."""
    write_idmap_dict(run, make_idmap(log_, split))


def write_idmap_dict(run: Path, obj: dict) -> None:
    """Write an idmap.json object atomically. Up to :data:`INLINE_ITEM_ROWS` rows (len of
    ``item_raw_ids``) its per-item values (:data:`ITEM_FIELDS`, lists or arrays) are JSON lists in it,
    and an items.npz left by an earlier, larger write is removed; above, they go to items.npz as
    arrays (:func:`_stored`), written before idmap.json so that no idmap.json names a missing file,
    and idmap.json records ``items_file``, ``item_rows`` (I+1) and ``item_fields`` instead."""
    run, rows = Path(run), len(obj["item_raw_ids"])
    if rows <= INLINE_ITEM_ROWS:
        write_json(run / IDMAP, {k: v.tolist() if k in ITEM_FIELDS and isinstance(v, np.ndarray) else v for k, v in obj.items()})
        (run / ITEMS).unlink(missing_ok=True)
        return
    arrays = {k: _stored(k, obj[k]) for k in ITEM_FIELDS if k in obj}
    write_npz(run / ITEMS, arrays)
    rest = {k: v for k, v in obj.items() if k not in ITEM_FIELDS}
    write_json(run / IDMAP, {**rest, "items_file": ITEMS, "item_rows": rows, "item_fields": list(arrays)})


def _stored(name: str, values) -> np.ndarray:
    """A per-item field as items.npz holds it: ids int64 or fixed-width unicode, features (I+1, F)
    int64, category / counts the smallest signed integer type holding their range."""
    a = np.asarray(values)
    if name == "item_raw_ids":
        return a.astype(str) if is_text(a) else a.astype(np.int64, copy=False)
    if name == "item_features" or not a.size:
        return a.astype(np.int64, copy=False)
    lo, hi = int(a.min()), int(a.max())
    return a.astype(next(t for t in (np.int8, np.int16, np.int32, np.int64) if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max), copy=False)


def read_history(run: str | Path) -> list[dict]:
    """history.json: one entry per epoch 1, 2, ...; ValueError naming file and entry if malformed."""
    return read_json(Path(run) / HISTORY)


def write_metrics(run: Path, metrics: dict) -> None:
    """Write metrics.json atomically."""
    write_json(Path(run) / METRICS, metrics)


def save_best_weights(run: Path, model: torch.nn.Module) -> None:
    """Write model.safetensors (the weights eval / generate / serve load) atomically."""
    save_weights(Path(run) / WEIGHTS, model)


def load_best_weights(run: Path, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
    """Load model.safetensors into ``model``; FileNotFoundError / ValueError naming the file."""
    load_weights(Path(run) / WEIGHTS, model, device)


def check_items_match(run: Path, cfg: dict, ids: dict) -> None:
    """ValueError when idmap.json's item count is not config.json's model.num_items (every dense
    id indexes the item table)."""
    run = Path(run)
    n, m = len(ids["item_raw_ids"]) - 1, cfg["model"].get("num_items", 0)
    if n != m:
        raise ValueError(f"{run / IDMAP}: item_raw_ids holds {n} items but {run / CONFIG} model.num_items is {m}")


# -- starting and resuming a run ----------------------------------------------------------------------------------

RESUME_DATA_FIELDS = ("dataset", "protocol", "max_users", "skip_bad_rows", "options", "exclude_history")  # data_dir may move
_FLAGS = {"options": "--columns", "skip_bad_rows": "--skip-bad-rows"}


def check_resume_data(config_path: Path, saved: dict, given: dict) -> None:
    """ValueError naming the first data option in ``given`` (name -> value, only the options to
    compare) that differs from the run's (config.json ``data``): the run's item ids and splits
    come from its own data. ``hstu train`` calls it with the flags given, before any data is
    read; fit with its whole spec."""
    for name in RESUME_DATA_FIELDS:
        value = given.get(name)
        if name in given and name in saved and saved[name] != value:
            flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
            if isinstance(value, bool) or isinstance(saved[name], bool):  # as typed: --exclude-history / --no-exclude-history
                here, was = (f"--no-{flag[2:]}" if v is False else flag if v else "neither flag" for v in (value, saved[name]))
                said = f"{here} here but the run was trained with {was}" + (" (the data set's default)" if saved[name] is None else "")
            else:
                said = f"{flag} ([data] {name}) is {value!r} here but {saved[name]!r} in the run"  # a flag or a config file's
            raise ValueError(f"--resume: {said} ({config_path} data.{name}); resume with the run's data options or train a new --out")


def check_resume_items(run: Path, log_: EventLog, *, ids: dict | None = None, command: str = "--resume") -> None:
    """ValueError when the data's item ids are not the run's (idmap.json, or ``ids``, that file
    already read): its embeddings are indexed by them, so training on (or rewriting the id map
    from) other data breaks the run, and evaluating or generating on other data (hstu eval /
    generate) scores the wrong items. ``command``: the message's first word (none when empty)."""
    path = Path(run) / IDMAP
    if ids is None and not path.exists():
        return
    saved = (ids if ids is not None else read_idmap(run)).get("item_raw_ids")
    if saved is not None and not same_item_ids(saved, log_.item_raw_ids):
        raise ValueError(
            f"{command + ': ' if command else ''}the data's {len(log_.item_raw_ids) - 1} item ids are not the run's {len(saved) - 1} "
            f"({path}); use the data the run was trained on (--data-dir / $HSTU_DATA_DIR)"
        )


@contextmanager
def training_lock(run: Path):  # -> Iterator[None]
    """Hold run directory ``run`` for one training (two would interleave their files): an exclusive ``flock`` on it, made
    here when missing and removed if still empty at the end; FileExistsError naming ``run`` while another holds it."""
    run = Path(run)
    if run.exists() and not run.is_dir():
        yield
        return
    made = not run.exists()
    run.mkdir(parents=True, exist_ok=True)
    fd = os.open(run, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FileExistsError(f"--out {run} is being trained by another process; wait for it, or choose another --out") from None
        yield
    finally:
        os.close(fd)  # releases the lock
        if made and run.is_dir() and not any(run.iterdir()):
            run.rmdir()


def remove_run_files(run: Path, everything: bool = False) -> None:
    """Delete an old run's files (:data:`RUN_FILES`) from ``run`` (a fresh run replaces it: nothing of
    it can be resumed or reported). config.json and idmap.json are rewritten by the new run. ``everything``: those
    two and the items file as well, and ``run`` itself if that leaves it empty (a fresh run that failed before its
    first epoch)."""
    for f in [*RUN_FILES, *((CONFIG, IDMAP, ITEMS) if everything else ())]:
        (Path(run) / f).unlink(missing_ok=True)
    if everything and Path(run).is_dir() and not any(Path(run).iterdir()):
        Path(run).rmdir()


# -- the last checkpoint (last.safetensors + its manifest, last.json, history.json) ---------------------------------


def has_train_state(run: Path) -> bool:
    """Whether ``run`` holds a resumable state (last.safetensors, or last.json of an older run)."""
    return (Path(run) / LAST_WEIGHTS).exists() or (Path(run) / LAST_JSON).exists()


def save_train_state(
    run: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, info: dict, history: list[dict]
) -> None:
    """Commit one epoch: weights, AdamW moments and RNG states as tensors, and the manifest
    ``{**info, "param_groups", "history"}`` in the same file's metadata (one rename), then its
    copies last.json, history.json and metrics.csv (:mod:`hstu.model.curves`). ``info``: epoch, best, best_epoch, bad_epochs,
    train_seconds (+ optional distributed); ``history``: one entry per epoch 1..epoch."""
    run = Path(run)
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for pid, st in sd["state"].items():
        for name, val in st.items():
            tensors[f"optim.{pid}.{name}"] = torch.as_tensor(val).detach().contiguous().cpu()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.negatives"] = gen.get_state()
    manifest = {**info, "param_groups": sd["param_groups"], "history": history}
    save_tensors(run / LAST_WEIGHTS, tensors, {MANIFEST_KEY: json.dumps(manifest)})  # the commit
    write_json(run / LAST_JSON, manifest)
    write_json(run / HISTORY, history)
    write_curves(run, history)  # metrics.csv: the same history as a table (hstu.model.curves)


def read_manifest(run: Path) -> dict:
    """The last commit's manifest: last.safetensors' metadata, or for a run written before the
    manifest existed last.json with history.json cut at its epoch (it may hold one epoch more)."""
    path = run / LAST_WEIGHTS
    text = read_safetensors_metadata(path).get(MANIFEST_KEY)
    if text is not None:
        where = f"{path} (metadata {MANIFEST_KEY})"
        try:
            return check_last(where, json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
    info = read_json(run / LAST_JSON)
    old = read_json(run / HISTORY) if (run / HISTORY).exists() else []
    info["history"] = check_history(str(run / HISTORY), [h for h in old if h["epoch"] <= info["epoch"]])
    return info


def load_train_state(run: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> dict:
    """Restore the last committed epoch into ``model``, ``opt`` and ``gen``; returns its manifest
    (epoch, best, best_epoch, bad_epochs, train_seconds, param_groups, history: a list of entries
    1..epoch, ...). Raises FileNotFoundError without last.safetensors, ValueError naming the file
    (and field) that is corrupt or does not match the model / optimizer."""
    run = Path(run)
    path = run / LAST_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found; the run has no training state to resume")
    tensors = read_safetensors(path)
    info = read_manifest(run)
    load_state(path, model, {k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, pid, name = k.split(".", 2)
            state.setdefault(int(pid), {})[name] = v
    for key in ("rng.torch", "rng.negatives"):
        if key not in tensors:
            raise ValueError(f"{path}: tensor {key!r} is missing")
    try:
        opt.load_state_dict({"state": state, "param_groups": info["param_groups"]})
        torch.set_rng_state(tensors["rng.torch"])
        gen.set_state(tensors["rng.negatives"])
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: optimizer or RNG state does not match this model ({' '.join(str(exc).split())[:200]})") from None
    return info


def repair_run_files(run: Path, info: dict) -> None:
    """Rewrite last.json, history.json and metrics.csv from a loaded manifest (:func:`load_train_state`) where
    a kill left them behind it (call from one process only: the temp-file names are fixed)."""
    run = Path(run)
    for name, want in ((LAST_JSON, info), (HISTORY, info["history"])):
        path = run / name
        try:
            same = path.exists() and json.loads(path.read_text(encoding="utf-8")) == json.loads(json.dumps(want))
        except (OSError, ValueError):
            same = False
        if not same:
            log.warning("%s did not match the last committed epoch (%d, in %s): rewritten from it", path, info["epoch"], run / LAST_WEIGHTS)
            write_json(path, want)
    csv_path = run / METRICS_CSV
    if not csv_path.exists() or csv_path.read_text(encoding="utf-8") != render(info["history"]):
        write_curves(run, info["history"])


# -- loading a run for eval / generate / serve ----------------------------------------------------------------------


def read_run(run_dir: str | Path) -> tuple[dict, dict]:
    """(config.json dict, idmap.json dict) of a run, without its weights; both checked field by
    field and against each other (:func:`check_items_match`). Raises FileNotFoundError (no
    directory or file), ValueError naming file and field."""
    run = Path(run_dir)
    require_run_dir(run)
    cfg, ids = read_config(run), read_idmap(run)
    check_items_match(run, cfg, ids)
    return cfg, ids


def is_quantized(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` is a quantized run (holds quant.json)."""
    return (Path(run_dir) / QUANT_META).exists()


def load_float_run(run_dir: str | Path, device: str = "cpu"):
    """(model in eval mode on ``device``, config.json dict, idmap.json dict) of a float run
    (model.safetensors; a quantized run has none, so it is never read as float by mistake).

    Raises FileNotFoundError (no run, no weights), ValueError naming the run file and field that is
    malformed, an id map whose item count is not the model's, or weights that do not fit."""
    from hstu.model.hstu import build_hstu

    run = Path(run_dir)
    cfg, ids = read_run(run)
    dev = backend.select(device)
    model = build_hstu(model_config_from_dict(cfg["model"]), device=dev.device).to(dev.device)
    load_best_weights(run, model, dev.device)
    return model.eval(), cfg, ids


def load_run(run_dir: str | Path, device: str = "cpu", precision: str | None = None):
    """Load any run for eval / generate / serve at ``precision`` (the one call behind ``--precision``);
    returns (model in eval mode on ``device``, config.json dict, idmap.json dict).

    - a quantized run (has quant.json): :func:`hstu.quant.load_quantized_run`; ``precision`` None
      means "as saved", otherwise it must equal the saved scheme (QuantCheckpointError if not;
      "fp32" is refused: the float weights are not in it); config gets ``"quant"``: quant.json;
    - a float run: :func:`load_float_run`, converted in memory with :func:`hstu.quant.apply_precision`
      when ``precision`` is not None / "fp32".
    Raises ValueError for an unknown precision, plus what the loaders raise."""
    from hstu.quant import apply_precision

    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"--precision: unknown value {precision!r}; valid: {list(PRECISIONS)}")
    meta = read_quant_meta(run_dir)
    if meta is not None:
        if precision == "fp32":
            raise QuantCheckpointError(
                f"{run_dir}: quantized run (scheme {meta['scheme']!r}); --precision fp32 needs the float run it was made from"
            )
        return load_quantized_run(run_dir, device, scheme=precision)
    model, cfg, ids = load_float_run(run_dir, device)
    if precision not in (None, "fp32"):
        apply_precision(model, precision)
        prepare_kernels(model)
    return model, cfg, ids


DEMO_MARK = ".hstu-demo"  # written into `hstu demo --out` before training: the directory is the demo's to replace


def claim_demo_dir(out: Path) -> None:
    """Make ``out`` `hstu demo`'s: absent or empty (marked now) or marked by an earlier demo. ValueError for
    anything else (a trained run, other files), which the demo would overwrite: nothing is touched."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    if out.exists() and any(out.iterdir()) and not (out / DEMO_MARK).exists():
        raise ValueError(f"--out {out} holds files that are not an earlier demo's (a run, or others): choose another --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARK).write_text("hstu demo writes here; each demo replaces the previous one\n", encoding="utf-8")
