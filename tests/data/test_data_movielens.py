"""ML-1M loader: the real files, splits, and malformed input with file:line errors."""

from __future__ import annotations

import numpy as np
import pytest

from hstu.data import DataFormatError, load_dataset, make_split
from hstu.data.batching import eval_batch, train_batch
from hstu.data.movielens import load_ratings


@pytest.fixture(scope="module")
def ml1m(request):
    from conftest import ML1M, need

    need(ML1M / "ratings.dat")
    return load_dataset("ml-1m", ML1M)


def test_real_counts(ml1m):
    assert ml1m.num_events == 1_000_209
    assert ml1m.num_users == 6_040
    assert ml1m.num_items == 3_706
    assert ml1m.item_raw_ids[0] == 0 and ml1m.items.min() == 1
    # user 1's first event in this copy of the data (data README): 1::3186::4::978300019
    assert ml1m.item_raw_ids[ml1m.items[0]] == 3186 and ml1m.timestamps[0] == 978300019
    # rating histogram (data README): 1: 56,174 ... 5: 226,310
    assert np.bincount(ml1m.values)[1:].tolist() == [56_174, 107_557, 261_197, 348_971, 226_310]
    # chronological within every user (stable sort)
    d = np.diff(ml1m.timestamps)
    assert (d[np.setdiff1d(np.arange(len(d)), ml1m.offsets[1:-1] - 1)] >= 0).all()
    assert ml1m.titles[1] == "Toy Story (1995)"


def test_splits(ml1m):
    clean, paper = make_split(ml1m, "clean"), make_split(ml1m, "paper")
    ends = ml1m.offsets[1:]
    assert (clean.test_target == ends - 1).all() and (clean.valid_target == ends - 2).all()
    assert (clean.train_end == ends - 2).all()
    assert (paper.train_end == ends - 1).all() and (paper.valid_target == paper.test_target).all()
    users = np.array([0, 5])
    b = eval_batch(ml1m, clean.test_target, users, max_seq_len=200)
    L = b.lengths.numpy()
    assert L[0] == min(200, ml1m.offsets[1] - 1)
    # the query time sits at position `length`: the target's timestamp
    assert b.timestamps[0, L[0]] == ml1m.timestamps[ml1m.offsets[1] - 1]
    assert b.targets[0] == ml1m.items[ml1m.offsets[1] - 1]
    tb = train_batch(ml1m, clean, users, max_seq_len=50)
    assert tb.lengths.max() <= 50
    # most recent events are kept: the last training event is the one before the valid target
    assert tb.ids[0, tb.lengths[0] - 1] == ml1m.items[ml1m.offsets[1] - 3]


def write(tmp_path, ratings: str, movies: str = "1::A (2000)::Drama\n2::B (2001)::Comedy|Drama\n"):
    (tmp_path / "ratings.dat").write_text(ratings, encoding="iso-8859-1")
    (tmp_path / "movies.dat").write_text(movies, encoding="iso-8859-1")
    return tmp_path


@pytest.mark.parametrize(
    "bad,line,msg",
    [
        ("1::1::5::100\n1::2::4\n", 2, "expected 4"),
        ("1::1::5::100\n1::2::4::200\nx::2::4::200\n", 3, "not an integer"),
        ("1::1::5::100\n1::2::4::20.5\n", 2, "not an integer"),
        ("1::1::5::100\n1::2::4::200::9\n", 2, "expected 4"),
        ("1::1::5::100\n99999999999999999999::2::4::200\n", 2, "outside the int64 range"),  # was an OverflowError traceback
        ("1::1::5::100\n4611686018427387905.0::2::4::200\n", 2, "not an integer"),  # the fast parser rounded it to 2^62
        ("1::1::5::100\n1e5::2::4::200\n", 2, "not an integer"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, bad, line, msg):
    d = write(tmp_path, bad)
    with pytest.raises(DataFormatError, match=f"ratings.dat:{line}: .*{msg}"):
        load_dataset("ml-1m", d)


def test_skip_bad_rows_reports_count(tmp_path):
    d = write(tmp_path, "1::1::5::100\n1::2::oops::200\n2::1::3::50\n1::2::4\n2::2::1::60\n1::2::4::300\n" + "9" * 21 + "::1::1::1\n")
    log_ = load_dataset("ml-1m", d, skip_bad_rows=True)
    assert log_.skipped_rows == 3 and log_.num_events == 4
    _, report = load_ratings(d / "ratings.dat", skip_bad_rows=True)
    assert report.skipped == 3 and "ratings.dat:2" in report.first_error


def test_missing_and_unknown(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_dataset("ml-1m", tmp_path / "nope")
    (tmp_path / "movies.dat").write_text("1::A::Drama\n")
    with pytest.raises(FileNotFoundError, match="ratings.dat"):
        load_dataset("ml-1m", tmp_path)
    d = write(tmp_path, "1::1::5::100\n1::9::4::200\n")
    with pytest.raises(DataFormatError, match="not in movies.dat"):
        load_dataset("ml-1m", d)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("netflix", d)
    d = write(tmp_path, "1::1::5::100\n1::2::4::200\n")
    assert load_dataset("ml-1m", d / "ratings.dat").num_events == 2  # a file of the set: its directory
    assert load_dataset("ml-1m", d / "movies.dat").num_events == 2
    (d / "ratings.dat").write_text("")
    with pytest.raises(DataFormatError, match=f"{d / 'ratings.dat'}: no events \\(empty file\\)"):
        load_dataset("ml-1m", d)


def test_ties_keep_file_order(tmp_path):
    d = write(tmp_path, "1::2::5::100\n1::1::4::100\n1::2::3::50\n")
    log_ = load_dataset("ml-1m", d)
    assert log_.item_raw_ids[log_.items].tolist() == [2, 2, 1]
    assert log_.values.tolist() == [3, 5, 4]
