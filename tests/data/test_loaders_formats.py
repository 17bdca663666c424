"""Generic logs (hstu.data.delimited): --format (separator, header or none), columns by position,
several files of one log, and order-only data (no time column: the time bias is off)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hstu.config import ModelConfig
from hstu.data import DataFormatError, load_dataset
from hstu.data.delimited import Format, log_files, parse_format
from hstu.data.ecommerce import load_csv
from hstu.data.prepare import DataSpec, model_config_for, prepare_data
from hstu.model.hstu import build_hstu

FIELDS = ("users", "offsets", "items", "timestamps", "actions", "categories", "item_raw_ids", "category_raw_ids")


def _write(p: Path, text: str) -> Path:
    p.write_text(text, encoding="utf-8")
    return p


def _same(a, b) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None and y is None) or x.tolist() == y.tolist(), f
    assert a.action_names == b.action_names


def _by_hand(rows: list[tuple]) -> dict[int, list[int]]:
    """user -> items in time order, ties in row order (a second method: Python's stable sort)."""
    out: dict[int, list[int]] = {}
    for u, i, _t in sorted(rows, key=lambda r: (r[0], r[2])):
        out.setdefault(u, []).append(i)
    return out


def _sequences(log_) -> dict[int, list[int]]:
    return {int(u): log_.item_raw_ids[log_.items[log_.offsets[k] : log_.offsets[k + 1]]].tolist() for k, u in enumerate(log_.users)}


def test_parse_format():
    assert parse_format(None) == Format() and parse_format("") == Format()
    assert parse_format("sep=;,header=none") == Format(";", False)
    assert parse_format("sep=tab") == Format("\t", True) and parse_format("sep=\\t") == Format("\t", True)
    assert parse_format("header=none,sep=,") == Format(",", False) and parse_format("sep=,") == Format(",", True)
    assert parse_format("sep=|") == Format("|") and parse_format({"sep": ";", "header": "yes"}) == Format(";", True)
    assert Format().sep_for(Path("a.tsv")) == "\t" and Format().sep_for(Path("a.csv")) == ","
    for bad, msg in [("sep=ab", "one character"), ("header=maybe", "header must be"), ("quote='", "unknown key"), ("sep", "key=value")]:
        with pytest.raises(ValueError, match=msg):
            parse_format(bad)


def test_headerless_semicolon_file_by_position(tmp_path: Path, caplog):
    rows = [(1, 10, 300, "view"), (2, 11, 100, "buy"), (1, 12, 200, "view"), (2, 10, 100, "view")]
    semi = _write(tmp_path / "log.txt", "".join(f"{a};{t};{u};{i}\n" for u, i, t, a in rows))  # action;time;user;item
    log_ = load_csv(semi, columns="user=2,item=3,time=1,action=0", format="sep=;,header=none")
    with_header = _write(tmp_path / "log.csv", "u,i,t,a\n" + "".join(f"{u},{i},{t},{a}\n" for u, i, t, a in rows))
    _same(log_, load_csv(with_header, columns="user=u,item=i,time=t,action=a"))
    assert _sequences(log_) == _by_hand([r[:3] for r in rows]) == {1: [12, 10], 2: [11, 10]}
    assert [log_.action_names[a - 1] for a in log_.actions] == ["view", "view", "buy", "view"]
    # positions with a header too, and a .tsv split on tabs without being told
    tsv = _write(tmp_path / "log.tsv", "u\ti\tt\ta\n" + "".join(f"{u}\t{i}\t{t}\t{a}\n" for u, i, t, a in rows))
    _same(log_, load_csv(tsv, columns="user=0,item=1,time=t,action=3"))
    spec = DataSpec("csv", str(semi), options={"columns": "user=2,item=3,time=1", "format": "sep=;,header=none"})
    assert prepare_data(spec)[0].num_events == 4  # the options as a run stores them
    with caplog.at_level("INFO", logger="hstu.data.prepare"):  # a --max-users cut is said, with what it kept
        assert prepare_data(replace(spec, max_users=1))[0].num_events == 2
    assert "csv: the first 1 of 2 users (max_users); 2 events" in [r.getMessage() for r in caplog.records]


def test_headerless_malformed_lines_are_named(tmp_path: Path):
    p = _write(tmp_path / "log.txt", "1;10;100\n1; ;101\n2;11;102\n")
    with pytest.raises(DataFormatError, match=r"log.txt:2: item \('#1'\) is missing"):
        load_csv(p, columns="user=0,item=1,time=2", format="sep=;,header=none")
    assert load_csv(p, columns="user=0,item=1,time=2", format="sep=;,header=none", skip_bad_rows=True).num_events == 2
    p = _write(tmp_path / "wide.txt", "1;10;100\n1;11;101;7\n")
    with pytest.raises(DataFormatError, match=r"wide.txt:2: expected 3 fields"):
        load_csv(p, columns="user=0,item=1,time=2", format="sep=;,header=none")
    with pytest.raises(DataFormatError, match=r"log.txt:1: column '3' \(for time\) is past the last field"):
        load_csv(tmp_path / "log.txt", columns="user=0,item=1,time=3", format="sep=;,header=none")
    with pytest.raises(DataFormatError, match=r"log.txt:1: column 'ts' \(for time\) is not a position"):
        load_csv(tmp_path / "log.txt", columns="user=0,item=1,time=ts", format="sep=;,header=none")
    with pytest.raises(DataFormatError, match=r"log.txt: empty file"):
        load_csv(_write(tmp_path / "log.txt", ""), columns="user=0,item=1", format="header=none")


def test_a_short_row_is_named_by_its_fields(tmp_path: Path):
    """A row with fewer fields than the header was reported as its first missing column ("category is missing"),
    though the others after it were missing too; an empty field is still named as such."""
    head = "user,item,category,time,action\n1,10,3,100,view\n"
    p = _write(tmp_path / "log.csv", head + "1,11\n2,10,3,102,view\n")
    cols = "user=user,item=item,category=category,time=time,action=action"
    with pytest.raises(DataFormatError, match=r"^.*log.csv:3: expected 5 fields \(as the header\), got 2: '1,11'$"):
        load_csv(p, columns=cols)
    assert load_csv(p, columns=cols, skip_bad_rows=True).num_events == 2
    p = _write(tmp_path / "log.csv", head + "1,11,,101,view\n")
    with pytest.raises(DataFormatError, match=r"log.csv:3: category \('category'\) is missing"):
        load_csv(p, columns=cols)
    p = _write(tmp_path / "log.txt", "1;10;100\n1;11\n")  # no header: as wide as the first row
    with pytest.raises(DataFormatError, match=r"log.txt:2: expected 3 fields, got 2: '1,11'$"):
        load_csv(p, columns="user=0,item=1,time=2", format="sep=;,header=none")


def _month_log(tmp_path: Path):
    """Three months of events for 3 users, ties within a month; returns (rows, parts by month)."""
    rng = np.random.default_rng(0)
    rows, parts = [], {}
    for m in range(3):
        t0 = 1_700_000_000 + m * 2_600_000
        part = [(int(rng.integers(1, 4)), int(rng.integers(100, 110)), t0 + int(rng.integers(0, 5)) * 60) for _ in range(12)]
        parts[m] = part
        rows += part
    return rows, parts


def test_several_files_in_the_wrong_order_are_one_sorted_log(tmp_path: Path):
    rows, parts = _month_log(tmp_path)
    (tmp_path / "parts").mkdir()
    names = {0: "part2.csv", 1: "part10.csv", 2: "part11.csv"}  # natural order 2 < 10 < 11 (as text '10' < '11' < '2')
    text = {m: "".join(f"{u},{i},{t}\n" for u, i, t in part[::-1]) for m, part in parts.items()}  # each month unsorted
    for m in parts:
        _write(tmp_path / "parts" / names[m], "user,item,time\n" + text[m])
    one = _write(tmp_path / "all.csv", "user,item,time\n" + "".join(text[m] for m in (2, 0, 1)))  # months mixed up too
    cols = "user=user,item=item,time=time"
    whole = load_csv(one, columns=cols)
    assert _sequences(whole) == _by_hand([r for m in (2, 0, 1) for r in parts[m][::-1]])  # time order, ties as in the file
    wrong = [tmp_path / "parts" / names[m] for m in (2, 0, 1)]
    for given in (wrong, [wrong[1], wrong[0], wrong[2]], tmp_path / "parts", str(tmp_path / "parts" / "part*.csv")):
        got = load_csv(given, columns=cols)
        _same(got, whole)
        assert got.facts["files"] == 3
    assert [p.name for p in log_files(tmp_path / "parts")] == ["part2.csv", "part10.csv", "part11.csv"]
    pd.DataFrame(parts[2], columns=["user", "item", "time"]).to_parquet(tmp_path / "parts" / "part12.parquet")  # mixed formats
    assert load_csv(tmp_path / "parts", columns=cols).num_events == len(rows) + 12
    with pytest.raises(FileNotFoundError, match="no file matches"):
        load_csv(str(tmp_path / "nope*.csv"), columns=cols)
    _write(tmp_path / "parts" / "part10.csv", "user,item,time\n1,2,3\n1,,4\n")
    with pytest.raises(DataFormatError, match=r"part10.csv:3: item \('item'\) is missing"):
        load_csv(tmp_path / "parts", columns=cols)


def test_ties_across_files_follow_the_file_order(tmp_path: Path):
    a = _write(tmp_path / "a.csv", "u,i,t\n1,5,100\n")
    b = _write(tmp_path / "b.csv", "u,i,t\n1,6,100\n")
    assert _sequences(load_csv([a, b], columns="user=u,item=i,time=t")) == {1: [5, 6]}
    assert _sequences(load_csv([b, a], columns="user=u,item=i,time=t")) == {1: [6, 5]}


TINY = dict(max_seq_len=8, max_output_len=2, embedding_dim=16, num_blocks=1, num_heads=2, d_qk=8, d_v=8)


def test_order_only_data_turns_the_time_bias_off(tmp_path: Path):
    p = _write(tmp_path / "seq.csv", "user,item\n1,30\n2,31\n1,10\n1,20\n2,32\n2,30\n")
    log_ = load_dataset("csv", p, columns="user=user,item=item")
    assert log_.facts["order_only"] is True
    assert _sequences(log_) == {1: [30, 10, 20], 2: [31, 32, 30]}  # the file order
    assert log_.timestamps.tolist() == [0] * 6
    cfg = model_config_for(log_, ModelConfig(**TINY), use_features=False)
    assert cfg.use_time_bias is False and cfg.num_items == 5
    timed = load_csv(_write(tmp_path / "t.csv", "user,item,t\n1,30,5\n1,10,9\n"), columns="user=user,item=item,time=t")
    assert "order_only" not in timed.facts and model_config_for(timed, ModelConfig(**TINY), False).use_time_bias is True
    # the time bias contributes nothing: any timestamps give the same encoding; with it on they do not
    ids, L = torch.tensor([[1, 2, 3, 0]]), torch.tensor([3])
    t1, t2 = torch.zeros(1, 4, dtype=torch.long), torch.tensor([[0, 10, 100_000, 100_000]])
    for on in (False, True):
        torch.manual_seed(0)
        m = build_hstu(ModelConfig(**{**TINY, "num_items": 5, "use_time_bias": on})).eval()
        with torch.no_grad():
            same = torch.equal(m.encode(ids, t1, L), m.encode(ids, t2, L))
        assert same is (not on)


def test_text_ids_are_trimmed_case_kept_and_integers_stay_int64(tmp_path: Path):
    rows = " A1YJEY40YUW4SE ,B00004U9V2,1\nA1YJEY40YUW4SE,b00004u9v2 ,2\nu2, 12,3\n"
    log_ = load_csv(_write(tmp_path / "log.csv", "u,i,t\n" + rows), columns="user=u,item=i,time=t")
    assert log_.users.tolist() == ["A1YJEY40YUW4SE", "u2"]
    assert log_.item_raw_ids[log_.items].tolist() == ["B00004U9V2", "b00004u9v2", "12"]  # case kept; '12' is a text id here
    # the line-by-line pass (a row with an extra field stops the C parser) reads the same ids
    slow = load_csv(_write(tmp_path / "slow.csv", "u,i,t\n" + rows + "x,y,4,extra\n"), columns="user=u,item=i,time=t", skip_bad_rows=True)
    assert slow.skipped_rows == 1
    _same(slow, log_)
    p = _write(tmp_path / "slow2.csv", "u,i,t\n" + rows + "x,,4\nx,y,4,extra\n")
    with pytest.raises(DataFormatError, match=r"slow2.csv:5: item \('i'\) is missing"):
        load_csv(p, columns="user=u,item=i,time=t")
    ints = load_csv(_write(tmp_path / "int.csv", "u,i,t\n 7 ,12,1\n7,5,2\n"), columns="user=u,item=i,time=t")
    assert ints.users.dtype == np.int64 and ints.item_raw_ids.tolist() == [0, 5, 12]


def test_one_non_integer_in_an_integer_id_column_is_warned(tmp_path: Path, caplog):
    """The column still becomes text ids (the documented rule), but a column of integers with one odd value says so,
    naming the value and its data row; a column of text ids says nothing."""
    rows = "".join(f"{u},{i},{t}\n" for t, (u, i) in enumerate([(1, 10), (1, 11), (2, "1O"), (2, 12), (3, 10)]))
    with caplog.at_level("WARNING", logger="hstu.data.parsing"):
        log_ = load_csv(_write(tmp_path / "log.csv", "u,i,t\n" + rows), columns="user=u,item=i,time=t")
    assert log_.item_raw_ids[log_.items].tolist() == ["10", "11", "1O", "12", "10"]
    assert [r.getMessage() for r in caplog.records] == [
        "id column 'i': 1 of 5 values are not integers written canonically (first '1O', data row 3): the column is read as "
        "text ids, each as written; fix them if they are typos"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hstu.data.parsing"):
        load_csv(_write(tmp_path / "t.csv", "u,i,t\n1,a,1\n1,b,2\n2,7,3\n"), columns="user=u,item=i,time=t")
    assert not caplog.records


def test_latin1_file_keeps_its_text_ids_apart(tmp_path: Path):
    """Decoded as UTF-8 with replacement, 'café' and 'cafè' (latin-1 0xE9 / 0xE8) were one item."""
    p = tmp_path / "log.tsv"
    p.write_bytes("u\ti\tt\n1\tcafé\t1\n1\tcafè\t2\n2\tcafé\t3\n".encode("iso-8859-1"))
    log_ = load_csv(p, columns="user=u,item=i,time=t")
    assert _sequences(log_) == {1: ["café", "cafè"], 2: ["café"]}
    assert log_.facts["encodings"] == {"log.tsv": "iso-8859-1"}
    wide = tmp_path / "wide.tsv"  # the line-by-line pass reads it the same way
    wide.write_bytes(p.read_bytes() + "3\tthé\t4\textra\n".encode("iso-8859-1"))
    _same(load_csv(wide, columns="user=u,item=i,time=t", skip_bad_rows=True), log_)
    utf8 = _write(tmp_path / "u.tsv", "u\ti\tt\n1\tcafé\t1\n")
    assert "encodings" not in load_csv(utf8, columns="user=u,item=i,time=t").facts


def test_one_file_per_action_type(tmp_path: Path):
    rows = [(1, 10, 5, "view"), (1, 10, 7, "buy"), (2, 11, 1, "view"), (1, 12, 6, "view"), (2, 11, 1, "buy")]
    for a in ("view", "buy"):
        _write(tmp_path / f"{a}.csv", "u,i,t\n" + "".join(f"{u},{i},{t}\n" for u, i, t, b in rows if b == a))
    one = _write(tmp_path / "one.txt", "u,i,t,a\n" + "".join(f"{u},{i},{t},{a}\n" for u, i, t, a in rows if a == "view"))
    with open(one, "a") as fh:
        fh.write("".join(f"{u},{i},{t},{a}\n" for u, i, t, a in rows if a == "buy"))
    got = load_csv([tmp_path / "view.csv", tmp_path / "buy.csv"], columns="user=u,item=i,time=t,action=@file")
    _same(got, load_csv(one, columns="user=u,item=i,time=t,action=a"))
    acts = [got.action_names[a - 1] for a in got.actions]
    assert acts == ["view", "view", "buy", "view", "buy"]  # user 1 at 5, 6, 7; user 2's tie at 1: view.csv first


def test_compressed_parts_are_read_as_their_text(tmp_path: Path, caplog):
    """A trial's finding: a directory's `.csv.gz` part was skipped without a word (events lost), a `.csv.gz` file's
    UTF-8 text ids were decoded as latin-1 ('café' -> 'cafÃ©': the encoding was sniffed on the compressed bytes), and
    a `.tsv.gz` was split on commas. Now gz / bz2 / xz parts read as their uncompressed files do."""
    import bz2
    import gzip
    import lzma

    text = "u\ti\tt\n1\tcafé\t1\n1\tthé\t2\n2\tcafé\t3\n2\tbad\t\n"  # the last row: no time (named by its line)
    (tmp_path / "plain").mkdir()
    plain = _write(tmp_path / "plain" / "log.tsv", text)
    want = load_csv(plain, columns="user=u,item=i,time=t", skip_bad_rows=True)
    assert _sequences(want) == {1: ["café", "thé"], 2: ["café"]}
    for suffix, open_ in ((".gz", gzip.open), (".bz2", bz2.open), (".xz", lzma.open)):
        d = tmp_path / suffix[1:]
        d.mkdir()
        with open_(d / f"log.tsv{suffix}", "wt", encoding="utf-8") as fh:
            fh.write(text)
        _write(d / "README.md", "notes beside the parts\n")
        (d / "older").mkdir()  # a subdirectory is not read either: named with the other files
        with caplog.at_level("WARNING"):
            got = load_csv(d, columns="user=u,item=i,time=t", skip_bad_rows=True)
        _same(got, want)
        assert "encodings" not in got.facts and "not read as event-log parts" in caplog.text and "README.md, older/" in caplog.text
        with pytest.raises(DataFormatError, match=rf"log.tsv{suffix}:5: "):  # the bad row named by its line, as in the plain file
            load_csv(d / f"log.tsv{suffix}", columns="user=u,item=i,time=t")
    whole = (tmp_path / "gz" / "log.tsv.gz").read_bytes()  # cut off, or plain text under a compressed name: one line naming it
    (tmp_path / "cut.csv.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "plain.csv.bz2").write_text(text)
    for name in ("cut.csv.gz", "plain.csv.bz2"):
        with pytest.raises(DataFormatError, match=rf"{name}: cannot read it as \.(gz|bz2) compressed text .*: cut off, or not"):
            load_csv(tmp_path / name, columns="user=u,item=i,time=t")
    (tmp_path / "log.csv.zip").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match=r"log.csv.zip: .zip files are not read; decompress it"):
        load_csv(tmp_path / "log.csv.zip", columns="user=u,item=i,time=t")
