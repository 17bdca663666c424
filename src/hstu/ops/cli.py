"""argparse wiring for ``hstu doctor | diagnose | monitor | watchdog``.

``add_subcommands(subparsers)`` is called by the top-level ``hstu`` CLI; each parser sets
``func=handler`` with ``handler(args) -> int`` (the exit code). ``python -m hstu.ops.cli ...`` runs
the same commands on their own.

Exit codes: 0 success; 1 doctor found a failing check / diagnose found errors / the watchdog gave up (or its
``--once`` recovery failed); 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)


def _ensure_logging(verbose: bool = False) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=logging.DEBUG if verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )


def _duration(text: str) -> float:
    from hstu.ops._common import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


# ---------------------------------------------------------------------------------------- doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    from hstu.ops import doctor

    _ensure_logging(getattr(args, "verbose", False))
    if wrong := _doctor_flag_error(args):
        print(f"hstu doctor: {wrong}", file=sys.stderr)
        return 2
    if args.conformance:
        return cmd_conformance(args)
    roots = tuple(Path(r) for r in args.ascend_root) if args.ascend_root else None
    try:
        table = doctor.load_compat(args.compat) if args.compat else doctor.load_compat()
    except OSError as exc:  # the raw errno named no flag ("[Errno 2] No such file or directory: 'nope.toml'")
        print(f"hstu doctor: --compat {args.compat}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"hstu doctor: {exc}", file=sys.stderr)
        return 2
    env = doctor.collect_environment(roots, import_probes=not args.no_import_probes)
    checks = doctor.run_checks(env, table)
    print(doctor.render_json(checks, env) if args.json else doctor.render_text(checks))
    return doctor.exit_code(checks)


_CONFORMANCE_FLAGS = ("device", "run", "report", "reps")  # dests: None unless given
_CHECK_FLAGS = ("compat", "ascend_root", "no_import_probes")  # the environment checks' inputs, unused by --conformance


def _doctor_flag_error(args: argparse.Namespace) -> str | None:
    """The line refusing a flag the chosen mode would ignore (a conformance flag without --conformance, an
    environment-check flag with it), or None."""
    if not args.conformance:
        given = [d for d in _CONFORMANCE_FLAGS if getattr(args, d) is not None]
        return f"--{given[0]} needs --conformance" if given else None
    given = [d for d in _CHECK_FLAGS if getattr(args, d)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        return f"{flag} is for the environment checks, which --conformance does not run: run `hstu doctor {flag} ...` on its own"
    return None


def cmd_conformance(args: argparse.Namespace) -> int:
    """``hstu doctor --conformance``: exit 2 without the device, for a bad --report or --run (nothing run, nothing
    written), 1 when a check fails. ``--json`` prints the report itself (the file is written too)."""
    import json

    from hstu.backend import BackendUnavailableError, select
    from hstu.ops.conformance import Conformance, check_report_path, render, write_report

    device = args.device or "npu"
    try:
        be = select(device)
    except (BackendUnavailableError, ValueError) as exc:
        print(f"hstu doctor --conformance: no {device} device here: {exc}", file=sys.stderr)
        return 2
    try:
        path = check_report_path(Path(args.report or f"hstu_conformance_{be.name}.json"))
        model = _conformance_model(args.run)
    except ValueError as exc:
        print(f"hstu doctor --conformance: {exc}", file=sys.stderr)
        return 2
    report = Conformance(model, be.device, reps=args.reps or 20).run()
    try:
        write_report(report, path)
    except OSError as exc:
        print(f"hstu doctor --conformance: --report {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    print(f"report: {path} (send this file back)", file=sys.stderr if args.json else sys.stdout)
    return 0 if report["status"] == "pass" else 1


def _conformance_model(run: str | None):
    """The run's float model on the CPU, or the small preset with seeded random weights (ML-1M's 3706 items).
    ValueError for a quantized run (:func:`hstu.ops.conformance.refuse_quantized`)."""
    import torch

    if run:
        from hstu.ops.conformance import refuse_quantized
        from hstu.runs import load_float_run

        refuse_quantized(run)
        return load_float_run(run, "cpu")[0]
    from hstu.config import PRESETS, ModelConfig
    from hstu.model import build_hstu

    torch.manual_seed(0)
    return build_hstu(ModelConfig(num_items=3706, dropout=0.0, **PRESETS["small"])).eval()


# ---------------------------------------------------------------------------------------- diagnose


def cmd_diagnose(args: argparse.Namespace) -> int:
    from hstu.ops import diagnose as dg

    _ensure_logging(getattr(args, "verbose", False))
    try:
        kb = dg.load_knowledge_base(args.kb) if args.kb else dg.load_knowledge_base()
    except (OSError, ValueError) as exc:
        print(f"hstu diagnose: {exc}", file=sys.stderr)
        return 2
    cann = args.cann_version
    if cann is None:
        from hstu.ops.probes import probe_ascend

        cann = probe_ascend().cann_version
    try:
        report = dg.diagnose(args.paths, kb, cann)
    except FileNotFoundError as exc:
        print(f"hstu diagnose: {exc}", file=sys.stderr)
        return 2
    print(dg.render_json(report) if args.json else dg.render_text(report))
    return 1 if report.findings or report.unknown else 0


# ---------------------------------------------------------------------------------------- monitor


def _rules_this_monitor_reads(rules, packaged: bool, exporting: bool = False) -> None:
    """ValueError naming the rule's file and line for a metric that neither `hstu monitor` (hstu.ops.metrics.METRICS)
    nor `hstu serve` (``hstu_serve_*``) exports (a misspelling: the rule could never fire); unless ``exporting``, a
    warning for one of the server's, which such a rule reads where both are scraped (Prometheus: ``--export-rules``),
    never inside the monitor (info for the ``packaged`` default rules)."""
    from hstu.ops.metrics import METRICS

    for r in rules:
        names = sorted(r.expr.metrics() - METRICS.keys())
        if bad := [n for n in names if not n.startswith("hstu_serve_")]:
            raise ValueError(f"{r.ref()}: when: unknown metric {bad[0]} (hstu monitor exports: {', '.join(sorted(METRICS))})")
        if names and not exporting:
            (log.info if packaged else log.warning)(
                "rule %s reads %s, which hstu serve exports, not hstu monitor: it fires in Prometheus "
                "(hstu monitor --export-rules), never here",
                r.name,
                ", ".join(names),
            )


def cmd_monitor(args: argparse.Namespace) -> int:
    from prometheus_client import generate_latest

    from hstu.ops import alerts, monitor

    _ensure_logging(getattr(args, "verbose", False))
    if args.duration is not None and not args.duration > 0:  # 0 ran forever (it read as "no --duration")
        print(f"hstu monitor: --duration must be > 0 (omit it to run until Ctrl-C / SIGTERM), got {args.duration:g}", file=sys.stderr)
        return 2
    if args.no_rules and args.rules:
        print("hstu monitor: --no-rules and --rules together: give one", file=sys.stderr)
        return 2
    try:
        rules = [] if args.no_rules else alerts.load_rules(args.rules)
        _rules_this_monitor_reads(rules, packaged=not args.rules, exporting=bool(args.export_rules))
    except (OSError, ValueError) as exc:  # refused before anything is exported, sampled or served
        print(f"hstu monitor: {exc}", file=sys.stderr)
        return 2
    if args.export_rules:
        text = alerts.export_prometheus_rules(rules, interval_s=args.interval)
        if args.export_rules == "-":
            sys.stdout.write(text)
        else:
            Path(args.export_rules).write_text(text, encoding="utf-8")
            print(f"wrote {len(rules)} alerting rule(s) to {args.export_rules}; check with: promtool check rules {args.export_rules}")
        return 0
    engine = alerts.AlertEngine(rules) if rules else None
    mon = monitor.Monitor(engine=engine, interval_s=args.interval)
    if args.once:
        mon.sample_once()
        sys.stdout.write(generate_latest(monitor.make_registry(mon)).decode())
        return 0
    try:
        host, port = monitor.parse_listen(args.listen)
    except ValueError as exc:
        print(f"hstu monitor: {exc}", file=sys.stderr)
        return 2
    try:
        server = monitor.MonitorServer(mon, host, port)
    except OSError as exc:
        print(f"hstu monitor: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():  # before the line saying it serves: a stop then exits 0
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    h, p = server.start()
    print(f"hstu monitor: http://{h}:{p}/metrics  /alerts  /health  (interval {args.interval:g} s)", flush=True)
    try:
        stop.wait(args.duration)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


# ---------------------------------------------------------------------------------------- watchdog


def _watchdog_once(wd) -> int:
    """``--once``: one look at the logs; 0 nothing to do or recovered, 1 the recovery failed."""
    res = wd.step()
    if res is None:
        print("no reset marker found")
        return 0
    for s in res.steps:
        print(f"{s.name:<12} {s.status} {s.seconds:.1f}s  {s.command}")
    print(f"healthy={res.healthy} service_started={res.service_started}")
    if not res.ok:
        print(f"recovery failed: {res.failure}; service not started")
    return 0 if res.ok else 1


def cmd_watchdog(args: argparse.Namespace) -> int:
    import re

    from hstu.ops.diagnose import load_knowledge_base
    from hstu.ops.watchdog import RecoveryPlan, Watchdog

    _ensure_logging(getattr(args, "verbose", False))
    try:
        if not args.poll > 0:  # 0 would poll the logs in a busy loop
            raise ValueError(f"--poll must be > 0 seconds, got {args.poll:g}")
        markers = [] if args.no_default_markers else list(load_knowledge_base().reset_markers)
        for m in args.marker or []:
            try:
                markers.append(re.compile(m))
            except re.error as exc:
                raise ValueError(f"--marker {m!r}: not a regular expression: {exc}") from None
        plan = RecoveryPlan(
            reset_cmd=args.on_reset,
            stop_cmd=args.stop_cmd,
            start_cmd=args.start_cmd,
            health_cmd=args.health_cmd,
            wait_s=args.wait,
            health_retries=args.health_retries,
            health_interval_s=args.health_interval,
            cooldown_s=args.cooldown,
            step_timeout_s=args.step_timeout,
            max_attempts=args.max_attempts,
        )
        wd = Watchdog(args.log_dir, plan, markers, from_start=args.from_start)
    except (ValueError, re.error, FileNotFoundError) as exc:
        print(f"hstu watchdog: {exc}", file=sys.stderr)
        return 2
    if args.once:
        return _watchdog_once(wd)
    stop = threading.Event()

    def on_term(*_) -> None:  # a recovery in progress is finished first: a half-done reset is worse than a late exit
        logging.getLogger("hstu.ops.watchdog").warning("SIGTERM: stopping after the step in progress (a recovery runs to its end)")
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    try:
        wd.run(stop, poll_s=args.poll)
    except KeyboardInterrupt:
        pass
    if wd.gave_up:  # run() returned at once: a service manager sees the failure (Restart=, OnFailure=)
        print(
            f"hstu watchdog: gave up after {wd.failures} failed recoveries in a row ({wd.last_failure}); "
            "the service is left stopped, a person has to look: exit 1",
            file=sys.stderr,
        )
        return 1
    return 0


# ---------------------------------------------------------------------------------------- wiring


_EXTRA_MODULES = {"yaml": "pyyaml", "psutil": "psutil", "prometheus_client": "prometheus-client"}


def _needs_extra(handler):
    """Turn a missing optional dependency into a one-line message and exit code 2."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ModuleNotFoundError as exc:
            if exc.name not in _EXTRA_MODULES:
                raise
            print(f"hstu {args.command}: needs {_EXTRA_MODULES[exc.name]}: pip install 'hstu[ops]'", file=sys.stderr)
            return 2

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    from hstu.cli import number_in  # the command line's ranged-number type (a lazy import: hstu.cli loads this module)

    p.add_argument("--json", action="store_true", help="machine-readable output (checks + raw environment)")
    p.add_argument(
        "--ascend-root",
        action="append",
        metavar="DIR",
        help="Ascend install root(s) to search instead of /usr/local/Ascend and ~/Ascend (repeatable)",
    )
    p.add_argument("--compat", metavar="FILE", help="use another compatibility table (TOML, same schema)")
    p.add_argument(
        "--no-import-probes", action="store_true", help="skip the subprocess `import torch_npu` / autoload probes (faster, less precise)"
    )
    c = p.add_argument_group("conformance (hstu.ops.conformance)")
    c.add_argument(
        "--conformance",
        action="store_true",
        help="replay every op the model runs on --device against the CPU reference (relative error per op), check each "
        "bucket's device graphs against eager, time next-5; writes one report file; exit 2 without the device",
    )
    c.add_argument("--device", help="device to check (default npu; cuda; cpu checks the tool itself)")
    c.add_argument(
        "--run", metavar="RUN", help="check this float run's model (default: the small preset, seeded random weights; not a quantized run)"
    )
    c.add_argument("--report", metavar="FILE", help="report path, its directory existing (default hstu_conformance_<device>.json)")
    c.add_argument(
        "--reps", type=number_in(int, 1), metavar="N", help="timed next-5 rounds per side in the graphs section, >= 1 (default 20)"
    )


