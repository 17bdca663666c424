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
    cell = json.loads((tmp_path / "bench.json").read_text())["cells"][0]
    s = cell["serve"]
    assert s["server_exit_code"] == 0 and s["steps"]
    if s["max_qps"]:
        assert s["p50_ms"] <= s["p99_ms"] <= 100
        assert any(st["achieved_qps"] == s["max_qps"] for st in s["steps"])
    _, rows = table((tmp_path / "bench.md").read_text())
    assert "HTTP QPS at P99 ≤ 100 ms" in rows
