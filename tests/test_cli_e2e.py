"""End to end through the console script in a subprocess: train 1 epoch on 300 users,
eval, generate (by user and from a history file), and clear errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


# the top-level modules of every optional extra (pyproject.toml): README's main command installs none of them
EXTRAS = (
    "fastapi uvicorn pydantic prometheus_client httpx fastapi_offline orjson aiohttp psutil yaml matplotlib ray tensorboard "
    "faiss onnx onnxruntime onnxscript triton fbgemm_gpu tensordict torchmetrics torchrec pyre_extensions"
).split()
# `hstu` as on a base install: each extra's module hidden (import raises ModuleNotFoundError, find_spec says absent)
BASE_ONLY = f"import sys\nfor m in {EXTRAS!r}: sys.modules[m] = None\nfrom hstu.cli import main\nsys.argv[0] = 'hstu'\nsys.exit(main())"


def hstu(*args, check=True, env=None, base_only=False):
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, *(("-c", BASE_ONLY) if base_only else ("-m", "hstu.cli")), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"hstu {args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from conftest import ML1M, need

    need(ML1M / "ratings.dat")
    out = tmp_path_factory.mktemp("run")
    args = ("train", "--dataset", "ml-1m", "--data-dir", ML1M, "--preset", "small", "--epochs", 1, "--max-users", 300, "--out", out)
    hstu(*args, "--quiet", base_only=True)  # the base install trains (README's main command has no extra)
    return out


def test_base_install_runs_the_main_commands(run_dir):
    """Without any optional extra (pip install -e .), the parser builds, eval and generate run, and a
    command whose extra is missing says which to install (it once died importing fastapi for --ann's flags)."""
    helptext = hstu("--help", base_only=True).stdout
    assert "demo" in helptext and "(needs: pip install 'hstu[serve]')" in helptext
    assert "--epochs" in hstu("demo", "--help", base_only=True).stdout
    ev = json.loads(hstu("eval", "--run", run_dir, "--json", base_only=True).stdout)
    m = json.loads((run_dir / "metrics.json").read_text())
    assert ev["HR@10"] == pytest.approx(m["test"]["HR@10"])
    out = json.loads(hstu("generate", "--run", run_dir, "--user", 1, "-k", 5, "--json", base_only=True).stdout)
    assert len(out["items"]) == 5
    p = hstu("serve", "--run", run_dir, check=False, base_only=True)
    assert p.returncode == 2 and "pip install 'hstu[serve]'" in p.stderr


def test_train_writes_metrics(run_dir):
    m = json.loads((run_dir / "metrics.json").read_text())
    assert set(m) >= {"valid", "test", "epochs", "train_seconds"}
    assert m["epochs"] == 1 and m["test"]["users"] == 300
    assert 0.0 <= m["test"]["HR@10"] <= 1.0


def test_eval_json_matches_metrics(run_dir):
    out = json.loads(hstu("eval", "--run", run_dir, "--split", "test", "--json").stdout)
    m = json.loads((run_dir / "metrics.json").read_text())
    assert out["HR@10"] == pytest.approx(m["test"]["HR@10"]) and out["NDCG@10"] == pytest.approx(m["test"]["NDCG@10"])


def test_generate_for_user_and_history(run_dir, tmp_path):
    out = json.loads(hstu("generate", "--run", run_dir, "--user", 1, "-k", 5, "--json").stdout)
    assert out["user"] == 1 and len(out["items"]) == 5
    ids = [it["item_id"] for it in out["items"]]
    assert len(set(ids)) == 5 and all(isinstance(it["title"], str) for it in out["items"])
    from hstu.data import load_dataset
    from conftest import ML1M

    log_ = load_dataset("ml-1m", ML1M)
    seen = set(log_.item_raw_ids[log_.items[: log_.offsets[1]]].tolist())
    assert not set(ids) & seen  # ML-1M excludes the user's history by default
    hist = tmp_path / "h.json"
    hist.write_text(json.dumps([{"item_id": 1, "timestamp": 978300000}, {"item_id": 2858, "timestamp": 978300100}]))
    out2 = json.loads(hstu("generate", "--run", run_dir, "--history", hist, "--json").stdout)
    assert len(out2["items"]) == 5 and not {1, 2858} & {it["item_id"] for it in out2["items"]}


def test_clear_errors(run_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"item_id": "x", "timestamp": 1}]))
    p = hstu("generate", "--run", run_dir, "--history", bad, check=False)
    assert p.returncode == 2 and "history[0].item_id: not an integer id: 'x'" in p.stderr  # a text id, for a run of integer ids
    p = hstu("generate", "--run", run_dir, "--user", 999999, check=False)
    assert p.returncode == 2 and "unknown user id 999999" in p.stderr
    p = hstu("eval", "--run", tmp_path / "missing", check=False)
    assert p.returncode == 2 and "not found" in p.stderr
    p = hstu("train", "--data-dir", tmp_path, "--out", tmp_path / "o", "--device", "cuda", check=False)
    assert p.returncode == 2


