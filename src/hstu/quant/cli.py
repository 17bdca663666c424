"""``hstu quantize``: write an INT8 / BF16 / FP16 copy of a trained run, with a per-layer report.

    hstu quantize --run RUN_DIR --scheme int8|bf16|fp16 --out RUN_DIR_Q
                  [--embeddings fp16|bf16|int8|fp32] [--keep-float layers.1.o,...]
                  [--kernel auto|fbgemm|onednn|qnnpack|int_mm|dequant] (int8: the report's GEMM; not saved)
                  [--calib-users 256] [--seed 0] [--data-dir DIR] [--no-calibrate] [--report-only] [--json]

The calibration batch comes from the run's own data set (config.json "data"; ``--data-dir``
overrides the path): histories before each sampled user's validation target. The report covers the user
vectors (the encoder) and the item table (:func:`item_table_cost`: min cosine of stored to float rows, max
change of a retrieval score), printed and recorded in quant.json's ``calibration``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def cmd_quantize(args) -> int:
    from hstu.quant import apply_precision, read_quant_meta, save_quantized_run
    from hstu.quant.calibrate import calibration_batch, format_report, layer_report
    from hstu.quant.int8 import Int8Linear
    from hstu.runs import load_float_run

    if read_quant_meta(args.run) is not None:
        raise ValueError(f"{args.run} is already quantized; quantize the float run it was made from")
    if not args.report_only and not args.out:
        raise ValueError("--out is required (or pass --report-only)")
    if args.report_only and args.no_calibrate:
        raise ValueError("--report-only with --no-calibrate has nothing to do: the report is the calibration")
    if not args.report_only:
        from hstu.quant.checkpoint import check_quantized_out

        check_quantized_out(args.run, args.out)  # before the run and its data are read
    float_model, cfg, _ = load_float_run(args.run, "cpu")
    kw = {}
    if args.scheme == "int8":
        kw = dict(embeddings=args.embeddings or "fp16", keep_float=args.keep_float or (), kernel=args.kernel)
    elif args.embeddings or args.keep_float or args.kernel != "auto":
        raise ValueError(f"--embeddings, --keep-float and --kernel apply to --scheme int8 only, not {args.scheme}")
    qmodel = apply_precision(copy.deepcopy(float_model), args.scheme, **kw)
    kernels = {m.kernel for m in qmodel.modules() if isinstance(m, Int8Linear)}
    for k in kernels:
        print(f"INT8 kernel: {k.name} ({'integer GEMM' if k.integer else 'FALLBACK, no integer GEMM'}): {k.reason}", file=sys.stderr)

    report = None
    if not args.no_calibrate:
        from hstu.data.prepare import DataSpec, prepare_data
        from hstu.data.sequences import make_split
        from hstu.runs import check_resume_items

        spec = DataSpec(**cfg["data"])
        if args.data_dir:
            spec.data_dir = args.data_dir
        log_, _ = prepare_data(spec)
        check_resume_items(Path(args.run), log_, command="--data-dir" if args.data_dir else "")  # calibrate on the run's items
        split = make_split(log_, spec.protocol)
        batch = calibration_batch(log_, split, float_model.cfg.max_seq_len, num_users=args.calib_users, seed=args.seed)
        report = layer_report(float_model, qmodel, batch)
        report["item_table"] = item_table_cost(float_model, qmodel)  # the user vectors' figures say nothing of the items
        report["kernel"] = [k.name for k in kernels]
    meta = None
    if not args.report_only:
        meta = save_quantized_run(qmodel, args.run, args.out, calibration=report)
    if args.json:
        print(json.dumps({"report": report, "quant": meta}, indent=2))
    else:
        if report:
            print(format_report(report))
            print(_item_table_line(report["item_table"]))
        if meta:
            b = meta["bytes"]
            ratio = f" ({b['file'] / b['float_file']:.3f}x the float file)" if b.get("float_file") else ""
            print(
                f"wrote {args.out}: scheme {meta['scheme']}, embeddings {meta['embeddings']}, {_layers_line(meta)}; "
                f"{b['file']} bytes{ratio}"
            )
    return 0


ITEM_BLOCK = 1 << 16  # item rows compared per step (one pass over the table, a block of rows in memory at a time)


def item_table_cost(float_model, qmodel, block: int = ITEM_BLOCK) -> dict:
    """The item table's share of the quality cost, in one pass over rows 1..I (row 0 is padding): ``min_cosine``
    between each stored (quantized / 16-bit) row and its float row, and ``max_abs_score_err``, the largest change of a
    retrieval score cosine(u, item) / temperature (Zhai et al. 2024, §4.1.1) over every item and every unit user
    vector u: max over items of ||q̂ - f̂|| / temperature (q̂, f̂ the L2-normalised rows, as
    ``item_vectors`` scores them; the bound is reached by u along q̂ - f̂). Float64 arithmetic."""
    import torch

    n, t = float_model.cfg.num_items + 1, float(float_model.cfg.temperature)
    min_cos, max_d = 1.0, 0.0
    with torch.no_grad():
        for a in range(1, n, block):
            b = min(n, a + block)
            f = float_model.item_vectors(a, b).double()  # (rows, d), unit rows
            q = qmodel.item_vectors(a, b).double()  # (rows, d)
            min_cos = min(min_cos, float(torch.nn.functional.cosine_similarity(f, q, dim=-1).min()))
            max_d = max(max_d, float((q - f).norm(dim=-1).max()) / t)
    return {"rows": n - 1, "min_cosine": min_cos, "max_abs_score_err": max_d, "temperature": t}


def _item_table_line(c: dict) -> str:
    return (
        f"item table ({c['rows']} rows): min cosine to float {c['min_cosine']:.6f}, "
        f"max |Δ score| {c['max_abs_score_err']:.4g} (cosine / temperature {c['temperature']:g}, any user)"
    )


def _layers_line(meta: dict) -> str:
    """The summary's layers: INT8's quantized and float-kept Linears; a 16-bit scheme's model in that dtype but the
    float32 layers it keeps (the next-action head)."""
    if meta["scheme"] != "int8":
        kept = ", ".join(meta["keep_float"])
        return f"the model {meta['scheme']}" + (f" but {kept} (float32)" if kept else "")
    return f"{len(meta['quantized'])} INT8 layers, kept float: {', '.join(meta['keep_float']) or 'none'}"


def add_subcommands(subparsers) -> None:
    """Add ``quantize`` to the ``hstu`` CLI (handler returns an exit code)."""
    from hstu.cli import number_in
    from hstu.config import SEED_MAX

    q = subparsers.add_parser(
        "quantize",
        help="write an INT8 / BF16 / FP16 copy of a run, with a per-layer error report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument("--run", required=True, help="float run directory (from `hstu train`)")
    q.add_argument("--scheme", required=True, choices=["int8", "bf16", "fp16"])
    q.add_argument("--out", help="new directory for the quantized run")
    q.add_argument(
        "--embeddings",
        choices=["fp16", "bf16", "int8", "fp32"],
        help="int8 scheme: item-table storage (default fp16; int8 = row-wise with per-row scales)",
    )
    q.add_argument("--keep-float", help="int8 scheme: comma-separated layers kept in float32, e.g. layers.1.o or layers.0")
    q.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "fbgemm", "onednn", "qnnpack", "int_mm", "dequant"],  # int8_kernels.KERNELS (torch not imported here)
        help="int8 GEMM kernel of the calibration report (default: this device's; onednn = fbgemm's results, large calls on oneDNN); "
        "not saved: a loaded run uses the device's kernel",
    )
    q.add_argument("--calib-users", type=number_in(int, 1), default=256, help="users in the calibration batch")
    q.add_argument("--seed", type=number_in(int, 0, SEED_MAX), default=0, help="calibration user sample seed")
    q.add_argument("--data-dir", help="data directory for calibration (default: the run's)")
    q.add_argument("--no-calibrate", action="store_true", help="skip the per-layer report (no data needed)")
    q.add_argument("--report-only", action="store_true", help="print the per-layer report, write nothing")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_quantize)
