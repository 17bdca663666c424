"""``hstu serve``: run the HTTP service for a run directory under uvicorn.

    hstu serve --run RUN_DIR [--host 127.0.0.1] [--port 8000] [--device cpu] [--max-batch 16]
               [--max-wait-ms 5] [--buckets 20,50,100,200] [--max-queue 256] [--request-timeout-s 10]
               [--max-queue-delay-ms 1000] [--memory-threshold 0.10] [--body-timeout-s 5] [--header-timeout-s 5]
               [--unknown-items drop|reject] [--timestamp-order sort|reject]
               [--cold-start popular|reject] [--data-dir DIR] [--engine auto|never|require] [--prefix-cache-mb 0]
               [--config FILE]

Binds loopback by default. ``--port 0`` picks a free port; the line
``hstu serve: listening on http://HOST:PORT`` on stdout gives the address once the socket is
bound and the app's lifespan has started (the model processes have loaded the run; a start-up
that fails prints one ``hstu serve: error:`` line instead, exit 1): the service answers /healthz
at once and /readyz once every bucket is warm. SIGINT /
SIGTERM stop accepting connections, let in-flight requests finish (up to the request timeout),
then exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
from pathlib import Path

from hstu.cli import EXCLUDE_HISTORY_HELP, number_in
from hstu.generate.batch_cli import add_ann_flags
from hstu.generate.requests import fit_buckets, parse_buckets

log = logging.getLogger(__name__)


def graph_cache_hint(run_dir, graphs: str, device: str, buckets: list[int], max_batch: int, precision: str | None) -> str | None:
    """A line for the log when ``hstu serve`` on the CPU under ``--graphs auto`` will run eager because the
    run has no graph cache for these buckets and max batch at this precision (``precision``, else the run's saved
    scheme; :meth:`GraphCache.layouts`, :meth:`GraphCache.precisions`), else None. Measured on 2 cores (docs/cli.md,
    "serve"): the exported cache served the multi-channel presets at 1.1x (small) and 1.5x (large) eager's QPS on an
    AVX-512 host, the HSTU-block large preset at 4-6x on an older one; prod INT8 at eager's QPS (lower latency below the knee)."""
    if graphs != "auto" or device != "cpu":
        return None
    from hstu.backend.graph_cache import GraphCache

    lays = GraphCache.layouts(run_dir)
    want = _served_precision(run_dir, precision)
    if not lays and want in GraphCache.precisions(run_dir):  # used (GraphCache.beside cannot rule it out): layout_record_warning
        return None
    if GraphCache.layout_of(buckets, max_batch) in lays:
        built = GraphCache.precisions(run_dir)
        if want in built:
            return None
        had = f" at {want} (its graphs are {', '.join(sorted(built)) or 'none'})"
    else:
        had = "; ".join(f"buckets {x['buckets']}, max batch {x['max_batch']}" for x in lays)
        had = f" (its cache is for {had})" if had else ""
    flags = export_flags(buckets, max_batch, precision)
    gain = (
        "measured at eager's QPS for the prod preset at the knee, lower latency below it: P99 54 against 71 ms at 85 QPS"
        if want == "int8"
        else "measured 1.1x the QPS of eager for the small preset, 1.5x for the large"
    )
    return (
        f"{run_dir}: no graph cache for buckets {list(buckets)}, max batch {max_batch}{had}: the model runs eager; "
        f"`hstu export --run {run_dir} --graphs {flags}` builds one once (minutes; {gain}, 2 cores)"
    )


def _served_precision(run_dir, precision: str | None) -> str:
    """The precision a server of ``run_dir`` runs at: ``precision`` (--precision), else the run's saved scheme, else fp32."""
    from hstu.quant.checkpoint import read_quant_meta

    return precision or (read_quant_meta(Path(run_dir)) or {}).get("scheme") or "fp32"


def export_flags(buckets: list[int], max_batch: int, precision: str | None) -> str:
    """The `hstu export --graphs` flags that build the cache of this server's layout (and precision)."""
    return f"--buckets {','.join(str(b) for b in buckets)} --max-batch {int(max_batch)}" + (
        f" --precision {precision}" if precision else ""
    )


