"""hstu quantize's quality cost covers the item table too (a trial: with --embeddings int8 it covered only the user
vectors): printed and recorded in quant.json, checked against a float64 computation from the saved weights."""

from __future__ import annotations

import json

import pytest
import torch

from hstu.runs import load_run


def test_quantize_reports_the_item_tables_share(run_dir, tmp_path, capsys):
    """A trial: with --embeddings int8 the printed quality cost covered only the user vectors, nothing of the item
    table. Its figures (min cosine of stored to float rows, max |Δ score| over items and unit user vectors) are
    printed and recorded in quant.json, and equal a float64 computation from the saved weights."""
    from hstu.cli import main
    from hstu.runs import load_float_run

    out = tmp_path / "e8"
    argv = ["quantize", "--run", str(run_dir), "--scheme", "int8", "--embeddings", "int8", "--calib-users", "16", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    got = json.loads((out / "quant.json").read_text())["calibration"]["item_table"]
    fm, cfg, _ = load_float_run(run_dir)
    qm, _, _ = load_run(out)
    f = torch.nn.functional.normalize(fm.item_emb.weight.detach()[1:].double(), dim=-1)  # (I, d)
    w = qm.item_emb
    q = torch.nn.functional.normalize(w.weight_int8[1:].double() * w.weight_scale[1:].double().unsqueeze(-1), dim=-1)
    cos = (f * q).sum(-1)
    t = cfg["model"]["temperature"]
    assert got["rows"] == cfg["model"]["num_items"] and got["temperature"] == t
    # the command scores float32-normalised rows (item_vectors, as generation does): ~1e-7 per element off these float64
    # ones, which moves the cosine of nearly parallel rows by ~1e-9 and the norm of their ~0.01 difference by ~1e-5 of it
    assert got["min_cosine"] == pytest.approx(float(cos.min()), abs=1e-8) and 0.999 < got["min_cosine"] < 1.0
    assert got["max_abs_score_err"] == pytest.approx(float((q - f).norm(dim=-1).max()) / t, rel=1e-4) and got["max_abs_score_err"] > 0
    line = next(ln for ln in text.splitlines() if ln.startswith("item table"))
    assert f"min cosine to float {got['min_cosine']:.6f}" in line and f"max |Δ score| {got['max_abs_score_err']:.4g}" in line
