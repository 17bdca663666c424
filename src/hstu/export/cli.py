"""``hstu export``: a run's encoder as ONNX or torch.export programs, one per bucket; or the run's
graph cache for ``hstu serve --graphs compiled``.

    hstu export --run RUN --format onnx|pt2 --out DIR [--buckets 20,50] [--precision fp32|fp16|bf16]
                [--batch N] [--overwrite]
    hstu export --run RUN --graphs [--buckets 20,50] [--max-batch 16] [--precision fp32|fp16|bf16|int8] [--device cpu]

``--graphs`` builds RUN/graphs (hstu.backend.graph_cache): one AOTInductor package per graph a
server's warm-up runs (bucket x batch size of its ladder x step kind) for those buckets, max batch,
precision and device (the server's defaults unless given), and prints each graph's compile time and
bytes. INT8 graphs call the Linears' packed weights through one opaque op (hstu.quant.int8.int8_linear)
and fuse the rest. A server started with the same settings (``--graphs auto``, the default, or ``compiled``) loads them instead of
compiling; entries already built for these weights and this torch are kept, stale ones rebuilt.

Writes DIR/export.json (how to feed the programs), encoder_E{E}.onnx or .pt2 per bucket edge,
items.npy and idmap.json (hstu.export.bundle). Each program is run once on export (ONNX
Runtime, or torch.export.load) and compared with the PyTorch model. ``--format onnx`` needs
the ``export`` extra (pip install 'hstu[export]'); pt2 needs only torch.

Exit codes: 0 done; 2 bad flag, run, missing extra or a failed export (one line; nothing written).
"""

from __future__ import annotations

import argparse
import sys


def cmd_export_graphs(args) -> int:
    """Build the run's graph cache through a server's warm-up (BatchRunner.warmup per bucket, graphs
    "compiled"); print one line per graph (mode, seconds, bytes) and the totals. Exit 1 when a graph
    could not be cached (it fell back: the line says why)."""
    from hstu.backend.graph_cache import GraphCache
    from hstu.config import ServeConfig
    from hstu.generate.recommend import Recommender
    from hstu.generate.requests import fit_buckets, parse_buckets
    from hstu.serve.runner import BatchRunner

    rec = Recommender.from_run(args.run, args.device, args.precision)
    buckets = fit_buckets(None if args.buckets is None else parse_buckets(args.buckets), rec.model.cfg.max_seq_len)
    d = GraphCache.create(args.run)
    runner = BatchRunner(rec, buckets, args.max_batch or ServeConfig().max_batch, graphs="compiled")
    GraphCache.add_layout(args.run, runner.buckets, runner.max_batch)  # hstu generate --graphs compiled builds this layout
    if runner.engine.graph_cache is None:
        print(f"hstu export: error: graphs on {args.device} are device graphs captured at start-up, not cached", file=sys.stderr)
        return 2
    for edge in buckets:
        runner.warmup(edge)
    rep = runner.engine.graph_report()
    for r in rep:
        why = f" ({r['error']})" if r["error"] else ""
        print(f"bucket {r['bucket']} {'/'.join(map(str, r['key']))}: {r['mode']} in {r['compile_s']:.1f} s, {r['bytes'] / 1e6:.2f} MB{why}")
    total = sum(r["bytes"] for r in rep) / 1e6
    print(f"graph cache {d}: {len(rep)} graphs, {total:.1f} MB, {sum(r['compile_s'] for r in rep):.0f} s")
    return 1 if any(r["mode"] == "fallback" for r in rep) else 0


def cmd_export(args) -> int:
    """Run :func:`hstu.export.export_run` for the parsed flags; print a summary line per bucket
    (``--graphs``: :func:`cmd_export_graphs`)."""
    from hstu.export.bundle import ExportError, export_run
    from hstu.generate.requests import parse_buckets

    if args.graphs:
        other = (("--format", args.format), ("--out", args.out), ("--batch", args.batch), ("--overwrite", args.overwrite))
        given = [f for f, v in other if v]
        if given:  # two forms of the command: one of them, never the flags of the other silently ignored
            raise ValueError(f"--graphs builds RUN/graphs and takes no {', '.join(given)} (those export programs to --out)")
        return cmd_export_graphs(args)
    if args.max_batch is not None or args.device != "cpu":
        raise ValueError("--max-batch and --device go with --graphs (the graph cache), not --format / --out")
    if args.format is None or args.out is None:
        raise ValueError("--format and --out are required (or --graphs for the graph cache)")
    if args.precision == "int8":
        from hstu.export.bundle import INT8_NOT_PORTABLE

        fix = "export the float run, or --precision fp16 / bf16"
        raise ValueError(f"--precision int8 goes with --graphs, not --format {args.format}: {INT8_NOT_PORTABLE}; {fix}")
    try:
        edges = None if args.buckets is None else parse_buckets(args.buckets)
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
    p.add_argument("--format", help="onnx (ONNX Runtime, Triton Inference Server) or pt2 (torch.export)")
    p.add_argument("--out", help="export directory (must not exist or be empty, unless --overwrite)")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="build the run's graph cache (RUN/graphs) that `hstu serve` loads (its default --graphs auto, or compiled) "
        "with the same buckets, max batch and precision",
    )
    p.add_argument("--max-batch", type=number_in(int, 1), help="with --graphs: the server's --max-batch (default: its default)")
    p.add_argument("--device", default="cpu", help="with --graphs: the server's --device (default cpu)")
    p.add_argument("--buckets", help="comma-separated bucket edges <= max_seq_len (default: the engine's default buckets)")
    p.add_argument("--precision", choices=PRECISION_CHOICES, help="the model's precision (default: as saved; int8 with --graphs only)")
    p.add_argument("--batch", type=number_in(int, 1), help="a fixed batch size (default: the batch axis is dynamic)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in --out (it holds export.json) once the new one is complete; never a run or other files",
    )
    p.set_defaults(func=cmd_export)


__all__ = ["add_subcommands", "cmd_export", "cmd_export_graphs"]
