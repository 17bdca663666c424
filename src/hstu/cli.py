"""Command line: ``hstu train | eval | generate | demo`` and the operational tools.

Every handler returns an exit code; errors a user can fix (missing files, malformed data, bad options, unavailable devices)
print one line to stderr and exit 2."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path

from hstu.config import BEAM_WIDTH_MAX, INT64_MAX, SEED_MAX, TEMPERATURE_MAX, TIME_S_MAX, TOP_K_MAX, DecodeOptions, check_k
from hstu.interrupts import Deferred, ignore_after_return, interrupted, terminated

log = logging.getLogger("hstu")


def default_data_dir() -> Path | None:
    """$HSTU_DATA_DIR, else ../shared/data/ml-1m beside the current directory or the repo."""
    env = os.environ.get("HSTU_DATA_DIR")
    if env:
        return Path(env)
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        cand = base.parent / "shared" / "data" / "ml-1m"
        if (cand / "ratings.dat").exists():
            return cand
    return None


def number_in(kind: type = int, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """An argparse ``type``: a finite ``kind`` (int or float) in [lo, hi] (an open end with ``lo_open`` / ``hi_open``;
    None: unbounded). Anything else exits 2 naming the flag and the range, e.g. ``argument --port: must be in 0..65535, got 70000``."""

    def num(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else str(x)

    if lo is not None and hi is not None:
        closed = kind is int and not (lo_open or hi_open)
        rng = f"in {num(lo)}..{num(hi)}" if closed else f"in {'(' if lo_open else '['}{num(lo)}, {num(hi)}{')' if hi_open else ']'}"
    elif lo is not None:
        rng = f"{'>' if lo_open else '>='} {num(lo)}"
    else:
        rng = f"<= {num(hi)}"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        below, above = lo is not None and (v <= lo if lo_open else v < lo), hi is not None and (v >= hi if hi_open else v > hi)
        if not math.isfinite(v) or below or above:  # inf / nan: "a finite number", as the config files say
            raise argparse.ArgumentTypeError(f"must be {'' if math.isfinite(v) else 'a finite number '}{rng}, got {text}")
        return v

    return parse


NO_DATA = (
    "MovieLens-1M not found. Download https://files.grouplens.org/datasets/movielens/ml-1m.zip, unzip it, and "
    "pass --data-dir PATH/ml-1m (or set HSTU_DATA_DIR). MovieLens may not be redistributed, so hstu does not ship it."
)


EXCLUDE_HISTORY_HELP = (
    "candidate policy: never recommend (and do not rank) items already in the user's history; default: the run's "
    "(hstu train --exclude-history), else the data set's (on for MovieLens / Amazon ratings, off for e-commerce event logs)"
)
PRECISION_CHOICES = ("fp32", "bf16", "fp16", "int8")
PRECISION_HELP = (
    "inference precision: a float run is converted in memory (int8 = per-channel INT8 Linears, FP16 "
    "item table); a quantized run (hstu quantize) loads as saved and refuses another scheme"
)


def cmd_eval(args) -> int:
    import torch

    from hstu.quant.checkpoint import load_for_inference
    from hstu.train.evaluate import evaluate
    from hstu.train.logs import policy_text

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, cfg, ids = load_for_inference(args.run, args.device, args.precision)
    log_, split, spec = _run_data(cfg, args.data_dir, args.protocol, args=args, run=(args.run, ids))
    excl = log_.exclude_history_default if args.exclude_history is None else args.exclude_history
    out = evaluate(model, log_, split, args.split, device=model.pos_emb.weight.device, exclude=excl)
    slices = _eval_slices(model, log_, split, args, excl) if args.slices else None
    prec = args.precision or cfg.get("quant", {}).get("scheme", "fp32")  # None: as saved (a quantized run's scheme)
    if args.json:  # what was evaluated beside the metrics
        what = {"split": args.split, "protocol": spec.protocol, "precision": prec, "exclude_history": excl}
        print(json.dumps({**out, **what, **({"slices": slices} if slices else {})}, indent=2))
        return 0
    head = f"{args.split} ({spec.protocol}, {prec}, {out['users']} users, {policy_text(excl)}): "
    print(head + ", ".join(f"{k} {v:.4f}" for k, v in out.items() if k != "users"))
    from hstu.report.slices import cells

    for name, cell in (cells(slices) if slices else {}).items():
        print(f"  {name}: {cell['value']:.4f} [{cell['ci'][0]:.4f}, {cell['ci'][1]:.4f}]")
    return 0


def _eval_slices(model, log_, split, args, exclude: bool) -> dict:
    """``hstu eval --slices``: :func:`hstu.train.slices.scorer_slices` of the run on ``args.split`` (95 % bootstrap CIs)."""
    from hstu.train.baselines import training_counts
    from hstu.train.slices import ModelScorer, scorer_slices

    scorer = ModelScorer(model, Path(args.run).name, model.pos_emb.weight.device)
    report, _ = scorer_slices(
        scorer, log_, split, args.split, exclude=exclude, popularity=training_counts(log_, split), resamples=args.resamples
    )
    return report


def _history_from_file(path: str):
    from hstu.generate.histories import check_event_int
    from hstu.generate.recommend import History, HistoryError

    p = Path(path)
    try:
        events = json.loads(p.read_text(encoding="utf-8-sig"))  # -sig: a byte-order mark (Windows editors) is allowed
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: history file not found") from None
    except IsADirectoryError:
        raise HistoryError(f"{p}: is a directory, not a history file") from None
    except UnicodeDecodeError as exc:
        raise HistoryError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested deeper than the decoder recurses
        raise HistoryError(f"{p}: not valid JSON: {exc}") from None
    if not isinstance(events, list):
        raise HistoryError(f'{p}: expected a JSON list of {{"item_id", "timestamp"}} objects')
    items, ts, acts, feats = [], [], [], []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or "item_id" not in e or "timestamp" not in e:
            raise HistoryError(f"{p}: event [{i}] needs 'item_id' and 'timestamp'")
        extra = sorted(set(e) - {"item_id", "timestamp", "action", "features"})
        if extra:  # a misspelt field must not pass silently (the HTTP Event refuses it too)
            raise HistoryError(f"{p}: event [{i}] has unknown field(s) {extra}; valid: item_id, timestamp, action, features")
        if e.get("features") is not None and not isinstance(e["features"], dict):
            raise HistoryError(f"{p}: event [{i}].features must be an object of feature name -> value, or null, got {e['features']!r}")
        if e.get("action") is not None and not isinstance(e["action"], str):
            raise HistoryError(f"{p}: event [{i}].action must be a string or null, got {e['action']!r}")
        if isinstance(e["item_id"], str):  # a text id: the run's id map decides (Recommender.prepare)
            pass
        elif not isinstance(e["item_id"], int) or isinstance(e["item_id"], bool):
            raise HistoryError(f"{p}: event [{i}].item_id must be an integer or a text id, got {e['item_id']!r}")
        for f in ("item_id", "timestamp") if isinstance(e["item_id"], int) else ("timestamp",):  # Recommender.prepare's check
            check_event_int(f"{p}: event [{i}]", f, e[f], 0 if f == "timestamp" else -INT64_MAX)
        items.append(e["item_id"])
        ts.append(e["timestamp"])
        acts.append(e.get("action"))
        feats.append(e.get("features"))  # side features: checked by Recommender.prepare (names, values)
    return History(
        items, ts, acts if any(a is not None for a in acts) else None, features=feats if any(f is not None for f in feats) else None
    )


def run_data_dir(cfg: dict, data_dir: str | None = None) -> str | list[str]:
    """Where a run's data set is read from: ``data_dir`` (--data-dir), else $HSTU_DATA_DIR (as for
    ``hstu train``), else the directory recorded at training; for ML-1M whose recorded directory is
    gone, ../shared/data/ml-1m as ``hstu train`` finds it (:func:`default_data_dir`)."""
    from hstu.data.prepare import data_dir_exists

    if data_dir:
        return str(data_dir)
    data = cfg["data"]
    recorded = data.get("data_dir")
    if os.environ.get("HSTU_DATA_DIR") or (data.get("dataset") == "ml-1m" and not data_dir_exists(recorded)):
        found = default_data_dir()
        if found is not None:
            return str(found)
    return recorded


def _run_data(cfg: dict, data_dir: str | None = None, protocol: str | None = None, *, args=None, run=None):
    """The run's data set (:func:`run_data_dir`), as (EventLog, Split, DataSpec); a missing
    directory says how to point at it. ``args``: the command's flags, whose --columns / --format
    must agree with the run's loader options (:func:`hstu.train.cli.run_loader_options`);
    ``run``: (run directory, its idmap.json dict or None): the data's item ids must be the run's
    (ValueError otherwise, :func:`hstu.runs.check_resume_items`)."""
    from hstu.train.cli import run_loader_options
    from hstu.train.loop import DataSpec, prepare_data

    data = cfg["data"]
    if args is not None:
        where = Path(run[0]) / "config.json" if run else "config.json"
        data = {**data, "options": run_loader_options(data, args, where)}
    spec = DataSpec(**{**data, "data_dir": run_data_dir(cfg, data_dir), "items": None})  # item metadata: in idmap.json
    if protocol:
        spec.protocol = protocol
    try:
        log_, split = prepare_data(spec)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc} (the run's {spec.dataset} data; pass --data-dir or set HSTU_DATA_DIR if it moved)") from None
    if run is not None:
        from hstu.runs import check_resume_items

        check_resume_items(Path(run[0]), log_, ids=run[1], command="--data-dir" if getattr(args, "data_dir", None) else "")
        was, now = (run[1] or {}).get("data_facts", {}), {"events": log_.num_events, "users": log_.num_users}
        if now.keys() <= was.keys() and any(was[k] != v for k, v in now.items()):  # same items, other events (appended logs)
            msg = "the data holds %d events of %d users; the run was trained on %d of %d (idmap.json data_facts): the figures differ"
            log.warning(msg, *now.values(), *map(was.get, now))
    return log_, split, spec


def cmd_generate(args) -> int:
    from hstu.backend.graph_cache import DIRNAME as GRAPHS_DIR
    from hstu.backend.graph_cache import LAYOUT, GraphCache
    from hstu.generate.batch import history_of
    from hstu.generate.batch_cli import cmd_all_users, reject_batch_flags
    from hstu.generate.recommend import HistoryError, Recommender
    from hstu.model.checkpoint import read_json

    if args.all_users:  # the batch job (hstu.generate.batch): the data set read once
        return cmd_all_users(args, lambda cfg: _run_data(cfg, args.data_dir, args=args, run=(args.run, None))[0])
    reject_batch_flags(args)
    if args.threads:  # one user's generation too (a fresh-user finding: only --all-users took it)
        import torch

        torch.set_num_threads(args.threads)
    if (args.user is None) == (args.history is None):
        raise ValueError("give exactly one of --user USER_ID, --history FILE or --all-users")
    rec = Recommender.from_run(args.run, args.device, args.precision)
    rec.attach_ann(args.ann, args.ann_nprobe, args.ann_candidates)  # --ann: approximate candidates (none without)
    check_k(args.k, rec.model.cfg.max_output_len, "-k")
    cfg = read_json(Path(args.run) / "config.json")
    if args.history:
        from hstu.train.cli import run_loader_options

        run_loader_options(cfg["data"], args, Path(args.run) / "config.json")  # no data read, but a contradicting flag is refused
        hist = _history_from_file(args.history)
    else:
        log_ = _run_data(cfg, args.data_dir, args=args, run=(args.run, rec.idmap))[0]
        args.user = log_.user_id(args.user)  # the data set's id (int, or trimmed text); KeyError names an unknown one
        hist = history_of(log_, args.user)
    hist.request_time = hist.request_time if args.request_time is None else args.request_time
    try:
        prep = rec.prepare(hist, unknown=args.unknown_items)
    except HistoryError as exc:  # an empty history, unknown ids: name the --history file too
        raise HistoryError(f"{args.history}: {exc}" if args.history else str(exc)) from None
    excl = args.exclude_history
    allow = True if args.allow_untrained_items else None
    dec = DecodeOptions(args.strategy, args.top_k, args.temperature, args.beam_width, args.seed)
    need = max(args.k, dec.beam_width if dec.strategy == "beam" else 1)
    rec.check_room(prep, need, exclude_history=excl, allow_untrained=allow, field="-k")  # HistoryError: exit 2, one line
    if args.graphs == "compiled" and GraphCache.unrecorded(args.run):  # its graphs cannot be matched: say why we compile
        print(
            f"warning: {Path(args.run) / GRAPHS_DIR / LAYOUT} is missing or unreadable: this call compiles graphs of its own "
            f"shape into the cache and records that layout alone; `hstu export --run {args.run} --graphs` with the server's "
            "--buckets and --max-batch records its layout again",
            file=sys.stderr,
        )
    eng = rec.engine_for([prep], dec, args.graphs)  # sized for this one call
    items = rec.recommend([prep], args.k, decoding=dec, exclude_history=excl, allow_untrained=allow, engine=eng)[0]
    built = [g for g in eng.graph_report() if g["mode"] == "built"]
    if built:  # compiled into the run's graph cache now: say so (a later serve or generate loads them)
        print(
            f"graph cache {eng.graph_cache.dir}: {len(built)} graph{'s' if len(built) != 1 else ''} built and stored now", file=sys.stderr
        )
    out = {"user": args.user, "items": items, **({"warnings": prep.warnings} if prep.warnings else {})}
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
    else:
        for w in prep.warnings:
            print(f"warning: {w}", file=sys.stderr)
        for i, it in enumerate(items, 1):
            extra = " ".join(
                [f"{k}={it[k]}" for k in ("action", "category") if k in it]
                + [f"{k}={v}" for k, v in it.get("meta", {}).items() if k != "title"]
            )
            print(f"{i}. {it['item_id']}  {it.get('title', '')}  score={it['score']:.3f} {extra}".rstrip())
    return 0


def version_text() -> str:
    """``hstu --version``: hstu's version, torch's, and each backend (:data:`hstu.backend.BACKENDS`)
    with "available" or the reason it is not (``Backend.unavailable_reason``)."""
    import torch

    import hstu
    from hstu.backend import BACKENDS

    lines = [f"hstu {hstu.__version__}", f"torch {torch.__version__}"]
    for name, cls in BACKENDS.items():
        why = cls.unavailable_reason()
        lines.append(f"backend {name}: " + ("available" if why is None else f"unavailable ({why})"))
    return "\n".join(lines)


class _Version(argparse.Action):
    """--version, computed only when asked (it imports torch and probes the devices)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The ``hstu`` parser: one builder per command, then the feature modules' commands (:data:`FEATURES`)."""
    p = argparse.ArgumentParser(prog="hstu", description="HSTU generative recommender: train, evaluate, generate, serve, operate.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action=_Version, help="print hstu's and torch's versions and the backends available, and exit")
    sub = p.add_subparsers(dest="command", required=True)
    from hstu.demo import add_demo_parser
    from hstu.train.cli import add_train_parser

    for add in (add_train_parser, _add_eval, _add_generate, add_demo_parser, _add_features):
        add(sub)
    for parser in (p, *sub.choices.values()):  # --epoch is not --epochs: no prefix matching of long flags
        parser.allow_abbrev = False
    return p


def _add_eval(sub) -> None:
    from hstu.train.cli import add_loader_flags

    e = sub.add_parser("eval", help="evaluate a run (full ranking)")
    e.add_argument("--run", required=True)
    e.add_argument("--split", default="test", choices=["valid", "test"])
    e.add_argument(
        "--protocol", choices=["clean", "paper"], help="split protocol (default: the run's); under paper valid and test are the last event"
    )
    e.add_argument("--data-dir", help="the run's data set, if it moved (default: $HSTU_DATA_DIR, else the run's recorded directory)")
    e.add_argument("--device", default="cpu", help="cpu, cuda or npu (default cpu)")
    e.add_argument("--threads", type=number_in(int, 1), help="torch intra-op threads (default: torch's)")
    e.add_argument("--json", action="store_true", help="print the metrics as JSON")
    e.add_argument("--precision", choices=PRECISION_CHOICES, help=PRECISION_HELP)
    e.add_argument("--exclude-history", action=argparse.BooleanOptionalAction, help=EXCLUDE_HISTORY_HELP)
    add_loader_flags(e, run=True)
    e.add_argument(
        "--slices",
        action="store_true",
        help="also the evaluation slices with 95 %% bootstrap intervals: next action, purchase targets, repeat vs new targets, "
        "cold start (history cut to 1 and 2 events), long-tail share of the next 10 (generates for every user: slower)",
    )
    e.add_argument("--resamples", type=number_in(int, 10), default=1000, help="bootstrap resamples of --slices (default 1000)")
    e.set_defaults(func=cmd_eval)


def _add_generate(sub) -> None:
    from hstu.train.cli import add_loader_flags

    q = sub.add_parser("generate", help="next-k items for a user, a history file, or every user (--all-users)")
    q.add_argument("--run", required=True, help="run directory (hstu train, or hstu quantize)")
    q.add_argument("--user", help="original user id in the run's data set (an integer, or a text id as in the data)")
    q.add_argument("--history", help='JSON list of {"item_id", "timestamp"[, "action"][, "features"]} events (docs/cli.md)')
    q.add_argument("-k", type=int, default=5, help="items to generate, 1..the model's max_output_len (default 5)")
    q.add_argument("--strategy", default="greedy", choices=["greedy", "topk", "beam"], help="decoding (default greedy)")
    # the ranges of the HTTP schema (hstu.serve.schemas.Decoding)
    q.add_argument("--top-k", type=number_in(int, 1, TOP_K_MAX), default=50, help="topk: sample among this many best (default 50)")
    q.add_argument(
        "--temperature",
        type=number_in(float, 0, TEMPERATURE_MAX, lo_open=True),
        default=1.0,
        help="topk: softmax temperature (default 1.0; a tiny one samples in the greedy limit)",
    )
    q.add_argument("--beam-width", type=number_in(int, 1, BEAM_WIDTH_MAX), default=4, help="beam: beams (default 4)")
    q.add_argument("--seed", type=number_in(int, 0, SEED_MAX), default=0, help="topk: sampling seed (default 0)")
    q.add_argument(
        "--data-dir",
        help="the run's data set (for --user), if it moved since training "
        "(default: $HSTU_DATA_DIR, else the directory recorded in the run)",
    )
    add_loader_flags(q, run=True)
    q.add_argument(
        "--request-time", type=number_in(int, 0, TIME_S_MAX), help="Unix seconds, up to 2262-04-11 (default: the last event's time)"
    )
    q.add_argument("--exclude-history", action=argparse.BooleanOptionalAction, help=EXCLUDE_HISTORY_HELP)
    q.add_argument(
        "--unknown-items", default="drop", choices=["drop", "reject"], help="unknown history items: drop, warned (default), or reject"
    )
    q.add_argument(
        "--allow-untrained-items",
        action="store_true",
        help="may generate items without training events (default: only if cold_item_dropout > 0)",
    )
    q.add_argument("--device", default="cpu", help="cpu, cuda or npu (default cpu)")
    q.add_argument("--precision", choices=PRECISION_CHOICES, help=PRECISION_HELP)
    q.add_argument(
        "--graphs", default="eager", choices=["eager", "compiled"], help="eager (default), or compiled: the run's graph cache, else now"
    )
    q.add_argument("--json", action="store_true", help="print the answer as JSON (default: one line per item)")
    from hstu.generate.batch_cli import add_ann_flags, add_arguments

    add_ann_flags(q)  # --ann FACTORY ... (as hstu serve)
    add_arguments(q)  # --all-users --out ... (batch inference)
    q.set_defaults(func=cmd_generate)


def _add_features(sub) -> None:
    """The commands of the feature modules present in this build (a missing optional dependency: a stub saying how to install it)."""
    for mod, (commands, extra) in FEATURES.items():
        try:
            module = __import__(mod, fromlist=["add_subcommands"])
        except ModuleNotFoundError as exc:
            if exc.name and mod.startswith(exc.name):
                continue  # feature module not present in this build
            if exc.name and exc.name.split(".")[0] == "hstu":
                raise
            for name in commands:  # an optional dependency is missing: say how to install it
                stub = sub.add_parser(name, help=f"(needs: pip install 'hstu[{extra}]')")
                stub.set_defaults(func=_missing_extra(name, extra, exc.name), stub=True)
            continue
        module.add_subcommands(sub)


FEATURES = {  # module -> (its commands, the extra that brings its dependencies)
    "hstu.ops.cli": (("doctor", "diagnose", "monitor", "watchdog"), "ops"),
    "hstu.model.embedding_cli": (("plan-memory",), "ops"),
    "hstu.quant.cli": (("quantize",), "ops"),
    "hstu.serve.cli": (("serve",), "serve"),
    "hstu.bench.cli": (("bench",), "bench"),
    "hstu.report.cli": (("report",), "plot"),
    "hstu.export.cli": (("export",), "export"),
}


EXTRA_OF = {  # an optional package's import name -> the extra that installs it (pyproject.toml)
    **dict.fromkeys(("fastapi", "uvicorn", "pydantic", "httpx", "fastapi_offline", "orjson", "msgspec"), "serve"),
    **dict.fromkeys(("psutil", "prometheus_client", "yaml", "packaging"), "ops"),
    **dict.fromkeys(("onnx", "onnxruntime", "onnxscript"), "export"),
    **{"aiohttp": "bench", "matplotlib": "plot", "ray": "ray", "pyarrow": "ray", "tensorboard": "tensorboard", "faiss": "ann"},
}


def _missing_extra(command: str, extra: str, missing: str | None):
    def handler(args) -> int:
        print(f"hstu {command}: needs the optional package {missing!r}: pip install 'hstu[{extra}]'", file=sys.stderr)
        return 2

    return handler


def main(argv: list[str] | None = None) -> int:
    on_term = signal.signal(signal.SIGTERM, terminated) if threading.current_thread() is threading.main_thread() else None
    try:
        rc = _run(argv)
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    if argv is None and on_term is not None:  # the program: its output is complete, the interpreter's exit takes ~0.7 s
        ignore_after_return()
    return rc


def _run(argv: list[str] | None) -> int:
    main_thread = threading.current_thread() is threading.main_thread()
    with Deferred() if main_thread else contextlib.nullcontext() as later:  # the parser's imports load torch: seconds
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
    if later is not None and later.exc is not None:
        words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
        return interrupted(argparse.Namespace(command=words[0] if words else ""), later.exc)
    if unknown and not getattr(args, "stub", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from hstu.backend import BackendUnavailableError

    where = f"hstu {args.command}"
    try:
        from hstu.train.cli import torchrun_rank

        rank = torchrun_rank(args)  # under --distributed: a rank other than 0 logs warnings only
        where += f" (rank {rank})" if getattr(args, "distributed", False) else ""
        level = logging.DEBUG if args.verbose else (logging.INFO if rank == 0 else logging.WARNING)
        tag = f"[rank {rank}] " if getattr(args, "distributed", False) else ""
        logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s")
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `hstu ... | head` closed stdout: stop quietly (Python docs, signal, "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OSError, ValueError, KeyError, TypeError, BackendUnavailableError) as exc:  # one line naming the file or field
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"{where}: error: {msg}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional package a command reached lazily (e.g. export --graphs: the server's)
        top = (exc.name or "").split(".")[0]
        if not top or top == "hstu":
            raise
        extra = f": pip install 'hstu[{EXTRA_OF[top]}]'" if top in EXTRA_OF else ""
        print(f"{where}: error: needs the optional package {top!r}{extra}", file=sys.stderr)
        return 2
    except (FloatingPointError, MemoryError) as exc:  # a diverged training (train.loop._epoch), a model too big: a failure
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        return interrupted(args, exc)


if __name__ == "__main__":
    sys.exit(main())
