"""Event times: integer Unix time in a unit (s | ms | us | ns) or ISO 8601 date-times, to the
model's whole seconds, keeping the exact order.

Events are sorted on the exact time as given, and only then converted to seconds (floor): each
loader frame carries ``time`` (int64 Unix s) and ``subsecond_ns`` (int64, the rest in ns,
0..1e9-1), which :meth:`hstu.data.sequences.EventLog.from_frame` sorts on after ``time``. Sorting
on the pair is sorting on the exact value, whatever the unit, without overflowing int64.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)

MS_THRESHOLD = 100_000_000_000  # 1e11: as seconds that is year 5138, as ms it is 1973
TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
NS_PER_S = 1_000_000_000


def split_time(t, unit: int):
    """Integer times in ``unit`` ticks per second -> (whole seconds, floor; the rest in ns, 0..1e9-1).

    ``t``: an int, an int64 array or Series. Sorting on (seconds, rest) is sorting on ``t``.
    """
    secs, rest = t // unit, t % unit
    return secs, rest * (NS_PER_S // unit)


def to_time(s: str, unit: int) -> tuple[int, int]:
    """A time field -> (Unix seconds, floor; the sub-second rest in ns), see :func:`split_time`.
    ValueError: neither an integer (or whole number) in the int64 range nor an ISO 8601 date-time."""
    s = s.strip()
    try:
        v = int(s)
    except ValueError:
        try:
            f = float(s)
        except ValueError:
            ts = pd.Timestamp(s)  # ValueError if not a date-time
            if pd.isna(ts):
                raise ValueError(f"not a time: {s!r}") from None
            if ts.tzinfo is None:
                ts = ts.tz_localize("UTC")
            return split_time((ts - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(1, "ns"), NS_PER_S)
        if not np.isfinite(f) or f != int(f):
            raise ValueError(f"not an integer time: {s!r}") from None
        v = int(f)
    if not -(2**63) <= v < 2**63:  # as the pandas pass (exact_times): an int64 column
        raise ValueError(f"not an int64 time: {s!r}")
    return split_time(v, unit)


def exact_times(col: pd.Series, unit: str | None, path: Path) -> tuple[pd.Series, pd.Series, np.ndarray, np.ndarray]:
    """(Unix seconds, sub-second rest in ns, bad-row mask, mixed-unit mask) of a time column: integer
    Unix time in ``unit`` (auto, :func:`unit_of`: s, or ms when the values are >= 1e11; the mixed-unit
    mask marks the integers on the other side of 1e11), a datetime column, or ISO 8601 strings.
    Both parts come from the exact value (:func:`split_time`), so ms / ns / fractional ISO times
    keep their order; bad rows (unparsed, or outside int64 ns: years 1677..2262) hold 0."""
    epoch = pd.Timestamp(0, tz="UTC")
    if pd.api.types.is_datetime64_any_dtype(col) or not _mostly_numbers(col):
        t = (
            col
            if pd.api.types.is_datetime64_any_dtype(col)
            else pd.to_datetime(col.where(col.notna(), None).astype(str), errors="coerce", utc=True, format="ISO8601")
        )
        t = t.dt.tz_localize("UTC") if t.dt.tz is None else t
        lo, hi = (x.tz_localize("UTC") for x in (pd.Timestamp.min, pd.Timestamp.max))  # int64 ns: years 1677..2262
        bad = (t.isna() | (t < lo) | (t > hi)).to_numpy()  # "-100" parses as the year -100
        ns = (t.where(~bad, epoch) - epoch) // pd.Timedelta(1, "ns")  # int64 ns: NaT rows set to 0 first (NaN would make it float)
        secs, rest = split_time(ns.astype(np.int64), NS_PER_S)
        return secs, rest, bad, np.zeros(len(col), bool)
    num = pd.to_numeric(col, errors="coerce")  # integer Unix time (int64: |t| < 2^63)
    bad = (num.isna() | (num != np.floor(num)) | (num.abs() >= 2.0**63)).to_numpy()
    ticks = num.where(~bad, 0).astype(np.int64)
    per_s, odd = unit_of(ticks[~bad], unit, path)
    mixed = np.zeros(len(col), bool)
    mixed[~bad] = odd
    secs, rest = split_time(ticks, per_s)
    return secs, rest, bad, mixed


def _mostly_numbers(col: pd.Series) -> bool:
    return pd.to_numeric(col, errors="coerce").notna().sum() * 2 >= col.notna().sum()


def unit_of(t, unit: str | None, path: Path) -> tuple[int, np.ndarray]:
    """(ticks per second, mixed-unit mask) of integer times ``t`` ((n,) int64): ``unit``'s, nothing
    marked; else automatic: ms when most values are >= 1e11, else s, marking the values on the other
    side of 1e11 (seconds and milliseconds in one column: the loaders refuse them, :func:`unit_problem`)."""
    big = np.asarray(t) >= MS_THRESHOLD
    if unit is not None:
        return TIME_UNITS[unit], np.zeros(len(big), bool)
    if int(big.sum()) * 2 > len(big):
        log.info("%s: the timestamps are >= 1e11, reading them as milliseconds (set time_unit= to override)", path)
        return TIME_UNITS["ms"], ~big
    return 1, big


def unit_problem(v: int) -> str:
    """Why integer time ``v``, marked by :func:`unit_of`, is on the other side of 1e11 than most, for a message."""
    ms, s = "milliseconds (>= 1e11)", "seconds (< 1e11)"
    mine, most = (ms, s) if v >= MS_THRESHOLD else (s, ms)
    return f"{v}, which looks like {mine} while most of the column is {most}: fix the row or set time_unit= in --columns"
