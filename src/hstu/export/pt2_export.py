"""torch.export programs of the encoder: ``torch.export.export`` + ``torch.export.save`` (.pt2).

A .pt2 file holds the traced graph (ATen ops) and the weights; load it with :func:`load` and call it with the
inputs of :class:`hstu.export.encoder.UserEncoder`, in that order: ``load(path)(*inputs).numpy()``. Plain
``torch.export.load(path).module()`` gives a module whose weights require grad, so its outputs do too and
``.numpy()`` fails (call it under ``torch.inference_mode()`` or ``.detach()`` them); :func:`load` returns one
that runs under inference mode with its weights frozen. Needs no package beyond torch.
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


class InferenceProgram(torch.nn.Module):
    """A loaded program (``torch.export.load(path).module()``) called under ``torch.inference_mode()``, its
    parameters frozen: outputs are plain tensors that need no ``.detach()`` (``.numpy()`` works)."""

    def __init__(self, program: torch.nn.Module) -> None:
        super().__init__()
        self.program = program.requires_grad_(False)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.program(*inputs)


def load(path: str | Path) -> InferenceProgram:
    """The .pt2 program at ``path`` (written by ``hstu export --format pt2``), ready to call on the encoder's inputs:
    ``load(path)(item_ids, timestamps, lengths, request_time[, actions])`` -> user_vector (B, d) float32, detached.
    Raises what ``torch.export.load`` raises (no file, not a .pt2 program)."""
    return InferenceProgram(torch.export.load(str(path)).module())


def run(path: Path, names: list[str], inputs: tuple[torch.Tensor, ...]) -> np.ndarray:
    """Load the saved program (:func:`load`, as a user does) and run it on ``inputs``: (B, d) float32."""
    return load(path)(*inputs).numpy()


__all__ = ["SUFFIX", "InferenceProgram", "batch_dims", "export", "load", "run", "trace"]
