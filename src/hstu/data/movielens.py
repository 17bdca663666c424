"""MovieLens loaders for the GroupLens files, each in its native layout (:data:`LAYOUTS`).

Data sets (Harper & Konstan, ACM TiiS 5(4), 2015; the READMEs of each zip):

    ml-100k   u.data   ``user\\titem\\trating\\ttimestamp`` (tabs, no header); u.item ``|``-separated,
              latin-1: ``id|title|release|video release|IMDb URL|`` + 19 genre flags (names from
              u.genre when present, else the README's list)
    ml-1m     ratings.dat ``UserID::MovieID::Rating::Timestamp``; movies.dat ``MovieID::Title::Genres``
              (genres ``|``-separated); users.dat ``UserID::Gender::Age::Occupation::Zip-code``
    ml-10m    ratings.dat / movies.dat as ml-1m, ratings in half stars (0.5 .. 5.0)
    ml-20m, ml-25m, ml-latest, ml-latest-small
              ratings.csv ``userId,movieId,rating,timestamp`` (header, half stars); movies.csv
              ``movieId,title,genres`` (header, titles quoted when they hold a comma)

``EventLog.values`` is the rating in stars for the whole-star sets (100k, 1m) and in half stars
(rating x 2, so 0.5 -> 1, 5.0 -> 10) for the others; ``facts["rating_unit"]`` says which.

Encoding, per file: UTF-8 if the whole file decodes as UTF-8 (ASCII included), else ISO-8859-1
(latin-1, the encoding of the original GroupLens .dat / u.item files, which never fails). The
choice is logged and kept in ``EventLog.facts["encodings"]`` (a run writes it to idmap.json
``data_facts``).

Errors: ratings are parsed by pandas' C parser when every line looks well formed, else line by
line, naming the first bad line as a :class:`~hstu.data.errors.DataFormatError` (file:line) unless
``skip_bad_rows`` (then the rows are dropped, counted and logged). MovieLens may not be
redistributed: this project never ships it.
"""

from __future__ import annotations

import codecs
import csv
import io
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from hstu.data.errors import DataFormatError, plural

log = logging.getLogger(__name__)
ENCODINGS = ("utf-8", "iso-8859-1")  # tried in this order; latin-1 decodes any byte string
# u.genre of ML-100K, in flag order (its README)
ML100K_GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
    "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """One MovieLens release's files: ratings / movies file names, their field separator, whether
    they start with a header row, and whether ratings come in half stars."""

    name: str
    ratings: str
    movies: str
    sep: str  # "::" | "\t" (u.data; u.item is "|") | "," (csv, quoted titles)
    header: bool
    half_stars: bool


LAYOUTS = {
    "ml-100k": Layout("ml-100k", "u.data", "u.item", "\t", False, False),
    "ml-1m": Layout("ml-1m", "ratings.dat", "movies.dat", "::", False, False),
    "ml-10m": Layout("ml-10m", "ratings.dat", "movies.dat", "::", False, True),
    **{n: Layout(n, "ratings.csv", "movies.csv", ",", True, True) for n in ("ml-20m", "ml-25m", "ml-latest", "ml-latest-small")},
}
ALIASES = {"movielens": "ml-1m", "ml1m": "ml-1m"}
_BAD_HALF_STARS = re.compile(r"(?m)^(?!\d+,\d+,\d+(?:\.\d+)?,\d+\r?$).+$")  # a line that is not user,item,rating,time
_INT_TEXT = str.maketrans("", "", "0123456789,\r\n")  # deletes what a whole-star ratings file may hold


@dataclass
class ParseReport:
    rows: int = 0
    skipped: int = 0
    first_error: str | None = None
    encoding: str | None = None  # the one of ENCODINGS the file was decoded with


def decode_text(path: Path, data: bytes) -> tuple[str, str]:
    """(text, encoding) of a MovieLens file's bytes: UTF-8 if it decodes, else ISO-8859-1 (logged)."""
    try:
        return data.decode(ENCODINGS[0]), ENCODINGS[0]
    except UnicodeDecodeError as exc:
        log.info("%s: not UTF-8 (byte %d), read as %s", path, exc.start, ENCODINGS[1])
        return data.decode(ENCODINGS[1]), ENCODINGS[1]


