"""Per-layer quantization report on a calibration batch from real data.

For each HSTU block Linear (``layers.{i}.uvqk``, ``layers.{i}.o``) the *local* error: the float
model's input to that layer is fed to both the float layer and its quantized replacement, and
the largest absolute difference of the outputs over live rows is reported (with the largest
absolute float output, and their ratio), so one layer's sensitivity is seen in isolation. Then
the *accumulated* error: each block's output and the final user vectors of the float and the
quantized model run end to end on the same batch. A layer with a large local error can be kept
in float with ``--keep-float LAYER``.

Symbols: B users in the batch, W padded width, K / N a Linear's input / output features, d width.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from hstu.data.batching import SequenceBatch, eval_batch
from hstu.data.sequences import EventLog, Split
from hstu.quant.int8 import Int8Linear, quantizable_linears

log = logging.getLogger(__name__)


def calibration_batch(log_: EventLog, split: Split, max_seq_len: int, *, num_users: int = 256, seed: int = 0) -> SequenceBatch:
    """Histories of ``num_users`` users (seeded sample) before their validation target: training
    events only, never the test target. Returns a padded :class:`SequenceBatch` (B = min(num_users,
    evaluable users)). Raises ValueError if no user has a validation target or num_users < 1."""
    if num_users < 1:
        raise ValueError(f"calibration: num_users must be >= 1, got {num_users}")
    targets = split.targets("valid")
    users = np.nonzero(targets >= 0)[0]
    if users.size == 0:
        raise ValueError("calibration: no user has a validation target")
    if num_users > users.size:  # said, not silently fewer (a trial's finding)
        log.warning("calibration: %d users asked, the data has %d with a validation target: calibrating on those", num_users, users.size)
    rng = np.random.default_rng(seed)
    users = np.sort(rng.choice(users, size=min(num_users, users.size), replace=False))
    return eval_batch(log_, targets, users, max_seq_len)


def _dtype_in(mod: nn.Module) -> torch.dtype:
    return torch.float32 if isinstance(mod, Int8Linear) else mod.weight.dtype


def _kind(mod: nn.Module) -> str:
    if isinstance(mod, Int8Linear):
        return "int8"
    return {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(mod.weight.dtype, str(mod.weight.dtype))


@torch.inference_mode()
def layer_report(float_model: nn.Module, quant_model: nn.Module, batch: SequenceBatch) -> dict:
    """Compare ``quant_model`` with ``float_model`` (same weights before conversion) on ``batch``.

    Returns a JSON-ready dict:
        users: B;  linears: [{name, kind ("int8" | "float32" | "bf16" | "fp16"), shape [N, K],
        max_abs_err, max_abs_ref, rel_err = max_abs_err / max_abs_ref}] (local errors);
        blocks: [{name, max_abs_err, max_abs_ref}] (end-to-end block outputs, live rows);
        user_vector: {max_abs_err, min_cosine} of the L2-normalised last rows.
    Errors are over live rows only (padding rows are zero in both models).
    """
    float_model.eval()
    quant_model.eval()
    dev = float_model.pos_emb.weight.device
    b = batch.to(dev)
    B, W = b.ids.shape
    live = torch.arange(W, device=dev).view(1, W) < b.lengths.view(B, 1)  # (B, W)

    lin_f = quantizable_linears(float_model)
    caught: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    blocks_f: list[torch.Tensor] = []
    blocks_q: list[torch.Tensor] = []
    hooks = []
    for name, mod in lin_f.items():
        hooks.append(mod.register_forward_hook(lambda m, i, o, name=name: caught.__setitem__(name, (i[0][live], o[live]))))
    for layer in float_model.layers:
        hooks.append(layer.register_forward_hook(lambda m, i, o: blocks_f.append(o[live].float())))
    for layer in quant_model.layers:
        hooks.append(layer.register_forward_hook(lambda m, i, o: blocks_q.append(o[live].float())))
    try:
        feats = dict(actions=b.actions, categories=b.categories)
        uf = float_model.last_rows(float_model.encode(b.ids, b.timestamps, b.lengths, **feats), b.lengths).float()  # (B, d)
        uq = quant_model.last_rows(quant_model.encode(b.ids, b.timestamps, b.lengths, **feats), b.lengths).float()  # (B, d)
    finally:
        for h in hooks:
            h.remove()

    linears = []
    for name, (x, y) in caught.items():
        qmod = quant_model.get_submodule(name)
        yq = qmod(x.to(_dtype_in(qmod))).float()  # (rows, N)
        err, ref = float((yq - y.float()).abs().max()), float(y.abs().max())
        linears.append(
            {
                "name": name,
                "kind": _kind(qmod),
                "shape": [int(y.shape[-1]), int(x.shape[-1])],
                "max_abs_err": err,
                "max_abs_ref": ref,
                "rel_err": err / ref if ref > 0 else 0.0,
            }
        )
    blocks = [
        {"name": f"layers.{i}", "max_abs_err": float((q - f).abs().max()), "max_abs_ref": float(f.abs().max())}
        for i, (f, q) in enumerate(zip(blocks_f, blocks_q))
    ]
    cos = torch.nn.functional.cosine_similarity(uf.double(), uq.double(), dim=-1)  # (B,)
    return {
        "users": int(B),
        "linears": linears,
        "blocks": blocks,
        "user_vector": {"max_abs_err": float((uq - uf).abs().max()), "min_cosine": float(cos.min())},
    }


def format_report(report: dict) -> str:
    """Plain-text table of :func:`layer_report` for the CLI."""
    lines = [
        f"calibration batch: {report['users']} users (histories before their validation target)",
        f"{'layer':<22}{'kind':<9}{'shape (N x K)':<16}{'max|err|':>11}{'max|ref|':>11}{'rel':>9}",
    ]
    worst = max(report["linears"], key=lambda r: r["rel_err"], default=None)
    for r in report["linears"]:
        flag = "  <- most sensitive" if r is worst and r["rel_err"] > 0 else ""
        lines.append(
            f"{r['name']:<22}{r['kind']:<9}{r['shape'][0]:>5} x {r['shape'][1]:<7}{r['max_abs_err']:>11.4g}"
            f"{r['max_abs_ref']:>11.4g}{r['rel_err']:>9.3%}{flag}"
        )
    for r in report["blocks"]:
        lines.append(f"{r['name'] + ' out':<22}{'':<9}{'':<16}{r['max_abs_err']:>11.4g}{r['max_abs_ref']:>11.4g}")
    u = report["user_vector"]
    lines.append(f"user vectors: max|err| {u['max_abs_err']:.4g}, min cosine to float {u['min_cosine']:.6f}")
    return "\n".join(lines)
