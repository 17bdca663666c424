"""Inference hardening in one place: every inference path (engine, recommender, server) calls
:func:`harden` once at load and runs under :func:`inference`.

- ``torch.inference_mode`` (no autograd graph, no version counters: PyTorch docs,
  "Inference Mode", https://pytorch.org/docs/stable/generated/torch.autograd.grad_mode.inference_mode.html);
- every parameter ``requires_grad=False`` (set, then asserted);
- ``eval()`` (dropout off);
- every parameter and buffer on the chosen device, checked at load: a stray tensor raises
  :class:`StrayTensorError` naming it (``layers.1.rel_bias.ts_w on cpu, expected cuda:0``),
  instead of a device-mismatch error deep inside the first request.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

inference = torch.inference_mode  # the one context every inference path uses


class StrayTensorError(RuntimeError):
    """A parameter, buffer or input is not on the device the model was loaded for."""


class TrainableParameterError(RuntimeError):
    """A parameter still has requires_grad=True after hardening."""


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    # "cuda" without an index means the current device; compare indices only when both have one
    return actual.index is None or expected.index is None or actual.index == expected.index


def check_device(module: nn.Module, device: torch.device | str) -> None:
    """Raise :class:`StrayTensorError` listing every parameter / buffer not on ``device``, except
    those a submodule keeps in host memory on purpose (its ``host_tensors()``: a hashed item table's
    host-placed shards, :class:`hstu.model.embedding.ShardedEmbedding`)."""
    dev = torch.device(device)
    host = {f"{m}.{t}" if m else t for m, sub in module.named_modules() if hasattr(sub, "host_tensors") for t in sub.host_tensors()}
    stray = [
        f"{name} on {t.device}"
        for name, t in (*module.named_parameters(), *module.named_buffers())
        if not _same_device(t.device, dev) and name not in host
    ]
    if stray:
        more = f" (+{len(stray) - 5} more)" if len(stray) > 5 else ""
        raise StrayTensorError(
            f"{len(stray)} tensor(s) not on {dev}: {', '.join(stray[:5])}{more}; move the model with .to({str(dev)!r}) before serving"
        )


def check_frozen(module: nn.Module) -> None:
    """Raise :class:`TrainableParameterError` naming the parameters with requires_grad=True."""
    live = [name for name, p in module.named_parameters() if p.requires_grad]
    if live:
        raise TrainableParameterError(f"parameters still trainable: {', '.join(live[:5])}")


def check_inputs_on(device: torch.device | str, **tensors: torch.Tensor | None) -> None:
    """Raise :class:`StrayTensorError` naming each input tensor not on ``device`` (None skipped)."""
    dev = torch.device(device)
    stray = [f"{name} on {t.device}" for name, t in tensors.items() if t is not None and not _same_device(t.device, dev)]
    if stray:
        raise StrayTensorError(f"input tensor(s) not on {dev}: {', '.join(stray)}")


def harden(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Prepare a loaded model for inference, in place; returns it.

    Sets eval mode and requires_grad=False on every parameter, then asserts both, and checks
    that every parameter and buffer is on ``device`` (default: the first parameter's device).

    Raises:
        StrayTensorError: a parameter or buffer elsewhere (named in the message).
        TrainableParameterError: a parameter could not be frozen.
    """
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    check_frozen(model)
    if model.training:
        raise RuntimeError("model is still in training mode after eval()")
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    check_device(model, device)
    log.debug("hardened %s on %s: eval, %d frozen parameters", type(model).__name__, device, sum(1 for _ in model.parameters()))
    return model
