"""Text user and item ids end to end (issue 21, item 3): EventLog, idmap.json, train -> eval ->
generate (--user, --history, --all-users) -> Python API -> HTTP.

The independent check: the same tiny log once with integer ids and once with text ids that sort
in the same order ("SKU-007" for item 7, " u-07 " for user 7, spaces trimmed) gives the same dense
ids, so the two trainings (same seed) are the same model: every metric and every recommendation of
the text run must be the integer run's, mapped id for id.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TINY_MODEL
from serving import post, serve

from hstu.cli import main
from hstu.data.sequences import EventLog, IdIndex, as_ids
from hstu.generate.recommend import History, HistoryError, Recommender
from hstu.model.run_files import check_idmap
from hstu.runs import make_idmap, read_idmap


def sku(i: int) -> str:
    return f"SKU-{i:03d}"


def user(u: int) -> str:
    return f"u-{u:02d}"


def int_frame() -> pd.DataFrame:
    rows = [(u, (u * 3 + j) % 20 + 1, 1000 + j) for u in range(1, 31) for j in range(8)]
    return pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"])


def text_frame() -> pd.DataFrame:
    df = int_frame()
    return df.assign(user_id=[f" {user(u)} " for u in df.user_id], item_id=[f"  {sku(i)}\t" for i in df.item_id])


def test_event_log_keeps_text_ids_trimmed_case_kept():
    df = pd.DataFrame({"user_id": [" A ", "b", "a", " A"], "item_id": ["SKU-1 ", "sku-1", " SKU-1", "x"], "timestamp": [3, 1, 2, 1]})
    log_ = EventLog.from_frame(df, name="t")
    assert log_.users.tolist() == ["A", "a", "b"]  # " A " and " A" are one user; "a" another (case kept)
    assert log_.item_raw_ids.tolist() == ["", "SKU-1", "sku-1", "x"]  # "" = the padding row
    assert log_.offsets.tolist() == [0, 2, 3, 4]
    assert log_.items.tolist() == [3, 1, 1, 2]  # user A: x at t=1, SKU-1 at t=3; a: SKU-1; b: sku-1
    assert log_.user_index("  b ") == 2 and log_.user_id(" A") == "A"
    assert log_.item_dense([" sku-1", "SKU-1", "nope", "x"]).tolist() == [2, 1, 0, 3]
    with pytest.raises(KeyError, match="unknown user id 'B'"):
        log_.user_index("B")
    with pytest.raises(ValueError, match=r"item_id\[0\]: a boolean is not an id"):
        log_.item_dense([True])


def test_bad_text_ids_are_refused_naming_the_row():
    df = pd.DataFrame({"user_id": ["a", "b"], "item_id": ["x", "  "], "timestamp": [1, 2]})
    with pytest.raises(ValueError, match=r"t: item_id row\[1\]: an id must be 1..256 characters"):
        EventLog.from_frame(df, name="t")
    with pytest.raises(ValueError, match="booleans"):
        EventLog.from_frame(pd.DataFrame({"user_id": [True], "item_id": [1], "timestamp": [1]}), name="t")


def test_integer_ids_stay_int64_and_lookups_take_either_form():
    log_ = EventLog.from_frame(int_frame(), name="i")
    assert log_.users.dtype == np.int64 and log_.item_raw_ids.dtype == np.int64 and log_.item_raw_ids[0] == 0
    assert log_.item_dense(["7", 7, 99]).tolist() == [7, 7, 0]
    assert log_.user_index("5") == 4
    with pytest.raises(KeyError, match="unknown user id 'abc'"):
        log_.user_index("abc")
    assert IdIndex(["", "b", "a"]).dense([1, "a", " b "]).tolist() == [0, 2, 1]  # an int given to a text map is its text
    with pytest.raises(ValueError, match=r"history\[1\]\.item_id: not an integer id"):
        as_ids([1, "x"], text=False, where="history[{i}].item_id")
    assert as_ids([" 7 ", "+7", "-3"], text=False).tolist() == [7, 7, -3]
    for bad in ("1_097", "\u0661\u0660\u0669\u0667", "\uff11\uff10\uff19\uff17", "7.0", "0x10"):  # what int() would also read
        with pytest.raises(ValueError, match="not an integer id"):
            as_ids([bad], text=False)
    with pytest.raises(ValueError, match=r"id\[0\]: integer id '99999999999999999999999' is outside int64"):  # not "not an integer"
        as_ids(["99999999999999999999999"], text=False)


def test_idmap_holds_text_ids_as_json_strings():
    log_ = EventLog.from_frame(text_frame(), name="t")
    ids = json.loads(json.dumps(make_idmap(log_)))
    assert ids["item_raw_ids"][:3] == ["", "SKU-001", "SKU-002"] and ids["user_ids"] == "text"
    check_idmap("idmap.json", ids)
    with pytest.raises(ValueError, match="item_raw_ids must be"):
        check_idmap("idmap.json", {**ids, "item_raw_ids": ["SKU-001", "SKU-002"]})  # no padding entry
    with pytest.raises(ValueError, match="item_raw_ids must be"):
        check_idmap("idmap.json", {**ids, "item_raw_ids": [0, "SKU-001"]})  # mixed kinds
    old = make_idmap(EventLog.from_frame(int_frame(), name="i"))
    assert check_idmap("idmap.json", json.loads(json.dumps(old)))["item_raw_ids"][:3] == [0, 1, 2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(text run dir, int run dir, the tmp dir): the same tiny training with text and integer ids.
    The data is the frame given to EventLog.from_frame (the loader is replaced; H1's loaders emit
    text columns the same way)."""
    d = tmp_path_factory.mktemp("text_ids")
    (d / "tiny.toml").write_text(
        "[model]\n" + "".join(f"{k} = {v}\n" for k, v in TINY_MODEL.items()) + "[train]\nbatch_size = 8\nnum_negatives = 4\n"
    )
    mp = pytest.MonkeyPatch()
    frames = {"text": text_frame(), "int": int_frame()}
    mp.setattr("hstu.data.prepare.load_dataset", lambda name, data_dir, **kw: EventLog.from_frame(frames[Path(data_dir).name], name="csv"))
    for kind in frames:
        (d / kind).mkdir()
        flags = ["--dataset", "csv", "--data-dir", str(d / kind), "--config", str(d / "tiny.toml"), "--epochs", "2", "--seed", "3"]
        assert main(["train", *flags, "--out", str(d / f"run_{kind}"), "--quiet"]) == 0
    yield d / "run_text", d / "run_int", d
    mp.undo()


