"""E-commerce loaders: Taobao UserBehavior (real head file), Retailrocket and generic CSV/Parquet
(small files written here), malformed rows named by file and line."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hstu.data import DataFormatError, load_dataset
from hstu.data.ecommerce import LOADERS, load_csv, load_retailrocket, load_taobao, parse_columns
from hstu.data.prepare import DataSpec, prepare_data


# ----------------------------------------------------------------------------- Taobao
def test_taobao_real_head_matches_readme(taobao_csv: Path):
    log_ = load_dataset("taobao", taobao_csv.parent)
    # counts stated in ../shared/data/README.md
    assert log_.num_events == 84_287
    assert log_.num_users == 814
    assert log_.num_items == 55_233
    assert log_.num_categories == 2_911
    assert log_.action_names == ["pv", "cart", "fav", "buy"]
    assert np.bincount(log_.actions, minlength=5)[1:].tolist() == [75_693, 4_494, 2_351, 1_749]
    assert log_.exclude_history_default is False
    assert log_.skipped_rows == 0


def test_taobao_events_equal_a_plain_csv_parse(taobao_csv: Path):
    """Second method: the csv module, grouped by user and stably sorted by time."""
    log_ = load_taobao(taobao_csv)  # the file path works as well as its directory
    rows: dict[int, list] = {}
    with open(taobao_csv, newline="") as fh:
        for r in csv.reader(fh):
            rows.setdefault(int(r[0]), []).append((int(r[4]), int(r[1]), int(r[2]), r[3]))
    assert sorted(rows) == log_.users.tolist()
    cat_raw = log_.category_raw_ids
    for u in (0, 1, 400, 813):
        raw = rows[int(log_.users[u])]
        expect = sorted(raw, key=lambda t: t[0])  # Python's sort is stable: ties keep file order
        s, e = log_.offsets[u], log_.offsets[u + 1]
        assert log_.timestamps[s:e].tolist() == [t for t, *_ in expect]
        assert log_.item_raw_ids[log_.items[s:e]].tolist() == [i for _, i, _, _ in expect]
        assert cat_raw[log_.categories[s:e]].tolist() == [c for _, _, c, _ in expect]
        assert [log_.action_names[a - 1] for a in log_.actions[s:e]] == [b for *_, b in expect]


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


TAOBAO_OK = "1,10,100,pv,1000\n1,11,100,cart,1005\n2,10,100,buy,990\n1,10,100,buy,1003\n"


def test_taobao_small_file_order_and_features(tmp_path: Path):
    log_ = load_taobao(_write(tmp_path / "UserBehavior.csv", TAOBAO_OK))
    assert log_.users.tolist() == [1, 2]
    assert log_.offsets.tolist() == [0, 3, 4]
    assert log_.timestamps.tolist() == [1000, 1003, 1005, 990]
    assert log_.item_raw_ids[log_.items].tolist() == [10, 10, 11, 10]
    assert [log_.action_names[a - 1] for a in log_.actions] == ["pv", "buy", "cart", "buy"]
    assert log_.item_category.tolist() == [0, 1, 1]


@pytest.mark.parametrize(
    "bad_line, text, needle",
    [
        (3, "1,10,100,pv,1000\n1,11,100,cart,1005\n1,12,100,pv\n", "expected 5 fields"),
        (2, "1,10,100,pv,1000\n1,11,100,click,1005\n", "unknown action 'click'"),
        (1, "1,1x,100,pv,1000\n", "item (1) is not an integer: '1x'"),
        (2, "1,10,100,pv,1000\n1,11,100,pv,1005,7\n", "expected 5 fields"),
        (1, "1,10,100,pv,1000,7\n1,11,100,pv,1005,7\n", "expected 5 fields"),  # extra column on every row
    ],
)
def test_taobao_malformed_rows_name_the_line(tmp_path: Path, bad_line: int, text: str, needle: str):
    p = _write(tmp_path / "UserBehavior.csv", text)
    with pytest.raises(DataFormatError) as ei:
        load_taobao(p)
    assert f"{p}:{bad_line}:" in str(ei.value)
    assert needle in str(ei.value)
    assert ei.value.line == bad_line


def test_taobao_skip_bad_rows_counts_them(tmp_path: Path):
    p = _write(tmp_path / "UserBehavior.csv", TAOBAO_OK + "3,1,1,pv\n\n4,2,2,zap,5\n5,3,3,pv,7\n")
    log_ = load_taobao(p, skip_bad_rows=True)
    assert log_.skipped_rows == 2
    assert log_.users.tolist() == [1, 2, 5]
    assert log_.num_events == 5


def test_taobao_missing_file_and_unknown_option(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="UserBehavior"):
        load_taobao(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_taobao(tmp_path / "nope.csv")
    p = _write(tmp_path / "UserBehavior.csv", TAOBAO_OK)
    with pytest.raises(ValueError, match="unknown option"):
        load_taobao(p, columns="user=a,item=b,time=c")


def test_exclude_history_is_a_per_dataset_option(tmp_path: Path):
    p = _write(tmp_path / "UserBehavior.csv", TAOBAO_OK)
    assert load_taobao(p).exclude_history_default is False
    assert load_taobao(p, exclude_history=True).exclude_history_default is True


# ----------------------------------------------------------------------------- Retailrocket
RR_EVENTS = (
    "timestamp,visitorid,event,itemid,transactionid\n"
    "1433221332117,257597,view,355908,\n"
    "1433224214164,992329,view,248676,\n"
    "1433221999827,257597,addtocart,355908,\n"
    "1433222276276,257597,transaction,355908,4000\n"
    "1433221955914,992329,view,111,\n"
)


def test_retailrocket_ms_to_seconds_and_actions(tmp_path: Path):
    log_ = load_retailrocket(_write(tmp_path / "events.csv", RR_EVENTS))
    assert log_.name == "retailrocket"
    assert log_.users.tolist() == [257597, 992329]
    assert log_.timestamps.tolist() == [1433221332, 1433221999, 1433222276, 1433221955, 1433224214]  # ms // 1000
    assert [log_.action_names[a - 1] for a in log_.actions] == ["view", "addtocart", "transaction", "view", "view"]
    assert log_.item_raw_ids[log_.items].tolist() == [355908, 355908, 355908, 111, 248676]
    assert log_.num_categories == 0
    assert log_.exclude_history_default is False


def test_retailrocket_categories_from_item_properties(tmp_path: Path):
    _write(tmp_path / "events.csv", RR_EVENTS)
    _write(
        tmp_path / "item_properties_part1.csv",
        "timestamp,itemid,property,value\n"
        "1431226800000,355908,categoryid,1338\n"
        "1431226800000,355908,790,n5.0\n"
        "1433041200000,355908,categoryid,1277\n",
    )  # later value wins
    _write(
        tmp_path / "item_properties_part2.csv",
        "timestamp,itemid,property,value\n1431226800000,248676,categoryid,5\n1431226800000,248676,available,1\n",
    )
    log_ = load_dataset("retailrocket", tmp_path)
    assert log_.category_raw_ids.tolist() == [0, 5, 1277]
    raw_cat = {int(r): int(log_.category_raw_ids[c]) if c else None for r, c in zip(log_.item_raw_ids[1:], log_.item_category[1:])}
    assert raw_cat == {111: None, 248676: 5, 355908: 1277}  # item 111 has no categoryid: category 0 (none)
    assert log_.categories.tolist() == [2, 2, 2, 0, 1]
    assert load_retailrocket(tmp_path, item_properties=False).num_categories == 0


def test_retailrocket_malformed(tmp_path: Path):
    p = _write(tmp_path / "events.csv", RR_EVENTS + "1433221955914,1,purchase,5,\n")
    with pytest.raises(DataFormatError, match=r"events.csv:7: unknown action 'purchase'"):
        load_retailrocket(p)
    assert load_retailrocket(p, skip_bad_rows=True).skipped_rows == 1
    _write(p, "timestamp,visitor,event,itemid\n1,2,view,3\n")
    with pytest.raises(DataFormatError, match=r"events.csv:1: column 'visitorid' \(for user\) not in the header"):
        load_retailrocket(p)
    _write(p, "timestamp,visitorid,event,itemid,transactionid\n14332213321x7,1,view,3,\n")
    with pytest.raises(DataFormatError, match=r"events.csv:2: time \('timestamp'\) is not"):
        load_retailrocket(p)


# ----------------------------------------------------------------------------- generic CSV / Parquet
GENERIC = (
    "uid,ts,sku,event,cat,extra\n"
    "7,2024-01-01T00:00:10Z,500,click,3,x\n"
    "7,2024-01-01T00:00:05Z,501,order,4,y\n"
    "9,2024-01-01T01:00:00+01:00,500,click,3,z\n"
)
MAPPING = "user=uid,item=sku,time=ts,action=event,category=cat"
T0 = 1704067200  # 2024-01-01T00:00:00Z


def test_parse_columns():
    m, unit = parse_columns("user=a, item=b,time=c,time_unit=ms")
    assert m == {"user": "a", "item": "b", "time": "c"} and unit == "ms"
    assert parse_columns({"user": "a", "item": "b", "time": "c"}) == ({"user": "a", "item": "b", "time": "c"}, None)
    for bad, msg in [
        ("user=a,time=b", "missing \\['item'\\]"),  # time is optional: order-only data (tests/data/test_loaders_formats.py)
        ("user=a,item=b,time=c,price=d", "unknown key 'price'"),
        ("user=a,item=b,time=c,user=e", "given twice"),
        ("user,item=b,time=c", "not key=column"),
        ("user=a,item=b,time=c,time_unit=h", "time_unit"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_columns(bad)


def test_csv_mapping_iso_times_and_features(tmp_path: Path):
    log_ = load_csv(_write(tmp_path / "log.csv", GENERIC), columns=MAPPING)
    assert log_.users.tolist() == [7, 9]
    assert log_.timestamps.tolist() == [T0 + 5, T0 + 10, T0]  # +01:00 offset: 01:00 local = 00:00 UTC
    assert log_.item_raw_ids[log_.items].tolist() == [501, 500, 500]
    assert [log_.action_names[a - 1] for a in log_.actions] == ["order", "click", "click"]
    assert log_.category_raw_ids[log_.categories].tolist() == [4, 3, 3]
    assert log_.exclude_history_default is False


def test_csv_via_load_dataset_and_dataspec_options(tmp_path: Path):
    p = _write(tmp_path / "log.csv", GENERIC)
    log_, split = prepare_data(DataSpec("csv", str(p), options={"columns": MAPPING}))
    assert log_.num_events == 3 and split.protocol == "clean"
    assert set(LOADERS) == {"taobao", "retailrocket", "csv"}
    with pytest.raises(ValueError, match="column mapping is needed"):
        load_dataset("csv", p)


def test_parquet_equals_csv(tmp_path: Path):
    df = pd.read_csv(_write(tmp_path / "log.csv", GENERIC))
    df["ts"] = pd.to_datetime(df["ts"], utc=True, format="ISO8601")  # a real timestamp column
    df.to_parquet(tmp_path / "log.parquet")
    a = load_csv(tmp_path / "log.csv", columns=MAPPING)
    b = load_csv(tmp_path / "log.parquet", columns=MAPPING)
    for f in ("users", "offsets", "items", "timestamps", "actions", "categories", "item_raw_ids"):
        assert getattr(a, f).tolist() == getattr(b, f).tolist(), f


def test_csv_integer_times_units(tmp_path: Path):
    p = _write(tmp_path / "log.csv", "u,i,t\n1,2,1700000000123\n1,3,1700000001999\n")
    assert load_csv(p, columns="user=u,item=i,time=t").timestamps.tolist() == [1700000000, 1700000001]  # auto: ms
    with pytest.raises(DataFormatError, match=r"log.csv:2: .*which as seconds \(time_unit\) is after 2262-04-11"):
        load_csv(p, columns="user=u,item=i,time=t,time_unit=s")  # ms read as s: year ~55,800, which no request can hold
    q = _write(tmp_path / "s.csv", "u,i,t\n1,2,1700000000\n")
    assert load_csv(q, columns="user=u,item=i,time=t").timestamps.tolist() == [1700000000]
    assert load_csv(q, columns="user=u,item=i,time=t", time_unit="ms").timestamps.tolist() == [1700000]


def test_csv_malformed_rows_name_the_line(tmp_path: Path):
    p = _write(tmp_path / "log.csv", "u,i,t,a\n1,2,10,view\n\n1, ,11,view\n")  # 'x3' and an id past int64 are text ids now
    with pytest.raises(DataFormatError, match=r"log.csv:4: item \('i'\) is missing"):
        load_csv(p, columns="user=u,item=i,time=t,action=a")
    log_ = load_csv(p, columns="user=u,item=i,time=t,action=a", skip_bad_rows=True)
    assert log_.skipped_rows == 1 and log_.num_events == 1
    p = _write(tmp_path / "log.csv", "u,i,t\n1,2,10\n1,3,11,99\n")
    with pytest.raises(DataFormatError, match=r"log.csv:3: expected"):
        load_csv(p, columns="user=u,item=i,time=t")
    p = _write(tmp_path / "log.csv", "u,i,t\n1,2,10\n1,3,yesterday\n")
    with pytest.raises(
        DataFormatError, match=r"log.csv:3: time \('t'\) is neither integer Unix time \(int64\) nor an ISO 8601 .*'yesterday'"
    ):
        load_csv(p, columns="user=u,item=i,time=t")
    p = _write(tmp_path / "log.csv", "u,i,t\n1,2,2024-01-01\n1,3,not-a-date\n")
    with pytest.raises(DataFormatError, match=r"log.csv:3: time \('t'\) is neither"):
        load_csv(p, columns="user=u,item=i,time=t")
    # in a column of ISO date-times "-100" parsed as the year -100 and raised pandas' OutOfBoundsDatetime
    p = _write(tmp_path / "log.csv", "u,i,t\n1,2,2024-01-01\n1,3,2024-01-02\n1,4,-100\n1,5,2024-01-03\n")
    with pytest.raises(DataFormatError, match=r"log.csv:4: time \('t'\) is neither .* years 1970..2262 .*'-100'"):
        load_csv(p, columns="user=u,item=i,time=t")
    assert load_csv(p, columns="user=u,item=i,time=t", skip_bad_rows=True).skipped_rows == 1
    p = _write(tmp_path / "log.csv", "u,item,t\n1,2,10\n")
    with pytest.raises(DataFormatError, match=r"log.csv:1: column 'i' \(for item\) not in the header"):
        load_csv(p, columns="user=u,item=i,time=t")
    p = _write(tmp_path / "log.csv", "u,i,t\n1,,10\n")
    with pytest.raises(DataFormatError, match=r"log.csv:2: item \('i'\) is missing"):
        load_csv(p, columns="user=u,item=i,time=t")


def test_csv_ids_are_parsed_exactly(tmp_path: Path):
    """A user id past int64 turned the whole column into float64: every id above 2^53 was
    rounded (two users became one) and the big id wrapped to a negative one. Now ids are exact,
    and an id past int64 (not an int64 integer) makes the column text ids, each as written."""
    big = 2**62 + 1  # float64 rounds it to 2^62
    p = _write(tmp_path / "log.csv", f"u,i,t\n{big},2,10\n{big - 1},3,11\n{big},3,12\n5,2,13\n")
    assert sorted(load_csv(p, columns="user=u,item=i,time=t").users.tolist()) == sorted([big, big - 1, 5])
    p = _write(tmp_path / "log.csv", p.read_text() + "99999999999999999999,2,14\n")
    log_ = load_csv(p, columns="user=u,item=i,time=t")
    assert log_.skipped_rows == 0 and sorted(log_.users.tolist()) == sorted([str(big), str(big - 1), "5", "99999999999999999999"])
    p = _write(tmp_path / "t.csv", "u,i,t\n1,2,10\n1,3,99999999999999999999\n")  # a time past int64 wrapped to -2^63
    with pytest.raises(DataFormatError, match=r"t.csv:3: time \('t'\) is neither integer Unix time \(int64\)"):
        load_csv(p, columns="user=u,item=i,time=t")
    assert load_csv(p, columns="user=u,item=i,time=t", skip_bad_rows=True).skipped_rows == 1
    pd.DataFrame({"u": [big, big - 1], "i": [2, 3], "t": [1, 2]}).to_parquet(tmp_path / "x.parquet")
    assert sorted(load_csv(tmp_path / "x.parquet", columns="user=u,item=i,time=t").users.tolist()) == [big - 1, big]


def test_parquet_malformed_rows_name_the_row(tmp_path: Path):
    pd.DataFrame({"u": [1, 1, 2], "i": ["5", None, "6"], "t": [1, 2, 3]}).to_parquet(tmp_path / "x.parquet")
    with pytest.raises(DataFormatError, match=r"x.parquet: row 1 \(0-based\): item \('i'\) is missing"):
        load_csv(tmp_path / "x.parquet", columns="user=u,item=i,time=t")
    log_ = load_csv(tmp_path / "x.parquet", columns="user=u,item=i,time=t", skip_bad_rows=True)
    assert log_.skipped_rows == 1 and log_.item_raw_ids[log_.items].tolist() == [5, 6]
    with pytest.raises(DataFormatError, match="column 'j'"):
        load_csv(tmp_path / "x.parquet", columns="user=u,item=j,time=t")


def test_repeat_share_on_real_taobao(taobao_csv: Path):
    """The issue's figures: ~25 % of events and ~31 % of last events revisit a history item."""
    log_ = load_taobao(taobao_csv)
    repeats, last = 0, 0
    for u in range(log_.num_users):
        seen: set[int] = set()
        items = log_.items[log_.offsets[u] : log_.offsets[u + 1]].tolist()
        for x in items:
            repeats += x in seen
            seen.add(x)
        last += items[-1] in set(items[:-1])
    assert repeats / log_.num_events == pytest.approx(0.2427, abs=5e-4)
    assert last / log_.num_users == pytest.approx(0.3096, abs=5e-4)
    # the counter agrees with a Counter-based second count
    total_repeat = sum(
        sum(c - 1 for c in Counter(log_.items[log_.offsets[u] : log_.offsets[u + 1]].tolist()).values()) for u in range(log_.num_users)
    )
    assert total_repeat == repeats
