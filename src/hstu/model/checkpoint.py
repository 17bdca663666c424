"""Run-directory I/O shared by every job: JSON files, safetensors weights, loading a run.

RUN_DIR/
  config.json             model, train and data settings, hstu version
  model.safetensors       best weights (by valid NDCG@10; last epoch under --protocol paper)
  idmap.json              dense id -> original item id, titles, categories, action names
  metrics.json            {"valid": {...}, "test": {...}, "epochs": n, "train_seconds": s}
  history.json            per-epoch loss, throughput and metrics
  last.safetensors/.json  last epoch's weights, optimizer and RNG state (for --resume); the
                          manifest (epoch, early-stopping state, history) is in last.safetensors'
                          metadata, written in one rename: last.json and history.json are copies
                          of it, repaired on resume (hstu.train.checkpoint)
No pickle anywhere: tensors in safetensors, everything else in JSON. Every file is written to
NAME.tmp and renamed into place; JSON run files are checked field by field as they are read
(hstu.model.run_files).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from hstu import backend
from hstu.config import model_config_from_dict
from hstu.model.run_files import check_run_json

KILL_AT_ENV = "HSTU_TEST_KILL_AT"  # test seam, see crash_point
_renames: dict[str, int] = {}


def crash_point(tmp: Path) -> None:
    """Test seam for kill-at-any-instant tests: with ``HSTU_TEST_KILL_AT=NAME:N`` in the
    environment, SIGKILL this process just before the N-th rename of a temp file called NAME
    (e.g. ``history.json.tmp:2``) into place. Does nothing when the variable is unset."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec:
        return
    name, _, n = spec.rpartition(":")
    if Path(tmp).name == name:
        _renames[name] = _renames.get(name, 0) + 1
        if _renames[name] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2), encoding="utf-8")
    crash_point(tmp)
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """Read JSON; a run file (config.json, idmap.json, last.json, history.json) is also checked
    field by field (:mod:`hstu.model.run_files`). FileNotFoundError says which run file is
    missing; ValueError names the file and the field that is malformed."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: not found (is this a run directory written by `hstu train`?)")
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    return check_run_json(path, obj)


def read_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; ValueError names a truncated or corrupt file."""
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); the run may be incomplete or corrupt") from exc


def read_safetensors_metadata(path: Path) -> dict[str, str]:
    """The metadata (text -> text) of a safetensors file's header; ValueError names a corrupt file."""
    try:
        with safe_open(str(path), "pt") as fh:
            return dict(fh.metadata() or {})
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); the run may be incomplete or corrupt") from exc


def load_state(path: Path, module: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """``module.load_state_dict(state)``; ValueError naming ``path`` for a missing, unexpected or
    wrongly shaped tensor (PyTorch raises RuntimeError for the shapes)."""
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise ValueError(f"{path}: weights do not match the model: {' '.join(str(exc).split())[:300]}") from None
    if strict and (missing or unexpected):
        raise ValueError(f"{path}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def save_weights(path: Path, module: torch.nn.Module, metadata: dict[str, str] | None = None) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    tmp = Path(str(path) + ".tmp")
    save_file(state, str(tmp), metadata=metadata)
    crash_point(tmp)
    os.replace(tmp, path)


def load_weights(path: Path, module: torch.nn.Module, device: torch.device | str = "cpu") -> None:
    """Load safetensors weights; a missing or unexpected key raises ValueError naming it."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: weights not found")
    load_state(path, module, read_safetensors(path, device))


def load_run(run_dir: str | Path, device: str = "cpu"):
    """(model in eval mode on ``device``, config.json dict, idmap.json dict) of a run.

    Raises FileNotFoundError (no run), ValueError naming the run file and field that is
    malformed, or an id map whose item count is not the model's."""
    from hstu.model.hstu import build_hstu

    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: run directory not found")
    cfg = read_json(run / "config.json")
    ids = read_json(run / "idmap.json")
    check_items_match(run, cfg, ids)
    dev = backend.select(device)
    model = build_hstu(model_config_from_dict(cfg["model"])).to(dev.device)
    load_weights(run / "model.safetensors", model, dev.device)
    return model.eval(), cfg, ids


def check_items_match(run: Path, cfg: dict, ids: dict) -> None:
    """ValueError when idmap.json's item count is not config.json's model.num_items (every dense
    id indexes the item table)."""
    n, m = len(ids["item_raw_ids"]) - 1, cfg["model"].get("num_items", 0)
    if n != m:
        raise ValueError(f"{run / 'idmap.json'}: item_raw_ids holds {n} items but {run / 'config.json'} model.num_items is {m}")
