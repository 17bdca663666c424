"""Shared parsing of the e-commerce event logs (:mod:`hstu.data.ecommerce`): file discovery, the
column description, the two CSV passes and the frame -> :class:`~hstu.data.sequences.EventLog` step.

Files are parsed with pandas' C parser first (:func:`read_columns`); only when that fails or a
value is out of range does a line-by-line pass (:func:`parse_lines`) run, naming the first bad
line in a :class:`~hstu.data.errors.DataFormatError` (file, 1-based line) unless ``skip_bad_rows``
(then the row is dropped, counted and logged). Times are split into whole seconds and the
sub-second remainder (:mod:`hstu.data.times`) so that events sort on the exact time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from hstu.data.errors import DataFormatError, plural
from hstu.data.movielens import file_encoding
from hstu.data.records import records
from hstu.data.sequences import CANONICAL_INT, ID_MAX_CHARS, EventLog
from hstu.data.times import TimeRangeError, after_2262, range_problem, split_time, to_time, unit_of, unit_problem

log = logging.getLogger(__name__)

MAPPING_KEYS = ("user", "item", "time", "action", "category")  # the columns a log may have
OUT_NAMES = {"user": "user_id", "item": "item_id", "time": "timestamp", "action": "action", "category": "category"}


@dataclass(frozen=True)
class Column:
    """One input column: ``key`` (user | item | time | action | category), its position in a
    headerless file or its header name, and for actions the allowed values (None: any)."""

    key: str
    source: int | str
    allowed: tuple[str, ...] | None = None
    text: bool = False  # an id column that may hold text ids (:func:`exact_ids`); else integers only


# ----------------------------------------------------------------------------- file discovery
def resolve_path(data_dir: str | Path, names: tuple[str, ...], what: str, exts: tuple[str, ...] = (".csv",)) -> Path:
    """``data_dir`` itself if it is a file; else the first of ``names`` in it; else its only file
    with one of ``exts``. FileNotFoundError says what was looked for."""
    p = Path(data_dir)
    if p.is_file():
        return p
    holding = " or ".join(names) if names else f"exactly one {'/'.join(exts)} file"
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: not found (expected {what}: a file, or a directory holding {holding})")
    for n in names:
        if (p / n).is_file():
            return p / n
    found = sorted(q for q in p.iterdir() if q.is_file() and q.name.lower().endswith(exts))
    if len(found) == 1:
        return found[0]
    listed = ", ".join(q.name for q in found[:5]) or "none"
    seen = f"no {holding} found (files with {'/'.join(exts)}: {listed})" if names else f"expected {holding}, found {len(found)} ({listed})"
    raise FileNotFoundError(f"{p}: {seen}; pass the file path instead")


# ----------------------------------------------------------------------------- ids
def exact_int(v) -> int | None:
    """An id value as an exact Python int, or None: ints as they are, whole floats below 2^53
    (where float64 is still exact), strings such as '12' or '12.0'; anything else None."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return int(v) if float(v).is_integer() and abs(v) < 2**53 else None
    try:
        return int(str(v).strip())
    except ValueError:
        try:
            f = float(str(v))
        except ValueError:
            return None
        return int(f) if f.is_integer() and abs(f) < 2**53 else None


def exact_ids(col: pd.Series, text: bool = False) -> tuple[pd.Series, np.ndarray]:
    """(ids, bad-row mask) of an id column, exactly: an int64 column (or strings that pandas reads
    as int64) as it is, anything else value by value (:func:`exact_int`), so an id past int64 is a
    bad row instead of a float rounded onto another id or a wrapped integer (categories).

    With ``text`` (user and item ids): integer ids when every present value is an int64 integer as
    written (text: canonical decimal, :data:`~hstu.data.sequences.CANONICAL_INT`, so "042", "+8",
    "1e3" and "12.0" are not; an integer or float column: whole values in range), else a text column
    (:func:`_text_or_int_ids`): "042" and "42" stay two ids, and an id past int64 is kept as written.
    Bad rows: missing / empty values (and text ids longer than ID_MAX_CHARS)."""
    if text:
        return _text_or_int_ids(col)
    if col.dtype == object:
        try:
            num = pd.to_numeric(col)
        except (ValueError, TypeError, OverflowError):
            num = None
        col = num if num is not None and num.dtype == np.int64 else col
    if pd.api.types.is_signed_integer_dtype(col):
        return col.astype(np.int64), np.zeros(len(col), bool)
    vals = [exact_int(v) for v in col.tolist()]
    bad = np.array([v is None or not -(2**63) <= v < 2**63 for v in vals], bool)
    return pd.Series([0 if b else v for v, b in zip(vals, bad)], index=col.index, dtype=np.int64), bad


