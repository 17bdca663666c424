"""Run-directory I/O shared by every job: JSON files, safetensors weights, loading a run.

RUN_DIR/
  config.json             model, train and data settings, hstu version
  model.safetensors       best weights (by valid NDCG@10; last epoch under --protocol paper)
  idmap.json              dense id -> original item id, titles, categories, action names
  metrics.json            {"valid": {...}, "test": {...}, "epochs": n, "train_seconds": s}
  history.json            per-epoch loss, throughput and metrics
  last.safetensors/.json  last epoch's weights, optimizer and RNG state (for --resume)
No pickle anywhere: tensors in safetensors, everything else in JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hstu import backend
from hstu.config import model_config_from_dict


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """Read JSON; FileNotFoundError says which run file is missing."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: not found (is this a run directory written by `hstu train`?)")
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def read_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; ValueError names a truncated or corrupt file."""
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); the run may be incomplete or corrupt") from exc


def save_weights(path: Path, module: torch.nn.Module, metadata: dict[str, str] | None = None) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    tmp = Path(str(path) + ".tmp")
    save_file(state, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def load_weights(path: Path, module: torch.nn.Module, device: torch.device | str = "cpu") -> None:
    """Load safetensors weights; a missing or unexpected key raises ValueError naming it."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: weights not found")
    state = read_safetensors(path, device)
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_run(run_dir: str | Path, device: str = "cpu"):
    """(model in eval mode on ``device``, config.json dict, idmap.json dict) of a run."""
    from hstu.model.hstu import build_hstu

    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: run directory not found")
    cfg = read_json(run / "config.json")
    ids = read_json(run / "idmap.json")
    dev = backend.select(device)
    model = build_hstu(model_config_from_dict(cfg["model"])).to(dev.device)
    load_weights(run / "model.safetensors", model, dev.device)
    return model.eval(), cfg, ids
