"""A fresh training in place of an old run (``hstu train --overwrite``, ``fit(overwrite=True)``) without losing the
old run to a start that fails: its files are set aside in ``RUN/.replaced/`` until the new run commits its first
epoch (then deleted), and put back if the new run fails or is interrupted before that (Ctrl-C in the first epoch
used to delete the old model). A process killed outright leaves ``.replaced/`` holding the old run; the next fresh
start into ``RUN`` takes it as the run set aside (the files beside it are that killed start's, never committed).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hstu.runs import CONFIG, IDMAP, ITEMS, RUN_FILES, remove_run_files

ASIDE = ".replaced"


def set_aside(run: Path) -> Path | None:
    """Move the run files in ``run`` (the old run's) into ``run/.replaced/``; return that directory, or None when
    there was nothing to keep."""
    run, aside = Path(run), Path(run) / ASIDE
    if aside.is_dir():  # a start killed before its first commit: the old run is in there, these files are that start's
        remove_run_files(run, everything=True)  # run itself stays: .replaced/ is in it
        return aside
    files = [f for f in (*RUN_FILES, CONFIG, IDMAP, ITEMS) if (run / f).exists()]
    if not files:
        return None
    aside.mkdir()
    for f in files:
        os.replace(run / f, aside / f)
    return aside


def put_back(run: Path, aside: Path | None) -> None:
    """After a start that committed no epoch: remove its files (and ``run`` if that leaves it empty), and move the
    old run's back from ``aside``."""
    remove_run_files(Path(run), everything=True)
    if aside is None:
        return
    for f in aside.iterdir():
        os.replace(f, Path(run) / f.name)
    aside.rmdir()


def drop(aside: Path | None) -> None:
    """The new run committed an epoch: the old run's files go. Returns None (the caller's ``aside``)."""
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def resumed_commit(run: Path, epoch: int, config: dict) -> None:
    """A resumed run's files once a new epoch (``epoch``) has committed: config.json becomes this training's ``config``
    (written only now: a resume interrupted before its first commit changed neither the recorded recipe nor epochs), and
    metrics.json's figures are an earlier epoch's (model.safetensors may already hold a newer best), so its ``status``
    says so until this training reports (a resume cut in its final evaluation left "completed" beside newer epochs)."""
    from hstu.model.checkpoint import read_json, write_json
    from hstu.runs import METRICS, write_config

    write_config(run, config)

    path = Path(run) / METRICS
    try:
        m = read_json(path) if path.exists() else None
    except ValueError:  # a malformed report: left as it is (the training's own report replaces it), never a stopped training
        return
    if m is not None:
        m["status"] = (
            f"stale: epochs up to {epoch} committed since this report of epoch {m.get('epochs')}; hstu train --resume reports them"
        )
        write_json(path, m)


def last_commit(run: Path) -> dict | None:
    """``run``'s last commit (:func:`hstu.runs.read_manifest`), or None where it has none or it cannot be read: equal
    before and after an interrupted ``--overwrite``, the old run is there as it was."""
    from hstu.runs import has_train_state, read_manifest

    try:
        return read_manifest(run) if has_train_state(run) else None
    except (OSError, ValueError):  # unreadable: no promise
        return None


def said_restored(exc: BaseException, restored: bool) -> None:
    """Mark ``exc`` (``old_run_restored``) for :func:`hstu.interrupts.interrupted`'s line; an exception that takes no
    attribute is left as it is (the line then reads as without a mark)."""
    try:
        exc.old_run_restored = restored
    except (AttributeError, TypeError):
        pass
