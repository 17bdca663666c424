"""hstu watchdog: log following (new lines, rotation, truncation, new files), the recovery sequence
run as real shell commands, the cool-down (never two recoveries closer than it), health-check
retries and giving up. Time is a fake clock, so nothing here waits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hstu.ops.cli import main
from hstu.ops.diagnose import load_knowledge_base
from hstu.ops.watchdog import LogFollower, RecoveryPlan, Watchdog

SLOG = Path(__file__).parent / "fixtures" / "ops" / "logs" / "slog"
MARKERS = load_knowledge_base().reset_markers
RESET_LINE = (
    "[ERROR] TSCH(-1,null):2024-05-10-14:35:02.900.001 [ts_heartbeat.c:201] device heartbeat lost, begin device hot reset, dev_id=0\n"
)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


def plan(tmp: Path, **kw) -> RecoveryPlan:
    trace = tmp / "trace"
    base = dict(
        stop_cmd=f"echo stop >> {trace}",
        reset_cmd=f"echo reset >> {trace}",
        health_cmd=f"echo health >> {trace}; test -f {tmp / 'healthy'}",
        start_cmd=f"echo start >> {trace}",
        wait_s=30,
        health_retries=2,
        health_interval_s=5,
        cooldown_s=300,
        step_timeout_s=30,
        max_attempts=2,
    )
    base.update(kw)
    return RecoveryPlan(**base)


def trace(tmp: Path) -> list[str]:
    f = tmp / "trace"
    return f.read_text().split() if f.exists() else []


def test_follower_new_lines_partial_rotation_truncation(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    f = d / "a.log"
    f.write_text("old line\n")
    fol = LogFollower(d)
    assert fol.poll() == []  # existing content is skipped by default
    append(f, "one\ntw")
    assert fol.poll() == [(str(f), "one")]
    append(f, "o\n")
    assert fol.poll() == [(str(f), "two")]  # the partial line waited for its newline
    f.rename(d / "a.log.1")  # rotation: a new file under the old name is read from its start
    f.write_text("fresh\n")
    assert sorted(fol.poll()) == [(str(f), "fresh")]
    f.write_text("x\n")  # truncated and rewritten
    assert fol.poll() == [(str(f), "x")]
    (d / "sub").mkdir()
    (d / "sub" / "b.log").write_text("new file\n")
    assert fol.poll() == [(str(d / "sub" / "b.log"), "new file")]
    assert LogFollower(d, from_start=True).poll()[0] == (str(f), "x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LogFollower(tmp_path / "absent")


def test_recovery_sequence_and_own_markers_ignored(tmp_path):
    (tmp_path / "healthy").touch()
    log = tmp_path / "dev.log"
    log.write_text(RESET_LINE)  # an old reset before the watchdog started: ignored
    clock = FakeClock()
    # the reset command itself writes a reset marker into the log, as a real device reset does
    p = plan(tmp_path, reset_cmd=f"echo reset >> {tmp_path / 'trace'}; echo 'device 0 hot reset done' >> {log}")
    wd = Watchdog(log, p, MARKERS, clock=clock, sleep=clock.sleep)
    assert wd.step() is None
    append(log, "[INFO] all fine\n")
    assert wd.step() is None and trace(tmp_path) == []
    append(log, RESET_LINE)
    res = wd.step()
    assert res is not None and "heartbeat lost" in res.trigger
    assert trace(tmp_path) == ["stop", "reset", "health", "start"]
    assert [s.name for s in res.steps] == ["stop", "reset", "health[1/2]", "start"]
    assert all(s.returncode == 0 for s in res.steps)
    assert res.healthy is True and res.service_started is True
    assert clock.t == 1030.0  # waited 30 s after the reset
    assert wd.suppressed == 1  # the marker the reset wrote
    assert wd.step() is None and len(wd.history) == 1


def test_cooldown_is_never_violated(tmp_path):
    (tmp_path / "healthy").touch()
    log = tmp_path / "dev.log"
    log.write_text("")
    clock = FakeClock(0.0)
    wd = Watchdog(log, plan(tmp_path), MARKERS, clock=clock, sleep=clock.sleep)
    append(log, RESET_LINE)
    assert wd.step() is not None  # starts at t=0, clock -> 30 after the wait
    clock.t = 100.0
    append(log, RESET_LINE)
    assert wd.step() is None and wd.suppressed == 1
    clock.t = 299.0
    append(log, RESET_LINE)
    assert wd.step() is None and wd.suppressed == 2
    clock.t = 300.0
    append(log, RESET_LINE)
    assert wd.step() is not None
    assert trace(tmp_path) == ["stop", "reset", "health", "start"] * 2


def test_marker_storm_recovers_exactly_once_per_cooldown(tmp_path):
    log = tmp_path / "dev.log"
    log.write_text("")
    clock = FakeClock(0.0)
    calls = []

    def runner(cmd, timeout):
        calls.append((clock(), cmd))
        return 0, ""

    wd = Watchdog(
        log,
        RecoveryPlan(reset_cmd="reset", wait_s=30, cooldown_s=300),
        MARKERS,
        runner=runner,
        clock=clock,
        sleep=clock.sleep,
    )
    for t in range(0, 1000, 10):  # a reset marker every 10 s for 1000 s
        clock.t = max(clock.t, float(t))
        append(log, RESET_LINE)
        wd.step()
    starts = [r.started_at for r in wd.history]
    assert starts == [0.0, 300.0, 600.0, 900.0]  # hand-computed: first marker at or after each cool-down
    assert all(b - a >= 300 for a, b in zip(starts, starts[1:]))


def test_unhealthy_is_retried_after_cooldown_then_gives_up(tmp_path):
    log = tmp_path / "dev.log"
    log.write_text("")
    clock = FakeClock(0.0)
    wd = Watchdog(log, plan(tmp_path), MARKERS, clock=clock, sleep=clock.sleep)
    append(log, RESET_LINE)
    res = wd.step()
    assert res.healthy is False and not res.service_started
    assert trace(tmp_path) == ["stop", "reset", "health", "health"]  # 2 attempts, no start
    assert clock.t == 35.0  # wait 30 + one 5 s interval between the two health checks
    assert wd.step() is None  # still cooling down
    clock.t = 300.0
    res2 = wd.step()  # no new marker needed: the device was left unhealthy
    assert res2 is not None and res2.trigger.startswith("retry:")
    assert wd.gave_up and wd.failures == 2
    clock.t = 10_000.0
    append(log, RESET_LINE)
    assert wd.step() is None and len(wd.history) == 2  # gave up: a person has to look


def test_retry_succeeds_when_device_comes_back(tmp_path):
    log = tmp_path / "dev.log"
    log.write_text("")
    clock = FakeClock(0.0)
    wd = Watchdog(log, plan(tmp_path, max_attempts=3), MARKERS, clock=clock, sleep=clock.sleep)
    append(log, RESET_LINE)
    assert wd.step().healthy is False
    (tmp_path / "healthy").touch()
    clock.t = 301.0
    res = wd.step()
    assert res.healthy is True and res.service_started and wd.failures == 0 and not wd.gave_up
    assert trace(tmp_path)[-2:] == ["health", "start"]


def test_plan_validation():
    with pytest.raises(ValueError, match="must not be empty"):
        RecoveryPlan(reset_cmd="  ")
    with pytest.raises(ValueError, match="cool-down must be > 0"):
        RecoveryPlan(reset_cmd="x", cooldown_s=0)
    with pytest.raises(ValueError, match="health_retries"):
        RecoveryPlan(reset_cmd="x", health_retries=0)


def test_cli_once_on_slog_fixture(tmp_path, capsys):
    logs = tmp_path / "slog"
    shutil.copytree(SLOG, logs)
    t = tmp_path / "trace"
    args = [
        "watchdog",
        "--log-dir",
        str(logs),
        "--on-reset",
        f"echo reset >> {t}",
        "--stop-cmd",
        f"echo stop >> {t}",
        "--start-cmd",
        f"echo start >> {t}",
        "--health-cmd",
        "true",
        "--wait",
        "0s",
        "--cooldown",
        "1s",
    ]
    assert main(args + ["--once"]) == 0  # only new lines by default: nothing to do
    assert "no reset marker found" in capsys.readouterr().out
    assert main(args + ["--once", "--from-start"]) == 0
    out = capsys.readouterr().out
    assert t.read_text().split() == ["stop", "reset", "start"]
    assert "healthy=True service_started=True" in out
    assert main(["watchdog", "--log-dir", str(tmp_path / "nope"), "--on-reset", "x", "--once"]) == 2
    capsys.readouterr()
    assert main(["watchdog", "--log-dir", str(logs), "--on-reset", "x", "--marker", "(", "--once"]) == 2
    assert capsys.readouterr().err.strip().startswith("hstu watchdog: --marker '(': not a regular expression: ")  # named the flag


@pytest.mark.parametrize(
    "line,is_reset",
    [
        (RESET_LINE, True),
        (
            "[ 9522.1] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            True,
        ),
        ("aclrtSynchronizeStream failed, error code = 507010", True),
        ("[ 9600.0] NVRM: Xid (PCI:0000:86:00): 94, pid=912, name=python, Ch 00000008", False),  # ECC: app restart
        (
            "ERR00100 PTA call acl api failed: getRepoStopFlag in Run, throw FORCE STOP.",
            False,
        ),  # job abort, not a reset
        ("[INFO] TSCH(-1,null):2024-05-10-14:35:32.000.000 [ts_init.c:55] ts init success after reset", False),
    ],
)
def test_default_reset_markers(line, is_reset):
    assert any(m.search(line) for m in MARKERS) == is_reset
