"""``hstu export``: a run's encoder as ONNX or torch.export programs, one per bucket.

    hstu export --run RUN --format onnx|pt2 --out DIR [--buckets 20,50] [--precision fp32|fp16|bf16]
                [--batch N] [--overwrite]

Writes DIR/export.json (how to feed the programs), encoder_E{E}.onnx or .pt2 per bucket edge,
items.npy and idmap.json (hstu.export.bundle). Each program is run once on export (ONNX
Runtime, or torch.export.load) and compared with the PyTorch model. ``--format onnx`` needs
the ``export`` extra (pip install 'hstu[export]'); pt2 needs only torch.

Exit codes: 0 done; 2 bad flag, run, missing extra or a failed export (one line; nothing written).
"""

from __future__ import annotations

import argparse
import sys


def _edges(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        got = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--buckets: expected comma-separated integers, got {text!r}") from None
    if not got:
        raise ValueError(f"--buckets: expected comma-separated integers, got {text!r}")
    return got


def cmd_export(args) -> int:
    """Run :func:`hstu.export.export_run` for the parsed flags; print a summary line per bucket."""
    from hstu.export.bundle import ExportError, export_run

    try:
        edges = _edges(args.buckets)
        m = export_run(args.run, args.out, args.format, buckets=edges, precision=args.precision, batch=args.batch, overwrite=args.overwrite)
    except (ImportError, ExportError) as exc:  # ValueError, FileNotFoundError, FileExistsError: hstu.cli.main's one line
        print(f"hstu export: error: {exc}", file=sys.stderr)
        return 2
    for b in m["buckets"]:
        size = b["bytes"] / 1e6
        print(f"bucket {b['edge']}: {args.out}/{b['file']} ({size:.1f} MB), max |exported - PyTorch| = {b['max_abs_error']:.2g}")
    print(f"manifest {args.out}/export.json; items {args.out}/items.npy ({m['items']['shape'][0]} x {m['items']['shape'][1]})")
    return 0


def add_subcommands(subparsers) -> None:
    """Add ``export`` to the ``hstu`` command line."""
    from hstu.cli import PRECISION_CHOICES, number_in

    p = subparsers.add_parser(
        "export",
        help="export a run's encoder as ONNX or a torch.export program",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run", required=True, help="run directory written by `hstu train`")
    p.add_argument("--format", required=True, help="onnx (ONNX Runtime, Triton Inference Server) or pt2 (torch.export)")
    p.add_argument("--out", required=True, help="export directory (must not exist or be empty, unless --overwrite)")
    p.add_argument("--buckets", help="comma-separated bucket edges <= max_seq_len (default: the engine's default buckets)")
    p.add_argument("--precision", choices=[c for c in PRECISION_CHOICES if c != "int8"], help="the model's precision (default: as saved)")
    p.add_argument("--batch", type=number_in(int, 1), help="a fixed batch size (default: the batch axis is dynamic)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out once the new export is complete")
    p.set_defaults(func=cmd_export)


__all__ = ["add_subcommands", "cmd_export"]
