"""The parts and the output file of a batch job (:mod:`hstu.generate.batch`): ``OUT.parts/``, one file per finished
chunk beside ``job.json``, and ``OUT``, their concatenation in chunk order.

Every file is written whole or not at all, and durably (:func:`atomic_write`: temp file, flush + fsync, rename, the
directory fsynced), so a kill or a power cut leaves no part that looks finished but is not. A rerun still checks each
part before it trusts it (:func:`part_problem`: it parses, it holds its chunk's rows; Parquet: from its footer): a part
cut off or edited by hand is logged, removed and computed again. The concatenation checks each part as it reads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)


class PartStore:
    """``OUT.parts/``: the finished chunks of one job (``job.json``), each written durably (:func:`atomic_write`) and
    checked before a rerun trusts it (:meth:`done`), and the assembly of ``OUT`` (OUT's missing directories are
    created). Raises ValueError when the directory holds another job's parts."""

    def __init__(self, out: str | Path, fmt: str, columns: list[tuple[str, str]], job: dict) -> None:
        self.out, self.fmt, self.columns = Path(out), fmt, columns
        self.dir = self.out.with_name(self.out.name + ".parts")
        self.made = [p for p in self.dir.absolute().parents if not p.exists()]  # removed again by discard_if_empty
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only or virtual file system: name the flag, not a bare errno
            raise OSError(f"--out {out}: cannot create {exc.filename}: {exc.strerror}") from None
        meta = self.dir / "job.json"
        if meta.exists():
            try:
                old = json.loads(meta.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:  # written before it was fsynced, cut off
                raise ValueError(f"{meta}: not a job's description ({exc}); remove {self.dir} and rerun") from None
            diff = sorted(k for k in set(old) | set(job) if old.get(k) != job.get(k))
            if diff:
                raise ValueError(
                    f"{self.dir} holds the parts of another job ({', '.join(diff)} differ); "
                    "rerun with the same flags to resume, or remove the directory"
                )
        else:
            atomic_write(meta, lambda f: f.write(json.dumps(job, indent=1).encode()))
        for stale in self.dir.glob("*.tmp"):  # a killed write
            stale.unlink()

    def discard_if_empty(self) -> None:
        """Remove the parts directory when it holds no finished chunk (a job that failed at once), and the
        directories made for it."""
        if not any(self.dir.glob(f"chunk-*.{self.fmt}")):
            shutil.rmtree(self.dir, ignore_errors=True)
            for p in self.made:  # deepest first
                try:
                    p.rmdir()
                except OSError:
                    break

    def path(self, i: int) -> Path:
        return self.dir / f"chunk-{i:06d}.{self.fmt}"

    def done(self, i: int, rows: int) -> bool:
        """Whether chunk ``i`` is finished: its part exists and holds its ``rows`` rows, whole (:func:`part_problem`).
        A bad part (cut off, edited, ...) is logged, one warning naming the file and why, and removed: computed again."""
        p = self.path(i)
        if not p.exists():
            return False
        why = part_problem(p, self.fmt, self.columns, rows)
        if why is not None:
            log.warning("%s: %s; computing chunk %d again", p, why, i)
            p.unlink()
        return why is None

    def write(self, i: int, cols: dict[str, list]) -> None:
        atomic_write(self.path(i), lambda f: _write_table(f, self.fmt, self.columns, cols))

    def assemble(self, rows: list[int]) -> int:
        """Concatenate the chunks (``rows[i]``: chunk i's rows) into OUT (temp + rename), remove the parts; rows written.
        Each part is checked again as it is read (:func:`_concat`): a bad one is removed (a rerun computes it again)
        and named in a ValueError, OUT not written."""
        parts = [self.path(i) for i in range(len(rows))]
        missing = [p.name for p in parts if not p.exists()]
        if missing:
            raise FileNotFoundError(f"{self.dir}: missing part(s) {missing[:5]}")
        n = atomic_write(self.out, lambda f: _concat(f, self.fmt, self.columns, list(zip(parts, rows))))
        shutil.rmtree(self.dir)
        return n


def atomic_write(path: Path, write: Callable[[BinaryIO], object]):
    """``write(f)`` into ``path.tmp`` (a binary file), flushed and fsynced, renamed to ``path``, the directory fsynced:
    after an error, a kill or a power cut ``path`` is absent (or as it was) or whole. Returns what ``write`` returns."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            res = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if os.name != "nt":  # the rename itself, durable (Windows opens no directory)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return res


def arrow_schema(columns: list[tuple[str, str]]):
    """The ``pyarrow.Schema`` of :func:`output_columns`' (name, type name) pairs."""
    import pyarrow as pa

    return pa.schema([(n, getattr(pa, t)()) for n, t in columns])


def _write_table(f: BinaryIO, fmt: str, columns, cols: dict[str, list]) -> None:
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(cols, schema=arrow_schema(columns)), f)
        return
    names = [n for n, _ in columns]
    for row in zip(*(cols[n] for n in names)):
        f.write((json.dumps(dict(zip(names, row)), ensure_ascii=False) + "\n").encode())


def part_problem(path: Path, fmt: str, columns, rows: int) -> str | None:
    """Why the part ``path`` is not a finished chunk of ``rows`` rows (None: it is). JSON lines: every line a JSON
    object of the output columns, the last one ended; Parquet: its footer (metadata) holds the columns and rows."""
    names = [n for n, _ in columns]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.read_metadata(path)
        except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid is a ValueError
            return f"not a whole Parquet file ({exc})"
        got, cols = meta.num_rows, meta.schema.names
    else:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            return "its last line is cut off"
        lines = data.split(b"\n")[:-1]
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or list(row) != names:
                return f"line {n} is not a JSON object of the columns {', '.join(names)}"
        got, cols = len(lines), names
    if cols != names:
        return f"its columns are {', '.join(cols)}, not {', '.join(names)}"
    return None if got == rows else f"{got} rows, its chunk has {rows}"


def _concat(f: BinaryIO, fmt: str, columns, parts: list[tuple[Path, int]]) -> int:
    """Write the parts ((path, its rows)) one after another into ``f``; rows written. Each is checked as it is read
    (:func:`part_problem`): a bad one is removed (the same command computes it again) and named in a ValueError."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        w = pq.ParquetWriter(f, arrow_schema(columns))
    try:
        for p, want in parts:
            try:
                why = part_problem(p, fmt, columns, want)
                data = None if why else pq.read_table(p) if fmt == "parquet" else p.read_bytes()
            except (OSError, ValueError) as exc:  # a Parquet part corrupt past its footer (pyarrow.ArrowInvalid)
                why = f"unreadable ({exc})"
            if why:
                p.unlink()
                raise ValueError(f"{p}: {why}; removed: the same command computes that chunk again")
            if fmt == "parquet":
                w.write_table(data)
            else:
                f.write(data)
    finally:
        if fmt == "parquet":
            w.close()
    return sum(want for _, want in parts)


__all__ = ["PartStore", "arrow_schema", "atomic_write", "part_problem"]
