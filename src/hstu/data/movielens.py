"""MovieLens-1M loader for the GroupLens files (``::`` separated).

Encoding, per file: UTF-8 if the whole file decodes as UTF-8 (ASCII included), else ISO-8859-1
(latin-1, the encoding of the original GroupLens files, which never fails). The choice is logged and
kept in ``EventLog.facts["encodings"]`` (a run writes it to idmap.json ``data_facts``).

Files: ratings.dat (UserID::MovieID::Rating::Timestamp), movies.dat (MovieID::Title::Genres),
users.dat (UserID::Gender::Age::Occupation::Zip-code). Harper & Konstan, ACM TiiS 5(4), 2015.
MovieLens may not be redistributed: this project never ships it.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from hstu.data.errors import DataFormatError

log = logging.getLogger(__name__)
ENCODINGS = ("utf-8", "iso-8859-1")  # tried in this order; latin-1 decodes any byte string


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


def _read_lines(path: Path, report: ParseReport) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: file not found (expected the GroupLens ML-1M files in {path.parent})")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataFormatError(path, None, f"cannot read file: {exc}") from exc
    text, report.encoding = decode_text(path, data)
    return text.splitlines()


def _parse_int_rows(path: Path, nfields: int, int_cols: tuple[int, ...], skip_bad_rows: bool, report: ParseReport) -> list[list]:
    rows = []
    for lineno, line in enumerate(_read_lines(path, report), start=1):
        if not line.strip():
            continue
        parts = line.split("::")
        try:
            if len(parts) != nfields:
                raise DataFormatError(path, lineno, f"expected {nfields} '::'-separated fields, got {len(parts)}: {line[:80]!r}")
            for c in int_cols:
                try:
                    parts[c] = int(parts[c])
                except ValueError:
                    raise DataFormatError(path, lineno, f"field {c + 1} is not an integer: {parts[c][:40]!r}") from None
                if not -(2**63) <= parts[c] < 2**63:
                    raise DataFormatError(path, lineno, f"field {c + 1} is outside the int64 range: {str(parts[c])[:40]!r}")
        except DataFormatError as exc:
            if not skip_bad_rows:
                raise
            report.skipped += 1
            report.first_error = report.first_error or str(exc)
            continue
        rows.append(parts)
    report.rows = len(rows)
    return rows


def _fast_int_table(path: Path, nfields: int, report: ParseReport) -> np.ndarray | None:
    """Parse an all-integer '::' file with pandas' C parser; None if any row is malformed."""
    text = "\n".join(_read_lines(path, report))
    if "," in text or "." in text or "e" in text or "E" in text:  # pandas would read '1.0' / '1e5' as ints: the slow parser refuses them
        return None
    try:
        df = pd.read_csv(io.StringIO(text.replace("::", ",")), header=None, dtype=np.int64, skip_blank_lines=True)
    except (ValueError, OverflowError, pd.errors.ParserError):  # e.g. an id past int64: the slow parser names it
        return None
    return df.to_numpy() if df.shape[1] == nfields else None


def load_ratings(path: Path, skip_bad_rows: bool = False) -> tuple[pd.DataFrame, ParseReport]:
    """ratings.dat -> DataFrame[user_id, item_id, rating, timestamp] (int64), file order kept.

    Raises:
        FileNotFoundError: missing file. DataFormatError: a malformed line (file:line), unless
        ``skip_bad_rows`` (then the count is in the report and logged).
    """
    report = ParseReport()
    arr = _fast_int_table(Path(path), 4, report)
    if arr is None:  # something is off: the line-by-line parser finds and names it
        rows = _parse_int_rows(Path(path), 4, (0, 1, 2, 3), skip_bad_rows, report)
        arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
    report.rows = len(arr)
    if report.skipped:
        log.warning("%s: skipped %d malformed rows (first: %s)", path, report.skipped, report.first_error)
    return pd.DataFrame(arr, columns=["user_id", "item_id", "rating", "timestamp"]), report


def load_movies(path: Path, skip_bad_rows: bool = False, report: ParseReport | None = None) -> pd.DataFrame:
    """movies.dat -> DataFrame[item_id, title, genres (list of str)]; ``report`` (if given) gets
    the row counts and the encoding the file was read with."""
    report = report if report is not None else ParseReport()
    rows = _parse_int_rows(Path(path), 3, (0,), skip_bad_rows, report)
    return pd.DataFrame({"item_id": [r[0] for r in rows], "title": [r[1] for r in rows], "genres": [r[2].split("|") for r in rows]})


def load_users(path: Path, skip_bad_rows: bool = False) -> pd.DataFrame:
    """users.dat -> DataFrame[user_id, gender, age, occupation, zip]."""
    report = ParseReport()
    rows = _parse_int_rows(Path(path), 5, (0, 2, 3), skip_bad_rows, report)
    return pd.DataFrame(rows, columns=["user_id", "gender", "age", "occupation", "zip"])


def load_movielens(data_dir: str | Path, skip_bad_rows: bool = False):
    """Load ML-1M from ``data_dir`` into an :class:`~hstu.data.sequences.EventLog`.

    Items carry their title and genres (genre = category feature, first listed genre).
    ``facts["encodings"]``: file name -> encoding read with (see the module docstring).
    """
    from hstu.data.sequences import EventLog

    d = Path(data_dir)
    if d.is_file() and d.name in ("ratings.dat", "movies.dat", "users.dat"):  # a file of the set: its directory
        d = d.parent
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: MovieLens-1M directory not found (download ml-1m.zip from GroupLens and unzip it)")
    ratings, report = load_ratings(d / "ratings.dat", skip_bad_rows)
    if not len(ratings):
        raise DataFormatError(
            d / "ratings.dat",
            None,
            "no events" + (f" left after skipping {report.skipped} malformed rows" if report.skipped else " (empty file)"),
        )
    movie_report = ParseReport()
    movies = load_movies(d / "movies.dat", skip_bad_rows, movie_report) if (d / "movies.dat").exists() else None
    if movies is not None:
        known = set(movies.item_id.tolist())
        unknown = sorted(set(ratings.item_id.unique().tolist()) - known)
        if unknown:
            raise DataFormatError(d / "ratings.dat", None, f"{len(unknown)} movie ids not in movies.dat, e.g. {unknown[:5]}")
    titles = dict(zip(movies.item_id, movies.title)) if movies is not None else {}
    genres = dict(zip(movies.item_id, movies.genres)) if movies is not None else {}
    out = EventLog.from_frame(
        ratings.rename(columns={"rating": "value"}),
        name="ml-1m",
        titles=titles,
        item_genres=genres,
        exclude_history_default=True,
        skipped_rows=report.skipped,
    )
    out.facts["encodings"] = {"ratings.dat": report.encoding, **({"movies.dat": movie_report.encoding} if movies is not None else {})}
    return out
