"""Issue 23 item 3: ``hstu report`` writes PNG curves and a Markdown summary whose numbers are the
run's own (metrics.json, history.json); --vs puts runs side by side; errors are one line and write nothing."""

from __future__ import annotations

import json
import sys

import pytest

from hstu.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss.png", "valid_hr10.png", "valid_ndcg10.png")
METRICS = ("HR@10", "NDCG@10", "HR@50", "NDCG@50", "MRR")


def _summary(md: str) -> dict[str, list[str]]:
    """The summary table (the first table of report.md): row name -> cells, one per run."""
    rows = {}
    for line in md.split("\n## ")[0].splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def _epochs(md: str, label: str) -> list[list[str]]:
    part = md.split(f"## Per epoch: {label}\n")[1].split("\n## ")[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in part.splitlines() if line.startswith("| ") and line[2].isdigit()]


def _check_run_column(rows: dict, col: int, run) -> None:
    m = json.loads((run / "metrics.json").read_text())
    for split in ("test", "valid"):
        for k in METRICS:
            assert rows[f"{split} {k}"][col] == f"{m[split][k]:.4f}", (split, k)
    assert rows["epochs (best)"][col] == f"{m['epochs']} ({m['best_epoch']})"
    assert rows["train seconds"][col] == f"{m['train_seconds']:.1f}"
    assert rows["status"][col] == m["status"]
    from hstu.train.recipe import describe

    assert rows["recipe"][col] == describe(m["recipe"])  # config.json's train table states what metrics.json's recipe does
    cfg = json.loads((run / "config.json").read_text())["model"]
    assert rows["blocks × heads × d"][col] == f"{cfg['num_blocks']} × {cfg['num_heads']} × {cfg['embedding_dim']}"
    # the presets' multi-channel block, else the stock HSTU block (tests/model/test_query_key_map.py: the others)
    from hstu.config import model_config_from_dict
    from hstu.train.recipe import block_text

    assert rows["block"][col] == block_text(model_config_from_dict(cfg))  # the training log's model line names it so
    assert rows["block"][col].startswith(
        "FuXi-alpha block (semantic, position and time channels)" if cfg["multi_channel"] else "HSTU block"
    )


