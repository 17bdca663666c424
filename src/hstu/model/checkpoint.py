"""Run-file primitives: atomic JSON and safetensors writes, checked reads, loading weights.

The run directory's layout (which files, what they hold) and every job's use of it are
:mod:`hstu.runs`; this module only reads and writes one file at a time, for it and for the
quantized weights format (:mod:`hstu.quant.checkpoint`), which sits below runs. No pickle anywhere:
tensors in safetensors, everything else in JSON. Every file is written to NAME.tmp and renamed
into place; JSON run files are checked field by field as they are read (hstu.model.run_files).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import shutil
import signal
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from hstu.model.run_files import IDMAP, check_items, check_run_json

KILL_AT_ENV = "HSTU_TEST_KILL_AT"  # test seam, see crash_point
_renames: dict[str, int] = {}


def crash_point(tmp: Path) -> None:
    """Test seam for kill-at-any-instant tests: with ``HSTU_TEST_KILL_AT=NAME:N`` in the
    environment, SIGKILL this process just before the N-th rename of a temp file called NAME
    (e.g. ``history.json.tmp:2``) into place. Does nothing when the variable is unset."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec:
        return
    name, _, n = spec.rpartition(":")
    if Path(tmp).name == name:
        _renames[name] = _renames.get(name, 0) + 1
        if _renames[name] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)


def write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically (``path.tmp``, :func:`crash_point`, rename); after an error
    (a full disk, ``path`` a directory) ``path`` is as it was and no ``path.tmp`` is left."""
    tmp = Path(str(path) + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        crash_point(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename)."""
    write_text(path, json.dumps(obj, indent=2))


def dir_target(out: str | Path) -> Path:
    """The directory an ``--out`` names, as :func:`staged_dir` writes it: absolute (``.`` too), a symbolic link
    to a directory followed. FileExistsError for a link to nothing (naming both)."""
    out = Path(os.path.abspath(out))
    if out.is_symlink():
        if not out.exists():
            raise FileExistsError(f"--out {out}: a symbolic link to {os.readlink(out)}, which does not exist")
        out = out.resolve()
    return out


def check_out_dir(out: str | None, overwrite: bool, files: tuple[str, ...], noun: str) -> None:
    """Refuse an --out that would lose something, before anything is measured: FileExistsError (exit 2, one line
    naming it) for a file, a directory holding an earlier ``hstu {noun}`` (``files[0]``, its marker, and only
    ``files``) without ``overwrite``, or one holding anything else (never replaced); ValueError for ``overwrite``
    without ``out``. The new-or-empty / ``--overwrite`` rule of ``hstu bench`` and ``hstu report``."""
    marker = files[0]
    if out is None:
        if overwrite:
            raise ValueError(f"--overwrite: needs --out (the directory whose earlier {noun} it replaces)")
        return
    d = dir_target(out)  # FileExistsError: a link to nothing
    if d.exists() and not d.is_dir():
        raise FileExistsError(f"--out {out}: exists and is not a directory")
    names = sorted(q.name for q in d.iterdir()) if d.is_dir() else []
    other = [n for n in names if n not in files]
    if names and (other or marker not in names):
        shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "") if other else f"no {marker}"
        raise FileExistsError(f"--out {out}: holds files that are not an earlier hstu {noun}'s output ({shown}); choose another directory")
    if names and not overwrite:
        raise FileExistsError(
            f"--out {out}: holds an earlier {noun} ({marker}); pass --overwrite to replace it, or choose another directory"
        )