def file_encoding(path: Path, opener=open, chunk: int = 1 << 24) -> str:
    """The encoding of a file read in chunks (``opener``: ``open`` or ``gzip.open``), as :func:`decode_text`
    picks it: UTF-8 if all of it decodes as UTF-8, else ISO-8859-1 (logged, with the offset). A byte-order
    mark decides first: "utf-16" (FF FE or FE FF; the codec reads the mark and the byte order), or
    "utf-8-sig" (EF BB BF; the codec drops the mark, which would otherwise start the first field)."""
    with opener(path, "rb") as fh:
        bom = fh.read(3)
    name = "utf-16" if bom[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE) else "utf-8-sig" if bom == codecs.BOM_UTF8 else ENCODINGS[0]
    dec, pos = codecs.getincrementaldecoder(name)(), 0
    with opener(path, "rb") as fh:
        try:
            while block := fh.read(chunk):
                dec.decode(block)
                pos += len(block)
            dec.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            log.info("%s: not %s (byte %d), read as %s", path, name, pos + exc.start, ENCODINGS[1])
            return ENCODINGS[1]
    if name != ENCODINGS[0]:
        log.info("%s: read as %s (byte-order mark)", path, name)
    return name


def _read_text(path: Path, report: ParseReport) -> str:
    if not path.exists():
        raise FileNotFoundError(f"{path}: file not found (expected the GroupLens MovieLens files in {path.parent})")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataFormatError(path, None, f"cannot read file: {exc}") from exc
    text, report.encoding = decode_text(path, data)
    return text


def _split(line: str, sep: str) -> list[str]:
    return next(csv.reader([line])) if sep == "," else line.split(sep)


def _field(path: Path, lineno: int, raw: str, c: int, kind: str):
    """Field ``c`` (0-based) as ``kind``: "int" (exact, int64 range) or "half" (a rating in half
    stars: '3.5' -> 7); DataFormatError (file:line) otherwise."""
    if kind == "half":
        try:
            v = float(raw) * 2
        except ValueError:
            v = float("nan")
        if not np.isfinite(v) or v != int(v):
            raise DataFormatError(path, lineno, f"field {c + 1} is not a rating in half stars: {raw[:40]!r}")
        return int(v)
    try:
        v = int(raw)
    except ValueError:
        raise DataFormatError(path, lineno, f"field {c + 1} is not an integer: {raw[:40]!r}") from None
    if not -(2**63) <= v < 2**63:
        raise DataFormatError(path, lineno, f"field {c + 1} is outside the int64 range: {raw[:40]!r}")
    return v


def _parse_rows(
    path: Path, text: str, sep: str, nfields: int | None, kinds: dict[int, str], header: bool, skip_bad_rows: bool, report: ParseReport
) -> list[list]:
    """Line-by-line parse of ``text`` (the file ``path``): ``nfields`` fields per line (None: at
    least max(kinds) + 1), fields in ``kinds`` converted (:func:`_field`); blank lines skipped."""
    rows = []
    what = "comma" if sep == "," else repr(sep)
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or (header and lineno == 1):
            continue
        parts = _split(line, sep)
        try:
            if (len(parts) != nfields) if nfields else len(parts) <= max(kinds):
                want = nfields if nfields else f"at least {max(kinds) + 1}"
                raise DataFormatError(path, lineno, f"expected {want} {what}-separated fields, got {len(parts)}: {line[:80]!r}")
            for c, kind in kinds.items():
                parts[c] = _field(path, lineno, parts[c], c, kind)
        except DataFormatError as exc:
            if not skip_bad_rows:
                raise
            report.skipped += 1
            report.first_error = report.first_error or str(exc)
            continue
        rows.append(parts)
    report.rows = len(rows)
    return rows


