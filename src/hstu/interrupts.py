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
    """The one line after Ctrl-C or SIGTERM; a training run that committed an epoch is resumable."""
    from hstu.runs import has_train_state

    out = getattr(args, "out", None)
    if args.command != "train" or not out:
        hint = ""
    elif Path(out).is_dir() and has_train_state(Path(out)):
        hint = "; the run keeps its last committed epoch: continue with --resume"
    else:
        hint = f"; no epoch was committed, nothing is kept in {out}: run the command again"
    where = f"hstu {args.command}" if args.command else "hstu"
    print(f"{where}: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}{hint}", file=sys.stderr)
    return 143 if isinstance(exc, Terminated) else 130


def exit_on_signal(rc: int) -> None:
    """Ctrl-C or SIGTERM after the command returned ends the process at once with the command's status: the work
    is done and written, so it is neither an interruption (130 / 143) nor a traceback from the interpreter's exit."""

    def handler(signum, frame) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
