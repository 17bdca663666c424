"""Event times: integer Unix time in a unit (s | ms | us | ns) or ISO 8601 date-times, to the
model's whole seconds, keeping the exact order.

Times start at 1970-01-01T00:00:00Z: the loaders refuse an earlier one (a negative Unix time, which
``hstu generate`` and the HTTP API refuse) as a bad row naming the file, line and field (dropped and
counted under ``skip_bad_rows``). ISO 8601 times end at 2262-04-11T23:47:16.854775807Z (int64 ns), and so
do integer times in the automatic unit (:func:`after_2262`): microseconds or nanoseconds (~1.7e15 / 1.7e18
today) read as milliseconds would land after it, so such a row is refused with a message to set
``time_unit=us`` or ``ns``. An explicit ``time_unit`` reads any int64 value at or after 0.

Events are sorted on the exact time as given, and only then converted to seconds (floor): each
loader frame carries ``time`` (int64 Unix s) and ``subsecond_ns`` (int64, the rest in ns,
0..1e9-1), which :meth:`hstu.data.sequences.EventLog.from_frame` sorts on after ``time``. Sorting
on the pair is sorting on the exact value, whatever the unit, without overflowing int64.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)

MS_THRESHOLD = 100_000_000_000  # 1e11: as seconds that is year 5138, as ms it is 1973
TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
NS_PER_S = 1_000_000_000
UNIT_NAMES = {1: "seconds", 1_000: "milliseconds", 1_000_000: "microseconds", 1_000_000_000: "nanoseconds"}
MAX_SECONDS, MAX_SUBSECOND_NS = divmod(2**63 - 1, NS_PER_S)  # 2262-04-11T23:47:16.854775807Z: the latest time


class TimeRangeError(ValueError):
    """A time that parses but lies before 1970-01-01 (:func:`range_problem` says why)."""


class Times(NamedTuple):
    """A time column as :func:`exact_times` reads it: whole Unix seconds and the sub-second rest in ns,
    masks of the unparsed rows, of the integers in the other unit than most (:func:`unit_of`) and of the
    times out of range (before 1970; with the automatic unit, after 2262: :func:`range_problem`), and the
    ticks per second of its integers."""

    secs: pd.Series
    rest: pd.Series
    bad: np.ndarray
    mixed: np.ndarray
    out: np.ndarray
    per_s: int


def after_2262(secs, rest):
    """Whether times (whole Unix seconds, sub-second ns: ints or arrays) are after 2262-04-11T23:47:16.854775807Z
    (the end of int64 nanoseconds): a bool or a mask."""
    return (secs > MAX_SECONDS) | ((secs == MAX_SECONDS) & (rest > MAX_SUBSECOND_NS))


def range_problem(raw, secs: int, per_s: int | None = None, auto: bool = True) -> str:
    """Why time ``raw`` (as written) at ``secs`` Unix seconds is out of range, for a message after "is ": before
    1970-01-01, or else after 2262 as ``per_s`` ticks per second (:func:`after_2262`), the automatic unit (``auto``)
    or the one set with ``time_unit``: a run's times end there in any unit, as generate and serve take them."""
    if secs < 0:
        return f"{raw!r}, before 1970-01-01 (a negative Unix time: a run's times start at 1970-01-01, as generate and serve require)"
    unit = UNIT_NAMES.get(per_s or 1, "seconds")
    if not auto:
        return f"{raw!r}, which as {unit} (time_unit) is after 2262-04-11, where a run's times end (generate and serve take none later)"
    fix = "microseconds or nanoseconds? set time_unit=us or time_unit=ns in --columns"
    return f"{raw!r}, which as {unit} (the automatic unit) is after 2262-04-11: {fix}"


def split_time(t, unit: int):
    """Integer times in ``unit`` ticks per second -> (whole seconds, floor; the rest in ns, 0..1e9-1).

    ``t``: an int, an int64 array or Series. Sorting on (seconds, rest) is sorting on ``t``.
    """
    secs, rest = t // unit, t % unit
    return secs, rest * (NS_PER_S // unit)


def to_time(s: str, unit: int, explicit: bool = False) -> tuple[int, int]:
    """A time field -> (Unix seconds, floor; the sub-second rest in ns), see :func:`split_time`.
    ValueError: neither an integer (or whole number) in the int64 range nor an ISO 8601 date-time;
    TimeRangeError: before 1970-01-01, or with an ``explicit`` unit (time_unit) after 2262-04-11 (the automatic unit
    is decided, and this checked, on the whole column)."""
    secs, rest = _to_time(s.strip(), unit)
    if secs < 0 or (explicit and after_2262(secs, rest)):
        raise TimeRangeError(range_problem(s.strip(), secs, unit, auto=False))
    return secs, rest


def _to_time(s: str, unit: int) -> tuple[int, int]:
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


def exact_times(col: pd.Series, unit: str | None, path: Path) -> Times:
    """A time column (:class:`Times`): integer Unix time in ``unit`` (auto, :func:`unit_of`: s, or ms when
    the values are >= 1e11; the mixed-unit mask marks the integers on the other side of 1e11), a datetime
    column, or ISO 8601 strings. Both parts come from the exact value (:func:`split_time`), so ms / ns /
    fractional ISO times keep their order; bad rows (unparsed, or outside int64 ns: years 1677..2262) hold
    0; ``out`` marks the parsed times before 1970 or after 2262 (:func:`range_problem`)."""
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
        none = np.zeros(len(col), bool)
        return Times(secs, rest, bad, none, (secs < 0).to_numpy() & ~bad, NS_PER_S)
    num = pd.to_numeric(col, errors="coerce")  # integer Unix time (int64: |t| < 2^63)
    bad = (num.isna() | (num != np.floor(num)) | (num.abs() >= 2.0**63)).to_numpy()
    ticks = num.where(~bad, 0).astype(np.int64)
    per_s, odd = unit_of(ticks[~bad], unit, path)
    mixed = np.zeros(len(col), bool)
    mixed[~bad] = odd
    secs, rest = split_time(ticks, per_s)
    out = (secs < 0) | after_2262(secs, rest)  # in any unit: a run's times end at 2262-04-11, as generate and serve take them
    return Times(secs, rest, bad, mixed, np.asarray(out) & ~bad & ~mixed, per_s)


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
