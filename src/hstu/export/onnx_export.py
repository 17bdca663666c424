"""ONNX models of the encoder, for ONNX Runtime or Triton Inference Server's onnxruntime backend.

``torch.onnx.export(..., dynamo=True)`` (the torch.export-based exporter; it translates with
``onnxscript``), checked with ``onnx.checker`` and run here by ``onnxruntime`` for the export's
own verification. Inputs and the output are named as :class:`hstu.export.encoder.UserEncoder`
says. Needs the ``export`` extra: ``pip install 'hstu[export]'`` (onnx, onnxruntime, onnxscript).
Sources: https://pytorch.org/docs/stable/onnx_export.html, https://onnxruntime.ai/docs/api/python/.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from hstu.export.encoder import UserEncoder
from hstu.export.pt2_export import trace

SUFFIX = ".onnx"
EXTRA = "export"
PACKAGES = ("onnx", "onnxscript", "onnxruntime")
# INFO lines per graph rewrite (hundreds per bucket) and "torchvision is not installed" warnings: raised to
# these levels while exporting, so `hstu export` (INFO logging) prints its own lines only
QUIET = {"onnx_ir": logging.WARNING, "onnxscript": logging.WARNING, "torch.onnx._internal.exporter._registration": logging.ERROR}


@contextlib.contextmanager
def _quiet():
    loggers = {name: logging.getLogger(name) for name in QUIET}
    before = {name: lg.level for name, lg in loggers.items()}
    try:
        for name, lg in loggers.items():
            lg.setLevel(max(QUIET[name], lg.getEffectiveLevel()))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)  # torch 2.13's own pytree deprecation
            yield
    finally:
        for name, lg in loggers.items():
            lg.setLevel(before[name])


def missing_package() -> str | None:
    """The first package of the ``export`` extra that cannot be imported, or None."""
    for name in PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def export(enc: UserEncoder, inputs: tuple[torch.Tensor, ...], path: Path, batch: int | None) -> dict:
    """Write the ONNX model (weights inside: the tables of a run fit the 2 GB protobuf limit far
    below serving sizes; a larger model raises) to ``path``; returns {"opset": n, "onnx": version}."""
    import onnx

    ins, outs = enc.signature(inputs[0].shape[1], batch)
    with _quiet():
        program = torch.onnx.export(
            trace(enc, inputs, batch), input_names=[t.name for t in ins], output_names=[t.name for t in outs], dynamo=True, verbose=False
        )
        program.save(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    return {"opset": int(opset), "onnx": onnx.__version__}


def run(path: Path, names: list[str], inputs: tuple[torch.Tensor, ...]) -> np.ndarray:
    """One onnxruntime CPU session over ``path`` run on ``inputs``: (B, d) float32."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {n: x.numpy() for n, x in zip(names, inputs)})[0]


__all__ = ["EXTRA", "PACKAGES", "SUFFIX", "export", "missing_package", "run"]
