"""Item metadata for any data set (issue 21, item 6): ``hstu train --items FILE`` copies an items
file's columns into the run (idmap.json ``item_meta``, titles), ``hstu generate`` shows them and the
HTTP API returns them on each recommendation (``meta``); a bad file is named with its line."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import tiny_csv_flags
from serving import post, serve

from hstu.cli import main
from hstu.data.errors import DataFormatError
from hstu.data.items import read_item_meta
from hstu.data.sequences import EventLog
from hstu.generate.recommend import History, Recommender


def int_log() -> EventLog:
    df = pd.DataFrame({"user_id": [1, 1, 2, 2], "item_id": [10, 20, 20, 30], "timestamp": [1, 2, 1, 2]})
    return EventLog.from_frame(df, name="t")


def test_csv_tsv_parquet_rows_of_known_items(tmp_path):
    log_ = int_log()
    (tmp_path / "items.csv").write_text('item_id,title,category\n10,"Heat, 1995",Crime\n20,Up,\n99,Not in data,X\n')
    want = {"10": {"title": "Heat, 1995", "category": "Crime"}, "20": {"title": "Up", "category": None}}
    assert read_item_meta(tmp_path / "items.csv", log_) == want  # 99 is not an item of the data: ignored
    (tmp_path / "items.tsv").write_text("ID\ttitle\tcategory\n 10 \tHeat, 1995\tCrime\n20\tUp\t\n")
    assert read_item_meta(tmp_path / "items.tsv", log_) == want  # id column by any case; the id trimmed
    pd.DataFrame({"item": [30, 10], "price": [9.5, float("nan")], "stock": [3, 0]}).to_parquet(tmp_path / "items.parquet")
    assert read_item_meta(tmp_path / "items.parquet", log_) == {"30": {"price": 9.5, "stock": 3}, "10": {"price": None, "stock": 0}}


def test_text_ids_follow_the_data_sets_rule(tmp_path):
    df = pd.DataFrame({"user_id": ["a", "a"], "item_id": ["SKU-1", "sku-1"], "timestamp": [1, 2]})
    log_ = EventLog.from_frame(df, name="t")
    (tmp_path / "i.csv").write_text("item_id,title\n SKU-1 ,upper\nsku-1,lower\n")
    assert read_item_meta(tmp_path / "i.csv", log_) == {"SKU-1": {"title": "upper"}, "sku-1": {"title": "lower"}}


@pytest.mark.parametrize(
    "text,message",
    [
        ("name,title\n10,x\n", r"i.csv: no id column: expected one of \['item_id', 'item', 'id'\], got columns \['name', 'title'\]"),
        ("item_id,title\n10,x\nabc,y\n", r"i.csv:3: column 'item_id': not an integer id: 'abc' \(this run's ids are integers\)"),
        ("item_id,title\n10,x\n20,y\n10,z\n", r"i.csv:4: column 'item_id': item 10 repeats line 2"),
        ("item_id,title\n10,x\n,y\n", r"i.csv:3: column 'item_id': not an integer id"),
        ('item_id,title\n10,"x\n', r"i.csv: cannot read the items file"),
    ],
)
def test_bad_files_are_named_with_the_line(tmp_path, text, message):
    (tmp_path / "i.csv").write_text(text)
    with pytest.raises(DataFormatError, match=message):
        read_item_meta(tmp_path / "i.csv", int_log())


def test_missing_or_unknown_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="--items .*nope.csv: not found"):
        read_item_meta(tmp_path / "nope.csv", int_log())
    (tmp_path / "i.json").write_text("{}")
    with pytest.raises(DataFormatError, match=r"i.json: unknown items file type '.json'; valid: .csv, .tsv, .tab, .parquet"):
        read_item_meta(tmp_path / "i.json", int_log())


@pytest.fixture(scope="module")
def meta_run(tmp_path_factory):
    """A tiny CSV run (items 1..20) trained with an items file: titles and a genre for every item."""
    d = tmp_path_factory.mktemp("meta")
    rows = "".join(f"{i},Item {i},{'odd' if i % 2 else 'even'}\n" for i in range(1, 21))
    (d / "items.csv").write_text("item,title,genre\n" + rows)
    assert main(["train", *tiny_csv_flags(d), "--epochs", "1", "--items", str(d / "items.csv"), "--out", str(d / "run"), "--quiet"]) == 0
    return d


def genre(i: int) -> str:
    return "odd" if i % 2 else "even"


def test_the_run_keeps_the_metadata_and_generate_shows_it(meta_run, capsys):
    d = meta_run
    ids = json.loads((d / "run" / "idmap.json").read_text())
    assert ids["item_meta"]["7"] == {"title": "Item 7", "genre": "odd"} and ids["titles"]["7"] == "Item 7"
    hist = [{"item_id": i, "timestamp": 1000 + j} for j, i in enumerate((3, 4, 5))]
    (d / "h.json").write_text(json.dumps(hist))
    assert main(["generate", "--run", str(d / "run"), "--history", str(d / "h.json"), "-k", "4", "--json"]) == 0
    items = json.loads(capsys.readouterr().out)["items"]
    assert all(it["title"] == f"Item {it['item_id']}" and it["meta"]["genre"] == genre(it["item_id"]) for it in items)
    assert main(["generate", "--run", str(d / "run"), "--history", str(d / "h.json"), "-k", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[1:4:2] for ln in lines] == [[str(it["item_id"]), str(it["item_id"])] for it in items]  # "1. ID  Item ID"
    assert all(f"genre={genre(it['item_id'])}" in ln for ln, it in zip(lines, items))


def test_http_returns_the_metadata(meta_run):
    rec = Recommender.from_run(meta_run / "run")
    direct = rec.recommend([rec.prepare(History([3, 4, 5], [1, 2, 3]))], 4)[0]
    with serve(rec, buckets=(8,), max_batch=4) as s:
        r = post(s.url, "/v1/generate", {"history": [{"item_id": i, "timestamp": t} for i, t in ((3, 1), (4, 2), (5, 3))], "k": 4})
        assert r.status_code == 200, r.text
        got = r.json()["items"]
    assert [x["meta"] for x in got] == [x["meta"] for x in direct]
    assert all(x["meta"] == {"title": f"Item {x['item_id']}", "genre": genre(x["item_id"])} for x in got)


def test_a_bad_items_file_fails_the_training_before_anything_is_written(tmp_path, capsys):
    (tmp_path / "items.csv").write_text("item_id,title\n1,a\n1,b\n")
    out = tmp_path / "run"
    assert main(["train", *tiny_csv_flags(tmp_path), "--epochs", "1", "--items", str(tmp_path / "items.csv"), "--out", str(out)]) == 2
    assert "items.csv:3: column 'item_id': item 1 repeats line 2" in capsys.readouterr().err
    assert not (out / "config.json").exists()