def test_history_file_and_train_flag_errors_name_the_input(run_dir, tmp_path):
    """Found by a fresh-user trial: a directory, a binary file or a timestamp past int64 as
    --history were tracebacks (exit 1); a negative timestamp ran; --max-users 0 trained on every
    user. Now one line naming the file / flag, exit 2 (ranges as the HTTP Event's)."""
    cases = [
        (tmp_path, f"{tmp_path}: is a directory, not a history file"),
        (tmp_path / "bin.json", "not UTF-8 text"),
        (
            tmp_path / "big.json",
            "event [0].timestamp must be Unix seconds in 0..9223372036 (up to 2262-04-11), got 99999999999999999999999",
        ),
        (tmp_path / "neg.json", "event [0].timestamp must be Unix seconds in 0..9223372036 (up to 2262-04-11), got -4"),
        (
            tmp_path / "ms.json",
            "event [0].timestamp must be Unix seconds in 0..9223372036 (up to 2262-04-11); milliseconds? divide by 1000, got 1700000000000",
        ),
        (tmp_path / "typo.json", "event [1] has unknown field(s) ['actoin']; valid: item_id, timestamp, action"),
        (tmp_path / "act.json", "event [0].action must be a string or null, got 3"),
    ]
    (tmp_path / "typo.json").write_text('[{"item_id": 1, "timestamp": 5}, {"item_id": 2, "timestamp": 6, "actoin": "buy"}]')
    (tmp_path / "act.json").write_text('[{"item_id": 1, "timestamp": 5, "action": 3}]')
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe")
    (tmp_path / "big.json").write_text('[{"item_id": 1, "timestamp": 99999999999999999999999}]')
    (tmp_path / "neg.json").write_text('[{"item_id": 1, "timestamp": -4}]')
    (tmp_path / "ms.json").write_text('[{"item_id": 1, "timestamp": 1700000000000}]')
    for path, message in cases:
        p = hstu("generate", "--run", run_dir, "--history", path, check=False)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    for flag in ("--max-users", "--epochs", "--batch-size", "--num-negatives", "--learning-rate"):
        p = hstu("train", "--data-dir", tmp_path, "--out", tmp_path / "o", flag, 0, check=False)
        assert p.returncode == 2 and f"argument {flag}: must be" in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()


def test_generate_k_names_the_models_range_as_http_does(run_dir):
    """-k 0 said "k must be >= 1", -k 11 "k=11 exceeds ..."; now the message of the HTTP service's
    422 (hstu.config.check_k), with the flag's name."""
    for k in (0, 11):
        p = hstu("generate", "--run", run_dir, "--user", 1, "-k", k, check=False)
        assert p.returncode == 2 and p.stderr.strip() == f"hstu generate: error: -k: must be in 1..10 (the model's max_output_len), got {k}"


