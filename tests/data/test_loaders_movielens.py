"""MovieLens 100K / 10M / 20M / 25M / latest in their native layouts (small files written here):
values, titles (latin-1, quoted commas), genres, malformed lines named by file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hstu.data import DataFormatError, load_dataset
from hstu.data.movielens import LAYOUTS, ML100K_GENRES, load_ratings

CAFE = "Café au lait (1993)"  # é is 0xE9 in latin-1, two bytes in UTF-8


def _flags(*genres: str) -> str:
    return "|".join("1" if g in genres else "0" for g in ML100K_GENRES)


def _ml100k(d: Path, data: str) -> Path:
    d.mkdir(exist_ok=True)
    (d / "u.data").write_text(data, encoding="ascii")
    items = [
        f"1|Toy Story (1995)|01-Jan-1995||http://us.imdb.com/M/title-exact?Toy%20Story%20(1995)|{_flags('Animation', 'Comedy')}",
        f"2|{CAFE}|01-Jan-1993||http://x|{_flags('Drama')}",
        f"3|unknown|||x|{_flags('unknown')}",
    ]
    (d / "u.item").write_bytes(("\n".join(items) + "\n").encode("iso-8859-1"))
    return d


def test_ml100k_tab_separated_and_latin1_items(tmp_path):
    d = _ml100k(tmp_path / "ml-100k", "196\t2\t3\t881250949\n196\t1\t5\t881250900\n22\t3\t1\t878887116\n22\t1\t4\t878887116\n")
    log_ = load_dataset("ml-100k", d)
    assert log_.name == "ml-100k" and log_.users.tolist() == [22, 196]
    assert log_.item_raw_ids[log_.items].tolist() == [3, 1, 1, 2]  # per user by time, the tie (22) in file order
    assert log_.values.tolist() == [1, 4, 5, 3] and log_.timestamps.tolist() == [878887116, 878887116, 881250900, 881250949]
    assert log_.titles[2] == CAFE and log_.titles[1] == "Toy Story (1995)"
    assert log_.item_genres[1] == ["Animation", "Comedy"] and log_.item_genres[2] == ["Drama"]
    assert log_.facts["encodings"] == {"u.data": "utf-8", "u.item": "iso-8859-1"} and log_.facts["rating_unit"] == "stars"
    assert log_.exclude_history_default is True
    # u.genre, when present, names the flags
    (d / "u.genre").write_text("".join(f"G{i}|{i}\n" for i in range(19)))
    assert load_dataset("ml-100k", d).item_genres[2] == ["G8"]


@pytest.mark.parametrize(
    "bad,line,msg",
    [
        ("1\t1\t5\t100\n1\t2\tx\t200\n", 2, "field 3 is not an integer: 'x'"),
        ("1\t1\t5\t100\n1\t2\t4\n", 2, "expected 4 '\\\\t'-separated fields, got 3"),
        ("1\t1\t5\t100\n1\t2\t4.5\t200\n", 2, "field 3 is not an integer"),  # whole stars in 100K
        ("1\t1\t5\t100\n1\t2,4\t200\n", 2, "expected 4 '\\\\t'-separated fields, got 3"),  # not read as 1,2,4,200
    ],
)
def test_ml100k_malformed_lines(tmp_path, bad, line, msg):
    d = _ml100k(tmp_path / "ml-100k", bad)
    with pytest.raises(DataFormatError, match=f"u.data:{line}: {msg}"):
        load_dataset("ml-100k", d)
    log_ = load_dataset("ml-100k", d, skip_bad_rows=True)
    assert log_.skipped_rows == 1 and log_.num_events == 1


def test_ml10m_half_stars(tmp_path):
    (tmp_path / "ratings.dat").write_text("1::122::5::838985046\n1::185::4.5::838983525\n2::122::0.5::868245777\n")
    (tmp_path / "movies.dat").write_text("122::Boomerang (1992)::Comedy|Romance\n185::Net, The (1995)::Action|Crime|Thriller\n")
    log_ = load_dataset("ml-10m", tmp_path)
    assert log_.values.tolist() == [9, 10, 1]  # half stars: 4.5 -> 9, 5 -> 10, 0.5 -> 1 (user 1 by time: 185 then 122)
    assert log_.item_raw_ids[log_.items].tolist() == [185, 122, 122]
    assert log_.titles[185] == "Net, The (1995)" and log_.facts["rating_unit"] == "half stars"
    (tmp_path / "ratings.dat").write_text("1::122::5::838985046\n1::185::4.25::838983525\n")
    with pytest.raises(DataFormatError, match=r"ratings.dat:2: field 3 is not a rating in half stars: '4.25'"):
        load_dataset("ml-10m", tmp_path)
    (tmp_path / "ratings.dat").write_text("1::122::5::838985046\n1.0::185::4::838983525\n")  # pandas would read 1.0 as 1
    with pytest.raises(DataFormatError, match=r"ratings.dat:2: field 1 is not an integer: '1.0'"):
        load_dataset("ml-10m", tmp_path)
    with pytest.raises(DataFormatError, match="not an integer"):  # ML-1M itself keeps whole stars
        load_dataset("ml-1m", tmp_path)
    (tmp_path / "ratings.dat").write_text("1::122::5::838985046\n1::185,4::838983525\n")  # a comma is no separator
    with pytest.raises(DataFormatError, match=r"ratings.dat:2: expected 4 '::'-separated fields, got 3"):
        load_dataset("ml-10m", tmp_path)


def test_csv_release_needs_its_header(tmp_path):
    (tmp_path / "ratings.csv").write_text("1,11,3.5,1112486027\n1,1,4.0,1112484676\n")  # the header left out
    with pytest.raises(DataFormatError, match=r"ratings.csv:1: expected a header line"):
        load_dataset("ml-latest-small", tmp_path)


MOVIES_CSV = (
    "movieId,title,genres\n"
    "1,Toy Story (1995),Adventure|Animation|Children|Comedy|Fantasy\n"
    '11,"American President, The (1995)",Comedy|Drama|Romance\n'
    "209171,Sans titre (2019),(no genres listed)\n"
)


@pytest.mark.parametrize("name", ["ml-20m", "ml-25m", "ml-latest", "ml-latest-small"])
def test_csv_releases(tmp_path, name):
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n1,11,3.5,1112486027\n1,1,4.0,1112484676\n3,209171,0.5,1439472215\n"
    )
    (tmp_path / "movies.csv").write_text(MOVIES_CSV)
    log_ = load_dataset(name, tmp_path)
    assert log_.name == name and log_.users.tolist() == [1, 3]
    assert log_.item_raw_ids[log_.items].tolist() == [1, 11, 209171] and log_.values.tolist() == [8, 7, 1]
    assert log_.titles[11] == "American President, The (1995)"  # the quoted comma
    assert log_.item_genres[11] == ["Comedy", "Drama", "Romance"] and log_.item_genres[209171] == []
    assert load_dataset(name, tmp_path / "ratings.csv").num_events == 3  # a file of the set: its directory


def test_csv_release_errors_name_the_line(tmp_path):
    (tmp_path / "movies.csv").write_text(MOVIES_CSV)
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,11,3.5,1112486027\n1,1,4.0\n")
    with pytest.raises(DataFormatError, match=r"ratings.csv:3: expected 4 comma-separated fields, got 3"):
        load_dataset("ml-25m", tmp_path)
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,11,3.5,1112486027\n1,99,4.0,1\n")
    with pytest.raises(DataFormatError, match=r"1 movie ids not in movies.csv, e.g. \[99\]"):
        load_dataset("ml-25m", tmp_path)
    (tmp_path / "movies.csv").write_text(MOVIES_CSV + "x,Bad,Drama\n")
    with pytest.raises(DataFormatError, match=r"movies.csv:5: field 1 is not an integer: 'x'"):
        load_dataset("ml-25m", tmp_path)
    with pytest.raises(FileNotFoundError, match="ml-25m.zip"):
        load_dataset("ml-25m", tmp_path / "nope")
    with pytest.raises(ValueError, match="fixed layout"):
        load_dataset("ml-25m", tmp_path, columns="user=a,item=b")


def test_fast_and_line_by_line_parsers_agree(tmp_path):
    """The same ratings through pandas (well-formed file) and line by line (one skipped bad line)."""
    rows = [(u, i, r, 1_000_000 + 7 * u + i) for u in range(1, 30) for i, r in ((3, "4.5"), (1, "2.0"), (2, "0.5"))]
    body = "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows)
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    good.write_text("userId,movieId,rating,timestamp\n" + body)
    bad.write_text("userId,movieId,rating,timestamp\n" + body + "1,2,x,3\n")
    a, ra = load_ratings(good, layout=LAYOUTS["ml-25m"])
    b, rb = load_ratings(bad, skip_bad_rows=True, layout="ml-25m")
    assert ra.skipped == 0 and rb.skipped == 1 and "bad.csv:89" in rb.first_error
    assert a.equals(b) and a.rating.tolist()[:3] == [9, 4, 1]
