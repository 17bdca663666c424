"""Item metadata from an items file (``hstu train --items FILE``): any data set's titles, categories
or other columns, copied into the run's idmap.json (key ``item_meta``) and shown by ``hstu generate``
and returned by the HTTP API (each recommendation's ``meta``).

File: CSV (``.csv``, comma), TSV (``.tsv`` / ``.tab``, tab) or Parquet (``.parquet``), a header
row, one row per item. The id column is the first of ``item_id``, ``item``, ``id`` (case-insensitive)
present; its values follow the data set's id rule (:mod:`hstu.data.sequences`: trimmed text, or
integers for integer ids). Every other column is kept: CSV / TSV cells as text, Parquet cells as
their column's type (numbers as numbers), empty cells as null; a ``title`` column also becomes the
item's title (as MovieLens titles are). Items of the file that the data set does not have are ignored (their count is
logged); items of the data set without a row have no ``meta``.

Errors name the file and the line (CSV/TSV: the file's line, header = line 1; Parquet: the row,
1-based) or the column: no id column, an empty or bad id, an id given twice, an unreadable file.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd

from hstu.data.errors import DataFormatError
from hstu.data.sequences import EventLog, as_id, is_text

log = logging.getLogger(__name__)

ID_COLUMNS = ("item_id", "item", "id")
SEPARATORS = {".csv": ",", ".tsv": "\t", ".tab": "\t"}


def _read_table(p: Path) -> tuple[pd.DataFrame, int]:
    """(the file as a frame of object columns, line of its first row: 2 for CSV/TSV, 1 for Parquet)."""
    suffix = p.suffix.lower()
    if not p.is_file():
        raise FileNotFoundError(f"--items {p}: not found")
    try:
        if suffix == ".parquet":
            return pd.read_parquet(p), 1
        if suffix not in SEPARATORS:
            raise DataFormatError(p, None, f"unknown items file type {suffix!r}; valid: .csv, .tsv, .tab, .parquet")
        return pd.read_csv(p, sep=SEPARATORS[suffix], dtype=str, keep_default_na=False, encoding="utf-8"), 2
    except UnicodeDecodeError as exc:
        raise DataFormatError(p, None, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, OSError, ValueError) as exc:
        if isinstance(exc, DataFormatError):
            raise
        raise DataFormatError(p, None, f"cannot read the items file: {str(exc).strip()}") from None


def _cell(v):
    """A JSON value of one cell: None for empty / NaN, Python scalars for NumPy ones."""
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    if isinstance(v, (np.generic,)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if isinstance(v, (str, int, float, bool)) else str(v)


def read_item_meta(path: str | Path, log_: EventLog) -> dict[str, dict]:
    """The items file's rows for the items of ``log_``: {str(original id): {column: value}}.

    Args:
        path: the items file (module docstring for its layout).
        log_: the data set; its ``item_raw_ids`` decide the id kind and which rows are kept.
    Returns:
        metadata per known item, keyed by the id's text (JSON object keys), columns in file order.
    Raises:
        FileNotFoundError: no such file. DataFormatError (a ValueError) naming the file and the line
        or column: no id column, an empty / non-integer / repeated id, an unreadable file.
    """
    p = Path(path)
    df, first = _read_table(p)
    lower = {str(c).strip().lower(): c for c in df.columns}
    id_col = next((lower[c] for c in ID_COLUMNS if c in lower), None)
    if id_col is None:
        raise DataFormatError(p, None, f"no id column: expected one of {list(ID_COLUMNS)}, got columns {[str(c) for c in df.columns]}")
    text = is_text(log_.item_raw_ids)
    ids: list = []
    seen: dict = {}
    for i, x in enumerate(df[id_col].tolist()):
        try:
            r = as_id(x, text, f"column {id_col!r}")
        except ValueError as exc:
            raise DataFormatError(p, i + first, str(exc)) from None
        if r in seen:
            raise DataFormatError(p, i + first, f"column {id_col!r}: item {r!r} repeats line {seen[r] + first}")
        seen[r] = i
        ids.append(r)
    known = log_.item_dense(ids) > 0
    if (~known).any():
        log.info("%s: %d of %d items are not in the data set; ignored", p, int((~known).sum()), len(ids))
    cols = [c for c in df.columns if c != id_col]
    values = {c: df[c].tolist() for c in cols}
    return {str(r): {str(c): _cell(values[c][i]) for c in cols} for i, r in enumerate(ids) if known[i]}
