"""The public Python API (``import hstu``): every exported name is the object the CLI runs, imported
on first use; the docstring's flow gives the same items as the CLI's ``hstu generate --json`` on the
tiny run (conftest's run_dir: 200 ML-1M users, one epoch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hstu
from hstu.cli import main


def test_every_api_name_is_the_modules_object() -> None:
    import importlib

    for name, module in hstu._API.items():  # noqa: SLF001 - the table under test
        assert getattr(hstu, name) is getattr(importlib.import_module(module), name), name
    assert set(hstu.__all__) == {"__version__", *hstu._API}  # noqa: SLF001
    assert set(hstu.__all__) <= set(dir(hstu))


def test_import_is_light_and_unknown_names_raise() -> None:
    code = "import sys, hstu; print('torch' in sys.modules); hstu.nope"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert p.stdout.strip() == "False", p.stdout  # torch is imported by the first API name, not by `import hstu`
    assert "module 'hstu' has no attribute 'nope'" in p.stderr


def test_api_flow_equals_the_cli(run_dir, ratings, tmp_path, capsys) -> None:
    user = int(ratings.user.iloc[0])
    rows = ratings[ratings.user == user].iloc[:20]
    events = [{"item_id": int(i), "timestamp": int(t)} for i, t in zip(rows.item, rows.ts)]
    (tmp_path / "h.json").write_text(json.dumps(events))

    rec = hstu.Recommender.from_run(run_dir)
    prep = rec.prepare(hstu.History(items=[e["item_id"] for e in events], timestamps=[e["timestamp"] for e in events]))
    for decoding in (hstu.DecodeOptions(), hstu.DecodeOptions("beam", beam_width=3)):
        got = rec.recommend([prep], k=4, decoding=decoding)[0]
        flags = ["--strategy", decoding.strategy, "--beam-width", str(decoding.beam_width)]
        assert main(["generate", "--run", str(run_dir), "--history", str(tmp_path / "h.json"), "-k", "4", *flags, "--json"]) == 0
        cli_items = json.loads(capsys.readouterr().out)["items"]
        assert [i["item_id"] for i in got] == [i["item_id"] for i in cli_items]
        assert [i["score"] for i in got] == [i["score"] for i in cli_items]


def test_recommend_of_no_histories_is_empty_and_subpackage_names(rec) -> None:
    assert rec.recommend([], k=3) == []
    from hstu.generate import Engine, History, Recommender

    assert (Recommender, History) == (hstu.Recommender, hstu.History) and Engine.__name__ == "Engine"
    assert dir(hstu) == sorted(hstu.__all__)


def test_fit_refuses_a_config_field_of_the_wrong_type_naming_it(tmp_path) -> None:
    """As a config file's [model] / [train] table: ValueError naming the field, before any data is read
    (the DataSpec names no data set that exists) and before the run directory is made."""
    small = hstu.model_config_from_preset("small")
    spec = hstu.DataSpec(dataset="csv", data_dir=str(tmp_path / "absent.csv"))
    cases = [
        (small, hstu.TrainConfig(epochs="2"), "train config: epochs must be int, got '2'"),
        (small, hstu.TrainConfig(learning_rate=None), "train config: learning_rate must be float, got None"),
        (small, hstu.TrainConfig(epochs=0), "train config: TrainConfig.epochs"),
        (hstu.ModelConfig(embedding_dim="64"), hstu.TrainConfig(), "model config: embedding_dim must be int, got '64'"),
    ]
    for mcfg, tcfg, message in cases:
        with pytest.raises(ValueError) as exc:
            hstu.fit(tmp_path / "run", mcfg, tcfg, spec, progress=False)
        assert str(exc.value).startswith(message), str(exc.value)
    assert not (tmp_path / "run").exists()
