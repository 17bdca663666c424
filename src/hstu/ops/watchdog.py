"""``hstu watchdog``: follow device logs for reset markers and run the cold-start recovery
(stop service -> device reset -> wait -> health check -> start service), never more often than
the cool-down.

Timing rules (the clock is monotonic; tests inject a fake one):

- A recovery may start only if ``cooldown_s`` has passed since the previous recovery *started*, so
  two recoveries are always at least ``cooldown_s`` apart, whatever the logs say.
- Markers seen during a recovery or its cool-down are logged and dropped; a device reset writes reset
  markers itself, and acting on them would loop.
- A recovery fails if the reset command fails (non-zero exit, or still running after ``step_timeout_s``:
  "timed out", and its whole process group is killed) or the health check still fails after its
  retries. Then the service is not started (no wait and no health check after a failed reset); after the
  cool-down the recovery is retried (no new marker needed) up to ``max_attempts`` consecutive failures,
  then the watchdog gives up and logs CRITICAL (:meth:`Watchdog.run` returns; ``hstu watchdog`` exits 1
  so the service manager notices): a device that does not come back needs a person.

Commands run through ``/bin/sh -c`` (they are the operator's own, e.g. ``systemctl stop hstu`` or
``npu-smi set -t reset -i 0 -c 0``), each with a timeout; a failed stop command is logged and the
sequence goes on (the service may be down already), a failed reset ends the recovery as failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


# the ``hstu watchdog`` flag of each RecoveryPlan field, for errors the operator can act on
_FLAGS = {
    "wait_s": "--wait",
    "health_interval_s": "--health-interval",
    "cooldown_s": "--cooldown",
    "step_timeout_s": "--step-timeout",
    "health_retries": "--health-retries",
    "max_attempts": "--max-attempts",
}


@dataclass(frozen=True)
class RecoveryPlan:
    """What to run on a reset marker. Only ``reset_cmd`` is required; None steps are skipped."""

    reset_cmd: str
    stop_cmd: str | None = None
    start_cmd: str | None = None
    health_cmd: str | None = None
    wait_s: float = 30.0  # after the reset, before the first health check
    health_retries: int = 3
    health_interval_s: float = 10.0
    cooldown_s: float = 300.0
    step_timeout_s: float = 600.0
    max_attempts: int = 3  # consecutive failed recoveries before giving up

    def __post_init__(self) -> None:
        if not self.reset_cmd.strip():
            raise ValueError("reset command (--on-reset) must not be empty")
        if self.wait_s < 0:
            raise ValueError(f"{_FLAGS['wait_s']} must be >= 0 seconds, got {self.wait_s:g}")
        # a 0 cool-down would loop, a 0 timeout fails every command, 0 between health checks retries at once
        for name in ("cooldown_s", "step_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_FLAGS[name]} must be > 0 seconds, got {getattr(self, name):g}")
        for name in ("health_retries", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_FLAGS[name]} must be >= 1, got {getattr(self, name)}")


@dataclass
class StepResult:
    name: str
    command: str
    returncode: int | None  # None: timed out (killed after step_timeout_s)
    seconds: float
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def status(self) -> str:
        return "timed out" if self.returncode is None else f"rc={self.returncode}"


@dataclass
class RecoveryResult:
    trigger: str
    started_at: float
    steps: list[StepResult] = field(default_factory=list)
    healthy: bool | None = None  # None: not checked (no health command, or the reset failed)
    service_started: bool = False
    failure: str | None = None  # why the recovery failed (reset or health check); None: it succeeded

    @property
    def ok(self) -> bool:
        return self.failure is None


Runner = Callable[[str, float], tuple[int | None, str]]


def run_shell(command: str, timeout_s: float) -> tuple[int | None, str]:
    """Run ``command`` with /bin/sh in a new session; return (exit status, last 2000 chars of output).

    None: still running after ``timeout_s``; then the whole process group (the shell and what it started)
    is killed, so a timed-out reset does not go on behind the next attempt. 127: /bin/sh could not be
    started. Output goes to a temporary file, not a pipe: a service the command starts in the background
    (``... &``) keeps no pipe open, so only the shell's own exit is waited for.
    """
    with tempfile.TemporaryFile() as buf:
        try:
            proc = subprocess.Popen(  # noqa: S602 - the operator's own command line
                command, shell=True, stdin=subprocess.DEVNULL, stdout=buf, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as exc:
            return 127, f"could not start: {exc}"
        rc: int | None = None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.returncode is None:  # timed out (or interrupted): end the shell and everything it started
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        buf.seek(max(0, buf.seek(0, os.SEEK_END) - 2000))
        out = buf.read().decode(errors="replace")
    return rc, (out if rc is not None else f"timed out after {timeout_s:g} s; {out[-1000:]}")


_HEAD = 4096  # bytes of each file's start kept, to notice an in-place rewrite and to recognise a copy


@dataclass
class _Tail:
    offset: int = 0  # bytes read so far
    partial: bytes = b""  # an incomplete last line, waiting for its newline
    head: bytes = b""  # the file's first min(offset, _HEAD) bytes, as read
    pending: bool = False  # a copy of a followed file, maybe still being written up to ``offset``


class LogFollower:
    """``tail -F`` over every file under a directory (or one file): new lines since the last poll.

    Files are tracked by (device, inode), so a rotated file (``dev.log`` -> ``dev.log.1``) keeps its
    read position under its new name and is not read again; a file that appears later is read from
    its start. Incomplete last lines wait for their newline.

    Truncation and copies (logrotate ``copytruncate``, ``: > dev.log``), checked on every poll:

    - a followed file is read again from its start if it is now shorter than the bytes already read,
      or if its first bytes (up to 4 KiB of what was read) changed; so a truncated file rewritten
      longer than before, or to the same length, is read from its new start;
    - a new file that starts with the first bytes (up to 4 KiB) read of a followed file is a copy (the
      one ``copytruncate`` makes): it is read from that file's position, not from its start (its old
      reset markers would start a recovery); while shorter than that position it waits, and if its bytes
      turn out to differ it is read from its start. A new file that is so far only the beginning of
      those bytes (a copy being written) is looked at again on the next poll.
    """

    def __init__(self, root: str | Path, from_start: bool = False) -> None:
        self.root = Path(root)
        if not self.root.exists():
            raise FileNotFoundError(f"log directory does not exist: {self.root}")
        self._state: dict[tuple[int, int], _Tail] = {}  # (dev, inode) -> read position
        for p in self._files():
            try:
                st = p.stat()
            except OSError:
                continue
            tail = _Tail()
            if not from_start:
                tail.offset = st.st_size
                with contextlib.suppress(OSError), open(p, "rb") as fh:
                    tail.head = fh.read(min(st.st_size, _HEAD))
            self._state[(st.st_dev, st.st_ino)] = tail

    def _files(self) -> list[Path]:
        if self.root.is_file():
            return [self.root]
        out = []
        for dirpath, dirs, files in os.walk(self.root):
            dirs.sort()
            out.extend(Path(dirpath) / f for f in sorted(files))
        return out

    @staticmethod
    def _new_tail(fh, size: int, known: list[_Tail]) -> _Tail | None:
        """A new file's read position: that of the followed file whose first bytes it starts with (a copy), else
        its start; None (look again next poll) while it is only the beginning of such first bytes."""
        start = fh.read(min(size, _HEAD))
        fh.seek(0)
        if not start:
            return _Tail()
        copied = [t for t in known if start.startswith(t.head)]
        if copied:
            t = max(copied, key=lambda t: (len(t.head), t.offset))
            return _Tail(t.offset, t.partial, t.head, pending=True)
        return None if any(t.head.startswith(start) for t in known) else _Tail()

    @staticmethod
    def _read(fh, size: int, tail: _Tail) -> list[bytes]:
        """Complete new lines of an open file; updates ``tail``."""
        if tail.offset:
            n = min(size, len(tail.head))
            same = fh.read(n) == tail.head[:n]
            if tail.pending and same and size < tail.offset:
                return []  # a copy still being written up to the position it takes over
            if not same or size < tail.offset:  # truncated, rewritten in place, or not a copy after all
                tail.offset, tail.partial, tail.head = 0, b"", b""
        tail.pending = False
        if size <= tail.offset:
            return []
        fh.seek(tail.offset)
        data = fh.read(size - tail.offset)
        if len(tail.head) < _HEAD:  # still the whole part read so far
            tail.head = (tail.head + data)[:_HEAD]
        tail.offset += len(data)
        chunks = (tail.partial + data).split(b"\n")
        tail.partial = chunks.pop()
        return chunks

    def poll(self) -> list[tuple[str, str]]:
        """New complete lines as (path, text)."""
        out: list[tuple[str, str]] = []
        seen: dict[tuple[int, int], _Tail] = {}
        known = [_Tail(t.offset, t.partial, t.head) for t in self._state.values() if t.head and not t.pending]  # as before this poll
        for p in self._files():
            try:
                st = p.stat()
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:  # hard link or listed twice
                continue
            tail = self._state.get(key)
            try:
                with open(p, "rb") as fh:
                    tail = tail or self._new_tail(fh, st.st_size, known)
                    if tail is None:  # maybe a copy still being written: looked at again next poll
                        continue
                    chunks = self._read(fh, st.st_size, tail)
            except OSError:
                chunks = []
            seen[key] = tail or _Tail()
            out.extend((str(p), c.decode("utf-8", errors="replace").rstrip("\r")) for c in chunks)
        self._state = seen  # deleted files are forgotten
        return out


class Watchdog:
    """Follow ``log_dir``; on a line matching ``markers`` run ``plan`` (see the module docstring)."""

    def __init__(
        self,
        log_dir: str | Path,
        plan: RecoveryPlan,
        markers: Sequence[re.Pattern | str],
        *,
        from_start: bool = False,
        runner: Runner = run_shell,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not markers:
            raise ValueError("at least one reset marker is needed")
        self.plan = plan
        self.markers = [re.compile(m) if isinstance(m, str) else m for m in markers]
        self.follower = LogFollower(log_dir, from_start=from_start)
        self.runner, self.clock, self.sleep = runner, clock, sleep
        self.last_start: float | None = None
        self.failures = 0  # consecutive failed recoveries
        self.last_failure: str | None = None
        self.gave_up = False
        self.suppressed = 0
        self.history: list[RecoveryResult] = []

    def _cooling(self, now: float) -> bool:
        return self.last_start is not None and now - self.last_start < self.plan.cooldown_s

    def step(self) -> RecoveryResult | None:
        """Read new log lines; run one recovery if a marker (or a pending retry) calls for it."""
        hits = [(p, t) for p, t in self.follower.poll() if any(m.search(t) for m in self.markers)]
        now = self.clock()
        if self.gave_up:
            if hits:
                log.critical(
                    "reset marker ignored: watchdog gave up after %d failed recoveries: %s",
                    self.failures,
                    hits[0][1][:200],
                )
            return None
        if self._cooling(now):
            if hits:
                self.suppressed += len(hits)
                log.warning(
                    "%d reset marker(s) during cool-down (%.0f s left), not acting: %s",
                    len(hits),
                    self.plan.cooldown_s - (now - self.last_start),
                    hits[0][1][:200],
                )
            return None
        if hits:
            return self.recover(f"{hits[0][0]}: {hits[0][1][:300]}")
        if self.failures:
            return self.recover(f"retry: the previous recovery failed: {self.last_failure} ({self.failures} in a row)")
        return None

    def _run(self, result: RecoveryResult, name: str, cmd: str) -> StepResult:
        t0 = self.clock()
        rc, out = self.runner(cmd, self.plan.step_timeout_s)
        step = StepResult(name, cmd, rc, self.clock() - t0, out)
        result.steps.append(step)
        said = f"timed out after {self.plan.step_timeout_s:g} s" if rc is None else f"exit {rc}"
        (log.info if step.ok else log.warning)("watchdog %s: `%s` -> %s", name, cmd, said)
        return step

    def _health(self, res: RecoveryResult) -> None:
        p = self.plan
        res.healthy = False
        for i in range(p.health_retries):
            if self._run(res, f"health[{i + 1}/{p.health_retries}]", p.health_cmd).ok:
                res.healthy = True
                return
            if i + 1 < p.health_retries:
                self.sleep(p.health_interval_s)
        res.failure = f"health check still failing after {p.health_retries} attempt(s)"

    def _failed(self, res: RecoveryResult) -> None:
        self.failures += 1
        self.last_failure = res.failure
        if self.failures >= self.plan.max_attempts:
            self.gave_up = True
            log.critical(
                "watchdog: %s; giving up after %d failed recoveries in a row, service left stopped: a person has to look",
                res.failure,
                self.failures,
            )
        else:
            log.error(
                "watchdog: recovery failed: %s; service not started; retry after the %.0f s cool-down (%d of %d attempts)",
                res.failure,
                self.plan.cooldown_s,
                self.failures,
                self.plan.max_attempts,
            )

    def recover(self, trigger: str) -> RecoveryResult:
        """Run the recovery sequence now (callers check the cool-down; :meth:`step` does)."""
        p = self.plan
        self.last_start = self.clock()
        log.warning("watchdog: reset detected (%s); starting recovery", trigger)
        res = RecoveryResult(trigger, self.last_start)
        if p.stop_cmd:
            self._run(res, "stop", p.stop_cmd)  # logged; the service may be down already
        reset = self._run(res, "reset", p.reset_cmd)
        if not reset.ok:  # no service on top of a device that was not reset
            res.failure = "reset command " + ("timed out" if reset.returncode is None else f"failed (exit {reset.returncode})")
        else:
            self.sleep(p.wait_s)
            if p.health_cmd:
                self._health(res)
        if res.ok:
            if p.start_cmd:
                res.service_started = self._run(res, "start", p.start_cmd).ok
            self.failures, self.last_failure = 0, None
            log.warning("watchdog: recovery done (healthy=%s, service started=%s)", res.healthy, res.service_started)
        else:
            self._failed(res)
        drained = [t for _, t in self.follower.poll() if any(m.search(t) for m in self.markers)]
        if drained:  # markers written by our own reset
            self.suppressed += len(drained)
            log.info("watchdog: %d reset marker(s) written during the recovery ignored", len(drained))
        self.history.append(res)
        return res

    def run(self, stop: threading.Event | None = None, poll_s: float = 1.0) -> None:
        """Poll until ``stop`` is set (Ctrl-C stops the CLI) or the watchdog gives up (:attr:`gave_up`)."""
        stop = stop or threading.Event()
        log.info("watchdog following %s (cool-down %.0f s)", self.follower.root, self.plan.cooldown_s)
        while not stop.is_set() and not self.gave_up:
            self.step()
            if not self.gave_up:
                stop.wait(poll_s)
