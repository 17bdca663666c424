"""One training per run directory (hstu.runs.training_lock): a second `hstu train` into an --out that another
process is training is refused before it writes anything (a trial's two trainings into one --out both exited 0
and left the small model's config.json beside the large model's weights); an empty --out is refused; a refused
or failed start leaves no directory it made."""

from __future__ import annotations

import multiprocessing
import os

from test_curves import _flags

from hstu.cli import main
from hstu.runs import training_lock


def _hold(run: str, ready, done) -> None:  # another process holding the run, as a training in progress does
    with training_lock(run):
        ready.set()
        done.wait(60)


def test_a_second_training_into_a_run_in_progress_is_refused(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(run), ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        assert main(["train", *_flags(tmp_path), "--epochs", "1", "--out", str(run), "--quiet"]) == 2
        assert f"--out {run} is being trained by another process" in capsys.readouterr().err
        assert os.listdir(run) == []  # nothing written
    finally:
        done.set()
        holder.join(60)
    assert not run.exists()  # the holder made it and left it empty: removed
    assert main(["train", *_flags(tmp_path), "--epochs", "1", "--out", str(run), "--quiet"]) == 0  # free again
    assert (run / "config.json").is_file()


def test_the_lock_is_per_directory_and_an_empty_out_is_refused(tmp_path, capsys) -> None:
    with training_lock(tmp_path / "a"), training_lock(tmp_path / "b"):  # two runs side by side
        assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    with training_lock(tmp_path / "c"):
        pass
    assert (tmp_path / "c").is_dir()  # not made by the lock: kept
    for empty in ("", " "):
        assert main(["train", *_flags(tmp_path), "--out", empty]) == 2
        assert "--out is empty: name the run directory" in capsys.readouterr().err
