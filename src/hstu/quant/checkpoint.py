"""Quantized run directories: safetensors weights + JSON metadata, loaded with a scheme check.

RUN_DIR_Q/
  config.json, idmap.json     copied from the float run (same model sizes and id map; its items.npz too, if any)
  model.quant.safetensors     the quantized state dict; safetensors metadata {"hstu_quant_scheme": scheme,
                              "hstu_quant_format": "1"}. INT8 scheme: ``{layer}.weight_int8`` (N, K) int8 and
                              ``{layer}.weight_scale`` (N,) float32 per quantized Linear, float32 biases,
                              item table in the embedding dtype (or ``item_emb.weight_int8`` + ``weight_scale``),
                              the small tables in fp16/bf16. BF16/FP16 schemes: every tensor in that dtype
                              (the next-action head in float32).
  quant.json                  {"format": 1, "scheme", "embeddings", "keep_float", "quantized", "stored_as",
                              "layers": {name: {"weight", "scale", "shape", "granularity", "symmetric", "qmin",
                              "qmax", "scale_min", "scale_max"}}, "versions": {hstu, torch, safetensors, numpy,
                              python}, "source_run", "source_weights_sha256", "bytes": {...}, "calibration": {...}}

The float run's ``model.safetensors`` is deliberately absent, so the float loader
(:func:`hstu.runs.load_float_run`) cannot silently read a quantized run; use
:func:`load_quantized_run` or :func:`hstu.runs.load_run` (any run, at a precision). The rest of
the run directory's layout is :mod:`hstu.runs`. Loading refuses, with a ValueError naming
the file and both schemes, a checkpoint whose scheme differs from the one asked for, whose
safetensors metadata disagrees with quant.json, or whose tensors have the wrong dtype or shape.
"""

from __future__ import annotations

import logging
import platform
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from hstu import backend
from hstu.config import model_config_from_dict
from hstu.model.checkpoint import dir_target, file_sha256, read_idmap, read_json, read_safetensors, save_tensors, staged_dir, write_json
from hstu.model.embedding_rows import dtype_name
from hstu.model.run_files import CONFIG, IDMAP, ITEMS, require_run_dir
from hstu.model.run_files import WEIGHTS as FLOAT_WEIGHTS
from hstu.quant.int8 import QMAX, Int8Embedding, Int8Linear, quantize_model_int8
from hstu.quant.lowp import LOWP, to_low_precision

log = logging.getLogger(__name__)

FORMAT = 1
WEIGHTS = "model.quant.safetensors"
META = "quant.json"
SCHEMES = ("int8", "bf16", "fp16")
PRECISIONS = ("fp32", "bf16", "fp16", "int8")
_DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class QuantCheckpointError(ValueError):
    """A quantized checkpoint that cannot be used as asked (wrong scheme, corrupt, mismatched)."""