@contextlib.contextmanager
def staged_dir(out: str | Path, *, last: str | None = None) -> Iterator[Path]:
    """Build a directory whole or not at all: yield a hidden temp directory beside ``out``
    (``.NAME.tmp-*``, mode 0755) to write into; when the block ends without error, move it to
    ``out``, replacing an old ``out`` only then. An existing empty ``out`` (one the user made: its mode,
    a shell inside it) is kept and filled instead, the file ``last`` (the one that marks the directory
    complete) moved in last. On any error (KeyboardInterrupt and SIGTERM included) the temp directory
    and whatever was moved are removed and ``out`` is left as it was. ``out`` as :func:`dir_target`."""
    out = dir_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would become the directory's mode
    old = None
    try:
        yield tmp
        if out.is_dir() and not any(out.iterdir()):
            _fill(tmp, out, last)
            tmp.rmdir()
            return
        if out.is_dir():
            old = out.with_name(f".{out.name}.old-{os.getpid()}-{tmp.name[-8:]}")
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_orphans(out: Path) -> None:
    """Remove the ``.NAME.tmp-PID-*`` / ``.NAME.old-PID-*`` directories beside ``out`` whose process PID is gone: a
    process killed outright (SIGKILL, an abort) could not clean them; a live one's (a concurrent writer) are kept."""
    for p in out.parent.glob(f".{glob.escape(out.name)}.[to][ml][pd]-*-*"):
        pid = p.name[len(out.name) + 6 :].split("-", 1)[0]
        if pid.isdigit() and p.is_dir() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fill(tmp: Path, out: Path, last: str | None) -> None:
    """Move ``tmp``'s entries into the empty directory ``out``, ``last`` last; on any error, take them out again."""
    moved = []
    try:
        for p in sorted(tmp.iterdir(), key=lambda p: p.name == last):
            os.rename(p, out / p.name)
            moved.append(out / p.name)
    except BaseException:
        for q in moved:
            shutil.rmtree(q) if q.is_dir() and not q.is_symlink() else q.unlink(missing_ok=True)
        raise


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: Path) -> Any:
    """Read JSON; a run file (config.json, idmap.json, last.json, history.json) is also checked
    field by field (:mod:`hstu.model.run_files`). FileNotFoundError says which run file is
    missing; ValueError names the file and the field that is malformed."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: not found (is this a run directory written by `hstu train`?)")
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    return check_run_json(path, obj)


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write NumPy arrays (no object arrays: nothing pickled) as an uncompressed .npz atomically
    (``path.tmp``, :func:`crash_point`, rename)."""
    bad = [k for k, a in arrays.items() if a.dtype.hasobject]
    if bad:  # np.savez would pickle them (its allow_pickle keyword is numpy >= 2.1's only)
        raise ValueError(f"{path}: {bad[0]} is an object array; store ids as int64 or fixed-width unicode")
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a name
        np.savez(f, **arrays)
    crash_point(tmp)
    os.replace(tmp, path)


def read_npz(path: Path, fields: list[str]) -> dict[str, np.ndarray]:
    """The arrays ``fields`` of an .npz file that holds them (absent ones left out), loaded without
    pickle. ValueError names the file (and the array) when it is missing, truncated or corrupt."""
    if not Path(path).exists():
        raise ValueError(f"{path}: not found; the run may be incomplete")
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz file ({exc}); the run may be incomplete or corrupt") from exc
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: not an .npz archive (a single array); the run may be corrupt")
    out = {}
    with npz:
        for name in fields:
            if name not in npz.files:
                continue
            try:
                out[name] = npz[name]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
                raise ValueError(f"{path}: {name} is not readable ({exc}); the run may be incomplete or corrupt") from exc
    return out


def read_idmap(run: str | Path) -> dict:
    """A run's idmap.json, checked field by field, with a large catalogue's per-item arrays from its
    sidecar (``items_file``, items.npz) under the same keys as inline lists (NumPy arrays then: int64
    or object str ids; :func:`hstu.model.run_files.check_items`). Raises FileNotFoundError without
    idmap.json, ValueError naming the file and field (items.npz missing, unreadable, or wrong)."""
    run = Path(run)
    ids = read_json(run / IDMAP)
    if "items_file" in ids:
        path = run / ids["items_file"]
        if not path.exists():
            raise ValueError(f"{path}: not found, but {run / IDMAP} items_file names it; the run is incomplete")
        ids.update(check_items(str(path), read_npz(path, ids["item_fields"]), ids["item_fields"], ids["item_rows"]))
    return ids