@pytest.mark.parametrize(
    "flag, field, bad, message, edge",
    [
        ("--top-k", "top_k", "0", "must be in 1..100000, got 0", "100000"),
        ("--temperature", "temperature", "0", "must be in (0, 100], got 0", "100"),
        ("--temperature", "temperature", "-1", "must be in (0, 100], got -1", "0.001"),
        ("--temperature", "temperature", "nan", "must be a finite number in (0, 100], got nan", "1"),
        ("--beam-width", "beam_width", "0", "must be in 1..16, got 0", "1"),
        ("--beam-width", "beam_width", "17", "must be in 1..16, got 17", "16"),
        ("--seed", "seed", "-1", "must be in 0..4294967295, got -1", "4294967295"),
    ],
)
def test_generate_decoding_options_take_the_http_ranges(tmp_path, capsys, flag, field, bad, message, edge):
    """--top-k 0, --temperature 0 and --beam-width 0 were raw RuntimeErrors, --temperature -1 ran:
    each is refused by argparse (exit 2, flag and range named) before the run is read, exactly
    where the HTTP schema refuses it; the edge value passes both."""
    from pydantic import ValidationError

    from hstu.cli import build_parser, main
    from hstu.serve.schemas import Decoding

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--run", str(tmp_path / "no_run"), "--user", "1", flag, bad])
    assert exc.value.code == 2 and f"hstu generate: error: argument {flag}: {message}" in capsys.readouterr().err
    with pytest.raises(ValidationError):
        Decoding(**{field: float(bad) if field == "temperature" else int(bad)})
    args = build_parser().parse_args(["generate", "--run", "r", "--user", "1", flag, edge])
    assert getattr(args, field) == Decoding(**{field: getattr(args, field)}).model_dump()[field]


