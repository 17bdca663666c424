"""Bad input to the command line gets one line naming the file, never a traceback (a fresh-user trial's findings):
a --config that is a directory or not UTF-8, a --history nested deeper than the JSON decoder recurses or whose
events cannot be used (empty, text ids for an integer-id run, only unknown ids), and stdout closed by the reader
(`hstu ... | head`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hstu.cli import _history_from_file, main
from hstu.generate.recommend import HistoryError


@pytest.mark.parametrize("kind", ["directory", "latin-1", "missing"])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, capsys, kind) -> None:
    cfg = tmp_path / "c.toml"
    if kind == "directory":
        cfg.mkdir()
    elif kind == "latin-1":
        cfg.write_bytes("[train]\n# d\xe9j\xe0 vu\nepochs = 2\n".encode("latin-1"))
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hstu train: error: ") and str(cfg) in err and "\n" not in err, err
    assert "Errno" not in err  # not the OS's raw message: "--config PATH: no such file" / "is a directory, ..."
    assert not (tmp_path / "run").exists()


def test_a_config_with_a_byte_order_mark_is_read(tmp_path) -> None:
    from hstu.config import load_config_file

    cfg = tmp_path / "c.toml"
    cfg.write_bytes("\ufeff[train]\nepochs = 3\n".encode())  # as Windows editors save "UTF-8 with BOM"
    assert load_config_file(cfg)["train"].epochs == 3


def test_a_file_in_place_of_a_run_directory_is_named_as_such(run_dir, tmp_path, capsys) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    report = ["report", "--run", str(f), "--out", str(tmp_path / "rep")]
    for argv in (["generate", "--run", str(f), "--user", "1"], ["eval", "--run", str(f)], report):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().endswith(f"{f}: is a file, not a run directory (hstu train --out writes one)"), argv
    assert main(["train", "--out", str(f), "--epochs", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"hstu train: error: --out {f}: is a file, not a run directory; choose another --out"
    assert f.read_text() == "x"


def test_a_deeply_nested_history_is_invalid_json_naming_the_file(tmp_path) -> None:
    f = tmp_path / "h.json"
    f.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(HistoryError, match=rf"{f}: not valid JSON: .*recursion"):
        _history_from_file(str(f))


@pytest.mark.parametrize(
    "events, why",
    [
        ([], "history: empty"),
        ([{"item_id": "abc", "timestamp": 1}], "history[0].item_id: not an integer id"),
        ([{"item_id": 10**9, "timestamp": 1}], "history: no known item ids left"),
    ],
    ids=["empty", "text-id", "unknown-ids"],
)
def test_an_unusable_history_file_is_one_line_naming_it(run_dir, tmp_path, capsys, events, why) -> None:
    f = tmp_path / "h.json"
    f.write_text(json.dumps(events))
    assert main(["generate", "--run", str(run_dir), "--history", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hstu generate: error: {f}: {why}") and "\n" not in err, err


def test_flags_one_users_call_does_not_read_are_warned(run_dir, tmp_path, capsys) -> None:
    """A trial: `generate --history F --top-k 3 --beam-width 8 --data-dir /nonexistent` ran greedy without a word."""
    f = tmp_path / "h.json"
    f.write_text(json.dumps([{"item_id": 1, "timestamp": 1_000_000}, {"item_id": 2, "timestamp": 1_000_060}]))
    argv = ["generate", "--run", str(run_dir), "--history", str(f), "-k", "2"]
    assert main([*argv, "--top-k", "3", "--beam-width", "8", "--data-dir", str(tmp_path / "none")]) == 0
    err = capsys.readouterr().err
    assert "warning: --top-k 3, --beam-width 8: not used by strategy 'greedy', ignored" in err, err
    assert f"warning: --data-dir {tmp_path / 'none'}: not read with --history" in err, err
    assert main([*argv, "--strategy", "beam", "--beam-width", "8"]) == 0 and "warning" not in capsys.readouterr().err


def test_stdout_closed_by_the_reader_ends_quietly() -> None:
    """The reader goes away before the command writes (as `| head` does after its lines): no BrokenPipeError
    traceback, and no 'Exception ignored' at exit (Python docs, signal module, "Note on SIGPIPE")."""
    p = subprocess.Popen([sys.executable, "-m", "hstu", "doctor", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    _, err = p.communicate(timeout=300)
    assert p.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_an_interrupt_while_the_parser_loads_is_one_line(capsys, monkeypatch, signal_name) -> None:
    """Ctrl-C in the first seconds (the parser imports torch) printed a KeyboardInterrupt traceback, and SIGTERM
    then killed the process without a word; raised inside an import, either could leave torch half-initialised (an
    abort, a segfault, a lost SIGTERM). Now noted while the parser loads, then one line, exit 130 / 143."""
    import os
    import signal

    from hstu import cli

    build = cli.build_parser

    def loading():  # the signal comes while the imports run: noted, reported once they are done (not raised inside one)
        os.kill(os.getpid(), getattr(signal, signal_name))
        return build()

    monkeypatch.setattr(cli, "build_parser", loading)
    stray = []
    previous = signal.signal(signal.SIGTERM, lambda *a: stray.append(a))  # main() installs its own; a leak lands here
    try:
        rc = main(["--verbose", "quantize", "--run", "r", "--scheme", "int8", "--out", "o"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    want = {"SIGINT": (130, "interrupted"), "SIGTERM": (143, "terminated")}[signal_name]
    assert not stray and (rc, capsys.readouterr().err.strip()) == (want[0], f"hstu quantize: {want[1]}")


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_signal_after_the_command_returned_keeps_its_exit_status(tmp_path, signal_name) -> None:
    """The interpreter's exit takes ~0.7 s after a command's last line (torch's teardown): Ctrl-C there gave a
    traceback and exit 1, SIGTERM exit -15, though the output was complete. Both are now ignored (SIG_IGN, which
    CPython keeps through finalization, unlike a Python handler): the process ends with the command's own status
    (here `hstu diagnose`'s 1: the log matched)."""
    log = tmp_path / "plog.log"
    log.write_text("[ERROR] RUNTIME(12345): EL0004: Failed to allocate memory.\n")
    script = (
        "import os, signal, sys, time\n"
        "from hstu.cli import main\n"
        f"sys.argv = ['hstu', 'diagnose', {str(log)!r}]\n"
        "rc = main()\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN\n"
        f"os.kill(os.getpid(), signal.{signal_name})\n"
        "time.sleep(0.5)\n"
        "sys.exit(rc)\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "EL0004" in p.stdout, (p.returncode, p.stderr[-2000:])


def test_a_history_file_with_a_byte_order_mark_is_read(tmp_path) -> None:
    """A UTF-8 file with a byte-order mark (Windows editors) was 'not valid JSON'; it reads as without one."""
    events = [{"item_id": 3, "timestamp": 10}, {"item_id": 7, "timestamp": 20, "action": "click"}]
    plain, bom = tmp_path / "h.json", tmp_path / "bom.json"
    plain.write_text(json.dumps(events), encoding="utf-8")
    bom.write_text(json.dumps(events), encoding="utf-8-sig")
    assert bom.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert _history_from_file(str(bom)) == _history_from_file(str(plain))


def test_resume_of_a_run_whose_csv_data_moved_names_its_path(tmp_path, capsys) -> None:
    """`train --resume` of a csv run whose file had moved fell back to the default ML-1M directory and said
    '/.../ml-1m: no event-log file in it'; it names the run's own data now (as eval and generate do)."""
    from conftest import tiny_csv_flags

    flags = tiny_csv_flags(tmp_path, train={"epochs": 1})
    run = tmp_path / "run"
    assert main(["train", *flags, "--out", str(run), "--quiet"]) == 0
    (tmp_path / "log.csv").rename(tmp_path / "moved.csv")
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run), "--epochs", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"hstu train: error: --resume: the run's csv data {(tmp_path / 'log.csv').resolve()} is not found; pass --data-dir", err


def test_an_interrupt_says_what_a_rerun_goes_on_from(capsys, tmp_path, monkeypatch) -> None:
    """Ctrl-C on `generate --all-users` or `export --graphs` said only "interrupted"; both keep their work (finished
    parts, built graphs) and the same command goes on from it: the line says so. Other commands: the plain line.
    `--all-users` said its parts stay also when no chunk had finished and OUT.parts/ was removed: it says so only
    where OUT.parts/ holds a finished chunk (not job.json alone, nor a part still being written)."""
    import argparse

    from hstu.interrupts import Terminated, interrupted

    ns = argparse.Namespace
    out, parts = tmp_path / "recs.jsonl", tmp_path / "recs.jsonl.parts"
    gen = ns(command="generate", all_users=True, out=str(out))
    kept = f"finished parts stay in {out}.parts/: the same command goes on from them"
    lost = "no chunk was finished, nothing is kept: run the command again"

    def line(args, exc, code: int) -> str:
        assert interrupted(args, exc) == code
        return capsys.readouterr().err.strip()

    assert line(gen, KeyboardInterrupt(), 130) == f"hstu generate: interrupted; {lost}"  # no OUT.parts/
    parts.mkdir()
    (parts / "job.json").write_text("{}")
    (parts / "chunk-000000.jsonl.tmp").write_text("")
    assert line(gen, Terminated(), 143) == f"hstu generate: terminated; {lost}"
    (parts / "chunk-000001.jsonl").write_text("{}\n")
    assert line(gen, KeyboardInterrupt(), 130) == f"hstu generate: interrupted; {kept}"
    graphs = ns(command="export", graphs=True, run="r", out=None)
    assert line(graphs, Terminated(), 143).startswith("hstu export: terminated; the graphs built so far stay in r/graphs")
    assert line(ns(command="generate", all_users=False, out=None), KeyboardInterrupt(), 130) == "hstu generate: interrupted"
    assert line(ns(command="export", graphs=False, run="r", out="o"), KeyboardInterrupt(), 130) == "hstu export: interrupted"
    ranks = ns(command="train", distributed=True, out=str(tmp_path / "none"))  # torchrun: Ctrl-C reaches every rank
    monkeypatch.setenv("RANK", "1")
    assert line(ranks, KeyboardInterrupt(), 130) == ""  # the other ranks say nothing
    monkeypatch.setenv("RANK", "0")
    assert line(ranks, KeyboardInterrupt(), 130).startswith("hstu train: interrupted; no epoch was committed")
