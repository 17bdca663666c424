"""From a trial of the data loaders (hstu.data.parsing / delimited / records / times / ecommerce): integer ids are
only those written canonically ("042" stays a text id), an integer past int64 makes the column text, an unclosed
quote is one error naming the line it opens on (also with --skip-bad-rows), the taobao loader drops a UTF-8
byte-order mark, integer microseconds in the automatic unit are refused with the unit to set, and a time before
1970 is a bad row. Expected values are written out by hand (or computed with datetime), not by the loaders."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hstu.data import DataFormatError
from hstu.data.delimited import load_csv
from hstu.data.ecommerce import load_retailrocket, load_taobao
from hstu.data.parsing import Column, parse_lines
from hstu.data.records import open_quote
from hstu.data.reviews import load_amazon, load_sequences
from hstu.data.times import TIME_UNITS

COLS = "user=u,item=i,time=t"
EXTRA = "9,9,9,extra\n"  # a row with an extra field: the C parser stops, the line-by-line pass reads the file


def _write(p: Path, text: str) -> Path:
    p.write_bytes(text.encode("utf-8"))
    return p


def _utc(*args) -> int:
    return int(datetime(*args, tzinfo=timezone.utc).timestamp())


def _load(p: Path, slow: bool, **kw):
    """load_csv of ``p`` by the pandas pass, or (``slow``) by the line-by-line pass: ``p`` with EXTRA appended."""
    if slow:
        p = _write(p.with_name("slow_" + p.name), p.read_text() + EXTRA)
        kw["skip_bad_rows"] = True
    return load_csv(p, **{"columns": COLS, **kw})


# ----------------------------------------------------------------------------- 1, 2: ids as written
@pytest.mark.parametrize("slow", [False, True])
def test_non_canonical_integers_make_the_column_text_ids(tmp_path: Path, slow: bool):
    """'042' and '42' (and '1e3' / '1000', '12' / '12.0', users '+8' / '08' / '8') were merged into one int id."""
    rows = [("+8", "042"), ("08", "42"), ("8", "1e3"), ("8", "1000"), ("08", "12"), ("+8", "12.0")]
    p = _write(tmp_path / "log.csv", "u,i,t\n" + "".join(f"{u},{i},{t}\n" for t, (u, i) in enumerate(rows, start=1)))
    log_ = _load(p, slow)
    assert log_.skipped_rows == int(slow)
    assert sorted(log_.users.tolist()) == ["+8", "08", "8"]
    assert sorted(log_.item_raw_ids[1:].tolist()) == sorted(["042", "42", "1e3", "1000", "12", "12.0"])
    seqs = {u: log_.item_raw_ids[log_.items[a:b]].tolist() for u, a, b in zip(log_.users, log_.offsets, log_.offsets[1:])}
    assert seqs == {"+8": ["042", "12.0"], "08": ["42", "12"], "8": ["1e3", "1000"]}


@pytest.mark.parametrize("slow", [False, True])
def test_canonical_integers_stay_int64_and_minus_zero_is_not_one(tmp_path: Path, slow: bool):
    p = _write(tmp_path / "log.csv", "u,i,t\n1, 0 ,1\n-3,-5,2\n1,42,3\n")
    log_ = _load(p, slow)
    assert log_.users.dtype == np.int64 and log_.users.tolist() == [-3, 1]
    assert log_.item_raw_ids.dtype == np.int64 and log_.item_raw_ids.tolist() == [0, -5, 0, 42]
    q = _write(tmp_path / "m0.csv", "u,i,t\n1,-0,1\n1,0,2\n")
    assert sorted(_load(q, slow).item_raw_ids[1:].tolist()) == ["-0", "0"]


@pytest.mark.parametrize("slow", [False, True])
def test_an_integer_past_int64_makes_the_column_text(tmp_path: Path, slow: bool):
    """A 20-digit barcode was refused as 'not an integer in the int64 range'; 2^63 (19 digits) too."""
    p = _write(tmp_path / "log.csv", "u,i,t\n1,18446744073709551616,1\n1,42,2\n2,9223372036854775808,3\n2,9223372036854775807,4\n")
    log_ = _load(p, slow)
    assert log_.skipped_rows == int(slow)
    assert sorted(log_.item_raw_ids[1:].tolist()) == sorted(["18446744073709551616", "42", "9223372036854775808", "9223372036854775807"])
    q = _write(tmp_path / "max.csv", "u,i,t\n1,9223372036854775807,1\n1,-9223372036854775808,2\n")
    assert _load(q, slow).item_raw_ids.tolist() == [0, -(2**63), 2**63 - 1]  # int64's own ends stay integers


def test_parquet_ids_integer_columns_and_string_columns(tmp_path: Path):
    pd.DataFrame({"u": [1, 1], "i": [42, 42], "t": [1, 2]}).to_parquet(tmp_path / "int.parquet")
    log_ = load_csv(tmp_path / "int.parquet", columns=COLS)
    assert log_.item_raw_ids.dtype == np.int64 and log_.item_raw_ids.tolist() == [0, 42]
    pd.DataFrame({"u": ["1", "1", "2"], "i": ["042", "42", "7"], "t": [1, 2, 3]}).to_parquet(tmp_path / "str.parquet")
    log_ = load_csv(tmp_path / "str.parquet", columns=COLS)
    assert log_.users.dtype == np.int64 and sorted(log_.item_raw_ids[1:].tolist()) == ["042", "42", "7"]
    big = pd.DataFrame({"u": [1, 1], "i": np.array([2**64 - 1, 5], np.uint64), "t": [1, 2]})
    big.to_parquet(tmp_path / "u64.parquet")
    assert sorted(load_csv(tmp_path / "u64.parquet", columns=COLS).item_raw_ids[1:].tolist()) == ["18446744073709551615", "5"]


def test_categories_keep_their_own_rule(tmp_path: Path):
    """Categories are integers read as numbers (documented): '12' and '12.0' are one category."""
    p = _write(tmp_path / "log.csv", "u,i,t,c\n1,1,1,12\n1,2,2,12.0\n")
    assert load_csv(p, columns=COLS + ",category=c").category_raw_ids.tolist() == [0, 12]


def test_sequence_and_amazon_ids_with_leading_zeros_stay_text(tmp_path: Path):
    seq = _write(tmp_path / "seq.txt", "1 0205616461 42\n2 042 42\n")
    log_ = load_sequences(seq)
    assert sorted(log_.item_raw_ids[1:].tolist()) == ["0205616461", "042", "42"]
    csv_ = _write(tmp_path / "ratings_Books.csv", "A1,0205616461,5.0,100\nA2,205616461,4.0,200\n")
    assert sorted(load_amazon(csv_).item_raw_ids[1:].tolist()) == ["0205616461", "205616461"]


# ----------------------------------------------------------------------------- 3: quotes
def _events(n: int, bad: int | None = None) -> str:
    """A header and n event rows (lines 2..n+1); line ``bad`` opens a quote that is never closed."""
    lines = ["u,i,t,a,c"]
    for k in range(2, n + 2):
        a = '"view' if k == bad else "view"
        lines.append(f"{10_000 + k % 50},{500_000 + k % 300},2024-03-08T19:43:19Z,{a},11")  # ~45 characters, as the trial's
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("skip", [False, True])
def test_an_unclosed_quote_in_a_large_file_names_its_line(tmp_path: Path, skip: bool):
    """It ended in _csv.Error 'field larger than field limit (131072)', also with --skip-bad-rows."""
    p = _write(tmp_path / "quote_mid.csv", _events(5569, bad=1001))
    with pytest.raises(DataFormatError, match=r"quote_mid.csv:1001: a quoted field opens on this line .* not closed within 131072"):
        load_csv(p, columns=COLS + ",action=a", skip_bad_rows=skip)


@pytest.mark.parametrize("skip", [False, True])
def test_an_unclosed_quote_near_the_end_is_refused_with_the_lines_it_swallows(tmp_path: Path, skip: bool):
    """With --skip-bad-rows the rest of the file (70 lines, 3 users) went as '1 malformed row'."""
    p = _write(tmp_path / "quote_end.csv", _events(5569, bad=5501))
    with pytest.raises(DataFormatError, match=r"quote_end.csv:5501: .* never closed: it would swallow lines 5501..5570, .*\(70 lines\)"):
        load_csv(p, columns=COLS + ",action=a", skip_bad_rows=skip)


def test_an_unclosed_quote_in_a_small_file_names_its_line_not_the_header(tmp_path: Path):
    p = _write(tmp_path / "unterminated.csv", 'u,i,t\n1,"2,100\n1,3,200\n')
    with pytest.raises(DataFormatError, match=r"unterminated.csv:2: a quoted field opens on this line"):
        load_csv(p, columns=COLS)
    tb = _write(tmp_path / "UserBehavior.csv", '1,2,3,pv,1511544070\n1,3,3,"buy,1511544080\n')  # headerless, taobao
    with pytest.raises(DataFormatError, match=r"UserBehavior.csv:2: a quoted field opens on this line"):
        load_taobao(tb, skip_bad_rows=True)


def test_closed_quotes_are_no_error_and_a_spanning_record_says_its_lines(tmp_path: Path, caplog):
    p = _write(tmp_path / "ok.csv", 'u,i,t,a\n1,2,1,"a ""b"""\n1,3,2,v"iew\n1,4,3,"x\ny"')  # doubled quotes, mid-field, no final newline
    assert load_csv(p, columns=COLS + ",action=a").num_events == 3
    assert open_quote(['1,2,"a ""b""",3\n'], ",") is None and open_quote(["1,2\n", '3,"a\n', "b\n"], ",") == 1
    q = _write(tmp_path / "pair.csv", 'u,i,t,a\n1,2,1,view\n1,3,2,"view\n1,4,3,view\n1,5,4,view",9\n1,6,5,view\n')
    with pytest.raises(
        DataFormatError, match=r"pair.csv:3: expected 4 fields \(as the header\), got 5 \(a quoted field makes lines 3..5 one"
    ):
        load_csv(q, columns=COLS + ",action=a")
    with caplog.at_level(logging.WARNING, logger="hstu.data.parsing"):
        assert load_csv(q, columns=COLS + ",action=a", skip_bad_rows=True).num_events == 2
    assert any("skipped 1 malformed row on 3 lines" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- 4: taobao byte-order mark
def test_taobao_drops_a_byte_order_mark_in_the_line_by_line_pass(tmp_path: Path):
    """'UserBehavior.csv:1: user (0) is not an integer: '\\ufeff1'' (and the first event dropped under --skip-bad-rows)."""
    p = tmp_path / "UserBehavior.csv"
    p.write_bytes("\ufeff1,2,3,pv,1511544070\n1,3,3,buy,1511544080\n1,4,3,xx,1511544090\n".encode("utf-8"))
    with pytest.raises(DataFormatError, match=r"UserBehavior.csv:3: unknown action 'xx'"):
        load_taobao(p)
    log_ = load_taobao(p, skip_bad_rows=True)
    assert log_.skipped_rows == 1 and log_.users.tolist() == [1] and log_.item_raw_ids.tolist() == [0, 2, 3]


# ----------------------------------------------------------------------------- 5: units past 2262
@pytest.mark.parametrize("slow", [False, True])
def test_microseconds_in_the_automatic_unit_are_refused_naming_the_unit(tmp_path: Path, slow: bool):
    """1.7e15 (us) was read as ms: year ~55,800. ``slow``: the line-by-line pass (parse_lines) decides the same."""
    t0 = _utc(2023, 11, 14, 22, 13, 20)  # 1_700_000_000
    p = _write(tmp_path / "us.csv", f"u,i,t\n1,1,{(t0 - 1) * 10**6}\n1,2,{t0 * 10**6}\n1,3,{(t0 + 1) * 10**6 + 5}\n")
    ns = _write(tmp_path / "ns.csv", f"u,i,t\n1,1,{t0 * 10**9}\n")
    cols = [Column("user", "u", text=True), Column("item", "i", text=True), Column("time", "t")]
    for f in (p, ns):
        with pytest.raises(DataFormatError, match=rf"{f.name}:2: time \('t'\) is '\d+', .*after 2262-04-11.* time_unit=us or time_unit=ns"):
            if slow:
                parse_lines(f, cols, header=True, sep=",", time_unit=None, skip_bad_rows=False)
            else:
                load_csv(f, columns=COLS)
    assert _load(p, slow, columns=COLS + ",time_unit=us").timestamps.tolist() == [t0 - 1, t0, t0 + 1]
    assert _load(ns, slow, columns=COLS + ",time_unit=ns").timestamps.tolist() == [t0]


def test_the_last_time_in_the_automatic_unit_is_2262_04_11(tmp_path: Path):
    last = pd.Timestamp.max  # 2262-04-11T23:47:16.854775807
    ms = int(last.value // 10**6)  # the last whole millisecond
    p = _write(tmp_path / "edge.csv", f"u,i,t\n1,1,{ms}\n1,2,1700000000000\n")
    assert load_csv(p, columns=COLS).timestamps.tolist() == [1_700_000_000, ms // 1000]
    q = _write(tmp_path / "past.csv", f"u,i,t\n1,2,1700000000000\n1,1,{ms + 1}\n")
    with pytest.raises(DataFormatError, match=r"past.csv:3: .*after 2262-04-11"):
        load_csv(q, columns=COLS)
    pd.DataFrame({"u": [1, 1], "i": [1, 2], "t": [ms + 1, 1700000000000]}).to_parquet(tmp_path / "x.parquet")
    with pytest.raises(DataFormatError, match=r"x.parquet: row 0 \(0-based\): time \('t'\) is .*after 2262-04-11"):
        load_csv(tmp_path / "x.parquet", columns=COLS)


@pytest.mark.parametrize("slow", [False, True])
def test_a_time_past_2262_is_refused_in_a_unit_set_explicitly_too(tmp_path: Path, slow: bool):
    """A trial's finding: `time_unit=s` with 9223372037 (or ms with 1e17) trained, and then no history holding it could
    be generated (generate and serve take seconds up to 2262-04-11): refused at load in any unit, naming the line."""
    cols = [Column("user", "u", text=True), Column("item", "i", text=True), Column("time", "t")]
    for unit, t in (("s", 9_223_372_037), ("ms", 10**17)):
        f = _write(tmp_path / f"{unit}.csv", f"u,i,t\n1,1,1700000000\n1,2,{t}\n")
        with pytest.raises(DataFormatError, match=rf"{unit}.csv:3: time \('t'\) is '{t}', which as .* \(time_unit\) is after 2262-04-11"):
            if slow:  # the line-by-line pass
                parse_lines(f, cols, header=True, sep=",", time_unit=TIME_UNITS[unit], skip_bad_rows=False)
            else:
                load_csv(f, columns=COLS + f",time_unit={unit}")
    ok = _write(tmp_path / "ok.csv", "u,i,t\n1,1,9223372036\n")  # the last whole second is still a time
    assert _load(ok, slow, columns=COLS + ",time_unit=s").timestamps.tolist()[0] == 9_223_372_036


# ----------------------------------------------------------------------------- 6: before 1970
@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("t", ["-1000", "1965-03-01T00:00:00Z"])
def test_a_time_before_1970_is_a_bad_row(tmp_path: Path, slow: bool, t: str):
    """Training took -1000 and 1965, which generate / serve refuse."""
    later = "1970-01-01T00:00:00Z" if "T" in t else "0"  # the epoch itself is fine
    p = _write(tmp_path / "log.csv", f"u,i,t\n1,1,{later}\n1,2,{t}\n2,3,{later}\n")
    with pytest.raises(DataFormatError, match=rf"log.csv:3: time \('t'\) is '{t}', before 1970-01-01"):
        load_csv(p if not slow else _write(tmp_path / "log.csv", p.read_text() + EXTRA), columns=COLS)
    p = _write(tmp_path / "log.csv", f"u,i,t\n1,1,{later}\n1,2,{t}\n2,3,{later}\n")
    log_ = _load(p, slow, skip_bad_rows=True)
    assert log_.skipped_rows == 1 + int(slow) and log_.timestamps.tolist() == [0, 0] and log_.num_users == 2


def test_parquet_times_before_1970_are_bad_rows(tmp_path: Path):
    for name, t in (("int", [5, -1]), ("dt", pd.to_datetime(["2024-01-01", "1965-03-01"], utc=True))):
        pd.DataFrame({"u": [1, 1], "i": [1, 2], "t": t}).to_parquet(tmp_path / f"{name}.parquet")
        with pytest.raises(DataFormatError, match=rf"{name}.parquet: row 1 \(0-based\): time \('t'\) is .*before 1970-01-01"):
            load_csv(tmp_path / f"{name}.parquet", columns=COLS)
        assert load_csv(tmp_path / f"{name}.parquet", columns=COLS, skip_bad_rows=True).skipped_rows == 1


def test_taobao_retailrocket_and_amazon_refuse_times_before_1970(tmp_path: Path):
    tb = _write(tmp_path / "UserBehavior.csv", "1,2,3,pv,1511544070\n1,3,3,buy,-1511544080\n")
    with pytest.raises(DataFormatError, match=r"UserBehavior.csv:2: time \(4\) is '-1511544080', before 1970-01-01"):
        load_taobao(tb)
    assert load_taobao(tb, skip_bad_rows=True).timestamps.tolist() == [1511544070]
    rr = tmp_path / "rr"
    rr.mkdir()
    _write(rr / "events.csv", "timestamp,visitorid,event,itemid,transactionid\n-5,1,view,2,\n1433221332117,1,view,3,\n")
    with pytest.raises(DataFormatError, match=r"events.csv:2: time \('timestamp'\) is '-5', before 1970-01-01"):
        load_retailrocket(rr)
    rec = {"reviewerID": "A1", "asin": "B1", "overall": 5.0, "unixReviewTime": -86400}
    js = _write(tmp_path / "reviews_Books_5.json", json.dumps(rec) + "\n")
    with pytest.raises(DataFormatError, match=r"reviews_Books_5.json:1: unixReviewTime is '-86400', before 1970-01-01"):
        load_amazon(js)
