"""Data errors that name the file and line."""

from __future__ import annotations


class DataFormatError(ValueError):
    """A malformed input row; ``path`` and ``line`` (1-based) say where."""

    def __init__(self, path: object, line: int | None, message: str) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")
        self.path, self.line = path, line


def plural(n: int, noun: str) -> str:
    """ "1 malformed row" / "2 malformed rows": a count the loaders report (``noun`` singular)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
