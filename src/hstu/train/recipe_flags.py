"""``hstu train``'s recipe flags: the TrainConfig fields beyond the model's that a flag overrides
(:data:`RECIPE_FIELDS`, copied onto the TrainConfig by :func:`hstu.train.cli.cmd_train` when given)."""

from __future__ import annotations

from hstu.cli import number_in
from hstu.config import NEGATIVES_MAX

RECIPE_FIELDS = (
    "epochs",
    "seed",
    "batch_size",
    "learning_rate",
    "num_negatives",
    "negatives_chunk",
    "negatives_pool",
    "in_batch_negatives",
    "softmax",
    "length_pool",
    "loss_divisor",
    "packing",
    "lr_decay_patience",
    "lr_decay_factor",
    "lr_warmup_steps",
    "num_threads",
)


def add_recipe_flags(t) -> None:
    """The TrainConfig recipe flags beyond the optimizer's: negatives scheme, length pooling, threads
    (``cmd_train`` copies each one given onto the TrainConfig)."""
    t.add_argument(
        "--negatives-chunk",
        type=number_in(int, 1),
        help="consecutive positions sharing one set of uniform negatives (default 1: per position, as the reference; "
        "TrainConfig.negatives_chunk)",
    )
    t.add_argument(
        "--negatives-pool",
        type=number_in(int, 0),
        help="per-position negatives drawn from one batch pool of K distinct items (0: off; TrainConfig.negatives_pool, hstu.train.losses)",
    )
    t.add_argument(
        "--in-batch-negatives",
        type=number_in(int, 0, NEGATIVES_MAX),
        help="per position, this many negatives more drawn from the batch's targets, logQ-corrected (mixed negative sampling; "
        "0: off, the default; TrainConfig.in_batch_negatives, hstu.train.mixed_negatives)",
    )
    t.add_argument(
        "--softmax",
        choices=["sampled", "full"],
        help="sampled (default): sampled softmax over uniform negatives; full: cross-entropy over every item "
        "(TrainConfig.softmax, hstu.train.full_softmax)",
    )
    t.add_argument(
        "--length-pool",
        type=number_in(int, 1),
        help="batches sorted by length inside pools of this many batches (default 1: random batches, as the reference; "
        "TrainConfig.length_pool)",
    )
    t.add_argument(
        "--loss-divisor",
        choices=["batch", "epoch"],
        help="batch: each batch's mean loss; epoch: its summed loss over the epoch's mean positions per batch (TrainConfig.loss_divisor)",
    )
    t.add_argument(
        "--packing",
        choices=["auto", "off", "pack"],
        help="pack: several users' sequences per row of width max_seq_len, masked per user, no padding cost; auto (default): "
        "pack where the trainer and the attention kernel set support it, else off (TrainConfig.packing)",
    )
    t.add_argument(
        "--lr-decay-patience",
        type=number_in(int, 0),
        help="multiply the learning rates by --lr-decay-factor after this many epochs in a row without a better valid "
        "NDCG@10, and again every that many (default 3; 0: a constant lr; TrainConfig.lr_decay_patience, hstu.train.recipe)",
    )
    t.add_argument(
        "--lr-decay-factor",
        type=number_in(float, 0, 1, lo_open=True, hi_open=True),
        help="the plateau decay's factor, in (0, 1) (default 0.5; TrainConfig.lr_decay_factor)",
    )
    t.add_argument(
        "--lr-warmup-steps",
        type=number_in(int, 0),
        help="raise every learning rate linearly to its value over the first N optimizer steps (default 0: none; "
        "TrainConfig.lr_warmup_steps, hstu.train.recipe.warmed_up; --resume keeps the run's)",
    )
    t.add_argument(
        "--threads", dest="num_threads", type=number_in(int, 0), help="torch threads (0: torch's default; TrainConfig.num_threads)"
    )
    from hstu.config import LOCAL_TABLE_OPTIMIZERS
    from hstu.train.dist_setup import TABLE_OPTIMIZERS

    t.add_argument(
        "--table-optimizer",
        choices=list(dict.fromkeys([*LOCAL_TABLE_OPTIMIZERS, *TABLE_OPTIMIZERS])),
        help="optimizer of the item table. One process: adamw (default; dense state) or rowwise_adagrad (looked-up rows only; "
        "[train] table_optimizer); --distributed: FBGEMM's fused sgd, adagrad, rowwise_adagrad (default), adam, "
        "partial_rowwise_adam (CPU: the first three). With --resume: the run's",
    )
    t.add_argument(
        "--table-learning-rate",
        type=number_in(float, 0, lo_open=True),
        help="its learning rate. One process, rowwise_adagrad: default 0.1 ([train] table_learning_rate; adamw trains the table "
        "at --learning-rate); --distributed: 1.0 (sgd), 0.1 (adagrad types), --learning-rate (adam types). With --resume: the run's",
    )