def _text_or_int_ids(col: pd.Series) -> tuple[pd.Series, np.ndarray]:
    """:func:`exact_ids` of a user or item id column (``text``)."""
    if pd.api.types.is_signed_integer_dtype(col):
        return col.astype(np.int64), np.zeros(len(col), bool)
    if isinstance(col.dtype, pd.StringDtype):
        strs = col.fillna("").str.strip()
    else:
        strs = col.astype(object).where(col.notna(), "").map(str).str.strip()
    missing = (strs == "").to_numpy()
    if col.dtype == object or isinstance(col.dtype, pd.StringDtype):  # as written: canonical integers only
        ints = np.array(strs.str.fullmatch(CANONICAL_INT.pattern).to_numpy(dtype=bool, na_value=False))
        long = np.flatnonzero(ints & (strs.str.len() >= 19).to_numpy())  # past int64 from 19 digits on
        ints[long] = [-(2**63) <= int(strs.iloc[i]) < 2**63 for i in long]
        nums = strs.where(ints, "0")
    else:  # numbers (a Parquet uint64 or float column): whole values in the int64 range
        vals = [exact_int(v) for v in col.tolist()]
        ints = np.array([v is not None and -(2**63) <= v < 2**63 for v in vals], bool)
        nums = pd.Series([v if ok else 0 for v, ok in zip(vals, ints)], index=col.index, dtype=object)
    odd = np.flatnonzero(~ints & ~missing)
    if not len(odd):  # via Arrow: 5x faster than astype(np.int64) on strings
        return pd.Series(nums.astype("int64[pyarrow]").to_numpy(np.int64), index=col.index), missing
    n = int((~missing).sum())
    if len(odd) * 2 < n:  # mostly integers: a typo would turn every id of the column into a text id
        log.warning(
            "id column %r: %d of %d values are not integers written canonically (first %r, data row %d): the column is read "
            "as text ids, each as written; fix them if they are typos", col.name, len(odd), n, strs.iloc[odd[0]][:40], odd[0] + 1,
        )  # fmt: skip
    return strs.astype(object), missing | (strs.str.len() > ID_MAX_CHARS).to_numpy()


def id_problem(v, text: bool = False) -> str:
    """What is wrong with a bad id value of :func:`exact_ids` (``text``: of a text-or-integer column), for a message."""
    if pd.isna(v) or not str(v).strip():
        return "missing"
    if text and len(str(v).strip()) > ID_MAX_CHARS:
        return f"{len(str(v).strip())} characters long (an id has at most {ID_MAX_CHARS}): {str(v).strip()[:40] + '...'!r}"
    return f"not an integer in the int64 range: {str(v)[:40]!r}"


# ----------------------------------------------------------------------------- row parsing
def _to_int(s: str) -> int:
    return int(s.strip())


def parse_lines(
    path: Path,
    cols: list[Column],
    *,
    header: bool,
    sep: str,
    time_unit: int | None,
    skip_bad_rows: bool,
    width: int | None = None,
    encoding: str = "utf-8",
) -> tuple[pd.DataFrame, int]:
    """Line-by-line parse naming the first bad line; returns (frame, skipped rows). Without a
    header, a column's ``source`` is its 0-based position and every row holds ``width`` fields
    (default: as many as ``cols``); with one, as many as the header. ``time_unit``: ticks per second
    of integer times, None automatic (:func:`~hstu.data.times.unit_of`: a column of seconds and
    milliseconds is refused). No ``time`` column: the frame has none (order-only data)."""
    out: dict[str, list] = {c.key: [] for c in cols} | {"subsecond_ns": [], "line": []}  # line: where each kept row starts
    skipped, lost, first = 0, 0, None  # lost: the physical lines of the skipped records (a quoted field may span lines)
    idx: dict[str, int] = {}
    width = width or len(cols)
    for line, row in records(path, sep=sep, encoding=encoding):
        if header and not idx:
            idx, width = _header_index(path, row, cols), len(row)
            continue
        if not row or all(not f.strip() for f in row):
            continue
        try:
            vals = _parse_row(path, line, row, cols, idx, width, time_unit)
        except DataFormatError as exc:
            if not skip_bad_rows:
                raise
            skipped, lost = skipped + 1, lost + record_lines(row)
            first = first or str(exc)
            continue
        out["line"].append(line)
        for c, v in zip(cols, vals):
            if c.key == "time":
                v, r = v
                out["subsecond_ns"].append(r)
            out[c.key].append(v)
    out, n, first = _column_checks(path, cols, out, time_unit, skip_bad_rows, first)
    skipped, lost = skipped + n, lost + n
    if skipped:
        spans = f" on {plural(lost, 'line')}" if lost > skipped else ""
        log.warning("%s: skipped %s%s (first: %s)", path, plural(skipped, "malformed row"), spans, first)
    texts = {c.key for c in cols if c.key == "action" or c.key.startswith("feature:") or (c.text and _any_text(out[c.key]))}
    frame = pd.DataFrame({c.key: pd.Series(out[c.key], dtype=object if c.key in texts else np.int64) for c in cols})
    if "time" in out:
        frame["subsecond_ns"] = pd.Series(out["subsecond_ns"], dtype=np.int64)
    return frame, skipped


