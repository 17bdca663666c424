"""torch.export programs of the encoder: ``torch.export.export`` + ``torch.export.save`` (.pt2).

A .pt2 file holds the traced graph (ATen ops) and the weights; load it with
``torch.export.load(path).module()`` and call it with the inputs of
:class:`hstu.export.encoder.UserEncoder`, in that order. Needs no package beyond torch.
Source: https://pytorch.org/docs/stable/export.html (torch.export, Dim, save / load).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hstu.export.encoder import UserEncoder

SUFFIX = ".pt2"


def batch_dims(n_inputs: int, batch: int | None):
    """dynamic_shapes for ``n_inputs`` inputs: axis 0 a shared ``Dim("batch")`` (1..65536), or None (static)."""
    if batch is not None:
        return None
    b = torch.export.Dim("batch", min=1, max=65536)
    return tuple({0: b} for _ in range(n_inputs))


def trace(enc: UserEncoder, inputs: tuple[torch.Tensor, ...], batch: int | None) -> torch.export.ExportedProgram:
    """The encoder as an ExportedProgram for inputs shaped like ``inputs`` (batch axis dynamic
    unless ``batch``). Raises what torch.export raises (an op it cannot trace)."""
    with torch.no_grad():
        return torch.export.export(enc, inputs, dynamic_shapes=batch_dims(len(inputs), batch), strict=False)


def export(enc: UserEncoder, inputs: tuple[torch.Tensor, ...], path: Path, batch: int | None) -> dict:
    """Write the .pt2 program to ``path``; returns the manifest facts of this format."""
    torch.export.save(trace(enc, inputs, batch), str(path))
    return {}


def run(path: Path, names: list[str], inputs: tuple[torch.Tensor, ...]) -> np.ndarray:
    """Load the saved program and run it on ``inputs``: (B, d) float32."""
    with torch.no_grad():
        return torch.export.load(str(path)).module()(*inputs).numpy()


__all__ = ["SUFFIX", "batch_dims", "export", "run", "trace"]