def read_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; ValueError names a truncated or corrupt file."""
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); the run may be incomplete or corrupt") from exc


def read_safetensors_metadata(path: Path) -> dict[str, str]:
    """The metadata (text -> text) of a safetensors file's header; ValueError names a corrupt file."""
    try:
        with safe_open(str(path), "pt") as fh:
            return dict(fh.metadata() or {})
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); the run may be incomplete or corrupt") from exc


def load_state(path: Path, module: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """``module.load_state_dict(state)``; ValueError naming ``path`` for a missing, unexpected or
    wrongly shaped tensor (PyTorch raises RuntimeError for the shapes)."""
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise ValueError(f"{path}: weights do not match the model: {' '.join(str(exc).split())[:300]}") from None
    if strict and (missing or unexpected):
        raise ValueError(f"{path}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def save_tensors(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically (``path.tmp``, :func:`crash_point`, rename), with the
    permissions of any other file the process creates (0666 less the umask: safetensors creates 0600)."""
    tmp = Path(str(path) + ".tmp")
    tmp.open("wb").close()  # created as any file is (0666 less the umask), read back: no process-wide umask change
    mode = tmp.stat().st_mode & 0o777
    save_file(state, str(tmp), metadata=metadata)
    os.chmod(tmp, mode)
    crash_point(tmp)
    os.replace(tmp, path)


def save_weights(path: Path, module: torch.nn.Module, metadata: dict[str, str] | None = None) -> None:
    """A module's state dict as safetensors at ``path`` (:func:`save_tensors`)."""
    save_tensors(path, {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, metadata)


STREAM_TENSOR_BYTES = 256 << 20  # tensors above this (item table shards) are read and loaded one at a time
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def load_weights(path: Path, module: torch.nn.Module, device: torch.device | str = "cpu") -> None:
    """Load safetensors weights; a missing or unexpected key raises ValueError naming it. Tensors
    over :data:`STREAM_TENSOR_BYTES` (a large catalogue's table shards) are read and copied into
    the module one at a time, first, so the peak is the model plus one of them rather than the
    model twice (a 120M x 32 fp16 table: 7.7 GB, not 15); the rest is one ``load_state_dict``."""
    if not Path(path).exists():
        quant = Path(path).with_name("model.quant.safetensors")  # hstu.quant.checkpoint.WEIGHTS (no import: it imports this)
        why = (
            f" ({quant.name} is there but not quant.json: an incomplete quantized copy; run hstu quantize again)" if quant.exists() else ""
        )
        raise FileNotFoundError(f"{path}: weights not found{why}")
    own = module.state_dict()  # views of the parameters and buffers
    try:
        with safe_open(str(path), "pt", device=str(device)) as fh:
            slices = {k: fh.get_slice(k) for k in fh.keys()}
            shapes = {k: tuple(v.get_shape()) for k, v in slices.items()}
            sizes = {k: math.prod(shapes[k]) * _DTYPE_BYTES.get(v.get_dtype(), 1) for k, v in slices.items()}
            big = sorted(k for k, n in sizes.items() if n > STREAM_TENSOR_BYTES and k in own)
            for k in big:  # copied in place; the call below sees them as the module's own (a self-copy), hooks and all
                if shapes[k] != tuple(own[k].shape):
                    raise ValueError(f"{path}: weights do not match the model: {k} is {shapes[k]} here, {tuple(own[k].shape)} in the model")
                with torch.no_grad():
                    own[k].copy_(fh.get_tensor(k))
            state = {k: own[k] if k in big else fh.get_tensor(k) for k in sizes}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); the run may be incomplete or corrupt") from exc
    load_state(path, module, state)


_MOVED = {"load_run": "load_float_run", "check_items_match": "check_items_match"}  # issue 18: now in hstu.runs


def __getattr__(name: str) -> Any:
    """The run loaders moved to :mod:`hstu.runs` (above model in the import order); their old
    names here are resolved on first use (PEP 562): ``load_run`` is :func:`hstu.runs.load_float_run`."""
    if name in _MOVED:
        import hstu.runs

        return getattr(hstu.runs, _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