def _column_checks(
    path: Path, cols: list[Column], out: dict[str, list], time_unit: int | None, skip_bad_rows: bool, first: str | None
) -> tuple[dict[str, list], int, str | None]:
    """:func:`parse_lines`' decisions on whole columns: text-or-integer ids (:func:`exact_ids`) and the
    automatic time unit (:func:`~hstu.data.times.unit_of`; a time after 2262 in it: :func:`~hstu.data.times.range_problem`).
    Returns (``out`` without the bad rows, their count, the first error); raises it unless ``skip_bad_rows``."""
    skipped = 0
    for c in cols:
        auto_time = c.key == "time" and time_unit is None
        if not out[c.key] or not (c.text or auto_time):
            continue
        vals = out[c.key]
        if c.text:
            ids, bad = exact_ids(pd.Series(vals, dtype=object), text=True)
        else:
            per_s, mixed = unit_of(np.array(vals, np.int64), None, path)
            secs, rest = split_time(np.array(vals, np.int64), per_s)
            bad = mixed | after_2262(secs, rest)
        if bad.any():
            i = int(np.argmax(bad))
            if c.text:
                what = id_problem(vals[i], text=True)
            else:
                what = unit_problem(vals[i]) if mixed[i] else range_problem(str(vals[i]), int(secs[i]), per_s)
            exc = DataFormatError(path, out["line"][i], f"{c.key} ({c.source!r}) is {what}")
            if not skip_bad_rows:
                raise exc
            skipped, first = skipped + int(bad.sum()), first or str(exc)
            out = {k: [v for v, b in zip(vs, bad) if not b] for k, vs in out.items()}
        if c.text:
            out[c.key] = ids[~bad].tolist()
        elif per_s != 1:
            out["time"], out["subsecond_ns"] = (x.tolist() for x in split_time(np.array(out["time"], np.int64), per_s))
    return out, skipped, first


def _any_text(vals: list) -> bool:
    return any(isinstance(v, str) for v in vals)


def _header_index(path: Path, row: list[str], cols: list[Column]) -> dict[str, int]:
    names = [h.strip() for h in row]
    idx = {}
    for c in cols:
        if c.source not in names:
            raise DataFormatError(path, 1, f"column {c.source!r} (for {c.key}) not in the header; columns: {names}")
        idx[c.key] = names.index(c.source)
    return idx


def record_lines(row: list[str]) -> int:
    """How many physical lines a record of :func:`~hstu.data.records.records` spans (1 + the line breaks in its quoted fields)."""
    return 1 + sum(f.count("\n") + f.count("\r") - f.count("\r\n") for f in row)


def width_error(path: Path, line: int, row: list[str], width: int, header: bool) -> DataFormatError | None:
    """The error of a row with another number of fields than ``width`` (the header's, with one), else None;
    a record over several lines (a quoted field with line breaks: a stray quote pairs with a later one) says which."""
    if len(row) == width:
        return None
    what = f"{width} fields" + (" (as the header)" if header else "")
    n = record_lines(row)
    span = f" (a quoted field makes lines {line}..{line + n - 1} one record: a stray quote?)" if n > 1 else ""
    return DataFormatError(path, line, f"expected {what}, got {len(row)}{span}: {','.join(row)[:80]!r}")


def row_width_error(path: Path, line: int, *, sep: str, width: int, header: bool, encoding: str) -> DataFormatError | None:
    """:func:`width_error` of the record starting on file line ``line`` (read again: pandas fills a short row's missing fields with NaN)."""
    for start, row in records(path, sep=sep, encoding=encoding):
        if start >= line:
            return width_error(path, line, row, width, header) if row else None
    return None


