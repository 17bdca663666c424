"""Quantized inference: layer-wise INT8 (per-channel INT8 Linear weights on an integer GEMM),
FP16 / BF16, a per-layer calibration report, and quantized checkpoints.

Entry points:
    apply_precision(model, "fp32" | "bf16" | "fp16" | "int8", ...) -> the same model, converted in place
    load_quantized_run(run_dir, device, scheme=None) -> (model, config dict, idmap dict)
    load_for_inference(run_dir, device, precision=None)  # moved: hstu.runs.load_run (old name kept)
    save_quantized_run(model, src_run, out, calibration=...)
    layer_report(float_model, quant_model, batch)                                           # calibration
"""

from __future__ import annotations

from torch import nn

from hstu.model.hstu import HSTUModel
from hstu.quant.calibrate import calibration_batch, layer_report
from hstu.quant.checkpoint import (
    PRECISIONS,
    SCHEMES,
    QuantCheckpointError,
    load_quantized_run,
    read_quant_meta,
    save_quantized_run,
    tensor_bytes,
)
from hstu.quant.int8 import (
    Int8Embedding,
    Int8Kernel,
    Int8Linear,
    dequantize_per_channel,
    quantize_model_int8,
    quantize_per_channel,
    select_int8_kernel,
)
from hstu.quant.lowp import LowPrecisionHSTUModel, to_low_precision

__all__ = [
    "PRECISIONS",
    "SCHEMES",
    "QuantCheckpointError",
    "Int8Embedding",
    "Int8Kernel",
    "Int8Linear",
    "LowPrecisionHSTUModel",
    "apply_precision",
    "calibration_batch",
    "dequantize_per_channel",
    "layer_report",
    "load_for_inference",
    "load_quantized_run",
    "quantize_model_int8",
    "quantize_per_channel",
    "read_quant_meta",
    "save_quantized_run",
    "select_int8_kernel",
    "tensor_bytes",
    "to_low_precision",
]


def __getattr__(name: str):
    """``load_for_inference``: moved to :func:`hstu.runs.load_run` (above quant in the import order),
    resolved on first use so the old name keeps working."""
    if name == "load_for_inference":
        from hstu.quant import checkpoint

        return checkpoint.load_for_inference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply_precision(model: nn.Module, precision: str, *, embeddings: str | None = None, keep_float=(), kernel: str = "auto") -> nn.Module:
    """Convert an HSTUModel in place for inference at ``precision`` and return it.

    Args:
        model: a float32 ``HSTUModel`` (eval mode is set).
        precision: "fp32" (unchanged), "bf16" / "fp16" (:func:`to_low_precision`), or "int8"
            (:func:`quantize_model_int8`: INT8 block Linears, item table in ``embeddings``).
        embeddings: INT8 only: "fp16" (default) | "bf16" | "int8" (row-wise) | "fp32".
        keep_float: INT8 only: Linear names (``layers.1.o``) or blocks (``layers.1``) to keep in float32.
        kernel: INT8 only: "auto" | "fbgemm" | "qnnpack" | "int_mm" | "dequant".
    Raises:
        ValueError: unknown precision / embeddings / kernel / layer name; options given for a
            scheme that does not use them.
        TypeError: another precision than fp32 for a model that is not an ``HSTUModel`` (SASRec).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: unknown value {precision!r}; valid: {list(PRECISIONS)}")
    if precision != "int8" and (embeddings not in (None, precision) or keep_float):
        raise ValueError(f"precision {precision!r}: --embeddings and --keep-float apply to the int8 scheme only")
    model.eval()
    if precision == "fp32":
        return model
    if not isinstance(model, HSTUModel):  # the SASRec baseline: float32 only
        raise TypeError(f"precision {precision!r}: low-precision inference supports HSTUModel, got {type(model).__name__} (use fp32)")
    if precision == "int8":
        return quantize_model_int8(model, embeddings=embeddings or "fp16", keep_float=keep_float, kernel=kernel)
    return to_low_precision(model, precision)
