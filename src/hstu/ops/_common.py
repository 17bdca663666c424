"""Small shared helpers for the ops tools: safe subprocess calls, durations, quantities, versions.

Nothing here imports torch; every probe tolerates the tool it calls being absent.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

log = logging.getLogger(__name__)


def load_document(path: str | Path | None, packaged: str, parse, what: str, errors: type[Exception] | tuple) -> tuple[object, str]:
    """Read and parse a data file of the ops tools: ``path``, or the file ``packaged`` shipped in
    hstu/ops when ``path`` is None. Returns (``parse(text)``, where: the name for messages).

    Raises:
        ValueError: ``parse`` raised one of ``errors`` ("<where>: invalid <what>: ...").
        OSError: an unreadable file.
    """
    if path is None:
        text, where = resources.files("hstu.ops").joinpath(packaged).read_text(encoding="utf-8"), f"hstu/ops/{packaged}"
    else:
        text, where = Path(path).read_text(encoding="utf-8"), str(path)
    try:
        return parse(text), where
    except errors as exc:
        raise ValueError(f"{where}: invalid {what}: {exc}") from exc


@dataclass(frozen=True)
class CommandResult:
    """Outcome of one external command: ``ok`` is True when it ran and exited 0."""

    argv: tuple[str, ...]
    returncode: int | None
    stdout: str
    stderr: str
    error: str | None = None  # why it did not run (absent, timeout, OSError)

    @property
    def ok(self) -> bool:
        return self.error is None and self.returncode == 0


def run_command(argv: list[str] | tuple[str, ...], timeout_s: float = 10.0) -> CommandResult:
    """Run ``argv`` without a shell; never raises.

    Returns a :class:`CommandResult` whose ``error`` names the reason when the program is not on
    PATH, timed out after ``timeout_s`` seconds, or could not be started.
    """
    argv = tuple(argv)
    exe = shutil.which(argv[0])
    if exe is None:
        return CommandResult(argv, None, "", "", error=f"{argv[0]} not found on PATH")
    try:
        proc = subprocess.run(  # noqa: S603 - argv list, no shell
            [exe, *argv[1:]], capture_output=True, text=True, timeout=timeout_s, errors="replace"
        )
    except subprocess.TimeoutExpired:
        return CommandResult(argv, None, "", "", error=f"{' '.join(argv)} timed out after {timeout_s:g} s")
    except OSError as exc:
        return CommandResult(argv, None, "", "", error=f"{' '.join(argv)} could not start: {exc}")
    return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | int | float, *, field: str = "duration") -> float:
    """Parse a duration such as ``"30s"``, ``"1m30s"``, ``"500ms"`` or a bare number of seconds.

    Returns seconds (float, >= 0). Raises ValueError naming ``field`` for anything else.
    Units follow Prometheus durations (ms, s, m, h, d).
    """
    if isinstance(text, bool):
        raise ValueError(f"{field}: expected a duration like '30s', got {text!r}")
    if isinstance(text, (int, float)):
        if text < 0 or not math.isfinite(text):
            raise ValueError(f"{field}: duration must be a finite number >= 0, got {text!r}")
        return float(text)
    s = str(text).strip().lower()
    try:
        value = float(s)
    except ValueError:
        pass
    else:
        return parse_duration(value, field=field)
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s) or not s:
        raise ValueError(f"{field}: expected a duration like '30s', '1m30s' or '500ms', got {text!r}")
    return total


def format_prom_duration(seconds: float) -> str:
    """Seconds as a Prometheus duration string (``"30s"``, ``"1500ms"``, ``"0s"``)."""
    if seconds <= 0:
        return "0s"
    ms = round(seconds * 1000)
    if ms % 1000:
        return f"{ms}ms"
    return f"{ms // 1000}s"


_QUANTITY_RE = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(%|[kKMGTP]i?)?\s*(B/s|B|/s)?\s*$")
_SI = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def parse_quantity(text: str) -> float:
    """Parse a threshold such as ``0.85``, ``85%`` (= 0.85), ``8GB/s`` (= 8e9), ``2GiB`` (= 2**31).

    SI prefixes (k, M, G, T, P) are powers of 1000, IEC prefixes (Ki, Mi, Gi, Ti, Pi) powers of 1024;
    a trailing ``B``, ``B/s`` or ``/s`` is a unit label only. Raises ValueError on anything else.
    """
    m = _QUANTITY_RE.match(text)
    if not m:
        raise ValueError(f"not a number or quantity: {text!r} (examples: 0.85, 85%, 8GB/s, 2GiB)")
    value = float(m.group(1))
    prefix = m.group(2)
    if prefix == "%":
        return value / 100.0
    if prefix:
        return value * (_IEC.get(prefix) or _SI[prefix])
    return value


_ASCEND_PART = re.compile(r"^(rc|alpha|beta|t|b|spc)?(\d+)$", re.IGNORECASE)


def ascend_version_key(version: str) -> tuple:
    """Sort key for Ascend versions (CANN ``8.0.RC3``, ``8.0.0``; HDK/driver ``24.1.rc3.b999``).

    Order within one ``X.Y`` line: ``RCn`` (release candidates) < ``0`` < ``1`` ...; build suffixes
    (``.b999``, ``.beta1``, ``.alpha001``) are ignored. Raises ValueError if major.minor is not numeric.
    """
    parts = version.strip().split(".")
    if len(parts) < 2 or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(f"not an Ascend version (expected like 8.0.RC3 or 24.1.0): {version!r}")
    key: list[tuple[int, int]] = [(1, int(parts[0])), (1, int(parts[1]))]
    for part in parts[2:]:
        m = _ASCEND_PART.match(part)
        if not m:
            break
        tag = (m.group(1) or "").lower()
        if tag == "rc":
            key.append((0, int(m.group(2))))
        elif tag == "":
            key.append((1, int(m.group(2))))
        else:  # build / beta suffix: does not change the release order
            break
    return tuple(key)


def ascend_release(version: str) -> str:
    """The release part of an Ascend version, upper-cased RC: ``24.1.rc3.b999`` -> ``24.1.RC3``."""
    parts = version.strip().split(".")
    out = parts[:2]
    for part in parts[2:]:
        m = _ASCEND_PART.match(part)
        if not m or (m.group(1) or "").lower() not in ("", "rc"):
            break
        out.append(part.upper() if m.group(1) else part)
        if m.group(1):
            break
    return ".".join(out)


def read_kv_file(path: Path) -> dict[str, str]:
    """Read a ``key=value`` (or ``key: value``) text file such as CANN's ``version.info``.

    Keys are lower-cased. Returns {} when the file is absent or unreadable (never raises).
    """
    out: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sep = "=" if "=" in line else (":" if ":" in line else None)
        if sep is None:
            continue
        key, _, value = line.partition(sep)
        out[key.strip().lower()] = value.strip()
    return out


def dist_version(name: str) -> str | None:
    """Installed version of distribution ``name`` per importlib.metadata, or None if absent."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def base_version(version: str) -> str:
    """PEP 440 release segment without local/post/dev parts: ``2.1.0.post10`` -> ``2.1.0``,
    ``2.13.0+cpu`` -> ``2.13.0``."""
    v = version.split("+", 1)[0]
    m = re.match(r"^(\d+(?:\.\d+)*)", v)
    return m.group(1) if m else v


def major_minor(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13``."""
    parts = base_version(version).split(".")
    return ".".join(parts[:2])


def version_tuple(version: str) -> tuple[int, ...]:
    """Numeric tuple of the release segment (``550.54.15`` -> (550, 54, 15)); non-numeric parts stop it."""
    out = []
    for part in base_version(version).split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def model_processes(parent) -> list:
    """The model processes of a serving process, seen from outside (soak, tests, operators; no torch import):
    ``parent``'s descendants started by multiprocessing's spawn (``psutil.Process`` objects)."""
    import psutil  # the [ops] / [test] / [bench] extras; not needed to serve

    out = []
    for c in parent.children(recursive=True):
        try:
            if any("spawn_main" in a for a in c.cmdline()):
                out.append(c)
        except psutil.Error:  # ended between the listing and the look
            pass
    return out
