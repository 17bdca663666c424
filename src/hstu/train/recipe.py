"""What a TrainConfig trains with, stated once (metrics.json ``recipe`` and the log's recipe line),
and the learning-rate decay on a validation plateau.

The decay is PyTorch's ``torch.optim.lr_scheduler.ReduceLROnPlateau`` rule (mode "max", threshold 0,
cooldown 0; its ``patience`` is ours minus one): at the ``[train] lr_decay_patience``-th evaluation in
a row without a better valid NDCG@10 (and every that many after), every learning rate is multiplied
by ``[train] lr_decay_factor``. It counts on the
early-stopping counter of :mod:`hstu.train.loop` instead of a scheduler object of its own, so the
decayed rates live in the optimizer's param_groups, which a checkpoint already stores and
``--resume`` restores (:func:`hstu.runs.save_train_state`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def recipe(tcfg, table: dict | None = None, num_items: int | None = None) -> dict:
    """The negatives scheme, the batching and the item table's optimizer a TrainConfig trains with,
    as metrics.json's ``recipe`` and the log's recipe line: {"negatives": "pool" | "per-position" |
    "chunked" | "mixed" (per position, uniform + in-batch) | "full" (``[train] softmax = "full"``: every item), "num_negatives",
    "negatives_chunk" (None unless per-position / chunked), "negatives_pool" (None under "full": nothing is sampled),
    "batching": "length-bucketed" |
    "random", "length_pool", "loss_divisor": "batch" | "epoch", "packing": "off" | "pack" (resolved,
    :func:`hstu.train.losses.resolve_packing`),
    "table_optimizer", "table_learning_rate", "lr_decay": "off" | {"patience", "factor", "scope"}
    (:func:`decay_on_plateau`), "lr_warmup_steps" (:func:`warm_up`), "in_batch_negatives" (None under "full";
    :mod:`hstu.train.mixed_negatives`)} (:func:`hstu.train.losses.training_loss`;
    :func:`hstu.data.batching.length_bucketed_batches`). ``table``: a strategy's own item-table
    optimizer, {"table_optimizer", "table_learning_rate", ...} (the distributed strategy's
    config.json ``distributed`` table, FBGEMM's fused optimizer); None: the TrainConfig's
    (``[train] table_optimizer``, the rate :func:`hstu.train.sparse_optim.table_learning_rate`). ``num_items``: the
    catalogue's size, which caps the pool (:func:`hstu.train.losses.draw_pool` draws min(pool, I) distinct items)."""
    from hstu.train.sparse_optim import table_learning_rate

    scheme = "pool" if tcfg.negatives_pool > 0 else ("per-position" if tcfg.negatives_chunk == 1 else "chunked")
    scheme = "mixed" if tcfg.in_batch_negatives and scheme != "pool" else scheme
    scheme = "full" if tcfg.softmax == "full" else scheme
    opt, lr = (table["table_optimizer"], table["table_learning_rate"]) if table else (tcfg.table_optimizer, table_learning_rate(tcfg))
    sampled = scheme != "full"
    return {
        "negatives": scheme,
        "num_negatives": tcfg.num_negatives if sampled else None,
        "negatives_chunk": tcfg.negatives_chunk if scheme in ("per-position", "chunked") else None,  # a pool ignores it
        "negatives_pool": min(tcfg.negatives_pool, num_items or tcfg.negatives_pool) if sampled else None,
        "batching": "random" if tcfg.length_pool == 1 else "length-bucketed",
        "length_pool": tcfg.length_pool,
        "loss_divisor": tcfg.loss_divisor,
        "packing": tcfg.packing,
        "table_optimizer": opt,
        "table_learning_rate": lr,
        "lr_decay": _decay(tcfg, fused_table=table is not None),
        "lr_warmup_steps": tcfg.lr_warmup_steps,
        "in_batch_negatives": tcfg.in_batch_negatives if sampled else None,
    }


def _decay(tcfg, fused_table: bool) -> dict | str:
    """recipe()'s ``lr_decay``: "off", or {"patience", "factor", "scope"}; under the distributed strategy
    only the dense AdamW decays (FBGEMM's fused table optimizer keeps its rate)."""
    if not tcfg.lr_decay_patience:
        return "off"
    scope = "dense layers (the fused item-table optimizer keeps its rate)" if fused_table else "all parameters"
    return {"patience": tcfg.lr_decay_patience, "factor": tcfg.lr_decay_factor, "scope": scope}


def recipe_text(tcfg, table: dict | None = None, num_items: int | None = None) -> str:
    """:func:`recipe` as one log line, e.g. ``negatives pool (128 per position from 1024 distinct items per
    batch), batching length-bucketed (pools of 50 batches), loss divisor batch, item table adamw (lr 0.001),
    lr x 0.5 after 3 epochs without a better valid NDCG@10``."""
    return describe(recipe(tcfg, table, num_items))


def unused_fields(tcfg) -> list[str]:
    """``name = value`` of the sampling fields set away from their defaults that the recipe does not use
    (``softmax = "full"`` samples nothing: num_negatives and negatives_chunk are then ignored)."""
    from hstu.config import TrainConfig

    if tcfg.softmax != "full":
        return []
    return [f"{f} = {getattr(tcfg, f)}" for f in ("num_negatives", "negatives_chunk") if getattr(tcfg, f) != getattr(TrainConfig, f)]


def describe(r: dict) -> str:
    """A :func:`recipe` dict as :func:`recipe_text`'s line."""
    neg = {
        "pool": f"pool ({r['num_negatives']} per position from {r['negatives_pool']} distinct items per batch)",
        "per-position": f"per-position ({r['num_negatives']} per position)",
        "chunked": f"chunked ({r['num_negatives']} shared by runs of {r['negatives_chunk']} positions)",
        "full": "full (every item: full softmax)",
        "mixed": f"mixed ({r['num_negatives']} uniform + {r.get('in_batch_negatives')} in-batch per position, logQ-corrected)",
    }[r["negatives"]]
    bat = "random" if r["batching"] == "random" else f"length-bucketed (pools of {r['length_pool']} batches)"
    pack = ", packed rows" if r["packing"] == "pack" else ""
    table = f"item table {r['table_optimizer']} (lr {r['table_learning_rate']:g})"
    d = r["lr_decay"]
    decay = "constant lr" if d == "off" else f"lr x {d['factor']:g} after {d['patience']} epochs without a better valid NDCG@10"
    if d != "off" and d["scope"] != "all parameters":
        decay += f" ({d['scope']})"
    if r.get("lr_warmup_steps"):
        decay = f"linear lr warm-up over {r['lr_warmup_steps']} steps, {decay}"
    return f"negatives {neg}, batching {bat}{pack}, loss divisor {r['loss_divisor']}, {table}, {decay}"


def decay_on_plateau(param_groups: list[dict], tcfg, bad_epochs: int, epoch: int) -> bool:
    """Multiply each group's ``"lr"`` by ``tcfg.lr_decay_factor`` when ``bad_epochs`` (evaluations in a
    row without a better valid NDCG@10, after this epoch's) is a positive multiple of
    ``tcfg.lr_decay_patience``; 0 patience: never. Returns whether it decayed (logged with the new rates)."""
    p = tcfg.lr_decay_patience
    if p == 0 or bad_epochs == 0 or bad_epochs % p:
        return False
    for g in param_groups:
        g["lr"] *= tcfg.lr_decay_factor
    rates = ", ".join(f"{g['lr']:.3g}" for g in param_groups)
    log.info("epoch %d: %d epochs without a better valid NDCG@10: learning rate x %g -> %s", epoch, bad_epochs, tcfg.lr_decay_factor, rates)
    return True


def warm_up(param_groups: list[dict], tcfg, step: int) -> None:
    """Linear learning-rate warm-up (Goyal et al. 2017, "Accurate, Large Minibatch SGD", §2.2): at optimizer step
    ``step`` (0-based, counted over the whole run) below N = ``tcfg.lr_warmup_steps``, every group's rate is its
    target x (step + 1) / N, the target being the group's rate when the warm-up began, kept in the group as
    ``"warmup_lr"`` (a checkpoint's optimizer state carries it to ``--resume``); from step N on, nothing changes."""
    n = tcfg.lr_warmup_steps
    if step >= n:
        return
    for g in param_groups:
        g.setdefault("warmup_lr", g["lr"])
        g["lr"] = g["warmup_lr"] * (step + 1) / n


def model_text(mcfg, parameters: int | None = None) -> str:
    """The model a run trains, for the log's model line, e.g. ``hstu, FuXi-alpha block (semantic, position and time
    channels), 2 blocks x 1 head, d 50, max_seq_len 200, 210,300 parameters``: the block named from ``[model]
    multi_channel`` / ``query_key_map`` / ``ffn_hidden`` (Zhai et al. 2024; Ye et al. 2025, FuXi-alpha and FuXi-beta)."""
    if mcfg.architecture != "hstu":
        block = ""
    elif mcfg.multi_channel:
        block = (
            "FuXi-alpha block (semantic, position and time channels)"
            if mcfg.query_key_map
            else "FuXi-beta block (position and time channels, no query-key map)"
        )
    else:
        block = "HSTU block" + ("" if mcfg.query_key_map else " without the query-key map (A = SiLU(rab) / n)")
    if block and mcfg.ffn_hidden:
        block += f" + SwiGLU FFN stage (hidden {mcfg.ffn_hidden})"
    heads = f"{mcfg.num_heads} head{'s' if mcfg.num_heads > 1 else ''}"
    sizes = f"{mcfg.num_blocks} blocks x {heads}, d {mcfg.embedding_dim}, max_seq_len {mcfg.max_seq_len}"
    return ", ".join(x for x in (mcfg.architecture, block, sizes, f"{parameters:,} parameters" if parameters else "") if x)