def test_report_of_the_tiny_run(run_dir, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", "--run", str(run_dir), "--out", str(out)]) == 0
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, name
    md = (out / "report.md").read_text()
    rows = _summary(md)
    _check_run_column(rows, 0, run_dir)
    hist = json.loads((run_dir / "history.json").read_text())
    table = _epochs(md, run_dir.name)
    assert [r[0] for r in table] == [str(h["epoch"]) for h in hist]
    assert [r[1] for r in table] == [f"{h['loss']:.4f}" for h in hist]
    assert [r[3] for r in table] == [f"{h['valid']['NDCG@10']:.4f}" for h in hist]
    for name in PLOTS:
        assert f"]({name})" in md
    assert capsys.readouterr().out.split() == [str(out / n) for n in (*PLOTS, "report.md")]


def test_report_vs_puts_two_runs_side_by_side(run_dir, tmp_path):
    """A second, different run (a 30-user CSV, tiny model, 2 epochs) beside the tiny ML-1M run: a
    column each with that run's own numbers and per-epoch tables for both."""
    rows = [f"{u},{(u * 3 + j) % 20 + 1},{1000 + j}" for u in range(1, 31) for j in range(8)]
    (tmp_path / "log.csv").write_text("u,i,t\n" + "\n".join(rows) + "\n")
    (tmp_path / "tiny.toml").write_text(
        "[model]\nmax_seq_len = 8\nembedding_dim = 8\nd_qk = 8\nd_v = 8\nnum_blocks = 1\nnum_heads = 1\n"
        "[train]\nbatch_size = 8\nnum_negatives = 4\nepochs = 2\n"
    )
    other = tmp_path / "csvrun"
    flags = ["--dataset", "csv", "--data-dir", str(tmp_path / "log.csv"), "--columns", "user=u,item=i,time=t"]
    assert main(["train", *flags, "--config", str(tmp_path / "tiny.toml"), "--out", str(other), "--quiet"]) == 0
    out = tmp_path / "rep"
    assert main(["report", "--run", str(run_dir), "--vs", str(other), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    table = _summary(md)
    assert table[""] == [run_dir.name, "csvrun"]
    _check_run_column(table, 0, run_dir)
    _check_run_column(table, 1, other)
    assert table["dataset"] == ["ml-1m (clean protocol)", "csv (clean protocol)"]
    assert len(_epochs(md, "csvrun")) == 2 and len(_epochs(md, run_dir.name)) == 1
    assert all((out / n).read_bytes().startswith(PNG) for n in PLOTS)


def test_report_of_a_missing_run_is_one_line_and_writes_nothing(tmp_path, run_dir, capsys):
    out = tmp_path / "rep"
    assert main(["report", "--run", str(run_dir), "--vs", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"hstu report: error: {tmp_path / 'nope'}: run directory not found"
    assert not out.exists()


def test_report_of_the_same_run_twice_is_refused(tmp_path, run_dir, capsys):
    """--vs of the run itself (or the same directory by another path) drew one line for the two and wrote
    two identical columns, without a word."""
    out, link = tmp_path / "rep", tmp_path / "link"
    link.symlink_to(run_dir)
    for other_path in (str(run_dir), str(link), f"{run_dir}/"):
        assert main(["report", "--run", str(run_dir), "--vs", other_path, "--out", str(out)]) == 2
        assert (
            capsys.readouterr().err.strip() == f"hstu report: error: --vs {other_path}: the same run as {run_dir} (compare different runs)"
        )
    assert not out.exists()


def test_report_out_blocked_by_a_file_names_out(tmp_path, run_dir, capsys):
    """A file at --out or on its path gave the bare "[Errno 17] File exists" / "[Errno 20] Not a directory"."""
    (tmp_path / "f.csv").write_text("x")
    for out in (tmp_path / "f.csv", tmp_path / "f.csv" / "rep"):
        assert main(["report", "--run", str(run_dir), "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"hstu report: error: --out {out}: not a directory ({tmp_path / 'f.csv'} is a file)"
    assert (tmp_path / "f.csv").read_text() == "x"


def test_report_without_matplotlib_names_the_extra(tmp_path, run_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "rep"
    assert main(["report", "--run", str(run_dir), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "hstu report: error: matplotlib is not installed: pip install 'hstu[plot]'"
    assert not out.exists()


def test_version(capsys):
    import torch

    import hstu

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [f"hstu {hstu.__version__}", f"torch {torch.__version__}", "backend cpu: available"]
    cuda = next(x for x in lines if x.startswith("backend cuda: "))
    assert (cuda == "backend cuda: available") == torch.cuda.is_available()
    assert any(x.startswith("backend npu: ") for x in lines)


def test_report_slices_agree_with_the_runs_own_evaluation(run_dir, tmp_path):
    """--slices: the all-users HR@10 / NDCG@10 (slices.collect: the model's scores, ranks by the
    slice code) equal metrics.json's test metrics (train.evaluate, another path); each interval
    holds its value; the table and slices.png are written."""
    out = tmp_path / "rep"
    assert main(["report", "--run", str(run_dir), "--out", str(out), "--slices", "--resamples", "50"]) == 0
    m = json.loads((run_dir / "metrics.json").read_text())
    rep = json.loads((out / "slices.json").read_text())[run_dir.name]
    assert rep["users"] == m["test"]["users"]
    for k in ("HR@10", "NDCG@10"):
        cell = rep["next_item"][k]
        assert cell["value"] == pytest.approx(m["test"][k], abs=1e-9)
        assert cell["ci"][0] <= cell["value"] <= cell["ci"][1]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in (out / "report.md").read_text().splitlines()
        if "all users" in line
    }
    v, (lo, hi) = rep["next_item"]["HR@10"]["value"], rep["next_item"]["HR@10"]["ci"]
    assert rows["HR@10, all users"] == f"{v:.4f} [{lo:.4f}, {hi:.4f}]"
    assert (out / "slices.png").read_bytes().startswith(PNG)


def test_report_out_must_be_new_empty_or_an_earlier_report(tmp_path, run_dir, capsys):
    """A trial: a second report into an --out holding another run's slices.json / slices.png left them beside the new
    report.md, exit 0. --out follows hstu bench's rule: new or empty, or an earlier report's files only with
    --overwrite (replaced whole); anything else is refused, checked before any run is read."""
    out, other = tmp_path / "rep", tmp_path / "other"
    assert main(["report", "--run", str(run_dir), "--out", str(out)]) == 0
    (out / "slices.json").write_text("{}")  # an earlier --slices report's file
    capsys.readouterr()
    assert main(["report", "--run", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"hstu report: error: --out {out}: holds an earlier report (report.md); pass --overwrite to replace it, or choose another directory"
    ]
    assert (out / "slices.json").read_text() == "{}"
    assert main(["report", "--run", str(run_dir), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([*PLOTS, "report.md"])  # replaced whole: no stale slices.json
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (other / "report.md").write_text("mine")
    capsys.readouterr()
    assert main(["report", "--run", str(run_dir), "--out", str(other), "--overwrite"]) == 2
    assert "holds files that are not an earlier hstu report's output (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt", "report.md"] and (other / "report.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "rep"]  # no staging directory left


def test_report_out_that_is_a_run_directory_is_refused(tmp_path, run_dir, capsys):
    """A trial: `hstu report --run r2 --out runs/r1` wrote r2's report over r1's own report.md and plots, exit 0."""
    import shutil

    victim = tmp_path / "r1"
    shutil.copytree(run_dir, victim)
    before = {p.name: p.read_bytes() for p in victim.iterdir() if p.is_file()}
    for flags in ([], ["--overwrite"]):
        assert main(["report", "--run", str(run_dir), "--out", str(victim), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {victim}: is a run directory" in err[0], err
    assert {p.name: p.read_bytes() for p in victim.iterdir() if p.is_file()} == before


def test_report_resamples_without_slices_is_refused(tmp_path, run_dir, capsys):
    """A trial: --resamples without --slices was silently ignored."""
    out = tmp_path / "rep"
    assert main(["report", "--run", str(run_dir), "--out", str(out), "--resamples", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resamples 50: needs --slices" in err[0], err
    assert not out.exists()


def test_report_of_a_quantized_run_names_its_float_run(tmp_path, run_dir, capsys):
    """A trial: `hstu report` on an `hstu quantize` output failed with "history.json not found"."""
    q = tmp_path / "q8"
    assert main(["quantize", "--run", str(run_dir), "--scheme", "int8", "--no-calibrate", "--out", str(q)]) == 0
    capsys.readouterr()
    out = tmp_path / "rep"
    for argv in (["--run", str(q)], ["--run", str(run_dir), "--vs", str(q)]):
        assert main(["report", *argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{q}: a quantized copy (quant.json, scheme 'int8') has no training history" in err[0], err
        assert f"report the float run it was made from: {run_dir.resolve()}" in err[0]
    assert not out.exists()