def _parse_row(path: Path, line: int, row: list[str], cols: list[Column], idx: dict[str, int], width: int, time_unit: int | None) -> list:
    """One record's values (``time_unit`` None: automatic, decided on the whole column: :func:`_column_checks`)."""
    if (bad := width_error(path, line, row, width, bool(idx))) is not None:
        raise bad
    vals = []
    for c in cols:
        raw = row[idx[c.key] if idx else c.source]
        if c.text:  # an id kept as text here; whether the column is integer or text is decided on all of it
            if not raw.strip():
                raise DataFormatError(path, line, f"{c.key} ({c.source!r}) is missing")
            vals.append(raw.strip())
            continue
        if c.key.startswith("feature:"):  # a side feature: any text, empty = unknown (hstu.data.features)
            vals.append(raw.strip() or None)
            continue
        if c.key == "action":
            v = raw.strip()
            if not v:
                raise DataFormatError(path, line, "action is empty")
            if c.allowed is not None and v not in c.allowed:
                raise DataFormatError(path, line, f"unknown action {v!r}; valid: {list(c.allowed)}")
            vals.append(v)
            continue
        try:
            vals.append(to_time(raw, time_unit or 1, time_unit is not None) if c.key == "time" else _to_int(raw))
        except TimeRangeError as exc:
            raise DataFormatError(path, line, f"{c.key} ({c.source!r}) is {exc}") from None
        except (ValueError, OverflowError):
            kind = "a time (integer or ISO 8601)" if c.key == "time" else "an integer"
            raise DataFormatError(path, line, f"{c.key} ({c.source!r}) is not {kind}: {raw[:40]!r}") from None
    return vals


def _parse_fast(path: Path, cols: list[Column], *, header: bool, sep: str) -> pd.DataFrame | None:
    """pandas C parser with integer dtypes; None if anything is off (the slow pass names it)."""
    dtypes = {c.source: (str if c.key == "action" else np.int64) for c in cols}
    if not header and _first_row_width(path, sep) != len(cols):
        return None  # pandas would turn extra leading fields into an index and shift the columns
    try:
        if header:
            # no usecols: with it pandas silently accepts rows with extra fields
            df = pd.read_csv(path, sep=sep, dtype=dtypes, engine="c")[[c.source for c in cols]]
        else:
            df = pd.read_csv(path, sep=sep, header=None, names=[c.source for c in cols], dtype=dtypes, engine="c")
    except (KeyError, ValueError, TypeError, OverflowError, pd.errors.ParserError, UnicodeDecodeError):
        return None
    df = df.rename(columns={c.source: c.key for c in cols})
    for c in cols:
        if c.key == "action":
            col = df["action"]
            if col.isna().any() or (col.str.strip() == "").any():
                return None
            if c.allowed is not None and not col.isin(c.allowed).all():
                return None
    return df[[c.key for c in cols]]


def _first_row_width(path: Path, sep: str) -> int:
    for _, row in records(path, sep=sep, encoding="utf-8"):
        if row and any(f.strip() for f in row):
            return len(row)
    return 0


def read_columns(
    path: Path, cols: list[Column], *, header: bool, sep: str = ",", time_unit: int = 1, skip_bad_rows: bool = False
) -> tuple[pd.DataFrame, int]:
    """(frame with columns = keys of ``cols``, skipped rows). Times are converted with ``time_unit``; one before
    1970 is a bad row (:func:`~hstu.data.times.range_problem`). The line-by-line pass
    reads the file in its encoding (:func:`~hstu.data.movielens.file_encoding`: a byte-order mark is no part of
    the first field; pandas' fast pass drops it itself)."""
    df = _parse_fast(path, cols, header=header, sep=sep)
    if df is not None:
        df["time"], df["subsecond_ns"] = split_time(df["time"], time_unit)
        if not (df["time"] < 0).any():
            return df, 0
    log.info("%s: the fast parser failed or found a bad time; checking line by line", path)
    enc = file_encoding(path)
    return parse_lines(path, cols, header=header, sep=sep, time_unit=time_unit, skip_bad_rows=skip_bad_rows, encoding=enc)


def to_event_log(
    df: pd.DataFrame, *, name: str, action_names: list[str] | None, exclude_history: bool | None, skipped: int, source=None, **items
) -> EventLog:
    """A loader frame (columns = mapping keys, ``feature:NAME`` side features) -> EventLog; ``items``:
    ``titles`` / ``item_genres`` / ``feature_buckets`` (:meth:`EventLog.from_frame`); ``source``: the file or
    files read (a Path or a list of them), named by the error when no event is left."""
    frame = df.rename(columns=OUT_NAMES)
    if frame.empty:
        files = [source] if isinstance(source, (str, Path)) else list(source or [])
        where = (
            " left" if not files else f" in {files[0]}" if len(files) == 1 else f" in its {len(files)} files ({', '.join(map(str, files))})"
        )
        raise ValueError(f"{name}: no events{where} after parsing (skipped {plural(skipped, 'malformed row')})")
    return EventLog.from_frame(
        frame,
        name=name,
        action_names=action_names,
        exclude_history_default=bool(exclude_history) if exclude_history is not None else False,
        skipped_rows=skipped,
        **items,
    )
