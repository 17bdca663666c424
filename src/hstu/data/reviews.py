"""Review and sequence data sets: Amazon reviews (ratings-only CSV, 5-core JSON lines) and
one-line-per-user sequence files.

Formats
    amazon      McAuley et al. (SIGIR 2015; He & McAuley, WWW 2016), the 2014 and 2018 releases:
                ``ratings_<Cat>.csv`` without header, ``user,item,rating,timestamp`` (Unix s); or
                ``reviews_<Cat>_5.json[.gz]`` / ``<Cat>_5.json[.gz]``, one review per line with the
                keys ``reviewerID``, ``asin``, ``overall`` (rating), ``unixReviewTime`` (Unix s).
                Lines that are not JSON are read as Python literals (the 2014 files were written
                with ``str(dict)``: single quotes). An optional ``meta_<Cat>.json[.gz]`` beside it
                (or ``meta=PATH``) gives titles (``title``) and categories (the most specific
                entry of the first ``categories`` path, 2014; or of ``category``, 2018).
    sequences   one line per user, ``user item item item ...`` separated by spaces or tabs (the
                SASRec / S3-Rec data files, e.g. S3-Rec's Beauty.txt), the items in the order
                they happened. A user on several lines (SASRec's ``user item`` per line) is one
                sequence, in line order. No times: order-only data (:mod:`hstu.data.delimited`).

Ids are text (trimmed, case kept) unless every id of the column is an int64 integer written canonically
(no leading zero or '+': an ASIN "0205616461" stays text; :func:`hstu.data.parsing.exact_ids`). A review
time before 1970 (a negative unixReviewTime) is a malformed line. ``EventLog.values`` holds the Amazon rating (1..5).
Both default to ``exclude_history`` on (catalogue data: a user reviews an item once).
Errors: a malformed line raises :class:`~hstu.data.errors.DataFormatError` naming file and line,
unless ``skip_bad_rows`` (then it is dropped, counted and logged).
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from hstu.data.delimited import Format, read_delimited
from hstu.data.errors import DataFormatError, plural
from hstu.data.movielens import file_encoding
from hstu.data.parsing import exact_ids, resolve_path, to_event_log
from hstu.data.sequences import ID_MAX_CHARS, EventLog
from hstu.data.times import range_problem

log = logging.getLogger(__name__)

AMAZON_KEYS = ("reviewerID", "asin", "overall", "unixReviewTime")
REVIEW_EXTS = (".csv", ".json", ".json.gz", ".jsonl", ".jsonl.gz")


def _lines(path: Path):
    """(1-based line number, text) of a text file, gzip-compressed or not (by its magic bytes), in
    UTF-8 when all of it decodes so, else latin-1 (:func:`hstu.data.movielens.file_encoding`)."""
    with open(path, "rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    try:
        encoding = file_encoding(path, opener)
        with opener(path, "rt", encoding=encoding) as fh:
            yield from enumerate(fh, start=1)
    except (OSError, EOFError) as exc:  # a truncated or corrupt .gz
        raise DataFormatError(path, None, f"cannot read: {exc}") from None


def _record(path: Path, lineno: int, line: str) -> dict:
    """One JSON object, or a Python literal dict (2014 files); DataFormatError otherwise."""
    try:
        rec = json.loads(line)
    except ValueError:
        try:
            rec = ast.literal_eval(line.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise DataFormatError(path, lineno, f"neither JSON nor a Python literal: {line.strip()[:80]!r}") from None
    if not isinstance(rec, dict):
        raise DataFormatError(path, lineno, f"expected an object, got {type(rec).__name__}")
    return rec


def _review(path: Path, lineno: int, rec: dict) -> tuple[str, str, int, int]:
    missing = [k for k in AMAZON_KEYS if k not in rec]
    if missing:
        raise DataFormatError(path, lineno, f"missing key(s) {missing}")
    user, item = str(rec["reviewerID"]).strip(), str(rec["asin"]).strip()
    if not user or not item:
        raise DataFormatError(path, lineno, "empty " + ("reviewerID" if not user else "asin"))
    try:
        rating, t = float(rec["overall"]), rec["unixReviewTime"]
        if isinstance(t, bool) or not isinstance(t, (int, str)) or not rating.is_integer():
            raise ValueError
        t = int(t)
    except (ValueError, TypeError):
        what = f"overall {rec['overall']!r} / unixReviewTime {rec['unixReviewTime']!r}"
        raise DataFormatError(path, lineno, f"{what}: not a whole rating / an integer Unix time") from None
    if t < 0:
        raise DataFormatError(path, lineno, f"unixReviewTime is {range_problem(str(rec['unixReviewTime']), t)}")
    return user, item, int(rating), t


def read_reviews(path: Path, skip_bad_rows: bool = False) -> tuple[pd.DataFrame, int]:
    """5-core JSON lines -> (DataFrame[user_id, item_id, value, timestamp], skipped lines); file order."""
    rows, skipped, first = [], 0, None
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            rows.append(_review(path, lineno, _record(path, lineno, line)))
        except DataFormatError as exc:
            if not skip_bad_rows:
                raise
            skipped, first = skipped + 1, first or str(exc)
    if skipped:
        log.warning("%s: skipped %s (first: %s)", path, plural(skipped, "malformed line"), first)
    df = pd.DataFrame(rows, columns=["user_id", "item_id", "value", "timestamp"])
    return df, skipped


def read_meta(path: Path) -> tuple[dict, dict]:
    """meta JSON lines -> (asin -> title, asin -> [category]); lines that cannot be read are skipped
    (logged: the metadata is optional)."""
    titles, genres, bad = {}, {}, 0
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            rec = _record(path, lineno, line)
        except DataFormatError:
            bad += 1
            continue
        asin = str(rec.get("asin", "")).strip()
        if not asin:
            continue
        if rec.get("title"):
            titles[asin] = str(rec["title"]).strip()
        cats = rec.get("categories") or [rec.get("category") or []]
        leaf = [c for c in (cats[0] if cats and isinstance(cats[0], list) else cats) if isinstance(c, str) and c.strip()]
        if leaf:
            genres[asin] = [leaf[-1].strip()]
    if bad:
        log.warning("%s: %d lines could not be read (skipped)", path, bad)
    return titles, genres


def _amazon_files(data_dir: str | Path, meta: str | None) -> tuple[Path, Path | None]:
    p = Path(data_dir)
    if p.is_dir():
        found = sorted(q for q in p.iterdir() if q.is_file() and q.name.lower().endswith(REVIEW_EXTS) and not q.name.startswith("meta_"))
        if len(found) != 1:
            listed = ", ".join(q.name for q in found[:5]) or "none"
            raise FileNotFoundError(f"{p}: expected one reviews file (.csv, .json[.gz]), found {len(found)} ({listed}); pass the file")
        p = found[0]
    elif not p.is_file():
        raise FileNotFoundError(f"{p}: not found (expected Amazon reviews: ratings_<Cat>.csv or reviews_<Cat>_5.json[.gz])")
    if meta is not None:
        if not Path(meta).is_file():
            raise FileNotFoundError(f"{meta}: meta file not found")
        return p, Path(meta)
    metas = sorted(q for q in p.parent.glob("meta_*") if q.name.lower().endswith(REVIEW_EXTS[1:]))
    return p, (metas[0] if len(metas) == 1 else None)


def load_amazon(
    data_dir: str | Path, skip_bad_rows: bool = False, *, exclude_history: bool | None = None, meta: str | None = None, **options
) -> EventLog:
    """Amazon reviews (the module docstring's formats) -> EventLog named "amazon".

    Raises:
        FileNotFoundError: no such file, or a directory without exactly one reviews file.
        DataFormatError: a malformed line (file:line) unless ``skip_bad_rows``; no events.
        ValueError: unknown options.
    """
    if options:
        raise ValueError(f"amazon: unknown option(s) {sorted(options)}; valid: exclude_history, meta")
    path, meta_path = _amazon_files(data_dir, meta)
    excl = True if exclude_history is None else bool(exclude_history)
    titles, genres = read_meta(meta_path) if meta_path is not None else ({}, {})
    if path.name.lower().endswith(".csv"):
        cols, fmt = {"user": "0", "item": "1", "time": "3"}, Format(",", False)
        df, skipped = read_delimited(path, cols, None, fmt, skip_bad_rows, file_encoding(path))
        out = to_event_log(
            df, name="amazon", action_names=None, exclude_history=excl, skipped=skipped, source=path, titles=titles, item_genres=genres
        )
        out.facts["format"] = "ratings csv"
        return out
    df, skipped = read_reviews(path, skip_bad_rows)
    if df.empty:
        raise DataFormatError(path, None, "no reviews" + (f" left after skipping {skipped} malformed lines" if skipped else ""))
    out = EventLog.from_frame(df, name="amazon", titles=titles, item_genres=genres, exclude_history_default=excl, skipped_rows=skipped)
    out.facts["format"] = "5-core json lines"
    return out


def load_sequences(data_dir: str | Path, skip_bad_rows: bool = False, *, exclude_history: bool | None = None, **options) -> EventLog:
    """One-line-per-user sequence file (``user item item ...``) -> order-only EventLog "sequences".

    ``data_dir``: the file, or a directory holding exactly one .txt file. Timestamps are 0 and
    ``facts["order_only"]`` is set (the time bias goes off, :func:`hstu.data.prepare.model_config_for`).

    Raises:
        FileNotFoundError. DataFormatError: a line with a user and no items (file:line) unless
        ``skip_bad_rows``; no events. ValueError: unknown options.
    """
    if options:
        raise ValueError(f"sequences: unknown option(s) {sorted(options)}; valid: exclude_history")
    path = resolve_path(data_dir, (), "a sequence file (user item item ...)", exts=(".txt",))
    users, items, skipped, first = [], [], 0, None
    for lineno, line in _lines(path):
        tokens = line.split()
        if not tokens:
            continue
        if len(tokens) < 2:
            exc = DataFormatError(path, lineno, f"user {tokens[0][:40]!r} has no items (expected 'user item item ...')")
            if not skip_bad_rows:
                raise exc
            skipped, first = skipped + 1, first or str(exc)
            continue
        users += [tokens[0]] * (len(tokens) - 1)
        items += tokens[1:]
    if skipped:
        log.warning("%s: skipped %s without items (first: %s)", path, plural(skipped, "line"), first)
    if not items:
        raise DataFormatError(path, None, "no events" + (f" left after skipping {skipped} lines" if skipped else " (empty file)"))
    u, i = _token_ids(path, "user", users), _token_ids(path, "item", items)
    frame = pd.DataFrame({"user_id": u, "item_id": i, "timestamp": np.zeros(len(items), np.int64)})
    excl = True if exclude_history is None else bool(exclude_history)
    out = EventLog.from_frame(frame, name="sequences", exclude_history_default=excl, skipped_rows=skipped)
    out.facts["order_only"] = True
    log.info("sequences: order-only data (the line order is the order; the time bias is off)")
    return out


def _token_ids(path: Path, what: str, tokens: list[str]) -> pd.Series:
    """Tokens as ids (:func:`exact_ids`: int64 when all are int64 integers written canonically, else text). Tokens
    are never empty, so the only bad one is a text id longer than ID_MAX_CHARS (DataFormatError)."""
    ids, bad = exact_ids(pd.Series(tokens, dtype=object), text=True)
    if bad.any():
        raise DataFormatError(path, None, f"{what} {tokens[int(np.argmax(bad))][:40]!r}... is longer than {ID_MAX_CHARS} characters")
    return ids


LOADERS = {"amazon": load_amazon, "sequences": load_sequences}
