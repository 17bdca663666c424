"""Side features (issue 21, item 4): quantile buckets from the training events, categorical maps,
the model input they change, and a feature that alone predicts the next item being learned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hstu.config import ModelConfig, TrainConfig, data_spec_from_table
from hstu.data import load_dataset
from hstu.data.features import FeatureMaps, bucketise, parse_feature_options, quantile_edges
from hstu.data.prepare import DataSpec, model_config_for, prepare_data
from hstu.model.hstu import build_hstu

COLUMNS = "user=user,item=item,time=ts"


def _write(path, rows, header="user,item,ts,price,brand"):
    path.write_text(header + "\n" + "".join(",".join("" if v is None else str(v) for v in r) + "\n" for r in rows))
    return path


def test_quantile_buckets_by_hand():
    train = np.array([1.0, 2.0, 3.0, 4.0, np.nan, 5.0, 6.0, 7.0, 8.0])
    edges = quantile_edges(train, 4)  # quartiles of 1..8 (NaN left out), linear interpolation: 2.75, 4.5, 6.25
    assert edges.tolist() == [2.75, 4.5, 6.25]
    got = bucketise(np.array([np.nan, -1.0, 2.75, 3.0, 4.5, 6.0, 6.25, 100.0]), edges)
    # NaN -> 0; below the first edge -> 1; an edge itself opens the next bucket; above the top edge -> last (4)
    assert got.tolist() == [0, 1, 2, 2, 3, 3, 4, 4]
    assert quantile_edges(np.array([5.0, 5.0, 5.0]), 10).tolist() == [5.0]  # repeated edges dropped: 2 buckets
    assert quantile_edges(np.array([np.nan]), 3).tolist() == []


def test_options_parse_and_errors():
    assert parse_feature_options("brand, color", "price:10,weight:3") == (["brand", "color"], {"price": 10, "weight": 3})
    assert parse_feature_options(["brand"], {"price": 4}) == (["brand"], {"price": 4})
    with pytest.raises(ValueError, match=r"numeric_features.price: the number of buckets must be an integer in 2..10000, got 'x'"):
        parse_feature_options(None, "price:x")
    with pytest.raises(ValueError, match=r"\['price'\] given twice"):
        parse_feature_options(["price"], {"price": 3})
    spec = data_spec_from_table({"dataset": "csv", "features": ["brand"], "numeric_features": {"price": 10}}, "cfg.toml [data]")
    assert spec.options == {"features": ["brand"], "numeric_features": {"price": 10}}


def test_edges_from_training_events_only(tmp_path, caplog):
    # 2 users x 4 events (clean split: events 3, 4 of each user are valid / test); test prices are huge
    rows = []
    for u in (1, 2):
        for j, price in enumerate([10 * u, 10 * u + 1, 10 * u + 2, 1000 * u]):
            rows.append((u, j + 1, j, price, "acme" if j % 2 else " zeta "))
    rows.append((2, 9, 9, None, None))  # missing price and brand: unknown (0); user 2 now has 5 events
    path = _write(tmp_path / "log.csv", rows)
    spec = DataSpec("csv", str(path), options={"columns": COLUMNS, "features": "brand", "numeric_features": "price:3"})
    log_, split = prepare_data(spec)
    train_prices = [10, 11, 20, 21, 22]  # user 1: 2 training events; user 2: 3 (the others held out)
    # sorted 10, 11, 20, 21, 22; the 1/3 quantile at rank 4/3 (11 + 1/3 * 9 = 14), the 2/3 at 8/3 (20 + 2/3 * 1)
    edges = np.array([14.0, 20 + 2 / 3])
    assert sorted(train_prices) == [10, 11, 20, 21, 22]
    brand_map, price_map = log_.feature_maps  # categorical features first, then numeric ones
    assert brand_map == {"name": "brand", "kind": "categorical", "values": ["acme", "zeta"]}  # trimmed, ascending
    assert price_map["name"] == "price" and price_map["buckets"] == 3
    assert np.allclose(price_map["edges"], edges)  # the held-out prices (1000, 2000) do not move them
    # token columns: [category, brand, price bucket]; expected by hand per event, in time order
    want_price = bucketise(np.array([10, 11, 12, 1000, 20, 21, 22, 2000, np.nan]), edges)
    assert want_price.tolist() == [1, 1, 1, 3, 2, 3, 3, 3, 0]
    assert log_.features[:, 2].tolist() == want_price.tolist()  # missing -> 0, above the top edge -> the last bucket
    assert log_.features[:, 1].tolist() == [2, 1, 2, 1, 2, 1, 2, 1, 0]
    assert log_.features[:, 0].tolist() == log_.categories.tolist()
    assert model_config_for(log_, ModelConfig(), True).features == {"brand": 2, "price": 3}
    with caplog.at_level("WARNING", logger="hstu.data.prepare"):  # a config's num_items gives way to the data's, said aloud
        assert model_config_for(log_, ModelConfig(num_items=7), False).num_items == log_.num_items != 7
        assert model_config_for(log_, ModelConfig(num_items=log_.num_items), False).num_items == log_.num_items
        n = model_config_for(log_, ModelConfig(num_actions=7, num_categories=log_.num_categories), True).num_actions
        assert n == (log_.num_actions if log_.num_actions > 1 else 0) != 7  # a trial's: replaced without a word
        mc = ModelConfig(num_categories=log_.num_categories, features={"brand": 5})  # another trial's: silent too
        assert model_config_for(log_, mc, True).features == {"brand": 2, "price": 3}
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        f"{log_.num_items} items in the data; [model] num_items = 7 is replaced by it",
        f"the data gives num_actions = {n}; [model] num_actions = 7 is replaced by it",
        "the data's side features are {'brand': 2, 'price': 3}; [model] features = {'brand': 5} is replaced by them",
    ]
    fm = FeatureMaps(log_.feature_maps)
    assert fm.encode("price", [None, 10.0, 1e9], "history[{i}].features").tolist() == [0, 1, 3]
    assert fm.names == ["brand", "price"]
    assert fm.encode("brand", ["zeta", "nope", None], "history[{i}].features").tolist() == [2, 0, 0]
    with pytest.raises(ValueError, match=r"history\[1\].features: feature 'price' is numeric"):
        fm.encode("price", [1.0, "cheap"], "history[{i}].features")
    with pytest.raises(KeyError, match=r"unknown feature 'colour'; this run's: \['brand', 'price'\]"):
        fm.encode("colour", [1], "history[{i}].features")
    plain = load_dataset("csv", str(path), columns=COLUMNS)
    assert plain.features is None and plain.token_categories.ndim == 1


def test_feature_changes_the_model_input():
    cfg = ModelConfig(num_items=5, max_seq_len=4, embedding_dim=8, num_blocks=1, d_qk=8, d_v=8, dropout=0.0, num_categories=2)
    cfg.features = {"price": 3, "brand": 2}
    torch.manual_seed(0)
    m = build_hstu(cfg).eval()
    ids, pos = torch.tensor([[1, 2]]), torch.tensor([[0, 1]])
    a = torch.tensor([[[1, 1, 2], [2, 3, 1]]])
    b = a.clone()
    b[0, 1, 1] = 2  # only the second event's price bucket differs
    xa, xb = m.embed(ids, pos, None, a), m.embed(ids, pos, None, b)
    assert torch.equal(xa[0, 0], xb[0, 0])
    diff = xb[0, 1] - xa[0, 1]
    assert torch.allclose(diff, m.feature_emb[0].weight[2] - m.feature_emb[0].weight[3], atol=1e-6)  # by its table rows
    assert diff.abs().max() > 0
    zero = a.clone()
    zero[..., 1:] = 0  # unknown features add nothing: the category-only input
    assert torch.allclose(m.embed(ids, pos, None, zero), m.embed(ids, pos, None, a[..., 0]))
    out_a = m.encode(ids, torch.tensor([[1, 2]]), torch.tensor([2]), categories=a)
    out_b = m.encode(ids, torch.tensor([[1, 2]]), torch.tensor([2]), categories=b)
    assert not torch.allclose(out_a[0, 1], out_b[0, 1])


def _synthetic(path, users=300, length=16, items=40, buckets=8, seed=0, brands=("x",)):
    """Each event's price is uniform in [0, 100); the next item is one of the 5 items of the current
    event's price bucket (equal-width buckets = the quantiles of a uniform price); items carry no signal.
    The brand is drawn from ``brands`` (no signal)."""
    rng = np.random.default_rng(seed)
    per = items // buckets
    rows = []
    for u in range(users):
        price = rng.uniform(0, 100, length)
        item = [int(rng.integers(1, items + 1))]
        for t in range(1, length):
            b = min(int(price[t - 1] // (100 / buckets)), buckets - 1)
            item.append(b * per + int(rng.integers(1, per + 1)))
        rows += [(u, item[t], 1_000_000 + 60 * t, round(float(price[t]), 3), brands[int(rng.integers(len(brands)))]) for t in range(length)]
    return _write(path, rows)


def test_model_learns_a_feature_that_alone_predicts_the_next_item(tmp_path):
    from hstu.train.loop import fit

    path = _synthetic(tmp_path / "synthetic.csv")
    mcfg = dict(max_seq_len=16, embedding_dim=24, num_blocks=1, num_heads=1, d_qk=24, d_v=24, dropout=0.0)
    tcfg = dict(epochs=6, batch_size=32, num_negatives=32, learning_rate=5e-3)
    hr = {}
    for name, opts in (("with", {"numeric_features": {"price": 8}}), ("without", {})):
        spec = DataSpec("csv", str(path), options={"columns": COLUMNS, **opts}, exclude_history=False)
        torch.manual_seed(0)
        m = fit(tmp_path / name, ModelConfig(**mcfg), TrainConfig(**tcfg), spec, progress=False)
        hr[name] = m["test"]["HR@10"]
    # with the price bucket the target is one of 5 items (HR@10 can reach 1); without it any of the 40 (about 10 / 40)
    assert hr["with"] > 0.6, hr
    assert hr["without"] < 0.4, hr
    assert hr["with"] > hr["without"] + 0.3, hr


def test_round_trip_eval_generate_api_http(tmp_path, capsys):
    """One run trained with a numeric and a categorical feature: the CLI eval reproduces the training
    report, and the CLI generate, the Python API and HTTP give the same items for a history with
    feature values, equal to the top item of the model scored directly on the load-time token columns."""
    import json

    import httpx
    from serving import LiveServer

    from hstu.cli import _run_data, main
    from hstu.config import ServeConfig
    from hstu.generate.batch import history_of
    from hstu.generate.recommend import History, HistoryError, Recommender
    from hstu.serve.app import ServePolicy, create_app

    path = _synthetic(tmp_path / "s.csv", users=40, length=10, brands=("acme", "zeta", "nova"))
    (tmp_path / "c.toml").write_text(
        "[model]\nmax_seq_len = 10\nembedding_dim = 16\nnum_blocks = 1\nnum_heads = 1\nd_qk = 16\nd_v = 16\nmax_output_len = 5\n"
        "[train]\nepochs = 2\nbatch_size = 16\nnum_negatives = 16\n"
        f'[data]\ndataset = "csv"\ndata_dir = "{path}"\ncolumns = "{COLUMNS}"\nnumeric_features = {{price = 8}}\n'
    )
    run = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--feature", "brand", "--out", str(run), "--quiet"]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["features"] == {"brand": 3, "price": 8}
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--split", "test", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = json.loads((run / "metrics.json").read_text())["test"]
    assert got["HR@10"] == want["HR@10"] and got["MRR"] == pytest.approx(want["MRR"], abs=1e-9)

    log_ = _run_data(cfg)[0]
    stored = json.loads((run / "idmap.json").read_text())["features"]
    assert cfg["data"]["feature_maps"] == stored == log_.feature_maps
    # another protocol's training events would give other edges; the run's stored maps are used instead
    paper = prepare_data(DataSpec(**{**cfg["data"], "protocol": "paper"}))[0]
    fresh = prepare_data(DataSpec(**{**cfg["data"], "protocol": "paper", "feature_maps": None}))[0]
    assert paper.feature_maps == stored and np.array_equal(paper.features, log_.features)
    assert fresh.feature_maps[1]["edges"] != stored[1]["edges"]
    with pytest.raises(ValueError, match=r"the run's side features \['brand'\] are not the data's \['brand', 'price'\]"):
        prepare_data(DataSpec(**{**cfg["data"], "feature_maps": stored[:1]}))
    user = int(log_.users[3])
    hist = history_of(log_, user)
    assert hist.features[0].keys() == {"brand", "price"}
    rec = Recommender.from_run(run)
    prep = rec.prepare(hist)
    u = log_.user_index(user)
    s, e = log_.offsets[u], log_.offsets[u + 1]
    assert np.array_equal(prep.categories, log_.features[s:e])  # served values bucketised as at load
    api = [it["item_id"] for it in rec.recommend([prep], 5)[0]]

    # the model scored directly on the load-time token columns (no engine, no id maps)
    m = rec.model
    ids = torch.from_numpy(log_.items[s:e]).view(1, -1)
    ts = torch.from_numpy(np.append(log_.timestamps[s:e], log_.timestamps[e - 1])).view(1, -1)
    cats = torch.from_numpy(np.concatenate([log_.features[s:e], np.zeros((1, 3), np.int64)])).unsqueeze(0)
    with torch.no_grad():
        seq = m.encode(torch.cat([ids, torch.zeros(1, 1, dtype=torch.int64)], 1), ts, torch.tensor([e - s]), categories=cats)
        scores = m.score_items(m.last_rows(seq, torch.tensor([e - s])), torch.arange(1, m.cfg.num_items + 1).view(1, -1))[0]
    if rec.untrained_np is not None:
        scores[torch.from_numpy(rec.untrained_np[1:])] = -float("inf")
    assert api[0] == int(log_.item_raw_ids[1 + int(scores.argmax())])

    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--user", str(user), "-k", "5", "--json"]) == 0
    assert [it["item_id"] for it in json.loads(capsys.readouterr().out)["items"]] == api
    hfile = tmp_path / "h.json"
    hfile.write_text(
        json.dumps([{"item_id": i, "timestamp": t, "features": f} for i, t, f in zip(hist.items, hist.timestamps, hist.features)])
    )
    assert main(["generate", "--run", str(run), "--history", str(hfile), "-k", "5", "--json"]) == 0
    assert [it["item_id"] for it in json.loads(capsys.readouterr().out)["items"]] == api

    # the features matter: without them (each item's last training values) or unknown, the input differs
    plain = rec.prepare(History(hist.items, hist.timestamps))
    unknown = rec.prepare(History(hist.items, hist.timestamps, features=[{"price": None, "brand": None}] * len(hist.items)))
    assert np.array_equal(plain.categories, rec.item_tokens_np[prep.ids]) and (unknown.categories[:, 1:] == 0).all()
    assert not np.array_equal(plain.categories, prep.categories)
    odd = rec.prepare(History(hist.items, hist.timestamps, features=[{"brand": "no-such-brand"}] * len(hist.items)))
    col = 1 + rec.features.names.index("brand")  # a value the run never saw reads as none, and says so (a trial: silent)
    assert (odd.categories[:, col] == 0).all() and not any("features." in w for w in prep.warnings)
    assert any(w.startswith("features.brand: unknown value(s) ['no-such-brand']") for w in odd.warnings), odd.warnings
    with pytest.raises(HistoryError, match=r"^history\[2\]\.features\.colour: unknown feature 'colour'"):
        rec.prepare(History(hist.items[:3], hist.timestamps[:3], features=[None, None, {"colour": "red"}]))

    events = [{"item_id": i, "timestamp": t, "features": f} for i, t, f in zip(hist.items, hist.timestamps, hist.features)]
    app = create_app(ServeConfig(buckets=[10]), rec, policy=ServePolicy(warmup=False))
    with LiveServer(app) as srv:
        r = httpx.post(srv.url + "/v1/generate", json={"history": events, "k": 5}, timeout=30)
        assert r.status_code == 200, r.text
        assert [it["item_id"] for it in r.json()["items"]] == api
        bad = [dict(ev) for ev in events]
        bad[1] = {**bad[1], "features": {"colour": "red"}}
        r = httpx.post(srv.url + "/v1/generate", json={"history": bad, "k": 5}, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["field"] == "history[1].features.colour", r.text
        bad[1] = {**bad[1], "features": {"price": "cheap"}}
        r = httpx.post(srv.url + "/v1/generate", json={"history": bad, "k": 5}, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["field"] == "history[1].features.price", r.text


def test_feature_columns_from_parquet_and_a_headerless_file(tmp_path):
    import pandas as pd

    rows = [(1, 10, 0, 5.0, "a"), (1, 11, 1, 7.0, "b"), (1, 12, 2, None, "a"), (2, 10, 0, 9.0, None), (2, 13, 1, 1.0, "c")]
    df = pd.DataFrame(rows, columns=["user", "item", "ts", "price", "brand"])
    df.to_parquet(tmp_path / "log.parquet")
    (tmp_path / "log.tsv").write_text("".join("\t".join("" if v is None else str(v) for v in r) + "\n" for r in rows))
    a = load_dataset("csv", str(tmp_path / "log.parquet"), columns=COLUMNS, features=["brand"], numeric_features={"price": 2})
    b = load_dataset(
        "csv", str(tmp_path / "log.tsv"), columns="user=0,item=1,time=2", format="header=none", features="4", numeric_features="3:2"
    )
    for log_, (brand, price) in ((a, ("brand", "price")), (b, ("4", "3"))):
        assert list(log_.feature_raw) == [brand, price] and log_.feature_buckets == {price: 2}
        assert log_.feature_raw[brand].tolist() == ["a", "b", "a", None, "c"]  # per user, in time order
        assert np.array_equal(log_.feature_raw[price], [5.0, 7.0, np.nan, 9.0, 1.0], equal_nan=True)