def _fast_ratings(text: str, layout: Layout) -> np.ndarray | None:
    """(E, 4) int64 ratings of a well-formed file by pandas' C parser, ratings in the layout's unit;
    None if any line is off (the line-by-line parser then names it). pandas reads '1.0' / '1e5'
    as ints, so the text is checked first: ids and times digits only, ratings digits[.digits]."""
    start = (text.find("\n") + 1 or len(text)) if layout.header else 0  # the header line is not data (no copy of the rest)
    if layout.sep != "," and "," in text:  # a comma inside a '::' / tab field would become a separator here
        return None
    body = text.replace(layout.sep, ",") if layout.sep != "," else text
    if layout.half_stars:  # a '.' may sit in the rating only: checked line by line (0.5 s per 1M lines)
        if _BAD_HALF_STARS.search(body, start) is not None:
            return None
    elif body.translate(_INT_TEXT):  # whole stars (no header): digits, ',' and line ends only (a cheap test)
        return None
    try:
        dtypes = {0: np.int64, 1: np.int64, 2: np.float64, 3: np.int64}
        df = pd.read_csv(io.StringIO(body), header=None, skiprows=1 if layout.header else 0, dtype=dtypes)
    except (ValueError, OverflowError, pd.errors.ParserError, pd.errors.EmptyDataError):  # e.g. an id past int64
        return None
    if df.shape[1] != 4:
        return None
    r = df[2].to_numpy() * (2 if layout.half_stars else 1)
    if not (r == np.round(r)).all():
        return None
    df[2] = r.astype(np.int64)
    return df.to_numpy(np.int64)


def _check_header(path: Path, text: str, lay: Layout) -> None:
    """A layout with a header: DataFormatError (line 1) when the first line is data (it would be dropped)."""
    first = text.split("\n", 1)[0].split(",", 1)[0].strip()
    if lay.header and first.lstrip("-").isdigit():
        raise DataFormatError(path, 1, f"expected a header line ({lay.name} files start with one), got data: {text[:60].splitlines()[0]!r}")


def load_ratings(path: Path, skip_bad_rows: bool = False, layout: str | Layout = "ml-1m") -> tuple[pd.DataFrame, ParseReport]:
    """A ratings file of ``layout`` -> DataFrame[user_id, item_id, rating, timestamp] (int64; rating in
    stars, or half stars for a half-star layout), file order kept.

    Raises:
        FileNotFoundError: missing file. DataFormatError: a malformed line (file:line), unless
        ``skip_bad_rows`` (then the count is in the report and logged).
    """
    lay = LAYOUTS[layout] if isinstance(layout, str) else layout
    report = ParseReport()
    text = _read_text(Path(path), report)
    _check_header(Path(path), text, lay)
    arr = _fast_ratings(text, lay)
    if arr is None:  # something is off: the line-by-line parser finds and names it
        kinds = {0: "int", 1: "int", 2: "half" if lay.half_stars else "int", 3: "int"}
        rows = _parse_rows(Path(path), text, lay.sep, 4, kinds, lay.header, skip_bad_rows, report)
        arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
    report.rows = len(arr)
    if report.skipped:
        log.warning("%s: skipped %s (first: %s)", path, plural(report.skipped, "malformed row"), report.first_error)
    return pd.DataFrame(arr, columns=["user_id", "item_id", "rating", "timestamp"]), report


def _genre_names(directory: Path) -> tuple[str, ...]:
    """ML-100K genre names in flag order: u.genre (``name|index``) when present, else the README's."""
    path = directory / "u.genre"
    if not path.exists():
        return ML100K_GENRES
    pairs = [ln.rsplit("|", 1) for ln in _read_text(path, ParseReport()).splitlines() if ln.strip()]
    try:
        return tuple(name for name, _ in sorted(pairs, key=lambda p: int(p[1])))
    except (ValueError, IndexError):
        raise DataFormatError(path, None, "expected 'name|index' lines") from None


