"""A hashed item table ([model] item_table = "hashed", 4 shards, one host-placed) on every user path:
train (and resume), eval, generate (CLI = API), quantize and /v1/generate, each checked against a
second method: a dense-table twin run whose item weight is the hashed table's rows."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ML1M, need
from safetensors.torch import load_file

from hstu.config import ModelConfig, TrainConfig, model_config_from_preset, to_dict
from hstu.data.prepare import DataSpec
from hstu.model.checkpoint import read_json, write_json
from hstu.model.embedding import ShardedEmbedding
from hstu.model.hstu import build_hstu
from hstu.runs import load_float_run, load_run, save_best_weights
from hstu.train.loop import fit

USERS = 200
HASHED = dict(item_table="hashed", item_table_shards=4, item_table_placement="device,host,device,device")
USER = 1


def hashed_cfg():
    return model_config_from_preset("small", max_seq_len=50, **HASHED)


def spec():
    return DataSpec("ml-1m", str(need(ML1M)), max_users=USERS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(hashed run, its dense twin): the twin holds the same weights with the item rows as one nn.Embedding."""
    root = tmp_path_factory.mktemp("item_table")
    hashed = root / "hashed"
    fit(hashed, hashed_cfg(), TrainConfig(epochs=1), spec(), progress=False)
    twin = root / "dense"
    twin.mkdir()
    for f in ("config.json", "idmap.json"):
        shutil.copyfile(hashed / f, twin / f)
    cfg = read_json(twin / "config.json")
    cfg["model"].update({k: v for k, v in to_dict(ModelConfig()).items() if k.startswith("item_table")})
    write_json(twin / "config.json", cfg)
    model, _, _ = load_float_run(hashed)
    dense = build_hstu(ModelConfig(**cfg["model"]))
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("item_emb.")}
    state["item_emb.weight"] = model.item_emb.rows(0, model.cfg.num_items + 1).detach().clone()
    dense.load_state_dict(state)
    save_best_weights(twin, dense)
    return hashed, twin


def history(user: int) -> list[dict]:
    df = pd.read_csv(ML1M / "ratings.dat", sep=":", header=None, usecols=[0, 2, 6], names=["user", "item", "ts"], encoding="latin-1")
    rows = df[df.user == user].sort_values("ts", kind="stable")
    return [{"item_id": int(i), "timestamp": int(t)} for i, t in zip(rows.item, rows.ts)]


def api(run, hist, k=5, precision=None):
    from hstu.generate.recommend import History, Recommender

    rec = Recommender.from_run(run, precision=precision)
    return rec.recommend([rec.prepare(History([e["item_id"] for e in hist], [e["timestamp"] for e in hist]))], k)[0]


