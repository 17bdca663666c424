"""The ``hstu generate --all-users`` flags and handler (the job itself: :mod:`hstu.generate.batch`).

``hstu.cli._add_generate`` calls :func:`add_arguments`; ``hstu.cli.cmd_generate`` calls
:func:`cmd_all_users` under ``--all-users`` and :func:`reject_batch_flags` otherwise. Errors a
user can fix raise ValueError / FileNotFoundError (one line, exit 2 in ``hstu.cli.main``), before
the data set or the model is loaded where they can.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

# flag -> argparse dest of the options that only --all-users takes (--threads applies to one user too)
BATCH_FLAGS = {
    "--out": "out",
    "--users-file": "users_file",
    "--chunk-users": "chunk_users",
    "--workers": "workers",
    "--batch-users": "batch_users",
    "--engine": "engine",
    "--ray-address": "ray_address",
    "--ray-gpus-per-worker": "ray_gpus_per_worker",
    "--overwrite": "overwrite",
}


def add_arguments(q) -> None:
    """The batch flags of the ``generate`` parser ``q`` (defaults None: :func:`reject_batch_flags`
    tells a given flag from an absent one)."""
    from hstu.cli import number_in  # the parser is built by hstu.cli, already loaded
    from hstu.generate.batch import BATCH_USERS, CHUNK_USERS

    g = q.add_argument_group("batch inference (--all-users)")
    g.add_argument("--all-users", action="store_true", help="next-k for every user of the run's data set (or --users-file), to --out")
    g.add_argument("--out", help="output file: .parquet (needs pyarrow) or .jsonl; one row per (user, rank)")
    g.add_argument(
        "--overwrite",
        action="store_const",
        const=True,
        help="replace an existing --out file (without it a finished output is never written over; OUT.parts/ resumes either way)",
    )
    g.add_argument("--users-file", help="only these users: one original user id per line, in this order")
    g.add_argument("--chunk-users", type=number_in(int, 1), help=f"users per resumable part in OUT.parts/ (default {CHUNK_USERS})")
    g.add_argument("--workers", type=number_in(int, 1), help="processes (local) or actors (ray), each loading the run once (default 1)")
    g.add_argument(
        "--threads",
        type=number_in(int, 1),
        help="torch threads (--all-users: per process; default: torch's for one worker, else cores // workers)",
    )
    g.add_argument(
        "--batch-users",
        type=number_in(int, 1),
        help=f"users per engine call (default {BATCH_USERS}); every call is padded to this many rows, so a user's result does not depend "
        "on the users sharing its call (another value may move scores by float rounding)",
    )
    g.add_argument("--engine", choices=["local", "ray"], help="local processes (default) or Ray Data (pip install 'hstu[ray]')")
    g.add_argument("--ray-address", help="Ray cluster to join, e.g. auto (default: start a local Ray instance)")
    g.add_argument("--ray-gpus-per-worker", type=number_in(float, 0), help="GPUs Ray gives each actor (default 0)")


def reject_batch_flags(args) -> None:
    """ValueError naming the batch flags given without --all-users; a warning on stderr for the flags one user's
    call does not read (:func:`warn_unused_flags`)."""
    given = [f for f, dest in BATCH_FLAGS.items() if getattr(args, dest, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: only with --all-users")
    warn_unused_flags(args)


def warn_unused_flags(args) -> None:
    """``warning: ...`` on stderr for decoding flags the --strategy does not read
    (:func:`hstu.generate.api_checks.ignored_decoding`) and --data-dir with --history (no data set is read)."""
    from hstu.config import DecodeOptions
    from hstu.generate.api_checks import ignored_decoding

    notes = [ignored_decoding(DecodeOptions(args.strategy, args.top_k, args.temperature, args.beam_width, args.seed), flags=True)]
    if getattr(args, "history", None) and getattr(args, "data_dir", None):
        notes.append(f"--data-dir {args.data_dir}: not read with --history (the history comes from the file), ignored")
    for note in filter(None, notes):
        print(f"warning: {note}", file=sys.stderr)


def cmd_all_users(args, load_log: Callable[[dict], object]) -> int:
    """``hstu generate --all-users``: check the flags, read the run's data set once
    (``load_log(config)`` -> EventLog), run :func:`hstu.generate.batch.run_batch`, print a summary
    line (or JSON with --json)."""
    from hstu.config import DecodeOptions, check_k
    from hstu.generate.batch import BatchSpec, output_format, read_users_file, run_batch
    from hstu.model.checkpoint import read_json

    if args.user is not None or args.history is not None:
        raise ValueError("--all-users generates for every user of the run's data set: give it without --user / --history")
    warn_unused_flags(args)
    if args.out is None:
        raise ValueError("--all-users needs --out FILE (.parquet or .jsonl)")
    if getattr(args, "ann", None):
        raise ValueError("--ann: the batch job (--all-users) picks exactly; drop --ann")
    if getattr(args, "graphs", "eager") != "eager":
        raise ValueError(f"--graphs {args.graphs}: the batch job (--all-users) runs eager; drop --graphs")
    if args.engine != "ray" and (args.ray_address is not None or args.ray_gpus_per_worker is not None):
        raise ValueError("--ray-address / --ray-gpus-per-worker: only with --engine ray")
    output_format(args.out)
    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out}: is a directory")
    if Path(args.out).exists() and not args.overwrite:
        raise ValueError(f"--out {args.out}: exists (an earlier output?); give --overwrite to replace it, or another --out")
    cfg = read_json(Path(args.run) / "config.json")
    check_k(args.k, int(cfg["model"]["max_output_len"]), "-k")
    spec = BatchSpec(
        run=str(args.run),
        k=args.k,
        decoding=DecodeOptions(args.strategy, args.top_k, args.temperature, args.beam_width, args.seed),
        exclude_history=args.exclude_history,
        allow_untrained=True if args.allow_untrained_items else None,
        request_time=args.request_time,
        device=args.device,
        precision=args.precision,
        **({} if args.batch_users is None else {"batch_users": args.batch_users}),
    )
    log_ = load_log(cfg)
    users = read_users_file(args.users_file, log_) if args.users_file else None
    opts = {"chunk_users": args.chunk_users, "workers": args.workers}
    summary = run_batch(
        spec,
        args.out,
        log_,
        users,
        engine=args.engine or "local",
        ray_address=args.ray_address,
        ray_gpus=args.ray_gpus_per_worker or 0.0,
        threads=args.threads,
        **{k: v for k, v in opts.items() if v is not None},
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        s = summary
        print(f"{s['users']} users, {s['rows']} rows -> {s['out']} ({s['computed']} of {s['chunks']} chunks computed now)")
    return 0


def add_ann_flags(s) -> None:
    """--ann, --ann-nprobe, --ann-candidates: approximate candidates (hstu.model.ann), for catalogues
    where the exact streamed top-k is too slow (120M items: seconds per call)."""
    s.add_argument(
        "--ann",
        metavar="FACTORY",
        help="pick among approximate candidates of a faiss index (index_factory string, e.g. IVF4096,SQ8 or HNSW32; "
        "needs the 'ann' extra), rescored exactly; built once per weights file and kept in RUN/ann/ (default: exact picks)",
    )
    from hstu.cli import number_in  # the parser is built by hstu.cli, already loaded

    s.add_argument("--ann-nprobe", type=number_in(int, 1), help="IVF cells probed per query (default 16)")
    s.add_argument("--ann-candidates", type=number_in(int, 1), help="approximate candidates per row rescored exactly (default 256)")
