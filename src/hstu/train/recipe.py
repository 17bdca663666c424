"""What a TrainConfig trains with, stated once (metrics.json ``recipe`` and the log's recipe line; the model line,
:func:`model_text`), the recipe's refusals (:func:`check_recipe`), the learning-rate warm-up (:func:`warmed_up`) and
the learning-rate decay on a validation plateau.

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
from contextlib import contextmanager
from pathlib import Path

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
    (:func:`decay_on_plateau`), "lr_warmup_steps" (:func:`warmed_up`), "in_batch_negatives" (None under "full";
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


def recipe_warnings(tcfg, steps_per_epoch: int | None = None) -> list[str]:
    """What the recipe does not use of the sampling fields set away from their defaults (``softmax = "full"`` samples
    nothing: num_negatives, negatives_chunk; a pool or in-batch negatives draw per position: negatives_chunk), and a
    warm-up longer than the run's tcfg.epochs x ``steps_per_epoch`` optimizer steps: the log's warnings."""
    from hstu.config import TrainConfig

    changed = [f for f in ("num_negatives", "negatives_chunk") if getattr(tcfg, f) != getattr(TrainConfig, f)]
    scheme = "negatives_pool" if tcfg.negatives_pool else "in_batch_negatives" if tcfg.in_batch_negatives else ""
    out = []
    if tcfg.softmax == "full" and changed:
        out.append(f"[train] softmax = 'full' samples no negatives: {', '.join(f'{f} = {getattr(tcfg, f)}' for f in changed)} unused")
    elif scheme and "negatives_chunk" in changed:
        out.append(f"[train] {scheme} draws negatives per position: negatives_chunk = {tcfg.negatives_chunk} unused")
    total = tcfg.epochs * steps_per_epoch if steps_per_epoch is not None else None
    if total is not None and tcfg.lr_warmup_steps > total:
        out.append(
            f"[train] lr_warmup_steps = {tcfg.lr_warmup_steps} is more than this run's {total} optimizer steps ({tcfg.epochs} epoch(s) x "
            f"{steps_per_epoch} batch(es)): the learning rate never reaches learning_rate = {tcfg.learning_rate:g}"
        )
    return out


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
        n = r["lr_warmup_steps"]
        decay = f"linear lr warm-up over {n} step{'s' if n > 1 else ''}, {decay}"
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


@contextmanager
def warmed_up(param_groups: list[dict], tcfg, step: int):
    """Linear learning-rate warm-up (Goyal et al. 2017, "Accurate, Large Minibatch SGD", §2.2) around one optimizer step:
    at step ``step`` (0-based, the run's optimizer steps so far: epochs x batches per epoch) below N =
    ``tcfg.lr_warmup_steps``, every group's rate is scaled by (step + 1) / N inside the block and restored after it,
    so the groups always hold the run's own rates (the plateau decay scales those; a checkpoint stores them)."""
    n = tcfg.lr_warmup_steps
    rates = [g["lr"] for g in param_groups]
    if step < n:
        for g in param_groups:
            g["lr"] *= (step + 1) / n
    try:
        yield
    finally:
        for g, r in zip(param_groups, rates):
            g["lr"] = r


def block_text(mcfg) -> str:
    """The model's block and heads by name, e.g. ``FuXi-alpha block (semantic, position and time channels)``, ``FuXi-beta
    block (position and time channels, no query-key map)``, ``HSTU block + SwiGLU FFN stage (hidden 200) + next-action
    head`` (Zhai et al. 2024; Ye et al. 2025, FuXi-alpha and FuXi-beta), from ``[model] multi_channel`` / ``query_key_map``
    / the relative biases / ``ffn_hidden`` / ``repeat_window`` / ``num_actions``; "" for an architecture without them."""
    chans = [c for c, on in (("semantic", mcfg.query_key_map), ("position", mcfg.use_position_bias), ("time", mcfg.use_time_bias)) if on]
    chans = (", ".join(chans[:-1]) + " and " + chans[-1]) if len(chans) > 1 else "".join(chans)
    if mcfg.architecture != "hstu":
        block = ""
    elif mcfg.multi_channel:
        name = "FuXi-alpha" if mcfg.query_key_map else "FuXi-beta"
        block = f"{name} block ({chans} channel{'s' if ' and ' in chans else ''}{'' if mcfg.query_key_map else ', no query-key map'})"
    else:
        block = "HSTU block" + ("" if mcfg.query_key_map else " without the query-key map (A = SiLU(rab) / n)")
    if block and mcfg.ffn_hidden:
        block += f" + SwiGLU FFN stage (hidden {mcfg.ffn_hidden})"
    heads = [f"repeat head (window {mcfg.repeat_window})" if mcfg.repeat_window else "", "next-action head" if mcfg.num_actions else ""]
    return " + ".join(x for x in (block, *heads) if x)


def model_text(mcfg, parameters: int | None = None) -> str:
    """The model a run trains, for the log's model line, e.g. ``hstu, FuXi-alpha block (semantic, position and time
    channels), 2 blocks x 1 head, d 50, max_seq_len 200, 210,300 parameters`` (:func:`block_text`)."""
    heads = f"{mcfg.num_heads} head{'s' if mcfg.num_heads > 1 else ''}"
    sizes = f"{mcfg.num_blocks} blocks x {heads}, d {mcfg.embedding_dim}, max_seq_len {mcfg.max_seq_len}"
    return ", ".join(x for x in (mcfg.architecture, block_text(mcfg), sizes, f"{parameters:,} parameters" if parameters else "") if x)


# Fields a --resume keeps (another value is refused): what they were when the run's steps were taken. The softmax and the
# in-batch negatives: one run, one loss (metrics.json's recipe states one); the warm-up: a function of the run's step count (and
# with it batch_size); the learning rate: the saved optimizer state carries the rates.
RESUME_KEEPS = {"softmax": "sampled", "in_batch_negatives": 0, "lr_warmup_steps": 0, "learning_rate": None}


def check_recipe(tcfg, repeat_window: int, distributed: bool, saved: dict | None = None, where: str | Path = "config.json") -> None:
    """The recipe's refusals, made before anything is written (``hstu train`` before the data is read, :func:`hstu.train.loop.fit`
    again for Python callers): a ``table_learning_rate`` without ``rowwise_adagrad`` in one process (it was recorded and
    ignored); ``softmax = "full"``, ``negatives_pool`` and ``in_batch_negatives`` with a repeat head
    (``repeat_window`` > 0: the resumed run's) or ``distributed``; with ``saved`` (a resumed run's config.json train table,
    at ``where``) another value of a :data:`RESUME_KEEPS` field than the run's. Raises ValueError naming the field and flag."""
    why = "with a repeat head (repeat_window > 0)" if repeat_window > 0 else "by --distributed yet" if distributed else ""
    if tcfg.softmax == "full" and why:
        raise ValueError(f"[train] softmax = 'full' (--softmax full) is not supported {why}; use 'sampled'")
    for name in ("negatives_pool", "in_batch_negatives"):  # hstu.train.losses.training_loss's own refusals
        if getattr(tcfg, name) and why:
            raise ValueError(f"[train] {name} (--{name.replace('_', '-')}) is not supported {why}; set it to 0")
    was_rate = (saved or {}).get("table_learning_rate")  # a run recorded before this check resumes as it was
    if (
        not distributed
        and tcfg.table_learning_rate > 0
        and tcfg.table_optimizer != "rowwise_adagrad"
        and tcfg.table_learning_rate != was_rate
    ):
        raise ValueError(
            f"[train] table_learning_rate = {tcfg.table_learning_rate:g} needs table_optimizer = 'rowwise_adagrad' "
            f"(with {tcfg.table_optimizer!r} the table trains at learning_rate)"
        )
    for name, missing in RESUME_KEEPS.items() if saved is not None else ():
        now, was = getattr(tcfg, name), saved.get(name, missing)
        if was is not None and now != was:
            raise ValueError(
                f"--resume: [train] {name} is {now!r} here, {was!r} in the run ({where} train.{name}); a resume keeps it: "
                f"drop --{name.replace('_', '-')} / [train] {name}"
            )
    was = (saved or {}).get("batch_size", tcfg.batch_size)
    if tcfg.lr_warmup_steps and tcfg.batch_size != was:  # the warm-up counts the run's steps, batches of its size
        raise ValueError(
            f"--resume: [train] batch_size is {tcfg.batch_size} here, {was} in the run ({where} train.batch_size), whose learning-rate "
            "warm-up counts steps of its batches: drop --batch-size / [train] batch_size"
        )


RESUME_FREE = ("epochs", "num_threads", "early_stopping_patience")  # what a resume may change without a record


def resumed_recipe(saved: dict, tcfg, state: dict, paper: bool) -> tuple:
    """The recipe a ``--resume`` goes on with, and config.json's ``recipe_changes`` (a list, the run's own ones first).

    ``saved``: the run's config.json; ``state``: its committed epoch (``epoch``, ``bad_epochs``). A run with nothing left
    to train keeps its saved recipe (this command's flags would have rewritten config.json and metrics.json's recipe
    for weights they never trained: a trial's finding). A resume that trains with other values than the run's (a flag
    overriding a train setting) warns and appends ``{"from_epoch": E, "changed": {field: [run's, now]}}``: config.json's
    ``train`` table then holds the values from epoch E on. Returns (TrainConfig, list)."""
    from dataclasses import asdict, replace

    from hstu.config import train_config_from_dict

    was, changes = train_config_from_dict(saved["train"], saved=True), list(saved.get("recipe_changes", []))
    old, new = asdict(was), asdict(tcfg)
    changed = {k: [old[k], v] for k, v in new.items() if k not in RESUME_FREE and old.get(k) != v}
    if state["epoch"] >= tcfg.epochs or (not paper and state["bad_epochs"] >= tcfg.early_stopping_patience):
        if changed:
            log.warning("--resume: nothing left to train, the run keeps its recorded recipe (%s not used)", ", ".join(changed))
        return replace(was, **{k: getattr(tcfg, k) for k in RESUME_FREE}), changes  # this command's epochs: none to train
    if changed and state["epoch"]:  # epochs were trained with the run's values
        text = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
        log.warning("--resume: from epoch %d the recipe changes: %s (recorded in config.json recipe_changes)", state["epoch"] + 1, text)
        changes.append({"from_epoch": state["epoch"] + 1, "changed": changed})
    return tcfg, changes


def recorded_changes(run) -> dict:
    """``{"recipe_changes": [...]}`` from ``run``'s config.json when it records any (metrics.json repeats them), else {}
    (also where the run directory is not visible: a torchrun rank other than 0 needs only rank 0 to see it)."""
    from hstu.runs import CONFIG, read_config

    path = Path(run) / CONFIG
    changes = read_config(run).get("recipe_changes") if path.exists() else None
    return {"recipe_changes": changes} if changes else {}
