"""The [data] table of a config file (hstu train --config; flags win) and an order-only run end to end:
a headerless ';' file by position, no time column, trained with the time bias off and saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_MODEL

from hstu.cli import main
from hstu.config import load_config_file


def _toml(d: Path, data: str) -> Path:
    model = "".join(f"{k} = {v}\n" for k, v in TINY_MODEL.items())
    p = d / "run.toml"
    p.write_text(f"[model]\n{model}[train]\nbatch_size = 8\nnum_negatives = 4\nepochs = 1\n[data]\n{data}")
    return p


def _log(d: Path) -> Path:
    rows = [f"{(u * 3 + j) % 20 + 1};{u}" for u in range(1, 31) for j in range(6)]  # item;user, in order, no time
    (d / "logs").mkdir()
    (d / "logs" / "part2.txt").write_text("\n".join(rows[:90]) + "\n")
    (d / "logs" / "part10.txt").write_text("\n".join(rows[90:]) + "\n")
    return d / "logs"


def test_data_table_parses_into_a_dataspec(tmp_path):
    spec = load_config_file(
        _toml(tmp_path, 'dataset = "csv"\ndata_dir = "logs"\ncolumns = "user=1,item=0"\nformat = "sep=;,header=none"\n')
    )["data"]
    assert spec.dataset == "csv" and spec.data_dir == str(tmp_path / "logs")  # relative to the config file
    assert spec.options == {"columns": "user=1,item=0", "format": "sep=;,header=none"}
    with pytest.raises(ValueError, match=r"run.toml \[data\]: unknown field\(s\) \['colums'\]") as info:
        load_config_file(_toml(tmp_path, 'colums = "user=1"\n'))
    valid = str(info.value).split("valid: ")[1]  # what a [data] table takes: DataSpec's fields and the loader options
    assert all(f"'{k}'" in valid for k in ("columns", "format", "time_unit", "features", "dataset", "max_users"))
    assert "feature_maps" not in valid  # the run's own (set by training), not a config field
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['feature_maps'\] for \[data\]"):
        load_config_file(_toml(tmp_path, "feature_maps = []\n"))
    with pytest.raises(ValueError, match=r"\[data\]: max_users must be int \| None"):
        load_config_file(_toml(tmp_path, 'max_users = "ten"\n'))
    with pytest.raises(ValueError, match=r"\[data\]: DataSpec.protocol must be one of"):
        load_config_file(_toml(tmp_path, 'protocol = "weekly"\n'))
    # the loader options are checked as the file is read, naming it (a trial's: the loaders' errors named no file)
    with pytest.raises(ValueError, match=r"run.toml \[data\] numeric_features.price: the number of buckets must be an integer"):
        load_config_file(_toml(tmp_path, "numeric_features = {price = 0}\n"))
    with pytest.raises(ValueError, match=r"run.toml \[data\] time_unit must be one of \['s', 'ms', 'us', 'ns'\], got 'min'"):
        load_config_file(_toml(tmp_path, 'time_unit = "min"\n'))


def test_order_only_run_from_the_data_table(tmp_path, capsys):
    logs = _log(tmp_path)
    cfg = _toml(
        tmp_path, f'dataset = "csv"\ndata_dir = "{logs}"\ncolumns = "user=1,item=0"\nformat = "sep=;,header=none"\nmax_users = 50\n'
    )
    rc = main(["train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--quiet", "--max-users", "20"])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["dataset"] == "csv" and saved["data"]["max_users"] == 20  # the flag wins over [data]
    assert saved["data"]["options"] == {"columns": "user=1,item=0", "format": "sep=;,header=none"}
    assert saved["model"]["use_time_bias"] is False
    facts = json.loads((tmp_path / "run" / "idmap.json").read_text())["data_facts"]
    assert facts["order_only"] is True and facts["files"] == 2 and facts["users"] == 20


def test_a_list_of_files_in_the_data_table(tmp_path, capsys):
    """configuration.md: a csv log may be "a list in a `[data]` table" (DataSpec takes one in Python): the
    table refused it ("data_dir must be str"). The list's paths are relative to the config file, the run
    records them absolute, trains as on the directory holding the same two files, and `hstu eval` reads it."""
    _log(tmp_path)
    opts = 'columns = "user=1,item=0"\nformat = "sep=;,header=none"\n'
    cfg = _toml(tmp_path, f'dataset = "csv"\ndata_dir = ["logs/part2.txt", "logs/part10.txt"]\n{opts}')
    assert load_config_file(cfg)["data"].data_dir == [str(tmp_path / "logs" / "part2.txt"), str(tmp_path / "logs" / "part10.txt")]
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "a"), "--quiet"]) == 0, capsys.readouterr().err
    by_dir = _toml(tmp_path, f'dataset = "csv"\ndata_dir = "logs"\n{opts}')
    assert main(["train", "--config", str(by_dir), "--out", str(tmp_path / "b"), "--quiet"]) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "a" / "config.json").read_text())["data"]["data_dir"]
    assert saved == [str((tmp_path / "logs" / n).resolve()) for n in ("part2.txt", "part10.txt")]
    capsys.readouterr()
    got = []
    for run in ("a", "b"):
        assert main(["eval", "--run", str(tmp_path / run), "--split", "test", "--json"]) == 0
        got.append(json.loads(capsys.readouterr().out))
    assert got[0] == got[1] and len(got[0]) > 4
    with pytest.raises(ValueError, match=r"\[data\]: data_dir must be str \| list\[str\], got \[\]"):
        load_config_file(_toml(tmp_path, "data_dir = []\n"))


def test_a_file_listed_twice_is_refused(tmp_path):
    """A list naming one file twice (``a.csv`` and ``./a.csv``) read its events twice, silently (a second trial)."""
    from hstu.data.delimited import log_files

    logs = _log(tmp_path)
    with pytest.raises(ValueError, match=r"part2.txt: listed twice in the event-log files \(also as .*part2.txt\)"):
        log_files([str(logs / "part2.txt"), str(logs / "part10.txt"), str(logs / "." / "part2.txt")])
    assert log_files([str(logs / "part2.txt"), str(logs / "part10.txt")]) == [logs / "part2.txt", logs / "part10.txt"]


def test_a_zero_padded_position_without_a_header(tmp_path, capsys):
    """``time=02`` in a headerless file was "['#02'] not in index" without file or line: 02 is position 2."""
    rows = [f"{u},{(u * 3 + j) % 20 + 1},{1000 + j}" for u in range(1, 31) for j in range(6)]
    (tmp_path / "log.csv").write_text("\n".join(rows) + "\n")
    base = ["train", "--dataset", "csv", "--data-dir", str(tmp_path / "log.csv"), "--format", "header=none", "--quiet"]
    model = "".join(f"{k} = {v}\n" for k, v in TINY_MODEL.items())
    (tmp_path / "t.toml").write_text(f"[model]\n{model}[train]\nbatch_size = 8\nnum_negatives = 4\nepochs = 1\n")
    base += ["--config", str(tmp_path / "t.toml")]
    assert main([*base, "--columns", "user=00,item=1,time=02", "--out", str(tmp_path / "a")]) == 0, capsys.readouterr().err
    assert main([*base, "--columns", "user=0,item=1,time=2", "--out", str(tmp_path / "b")]) == 0, capsys.readouterr().err
    facts = [json.loads((tmp_path / r / "idmap.json").read_text())["data_facts"] for r in ("a", "b")]
    assert facts[0]["events"] == facts[1]["events"] == 180