def layout_record_warning(run_dir, graphs: str, device: str, buckets: list[int], max_batch: int, precision: str | None) -> str | None:
    """A warning for the log when ``hstu serve`` on the CPU under ``--graphs auto`` finds a graph cache whose
    ``manifest.json`` is unreadable (the model runs eager), or uses one whose ``layout.json`` is missing or
    unreadable (:meth:`GraphCache.beside` cannot rule it out, so its graphs load where their names match this
    server's buckets and max batch, the rest run eager), else None."""
    if graphs != "auto" or device != "cpu":
        return None
    from hstu.backend.graph_cache import DIRNAME, LAYOUT, MANIFEST, GraphCache, ManifestError, manifest_entries

    try:
        manifest_entries(Path(run_dir) / DIRNAME / MANIFEST)
    except ManifestError as exc:
        flags = export_flags(buckets, max_batch, precision)
        return f"{exc.what}: the model runs eager; `hstu export --run {run_dir} --graphs {flags}` builds a new cache"
    if not GraphCache.unrecorded(run_dir, _served_precision(run_dir, precision)):
        return None
    return (
        f"{run_dir}: {DIRNAME}/{LAYOUT} is missing or unreadable: the graph cache's graphs load where they match "
        f"buckets {list(buckets)}, max batch {max_batch}, the rest run eager; `hstu export --run {run_dir} --graphs "
        f"{export_flags(buckets, max_batch, precision)}` builds what is missing and rewrites the file"
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to (host, port); port 0 picks a free one. It listens at once,
    so that connections made after the "listening on" line wait in the backlog while the app
    starts instead of being refused.

    Raises:
        OSError: ``host`` does not resolve, or (host, port) cannot be bound (in use, not a local
            address, a privileged port); the message names host:port.
    """
    where = f"cannot listen on {host}:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"{where}: the host does not resolve ({exc.strerror}); check --host") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"{where}: {exc.strerror or exc}; check --host / --port") from None
    return sock


MIN_BODY_BYTES = 1024  # ServePolicy.max_body_bytes' floor


def _check_prefix_cache_memory(mb: float, processes: int) -> None:
    """ValueError when the user-prefix caches' bound (``mb`` MiB in each of ``processes`` model processes) exceeds
    this machine's physical memory: the caches would grow until the kernel kills a process, never evicting."""
    from hstu.backend.cpu import host_memory_info

    total = host_memory_info().total_bytes
    if mb * 2**20 * processes > total:
        per = f" x {processes} model processes" if processes > 1 else ""
        raise ValueError(
            f"--prefix-cache-mb {mb:g}{per} is more than this machine's {total / 2**30:.1f} GiB of memory; give a bound it can hold"
        )


def _settings(args: argparse.Namespace):
    """(ServeConfig, ServePolicy, explicit bucket edges or None, the flag or field that gave them) from the flags over
    a ``--config`` file's [serve] table; ValueError naming the flag or field when one is out of range."""
    from hstu.backend.memory_guard import parse_bytes
    from hstu.config import ServeConfig, load_config_file, load_config_tables
    from hstu.serve.app import ServePolicy

    cfg, tables = ServeConfig(), load_config_tables(args.config) if args.config else {}
    if args.config:
        cfg = load_config_file(args.config).get("serve") or cfg  # every table checked, [serve] used
    if ignored := [f"[{t}]" for t in tables if t != "serve"]:  # the run's own model and recipe are served
        log.warning("--config %s: hstu serve reads its [serve] table only; %s not used", args.config, ", ".join(ignored))
    for name in (
        "host",
        "port",
        "max_batch",
        "max_wait_ms",
        "max_queue",
        "request_timeout_s",
        "memory_threshold",
        "body_timeout_s",
        "header_timeout_s",
        "graphs",
        "ann",
        "ann_nprobe",
        "ann_candidates",
        "prefix_cache_mb",
    ):
        v = getattr(args, name)
        if v is not None:
            setattr(cfg, name, v)  # flags are range-checked by argparse; a --config file's values here
    cfg.validate()
    for flag, on in (
        ("--ann: approximate candidates are the engine's picks", cfg.ann),
        ("--prefix-cache-mb: the cache is the engine's", cfg.prefix_cache_mb),
    ):
        if on and args.engine == "never":
            raise ValueError(f"{flag}; drop --engine never")
    _check_prefix_cache_memory(cfg.prefix_cache_mb, args.model_workers or 1)
    if cfg.ann:  # said here, before any model process starts (there it would fail at every restart)
        from hstu.quant.checkpoint import read_quant_meta

        if (read_quant_meta(Path(args.run)) or {}).get("embeddings") == "int8":
            raise ValueError(f"--ann: approximate picks need a float or 16-bit item table; {args.run} stores INT8 item rows")
    source = "--buckets" if args.buckets is not None else f"{args.config}: [serve] buckets"
    if args.buckets is not None:
        explicit = parse_buckets(args.buckets)
    else:  # a [serve] table without buckets keeps the defaults, clipped to the model like the flag's absence
        explicit = list(cfg.buckets) if "buckets" in (tables.get("serve") or {}) else None
    max_body_bytes = parse_bytes(args.max_body_bytes, field="--max-body-bytes")
    if max_body_bytes < MIN_BODY_BYTES:
        raise ValueError(f"--max-body-bytes: must be >= {MIN_BODY_BYTES} bytes, got {args.max_body_bytes}")
    policy = ServePolicy(
        unknown_items=args.unknown_items,
        timestamp_order=args.timestamp_order,
        max_body_bytes=max_body_bytes,
        max_candidates=args.max_candidates,
        cold_start=args.cold_start,
        max_queue_delay_ms=args.max_queue_delay_ms,
        use_engine=args.engine,
        device=args.device,
        model_process=args.model_process,
        precision=args.precision,
        threads=args.threads,
        model_workers=args.model_workers,
        exclude_history=args.exclude_history,
    )
    policy.validate()
    return cfg, policy, explicit, source


def cmd_serve(args: argparse.Namespace) -> int:
    """Check every setting, bind the socket, then load the run and serve (:func:`run_server`): a
    bad flag, a busy port or an unresolvable host fail (one line, exit 2) before any model
    (process) is started; a model process that keeps dying or hangs while loading fails in one
    line, exit 1."""
    import sys

    import torch
    import uvicorn

    from hstu.generate.recommend import Recommender
    from hstu.model.checkpoint import read_json
    from hstu.serve.app import create_app
    from hstu.serve.http_limits import http_protocol
    from hstu.serve.popularity import popularity_for_run
    from hstu.serve.worker import ModelProcessDied

    cfg, policy, explicit, source = _settings(args)
    try:
        sock = bind(cfg.host, cfg.port)
    except OSError as exc:
        print(f"hstu serve: error: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        if args.model_process:
            torch.set_num_threads(1)  # this process only parses requests; the model process uses --threads
        elif args.threads:
            torch.set_num_threads(args.threads)
        run = Path(args.run)
        # with a model process, this process only maps ids and formats answers: no weights here
        rec = Recommender.mapping_only(run) if args.model_process else Recommender.from_run(run, args.device, args.precision)
        cfg.buckets = fit_buckets(explicit, rec.model.cfg.max_seq_len, source)
        where = (run, cfg.graphs, args.device, cfg.buckets, cfg.max_batch, args.precision)
        if warning := layout_record_warning(*where):
            log.warning(warning)
        elif hint := graph_cache_hint(*where):
            log.info(hint)
        popularity = popularity_for_run(read_json(run / "config.json"), rec.idmap, args.data_dir) if args.cold_start == "popular" else None
        app = create_app(cfg, rec, run_dir=str(run), policy=policy, popularity=popularity)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        log_level=logging.getLevelName(logging.getLogger().level).lower(),
        access_log=args.access_log,
        log_config=_uvicorn_logging(),
        timeout_graceful_shutdown=int(cfg.request_timeout_s) + 1,
        limit_concurrency=args.limit_concurrency,
        http=http_protocol(cfg.header_timeout_s, app.state.header_timeout_answer),
        lifespan="off",
    )  # run_server drives the lifespan
    try:
        run_server(config, app, sock, f"hstu serve: listening on http://{host}:{port} (run {run}, buckets {cfg.buckets})")
    except (ModelProcessDied, TimeoutError) as exc:  # the model process kept dying, or hung, while loading: one line
        print(f"hstu serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        sock.close()
    return 0


def _uvicorn_logging() -> dict:
    """uvicorn's logging config with its access lines on stderr like every other log line (its default is stdout,
    whose first line is the "listening" line scripts read)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return cfg


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_server(config, app, sock: socket.socket, banner: str) -> None:
    """Serve ``app`` under uvicorn (``config``: a ``uvicorn.Config`` with ``lifespan="off"``) on
    ``sock``, entering the app's lifespan here, in the server's event loop: its start-up (model
    processes load the run) runs before ``banner`` is printed and before uvicorn takes connections
    (they wait in the backlog), and what it raises propagates as itself, with no traceback logged
    (uvicorn's own lifespan would log one and exit 3); its shutdown (the drain) runs after
    uvicorn's graceful shutdown, as under uvicorn's lifespan.

    Signals: Ctrl-C while the run loads raises KeyboardInterrupt at once (asyncio's runner would
    only cancel at the next await). From the banner until the drain has ended, SIGINT / SIGTERM
    get no-op handlers: uvicorn replaces them while it serves and re-raises a captured signal
    after its graceful shutdown, where the no-op makes a drained shutdown exit 0.

    Raises:
        what the lifespan's start-up raised (ModelProcessDied, TimeoutError, FileNotFoundError, ...).
    """
    import uvicorn

    class LifespanServer(uvicorn.Server):
        async def serve(self, sockets=None) -> None:
            async with contextlib.AsyncExitStack() as stack:
                previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
                stack.callback(lambda: [signal.signal(sig, handler) for sig, handler in previous.items()])  # after the drain
                await stack.enter_async_context(app.router.lifespan_context(app))
                for sig in previous:
                    signal.signal(sig, lambda *_: None)
                print(banner, flush=True)
                await super().serve(sockets=sockets)

    interrupt = signal.getsignal(signal.SIGINT)
    if interrupt is signal.default_int_handler:  # not where the launcher ignores SIGINT (a background job)
        signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        LifespanServer(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGINT, interrupt)


def _add_engine_flags(s: argparse.ArgumentParser) -> None:
    """--engine, --graphs, --ann and --prefix-cache-mb: how batches are generated."""
    s.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "never", "require"],
        help="generate through hstu.generate.engine when available (auto), never, or fail without it",
    )
    s.add_argument(
        "--graphs",
        choices=["auto", "eager", "compiled"],
        help="per-bucket graphs: auto (the default: CUDA / NPU graphs where the device has them; on the CPU the graphs of "
        "the run's graph cache at this precision where `hstu export --graphs` built one, eager for the rest), eager, "
        "or compiled (those graphs, else torch.compile: Inductor C++ on the CPU, compiled at warm-up, or loaded from "
        "the run's graph cache where `hstu export --run RUN --graphs` built one for these buckets and --max-batch; "
        "a failed compilation runs eager with a warning)",
    )
    add_ann_flags(s)
    s.add_argument(
        "--prefix-cache-mb",
        type=number_in(float, 0),
        help="each model process's user-prefix cache, MiB (default 0: off): a request's user_id keys its history's cached keys / "
        "values, so the user's next request computes only its new events (with --model-workers > 1 each process has its own; "
        "a batch goes to the idle one that last ran most of its users)",
    )


def add_subcommands(subparsers) -> None:
    """Add ``serve`` to the ``hstu`` command line."""
    s = subparsers.add_parser(
        "serve",
        help="HTTP recommendation service for a run (FastAPI + uvicorn)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--run", required=True, help="run directory written by `hstu train`")
    s.add_argument("--host", help="bind address (default 127.0.0.1, loopback only)")
    s.add_argument("--port", type=number_in(int, 0, 65535), help="TCP port, 0..65535 (default 8000; 0 = any free port)")
    s.add_argument("--device", default="cpu", help="auto | cpu | cuda | npu")
    s.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16", "int8"],
        help="inference precision (a float run is converted in memory; a quantized run loads as saved)",
    )
    s.add_argument(
        "--max-batch",
        type=number_in(int, 1),
        help="rows per model batch, >= 1 (a request takes one row, a beam request its beam width; default 16)",
    )
    s.add_argument("--max-wait-ms", type=number_in(float, 0), help="close a batch this long after its oldest request (default 5)")
    s.add_argument("--buckets", help="length-bucket edges in events (default 20,50,100,200 clipped to the model's max_seq_len)")
    s.add_argument("--max-queue", type=number_in(int, 1), help="waiting requests per bucket before 429 (default 256)")
    s.add_argument("--request-timeout-s", type=number_in(float, 0, lo_open=True), help="per-request timeout before 503 (default 10)")
    s.add_argument(
        "--max-queue-delay-ms",
        type=number_in(float, 0, lo_open=True),
        default=1000.0,
        help="refuse (429) when the predicted queueing delay is longer (default 1000)",
    )
    s.add_argument(
        "--body-timeout-s",
        type=number_in(float, 0, lo_open=True),
        help="a request body must arrive within this many seconds of its headers, else 408 and close (default 5)",
    )
    s.add_argument(
        "--header-timeout-s",
        type=number_in(float, 0, lo_open=True),
        help="request headers must arrive within this many seconds of the connection opening or of the "
        "previous response, else 408 and close (default 5)",
    )
    s.add_argument(
        "--memory-threshold",
        type=number_in(float, 0, 1),
        help="free-memory fraction under which caches are released / load shed (default 0.10)",
    )
    s.add_argument("--unknown-items", default="drop", choices=["drop", "reject"], help="unknown item ids: drop with a warning, or 422")
    s.add_argument("--timestamp-order", default="sort", choices=["sort", "reject"], help="out-of-order histories: sort, or 422")
    s.add_argument("--exclude-history", action=argparse.BooleanOptionalAction, help=EXCLUDE_HISTORY_HELP + "; a request's own field wins")
    s.add_argument(
        "--cold-start", default="popular", choices=["popular", "reject"], help="empty histories: most popular training items, or 422"
    )
    s.add_argument(
        "--data-dir",
        help="the run's training data (for cold-start popularity), if it moved since training (default: the counts stored in the run, else $HSTU_DATA_DIR, else the recorded directory)",
    )
    s.add_argument("--max-body-bytes", default="1MiB", help="larger bodies answer 413, >= 1024 (default 1MiB)")
    s.add_argument("--max-candidates", type=number_in(int, 1), default=1000, help="most candidates per /v1/score request")
    _add_engine_flags(s)
    s.add_argument("--limit-concurrency", type=number_in(int, 1), help="uvicorn: most concurrent connections before plain 503s")
    s.add_argument("--threads", type=number_in(int, 1), help="torch intra-op threads (of the model process)")
    s.add_argument(
        "--model-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run batches in a model process of their own, in parallel with the HTTP event loop (default: on)",
    )
    s.add_argument(
        "--model-workers",
        type=number_in(int, 1),
        default=1,
        help="model processes, each with a copy of the model and one batch in flight (default 1; CPU serving "
        "with spare cores gains from 2)",
    )
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.add_argument("--config", help="TOML/JSON with a [serve] table (flags override it; other tables are not used, a warning says so)")
    s.set_defaults(func=cmd_serve)


__all__ = ["add_subcommands", "cmd_serve", "fit_buckets", "graph_cache_hint", "layout_record_warning", "parse_buckets", "run_server"]
