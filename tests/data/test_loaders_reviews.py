"""Amazon reviews (ratings-only CSV, 5-core JSON lines gzip or not, 2014 Python-literal lines, meta)
and one-line-per-user sequence files (order-only), on small files written here."""

from __future__ import annotations

import gzip
import json
import logging

import pytest

from hstu.config import ModelConfig
from hstu.data import DataFormatError, load_dataset
from hstu.data.prepare import DataSpec, model_config_for, prepare_data

# (reviewerID, asin, overall, unixReviewTime), in no particular order; user A has a tie at 200
REVIEWS = [
    ("A1YJEY40YUW4SE", "B00004U9V2", 5.0, 300),
    ("A1YJEY40YUW4SE", "0205616461", 4.0, 200),
    ("A2ZZ", "B00004U9V2", 3.0, 100),
    ("A1YJEY40YUW4SE", "B0000X", 1.0, 200),
]
BY_HAND = {"A1YJEY40YUW4SE": ["0205616461", "B0000X", "B00004U9V2"], "A2ZZ": ["B00004U9V2"]}  # time order, tie in file order


def _seqs(log_) -> dict:
    return {u: log_.item_raw_ids[log_.items[log_.offsets[k] : log_.offsets[k + 1]]].tolist() for k, u in enumerate(log_.users.tolist())}


def _json_lines(rows, literal: bool = False) -> str:
    recs = [{"reviewerID": u, "asin": i, "reviewerName": "x", "overall": r, "unixReviewTime": t, "summary": "ok"} for u, i, r, t in rows]
    return "".join((repr(r) if literal else json.dumps(r)) + "\n" for r in recs)


@pytest.mark.parametrize("kind", ["json", "json.gz", "literal"])
def test_amazon_5core_json_lines(tmp_path, kind):
    text = _json_lines(REVIEWS, literal=kind == "literal")
    p = tmp_path / f"reviews_Beauty_5.{'json.gz' if kind == 'json.gz' else 'json'}"
    p.write_bytes(gzip.compress(text.encode()) if kind == "json.gz" else text.encode())
    log_ = load_dataset("amazon", tmp_path)
    assert _seqs(log_) == BY_HAND
    assert log_.values.tolist() == [4, 1, 5, 3] and log_.timestamps.tolist() == [200, 200, 300, 100]
    assert log_.exclude_history_default is True and log_.facts["format"] == "5-core json lines"


def test_amazon_bad_lines_are_named_and_skipped(tmp_path):
    lines = _json_lines(REVIEWS[:2]).splitlines()
    bad = [lines[0], "{'reviewerID': 'A9', 'asin': ", json.dumps({"reviewerID": "A9", "asin": "B1", "overall": 5.0}), lines[1], ""]
    p = tmp_path / "Beauty_5.json"
    p.write_text("\n".join(bad) + "\n")
    with pytest.raises(DataFormatError, match=r"Beauty_5.json:2: neither JSON nor a Python literal"):
        load_dataset("amazon", p)
    log_ = load_dataset("amazon", p, skip_bad_rows=True)
    assert log_.skipped_rows == 2 and log_.num_events == 2
    p.write_text(bad[2] + "\n")
    with pytest.raises(DataFormatError, match=r"Beauty_5.json:1: missing key\(s\) \['unixReviewTime'\]"):
        load_dataset("amazon", p)
    p.write_text(json.dumps({"reviewerID": "A9", "asin": "B1", "overall": 5.0, "unixReviewTime": "soon"}) + "\n")
    with pytest.raises(DataFormatError, match=r"Beauty_5.json:1: .*not a whole rating / an integer Unix time"):
        load_dataset("amazon", p)
    with pytest.raises(DataFormatError, match="no reviews left after skipping 1"):
        load_dataset("amazon", p, skip_bad_rows=True)


