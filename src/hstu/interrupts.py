"""How an ``hstu`` command ends on Ctrl-C or SIGTERM: one line and exit 130 / 143 while it works (its cleanup runs
as after any exception: no half-written output), its own status once it has returned."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``docker stop``, Kubernetes) raised as an interrupt, so a command cleans up
    as after Ctrl-C (no half-written output) and says so; exit status 143 (128 + SIGTERM)."""


def terminated(signum, frame) -> None:
    raise Terminated


def interrupted(args, exc: KeyboardInterrupt) -> int:
    """The one line after Ctrl-C or SIGTERM; what a rerun goes on from: a training run's last committed epoch,
    ``generate --all-users``' finished parts, ``export --graphs``' built graphs."""
    out = getattr(args, "out", None)
    if args.command == "generate" and getattr(args, "all_users", False) and out:  # no import here: an interrupt inside a
        hint = (  # lazy import may have left a module half-loaded
            f"; finished parts stay in {out}.parts/: the same command goes on from them"
            if has_finished_part(out)
            else "; no chunk was finished, nothing is kept: run the command again"
        )
    elif args.command == "export" and getattr(args, "graphs", False) and getattr(args, "run", None):
        hint = f"; the graphs built so far stay in {Path(args.run) / 'graphs'}: the same command builds the rest"
    elif args.command != "train" or not out:
        hint = ""
    elif getattr(exc, "old_run_restored", False):  # --overwrite cut before the new training's first commit
        hint = f"; no epoch of the new training was committed: {out} holds the old run, as it was (run the command again to replace it)"
    else:
        from hstu.runs import has_train_state

        kept = Path(out).is_dir() and has_train_state(Path(out))
        hint = (
            "; the run keeps its last committed epoch: continue with --resume"
            if kept
            else (f"; no epoch was committed, nothing is kept in {out}: run the command again")
        )
    where = f"hstu {args.command}" if args.command else "hstu"
    if not getattr(args, "distributed", False) or os.environ.get("RANK", "0") == "0":  # torchrun: one line, rank 0's
        print(f"{where}: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}{hint}", file=sys.stderr)
    return 143 if isinstance(exc, Terminated) else 130


def has_finished_part(out: str | Path) -> bool:
    """Whether ``OUT.parts/`` of ``generate --all-users --out OUT`` holds a finished chunk (``chunk-*.jsonl`` /
    ``.parquet``, not a ``.tmp`` being written): pathlib only, as :mod:`hstu.generate.batch_parts` names them."""
    parts = Path(f"{out}.parts")
    try:
        return any(p.suffix in (".jsonl", ".parquet") for p in parts.glob("chunk-*")) if parts.is_dir() else False
    except OSError:  # unreadable: nothing to promise
        return False


def ignore_after_return() -> None:
    """Ctrl-C or SIGTERM after the command returned (its output complete; the interpreter's exit takes ~0.7 s) is
    ignored, so the process ends with the command's own status, neither 130 / 143 nor a traceback. SIG_IGN, not a
    Python handler: CPython resets Python handlers to the default at finalization, but keeps an ignored signal."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


class Deferred:
    """While the parser is built (its imports load torch, numpy: seconds), Ctrl-C and SIGTERM are noted, not raised:
    an exception inside a C extension's import left torch half-initialised (an abort, a segfault, or a lost
    SIGTERM). :attr:`exc` is the interruption to report once the imports are done (None: none came)."""

    def __enter__(self) -> Deferred:
        self.got: list[int] = []
        self.prev = {s: signal.signal(s, lambda signum, frame: self.got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.prev.items():
            signal.signal(s, h)

    @property
    def exc(self) -> KeyboardInterrupt | None:
        return None if not self.got else Terminated() if self.got[0] == signal.SIGTERM else KeyboardInterrupt()