def test_train_refuses_an_out_dir_that_holds_a_run(tmp_path, capsys):
    """`hstu train --out EXISTING_RUN` silently trained over it: now refused unless --resume or
    --overwrite (which deletes the old run's files first); checked before any data is read."""
    from hstu.cli import main
    from hstu.runs import RUN_FILES

    for name, files in (("finished", ["model.safetensors", "metrics.json"]), ("interrupted", ["last.json", "last.safetensors"])):
        out = tmp_path / name
        out.mkdir()
        for f in files:
            (out / f).write_text("{}")
        assert main(["train", "--data-dir", str(tmp_path / "no_data"), "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"hstu train: error: --out {out} already holds a run ({', '.join(f for f in RUN_FILES if f in files)}); "
            "pass --resume to continue it, --overwrite to replace it"
        ), err
    nodata = ["--data-dir", str(tmp_path / "no_data"), "--out", str(out), "--quiet"]  # the interrupted run
    assert main(["train", "--resume", *nodata]) == 2  # passes the check, then misses the data
    assert "already holds" not in capsys.readouterr().err and (out / "last.json").exists()
    assert main(["train", "--overwrite", *nodata]) == 2  # the data is missing: the old run must survive that
    assert "already holds" not in capsys.readouterr().err and (out / "last.json").exists()
    with pytest.raises(SystemExit):
        main(["train", "--resume", "--overwrite", *nodata])
    assert "not allowed with argument --resume" in capsys.readouterr().err
    assert main(["train", "--resume", "--data-dir", str(tmp_path / "no_data"), "--out", str(tmp_path / "new")]) == 2
    assert f"--resume: {tmp_path / 'new'} holds no run to resume (no config.json)" in capsys.readouterr().err
    q = tmp_path / "q8"  # hstu quantize's output: --resume once retrained from scratch beside the stale INT8 weights
    q.mkdir()
    for f in ("config.json", "idmap.json", "quant.json", "model.quant.safetensors"):
        (q / f).write_text("{}")
    for flags in ([], ["--resume"], ["--overwrite"]):
        assert main(["train", *flags, "--data-dir", str(tmp_path / "no_data"), "--out", str(q), "--quiet"]) == 2
        assert f"--out {q} holds a quantized copy of a run (quant.json, from hstu quantize)" in capsys.readouterr().err
    assert sorted(p.name for p in q.iterdir()) == ["config.json", "idmap.json", "model.quant.safetensors", "quant.json"]


def test_generate_data_dir_flag_and_env(run_dir, tmp_path):
    """`generate --user` reads the run's data: --data-dir, else $HSTU_DATA_DIR (as `hstu train`),
    else where the run was trained; both used to be ignored (no flag, env unread)."""
    import shutil

    from conftest import ML1M

    want = json.loads(hstu("generate", "--run", run_dir, "--user", 1, "--json").stdout)["items"]
    moved = tmp_path / "moved-run"
    shutil.copytree(run_dir, moved)
    cfg = json.loads((moved / "config.json").read_text())
    cfg["data"]["data_dir"] = str(tmp_path / "gone")  # the data moved since training
    (moved / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "elsewhere").symlink_to(ML1M)
    out = json.loads(hstu("generate", "--run", moved, "--user", 1, "--json", "--data-dir", tmp_path / "elsewhere").stdout)
    assert out["items"] == want
    env = {k: v for k, v in os.environ.items() if k != "HSTU_DATA_DIR"}
    out = json.loads(
        hstu("generate", "--run", moved, "--user", 1, "--json", env={**env, "HSTU_DATA_DIR": str(tmp_path / "elsewhere")}).stdout
    )
    assert out["items"] == want
    empty = tmp_path / "empty"
    empty.mkdir()
    p = hstu("generate", "--run", run_dir, "--user", 1, env={**env, "HSTU_DATA_DIR": str(empty)}, check=False)  # env over the recorded dir
    assert p.returncode == 2 and str(empty) in p.stderr and "pass --data-dir or set HSTU_DATA_DIR" in p.stderr, p.stderr
    out = json.loads(
        hstu("generate", "--run", run_dir, "--user", 1, "--json", "--data-dir", ML1M, env={**env, "HSTU_DATA_DIR": str(empty)}).stdout
    )  # the flag over the env
    assert out["items"] == want


def test_eval_data_dir_flag_and_env(run_dir, tmp_path):
    """`eval` finds the run's data as `generate` does: --data-dir, else $HSTU_DATA_DIR, else where
    the run was trained (the env used to be ignored)."""
    from conftest import ML1M

    want = json.loads(hstu("eval", "--run", run_dir, "--json").stdout)
    env = {k: v for k, v in os.environ.items() if k != "HSTU_DATA_DIR"}
    (tmp_path / "elsewhere").symlink_to(ML1M)
    got = json.loads(hstu("eval", "--run", run_dir, "--json", env={**env, "HSTU_DATA_DIR": str(tmp_path / "elsewhere")}).stdout)
    assert got == want
    empty = tmp_path / "empty"
    empty.mkdir()
    p = hstu("eval", "--run", run_dir, env={**env, "HSTU_DATA_DIR": str(empty)}, check=False)  # env over the recorded dir
    assert p.returncode == 2 and str(empty) in p.stderr and "pass --data-dir or set HSTU_DATA_DIR" in p.stderr, p.stderr
    got = json.loads(hstu("eval", "--run", run_dir, "--json", "--data-dir", ML1M, env={**env, "HSTU_DATA_DIR": str(empty)}).stdout)
    assert got == want  # the flag over the env


def test_demo_says_1_epoch(tmp_path, capsys):
    """`hstu demo --epochs 1` printed "1 epochs" (twice); on the first 30 ML-1M users. `--threads` reaches
    the training recipe (a fresh-user finding: the demo had no --threads)."""
    from conftest import ML1M, need

    from hstu.cli import main

    need(ML1M / "ratings.dat")
    data = tmp_path / "ml-1m"
    data.mkdir()
    with open(ML1M / "ratings.dat", encoding="latin-1") as f:
        (data / "ratings.dat").write_text("".join(line for line in f if int(line.split("::", 1)[0]) <= 30), encoding="latin-1")
    (data / "movies.dat").symlink_to(ML1M / "movies.dat")
    assert main(["demo", "--data-dir", str(data), "--epochs", "1", "--out", str(tmp_path / "run"), "--quiet", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["num_threads"] == 2
    mine = tmp_path / "mine"  # a fresh-user finding: the demo wrote its run over any --out
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["demo", "--data-dir", str(data), "--epochs", "1", "--out", str(mine), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "holds files that are not an earlier demo's" in err and [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert main(["demo", "--data-dir", str(data), "--device", "tpu", "--out", str(tmp_path / "tpu")]) == 2
    cap = capsys.readouterr()  # the banner said "training ... on tpu" before the error
    assert "unknown device 'tpu'" in cap.err and cap.out == "" and not (tmp_path / "tpu").exists()
    assert " for 1 epoch on cpu" in out and "\ntrained 1 epoch in " in out and "epochs" not in out
    with pytest.raises(SystemExit) as e:  # --epochs 0 printed the banner, then failed inside training
        main(["demo", "--data-dir", str(data), "--epochs", "0", "--out", str(tmp_path / "run0")])
    cap = capsys.readouterr()
    assert e.value.code == 2 and "argument --epochs: must be >= 1, got 0" in cap.err and cap.out == ""


def test_python_dash_m_hstu_is_the_cli():
    """``python -m hstu`` runs the same parser as the console script: help exits 0, a usage
    error exits 2 naming the flag."""
    ok = subprocess.run([sys.executable, "-m", "hstu", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("usage: hstu")
    bad = subprocess.run([sys.executable, "-m", "hstu", "train", "--epochs", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--epochs: must be >= 1" in bad.stderr


def test_resume_keeps_the_runs_data_and_refuses_contradicting_flags(run_dir, tmp_path):
    """`train --resume` continues the run's own data (its --max-users, dataset, protocol) and
    train settings when the flags are not given; a model choice or a data option that contradicts
    the run exits 2 naming the flag and the run's config.json, before anything is written. A train
    that fails on its data leaves no empty --out behind."""
    from conftest import ML1M

    before = (run_dir / "config.json").read_text()
    p = hstu("train", "--resume", "--out", run_dir, "--data-dir", ML1M, "--max-users", 200, check=False)
    assert (
        p.returncode == 2 and "--max-users ([data] max_users) is 200 here but 300 in the run" in p.stderr and "config.json" in p.stderr
    ), p.stderr
    p = hstu("train", "--resume", "--out", run_dir, "--preset", "large", check=False)
    assert p.returncode == 2 and "drop --preset large" in p.stderr and "num_blocks = 8 (the run: 2)" in p.stderr, p.stderr
    p = hstu("train", "--resume", "--out", run_dir, "--protocol", "paper", "--data-dir", ML1M, check=False)
    assert p.returncode == 2 and "--protocol ([data] protocol) is 'paper' here but 'clean'" in p.stderr, p.stderr
    p = hstu("train", "--resume", "--out", run_dir, "--dataset", "taobao", check=False)  # refused before its data is looked for
    assert p.returncode == 2 and "--dataset ([data] dataset) is 'taobao' here but 'ml-1m'" in p.stderr, p.stderr
    other = tmp_path / "other"  # the same options over other data (40 users): the item ids differ
    other.mkdir()
    with open(ML1M / "ratings.dat", encoding="latin-1") as f:
        (other / "ratings.dat").write_text("".join(line for line in f if int(line.split("::", 1)[0]) <= 40), encoding="latin-1")
    (other / "movies.dat").symlink_to(ML1M / "movies.dat")
    p = hstu("train", "--resume", "--out", run_dir, "--data-dir", other, "--max-users", 300, check=False)
    assert p.returncode == 2 and "item ids are not the run's" in p.stderr and "idmap.json" in p.stderr, p.stderr
    assert (run_dir / "config.json").read_text() == before
    p = hstu("train", "--data-dir", tmp_path / "no_data", "--out", tmp_path / "never", check=False)
    assert p.returncode == 2 and not (tmp_path / "never").exists()
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    saved = json.loads(before)
    cfg = {**saved, "train": {**saved["train"], "batch_size": 64}}  # a run trained at another batch size
    (copy / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "train.toml").write_text("[train]\nepochs = 2\n")  # only [train] epochs: the run's other settings stay
    hstu("train", "--resume", "--out", copy, "--data-dir", ML1M, "--config", tmp_path / "train.toml", "--quiet")
    m = json.loads((copy / "metrics.json").read_text())
    assert m["epochs"] == 2 and m["test"]["users"] == 300
    assert json.loads((copy / "config.json").read_text())["train"]["batch_size"] == 64


@pytest.fixture(scope="module")
def semicolon_run(tmp_path_factory):
    """A tiny run trained on a headerless semicolon file read with --format and columns by position
    (in process: :func:`conftest.tiny_csv_flags`' model and recipe, 1 epoch)."""
    from conftest import tiny_csv_flags

    from hstu.cli import main

    d = tmp_path_factory.mktemp("semi")
    flags = tiny_csv_flags(d)
    rows = [f"{u};{(u * 3 + j) % 20 + 1};{1000 + j}" for u in range(1, 31) for j in range(8)]
    (d / "log.txt").write_text("\n".join(rows) + "\n")
    data = ["--dataset", "csv", "--data-dir", str(d / "log.txt"), "--format", "sep=;,header=none", "--columns", "user=0,item=1,time=2"]
    assert main(["train", *data, *flags[flags.index("--config") :], "--epochs", "1", "--out", str(d / "run"), "--quiet"]) == 0
    return d


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_eval_and_generate_take_the_runs_loader_options(semicolon_run, command, capsys):
    from hstu.cli import main

    run = semicolon_run / "run"
    cmd = ["eval", "--run", str(run), "--json"] if command == "eval" else ["generate", "--run", str(run), "--user", "3", "--json"]
    assert main(cmd) == 0  # the run's --format / --columns are the default
    first = json.loads(capsys.readouterr().out)
    same = ["--format", "sep=semicolon,header=no", "--columns", "user=0, item=1, time=2"]  # the run's options, spelt otherwise
    assert main([*cmd, *same]) == 0
    assert json.loads(capsys.readouterr().out) == first
    for flag, value, err in (
        ("--format", "sep=tab,header=none", "--format is 'sep=tab,header=none' here but 'sep=;,header=none' in the run"),
        ("--columns", "user=1,item=0,time=2", "--columns is 'user=1,item=0,time=2' here but 'user=0,item=1,time=2' in the run"),
    ):
        assert main([*cmd, flag, value]) == 2
        msg = capsys.readouterr().err
        assert err in msg and "config.json data.options." + flag[2:] in msg


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_eval_and_generate_refuse_data_with_other_items(semicolon_run, command, capsys):
    """--data-dir at a log of other items (one item fewer): the run's rows would score the wrong items."""
    from hstu.cli import main

    d = semicolon_run
    rows = [f"{u};{(u * 3 + j) % 19 + 1};{1000 + j}" for u in range(1, 31) for j in range(8)]
    (d / "other.txt").write_text("\n".join(rows) + "\n")
    cmd = ["eval", "--run", str(d / "run")] if command == "eval" else ["generate", "--run", str(d / "run"), "--user", "3"]
    assert main([*cmd, "--data-dir", str(d / "other.txt")]) == 2
    err = capsys.readouterr().err.strip()  # the command named once (it was "hstu eval: error: hstu eval: ...")
    assert err.startswith(f"hstu {command}: error: --data-dir: the data's 19 item ids are not the run's 20"), err


def test_eval_on_data_with_other_events_of_the_same_items_warns(semicolon_run, capsys, caplog):
    """A trial: after appending 150 events of known items to the log, eval's HR@10 moved from .46 to .27 without a
    word; the run knows its events and users (idmap.json data_facts): a warning says the data differs."""
    from hstu.cli import main

    d = semicolon_run
    rows = (d / "log.txt").read_text().splitlines()
    (d / "more.txt").write_text("\n".join([*rows, "1;5;2000", "2;6;2001"]) + "\n")  # two more events, same items
    cmd = ["eval", "--run", str(d / "run"), "--json"]
    with caplog.at_level("WARNING", logger="hstu"):
        assert main([*cmd, "--data-dir", str(d / "log.txt")]) == 0
        assert "data_facts" not in caplog.text
        assert main([*cmd, "--data-dir", str(d / "more.txt")]) == 0
    assert "the data holds 242 events of 30 users; the run was trained on 240 of 30 (idmap.json data_facts)" in caplog.text


def test_a_loader_flag_against_a_run_without_that_option_names_the_default():
    from argparse import Namespace
    from pathlib import Path

    from hstu.train.cli import run_loader_options

    given = Namespace(columns=None, format="sep=;")
    with pytest.raises(ValueError, match=r"--format is 'sep=;' here but none \(the loader's default\) in the run \(r/config\.json"):
        run_loader_options({"options": {}}, given, Path("r/config.json"))
    assert run_loader_options({"options": {}}, Namespace(columns=None, format="header=yes"), Path("c")) == {}  # the default, spelt out
    assert run_loader_options({}, given, Path("c")) == {"format": "sep=;"}  # a run that recorded no options: the flags
    # the default separator restated (a trial: `--format sep=comma` on a .csv run was refused): the one the loader takes
    for path, same, other in (("log.csv", "sep=comma", "sep=tab"), ("log.tsv", "sep=tab", "sep=comma")):
        assert run_loader_options({"data_dir": path, "options": {}}, Namespace(columns=None, format=same), Path("c")) == {}
        with pytest.raises(ValueError, match=f"--format is '{other}' here but none"):
            run_loader_options({"data_dir": path, "options": {}}, Namespace(columns=None, format=other), Path("c"))
