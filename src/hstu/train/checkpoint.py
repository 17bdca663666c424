"""Training state for --resume (weights, AdamW moments, RNG) in safetensors + JSON.

The run-directory layout is documented in :mod:`hstu.model.checkpoint`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hstu.model.checkpoint import read_json, write_json


def save_train_state(run: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, info: dict) -> None:
    """Weights, AdamW moments and RNG states as tensors; scalars in last.json."""
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for pid, st in sd["state"].items():
        for name, val in st.items():
            tensors[f"optim.{pid}.{name}"] = torch.as_tensor(val).detach().contiguous().cpu()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.negatives"] = gen.get_state()
    tmp = run / "last.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, run / "last.safetensors")
    write_json(run / "last.json", {**info, "param_groups": sd["param_groups"]})


def load_train_state(run: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> dict:
    info = read_json(run / "last.json")
    tensors = load_file(str(run / "last.safetensors"))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, pid, name = k.split(".", 2)
            state.setdefault(int(pid), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": info["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    gen.set_state(tensors["rng.negatives"])
    return info
