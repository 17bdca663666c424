"""``hstu watchdog``: follow device logs for reset markers and run the cold-start recovery
(stop service -> device reset -> wait -> health check -> start service), never more often than
the cool-down.

Timing rules (the clock is monotonic; tests inject a fake one):

- A recovery may start only if ``cooldown_s`` has passed since the previous recovery *started*, so
  two recoveries are always at least ``cooldown_s`` apart, whatever the logs say.
- Markers seen during a recovery or its cool-down are logged and dropped; a device reset writes reset
  markers itself, and acting on them would loop.
- If the health check still fails after its retries, the service is not started; after the cool-down
  the recovery is retried (no new marker needed) up to ``max_attempts`` consecutive failures, then the
  watchdog stops acting and logs CRITICAL: a device that does not come back needs a person.

Commands run through ``/bin/sh -c`` (they are the operator's own, e.g. ``systemctl stop hstu`` or
``npu-smi set -t reset -i 0 -c 0``), each with a timeout; a non-zero exit of stop/reset is logged and
the sequence continues, because the health check is what decides.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


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
    max_attempts: int = 3  # consecutive unhealthy recoveries before giving up

    def __post_init__(self) -> None:
        if not self.reset_cmd.strip():
            raise ValueError("reset command (--on-reset) must not be empty")
        for name in ("wait_s", "health_interval_s", "cooldown_s", "step_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cooldown_s <= 0:
            raise ValueError(f"cool-down must be > 0 seconds, got {self.cooldown_s}")
        if self.health_retries < 1 or self.max_attempts < 1:
            raise ValueError("health_retries and max_attempts must be >= 1")


@dataclass
class StepResult:
    name: str
    command: str
    returncode: int | None  # None: timed out or could not start
    seconds: float
    output: str = ""


@dataclass
class RecoveryResult:
    trigger: str
    started_at: float
    steps: list[StepResult] = field(default_factory=list)
    healthy: bool | None = None  # None: no health command configured
    service_started: bool = False


Runner = Callable[[str, float], tuple[int | None, str]]


def run_shell(command: str, timeout_s: float) -> tuple[int | None, str]:
    """Run ``command`` with /bin/sh; return (exit code or None on timeout, last 2000 chars of output)."""
    try:
        proc = subprocess.run(
            command,
            shell=True,
            capture_output=True,
            text=True,
            timeout=timeout_s,  # noqa: S602
            errors="replace",
        )
        return proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") if isinstance(exc.stdout, bytes) else (exc.stdout or "").encode()
        return None, f"timed out after {timeout_s:g} s; " + out.decode(errors="replace")[-1000:]
    except OSError as exc:
        return None, f"could not start: {exc}"


class LogFollower:
    """``tail -F`` over every file under a directory (or one file): new lines since the last poll.

    Files are tracked by (device, inode), so a rotated file (``dev.log`` -> ``dev.log.1``) keeps its
    read position under its new name and is not read again; a file that appears later is read from
    its start, and a truncated file from its new start. Incomplete last lines wait for their newline.
    """

    def __init__(self, root: str | Path, from_start: bool = False) -> None:
        self.root = Path(root)
        if not self.root.exists():
            raise FileNotFoundError(f"log directory does not exist: {self.root}")
        self._state: dict[tuple[int, int], tuple[int, bytes]] = {}  # (dev, inode) -> (offset, partial line)
        for p in self._files():
            try:
                st = p.stat()
            except OSError:
                continue
            self._state[(st.st_dev, st.st_ino)] = (0 if from_start else st.st_size, b"")

    def _files(self) -> list[Path]:
        if self.root.is_file():
            return [self.root]
        out = []
        for dirpath, dirs, files in os.walk(self.root):
            dirs.sort()
            out.extend(Path(dirpath) / f for f in sorted(files))
        return out

    def poll(self) -> list[tuple[str, str]]:
        """New complete lines as (path, text)."""
        out: list[tuple[str, str]] = []
        seen: dict[tuple[int, int], tuple[int, bytes]] = {}
        for p in self._files():
            try:
                st = p.stat()
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:  # hard link or listed twice
                continue
            off, partial = self._state.get(key, (0, b""))
            if st.st_size < off:  # truncated
                off, partial = 0, b""
            if st.st_size > off:
                try:
                    with open(p, "rb") as fh:
                        fh.seek(off)
                        data = fh.read(st.st_size - off)
                except OSError:
                    seen[key] = (off, partial)
                    continue
                off += len(data)
                chunks = (partial + data).split(b"\n")
                partial = chunks.pop()
                out.extend((str(p), c.decode("utf-8", errors="replace").rstrip("\r")) for c in chunks)
            seen[key] = (off, partial)
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
        self.failures = 0  # consecutive unhealthy recoveries
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
            return self.recover(f"retry: the previous recovery left the device unhealthy ({self.failures} so far)")
        return None

    def _run(self, result: RecoveryResult, name: str, cmd: str) -> int | None:
        t0 = self.clock()
        rc, out = self.runner(cmd, self.plan.step_timeout_s)
        result.steps.append(StepResult(name, cmd, rc, self.clock() - t0, out))
        (log.info if rc == 0 else log.warning)("watchdog %s: `%s` -> %s", name, cmd, rc)
        return rc

    def recover(self, trigger: str) -> RecoveryResult:
        """Run the recovery sequence now (callers check the cool-down; :meth:`step` does)."""
        p = self.plan
        self.last_start = self.clock()
        log.warning("watchdog: reset detected (%s); starting recovery", trigger)
        res = RecoveryResult(trigger, self.last_start)
        if p.stop_cmd:
            self._run(res, "stop", p.stop_cmd)
        self._run(res, "reset", p.reset_cmd)
        self.sleep(p.wait_s)
        if p.health_cmd:
            res.healthy = False
            for i in range(p.health_retries):
                if self._run(res, f"health[{i + 1}/{p.health_retries}]", p.health_cmd) == 0:
                    res.healthy = True
                    break
                if i + 1 < p.health_retries:
                    self.sleep(p.health_interval_s)
        if res.healthy is not False:
            if p.start_cmd:
                res.service_started = self._run(res, "start", p.start_cmd) == 0
            self.failures = 0
            log.warning("watchdog: recovery done (healthy=%s, service started=%s)", res.healthy, res.service_started)
        else:
            self.failures += 1
            if self.failures >= p.max_attempts:
                self.gave_up = True
                log.critical(
                    "watchdog: device still unhealthy after %d recoveries; giving up, service left stopped",
                    self.failures,
                )
            else:
                log.error("watchdog: health check failed; service not started; retry after the %.0f s cool-down", p.cooldown_s)
        drained = [t for _, t in self.follower.poll() if any(m.search(t) for m in self.markers)]
        if drained:  # markers written by our own reset
            self.suppressed += len(drained)
            log.info("watchdog: %d reset marker(s) written during the recovery ignored", len(drained))
        self.history.append(res)
        return res

    def run(self, stop: threading.Event | None = None, poll_s: float = 1.0) -> None:
        """Poll until ``stop`` is set (Ctrl-C stops the CLI)."""
        stop = stop or threading.Event()
        log.info("watchdog following %s (cool-down %.0f s)", self.follower.root, self.plan.cooldown_s)
        while not stop.is_set():
            self.step()
            stop.wait(poll_s)
