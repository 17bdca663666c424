"""Checks of the JSON run files as they are read: config.json, idmap.json, last.json, history.json,
and of idmap.json's sidecar items.npz (a large catalogue's per-item arrays, :func:`check_items`).

Each field's type and range is checked where the file is read (:func:`hstu.model.checkpoint.read_json`
calls :func:`check_run_json`), so a truncated, corrupt or hand-edited file is one ValueError naming
the file and the field (``run/config.json data: max_users must be int | None, got '300'``) for
``hstu train --resume`` and ``hstu eval / generate / serve --run`` alike, instead of a TypeError
deep inside training or loading. config.json's tables reuse the typed dataclass checks of
:mod:`hstu.config` and :class:`hstu.data.prepare.DataSpec`. Unknown top-level keys are kept (files
written by a newer hstu). The directory's layout is :mod:`hstu.runs`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hstu.config import ModelConfig, TrainConfig, _from_dict
from hstu.data.prepare import DataSpec

log = logging.getLogger(__name__)

# The run directory's file names, defined once (hstu.runs re-exports them and documents the layout;
# they live here, below quant, because the quantized weights format reads and copies them too).
CONFIG, IDMAP, WEIGHTS, METRICS, HISTORY = "config.json", "idmap.json", "model.safetensors", "metrics.json", "history.json"
LAST_WEIGHTS, LAST_JSON = "last.safetensors", "last.json"
# a large catalogue's per-item arrays (issue 21): NumPy arrays in items.npz beside idmap.json, which then holds
# "items_file": ITEMS, "item_rows": I+1 and "item_fields" (the keys stored) in place of those lists
ITEMS = "items.npz"
ITEM_FIELDS = ("item_raw_ids", "item_category", "item_train_counts", "item_features")


def require_run_dir(run: Path) -> None:
    """FileNotFoundError unless ``run`` is a directory: "run directory not found", or for an existing file
    "is a file, not a run directory" (the one message of every reader of a run: eval, generate, serve, report)."""
    if not run.is_dir():
        what = "is a file, not a run directory (hstu train --out writes one)" if run.exists() else "run directory not found"
        raise FileNotFoundError(f"{run}: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _texts(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is str for x in v)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(where: str, obj: dict, key: str, ok: Callable[[Any], bool], want: str, *, optional: bool = False) -> Any:
    """obj[key] if ``ok``; ValueError naming ``where`` and ``key`` if it is missing or not ``want``."""
    if key not in obj:
        if optional:
            return None
        raise ValueError(f"{where}: {key} is missing")
    v = obj[key]
    if not ok(v):
        raise ValueError(f"{where}: {key} must be {want}, got {_short(v)}")
    return v


def _object(where: str, obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: must be a JSON object, got {_short(obj)}")
    return obj


def check_config(where: str, obj: Any) -> dict:
    """config.json: ``model`` (ModelConfig), ``train`` (TrainConfig), ``data`` (DataSpec) tables,
    each field typed and range-checked as a config file's; ``distributed`` a table."""
    _object(where, obj)
    for key, cls, optional in (("model", ModelConfig, False), ("train", TrainConfig, True), ("data", DataSpec, True)):
        table = _field(where, obj, key, lambda v: isinstance(v, dict), "a table of fields", optional=optional)
        if table is not None:
            _from_dict(cls, table, f"{where} {key}")
    _field(where, obj, "distributed", lambda v: isinstance(v, dict), "a table", optional=True)
    _field(where, obj, "hstu_version", lambda v: isinstance(v, str), "a text", optional=True)
    return obj


