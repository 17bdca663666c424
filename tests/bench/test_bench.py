"""hstu bench: a --quick run on the tiny trained ML-1M run (conftest ``run_dir``) gives the reference
port's table whose figures agree with each other and with independent computations (the raw call
times in bench.json, the weights file's tensor bytes, hstu eval's HR@10); --compare merges result
files; cells that cannot run are reported with their reason; bad flags are one line, exit 2."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hstu.cli import main

ROWS = [
    "P50 latency (ms)",
    "P99 latency (ms)",
    "QPS (users/s)",
    "memory peak (GB)",
    "model bytes (MB)",
    "HR@10 (test)",
    "NDCG@10 (test)",
    "P50 at 10 events, batch 8 (ms)",
    "P50 at 40 events, batch 8 (ms)",
    "P50 at 100 events, batch 8 (ms)",
    "latency growth, shortest → longest",
]
REFERENCE_COLUMNS = ["A100 FP16 (reference port)", "910B FP16 (reference port)", "910B INT8 (reference port)"]


def table(md: str) -> tuple[list[str], dict[str, list[str]]]:
    """(column headers, row label -> cells) of the Markdown table in ``md``."""
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return head, rows


@pytest.fixture(scope="module")
def quick(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    argv = ["bench", "--run", str(run_dir), "--device", "cpu", "--precisions", "fp32,int8", "--batch", "4"]
    argv += ["--lengths", "10,40,100", "--sweep-batch", "8", "--quick", "--threads", "2", "--out", str(out)]
    assert main(argv) == 0
    return json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text(), out


def test_quick_table_structure_and_consistent_figures(quick, run_dir):
    res, md, out = quick
    head, rows = table(md)
    cpu = res["environment"]["device_name"]
    assert len(head) == 5 and head[2:] == REFERENCE_COLUMNS and head[0].endswith(" FP32") and head[1].endswith(" INT8")
    assert list(rows) == ROWS
    assert rows["P50 latency (ms)"][2:] == ["42.3", "58.7", "39.1"] and rows["QPS (users/s)"][2:] == ["368", "272", "498"]
    assert rows["latency growth, shortest → longest"][2:4] == ["+123 %", "+387 % (unoptimised)"]
    assert cpu and res["environment"]["torch"] == torch.__version__ and res["environment"]["git_commit"]
    with safe_open(str(run_dir / "model.safetensors"), "pt") as f:  # the float weights, as stored
        fp32_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    cells = {c["precision"]: c for c in res["cells"]}
    assert cells["fp32"]["model_bytes"] == fp32_bytes and cells["int8"]["model_bytes"] < 0.6 * fp32_bytes
    for col, c in enumerate(cells.values()):
        t = np.asarray(c["times_ms"])
        assert len(t) == c["calls"] == 5 and c["history"] == 40  # the longest --lengths value within max_seq_len 50
        assert c["min_ms"] <= c["p50_ms"] <= c["p99_ms"] <= c["max_ms"]
        assert c["p50_ms"] == pytest.approx(float(np.median(t)), rel=1e-3)
        assert 4 / (c["max_ms"] / 1e3) <= c["qps"] <= 4 / (c["min_ms"] / 1e3)  # batch / latency within the spread
        assert c["qps"] == pytest.approx(4 * len(t) / (t.sum() / 1e3), rel=1e-3)
        assert c["memory"]["host_rss_peak_bytes"] > c["model_bytes"] and c["memory"]["device_peak_bytes"] is None
        assert float(rows["P50 latency (ms)"][col]) == pytest.approx(c["p50_ms"], abs=0.006)
        assert float(rows["P50 latency (ms)"][col]) <= float(rows["P99 latency (ms)"][col])
        assert rows["memory peak (GB)"][col] == f"{c['memory']['host_rss_peak_bytes'] / 1e9:.2f} (host RSS)"
        # growth from the P50s shown (rounded to 0.01 ms)
        p10, p40 = float(rows["P50 at 10 events, batch 8 (ms)"][col]), float(rows["P50 at 40 events, batch 8 (ms)"][col])
        shown = int(re.match(r"([+-]\d+) %", rows["latency growth, shortest → longest"][col]).group(1))
        assert abs(shown - 100 * (p40 / p10 - 1)) <= 1
        assert rows["P50 at 100 events, batch 8 (ms)"][col] == "n/a (> max_seq_len)"
        assert c["sweep"]["unavailable"] == {"100": "history 100 > the model's max_seq_len 50"}
    assert (out / "latency_per_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "latency_cdf.png").stat().st_size > 1000


def test_each_precision_is_measured_in_its_own_process(run_dir):
    """A column's peak RSS is its own process's: 400 MB held here do not show in it (in one process they
    did, and each column's peak included every column before it)."""
    psutil = pytest.importorskip("psutil")
    from hstu.backend import BackendUnavailableError, select
    from hstu.bench.cells import Settings, measure_isolated, open_run

    held = torch.ones(100_000_000)  # 400 MB in this process
    here = psutil.Process().memory_info().rss
    st = Settings(device="cpu", batch=2, lengths=(10,), sweep_batch=2, repeats=1, warmup=0, quality=False)
    cell = measure_isolated(open_run(run_dir), "fp32", st, select("cpu"), threads=1)
    mem = cell["memory"]
    assert cell["calls"] == 1 and mem["device_peak_bytes"] is None
    assert cell["model_bytes"] < mem["host_rss_base_bytes"] <= mem["host_rss_peak_bytes"] < here - 300e6
    with pytest.raises(BackendUnavailableError):  # the child's error, raised here
        measure_isolated(open_run(run_dir), "fp32", Settings(device="npu"), select("cpu"))
    del held


def test_quality_is_what_hstu_eval_prints(quick, run_dir, capsys):
    res, md, _ = quick
    assert main(["eval", "--run", str(run_dir), "--json", "--precision", "int8"]) == 0
    ev = json.loads(capsys.readouterr().out)
    _, rows = table(md)
    assert rows["HR@10 (test)"][1] == f"{ev['HR@10']:.4f}" and rows["NDCG@10 (test)"][1] == f"{ev['NDCG@10']:.4f}"


def test_compare_merges_result_files(quick, tmp_path, capsys):
    res, _, out = quick
    other = json.loads(json.dumps(res))
    other["environment"].update(device="npu:0", device_name="Ascend910B3")
    other["cells"] = [c for c in other["cells"] if c["precision"] == "int8"]
    other["cells"][0]["p50_ms"] = 12.5
    (tmp_path / "npu.json").write_text(json.dumps(other))
    assert main(["bench", "--compare", str(out / "bench.json"), "--compare", str(tmp_path / "npu.json"), "--out", str(tmp_path / "m")]) == 0
    head, rows = table(capsys.readouterr().out)
    assert head[:3] == [*[h for h in table((out / "bench.md").read_text())[0][:2]], "Ascend910B3 INT8"]
    assert rows["P50 latency (ms)"][2] == "12.50" and rows["P50 latency (ms)"][0] == f"{res['cells'][0]['p50_ms']:.2f}"
    merged = json.loads((tmp_path / "m" / "bench.json").read_text())
    assert [r["environment"]["device"] for r in merged["merged"]] == ["cpu", "npu:0"]
    (tmp_path / "bad.json").write_text('{"cells": []}')
    assert main(["bench", "--compare", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json" in err[0] and "not an hstu bench result" in err[0]


def test_unavailable_cells_are_reported_not_raised(run_dir, monkeypatch, capsys):
    import hstu.quant.int8_kernels as int8_kernels

    monkeypatch.setattr(int8_kernels, "_int8_gemms", lambda dev: ())  # a device without an integer GEMM
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # a CPU without bf16 matmul
    assert main(["bench", "--run", str(run_dir), "--device", "cpu", "--precisions", "int8,bf16", "--quick"]) == 0
    md = capsys.readouterr().out
    head, rows = table(md)
    assert all(v == "n/a [1]" for v in rows["P50 latency (ms)"][:1]) and rows["QPS (users/s)"][1] == "n/a [2]"
    assert re.search(r"^\[1\] .* INT8: no INT8 GEMM kernel on cpu: no integer GEMM kernel known", md, re.M)
    assert re.search(r"^\[2\] .* BF16: this CPU has no oneDNN bf16 matmul kernel", md, re.M)


def test_same_device_name_columns_are_distinct(quick, tmp_path, capsys):
    """Two machines with the same CPU name gave the same header twice ("AMD EPYC FP32"): every column is told
    apart by its file's name (its path where two files share a name), its position when one file comes twice."""
    _, md, out = quick
    first = table(md)[0][:2]  # "<device> FP32", "<device> INT8"
    paths = [tmp_path / d / "bench.json" for d in ("a", "b")] + [tmp_path / "c.json"]
    for f in paths:
        f.parent.mkdir(exist_ok=True)
        f.write_text((out / "bench.json").read_text())
    files = [out / "bench.json", *paths]
    assert main(["bench", *[x for f in files for x in ("--compare", str(f))]]) == 0
    head = table(capsys.readouterr().out)[0]
    tags = ["", f" ({paths[0]})", f" ({paths[1]})", " (c.json)"]  # a/bench.json, b/bench.json: a repeated name, so the path
    assert head[:8] == [h + t for t in tags for h in first] and len(set(head)) == len(head)


def test_a_compare_file_given_twice_is_refused(quick, tmp_path, capsys):
    """A trial: `--compare X --compare X` printed X's columns twice (told apart by "(result 2)"), exit 0."""
    src = quick[2] / "bench.json"
    for again in (str(src), str(quick[2] / ".." / quick[2].name / "bench.json")):  # the same file, spelled twice or otherwise
        assert main(["bench", "--compare", str(src), "--compare", again, "--out", str(tmp_path / "m")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--compare {again}: given twice" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_table_says_how_each_qps_row_is_defined(quick):
    """The reference port's 910B INT8 QPS (498) is not its batch / P50 (16 / 39.1 ms = 409), unlike the measured
    columns' QPS (batch / mean call time): bench.md and docs/benchmarks.md say which is which."""
    from pathlib import Path

    res, md, _ = quick
    note = "a measured column's is batch ÷ mean call time"
    assert note in md and "not derivable from its P50" in md
    cell = res["cells"][0]
    assert cell["qps"] == pytest.approx(cell["batch"] / (cell["mean_ms"] / 1e3), rel=1e-3)  # what the note says it is
    docs = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert note in " ".join(docs.split()) and "not derivable from its P50" in " ".join(docs.split())


@pytest.mark.parametrize(
    "field, value",
    [
        ("cells[0].p50_ms", "12"),
        ("cells[0].qps", float("nan")),
        ("cells[1].p99_ms", -3.0),
        ("cells[0].times_ms[1]", "a"),
        ("cells[1].quality.HR@10", float("inf")),
        ("cells[0].sweep.lengths.10.p50_ms", True),
        ("cells[0].serve.max_qps", -1.0),
        ("cells[0].memory.host_rss_peak_bytes", "1 GB"),
    ],
)
def test_compare_checks_every_figure_naming_file_and_field(quick, tmp_path, capsys, field, value):
    """A text p50_ms gave "Unknown format code 'f' for object of type 'str'"; NaN and negative figures were printed."""
    res = json.loads((quick[2] / "bench.json").read_text())
    obj, *path = re.findall(r"[^.\[\]]+", field)
    node = res[obj]
    for k in path[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {}) if k == "serve" else node[k]
    node[int(path[-1]) if isinstance(node, list) else path[-1]] = value
    (tmp_path / "edited.json").write_text(json.dumps(res))
    assert main(["bench", "--compare", str(tmp_path / "edited.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"edited.json: field '{field}' must be a finite number" in err[0] and repr(value) in err[0], err


def _no_measuring(monkeypatch):
    import hstu.bench.cli as bench_cli

    def measure(args):
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr(bench_cli, "_measure", measure)


def test_out_is_checked_before_measuring(tmp_path, monkeypatch, capsys):
    """--out naming a file failed with "[Errno 17] File exists" after the whole benchmark ran; a directory holding
    other files, or an earlier bench without --overwrite, is refused as early; nothing in it is touched."""
    _no_measuring(monkeypatch)
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "bench.json").write_text("{}")
    (tmp_path / "other" / "notes.txt").write_text("mine")
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "bench.json").write_text("{}")
    cases = [
        ("afile", [], "exists and is not a directory"),
        ("other", ["--overwrite"], "holds files that are not an earlier hstu bench's output (notes.txt)"),
        ("earlier", [], "holds an earlier bench (bench.json); pass --overwrite to replace it"),
    ]
    for name, flags, message in cases:
        assert main(["bench", "--preset", "small", "--quick", "--out", str(tmp_path / name), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {tmp_path / name}: {message}" in err[0], err
    assert (tmp_path / "afile").read_text() == "mine" and (tmp_path / "other" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "earlier", "other"]
    assert main(["bench", "--preset", "small", "--overwrite"]) == 2
    assert "--overwrite: needs --out" in capsys.readouterr().err


def test_out_is_written_whole_or_not_at_all(quick, tmp_path, monkeypatch, capsys):
    """A rerun into --out replaced the earlier results silently; an interrupted one left the new bench.json / bench.md
    beside the old plots, or in a fresh --out bench.json and bench.md without plots."""
    import hstu.bench.plots as plots

    src = quick[2] / "bench.json"
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    argv = ["bench", "--compare", str(src), "--out"]
    assert main([*argv, str(out)]) == 0
    files = ["bench.json", "bench.md", "latency_cdf.png", "latency_per_length.png"]
    before = {f: (out / f).read_bytes() for f in files}
    assert sorted(before) == sorted(p.name for p in out.iterdir())
    assert main([*argv, str(out)]) == 2  # an earlier bench: --overwrite needed
    real = plots.write_plots

    def interrupted(results, d):
        real(results, d)  # the new plots are written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "write_plots", interrupted)
    assert main([*argv, str(out), "--overwrite"]) == 130
    assert main([*argv, str(fresh)]) == 130
    assert {f: (out / f).read_bytes() for f in files} == before and sorted(p.name for p in out.iterdir()) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no fresh --out, no hidden staging directory
    monkeypatch.undo()
    res = json.loads(src.read_text())
    res["cells"][0]["p50_ms"] = 1234.5
    (tmp_path / "new.json").write_text(json.dumps(res))
    assert main(["bench", "--compare", str(tmp_path / "new.json"), "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "bench.json").read_text())["merged"][0]["cells"][0]["p50_ms"] == 1234.5
    assert "| 1234.50 |" in (out / "bench.md").read_text() and sorted(p.name for p in out.iterdir()) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "out"]
    capsys.readouterr()


def _sasrec_run(out):
    """A SASRec run with random weights (as write_preset_run writes a preset's HSTU model)."""
    from hstu.config import model_config_from_preset
    from hstu.model.checkpoint import save_weights, write_json
    from hstu.model.hstu import build_hstu
    from hstu.runs import write_idmap_dict

    torch.manual_seed(0)
    cfg = model_config_from_preset("small", architecture="sasrec", num_items=40, max_seq_len=16, dropout=0.0)
    out.mkdir()
    save_weights(out / "model.safetensors", build_hstu(cfg).eval())
    write_json(out / "config.json", {"model": cfg.__dict__})
    write_idmap_dict(out, {"item_raw_ids": np.arange(41, dtype=np.int64)})
    return out


def test_a_precision_the_model_does_not_run_at_is_a_footnote(tmp_path, capsys):
    """A SASRec run with the default precisions measured FP32, then exited 2 ("low-precision inference supports
    HSTUModel") and lost it: each precision the model does not run at is an n/a column saying why, as for an INT8 run."""
    run = _sasrec_run(tmp_path / "sas")
    argv = ["bench", "--run", str(run), "--device", "cpu", "--precisions", "fp32,bf16,int8", "--batch", "2", "--lengths", "10"]
    assert main([*argv, "--sweep-batch", "2", "--quick", "--threads", "1", "--out", str(tmp_path / "b")]) == 0
    md = capsys.readouterr().out
    head, rows = table(md)
    assert [h.split()[-1] for h in head[:3]] == ["FP32", "BF16", "INT8"]
    assert float(rows["P50 latency (ms)"][0]) > 0 and rows["P50 latency (ms)"][1:3] == ["n/a [1]", "n/a [2]"]
    for n, prec in ((1, "BF16"), (2, "INT8")):
        assert re.search(rf"^\[{n}\] .* {prec}: a sasrec model runs at fp32 only", md, re.M), md
    cells = json.loads((tmp_path / "b" / "bench.json").read_text())["cells"]
    assert cells[0]["calls"] == 5 and [set(c) for c in cells[1:]] == [{"precision", "unavailable"}] * 2


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--precisions", "fp33"], "--precisions"),
        (["--lengths", "0,50"], "--lengths"),
        (["--batch", "0"], "--batch"),
        (["--device", "tpu"], "--device"),
        (["--repeats", "x"], "--repeats"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--preset", "small", *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err.strip().splitlines()[-1]


def test_lengths_beyond_the_model_are_one_line(run_dir, capsys):
    """Every --lengths value past the run's max_seq_len gave exit 0 and a table of n/a (a fresh-user finding)."""
    max_len = json.loads((run_dir / "config.json").read_text())["model"]["max_seq_len"]
    assert main(["bench", "--run", str(run_dir), "--lengths", f"{max_len + 1}", "--precisions", "fp32", "--quick", "--no-quality"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--lengths {max_len + 1}: every value exceeds the model's max_seq_len {max_len}" in err[0], err


def test_a_broken_quant_json_is_the_runs_error(run_dir, tmp_path, capsys):
    """A trial: a truncated quant.json gave exit 0 and a table of n/a columns; bench's help says exit 2 for a bad run."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "quant.json").write_text('{"format": 1, "scheme"')
    assert main(["bench", "--run", str(run), "--precisions", "int8", "--quick", "--no-quality"]) == 2
    assert f"{run / 'quant.json'}: not valid JSON" in capsys.readouterr().err


def test_a_run_whose_weights_do_not_open_is_one_line_and_writes_nothing(run_dir, tmp_path, capsys):
    """A trial: a truncated model.safetensors gave exit 0 and bench.json, bench.md and plots with every cell
    "n/a [1]"; the run is now refused before anything is measured (export, quantize, doctor exit 2 on it too)."""
    import shutil

    run = tmp_path / "bad"
    shutil.copytree(run_dir, run)
    weights = run / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    out = tmp_path / "b"
    assert main(["bench", "--run", str(run), "--quick", "--precisions", "fp32,int8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{weights}: not a readable safetensors file" in err[0], err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
    weights.unlink()
    assert main(["bench", "--run", str(run), "--quick", "--out", str(out)]) == 2
    assert f"{weights}: weights not found" in capsys.readouterr().err and not out.exists()


def test_every_other_precision_of_a_quantized_run_has_the_same_footnote(run_dir, tmp_path, monkeypatch, capsys):
    """A trial: on an INT8 run, BF16 said "checkpoint is quantized with scheme 'int8'" but FP16 blamed the CPU
    ("no oneDNN fp16 matmul kernel"), which was asked first; both fail because the run is quantized."""
    import hstu.bench.cells as cells

    q = tmp_path / "q8"
    assert main(["quantize", "--run", str(run_dir), "--scheme", "int8", "--no-calibrate", "--out", str(q)]) == 0
    monkeypatch.setattr(cells, "precision_unavailable", lambda be, p: f"no {p} kernel here")  # a CPU with neither kernel
    assert main(["bench", "--run", str(q), "--precisions", "fp32,fp16,bf16", "--quick", "--no-quality"]) == 0
    md = capsys.readouterr().out
    notes = re.findall(r"^\[\d\] .* (FP32|FP16|BF16): (.*)$", md, re.M)
    assert [n[0] for n in notes] == ["FP32", "FP16", "BF16"], md
    for prec, why in notes:
        assert why.startswith("checkpoint is quantized with scheme 'int8'") and str(run_dir.resolve()) in why, why
        assert why.replace(prec.lower(), "P") == notes[1][1].replace("fp16", "P")


def test_no_source_is_one_line(capsys):
    assert main(["bench"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--run" in err[0] and "--preset" in err[0]


@pytest.mark.slow
def test_serve_figures(run_dir, tmp_path):
    assert (
        main(
            ["bench", "--run", str(run_dir), "--device", "cpu", "--precisions", "fp32", "--lengths", "40", "--quick"]
            + ["--no-quality", "--serve", "--out", str(tmp_path)]
        )
        == 0
    )
    from hstu.bench.table import HTTP_QPS_ROW

    cell = json.loads((tmp_path / "bench.json").read_text())["cells"][0]
    s = cell["serve"]
    assert s["server_exit_code"] == 0 and s["steps"]
    passed = [st for st in s["steps"] if set(st["codes"]) == {"200"} and st["p99_ms"] <= 100 and not st["client_dropped"]]
    assert s["max_qps"] == max((st["offered_qps"] for st in passed), default=0.0)  # the offered rate, not the achieved count
    if s["max_qps"]:
        assert s["p50_ms"] <= s["p99_ms"] <= 100 and s["offered_qps"] == s["max_qps"]
    _, rows = table((tmp_path / "bench.md").read_text())
    assert rows[HTTP_QPS_ROW][0] == f"{s['max_qps']:.1f}"