def versions() -> dict[str, str]:
    import numpy
    import safetensors

    import hstu

    return {
        "hstu": getattr(hstu, "__version__", "unknown"),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as stored: small tables cast to their recorded storage dtype (lossless:
    they were rounded through it at conversion)."""
    meta = getattr(model, "quant_meta", None)
    if meta is None:
        raise ValueError("model has no quant_meta: convert it with hstu.quant.apply_precision first")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    for key, name in meta["stored_as"].items():
        state[key] = state[key].to(_DT[name])
    return state


def tensor_bytes(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """{"embedding": bytes of embedding tables, "dense": bytes of everything else, "total": sum}.

    Embedding tables: item, position, action and category embeddings (keys ``*_emb.*``); dense:
    the HSTU blocks (Linear weights, scales, biases, relative-bias tables) and the action head.
    """
    emb = sum(t.numel() * t.element_size() for k, t in state.items() if k.split(".")[0].endswith("_emb"))
    tot = sum(t.numel() * t.element_size() for t in state.values())
    return {"embedding": emb, "dense": tot - emb, "total": tot}


def layer_table(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (Int8Linear, Int8Embedding)):
            s = mod.weight_scale
            out[name] = {
                "weight": f"{name}.weight_int8",
                "scale": f"{name}.weight_scale",
                "shape": list(mod.weight_int8.shape),
                "granularity": "per_output_channel" if isinstance(mod, Int8Linear) else "per_row",
                "symmetric": True,
                "qmin": -QMAX,
                "qmax": QMAX,
                "scale_min": float(s.min()),
                "scale_max": float(s.max()),
            }
    return out


def check_quantized_out(src_run: str | Path, out: str | Path, overwrite: bool = False) -> None:
    """FileExistsError when ``out`` is ``src_run``, inside it or inside any other run directory (config.json and
    idmap.json), or a non-empty directory (unless ``overwrite``);
    ``hstu quantize`` calls it before it reads any data."""
    src, out = Path(src_run), dir_target(out)  # FileExistsError: a link to nothing
    if out.resolve() == src.resolve():
        raise FileExistsError(f"--out {out} is the source run itself; write the quantized run to a new directory")
    if src.resolve() in out.resolve().parents:  # a run nested in a run: its files would be taken for the run's own
        raise FileExistsError(f"--out {out} is inside the source run {src}; write the quantized run to a directory beside it")
    host = next((p for p in out.resolve().parents if (p / CONFIG).is_file() and (p / IDMAP).is_file()), None)
    if host is not None:  # e.g. another quantized run: its graph cache and report would share a tree with this one
        raise FileExistsError(f"--out {out} is inside the run {host}; write the quantized run to a directory beside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out}: {'directory exists and is not empty' if out.is_dir() else 'is a file'} (choose a new --out)")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise FileExistsError(f"{out}: {above} is a file, not a directory (choose a new --out)")


def save_quantized_run(
    model: torch.nn.Module, src_run: str | Path, out: str | Path, *, calibration: dict | None = None, overwrite: bool = False
) -> dict[str, Any]:
    """Write a quantized run directory (see module docstring) and return its quant.json dict. The directory is
    built beside ``out`` and moved there when complete (:func:`hstu.model.checkpoint.staged_dir`): an error or an
    interrupt leaves nothing at ``out``, and ``overwrite`` replaces an old ``out`` whole, only then.

    Raises:
        FileExistsError: ``out`` exists and is not empty (unless ``overwrite``), or is ``src_run``.
        ValueError: the model was not converted by :func:`hstu.quant.apply_precision`.
    """
    src, out = Path(src_run), Path(out)
    check_quantized_out(src, out, overwrite)
    meta = dict(getattr(model, "quant_meta", None) or {})
    if meta.get("scheme") not in SCHEMES:
        raise ValueError("model has no quantization scheme (quant_meta): convert it with hstu.quant.apply_precision first")
    state = quantized_state(model)
    float_weights = src / FLOAT_WEIGHTS
    with staged_dir(out, last=META) as tmp:  # whole or not at all: an error or Ctrl-C leaves ``out`` as it was
        for f in (CONFIG, ITEMS, IDMAP):  # items.npz (a large catalogue's, when there is one) before the idmap.json naming it
            if f != ITEMS or (src / f).exists():
                shutil.copyfile(src / f, tmp / f)
        if (dt := getattr(model.item_emb, "dtypes", None)) is not None:  # a hashed table: the dtype its shards are stored in
            cfg = read_json(tmp / CONFIG)  # (a bf16 table quantized with fp32 embeddings said bf16: its memory plan, half)
            cfg["model"]["item_table_dtype"] = dtype_name(dt[0])
            write_json(tmp / CONFIG, cfg)
        meta.update(
            {
                "format": FORMAT,
                "layers": layer_table(model),
                "versions": versions(),
                "source_run": str(src.resolve()),
                "source_weights_sha256": file_sha256(float_weights) if float_weights.exists() else None,
                "calibration": calibration,
            }
        )
        save_tensors(tmp / WEIGHTS, state, {"hstu_quant_scheme": meta["scheme"], "hstu_quant_format": str(FORMAT)})
        meta["bytes"] = {"tensors": tensor_bytes(state), "file": (tmp / WEIGHTS).stat().st_size}
        if float_weights.exists():
            meta["bytes"]["float_file"] = float_weights.stat().st_size
        write_json(tmp / META, meta)
    log.info("wrote %s (%s, %d bytes)", out / WEIGHTS, meta["scheme"], meta["bytes"]["file"])
    return meta


def read_quant_meta(run_dir: str | Path) -> dict[str, Any] | None:
    """quant.json of a run, or None for a float run. ValueError naming the file: not valid JSON (e.g. truncated), not an object."""
    p = Path(run_dir) / META
    if not p.exists():
        return None
    meta = read_json(p)
    if not isinstance(meta, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _check(run: Path, meta: dict, scheme: str | None) -> None:
    if meta.get("format") != FORMAT:
        raise QuantCheckpointError(f"{run / META}: format {meta.get('format')!r} is not supported by this hstu (expects {FORMAT})")
    have = meta.get("scheme")
    if have not in SCHEMES:
        raise QuantCheckpointError(f"{run / META}: unknown scheme {have!r}; valid: {list(SCHEMES)}")
    if scheme is not None and scheme != have:
        raise QuantCheckpointError(
            f"{run}: checkpoint is quantized with scheme {have!r} but {scheme!r} was requested; re-run "
            f"`hstu quantize --run FLOAT_RUN --scheme {scheme} --out NEW_DIR` or drop --precision to use {have!r}"
        )
    wpath = run / WEIGHTS
    if not wpath.exists():
        raise FileNotFoundError(f"{wpath}: quantized weights not found")
    try:
        fh_ctx = safe_open(str(wpath), "pt")
    except (SafetensorError, OSError) as exc:
        raise QuantCheckpointError(f"{wpath}: not a readable safetensors file ({exc}); the run may be incomplete or corrupt") from exc
    with fh_ctx as fh:
        file_scheme = (fh.metadata() or {}).get("hstu_quant_scheme")
        if file_scheme != have:
            raise QuantCheckpointError(f"{wpath}: weights were written for scheme {file_scheme!r} but {run / META} says {have!r}")
        keys = set(fh.keys())
        for name, info in meta.get("layers", {}).items():
            for key, dtype, shape in ((info["weight"], torch.int8, info["shape"]), (info["scale"], torch.float32, info["shape"][:1])):
                if key not in keys:
                    raise QuantCheckpointError(f"{wpath}: tensor {key!r} of layer {name} is missing")
                t = fh.get_slice(key)
                got = t.get_dtype()
                want = {torch.int8: "I8", torch.float32: "F32"}[dtype]
                if got != want or list(t.get_shape()) != list(shape):
                    raise QuantCheckpointError(f"{wpath}: tensor {key!r} is {got} {t.get_shape()}, expected {want} {shape}")
        if have in LOWP:
            want = {"bf16": "BF16", "fp16": "F16"}[have]
            bad = [k for k in keys if not k.startswith("action_head.") and fh.get_slice(k).get_dtype() != want]
            if bad:
                raise QuantCheckpointError(f"{wpath}: scheme {have!r} but tensor {bad[0]!r} is {fh.get_slice(bad[0]).get_dtype()}")


def load_quantized_run(run_dir: str | Path, device: str = "cpu", *, scheme: str | None = None):
    """(model in eval mode on ``device``, config.json dict + {"quant": quant.json}, idmap.json dict).

    Args:
        run_dir: a directory written by ``hstu quantize`` / :func:`save_quantized_run`.
        device: "auto" | "cpu" | "cuda" | "npu".
        scheme: if given, the scheme the caller expects ("int8" | "bf16" | "fp16").
    Raises:
        FileNotFoundError: no directory, or no quant.json (a float run: the message says so).
        QuantCheckpointError (a ValueError): scheme mismatch, unsupported format, or weights
            whose metadata, dtypes or shapes disagree with quant.json.
    """
    run = Path(run_dir)
    require_run_dir(run)
    meta = read_quant_meta(run)
    if meta is None:
        raise FileNotFoundError(
            f"{run / META}: not found: {run} is not a quantized run (make one with "
            f"`hstu quantize --run {run} --scheme int8 --out {run}-int8`, or load it as a float run)"
        )
    _check(run, meta, scheme)
    cfg = read_json(run / CONFIG)
    ids = read_idmap(run)  # with items.npz's arrays for a large catalogue
    from hstu.model.hstu import build_hstu

    dev = backend.select(device)
    model = build_hstu(model_config_from_dict(cfg["model"]), device=dev.device)  # a hashed table: its shards, then their dtype
    if meta["scheme"] == "int8":
        quantize_model_int8(model, embeddings=meta["embeddings"], keep_float=meta["keep_float"], structure_only=True)
    else:
        to_low_precision(model, meta["scheme"])
    state = read_safetensors(run / WEIGHTS)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise QuantCheckpointError(
            f"{run / WEIGHTS}: weights do not match the {meta['scheme']} model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.quant_meta = {k: meta[k] for k in ("scheme", "embeddings", "keep_float", "quantized", "stored_as")}
    torch_saved = meta.get("versions", {}).get("torch")
    if torch_saved and torch_saved != torch.__version__:
        log.info("%s was written with torch %s, loading with %s", run, torch_saved, torch.__version__)
    model = model.to(dev.device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    prepare_kernels(model)
    cfg["quant"] = meta
    return model, cfg, ids


def prepare_kernels(model: torch.nn.Module) -> None:
    """Select kernels and prepack every Int8Linear now, logging the kernel once."""
    kernels = set()
    for m in model.modules():
        if isinstance(m, Int8Linear):
            kernels.add(m.prepare().kernel)
    for k in kernels:
        (log.info if k.integer else log.warning)("INT8 Linear kernel: %s (%s)", k.name, k.reason)


# Moved (issue 18): load_for_inference is hstu.runs.load_run, which owns loading a run at a precision;
# the old name stays importable from here, resolved on first use (PEP 562): hstu.runs sits above quant.
def __getattr__(name: str) -> Any:
    if name == "load_for_inference":
        from hstu.runs import load_run

        return load_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