def test_amazon_ratings_csv_equals_the_json_and_reads_meta(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "ratings_Beauty.csv").write_text("".join(f"{u},{i},{r},{t}\n" for u, i, r, t in REVIEWS))
    meta = [
        {"asin": "B00004U9V2", "title": "Crabtree & Evelyn", "categories": [["Beauty", "Skin Care", "Hands & Nails"]]},
        {"asin": "B0000X", "categories": [["Beauty", "Makeup"]], "price": 9.5},
    ]
    (tmp_path / "csv" / "meta_Beauty.json").write_text("".join(repr(m) + "\n" for m in meta) + "not a record\n")
    csv_log = load_dataset("amazon", tmp_path / "csv")
    assert _seqs(csv_log) == BY_HAND and csv_log.facts["format"] == "ratings csv"
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "reviews_Beauty_5.json").write_text(_json_lines(REVIEWS))
    js = load_dataset("amazon", tmp_path / "json", meta=str(tmp_path / "csv" / "meta_Beauty.json"))
    for f in ("offsets", "items", "timestamps"):
        assert getattr(js, f).tolist() == getattr(csv_log, f).tolist(), f
    assert js.users.tolist() == csv_log.users.tolist() and js.item_raw_ids.tolist() == csv_log.item_raw_ids.tolist()
    for log_ in (csv_log, js):
        assert log_.titles == {"B00004U9V2": "Crabtree & Evelyn"}
        assert log_.item_genres == {"B00004U9V2": ["Hands & Nails"], "B0000X": ["Makeup"]}
        cat = dict(zip(log_.item_raw_ids[1:].tolist(), log_.item_category[1:].tolist()))
        assert cat["0205616461"] == 0 and cat["B00004U9V2"] != cat["B0000X"] != 0  # the first genre as category
    with pytest.raises(FileNotFoundError, match="expected one reviews file"):
        (tmp_path / "json" / "other.csv").write_text("a,b,1,2\n")
        load_dataset("amazon", tmp_path / "json")


def test_sequence_file_is_order_only(tmp_path):
    p = tmp_path / "Beauty.txt"
    p.write_text("1 30 10 20\n2 31\t32 30\n\n")
    log_ = load_dataset("sequences", p)
    assert _seqs(log_) == {1: [30, 10, 20], 2: [31, 32, 30]}  # the line order; integer ids stay integers
    assert log_.facts["order_only"] is True and log_.timestamps.tolist() == [0] * 6
    cfg = model_config_for(log_, ModelConfig(max_seq_len=8, max_output_len=2, embedding_dim=16, num_blocks=1, num_heads=2), False)
    assert cfg.use_time_bias is False
    # SASRec's 'user item' per line is the same log; text ids are kept as text
    q = tmp_path / "per_line" / "data.txt"
    q.parent.mkdir()
    q.write_text("1 30\n1 10\n2 31\n2 32\n1 20\n2 30\n")
    one = load_dataset("sequences", q.parent)
    assert _seqs(one) == _seqs(log_)
    q.write_text("u1 B01 b01\nu2 12 B01\n")
    assert _seqs(load_dataset("sequences", q)) == {"u1": ["B01", "b01"], "u2": ["12", "B01"]}
    q.write_text("1 2 3\n7\n2 3 4\n")
    with pytest.raises(DataFormatError, match=r"data.txt:2: user '7' has no items"):
        load_dataset("sequences", q)
    assert load_dataset("sequences", q, skip_bad_rows=True).skipped_rows == 1
    log2, split = prepare_data(DataSpec("sequences", str(p), protocol="paper"))
    assert log2.num_users == 2 and split.test_target.tolist() == [2, 5]


def test_latin1_sequence_file_and_meta(tmp_path):
    p = tmp_path / "seq.txt"
    p.write_bytes("u1 café cafè\n".encode("iso-8859-1"))
    assert _seqs(load_dataset("sequences", p)) == {"u1": ["café", "cafè"]}
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "reviews_X_5.json").write_text(_json_lines(REVIEWS))
    (tmp_path / "r" / "meta_X.json").write_bytes((repr({"asin": "B0000X", "title": "Crème"}) + "\n").encode("iso-8859-1"))
    assert load_dataset("amazon", tmp_path / "r").titles == {"B0000X": "Crème"}


def test_the_skipped_row_count_reads_right(tmp_path, caplog):
    """One skipped line is "1 line", two are "2 lines" (a fresh-user finding: "skipped 1 malformed rows")."""
    q = tmp_path / "data.txt"
    q.write_text("1 2 3\n7\n2 3 4\n")
    with caplog.at_level(logging.WARNING):
        load_dataset("sequences", q, skip_bad_rows=True)
    assert "skipped 1 line without items (first:" in caplog.text
    q.write_text("1 2 3\n7\n8\n2 3 4\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_dataset("sequences", q, skip_bad_rows=True)
    assert "skipped 2 lines without items (first:" in caplog.text
