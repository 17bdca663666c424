"""hstu.model.checkpoint.staged_dir, the whole-or-nothing directory writer of `hstu quantize` and `hstu export`:
found by a fresh-user trial: an `--out` that was a symbolic link to an empty directory was replaced by the output
(the link left behind as a hidden `.NAME.old-*`), a link to nothing failed after all the work with a raw errno,
`--out .` failed with "PosixPath('.') has an empty name", and an existing empty directory lost its mode."""

from __future__ import annotations

import os

import pytest

from hstu.model.checkpoint import dir_target, staged_dir, write_text


def _write(out, last="done.json", fail=False):
    with staged_dir(out, last=last) as tmp:
        (tmp / "a.bin").write_bytes(b"a")
        (tmp / "sub").mkdir()
        (tmp / last).write_text("{}")
        if fail:
            raise KeyboardInterrupt


def test_a_new_directory_and_a_replaced_one(tmp_path):
    _write(tmp_path / "new" / "out")  # missing parents made
    assert sorted(p.name for p in (tmp_path / "new" / "out").iterdir()) == ["a.bin", "done.json", "sub"]
    (tmp_path / "new" / "out" / "stale").write_text("x")
    _write(tmp_path / "new" / "out")  # a non-empty one: replaced whole
    assert not (tmp_path / "new" / "out" / "stale").exists()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["out"]


def test_an_empty_directory_is_filled_in_place(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o2750)
    before = os.stat(out)
    _write(out)
    after = os.stat(out)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)  # the user's directory, kept
    assert sorted(p.name for p in out.iterdir()) == ["a.bin", "done.json", "sub"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failure_leaves_things_as_they_were(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        _write(out, fail=True)
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    renames = []

    def interrupted(src, dst):  # Ctrl-C while the entries move into an empty --out: the moved ones go again
        if renames:
            raise KeyboardInterrupt
        renames.append(dst)
        os.replace(src, dst)

    monkeypatch.setattr(os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _write(out)
    assert len(renames) == 1 and list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_links_and_dot(tmp_path, monkeypatch):
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    _write(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (target / "done.json").exists()  # written through the link
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match=r"dangling: a symbolic link to .*nowhere, which does not exist"):
        dir_target(tmp_path / "dangling")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert dir_target(".") == here
    _write(".")
    assert sorted(p.name for p in here.iterdir()) == ["a.bin", "done.json", "sub"]


def test_the_last_file_moves_last(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    order = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda s, d: (order.append(os.path.basename(d)), real(s, d)))
    _write(out, last="a.bin")
    assert order == ["sub", "a.bin"]  # by name a.bin would go first


def test_a_killed_writers_temp_directories_go_with_the_next_write(tmp_path):
    """A writer killed outright (SIGKILL, an abort: a trial's export under Ctrl-C once died in a C++ terminate) leaves
    its .NAME.tmp-PID-* beside --out; the next write into that --out removes it, but never a live writer's."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    out = tmp_path / "x"
    orphans = [tmp_path / f".x.tmp-{dead}-abc", tmp_path / f".x.old-{dead}-abc"]
    live = tmp_path / f".x.tmp-{os.getpid()}-zzz"
    foreign = [tmp_path / ".y.tmp-1-abc", tmp_path / ".x.tmp-notapid"]
    for d in (*orphans, live, *foreign):
        d.mkdir()
    with staged_dir(out) as tmp:
        (tmp / "a").write_text("1")
    assert not any(d.exists() for d in orphans)
    assert live.is_dir() and all(d.is_dir() for d in foreign) and (out / "a").read_text() == "1"


def test_a_failed_text_write_leaves_no_temp_file(tmp_path, monkeypatch):
    """write_text: a rename that fails (the target a directory) raises, leaves the target as it was
    and removes its ``.tmp``; a good write replaces the file whole."""
    (tmp_path / "a.json").mkdir()
    with pytest.raises(OSError):
        write_text(tmp_path / "a.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"] and (tmp_path / "a.json").is_dir()
    write_text(tmp_path / "b.json", "[1]")
    write_text(tmp_path / "b.json", "[2]")
    assert (tmp_path / "b.json").read_text() == "[2]" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]