def check_idmap(where: str, obj: Any) -> dict:
    """idmap.json: ``item_raw_ids`` ([0, original id of dense id 1, ...]) and the per-item lists
    of its length, titles, action names, the exclusion default. A large catalogue's file names its
    sidecar instead (``items_file`` = items.npz, ``item_rows`` = I+1, ``item_fields``: the
    per-item keys stored there, none of them inline; :func:`check_items` checks the arrays)."""
    _object(where, obj)
    if "items_file" in obj:
        _field(where, obj, "items_file", lambda v: v == ITEMS, repr(ITEMS))
        n = _field(where, obj, "item_rows", lambda v: _is_int(v) and v >= 1, "an integer >= 1 (I+1 rows of items.npz)")
        ok_fields = lambda v: isinstance(v, list) and "item_raw_ids" in v and set(v) <= set(ITEM_FIELDS)  # noqa: E731
        stored = _field(where, obj, "item_fields", ok_fields, f"a list of {list(ITEM_FIELDS)} holding item_raw_ids")
        both = [k for k in stored if k in obj]
        if both:
            raise ValueError(f"{where}: {both[0]} is both inline and in {ITEMS} (items_file)")
    else:
        raw = _field(
            where,
            obj,
            "item_raw_ids",
            lambda v: (_ints(v) and len(v) >= 1 and v[0] == 0) or (_texts(v) and len(v) >= 1 and v[0] == ""),
            'a list of integer ids starting with 0, or of text ids starting with "" (padding)',
        )
        n = len(raw)
    for name in ("item_category", "item_train_counts"):  # one entry per item
        per_item = f"a list of {n} integers >= 0 (one per item_raw_ids entry)"
        _field(where, obj, name, lambda v: _ints(v) and len(v) == n and min(v, default=0) >= 0, per_item, optional=True)
    _field(where, obj, "category_raw_ids", lambda v: v is None or _ints(v), "a list of integers or null", optional=True)
    _field(
        where, obj, "action_names", lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of texts", optional=True
    )
    _field(
        where,
        obj,
        "titles",
        lambda v: isinstance(v, dict) and all(isinstance(t, str) for t in v.values()),
        "an object of id -> title text",
        optional=True,
    )
    _field(where, obj, "exclude_history_default", lambda v: isinstance(v, bool), "true or false", optional=True)
    meta = "an object of id -> {column: value} (hstu train --items)"
    _field(where, obj, "item_meta", lambda v: isinstance(v, dict) and all(isinstance(m, dict) for m in v.values()), meta, optional=True)
    _field(where, obj, "last_timestamp", _is_int, "an integer (Unix s)", optional=True)
    feats = 'a list of {"name", "kind": "categorical" (+ "values") | "numeric" (+ "buckets", "edges")} (hstu.data.features)'
    ok = lambda m: (  # noqa: E731
        isinstance(m, dict)
        and isinstance(m.get("name"), str)
        and isinstance(m.get("values" if m.get("kind") == "categorical" else "edges"), list)
    )
    _field(where, obj, "features", lambda v: isinstance(v, list) and all(ok(m) for m in v), feats, optional=True)
    rows = f"a list of {n} lists of integers (one per item_raw_ids entry)"
    _field(where, obj, "item_features", lambda v: isinstance(v, list) and len(v) == n and all(_ints(r) for r in v), rows, optional=True)
    _field(where, obj, "dataset", lambda v: isinstance(v, str), "a text", optional=True)
    _field(where, obj, "data_facts", lambda v: isinstance(v, dict), "an object", optional=True)
    return obj


_KINDS = {"item_raw_ids": "iU", "item_category": "iu", "item_train_counts": "iu", "item_features": "iu"}  # NumPy dtype kinds


def check_items(where: str, arrays: dict, fields: list[str], rows: int) -> dict[str, np.ndarray]:
    """items.npz (issue 21): the arrays ``fields`` (idmap.json ``item_fields``) as read from it, each
    ``rows`` long (idmap.json ``item_rows``, I+1): ``item_raw_ids`` (I+1,) int64 ids starting with 0
    or fixed-width unicode ids starting with "" (returned as an object array of str, the form
    ``EventLog.item_raw_ids`` holds), ``item_category`` / ``item_train_counts`` (I+1,) integers >= 0,
    ``item_features`` (I+1, F) integers. Returns name -> array (the others as stored). Raises
    ValueError naming ``where`` and the field: missing, wrong shape or dtype, a bad padding entry, a
    negative count or category."""
    out = {}
    for name in fields:
        if name not in arrays:
            raise ValueError(f"{where}: {name} is missing (idmap.json item_fields lists it)")
        v = arrays[name]
        ndim = 2 if name == "item_features" else 1
        if v.ndim != ndim or len(v) != rows:
            raise ValueError(f"{where}: {name} must hold {rows} rows (idmap.json item_rows) in {ndim} dimension(s), got shape {v.shape}")
        if v.dtype.kind not in _KINDS[name]:
            want = "int64 or unicode ids" if name == "item_raw_ids" else "integers"
            raise ValueError(f"{where}: {name} must be {want}, got dtype {v.dtype}")
        if name == "item_raw_ids":
            if v[0] != ("" if v.dtype.kind == "U" else 0):
                raise ValueError(f'{where}: item_raw_ids must start with the padding id (0, or "" for text ids), got {v[0]!r}')
            v = v.astype(object) if v.dtype.kind == "U" else v.astype(np.int64, copy=False)
        elif ndim == 1 and rows and v.min() < 0:
            raise ValueError(f"{where}: {name} must be >= 0 (one per item), got {v.min()} at dense id {int(v.argmin())}")
        out[name] = v
    return out


