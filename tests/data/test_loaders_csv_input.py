"""A new user's own files through the csv loader (hstu.data.delimited): one column mapped to two roles, a header
with spaces, integer times in mixed units, quoted line breaks, over-long ids, a numeric feature on a text column
and UTF-16 files. Each bad input is one DataFormatError naming the file and the line its row starts on."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from hstu.data import DataFormatError
from hstu.data.delimited import load_csv
from hstu.data.parsing import Column, parse_lines

COLS = "user=u,item=i,time=t"
ROWS = [(1, 10, 100, "view", 3), (1, 11, 101, "buy", 4), (2, 10, 102, "view", 3)]  # user, item, time (s), action, category


def _write(p: Path, text: str) -> Path:
    p.write_bytes(text.encode("utf-8"))  # bytes: the line ends as written
    return p


def _csv(rows: list[tuple], head: str = "u,i,t,a,c", sep: str = ",") -> str:
    return head + "\n" + "".join(sep.join(map(str, r)) + "\n" for r in rows)


def _events(log_) -> list[tuple]:
    """(user, item, Unix s, action) per event, in the log's order: by user, then time."""
    users, items, names = log_.users.tolist(), log_.item_raw_ids.tolist(), log_.action_names
    out = []
    for k, u in enumerate(users):
        for e in range(log_.offsets[k], log_.offsets[k + 1]):
            out.append((u, items[log_.items[e]], int(log_.timestamps[e]), names[log_.actions[e] - 1] if names else None))
    return out


# ----------------------------------------------------------------------------- 1. one column, two roles
@pytest.mark.parametrize(
    ("columns", "options", "message"),
    [
        ("user=u,item=u,time=t", {}, r"log.csv:1: --columns: column 'u' is mapped to both user and item; a column has one role$"),
        ("user=u,item=i,time=t,action=a,category=a", {}, r"--columns: column 'a' is mapped to both action and category"),
        ("user=u,item=i,time=t,category=t", {}, r"--columns: column 't' is mapped to both time and category"),
        ("user=u,item=0,time=t", {}, r"--columns: column 'u' is mapped to both user and item"),  # a name and its position
        ("user=u,item=i,time=t", {"features": "u"}, r"--columns/--feature: column 'u' is mapped to both user and the feature 'u'"),
        (
            "user=u,item=i,time=t",
            {"numeric_features": "t:4"},
            r"--columns/--feature: column 't' is mapped to both time and the feature 't'",
        ),
    ],
)
def test_one_column_with_two_roles_is_refused(tmp_path: Path, columns: str, options: dict, message: str):
    """Selecting one label twice gave pandas a frame for a column: AttributeError 'DataFrame' object has no attribute 'dtype'."""
    p = _write(tmp_path / "log.csv", _csv(ROWS))
    with pytest.raises(DataFormatError, match=message):
        load_csv(p, columns=columns, **options)
    pq = tmp_path / "log.parquet"
    pd.DataFrame(ROWS, columns=["u", "i", "t", "a", "c"]).to_parquet(pq)
    with pytest.raises(DataFormatError, match=message.replace("log.csv:1", "log.parquet")):
        load_csv(pq, columns=columns, **options)


def test_headerless_positions_with_two_roles_are_refused(tmp_path: Path):
    p = _write(tmp_path / "log.txt", "".join(f"{u};{i};{t}\n" for u, i, t, _, _ in ROWS))
    with pytest.raises(DataFormatError, match=r"log.txt:1: --columns: column '#0' is mapped to both user and item"):
        load_csv(p, columns="user=0,item=0,time=2", format="sep=;,header=none")


