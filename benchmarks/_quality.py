"""Shared pieces of the quality benchmarks (reproduce_ml1m.py, taobao.py): resumable training runs,
provenance (machine, git commit, exact command); the validation-curve plot is hstu.report.plots.plot_curves."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from hstu.backend import CPUBackend
from hstu.config import ModelConfig, TrainConfig
from hstu.data.prepare import DataSpec
from hstu.model.checkpoint import read_json
from hstu.report.plots import plot_curves  # noqa: F401 (the benchmarks' curve plot, re-exported)
from hstu.train.loop import fit

log = logging.getLogger("benchmarks")
REPO = Path(__file__).resolve().parents[1]


def command() -> str:
    """The exact command line that is running (for the result files)."""
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def git_commit() -> str:
    """HEAD commit, with "+dirty" when the working tree differs from it (read-only git calls)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> dict:
    """CPU model, core counts, torch threads and versions."""
    cpu = CPUBackend().device_name()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def finite(obj):
    """A copy of a JSON-ready object with NaN / ±inf floats replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(obj), indent=2, allow_nan=False) + "\n", encoding="utf-8")


def run_spec(run_dir: Path, spec: DataSpec) -> DataSpec:
    """``spec`` with the user subset the run in ``run_dir`` recorded (config.json ``data.max_users``):
    a run is rescored on the users it was trained and tested on, whatever ``--max-users`` this
    invocation got (``--report-only`` without it rescored smoke runs on all users). ``spec`` as
    is when the run has no config.json yet."""
    cfg = Path(run_dir) / "config.json"
    if not cfg.exists():
        return spec
    recorded = (read_json(cfg).get("data") or {}).get("max_users")
    if recorded != spec.max_users:
        log.info("%s: rescoring on the run's own users (max_users=%s, not %s)", run_dir, recorded, spec.max_users)
        return dataclasses.replace(spec, max_users=recorded)
    return spec


def train_or_resume(
    run_dir: Path, mcfg: ModelConfig, tcfg: TrainConfig, spec: DataSpec, *, device: str = "cpu", **fit_kwargs
) -> tuple[dict, list]:
    """Finished run (metrics.json present): read it. Otherwise train, continuing from
    RUN_DIR/last.* when a previous invocation was interrupted. ``fit_kwargs`` (e.g. ``data``,
    ``max_minutes``) go to :func:`hstu.train.loop.fit`. Returns (metrics, history)."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.json").exists():
        log.info("%s: finished run found, not retraining (delete the directory to retrain)", run_dir)
        return read_json(run_dir / "metrics.json"), read_json(run_dir / "history.json")
    resume = (run_dir / "last.json").exists() and (run_dir / "config.json").exists()
    if resume:
        log.info("%s: resuming an interrupted run", run_dir)
    metrics = fit(run_dir, mcfg, tcfg, spec, device=device, resume=resume, overwrite=True, progress=False, **fit_kwargs)
    return metrics, read_json(run_dir / "history.json")


def interim_metrics(run_dir: Path, spec: DataSpec, *, device: str = "cpu") -> tuple[dict, list] | None:
    """An unfinished run (history.json, no metrics.json): the best checkpoint so far evaluated on
    valid and test, marked in progress (a resumed run continues it). None without a history."""
    import numpy as np

    from hstu.data.prepare import prepare_data
    from hstu.runs import load_run
    from hstu.train.evaluate import evaluate

    run_dir = Path(run_dir)
    if not (run_dir / "history.json").exists() or not (run_dir / "model.safetensors").exists():
        return None
    history = read_json(run_dir / "history.json")
    model, _, _ = load_run(run_dir, device)
    log_, split = prepare_data(spec)
    valid = [h for h in history if "valid" in h]
    best = max(valid, key=lambda h: h["valid"]["NDCG@10"])["epoch"] if valid and spec.protocol == "clean" else history[-1]["epoch"]
    metrics = {
        "valid": evaluate(model, log_, split, "valid", device=device),
        "test": evaluate(model, log_, split, "test", device=device),
        "epochs": history[-1]["epoch"],
        "best_epoch": best,
        "train_seconds": round(sum(h["seconds"] for h in history), 2),
        "sequences_per_s": round(float(np.mean([h["sequences_per_s"] for h in history])), 1),
        "protocol": spec.protocol,
        "status": f"in progress: interrupted after epoch {history[-1]['epoch']}; rerun the run's command to resume",
    }
    return metrics, history