def check_history(where: str, obj: Any) -> list:
    """history.json: one object per epoch, ``epoch`` 1, 2, ... (each once, ascending), numbers
    finite where present."""
    if not isinstance(obj, list):
        raise ValueError(f"{where}: must be a list of per-epoch entries, got {_short(obj)}")
    for i, entry in enumerate(obj):
        at = f"{where} [{i}]"
        _object(at, entry)
        _field(at, entry, "epoch", lambda v, i=i: _is_int(v) and v == i + 1, f"{i + 1} (epochs 1, 2, ... each once)")
        for key in ("loss", "seconds", "sequences_per_s"):
            _field(at, entry, key, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number", optional=True)
        _field(at, entry, "positions", lambda v: _is_int(v) and v >= 0, "an integer >= 0", optional=True)
        for key in ("valid", "test"):
            _field(at, entry, key, lambda v: isinstance(v, dict), "an object of metrics", optional=True)
    return obj


def check_last(where: str, obj: Any) -> dict:
    """last.json (and the manifest in last.safetensors' metadata): the epoch reached, the early
    stopping state, AdamW's param_groups, and (written since issue 22) the history up to it."""
    _object(where, obj)
    epoch = _field(where, obj, "epoch", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    _field(where, obj, "best_epoch", lambda v: _is_int(v) and 0 <= v <= epoch, f"an integer in 0..{epoch} (epoch)")
    _field(where, obj, "best", _is_num, "a finite number")
    _field(where, obj, "bad_epochs", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    _field(where, obj, "train_seconds", lambda v: _is_num(v) and v >= 0, "a number >= 0")
    _field(
        where,
        obj,
        "param_groups",
        lambda v: isinstance(v, list) and v and all(isinstance(g, dict) for g in v),
        "a non-empty list of optimizer parameter groups",
    )
    _field(where, obj, "distributed", lambda v: isinstance(v, dict), "a table", optional=True)
    history = obj.get("history")
    if history is not None:
        check_history(f"{where} history", history)
        if len(history) != epoch:
            raise ValueError(f"{where}: history holds {len(history)} epochs but epoch is {epoch}")
    return obj


CHECKS: dict[str, Callable[[str, Any], Any]] = {
    CONFIG: check_config,
    IDMAP: check_idmap,
    LAST_JSON: check_last,
    HISTORY: check_history,
}


def check_run_json(path: str | Path, obj: Any) -> Any:
    """``obj`` as read from ``path``, checked if its name is a run file of :data:`CHECKS`
    (else returned as it is). Raises ValueError naming ``path`` and the field."""
    check = CHECKS.get(Path(path).name)
    return obj if check is None else check(str(path), obj)


RUN_RECORDS = ("hstu_version", "recipe_changes", "distributed")  # what a run's config.json holds beside its settings


def config_as_settings(raw: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """A run's config.json read by ``--config`` (it records ``hstu_version``): the tables a new run takes as settings.
    Its records go (``hstu_version``, ``recipe_changes``; [data] ``feature_maps``, the maps fitted to that run's data,
    which a new run fits to its own); with a ``distributed`` table, also its [train] ``table_optimizer`` /
    ``table_learning_rate``: they record one process's defaults, not FBGEMM's optimizer the run trained with
    (``--distributed`` picks that again, ``--table-optimizer`` another). Said at INFO."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items() if k not in RUN_RECORDS}
    dropped = [k for k in RUN_RECORDS if k in raw]
    if isinstance(out.get("data"), dict) and out["data"].pop("feature_maps", None) is not None:
        dropped.append("data.feature_maps")
    if "distributed" in raw and isinstance(out.get("train"), dict):
        dropped += [f"train.{k}" for k in ("table_optimizer", "table_learning_rate") if out["train"].pop(k, None) is not None]
    if str(path) not in _SAID:  # a command reads its config file more than once
        _SAID.add(str(path))
        log.info("--config %s: a run's config.json; its records are not settings, left out: %s", path, ", ".join(dropped))
    return out


_SAID: set[str] = set()
