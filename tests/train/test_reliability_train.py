"""Issue 22, run-file faults found by a break-it campaign: corrupt or mistyped run files on
resume and load (7), and kill -9 between the per-epoch writes losing an epoch's history (8)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import tiny_csv_flags
from safetensors.torch import load_file, save_file

from hstu.cli import main
from hstu.model.checkpoint import KILL_AT_ENV
from hstu.runs import load_run


def _data(d):
    return tiny_csv_flags(d, train={"epochs": 2})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(data flags, an uninterrupted 2-epoch run)."""
    d = tmp_path_factory.mktemp("rel")
    flags = _data(d)
    assert main(["train", *flags, "--out", str(d / "ref"), "--quiet"]) == 0
    return flags, d / "ref"


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _strip_manifest(run):
    """last.safetensors as written before the manifest existed (no metadata): last.json is its record."""
    p = str(run / "last.safetensors")
    save_file(load_file(p), p)


def _edit(name, fn):
    def mutate(run):
        obj = json.loads((run / name).read_text())
        fn(obj)
        (run / name).write_text(json.dumps(obj))

    return mutate


def _truncate(name):
    def mutate(run):
        b = (run / name).read_bytes()
        (run / name).write_bytes(b[: len(b) // 2])

    return mutate


def _old_run(mutate):
    def both(run):
        _strip_manifest(run)
        mutate(run)

    return both


RESUME = ["train", "--resume", "--epochs", "3", "--quiet"]
BAD_FILES = [
    # (command, mutation, file named, the message after "FILE")
    (RESUME, _truncate("last.safetensors"), "last.safetensors", ": not a readable safetensors file ("),
    (
        RESUME,
        _edit("config.json", lambda o: o["data"].__setitem__("max_users", "300")),
        "config.json",
        " data: max_users must be int | None, got '300'",
    ),
    (RESUME, _edit("config.json", lambda o: o.__setitem__("data", "x")), "config.json", ": data must be a table of fields, got 'x'"),
    (RESUME, _edit("config.json", lambda o: o["train"].__setitem__("epochs", 1.5)), "config.json", " train: epochs must be int, got 1.5"),
    (RESUME, _old_run(_edit("last.json", lambda o: o.__setitem__("epoch", "1"))), "last.json", ": epoch must be an integer >= 0, got '1'"),
    (
        RESUME,
        _old_run(_edit("last.json", lambda o: o.__setitem__("best_epoch", 7))),
        "last.json",
        ": best_epoch must be an integer in 0..2 (epoch), got 7",
    ),
    (
        RESUME,
        _old_run(_edit("history.json", lambda o: o[1].__setitem__("epoch", 1))),
        "history.json",
        " [1]: epoch must be 2 (epochs 1, 2, ... each once), got 1",
    ),
    (
        RESUME,
        _edit("idmap.json", lambda o: o.__setitem__("item_raw_ids", "x")),
        "idmap.json",
        ": item_raw_ids must be a list of integer ids starting with 0, or of text ids starting with \"\" (padding), got 'x'",
    ),
    (["eval"], _truncate("model.safetensors"), "model.safetensors", ": not a readable safetensors file ("),
    (["eval"], _edit("config.json", lambda o: o.__setitem__("data", "x")), "config.json", ": data must be a table of fields, got 'x'"),
    (
        ["generate", "--user", "1"],
        _edit("config.json", lambda o: o["model"].__setitem__("num_heads", "1")),
        "config.json",
        " model: num_heads must be int, got '1'",
    ),
    (
        ["generate", "--user", "1"],
        _edit("idmap.json", lambda o: o.__setitem__("titles", [1])),
        "idmap.json",
        ": titles must be an object of id -> title text, got [1]",
    ),
    (
        ["generate", "--user", "1"],
        _edit("idmap.json", lambda o: o.__setitem__("action_names", "pv")),
        "idmap.json",
        ": action_names must be a list of texts, got 'pv'",
    ),
    (
        ["serve", "--port", "0"],
        _edit("config.json", lambda o: o["model"].__setitem__("embedding_dim", None)),
        "config.json",
        " model: embedding_dim must be int, got None",
    ),
]


@pytest.mark.parametrize("cmd,mutate,name,message", BAD_FILES, ids=[f"{c[0]}-{n}-{i}" for i, (c, _, n, _) in enumerate(BAD_FILES)])
def test_a_malformed_run_file_is_one_line_naming_file_and_field(base, tmp_path, capsys, cmd, mutate, name, message):
    """Fault 7: a truncated last.safetensors was a SafetensorError traceback on --resume;
    data.max_users "300" gave "'<=' not supported ...", "data": "x" "'str' object is not a
    mapping", last.json epoch "1" a TypeError text."""
    run = _copy(base[1], tmp_path)
    mutate(run)
    where = ["--out", str(run)] if cmd[0] == "train" else ["--run", str(run)]
    assert main([*cmd, *where]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"hstu {cmd[0]}: error: {run / name}{message}"), err[-1]


def test_load_run_names_an_id_map_of_another_size(base, tmp_path):
    run = _copy(base[1], tmp_path)
    _edit("idmap.json", lambda o: [o[k].pop() for k in ("item_raw_ids", "item_category", "item_train_counts")])(run)
    with pytest.raises(ValueError, match=r"idmap.json: item_raw_ids holds 19 items but .*config.json model.num_items is 20"):
        load_run(run)


def _history(run):
    return json.loads((run / "history.json").read_text())


def _check_like_reference(run, ref):
    """history.json has each epoch once, agrees with last.json, and the resumed run's numbers and
    weights are the uninterrupted run's."""
    hist, last = _history(run), json.loads((run / "last.json").read_text())
    assert [h["epoch"] for h in hist] == [1, 2] and last["epoch"] == 2 and last["history"] == hist
    assert [h["loss"] for h in hist] == pytest.approx([h["loss"] for h in _history(ref)], rel=1e-5)
    assert [h["valid"]["NDCG@10"] for h in hist] == pytest.approx([h["valid"]["NDCG@10"] for h in _history(ref)], rel=1e-5)
    for f in ("last.safetensors", "model.safetensors"):
        a, b = load_file(str(run / f)), load_file(str(ref / f))
        assert a.keys() == b.keys()
        for k in a:
            if not k.startswith("rng."):
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_resume_after_history_json_lost_the_last_epoch(base, tmp_path):
    """Fault 8 as the campaign left it: last.json written for epoch 2, killed before history.json
    was renamed, so history.json still ends at epoch 1. Resume used to keep [1]."""
    ref = base[1]
    run = _copy(ref, tmp_path)
    (run / "history.json").write_text(json.dumps(_history(run)[:1]))
    (run / "metrics.json").unlink()
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    _check_like_reference(run, ref)


@pytest.mark.parametrize("name", ["history.json", "last.json"])
def test_resume_repairs_a_cut_off_history_or_last_json(base, tmp_path, name):
    """A trial's finding: half of history.json stopped `--resume` ("not valid JSON") while half of last.json was
    repaired: both are copies of the commit in last.safetensors, so both are rewritten from it (as cli.md says)."""
    ref = base[1]
    run = _copy(ref, tmp_path)
    text = (run / name).read_text()
    (run / name).write_text(text[: len(text) // 2])
    (run / "metrics.json").unlink()
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    _check_like_reference(run, ref)


# each rename of an epoch's commit, in the order they happen: epoch 1's (nothing committed yet;
# committed, but not its best weights) and epoch 2's (no better valid NDCG@10 here: no best weights)
KILL_POINTS = ["last.safetensors.tmp:1", "model.safetensors.tmp:1", "last.safetensors.tmp:2", "last.json.tmp:2", "history.json.tmp:2"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_at_any_write_then_resume_is_consistent(base, tmp_path, point):
    """Fault 8: a real SIGKILL just before each file of an epoch is renamed into place (the
    HSTU_TEST_KILL_AT seam), then --resume: every epoch is in history.json exactly once, as in
    last.json, and the run ends as the uninterrupted one."""
    flags, ref = base
    run = tmp_path / "run"
    env = {**os.environ, KILL_AT_ENV: point, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    p = subprocess.run(
        [sys.executable, "-m", "hstu", "train", *flags, "--out", str(run), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    _check_like_reference(run, ref)