# ----------------------------------------------------------------------------- 2. spaces after the separators
def test_header_names_with_spaces_are_trimmed(tmp_path: Path):
    """The mapping matched the trimmed names but the frame kept ' i': KeyError "['i', 't'] not in index"."""
    want = [(1, 10, 100, "view"), (1, 11, 101, "buy"), (2, 10, 102, "view")]
    spaced = _write(tmp_path / "spaced.csv", _csv(ROWS, head="u, i, t, a, c", sep=", "))
    cols = COLS + ",action=a,category=c"
    assert _events(load_csv(spaced, columns=cols)) == want
    wide = _write(tmp_path / "wide.csv", _csv([*ROWS, (3, 12, 103, "view", 3, "extra")], head="u, i, t, a, c", sep=", "))
    assert _events(load_csv(wide, columns=cols, skip_bad_rows=True)) == want  # the line-by-line pass, the same names


# ----------------------------------------------------------------------------- 3. integer times in mixed units
SECONDS = [(1, 10, 1_700_000_000), (1, 11, 1_700_000_060), (2, 10, 1_700_000_120), (2, 12, 1_700_000_180)]


def _mixed(tmp_path: Path, rows: list[tuple], name: str = "log.csv") -> Path:
    return _write(tmp_path / name, "u,i,t\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))


def test_seconds_with_one_millisecond_time_are_refused(tmp_path: Path):
    """Read as seconds, the ms row was an event in the year 55,800 (training went on silently)."""
    rows = [*SECONDS[:2], (2, 10, 1_700_000_120_000), SECONDS[3]]  # line 4: ms
    p = _mixed(tmp_path, rows)
    with pytest.raises(DataFormatError, match=r"log.csv:4: time \('t'\) is 1700000120000, which looks like milliseconds \(>= 1e11\) "
                       r"while most of the column is seconds \(< 1e11\): fix the row or set time_unit= in --columns$"):  # fmt: skip
        load_csv(p, columns=COLS)
    kept = load_csv(p, columns=COLS, skip_bad_rows=True)
    assert _events(kept) == [(1, 10, 1_700_000_000, None), (1, 11, 1_700_000_060, None), (2, 12, 1_700_000_180, None)]
    assert kept.skipped_rows == 1
    with pytest.raises(DataFormatError, match=r"log.csv:4: .*which as seconds \(time_unit\) is after 2262-04-11"):
        load_csv(p, columns=COLS + ",time_unit=s")  # a unit given: as seconds that row is past the times a run can hold


def test_milliseconds_with_one_seconds_time_are_refused(tmp_path: Path):
    """Read as seconds (not every value was >= 1e11), every gap of the ms rows was x1000."""
    rows = [(u, i, t * 1000) for u, i, t in SECONDS]
    rows[1] = (1, 11, 1_700_000_060)  # line 3: seconds
    p = _mixed(tmp_path, rows)
    with pytest.raises(DataFormatError, match=r"log.csv:3: time \('t'\) is 1700000060, which looks like seconds \(< 1e11\) "
                       r"while most of the column is milliseconds"):  # fmt: skip
        load_csv(p, columns=COLS)
    kept = load_csv(p, columns=COLS, skip_bad_rows=True)  # the others in ms: whole seconds as in SECONDS
    assert _events(kept) == [(1, 10, 1_700_000_000, None), (2, 10, 1_700_000_120, None), (2, 12, 1_700_000_180, None)]


def test_mixed_units_in_the_line_by_line_pass_and_parquet(tmp_path: Path):
    """The same rule where pandas' parser gives up (a too-wide row) and in Parquet (row index); a tie reads seconds."""
    rows = [(1, 10, 1_700_000_000_000), (1, 11, 1_700_000_060_000), (2, 10, 1_700_000_120)]
    p = _mixed(tmp_path, rows)
    wide = _write(tmp_path / "wide.csv", p.read_text() + "3,1,2,extra\n")
    kept = load_csv(wide, columns=COLS, skip_bad_rows=True)
    assert _events(kept) == [(1, 10, 1_700_000_000, None), (1, 11, 1_700_000_060, None)] and kept.skipped_rows == 2
    pq = tmp_path / "log.parquet"
    pd.DataFrame([(1, 10, 1_700_000_000), (1, 11, 1_700_000_060_000)], columns=["u", "i", "t"]).to_parquet(pq)
    with pytest.raises(
        DataFormatError, match=r"log.parquet: row 1 \(0-based\): time \('t'\) is 1700000060000, which looks like milliseconds"
    ):
        load_csv(pq, columns=COLS)
    cols = [Column("user", "u", text=True), Column("item", "i", text=True), Column("time", "t")]
    with pytest.raises(DataFormatError, match=r"log.csv:4: time \('t'\) is 1700000120, which looks like seconds"):
        parse_lines(p, cols, header=True, sep=",", time_unit=None, skip_bad_rows=False)  # time_unit None: automatic


def test_a_time_past_int64_is_a_bad_row_in_the_line_by_line_pass(tmp_path: Path):
    """The pandas pass refuses it (int64 column); the line-by-line pass kept a Python int and stopped with OverflowError."""
    cols = [Column("user", "u", text=True), Column("item", "i", text=True), Column("time", "t")]
    for big in ("99999999999999999999", "1e25"):
        p = _write(tmp_path / "log.csv", f"u,i,t\n1,10,100\n1,11,{big}\n")
        with pytest.raises(DataFormatError, match=rf"log.csv:3: time \('t'\) is not a time \(integer or ISO 8601\): '{big}'$"):
            parse_lines(p, cols, header=True, sep=",", time_unit=None, skip_bad_rows=False)
        wide = _write(tmp_path / "wide.csv", p.read_text() + "2,1,1,extra\n")
        assert _events(load_csv(wide, columns=COLS, skip_bad_rows=True)) == [(1, 10, 100, None)]


# ----------------------------------------------------------------------------- 4. quoted line breaks
def test_lines_are_counted_across_quoted_line_breaks(tmp_path: Path):
    """The frame index was taken for the line: after a quoted field holding a line break every line was one short."""
    text = 'u,i,t,a,c\n1,10,100,"vi\new",3\n\n1,11,101,"a\r\nb",4\n2,10,102,view,x\n2,11,103,view,3\n'
    p = _write(tmp_path / "log.csv", text)  # the bad category 'x' is on line 7 (lines 2-3, 5-6: one row each)
    with pytest.raises(DataFormatError, match=r"log.csv:7: category \('c'\) is not an integer"):
        load_csv(p, columns=COLS + ",action=a,category=c")
    short = _write(tmp_path / "short.csv", text.replace("2,10,102,view,x", "2,10"))
    with pytest.raises(DataFormatError, match=r"short.csv:7: expected 5 fields \(as the header\), got 2: '2,10'$"):
        load_csv(short, columns=COLS + ",action=a,category=c")
    wide = _write(tmp_path / "wide.csv", text.replace("2,10,102,view,x", "2,10,102,view,3,9"))  # the line-by-line pass
    with pytest.raises(DataFormatError, match=r"wide.csv:7: expected 5 fields \(as the header\), got 6"):
        load_csv(wide, columns=COLS + ",action=a,category=c")
    crlf = _write(tmp_path / "crlf.csv", text.replace("\r\n", "\n").replace("\n", "\r\n"))  # Windows line ends
    with pytest.raises(DataFormatError, match=r"crlf.csv:7: category"):
        load_csv(crlf, columns=COLS + ",action=a,category=c")


# ----------------------------------------------------------------------------- 5. over-long ids
def test_an_over_long_id_names_file_and_line(tmp_path: Path):
    """It was refused after loading, as 'csv: user_id row[1]: ...' with all its characters and no file or line."""
    long = "x" * 300
    p = _write(tmp_path / "log.csv", f"u,i,t\n1,10,100\n{long},11,101\n2,10,102\n")
    with pytest.raises(DataFormatError) as err:
        load_csv(p, columns=COLS)
    msg = str(err.value)
    assert msg == f"{p}:3: user ('u') is 300 characters long (an id has at most 256): '{'x' * 40}...'"
    kept = load_csv(p, columns=COLS, skip_bad_rows=True)
    assert kept.skipped_rows == 1 and sorted(kept.users.tolist()) == ["1", "2"]  # a text column: the id rule on the whole column
    cols = [Column("user", "u", text=True), Column("item", "i", text=True), Column("time", "t")]
    wide = _write(tmp_path / "wide.csv", f"u,i,t\n1,10,100\n2,x{'y' * 256},101\n")  # 257 characters: the line-by-line pass
    with pytest.raises(DataFormatError, match=r"wide.csv:3: item \('i'\) is 257 characters long"):
        parse_lines(wide, cols, header=True, sep=",", time_unit=1, skip_bad_rows=False)
    edge = _write(tmp_path / "edge.csv", f"u,i,t\n1,{'z' * 256},100\n")
    assert load_csv(edge, columns=COLS).item_raw_ids.tolist()[1] == "z" * 256


# ----------------------------------------------------------------------------- 6. a numeric feature on a text column
def test_a_numeric_feature_without_numbers_is_refused(tmp_path: Path, caplog):
    """Its quantile edges were [] and every event had the unknown bucket, silently."""
    p = _write(tmp_path / "log.csv", "u,i,t,brand,price\n1,10,100,acme,1.5\n1,11,101,,cheap\n2,10,102,zeta,2.5\n")
    with pytest.raises(DataFormatError, match=r"log.csv: --numeric-feature brand: no value of column 'brand' is a number \(e.g. 'acme'\)"):
        load_csv(p, columns=COLS, numeric_features="brand:4")
    with caplog.at_level("WARNING", logger="hstu.data.delimited"):
        log_ = load_csv(p, columns=COLS, numeric_features="price:4")
    assert [r.getMessage() for r in caplog.records] == [
        f"{p}: numeric feature 'price': 1 of 3 values are not numbers (first 'cheap'): their events get the unknown bucket"
    ]
    assert [str(v) for v in log_.feature_raw["price"].tolist()] == ["1.5", "nan", "2.5"]
    empty = _write(tmp_path / "empty.csv", "u,i,t,price\n1,10,100,\n")  # nothing given: nothing to say
    assert load_csv(empty, columns=COLS, numeric_features="price:4").num_events == 1


# ----------------------------------------------------------------------------- 7. UTF-16 and byte-order marks
BOMS = {"utf-16-le": b"\xff\xfe", "utf-16-be": b"\xfe\xff", "utf-8": b"\xef\xbb\xbf"}


@pytest.mark.parametrize("encoding", list(BOMS))
def test_files_with_a_byte_order_mark_are_decoded_by_it(tmp_path: Path, encoding: str):
    """UTF-16 was read as latin-1 ('ÿþu\\x00' for 'u'); a UTF-8 BOM broke the header in the line-by-line pass."""
    text = _csv([(1, "café", 100, "view", 3), (2, "thé", 101, "buy", 4)])
    p = tmp_path / "log.csv"
    p.write_bytes(BOMS[encoding] + text.encode(encoding))
    log_ = load_csv(p, columns=COLS + ",action=a")
    assert _events(log_) == [(1, "café", 100, "view"), (2, "thé", 101, "buy")]
    assert log_.facts["encodings"] == {"log.csv": "utf-8-sig" if encoding == "utf-8" else "utf-16"}
    p.write_bytes(BOMS[encoding] + (text + "3,1,2,x,3,extra\n").encode(encoding))
    assert _events(load_csv(p, columns=COLS + ",action=a", skip_bad_rows=True)) == _events(log_)  # the line-by-line pass


def test_a_header_only_file_is_named(tmp_path: Path):
    """A file with its header and no row: the error names the file (it named only the data set); several files: all."""
    empty = _write(tmp_path / "empty.csv", "u,i,t\n")
    with pytest.raises(ValueError, match=rf"csv: no events in {empty} after parsing \(skipped 0 malformed rows\)"):
        load_csv(empty, columns=COLS)
    (tmp_path / "d").mkdir()
    a, b = _write(tmp_path / "d" / "a.csv", "u,i,t\n"), _write(tmp_path / "d" / "b.csv", "u,i,t\n")
    with pytest.raises(ValueError, match=rf"no events in its 2 files \({a}, {b}\)"):
        load_csv(tmp_path / "d", columns=COLS)