def test_train_and_eval_match_the_integer_run(runs, capsys):
    text, ints, _ = runs
    assert read_idmap(text)["item_raw_ids"][1:] == [sku(i) for i in range(1, 21)]
    mt, mi = (json.loads((r / "metrics.json").read_text()) for r in (text, ints))
    assert mt["test"] == mi["test"] and mt["valid"] == mi["valid"]
    outs = []
    for r in (text, ints):
        assert main(["eval", "--run", str(r), "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]


def _generate(capsys, *argv) -> dict:
    assert main(["generate", *argv, "-k", "5", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_cli_user_and_history_file(runs, capsys):
    text, ints, d = runs
    got = _generate(capsys, "--run", str(text), "--user", "  u-07 ")
    want = _generate(capsys, "--run", str(ints), "--user", "7")
    assert got["user"] == "u-07" and want["user"] == 7
    assert [it["item_id"] for it in got["items"]] == [sku(it["item_id"]) for it in want["items"]]
    assert [it["score"] for it in got["items"]] == [it["score"] for it in want["items"]]
    hist = [{"item_id": f" {sku(i)}", "timestamp": 1000 + j} for j, i in enumerate((3, 9, 14))]
    (d / "h.json").write_text(json.dumps(hist))
    (d / "hi.json").write_text(json.dumps([{**e, "item_id": int(e["item_id"].strip()[4:])} for e in hist]))
    got = _generate(capsys, "--run", str(text), "--history", str(d / "h.json"))
    want = _generate(capsys, "--run", str(ints), "--history", str(d / "hi.json"))
    assert [it["item_id"] for it in got["items"]] == [sku(it["item_id"]) for it in want["items"]]
    assert main(["generate", "--run", str(text), "--user", "u-99"]) == 2
    assert "unknown user id 'u-99'" in capsys.readouterr().err


def test_all_users_output_has_text_columns(runs):
    text, ints, d = runs
    for r in (text, ints):
        out = str(d / f"{r.name}.parquet")
        assert main(["generate", "--run", str(r), "--all-users", "--out", out, "-k", "3", "--batch-users", "8"]) == 0
    t, i = (pd.read_parquet(d / f"{r.name}.parquet") for r in (text, ints))
    assert t.user_id.tolist() == [user(u) for u in i.user_id] and t.item_id.tolist() == [sku(x) for x in i.item_id]
    assert pd.api.types.is_string_dtype(t.item_id) and pd.api.types.is_string_dtype(t.user_id) and i.item_id.dtype == np.int64
    np.testing.assert_array_equal(t.score.to_numpy(), i.score.to_numpy())


def test_api_and_http_take_text_ids(runs):
    text, ints, _ = runs
    rt, ri = Recommender.from_run(text), Recommender.from_run(ints)
    prep = rt.prepare(History([sku(4), " SKU-011 ", "nope"], [1, 2, 3]))
    assert prep.warnings == ["dropped 1 event(s) with unknown item ids: 'nope'"]  # named (a fresh-user finding)
    got = rt.recommend([prep], 4)[0]
    want = ri.recommend([ri.prepare(History([4, 11], [1, 2]))], 4)[0]
    assert [x["item_id"] for x in got] == [sku(x["item_id"]) for x in want]
    with pytest.raises(HistoryError, match=r"history\[0\]\.item_id: a boolean is not an id"):
        rt.prepare(History([True], [1]))
    with pytest.raises(HistoryError, match=r"history\[0\]\.item_id: a boolean is not an id"):
        ri.prepare(History([True], [1]))
    with pytest.raises(HistoryError, match="unknown item id nope"):
        rt.prepare(History(["nope", sku(1)], [1, 2]), unknown="reject")
    with serve(rt, buckets=(8,), max_batch=4) as s:
        body = {"user_id": "u-04", "history": [{"item_id": sku(4), "timestamp": 1}, {"item_id": sku(11), "timestamp": 2}], "k": 4}
        r = post(s.url, "/v1/generate", body)
        assert r.status_code == 200, r.text
        assert [x["item_id"] for x in r.json()["items"]] == [x["item_id"] for x in got]
        r = post(s.url, "/v1/generate", {**body, "exclude": [got[0]["item_id"]]})
        assert got[0]["item_id"] not in [x["item_id"] for x in r.json()["items"]]
        r = post(s.url, "/v1/score", {"history": body["history"], "candidates": [got[0]["item_id"], "nope"]})
        assert r.status_code == 200 and r.json()["scores"][1] is None
        r = post(s.url, "/v1/generate", {**body, "unknown_items": "reject", "history": [{"item_id": "SKU-999", "timestamp": 1}]})
        assert r.status_code == 422 and "SKU-999" in r.json()["error"]["message"]
        assert r.json()["error"]["field"] == "history[0].item_id"
        r = post(s.url, "/v1/generate", {**body, "history": [{"item_id": True, "timestamp": 1}]})
        assert r.status_code == 422 and "boolean" in r.text
