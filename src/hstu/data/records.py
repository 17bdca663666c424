"""The records of a delimited text file as ``csv.reader`` splits them, with the line each starts on.

A quoted field may hold line breaks, so a record can span several lines. A quote that is never closed
would make the rest of the file one field: :func:`records` refuses it with a
:class:`~hstu.data.errors.DataFormatError` naming the line the quote opens on (also under
``skip_bad_rows``: skipping that "row" would silently drop every line after it).

A text file may be compressed (``.gz``, ``.bz2``, ``.xz``: :func:`opener`, by its name, as pandas infers it);
:func:`text_suffix` is then the suffix before the compression's (``.tsv`` of ``log.tsv.gz``).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import lzma
from pathlib import Path

from hstu.data.errors import DataFormatError

COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # suffix -> open(path, mode, ...) of the stdlib
UNREAD_COMPRESSIONS = (".zip", ".zst", ".zstd", ".tar", ".tgz", ".7z", ".lz4")


def opener(path: Path):
    """The open function of a text file by its name: gzip / bz2 / lzma for ``.gz`` / ``.bz2`` / ``.xz``, else ``open``.
    ValueError for another archive or compression (``.zip``, ``.zst``, ...), naming the file."""
    suffix = path.suffix.lower()
    if suffix in UNREAD_COMPRESSIONS:
        raise ValueError(f"{path}: {suffix} files are not read; decompress it, or compress it as .gz, .bz2 or .xz")
    return COMPRESSIONS.get(suffix, open)


def text_suffix(path: Path) -> str:
    """The lower-case suffix of a text file's format: ``.tsv`` for ``a.tsv`` and ``a.tsv.gz``."""
    suffixes = [x.lower() for x in path.suffixes]
    return suffixes[-2] if len(suffixes) >= 2 and suffixes[-1] in COMPRESSIONS else path.suffix.lower()


def text_encoding(path: Path) -> str:
    """The encoding of a text file, compressed or not (:func:`hstu.data.movielens.file_encoding`, through :func:`opener`).
    It reads all of the file, so a compressed one cut off or not what its name says fails here: DataFormatError naming
    it (a truncated .gz was an EOFError traceback, a plain file named .bz2 a bare "Invalid data stream")."""
    from hstu.data.movielens import file_encoding

    read = opener(path)
    try:
        return file_encoding(path, read)
    except (EOFError, OSError, lzma.LZMAError) as exc:
        if read is open:
            raise
        raise DataFormatError(
            path, None, f"cannot read it as {path.suffix} compressed text ({exc}): cut off, or not {path.suffix}?"
        ) from None


class _Lines:
    """An iterator over a file's lines that keeps the lines of the record being read (``current``)
    and says when the file has ended (``eof``)."""

    def __init__(self, fh) -> None:
        self.fh, self.current, self.eof = fh, [], False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self.fh.readline()
        if not line:
            self.eof = True
            raise StopIteration
        self.current.append(line)
        return line


def open_quote(lines: list[str], sep: str, quote: str = '"') -> int | None:
    """The 0-based index in ``lines`` (one record's text) of the line on which a quoted field opens that
    is still open at the end of the text, else None; the quoting of ``csv.reader``'s default dialect (a
    quote opens a field only at its start, a doubled quote inside one is a quote)."""
    state, opened = "start", None  # start of a field | in an unquoted field | in a quoted one | after a quote in one
    for k, line in enumerate(lines):
        for ch in line:
            end = ch in (sep, "\n", "\r")
            if state == "quoted":
                state = "quote" if ch == quote else state
            elif state == "quote":  # a doubled quote is one; other text after the closing quote joins the field
                state = "quoted" if ch == quote else "start" if end else "field"
            elif state == "start" and ch == quote:
                state, opened = "quoted", k
            else:
                state = "start" if end else "field"
    return opened if state == "quoted" else None


def _unclosed(path: Path, start: int, lines: list[str], sep: str, end: int, limit: bool) -> DataFormatError:
    """The error of the record starting on line ``start`` (its lines so far: ``lines``, up to line ``end``) that
    ran past csv's field size limit (``limit``) or to the end of the file inside a quoted field."""
    k = open_quote(lines, sep)
    if k is None:  # past the limit without a quote: one huge field
        return DataFormatError(path, start, f"a field longer than {csv.field_size_limit()} characters (by line {end})")
    line = start + k
    if limit:
        what = f"is not closed within {csv.field_size_limit()} characters (by line {end})"
    else:
        what = f"is never closed: it would swallow lines {line}..{end}, the rest of the file ({end - line + 1} lines)"
    return DataFormatError(path, line, f'a quoted field opens on this line (a field starting with ") and {what}; '
                           "fix the quote (an unclosed quote is refused, also with --skip-bad-rows)")  # fmt: skip


def records(path: Path, *, sep: str, encoding: str):
    """(1-based line on which it starts, fields) of each record of a delimited file, as ``csv.reader``
    splits it: a blank line is an empty record, and a quoted field may hold line breaks (the record then
    spans several lines; pandas' C parser counts records the same way). DataFormatError: a quote that is
    never closed (or not within csv's field size limit), naming the line it opens on."""
    with opener(path)(path, "rt", newline="", encoding=encoding, errors="replace") as fh:
        lines = _Lines(fh)
        reader = csv.reader(lines, delimiter=sep)
        start = 1
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                if "field larger than field limit" not in str(exc):
                    raise DataFormatError(path, start, f"cannot split the record starting here: {exc}") from None
                raise _unclosed(path, start, lines.current, sep, reader.line_num, True) from None
            if lines.eof and open_quote(lines.current, sep) is not None:
                raise _unclosed(path, start, lines.current, sep, reader.line_num, False)
            yield start, row
            start, lines.current = reader.line_num + 1, []


def record_line(path: Path, record: int, *, sep: str, encoding: str) -> int | None:
    """The line on which 0-based record ``record`` (the header included, :func:`records`) starts; None past the end."""
    return next((line for k, (line, _) in enumerate(records(path, sep=sep, encoding=encoding)) if k == record), None)


def check_quotes(path: Path, *, sep: str, encoding: str) -> None:
    """Reads every record (:func:`records`): DataFormatError at an unclosed quote, else nothing."""
    for _ in records(path, sep=sep, encoding=encoding):
        pass
