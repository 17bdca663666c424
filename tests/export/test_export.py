"""hstu export (issue 23, item 5): the exported encoder programs (ONNX via onnxruntime, torch.export
.pt2) give the PyTorch model's user vectors for real ML-1M histories of several lengths per bucket,
their top item is the engine's first greedy item, the manifest says how to feed them, and a bad
request or a failed export leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from hstu.cli import main
from hstu.generate.recommend import History

BUCKETS = (20, 50)
REPO = Path(__file__).resolve().parents[2]
FORMATS = ("onnx", "pt2")


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    """{format: export directory} of the tiny run, both buckets, through the command line."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        rc = main(["export", "--run", str(run_dir), "--format", fmt, "--out", str(out[fmt]), "--buckets", ",".join(map(str, BUCKETS))])
        assert rc == 0
    return out


@pytest.fixture(scope="module")
def histories(ratings, rec):
    """{bucket: prepared histories} of real users, lengths 1, between and the edge (one with a
    request time 30 days after its last event)."""
    users = [g for _, g in ratings.groupby("user") if len(g) >= max(BUCKETS)]
    out = {}
    for E in BUCKETS:
        preps = []
        for i, L in enumerate((1, E // 3, E - 1, E)):
            g = users[(3 * i + E) % len(users)].iloc[:L]
            ts = [int(t) for t in g.ts]
            rt = ts[-1] + 30 * 86400 if i == 2 else None
            preps.append(rec.prepare(History(items=[int(x) for x in g.item], timestamps=ts, request_time=rt)))
        assert [len(p.ids) for p in preps] == [1, E // 3, E - 1, E]
        out[E] = preps
    return out


def _feed(rec, preps, E):
    b = rec.batch(preps, width=E)
    return [b["ids"], b["timestamps"], b["lengths"], b["request_time"]]


def _run(fmt, path, inputs):
    """The exported program, loaded by its own runtime (not through hstu.export)."""
    if fmt == "onnx":
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        return sess.run(None, {n: x.numpy() for n, x in zip(names, inputs)})[0]
    return torch.export.load(str(path)).module()(*inputs).detach().numpy()


@torch.no_grad()
def _reference(model, p) -> np.ndarray:
    """encode's own contract at the history's width + 1 (no bucket padding): the query time at
    position L, the user vector at row L - 1."""
    L = len(p.ids)
    ids = torch.tensor([[*p.ids, 0]], dtype=torch.int64)
    ts = torch.tensor([[*p.timestamps, p.request_time]], dtype=torch.int64)
    return model.encode(ids, ts, torch.tensor([L])).numpy()[0, L - 1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_exported_user_vectors_equal_the_models(fmt, exported, histories, ref):
    manifest = json.loads((exported[fmt] / "export.json").read_text())
    assert [b["edge"] for b in manifest["buckets"]] == list(BUCKETS)
    for entry in manifest["buckets"]:
        E, path = entry["edge"], exported[fmt] / entry["file"]
        preps = histories[E]
        want = np.stack([_reference(ref.model, p) for p in preps])  # (4, d)
        got = _run(fmt, path, _feed(ref, preps, E))
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        one = _run(fmt, path, _feed(ref, preps[2:3], E))  # the batch axis is dynamic: one row alone
        np.testing.assert_allclose(one[0], want[2], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_top_item_of_the_exported_vector_is_the_engines_first(fmt, exported, histories, rec):
    items = np.load(exported[fmt] / "items.npy")
    manifest = json.loads((exported[fmt] / "export.json").read_text())
    raw = np.asarray(json.loads((exported[fmt] / "idmap.json").read_text())["item_raw_ids"])
    T = manifest["scoring"]["temperature"]
    for entry in manifest["buckets"]:
        preps = histories[entry["edge"]]
        scores = _run(fmt, exported[fmt] / entry["file"], _feed(rec, preps, entry["edge"])) @ items.T / T  # (B, I+1)
        mask = rec.exclusion(rec.batch(preps), preps, None, None).numpy()  # history, untrained, padding
        scores[mask] = -np.inf
        engine = rec.recommend(preps, k=1, strategy="greedy")
        for i, p in enumerate(preps):
            j = int(np.argmax(scores[i]))
            assert raw[j] == engine[i][0]["item_id"], f"bucket {entry['edge']}, length {len(p.ids)}"
            assert scores[i, j] == pytest.approx(engine[i][0]["score"], abs=1e-3)


def test_manifest_says_how_to_feed_the_programs(exported, run_dir):
    m = json.loads((exported["onnx"] / "export.json").read_text())
    assert m["format"] == "onnx" and m["batch"] == "dynamic" and m["precision"] == "fp32"
    assert m["config_sha256"] == hashlib.sha256((run_dir / "config.json").read_bytes()).hexdigest()
    assert m["versions"]["torch"] == torch.__version__
    d = json.loads((run_dir / "config.json").read_text())["model"]["embedding_dim"]
    for entry in m["buckets"]:
        sess = ort.InferenceSession(str(exported["onnx"] / entry["file"]), providers=["CPUExecutionProvider"])
        got = [(i.name, i.type, i.shape[1:]) for i in sess.get_inputs()]
        want = [(t["name"], f"tensor({t['dtype']})", [entry["edge"] if s == "E" else s for s in t["shape"][1:]]) for t in m["inputs"]]
        assert got == want
        assert all(isinstance(i.shape[0], str) for i in sess.get_inputs())  # dynamic batch axis
        (o,) = sess.get_outputs()
        assert (o.name, o.type, o.shape[1]) == (m["outputs"][0]["name"], "tensor(float)", d)
        assert entry["opset"] >= 18 and entry["max_abs_error"] <= 1e-4
    items = np.load(exported["onnx"] / "items.npy")
    assert items.shape == tuple(m["items"]["shape"]) and not items[0].any()
    np.testing.assert_allclose(np.linalg.norm(items[1:], axis=1), 1.0, atol=1e-5)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.") or p.name == name)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--format", "tflite"], "--format: unknown value 'tflite'; valid: onnx, pt2"),
        (["--format", "pt2", "--buckets", "20,51"], "--buckets [51]: each edge must be in 1..the run's max_seq_len = 50"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(flags, message, run_dir, tmp_path, capsys):
    assert main(["export", "--run", str(run_dir), "--out", str(tmp_path / "x"), *flags]) == 2
    assert _one_error_line(capsys) == f"hstu export: error: {message}"
    assert _leftovers(tmp_path, "x") == []


def test_missing_run_gives_one_line_and_exit_2(tmp_path, capsys):
    assert main(["export", "--run", str(tmp_path / "nope"), "--format", "pt2", "--out", str(tmp_path / "x")]) == 2
    assert _one_error_line(capsys) == f"hstu export: error: {tmp_path / 'nope'}: run directory not found"
    assert _leftovers(tmp_path, "x") == []


def test_onnx_without_the_extra_names_it(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript now raises ImportError
    assert main(["export", "--run", str(run_dir), "--format", "onnx", "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys)
    assert "'onnxscript'" in line and "pip install 'hstu[export]'" in line
    assert _leftovers(tmp_path, "x") == []


def test_a_failed_export_leaves_nothing_and_keeps_the_old_one(run_dir, tmp_path, capsys, monkeypatch):
    from hstu.export import pt2_export

    out = tmp_path / "x"
    assert main(["export", "--run", str(run_dir), "--format", "pt2", "--out", str(out), "--buckets", "20"]) == 0
    before = (out / "export.json").read_text()
    capsys.readouterr()
    monkeypatch.setattr(pt2_export, "run", lambda path, names, inputs: np.zeros((inputs[0].shape[0], 50), np.float32))  # a wrong program
    args = ["export", "--run", str(run_dir), "--format", "pt2", "--buckets", "20,50"]
    assert main([*args, "--out", str(tmp_path / "y")]) == 2
    assert "bucket 20: the pt2 program differs from the model by" in _one_error_line(capsys)
    assert _leftovers(tmp_path, "y") == []
    assert main([*args, "--out", str(out), "--overwrite"]) == 2
    assert _leftovers(tmp_path, "x") == ["x"] and (out / "export.json").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["encoder_E20.pt2", "export.json", "idmap.json", "items.npy"]


def test_overwrite_replaces_only_an_earlier_export(run_dir, tmp_path, capsys):
    """--overwrite never deletes a run or foreign files: --out that is (or contains) the run, or holds
    files without export.json, is refused and left as it was (it once emptied --out, the run included)."""
    run = tmp_path / "box" / "run"
    shutil.copytree(run_dir, run)
    files = sorted(p.name for p in run.iterdir())
    args = ["export", "--run", str(run), "--format", "pt2", "--buckets", "20", "--overwrite"]
    for out, why in ((run, "is or contains the run"), (run.parent, "is or contains the run")):
        assert main([*args, "--out", str(out)]) == 2
        assert why in _one_error_line(capsys)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main([*args, "--out", str(other)]) == 2
    assert "no export.json" in _one_error_line(capsys)
    assert (other / "notes.txt").read_text() == "keep me" and sorted(p.name for p in run.iterdir()) == files
    out = tmp_path / "x"
    assert main([*args, "--out", str(out)]) == 0 and main([*args, "--out", str(out)]) == 0  # an earlier export: replaced
    assert (out / "export.json").is_file()
    (out / "my_notes.md").write_text("keep me")  # a trial's notes and a Triton config beside an export: once deleted
    (out / "triton").mkdir()
    assert main([*args, "--out", str(out)]) == 2
    assert "also my_notes.md, triton, which no export wrote" in _one_error_line(capsys)
    assert (out / "my_notes.md").read_text() == "keep me" and (out / "triton").is_dir()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--graphs", "--format", "pt2", "--out", "x"], "--graphs builds RUN/graphs and takes no --format, --out"),
        (["--format", "pt2", "--out", "x", "--max-batch", "4"], "--max-batch and --device go with --graphs"),
    ],
)
def test_the_two_forms_refuse_each_others_flags(flags, message, run_dir, tmp_path, capsys):
    flags = [str(tmp_path / f) if f == "x" else f for f in flags]
    assert main(["export", "--run", str(run_dir), *flags]) == 2
    assert _one_error_line(capsys).startswith(f"hstu export: error: {message}")  # one prefix (it was doubled)
    assert not (tmp_path / "x").exists() and not (run_dir / "graphs").exists()


def test_actions_and_categories_reach_the_exported_program(tmp_path):
    """A model with action and category embeddings (random weights): the pt2 program equals encode
    at the unpadded width with the categories looked up from the item map, and the actions matter."""
    from hstu.config import model_config_from_preset
    from hstu.export import pt2_export
    from hstu.export.encoder import UserEncoder, example_inputs
    from hstu.model.hstu import build_hstu

    torch.manual_seed(0)
    cfg = model_config_from_preset("small", max_seq_len=30, num_items=40, num_actions=3, num_categories=5)
    model = build_hstu(cfg).eval()
    item_category = torch.randint(1, 6, (41,))
    item_category[0] = 0
    enc = UserEncoder(model, item_category)
    assert enc.input_names[-1] == "actions"
    inputs = example_inputs(enc, 12, batch=4, seed=3)
    path = tmp_path / "e.pt2"
    pt2_export.export(enc, example_inputs(enc, 12, batch=3, seed=0), path, None)
    got = pt2_export.run(path, enc.input_names, inputs)
    ids, ts, lengths, rt, acts = inputs
    with torch.no_grad():
        for b in range(4):
            L = int(lengths[b])
            i = torch.cat([ids[b, :L], torch.zeros(1, dtype=torch.int64)]).view(1, -1)
            t = torch.cat([ts[b, :L], rt[b : b + 1]]).view(1, -1)
            a = torch.cat([acts[b, :L], torch.zeros(1, dtype=torch.int64)]).view(1, -1)
            want = model.encode(i, t, lengths[b : b + 1], actions=a, categories=item_category[i])[0, L - 1]
            np.testing.assert_allclose(got[b], want.numpy(), atol=1e-5, rtol=0)
        other = pt2_export.run(path, enc.input_names, (*inputs[:4], acts % 3 + 1))
    assert np.abs(other - got).max() > 1e-3


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_a_multi_channel_model_exports(tmp_path, fmt):
    """[model] multi_channel (FuXi-alpha's position and time channels): the exported program equals encode."""
    from hstu.config import model_config_from_preset
    from hstu.export import onnx_export, pt2_export
    from hstu.export.encoder import UserEncoder, example_inputs
    from hstu.model.hstu import build_hstu

    if fmt == "onnx":
        pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
    torch.manual_seed(0)
    model = build_hstu(model_config_from_preset("small", max_seq_len=30, num_items=40, multi_channel=True)).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.rel_bias.pos_w.normal_(0, 0.5)
            layer.rel_bias.ts_w.normal_(0, 0.5)
    enc, mod = UserEncoder(model, None), pt2_export if fmt == "pt2" else onnx_export
    path = tmp_path / f"e.{fmt}"
    mod.export(enc, example_inputs(enc, 12, batch=3, seed=0), path, None)
    ids, ts, lengths, rt = inputs = example_inputs(enc, 12, batch=4, seed=3)
    got = mod.run(path, enc.input_names, inputs)
    with torch.no_grad():
        for b in range(4):
            L = int(lengths[b])
            i = torch.cat([ids[b, :L], torch.zeros(1, dtype=torch.int64)]).view(1, -1)
            t = torch.cat([ts[b, :L], rt[b : b + 1]]).view(1, -1)
            np.testing.assert_allclose(got[b], model.encode(i, t, lengths[b : b + 1])[0, L - 1].numpy(), atol=1e-5, rtol=0)


def test_an_int8_run_is_refused_naming_the_run_not_a_flag(run_dir, tmp_path, capsys):
    """Found by a fresh-user trial: exporting an INT8 run (hstu quantize) said "--precision int8" although no
    such flag was given; the flag is named only when it was."""
    q = tmp_path / "q"
    assert main(["quantize", "--run", str(run_dir), "--scheme", "int8", "--out", str(q), "--no-calibrate"]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(q), "--format", "pt2", "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"hstu export: error: {q} is an INT8 run (quant.json): not exportable")
    assert line.endswith("export the float run it was quantized from")  # not --precision bf16: a quantized run refuses it
    assert main(["export", "--run", str(run_dir), "--format", "pt2", "--precision", "int8", "--out", str(tmp_path / "x")]) == 2
    assert _one_error_line(capsys).startswith("hstu export: error: --precision int8 goes with --graphs, not --format pt2")
    assert not (tmp_path / "x").exists()


def test_the_manifest_notes_follow_the_runs_history_policy(run_dir, exported, tmp_path):
    """Found by a fresh-user trial: the notes said history items are never recommended for a run whose
    exclude_history_default is off (a CSV / e-commerce log's default)."""
    notes = json.loads((exported["pt2"] / "export.json").read_text())["notes"]
    assert any("never recommends history items" in n for n in notes)  # the ML-1M run: on
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ids = json.loads((run / "idmap.json").read_text())
    (run / "idmap.json").write_text(json.dumps({**ids, "exclude_history_default": False}))
    assert main(["export", "--run", str(run), "--format", "pt2", "--out", str(tmp_path / "x"), "--buckets", "20"]) == 0
    notes = json.loads((tmp_path / "x" / "export.json").read_text())["notes"]
    assert not any("history items" in n for n in notes) and any("exclude_history_default is off" in n for n in notes)


def test_sigterm_mid_export_leaves_nothing(run_dir, tmp_path, capsys, monkeypatch):
    """SIGTERM (timeout, docker stop, Kubernetes) cleans up as Ctrl-C does: it used to kill the process
    and leave the hidden .NAME.tmp-* directory beside --out (a fresh-user finding); exit 143, one line."""
    import os
    import signal

    from hstu.export import pt2_export

    def killed(path, names, inputs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the export")

    monkeypatch.setattr(pt2_export, "run", killed)
    out, stray = tmp_path / "z", []
    previous = signal.signal(signal.SIGTERM, lambda *a: stray.append(a))  # without main()'s handler: caught here, not pytest killed
    try:
        assert main(["export", "--run", str(run_dir), "--format", "pt2", "--out", str(out), "--buckets", "20"]) == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not stray and capsys.readouterr().err.strip().splitlines()[-1] == "hstu export: terminated"
    assert _leftovers(tmp_path, "z") == []


def test_export_needs_no_serve_extra_and_a_missing_package_is_one_line(run_dir, tmp_path):
    """`hstu export --format pt2` imported hstu.serve (for its --buckets parser), so without the [serve] extra it
    died in a traceback (ModuleNotFoundError: fastapi); `--graphs` does need the server: one line naming the extra."""
    import subprocess

    code = "import sys; sys.modules['fastapi'] = None; from hstu.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", code, "export", "--run", str(run_dir)]
    p = subprocess.run([*args, "--format", "pt2", "--buckets", "20", "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert p.returncode == 0 and (tmp_path / "x" / "export.json").is_file(), p.stderr
    p = subprocess.run([*args, "--graphs", "--buckets", "20"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "hstu export: error: needs the optional package 'fastapi': pip install 'hstu[serve]'"
    ), p.stderr


def test_pt2_load_returns_detached_outputs(exported, histories, rec):
    """A trial: the loaded .pt2 program's outputs required grad, so `.numpy()` failed without `.detach()`. The loader
    the docs name (hstu.export.pt2_export.load) runs it under inference mode with its weights frozen."""
    from hstu.export.pt2_export import load

    path = exported["pt2"] / "encoder_E20.pt2"
    inputs = _feed(rec, histories[20], 20)
    raw = torch.export.load(str(path)).module()(*inputs)
    assert raw.requires_grad  # what torch.export.load alone gives
    got = load(path)(*inputs)
    assert not got.requires_grad and np.array_equal(got.numpy(), raw.detach().numpy())
    assert "hstu.export.pt2_export.load(path)" in " ".join((REPO / "docs" / "cli.md").read_text().split())
