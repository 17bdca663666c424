"""`hstu doctor` / `hstu doctor --conformance` command-line faults from a user trial: a quantized run called
incomplete, a --report directory found only after the run (with a temp file left beside it), flags of one mode
ignored in the other, --json ignored, --reps below 1 accepted. The checks themselves are stubbed where a test is
about the command line (the real CPU self-check: test_conformance.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hstu.cli import main
from hstu.ops.conformance import Conformance, write_report

REPORT = {
    "status": "pass",
    "device": {"device": "cpu", "name": "cpu"},
    "model": {"cfg": "stub", "buckets": [20]},
    "ops_failed": [],
    "ops": [{"op": "aten.mm.default", "calls_checked": 1, "max_rel_error": 0.0, "tolerance": 2e-3, "status": "pass"}],
    "end_to_end": {"encode_rel_error": 0.0, "next5_same_items_ratio": 1.0, "status": "pass"},
    "graphs": {"status": "skipped", "why": "cpu: no device graph mode"},
    "seconds": 0.1,
}


@pytest.fixture
def stub_run(monkeypatch):
    """Conformance.run returns REPORT at once; ``calls`` counts the runs."""
    calls = []
    monkeypatch.setattr(Conformance, "run", lambda self, run_op=None: calls.append(1) or REPORT)
    return calls


@pytest.fixture(scope="module")
def quantized_runs(tmp_path_factory):
    """A tiny trained float run and its INT8 and BF16 copies made by `hstu quantize`: {"float": .., "int8": .., "bf16": ..}."""
    from conftest import tiny_csv_flags

    d = tmp_path_factory.mktemp("quantized")
    runs = {"float": d / "run", "int8": d / "int8", "bf16": d / "bf16"}
    assert main(["train", *tiny_csv_flags(d, train={"epochs": 1}), "--out", str(runs["float"]), "--quiet"]) == 0
    for scheme in ("int8", "bf16"):
        assert main(["quantize", "--run", str(runs["float"]), "--scheme", scheme, "--out", str(runs[scheme]), "--no-calibrate"]) == 0
    return runs


@pytest.mark.parametrize("scheme", ["int8", "bf16"])
def test_a_quantized_run_is_refused_naming_the_float_run(quantized_runs, scheme, stub_run, tmp_path, capsys):
    """`--conformance --run Q` of a valid quantized run said "model.quant.safetensors is there but not quant.json: an
    incomplete quantized copy"; it says the run is quantized and names the float run to check instead."""
    q, report = quantized_runs[scheme], tmp_path / "r.json"
    capsys.readouterr()
    assert main(["doctor", "--conformance", "--device", "cpu", "--run", str(q), "--report", str(report)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "incomplete" not in err, err
    assert f"--run {q} is a quantized run ({scheme}, quant.json)" in err and f"(--run {quantized_runs['float']})" in err, err
    assert not stub_run and not report.exists()


@pytest.mark.parametrize("where", ["directory", "missing parent"])
def test_a_bad_report_path_is_refused_before_the_run(where, stub_run, tmp_path, capsys):
    """`--report DIR` ran the whole check, then failed with a raw "[Errno 21] Is a directory" and left a temp file."""
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" if where == "directory" else tmp_path / "nope" / "r.json"
    assert main(["doctor", "--conformance", "--device", "cpu", "--report", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"hstu doctor --conformance: --report {path}: "), err
    assert ("is a directory" if where == "directory" else f"{tmp_path / 'nope'} does not exist") in err
    assert not stub_run
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["d"]


def test_a_failed_report_write_leaves_no_temp_file(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        write_report(REPORT, tmp_path / "d")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["d"]
    assert json.loads(write_report(REPORT, tmp_path / "r.json").read_text()) == REPORT
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["d", "r.json"]


@pytest.mark.parametrize("flag, value", [("--device", "cpu"), ("--run", "RUN"), ("--report", "r.json"), ("--reps", "3")])
def test_a_conformance_flag_without_conformance_is_refused(flag, value, capsys):
    """`hstu doctor --device cpu` (and --run, --report, --reps) ran the environment checks and exited 0."""
    assert main(["doctor", "--no-import-probes", flag, value]) == 2
    assert capsys.readouterr().err.strip() == f"hstu doctor: {flag} needs --conformance"


@pytest.mark.parametrize("flag", ["--compat", "--ascend-root", "--no-import-probes"])
def test_an_environment_check_flag_with_conformance_is_refused(flag, stub_run, tmp_path, capsys):
    """`--conformance --compat bad.toml` exited 0 (the table is never read there) though `--compat bad.toml` alone
    exits 2: flags of the environment checks are refused with --conformance."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[[[ not toml\n")
    value = {"--compat": [str(bad)], "--ascend-root": [str(tmp_path)], "--no-import-probes": []}[flag]
    report = tmp_path / "r.json"
    assert main(["doctor", "--conformance", "--device", "cpu", "--report", str(report), flag, *value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hstu doctor: {flag} is for the environment checks, which --conformance does not run"), err
    assert not stub_run and not report.exists()
    if flag == "--compat":  # alone, as before: read and refused
        assert main(["doctor", "--no-import-probes", "--compat", str(bad)]) == 2
        assert str(bad) in capsys.readouterr().err


@pytest.mark.parametrize("reps", ["-5", "0"])
def test_reps_below_one_is_refused(reps, stub_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--conformance", "--device", "cpu", "--reps", reps, "--report", str(tmp_path / "r.json")])
    assert e.value.code == 2
    assert f"argument --reps: must be >= 1, got {reps}" in capsys.readouterr().err
    assert not stub_run and not list(tmp_path.iterdir())


def test_json_with_conformance_prints_the_report(stub_run, tmp_path, capsys):
    """`hstu doctor --json --conformance` printed the text summary."""
    report = tmp_path / "r.json"
    assert main(["doctor", "--json", "--conformance", "--device", "cpu", "--report", str(report)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == REPORT == json.loads(report.read_text())
    assert f"report: {report}" in err
    assert Path(report).exists() and len(stub_run) == 1
