"""hstu watchdog: log following (new lines, rotation, truncation, new files), the recovery sequence
run as real shell commands, the cool-down (never two recoveries closer than it), health-check
retries and giving up. Time is a fake clock, so nothing here waits."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from hstu.ops.cli import main
from hstu.ops.diagnose import load_knowledge_base
from hstu.ops.watchdog import LogFollower, RecoveryPlan, Watchdog, run_shell

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
    f.write_text("")  # copytruncate `: > a.log`, then a line longer than the old content, before the next poll
    append(f, "longer\n")
    assert fol.poll() == [(str(f), "longer")]  # not "nger" from the old offset 2
    f.write_text("second\n")  # rewritten to the same length (7 bytes): no growth
    assert fol.poll() == [(str(f), "second")]
    os.utime(f, (1, 1))  # only the times change: nothing is read again
    assert fol.poll() == []
    (d / "sub").mkdir()
    (d / "sub" / "b.log").write_text("new file\n")
    assert fol.poll() == [(str(d / "sub" / "b.log"), "new file")]
    assert LogFollower(d, from_start=True).poll()[0] == (str(f), "second")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LogFollower(tmp_path / "absent")


def test_follower_copytruncate_copy_is_not_read_again(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    f = d / "a.log"
    f.write_text("2024-05-10 old reset marker\n")
    fol = LogFollower(d)
    append(f, "2024-05-10 seen\n2024-05-10 unse")
    assert fol.poll() == [(str(f), "2024-05-10 seen")]
    append(f, "en\n")  # written after the poll, before logrotate copies the file
    shutil.copyfile(f, d / "a.log.1")  # logrotate copytruncate: copy, then truncate in place
    f.write_text("")
    append(f, "2024-05-10 after rotation\n")
    # the copy goes on from a.log's position (its old lines are not read again), a.log from its new start
    assert fol.poll() == [(str(f), "2024-05-10 after rotation"), (str(d / "a.log.1"), "2024-05-10 unseen")]
    assert fol.poll() == []
    copy = d / "a.log.2"  # a copy still being written: it waits until it reaches the copied position
    copy.write_bytes(f.read_bytes()[:10])
    assert fol.poll() == []
    copy.write_bytes(f.read_bytes() + b"2024-05-10 new in copy\n")
    assert fol.poll() == [(str(copy), "2024-05-10 new in copy")]
    other = d / "b.log"  # a new file that only starts like a followed one is read from its start
    other.write_text("2024-05-10 a")
    assert fol.poll() == []
    append(other, "nother file\n")
    assert fol.poll() == [(str(other), "2024-05-10 another file")]


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


def test_failed_or_timed_out_reset_is_a_failed_recovery(tmp_path):
    (tmp_path / "healthy").touch()
    log = tmp_path / "dev.log"
    log.write_text("")
    clock = FakeClock(0.0)
    wd = Watchdog(log, plan(tmp_path, reset_cmd=f"echo reset >> {tmp_path / 'trace'}; exit 3"), MARKERS, clock=clock, sleep=clock.sleep)
    append(log, RESET_LINE)
    res = wd.step()
    assert trace(tmp_path) == ["stop", "reset"]  # no wait, no health check, no start on top of a failed reset
    assert [s.status for s in res.steps] == ["rc=0", "rc=3"] and clock.t == 0.0
    assert not res.ok and res.failure == "reset command failed (exit 3)" and res.healthy is None and not res.service_started
    assert wd.failures == 1 and not wd.gave_up
    clock.t = 300.0
    res2 = wd.step()  # retried after the cool-down, no new marker needed; the second failure gives up (max_attempts=2)
    assert res2.trigger == "retry: the previous recovery failed: reset command failed (exit 3) (1 in a row)"
    assert wd.gave_up and wd.failures == 2 and trace(tmp_path) == ["stop", "reset"] * 2

    clock.t = 0.0
    wd = Watchdog(
        log,
        plan(tmp_path, reset_cmd=f"echo reset >> {tmp_path / 'trace'}; sleep 5", step_timeout_s=0.3),
        MARKERS,
        clock=clock,
        sleep=clock.sleep,
    )
    append(log, RESET_LINE)
    res = wd.step()
    assert [(s.name, s.returncode, s.status) for s in res.steps] == [("stop", 0, "rc=0"), ("reset", None, "timed out")]
    assert res.failure == "reset command timed out" and wd.failures == 1 and trace(tmp_path)[-1] == "reset"


def test_run_shell_timeout_kills_what_the_command_started(tmp_path):
    pidfile = tmp_path / "pid"
    t0 = time.monotonic()
    rc, out = run_shell(f"sleep 30 & echo $! > {pidfile}; wait", 0.3)
    assert rc is None and out.startswith("timed out after 0.3 s") and time.monotonic() - t0 < 5
    proc = Path("/proc") / pidfile.read_text().strip()
    deadline = time.monotonic() + 5
    while proc.exists() and " Z " not in (proc / "stat").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proc.exists() or " Z " in (proc / "stat").read_text()  # the background sleep went with the shell
    assert run_shell("echo hi; exit 4", 5) == (4, "hi\n")
    t0 = time.monotonic()
    assert run_shell("sleep 3 > /dev/null 2>&1 &", 2)[0] == 0  # a command that starts a service in the background
    assert time.monotonic() - t0 < 1.5


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
    with pytest.raises(ValueError, match="^--cooldown must be > 0 seconds, got 0$"):
        RecoveryPlan(reset_cmd="x", cooldown_s=0)
    with pytest.raises(ValueError, match="^--step-timeout must be > 0 seconds, got 0$"):
        RecoveryPlan(reset_cmd="x", step_timeout_s=0)
    with pytest.raises(ValueError, match="^--health-retries must be >= 1, got 0$"):
        RecoveryPlan(reset_cmd="x", health_retries=0)
    with pytest.raises(ValueError, match="^--max-attempts must be >= 1, got -2$"):
        RecoveryPlan(reset_cmd="x", max_attempts=-2)
    with pytest.raises(ValueError, match="^--wait must be >= 0 seconds, got -1$"):
        RecoveryPlan(reset_cmd="x", wait_s=-1)
    with pytest.raises(ValueError, match="^--health-interval must be > 0 seconds, got 0$"):
        RecoveryPlan(reset_cmd="x", health_interval_s=0)
    assert RecoveryPlan(reset_cmd="x", wait_s=0).wait_s == 0  # no wait after the reset is allowed


@pytest.mark.parametrize(
    "flag,value,error",
    [
        ("--step-timeout", "0", "--step-timeout must be > 0 seconds, got 0"),
        ("--step-timeout", "0s", "--step-timeout must be > 0 seconds, got 0"),
        ("--cooldown", "0", "--cooldown must be > 0 seconds, got 0"),
        ("--poll", "0ms", "--poll must be > 0 seconds, got 0"),
        ("--health-interval", "0", "--health-interval must be > 0 seconds, got 0"),  # a trial: was accepted
        ("--health-interval", "0s", "--health-interval must be > 0 seconds, got 0"),
        ("--health-retries", "0", "--health-retries must be >= 1, got 0"),
        ("--max-attempts", "0", "--max-attempts must be >= 1, got 0"),
    ],
)
def test_cli_refuses_bad_values_naming_the_flag(tmp_path, capsys, flag, value, error):
    t = tmp_path / "trace"
    assert main(["watchdog", "--log-dir", str(tmp_path), "--on-reset", f"echo reset >> {t}", flag, value, "--once"]) == 2
    assert capsys.readouterr().err.strip() == f"hstu watchdog: {error}"
    assert not t.exists()


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


def test_cli_once_failed_or_timed_out_reset_does_not_start(tmp_path, capsys):
    logs = tmp_path / "wd" / "logs"
    logs.mkdir(parents=True)
    (logs / "a.log").write_text(RESET_LINE)
    t = tmp_path / "trace"
    args = ["watchdog", "--log-dir", str(logs), "--start-cmd", f"echo start >> {t}", "--from-start", "--once", "--wait", "0s"]
    assert main(args + ["--on-reset", "false"]) == 1
    out = capsys.readouterr().out
    assert "reset        rc=1 " in out and "healthy=None service_started=False" in out
    assert "recovery failed: reset command failed (exit 1); service not started" in out
    assert main(args + ["--on-reset", "sleep 5", "--step-timeout", "0.3s"]) == 1
    out = capsys.readouterr().out
    assert "reset        timed out " in out and "rc=None" not in out
    assert "recovery failed: reset command timed out; service not started" in out
    assert not t.exists()  # the service was never started


def test_cli_exits_1_at_once_after_giving_up_and_0_on_interrupt(tmp_path, capsys, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.log").write_text(RESET_LINE)
    args = ["watchdog", "--log-dir", str(logs), "--health-cmd", "false", "--wait", "0s", "--health-interval", "10ms"]
    args += ["--from-start", "--poll", "10ms"]
    rc = []
    th = threading.Thread(target=lambda: rc.append(main(args + ["--on-reset", "true", "--max-attempts", "1"])), daemon=True)
    th.start()
    th.join(20)
    assert not th.is_alive() and rc == [1]  # it stops watching instead of logging on, so a service manager sees it
    err = capsys.readouterr().err
    assert "hstu watchdog: gave up after 1 failed recoveries in a row (health check still failing after 3 attempt(s))" in err

    def interrupted(self, stop=None, poll_s=1.0):
        raise KeyboardInterrupt

    monkeypatch.setattr(Watchdog, "run", interrupted)
    assert main(args + ["--on-reset", "true"]) == 0  # Ctrl-C: exit 0, as documented


@pytest.mark.parametrize(
    "line,is_reset",
    [
        (RESET_LINE, True),
        (
            "[ 9522.1] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            True,
        ),
        ("aclrtSynchronizeStream failed, error code = 507010", True),
        ("[ 9700.5] [ascend] [devdrv] [ERROR] <kworker/0:1:93> device 2 heartbeat lost, start hot reset", True),
        ("[ERROR] DRV(1,null):2024-05-10-14:35:02.900.001 [hb.c:88] heartbeat lost, dev_id=3", True),
        ("npu 3 heartbeat timeout", True),
        ("rtStreamSynchronize failed, runtime result = 507010", True),
        # a second trial's real forms: a period after the code, a syslog prefix, the device's index in other spellings
        ("[ERROR] RUNTIME(1234,python):2024-05-10 rtStreamSynchronize failed, error code is 507010.", True),
        ("Jan 01 12:00:00 host python[123]: [ERROR] TSCH(-1,null):2024-05-10 [hb.c:1] heartbeat lost", True),
        ("2024-05-01T12:00:00Z [ERROR] DRV(5678,dmp):2024-05-01 [hb.c:2] heart beat timeout", True),
        ("device(0) heartbeat lost", True),
        ("devId=0, heartbeat lost", True),
        ("hot reset of device 3", True),
        ("npu-smi set -t reset -i 0 -c 0", True),
        # ordinary application lines: a bare number, an application's own heartbeat (a trial: they reset the device)
        ("INFO batch job: processed 507010 rows in 3.2s", False),
        ("INFO kafka consumer heartbeat timeout, rejoining group", False),
        ("INFO user requested: reset device settings for account 42", False),  # the second trial's: no device index
        ("INFO hot reset of the config cache done", False),
        ("INFO device reset password email sent", False),
        ("WARN mobile device heartbeat timeout for session 9f3a", False),
        ("result: 507010 users evaluated", False),
        ("error_count=507010", False),
        ("ret=507010", False),  # a plain "ret" only on a line about the runtime / driver
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


def test_cli_ordinary_app_lines_do_not_start_a_recovery(tmp_path, capsys):
    """A trial: `processed 507010 rows` and a Kafka heartbeat timeout were reset markers: the watchdog stopped the
    service and reset the device on ordinary application log lines."""
    logs = tmp_path / "wd" / "logs"
    logs.mkdir(parents=True)
    (logs / "app.log").write_text("INFO batch job: processed 507010 rows in 3.2s\nINFO kafka consumer heartbeat timeout, rejoining group\n")
    r = tmp_path / "wd" / "r.txt"
    args = ["watchdog", "--log-dir", str(logs), "--on-reset", f"echo RESET >> {r}", "--stop-cmd", f"echo STOP >> {r}"]
    assert main(args + ["--wait", "100ms", "--from-start", "--once"]) == 0
    assert capsys.readouterr().out == "no reset marker found\n"
    assert not r.exists()  # neither the stop nor the reset command ran
    append(logs / "app.log", RESET_LINE)  # a real device reset still starts the recovery
    assert main(args + ["--wait", "0s", "--from-start", "--once"]) == 0
    assert r.read_text().split() == ["STOP", "RESET"]