def _diagnose_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files or directories (e.g. ~/ascend/log /var/log/npu/slog); - for stdin")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--cann-version", metavar="VER", help="CANN release the logs come from (default: the one installed here, if any)")
    p.add_argument("--kb", metavar="FILE", help="use another knowledge base (YAML, same schema)")


def _monitor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen", default="127.0.0.1:9400", metavar="HOST:PORT", help="address to serve on (default %(default)s; port 0 = any)"
    )
    p.add_argument("--interval", type=_duration, default=1.0, metavar="DUR", help="sampling interval, e.g. 1s, 500ms (default 1s)")
    p.add_argument("--rules", metavar="FILE", help="alert rules (YAML/TOML/JSON); default: the packaged default_alerts.yaml")
    p.add_argument("--no-rules", action="store_true", help="evaluate no alert rules")
    p.add_argument("--export-rules", metavar="FILE", help="write the rules as a Prometheus alerting-rules file (- for stdout) and exit")
    p.add_argument("--once", action="store_true", help="take one sample, print it in Prometheus text format, exit")
    p.add_argument("--duration", type=_duration, metavar="DUR", help="stop after this long (default: run until Ctrl-C / SIGTERM)")


def _watchdog_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-dir", required=True, metavar="DIR", help="directory (or file) of device logs to follow, e.g. /var/log/npu/slog")
    p.add_argument("--on-reset", required=True, metavar="CMD", help="device reset command, e.g. 'npu-smi set -t reset -i 0 -c 0'")
    p.add_argument("--stop-cmd", metavar="CMD", help="stop the service first, e.g. 'systemctl stop hstu-serve'")
    p.add_argument("--start-cmd", metavar="CMD", help="start the service after a healthy check")
    p.add_argument("--health-cmd", metavar="CMD", help="exit 0 when the device is healthy, e.g. 'npu-smi info -t health -i 0'")
    for flag, default, what in (
        ("--wait", 30.0, "wait after the reset (default 30s)"),
        ("--cooldown", 300.0, "minimum time between recoveries (default 5m)"),
        ("--health-interval", 10.0, "between health checks, > 0 (default 10s)"),
        ("--step-timeout", 600.0, "timeout of each command, > 0 (default 10m); a reset that times out is a failed recovery"),
        ("--poll", 1.0, "log polling interval, > 0 (default 1s)"),
    ):
        p.add_argument(flag, type=_duration, default=default, metavar="DUR", help=what)
    p.add_argument("--health-retries", type=int, default=3, metavar="N", help="health-check attempts (default 3)")
    p.add_argument(
        "--max-attempts", type=int, default=3, metavar="N", help="give up (exit 1) after N failed recoveries in a row (default 3)"
    )
    p.add_argument("--marker", action="append", metavar="REGEX", help="extra reset-marker regex (repeatable)")
    p.add_argument("--no-default-markers", action="store_true", help="use only --marker patterns")
    p.add_argument("--from-start", action="store_true", help="also scan lines already in the logs (default: only new lines)")
    p.add_argument("--once", action="store_true", help="check the logs once, recover if needed, exit")


