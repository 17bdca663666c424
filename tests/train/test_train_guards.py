"""Training guards found by a fresh-user trial: an fp16 hashed table under AdamW is refused before the data is read
(it trained to a nan loss and a run marked completed), a diverged epoch (non-finite loss) stops the run
with nothing of that epoch written, ``hstu.fit`` never replaces a run unless asked, the run records an
absolute data path, Ctrl-C / an abbreviated flag give one line, an out-of-range seed is refused before a run is replaced and
a model too big to allocate is one line naming its sizes."""

from __future__ import annotations

import argparse
import json
import os
import signal

import pytest
from conftest import TINY_MODEL, tiny_csv

from hstu import interrupts
from hstu.cli import main
from hstu.config import ModelConfig, TrainConfig
from hstu.data.prepare import DataSpec
from hstu.interrupts import terminated as _terminated
from hstu.runs import read_history
from hstu.train import loop

CFG = TINY_MODEL


def _log(d):
    return DataSpec("csv", str(tiny_csv(d)), options={"columns": "user=u,item=i,time=t"})


def _fit(run, spec, epochs=1, **kw):
    mcfg = ModelConfig(**CFG, **kw.pop("model", {}))
    return loop.fit(run, mcfg, TrainConfig(epochs=epochs, batch_size=8, num_negatives=4), spec, progress=False, **kw)


def test_fp16_hashed_table_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "prepare_data", lambda *_: pytest.fail("the data was read before the refusal"))
    with pytest.raises(ValueError, match=r"item_table_dtype = 'fp16' cannot be trained.*bf16"):
        _fit(tmp_path / "run", DataSpec("csv", "x.csv"), model={"item_table": "hashed", "item_table_dtype": "fp16"})
    assert not (tmp_path / "run").exists()


def test_bf16_hashed_table_trains_to_a_finite_loss(tmp_path):
    m = _fit(tmp_path / "run", _log(tmp_path), model={"item_table": "hashed", "item_table_shards": 2, "item_table_dtype": "bf16"})
    assert all(abs(v) < float("inf") for k, v in m["test"].items() if k != "users")
    assert all(0 < e["loss"] < float("inf") for e in read_history(tmp_path / "run"))


def test_a_diverged_epoch_stops_the_run_and_writes_nothing_of_it(tmp_path, monkeypatch):
    spec, run = _log(tmp_path), tmp_path / "run"
    _fit(run, spec, epochs=1)
    files = lambda: {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != "config.json"}  # noqa: E731
    before = files()  # config.json takes the resumed run's epochs = 2 at the start
    real = loop.train_one_epoch
    monkeypatch.setattr(loop, "train_one_epoch", lambda *a, **k: {**real(*a, **k), "loss": float("nan")})
    with pytest.raises(FloatingPointError, match="epoch 2: the training loss is nan"):
        _fit(run, spec, epochs=2, resume=True)
    assert files() == before  # epoch 1 intact, nothing of epoch 2
    assert [e["epoch"] for e in read_history(run)] == [1]


def test_fit_does_not_replace_a_run_unless_asked(tmp_path):
    spec, run = _log(tmp_path), tmp_path / "run"
    _fit(run, spec)
    with pytest.raises(FileExistsError, match=r"already holds a run; resume=True \(--resume\) continues it, overwrite=True"):
        _fit(run, spec)  # the Python API's keywords, not only the CLI's flag (a trial)
    _fit(run, spec, overwrite=True)


def test_cli_run_records_an_absolute_data_path(tmp_path, monkeypatch, capsys):
    _log(tmp_path)
    model = "\n".join(f"{k} = {v}" for k, v in CFG.items())
    (tmp_path / "t.toml").write_text(f"[model]\n{model}\n[train]\nbatch_size = 8\nnum_negatives = 4\n")
    monkeypatch.chdir(tmp_path)
    flags = ["--dataset", "csv", "--data-dir", "log.csv", "--columns", "user=u,item=i,time=t", "--config", "t.toml", "--epochs", "1"]
    assert main(["train", *flags, "--out", "run", "--quiet"]) == 0
    data_dir = json.loads((tmp_path / "run" / "config.json").read_text())["data"]["data_dir"]
    assert os.path.isabs(data_dir) and os.path.samefile(data_dir, tmp_path / "log.csv")