def cli_json(capsys, *args):
    from hstu.cli import main

    assert main([*map(str, args)]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_run_holds_a_hashed_table_that_loads_back_exactly(runs):
    hashed, _ = runs
    cfg = read_json(hashed / "config.json")["model"]
    assert (cfg["item_table"], cfg["item_table_shards"], cfg["item_table_placement"]) == ("hashed", 4, "device,host,device,device")
    saved = load_file(str(hashed / "model.safetensors"))
    assert sorted(k for k in saved if k.startswith("item_emb.")) == [f"item_emb.shards.{s}" for s in range(4)]
    a, _, _ = load_float_run(hashed)
    b, _, _ = load_float_run(hashed)
    assert isinstance(a.item_emb, ShardedEmbedding) and a.item_emb.placements[1] == "host"
    for k, v in a.state_dict().items():
        assert torch.equal(v, saved[k]) and torch.equal(v, b.state_dict()[k])


def test_eval_cli_equals_metrics_and_the_dense_twin(runs, capsys):
    hashed, twin = runs
    got = cli_json(capsys, "eval", "--run", hashed, "--json")
    want = json.loads((hashed / "metrics.json").read_text())["test"]
    assert got["users"] == USERS and got["HR@10"] == pytest.approx(want["HR@10"]) and got["MRR"] == pytest.approx(want["MRR"])
    dense = cli_json(capsys, "eval", "--run", twin, "--json")
    assert dense.pop("split") == got.pop("split") == "test" and dense.pop("precision") == got.pop("precision") == "fp32"
    assert dense.pop("protocol") == got.pop("protocol") and dense == pytest.approx(got)


def test_generate_cli_equals_api_and_the_dense_twin_and_excludes_history(runs, capsys):
    hashed, twin = runs
    hist = history(USER)
    cli = cli_json(capsys, "generate", "--run", hashed, "--user", USER, "-k", 5, "--json")["items"]
    via_api = api(hashed, hist)
    dense = api(twin, hist)
    assert [i["item_id"] for i in cli] == [i["item_id"] for i in via_api] == [i["item_id"] for i in dense]
    assert np.allclose([i["score"] for i in cli], [i["score"] for i in dense], atol=1e-4)
    assert not {i["item_id"] for i in cli} & {e["item_id"] for e in hist}  # ML-1M excludes the history


def test_quantize_cli_stores_the_shards_in_fp16_and_ranks_as_the_dense_twin(runs, capsys, tmp_path):
    from hstu.cli import main

    hashed, twin = runs
    q, qd = tmp_path / "q8", tmp_path / "q8-dense"
    assert main(["quantize", "--run", str(hashed), "--scheme", "int8", "--out", str(q), "--no-calibrate"]) == 0
    assert main(["quantize", "--run", str(twin), "--scheme", "int8", "--out", str(qd), "--no-calibrate"]) == 0
    capsys.readouterr()
    saved = load_file(str(q / "model.quant.safetensors"))
    assert all(saved[f"item_emb.shards.{s}"].dtype == torch.float16 for s in range(4))
    # the quantized run's config.json says so (it said the float run's dtype: a plan, and its memory check, of other sizes)
    assert read_json(q / "config.json")["model"]["item_table_dtype"] == "fp16"
    assert load_run(q)[0].item_emb.plan.shards[0].dtype == "fp16"
    ev, evd = cli_json(capsys, "eval", "--run", q, "--json"), cli_json(capsys, "eval", "--run", qd, "--json")
    assert ev["users"] == evd["users"] == USERS and abs(ev["HR@10"] - evd["HR@10"]) <= 2 / USERS  # a rank or two may move
    # not bit-equal: a dense fp16 table scales its looked-up rows by √d in fp16, a hashed one widens them to float32
    # first (input rows differ by ~1e-4, then the INT8 Linears' per-call activation scales): the next item and its score agree;
    # a greedy chain's later steps may part at a near tie (scores are cosines / 0.05)
    (a,), (b,) = api(q, history(USER), k=1), api(qd, history(USER), k=1)
    assert a["item_id"] == b["item_id"] and abs(a["score"] - b["score"]) < 0.1  # .005 in cosine
    assert main(["quantize", "--run", str(hashed), "--scheme", "int8", "--embeddings", "int8", "--out", str(tmp_path / "x")]) == 2
    assert "is for a dense item table" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_one_generate_request_answers_as_the_api(runs):
    pytest.importorskip("fastapi")
    from serving import post, serve

    from hstu.generate.recommend import Recommender

    hashed, _ = runs
    hist = history(USER)[-30:]
    with serve(Recommender.from_run(hashed)) as s:
        r = post(s.url, "/v1/generate", {"history": hist, "k": 3})
    assert r.status_code == 200, r.text
    assert [i["item_id"] for i in r.json()["items"]] == [i["item_id"] for i in api(hashed, hist, k=3)]


def test_resume_of_a_hashed_run_equals_an_uninterrupted_one(tmp_path):
    tc = lambda e: TrainConfig(epochs=e, batch_size=64, num_negatives=16, seed=5, early_stopping_patience=99)  # noqa: E731
    small = dict(max_seq_len=20, embedding_dim=16, d_qk=16, d_v=16)
    sp = DataSpec("ml-1m", str(need(ML1M)), max_users=100)
    fit(tmp_path / "a", model_config_from_preset("small", **small, **HASHED), tc(2), sp, progress=False)
    fit(tmp_path / "b", model_config_from_preset("small", **small, **HASHED), tc(1), sp, progress=False)
    fit(tmp_path / "b", model_config_from_preset("small", **small, **HASHED), tc(2), sp, resume=True, progress=False)
    wa, wb = (load_file(str(tmp_path / r / "last.safetensors")) for r in "ab")
    assert {k for k in wa if k.startswith("model.item_emb.")} == {f"model.item_emb.shards.{s}" for s in range(4)}
    assert any(k.startswith("optim.") for k in wa)
    for k in wa:
        if k.startswith("model."):
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_distributed_training_refuses_a_hashed_table(tmp_path):
    pytest.importorskip("torchrec")
    from hstu.train.distributed import fit_distributed

    with pytest.raises(ValueError, match="item_table = 'hashed'.*without --distributed"):
        fit_distributed(tmp_path / "d", hashed_cfg(), TrainConfig(epochs=1), spec())


def test_approximate_candidates_from_a_flat_index_change_no_answer(runs, capsys):
    """``--ann Flat`` (faiss's exhaustive inner-product index: its candidates are the exact
    neighbours) on the hashed run: hstu generate and /v1/generate answer the exact items, and the
    index is built once into RUN/ann/ and reused."""
    pytest.importorskip("faiss")
    pytest.importorskip("fastapi")
    from serving import post, serve

    from hstu.generate.recommend import Recommender

    hashed, _ = runs
    exact = cli_json(capsys, "generate", "--run", hashed, "--user", USER, "-k", 5, "--json")["items"]
    approx = cli_json(capsys, "generate", "--run", hashed, "--user", USER, "-k", 5, "--json", "--ann", "Flat", "--ann-candidates", 8)[
        "items"
    ]
    assert [i["item_id"] for i in approx] == [i["item_id"] for i in exact]
    built = sorted((hashed / "ann").glob("*.faiss"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    hist = history(USER)[-30:]
    with serve(Recommender.from_run(hashed), ann="Flat", ann_candidates=8) as s:
        r = post(s.url, "/v1/generate", {"history": hist, "k": 3})
    assert r.status_code == 200, r.text
    assert [i["item_id"] for i in r.json()["items"]] == [i["item_id"] for i in api(hashed, hist, k=3)]
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    from hstu.cli import main

    assert main(["generate", "--run", str(hashed), "--all-users", "--out", str(hashed / "x.jsonl"), "--ann", "Flat"]) == 2
    assert "--ann: the batch job (--all-users) picks exactly" in capsys.readouterr().err and not (hashed / "x.jsonl").exists()


def test_export_refuses_a_hashed_table_in_one_line(runs, capsys, tmp_path):
    """A trial's finding: `hstu export --format pt2|onnx` of a hashed run failed after a page of torch.export trace."""
    from hstu.cli import main

    hashed, _ = runs
    for fmt in ("pt2", "onnx"):
        assert main(["export", "--run", str(hashed), "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
        err = capsys.readouterr().err
        assert "has a hashed item table (item_table = 'hashed'): not exportable as ONNX / pt2" in err and err.count("\n") == 1
        assert not (tmp_path / fmt).exists()
