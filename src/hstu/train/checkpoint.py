"""Training state for --resume (weights, AdamW moments, RNG) in safetensors + JSON.

The run-directory layout is documented in :mod:`hstu.model.checkpoint`. One epoch's state is
committed by one rename: last.safetensors holds the tensors and, in its metadata, the manifest
(epoch, early-stopping state, AdamW param_groups, the history up to this epoch). last.json and
history.json are written after it as readable copies, so a kill at any instant leaves either the
previous epoch's commit or this one's, and :func:`repair_run_files` rewrites the copies from the
manifest on resume (a kill before history.json was renamed lost that epoch's entry).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hstu.model.checkpoint import (crash_point, load_state, read_json, read_safetensors, read_safetensors_metadata,
                                   write_json)
from hstu.model.run_files import check_history, check_last

log = logging.getLogger(__name__)
MANIFEST_KEY = "hstu_train_state"  # last.safetensors metadata: the JSON manifest


def has_train_state(run: Path) -> bool:
    """Whether ``run`` holds a resumable state (last.safetensors, or last.json of an older run)."""
    return (run / "last.safetensors").exists() or (run / "last.json").exists()


def save_train_state(run: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, info: dict,
                     history: list[dict]) -> None:
    """Commit one epoch: weights, AdamW moments and RNG states as tensors, and the manifest
    ``{**info, "param_groups", "history"}`` in the same file's metadata (one rename), then its
    copies last.json and history.json. ``info``: epoch, best, best_epoch, bad_epochs,
    train_seconds (+ optional distributed); ``history``: one entry per epoch 1..epoch."""
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for pid, st in sd["state"].items():
        for name, val in st.items():
            tensors[f"optim.{pid}.{name}"] = torch.as_tensor(val).detach().contiguous().cpu()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.negatives"] = gen.get_state()
    manifest = {**info, "param_groups": sd["param_groups"], "history": history}
    tmp = run / "last.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={MANIFEST_KEY: json.dumps(manifest)})
    crash_point(tmp)
    os.replace(tmp, run / "last.safetensors")  # the commit
    write_json(run / "last.json", manifest)
    write_json(run / "history.json", history)


def load_train_state(run: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> dict:
    """Restore the last committed epoch into ``model``, ``opt`` and ``gen``; returns its manifest
    (epoch, best, best_epoch, bad_epochs, train_seconds, param_groups, history: a list of entries
    1..epoch, ...). A run written before the manifest existed reads last.json, and history.json
    cut at its epoch. Raises ValueError naming the file (and field) that is missing, corrupt
    or does not match the model / optimizer."""
    path = run / "last.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found; the run has no training state to resume")
    tensors = read_safetensors(path)
    text = read_safetensors_metadata(path).get(MANIFEST_KEY)
    if text is not None:
        where = f"{path} (metadata {MANIFEST_KEY})"
        try:
            info = check_last(where, json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
    else:  # written before the manifest: last.json is the record; history.json may hold one epoch more
        info = read_json(run / "last.json")
        old = read_json(run / "history.json") if (run / "history.json").exists() else []
        info["history"] = check_history(str(run / "history.json"), [h for h in old if h["epoch"] <= info["epoch"]])
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
    """Rewrite last.json and history.json from a loaded manifest (:func:`load_train_state`) where
    a kill left them behind it (call from one process only: the temp-file names are fixed)."""
    history = info["history"]
    for name, want in (("last.json", info), ("history.json", history)):
        path = run / name
        try:
            same = path.exists() and json.loads(path.read_text(encoding="utf-8")) == json.loads(json.dumps(want))
        except (OSError, ValueError):
            same = False
        if not same:
            log.warning("%s did not match the last committed epoch (%d, in %s): rewritten from it", path, info["epoch"],
                        run / "last.safetensors")
            write_json(path, want)