def test_abbreviated_flags_and_ctrl_c_are_one_line(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--epoch", "1", "--out", str(tmp_path / "r")])
    assert exc.value.code == 2 and "unrecognized arguments: --epoch" in capsys.readouterr().err

    def interrupted(args):
        if args.seed == 7:  # SIGTERM (timeout, docker stop): the same cleanup as Ctrl-C, said as such
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt

    import hstu.train.cli as tcli

    real_add = tcli.add_train_parser

    def add(sub):
        real_add(sub)
        sub.choices["train"].set_defaults(func=interrupted)

    monkeypatch.setattr(tcli, "add_train_parser", add)
    run = tmp_path / "r"
    assert main(["train", "--out", str(run)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hstu train: interrupted; no epoch was committed, nothing is kept in {run}: run the command again"]
    run.mkdir()
    (run / "last.json").write_text("{}")  # a committed epoch (an older run's manifest)
    assert main(["train", "--out", str(run)]) == 130
    assert capsys.readouterr().err.strip() == "hstu train: interrupted; the run keeps its last committed epoch: continue with --resume"
    stray: list = []
    before = signal.signal(signal.SIGTERM, lambda *a: stray.append(a))  # without main()'s handler: caught here, not pytest killed
    try:
        assert main(["train", "--out", str(run), "--seed", "7"]) == 143
        assert signal.getsignal(signal.SIGTERM) is not _terminated  # the handler is main()'s only
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not stray
    assert capsys.readouterr().err.strip() == "hstu train: terminated; the run keeps its last committed epoch: continue with --resume"


def _cli_flags(tmp_path, train_extra=""):
    _log(tmp_path)
    model = "\n".join(f"{k} = {v}" for k, v in CFG.items())
    (tmp_path / "t.toml").write_text(f"[model]\n{model}\n[train]\nbatch_size = 8\nnum_negatives = 4\n{train_extra}")
    return ["train", "--dataset", "csv", "--data-dir", str(tmp_path / "log.csv"), "--columns", "user=u,item=i,time=t", "--quiet"]


@pytest.mark.parametrize("where", ["flag", "toml"])
def test_an_out_of_range_seed_is_refused_before_the_run_is_replaced(tmp_path, capsys, where):
    flags, run = _cli_flags(tmp_path), tmp_path / "run"
    assert main([*flags, "--config", str(tmp_path / "t.toml"), "--epochs", "1", "--out", str(run)]) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    capsys.readouterr()
    bad = ["--seed", "-1"] if where == "flag" else []
    if where == "toml":
        _cli_flags(tmp_path, "seed = -1\n")
    for out in ("run", "new"):  # replacing the old run, a fresh --out
        over = ["--overwrite"] if out == "run" else []
        args = [*flags, "--config", str(tmp_path / "t.toml"), *bad, "--out", str(tmp_path / out), *over]
        if where == "flag":
            with pytest.raises(SystemExit) as exc:
                main(args)
            assert exc.value.code == 2 and "argument --seed: must be in 0..4294967295, got -1" in capsys.readouterr().err
        else:
            assert main(args) == 2
            assert "TrainConfig.seed ([train] seed, --seed) must be in 0..4294967295, got -1" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # the old run intact
    assert not (tmp_path / "new").exists()  # nothing half-written


@pytest.mark.parametrize("field, value", [("embedding_dim", 2**40), ("embedding_dim", 10**22), ("num_time_buckets", 10**12)])
def test_a_model_too_big_to_allocate_is_one_line_naming_its_sizes(tmp_path, capsys, field, value):
    """The sizes named include the one at fault (a trial: a huge num_time_buckets was not among them)."""
    flags = _cli_flags(tmp_path)
    model = "\n".join(f"{k} = {v}" for k, v in {**CFG, field: value}.items())
    (tmp_path / "t.toml").write_text(f"[model]\n{model}\n[train]\nbatch_size = 8\nnum_negatives = 4\n")
    assert main([*flags, "--config", str(tmp_path / "t.toml"), "--epochs", "1", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hstu train: error: the model's tensors do not fit (") and f"{field} = {value}" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--seed", "-1"], "argument --seed: must be in 0..4294967295, got -1"),
        (["quantize", "--run", "r", "--scheme", "int8", "--seed", "-1"], "argument --seed: must be in 0..4294967295, got -1"),
        (["quantize", "--run", "r", "--scheme", "int8", "--calib-users", "0"], "argument --calib-users: must be >= 1, got 0"),
        (["train", "--out", "r", "--seed", "1e23"], "argument --seed: expected an integer, got '1e23'"),
        # a fresh-user finding: a huge --request-time ended in an OverflowError traceback
        (["generate", "--run", "r", "--request-time", "9" * 20], "argument --request-time: must be in 0..9223372036"),
        (["generate", "--run", "r", "--request-time", "-1"], "argument --request-time: must be in 0..9223372036, got -1"),
    ],
)
def test_other_seed_flags_are_range_checked(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_stack_of_blocks_too_deep_to_build_is_refused_at_once():
    """num_blocks = 10**23 built layers until memory ran out (a fresh user's config never returned); the
    config check names the field and its bound; 1024 blocks is still a valid config."""
    with pytest.raises(ValueError, match=r"^ModelConfig\.num_blocks must be <= 1024, got 100000000000000000000000$"):
        ModelConfig(**{**CFG, "num_blocks": 10**23}).validate()
    ModelConfig(**{**CFG, "num_blocks": 1024}).validate()
    with pytest.raises(ValueError, match=r"^ModelConfig\.max_output_len must be >= 1, got 0$"):
        ModelConfig(**{**CFG, "max_output_len": 0}).validate()


def test_sasrec_runs_refuse_low_precision_in_one_line(tmp_path, capsys):
    """A fresh user's `hstu quantize --scheme int8` / `eval --precision int8` of a SASRec run ended in an
    AttributeError traceback (the INT8 scheme looked for HSTU's W_uvqk); now one line, nothing written."""
    flags, run = _cli_flags(tmp_path), tmp_path / "sas"
    assert main([*flags, "--config", str(tmp_path / "t.toml"), "--arch", "sasrec", "--epochs", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    for argv in (
        ["quantize", "--run", str(run), "--scheme", "int8", "--out", str(tmp_path / "q")],
        ["eval", "--run", str(run), "--precision", "int8"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "precision 'int8': low-precision inference supports HSTUModel, got SASRecModel (use fp32)" in err[0]
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "model, arch, message",
    [
        # the file's HSTU block option with --arch sasrec: the file is named, not only the preset
        ("multi_channel = true", ["--arch", "sasrec"], "t.toml [model] with --arch sasrec: preset small: ModelConfig.multi_channel = true"),
        ("ffn_hidden = 16", ["--arch", "sasrec"], "t.toml [model] with --arch sasrec: preset small: ModelConfig.ffn_hidden = 16"),
        # an unknown architecture is a config error naming the file, before any data is read
        ('architecture = "gpt"', [], "t.toml [model]: ModelConfig.architecture must be 'hstu' or 'sasrec', got 'gpt'"),
    ],
)
def test_model_table_errors_name_the_file(tmp_path, capsys, model, arch, message):
    flags = _cli_flags(tmp_path)
    (tmp_path / "t.toml").write_text(f"[model]\n{model}\n")
    assert main([*flags, "--config", str(tmp_path / "t.toml"), *arch, "--epochs", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_resume_names_a_contradicting_model_field_in_toml_spelling(tmp_path, capsys):
    """--resume with a [model] value the run does not have: the message spells both as TOML does (true, not True)."""
    flags, run = _cli_flags(tmp_path), tmp_path / "run"
    assert main([*flags, "--config", str(tmp_path / "t.toml"), "--epochs", "1", "--out", str(run)]) == 0
    (tmp_path / "off.toml").write_text("[model]\nmulti_channel = false\n")  # the small preset's block has it on
    capsys.readouterr()
    assert main([*flags, "--config", str(tmp_path / "off.toml"), "--epochs", "2", "--out", str(run), "--resume"]) == 2
    assert "[model] sets multi_channel = false (the run: true): drop them" in capsys.readouterr().err


def test_cli_train_refuses_an_out_whose_config_json_is_not_a_runs(tmp_path, monkeypatch, capsys):
    """Training writes config.json / idmap.json: another tool's file of that name in --out is not overwritten (nor
    deleted by a failed start); an hstu run's leftover config.json (a start ended before its first epoch) is fine."""
    _log(tmp_path)
    model = "\n".join(f"{k} = {v}" for k, v in CFG.items())
    (tmp_path / "t.toml").write_text(f"[model]\n{model}\n[train]\nbatch_size = 8\nnum_negatives = 4\n")
    monkeypatch.chdir(tmp_path)
    flags = [
        "train",
        "--dataset",
        "csv",
        "--data-dir",
        "log.csv",
        "--columns",
        "user=u,item=i,time=t",
        "--config",
        "t.toml",
        "--epochs",
        "1",
    ]
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "config.json").write_text('{"eslint": true}\n')
    assert main([*flags, "--out", "proj", "--quiet"]) == 2
    assert "holds config.json that no hstu run wrote" in capsys.readouterr().err
    assert (tmp_path / "proj" / "config.json").read_text() == '{"eslint": true}\n'
    assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["config.json"]
    assert main([*flags, "--out", "run", "--quiet"]) == 0
    for f in ("model.safetensors", "last.safetensors", "last.json", "history.json", "metrics.csv", "metrics.json"):
        (tmp_path / "run" / f).unlink(missing_ok=True)  # what a start that ended before its first epoch leaves
    assert main([*flags, "--out", "run", "--quiet"]) == 0


def test_resuming_a_run_that_stopped_early_trains_no_more_epochs(tmp_path, monkeypatch):
    """Early stopping is part of the run: ``--resume`` of a run that stopped early (a rerun of the same command)
    used to train one more epoch at least (three more in the trial), changing a finished model."""
    real = loop.LocalStrategy.evaluate
    monkeypatch.setattr(loop.LocalStrategy, "evaluate", lambda *a: {**real(*a), "NDCG@10": 0.1})  # never better after epoch 1
    spec, run = _log(tmp_path), tmp_path / "run"
    tcfg = lambda: TrainConfig(epochs=10, batch_size=8, num_negatives=4, early_stopping_patience=1)  # noqa: E731
    m = loop.fit(run, ModelConfig(**CFG), tcfg(), spec, progress=False)
    assert m["status"] == "early stopping at epoch 2 (best 1)"
    weights = (run / "last.safetensors").read_bytes()
    m2 = loop.fit(run, ModelConfig(**CFG), tcfg(), spec, progress=False, resume=True)
    assert m2["status"] == m["status"] and [e["epoch"] for e in read_history(run)] == [1, 2]
    assert (run / "last.safetensors").read_bytes() == weights
    patient = TrainConfig(epochs=3, batch_size=8, num_negatives=4, early_stopping_patience=3)  # a larger patience goes on
    assert loop.fit(run, ModelConfig(**CFG), patient, spec, progress=False, resume=True)["status"] == "completed"
    assert [e["epoch"] for e in read_history(run)] == [1, 2, 3]


def test_cli_resume_refuses_fewer_epochs_than_committed(tmp_path, monkeypatch, capsys, caplog):
    _log(tmp_path)
    model = "\n".join(f"{k} = {v}" for k, v in CFG.items())
    (tmp_path / "t.toml").write_text(f"[model]\n{model}\n[train]\nbatch_size = 8\nnum_negatives = 4\n")
    monkeypatch.chdir(tmp_path)
    flags = ["train", "--dataset", "csv", "--data-dir", "log.csv", "--columns", "user=u,item=i,time=t", "--config", "t.toml"]
    assert main([*flags, "--epochs", "2", "--out", "run", "--quiet"]) == 0
    config = (tmp_path / "run" / "config.json").read_bytes()
    assert main(["train", "--out", "run", "--resume", "--epochs", "1", "--quiet"]) == 2
    assert "has committed 2 epochs and --epochs 1 is fewer" in capsys.readouterr().err
    assert (tmp_path / "run" / "config.json").read_bytes() == config  # the run's epochs stay 2
    with caplog.at_level("INFO", logger="hstu"):
        assert main(["train", "--out", "run", "--resume", "--quiet"]) == 0
    assert "has trained its 2 epochs, nothing to train" in caplog.text
    assert [e["epoch"] for e in read_history(tmp_path / "run")] == [1, 2]


def test_overwrite_keeps_the_old_run_until_the_new_one_commits_an_epoch(tmp_path, monkeypatch, capsys):
    """A trial: Ctrl-C in the first epoch of `train --overwrite` deleted the old run ("nothing is kept"). Its files
    now wait in RUN/.replaced/ until the new run commits an epoch, and come back if it does not."""
    spec, run = _log(tmp_path), tmp_path / "run"
    _fit(run, spec)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    real = loop.train_one_epoch

    def interrupted(*a, **k):
        assert (run / ".replaced" / "model.safetensors").is_file() and not (run / "model.safetensors").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train_one_epoch", interrupted)
    with pytest.raises(KeyboardInterrupt) as exc:
        _fit(run, spec, overwrite=True)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # the old run, whole; no .replaced left
    args = argparse.Namespace(command="train", out=str(run))  # the line said "continue with --resume", which then refused
    assert interrupts.interrupted(args, exc.value) == 130  # the new run's flags (the old run's differ)
    err = capsys.readouterr().err.strip()
    assert err == (
        f"hstu train: interrupted; no epoch of the new training was committed: {run} holds the old run, as it was "
        "(run the command again to replace it)"
    )
    for where in ("prepare_data", "write_idmap"):  # a trial: stopped loading its data (before the old run was set aside)
        monkeypatch.setattr(loop, where, lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))  # or just after
        with pytest.raises(KeyboardInterrupt) as exc:
            _fit(run, spec, overwrite=True)
        assert exc.value.old_run_restored and {p.name: p.read_bytes() for p in run.iterdir()} == before, where
        monkeypatch.undo()
    (run / ".replaced").mkdir()  # a start killed outright: the old run aside, that start's config.json beside it
    for name in before:
        (run / name).rename(run / ".replaced" / name)
    (run / "config.json").write_text("{}")
    monkeypatch.setattr(loop, "train_one_epoch", real)
    _fit(run, spec, overwrite=True)
    assert not (run / ".replaced").exists() and json.loads((run / "config.json").read_text())["model"]
    assert [e["epoch"] for e in read_history(run)] == [1]


def test_torchrun_without_distributed_is_refused(tmp_path, capsys, monkeypatch):
    """A trial: `torchrun --nproc-per-node 2 hstu train ...` without --distributed started two whole trainings into one
    --out (one failed on the run lock, then torchrun killed the other). Refused in one line, nothing written."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = _cli_flags(tmp_path)
    assert main([*flags, "--config", str(tmp_path / "t.toml"), "--epochs", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "hstu train: error: WORLD_SIZE=2 (torchrun?) but one process trains alone here: add --distributed (fit: DistributedStrategy)"
    )
    assert not (tmp_path / "run").exists()