def load_movies(path: Path, skip_bad_rows: bool = False, report: ParseReport | None = None, layout: str | Layout = "ml-1m") -> pd.DataFrame:
    """A movies file of ``layout`` -> DataFrame[item_id, title, genres (list of str)]; ``report`` (if
    given) gets the row counts and the encoding the file was read with. "(no genres listed)" is
    no genre."""
    lay = LAYOUTS[layout] if isinstance(layout, str) else layout
    report = report if report is not None else ParseReport()
    path = Path(path)
    text = _read_text(path, report)
    _check_header(path, text, lay)
    if lay.name == "ml-100k":
        names = _genre_names(path.parent)
        rows = _parse_rows(path, text, "|", 5 + len(names), {0: "int"}, False, skip_bad_rows, report)
        genres = [[g for g, flag in zip(names, r[5:]) if flag.strip() == "1"] for r in rows]
    else:
        rows = _parse_rows(path, text, lay.sep, 3, {0: "int"}, lay.header, skip_bad_rows, report)
        genres = [[g for g in r[2].split("|") if g and g != "(no genres listed)"] for r in rows]
    return pd.DataFrame({"item_id": [r[0] for r in rows], "title": [r[1] for r in rows], "genres": genres})


def load_users(path: Path, skip_bad_rows: bool = False) -> pd.DataFrame:
    """ML-1M users.dat -> DataFrame[user_id, gender, age, occupation, zip]."""
    report = ParseReport()
    rows = _parse_rows(Path(path), _read_text(Path(path), report), "::", 5, {0: "int", 2: "int", 3: "int"}, False, skip_bad_rows, report)
    return pd.DataFrame(rows, columns=["user_id", "gender", "age", "occupation", "zip"])


def load_movielens(data_dir: str | Path, skip_bad_rows: bool = False, *, dataset: str = "ml-1m"):
    """Load the MovieLens release ``dataset`` (a :data:`LAYOUTS` name or alias) from ``data_dir`` into
    an :class:`~hstu.data.sequences.EventLog`.

    Items carry their title and genres (genre = category feature, first listed genre).
    ``facts``: ``encodings`` (file name -> encoding read with, see the module docstring) and
    ``rating_unit`` ("stars" | "half stars": the unit of ``values``).

    Raises:
        ValueError: unknown ``dataset``. FileNotFoundError: no such directory / ratings file.
        DataFormatError: a malformed line, no events, or rated movies missing from the movies file.
    """
    from hstu.data.sequences import EventLog

    name = ALIASES.get(dataset, dataset)
    if name not in LAYOUTS:
        raise ValueError(f"unknown MovieLens release {dataset!r}; valid: {sorted(LAYOUTS)}")
    lay = LAYOUTS[name]
    d = Path(data_dir)
    if d.is_file() and d.name in (lay.ratings, lay.movies, "users.dat"):  # a file of the set: its directory
        d = d.parent
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: MovieLens directory not found (download {name}.zip from GroupLens and unzip it)")
    ratings, report = load_ratings(d / lay.ratings, skip_bad_rows, lay)
    if not len(ratings):
        raise DataFormatError(
            d / lay.ratings,
            None,
            "no events" + (f" left after skipping {plural(report.skipped, 'malformed row')}" if report.skipped else " (empty file)"),
        )
    movie_report = ParseReport()
    movies = load_movies(d / lay.movies, skip_bad_rows, movie_report, lay) if (d / lay.movies).exists() else None
    if movies is not None:
        unknown = sorted(set(ratings.item_id.unique().tolist()) - set(movies.item_id.tolist()))
        if unknown:
            raise DataFormatError(d / lay.ratings, None, f"{len(unknown)} movie ids not in {lay.movies}, e.g. {unknown[:5]}")
    titles = dict(zip(movies.item_id, movies.title)) if movies is not None else {}
    genres = dict(zip(movies.item_id, movies.genres)) if movies is not None else {}
    out = EventLog.from_frame(
        ratings.rename(columns={"rating": "value"}),
        name=name,
        titles=titles,
        item_genres=genres,
        exclude_history_default=True,
        skipped_rows=report.skipped,
    )
    out.facts["encodings"] = {lay.ratings: report.encoding, **({lay.movies: movie_report.encoding} if movies is not None else {})}
    out.facts["rating_unit"] = "half stars" if lay.half_stars else "stars"
    return out