# (command, handler, help, description, arguments) of the operating tools
_COMMANDS = (
    (
        "doctor",
        cmd_doctor,
        "check Python/torch/torch_npu/CANN/driver/CUDA/Triton against the known-good table",
        "Check this host against the shipped compatibility table; print pass/warn/fail with the fix. Exit 1 if any check fails.",
        _doctor_arguments,
    ),
    (
        "diagnose",
        cmd_diagnose,
        "explain errors in Ascend plog/slog logs, tracebacks and dmesg",
        "Match logs against the knowledge base; print likely causes with a verify command and a fix each, and the evidence lines. "
        "Exit 1 if anything was found, 2 on bad input.",
        _diagnose_arguments,
    ),
    (
        "monitor",
        cmd_monitor,
        "Prometheus exporter of device/host metrics with composite alert rules",
        "Serve /metrics, /alerts and /health; evaluate alert rules on every sample.",
        _monitor_arguments,
    ),
    (
        "watchdog",
        cmd_watchdog,
        "follow device logs for resets and run the recovery with a cool-down",
        "On a reset marker: stop service -> reset command -> wait -> health check -> start service; never more often than the cool-down.",
        _watchdog_arguments,
    ),
)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``doctor``, ``diagnose``, ``monitor`` and ``watchdog`` to the ``hstu`` command (optional
    dependencies checked when one runs)."""
    for name, handler, help_, description, add_arguments in _COMMANDS:
        p = subparsers.add_parser(name, help=help_, description=description)
        add_arguments(p)
        p.set_defaults(func=_needs_extra(handler), command=name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hstu", description="hstu operations tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
