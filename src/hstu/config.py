"""Typed configuration: ModelConfig, TrainConfig, DecodeOptions / GenerateConfig, ServeConfig. Loaded from TOML or JSON
(or a run's config.json); unknown keys are rejected with a ValueError naming the field. Defaults follow the HSTU ML-1M
recipe (Zhai et al. 2024, §4.1; reference repository's ML-1M configuration) unless a comment says otherwise."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


ARCHITECTURES, ATTENTION_NORMS = ("hstu", "sasrec"), ("fixed", "causal")  # [model] architecture: hstu.model.build_hstu
ATTENTION_KERNELS = ("auto", "reference", "triton", "npu")  # [model] attention: kernel sets (hstu.model.kernels)
ITEM_TABLES = ("dense", "hashed")  # [model] item_table: nn.Embedding | model.embedding.ShardedEmbedding
TABLE_PLACEMENTS = ("device", "host")  # where a hashed table's shard lives (model/embedding.py)
TABLE_DTYPES = ("fp32", "fp16", "bf16")  # a hashed table's row storage dtype
INT64_MAX = 2**63 - 1  # item ids of a history event (CLI files and HTTP alike)
TIME_S_MAX = INT64_MAX // 10**9  # request times: Unix seconds up to 2262-04-11, the loaders' end (ms are refused)
MAX_WIDTH, MAX_BLOCKS = 65_536, 1024  # max_seq_len + max_output_len (position table, attention width N); num_blocks

_BLOCK = {"query_key_map": True, "ffn_hidden": 0, "multi_channel": False}  # HSTU block options and their defaults


@dataclass
class ModelConfig:
    """HSTU encoder sizes (DESIGN.md "The model"; Zhai et al. 2024, §3).

    The fixed width N = max_seq_len + max_output_len is both the positional table size and
    the attention divisor n (``attention_norm="fixed"``), so padding to any width <= N never
    changes a live output; ``"causal"`` divides row i by the i + 1 keys it attends instead.
    """

    architecture: str = "hstu"  # "hstu" | "sasrec" (baseline, Kang & McAuley 2018)
    num_items: int = 0  # set from the data: dense ids 1..num_items, 0 is padding
    max_seq_len: int = 200  # history events kept (most recent)
    max_output_len: int = 10  # extra positions for generated tokens (next-k, k <= this)
    embedding_dim: int = 50  # d
    num_blocks: int = 2
    num_heads: int = 1  # H
    d_qk: int = 50  # per-head query/key width
    d_v: int = 50  # per-head value width
    dropout: float = 0.2  # input-embedding and pre-output-projection dropout (recipe: 0.2)
    num_time_buckets: int = 128  # log time buckets 0..128 (reference: 128 + 1 weights)
    time_bucket_log_base: float = 0.301  # bucket(dt) = floor(ln(max(|dt|, 1)) / 0.301)
    use_time_bias: bool = True  # ablation switches (issue: relative bias off, time bias off)
    use_position_bias: bool = True
    # attention divisor n (eq. 2): "fixed" = the model width N for every row (the reference); "causal" = i + 1, an ablation (issue 3)
    attention_norm: str = "fixed"
    query_key_map: bool = True  # False: no Q Kᵀ (FuXi-beta): A = SiLU(rab) / n; with multi_channel, no semantic channel
    ffn_hidden: int = 0  # > 0: FuXi-alpha's SwiGLU FFN stage (§4.3) of this width after each block (hstu.model.hstu.SwiGLUFFN)
    multi_channel: bool = False  # True: FuXi-alpha's multi-channel attention (§4.2), rab as channels (hstu.model.meta.multi_channel)
    # attention kernel set (hstu.model.kernels) for every path: "auto" = the device's default where it can run ("triton" on CUDA,
    # "npu" on NPU, else "reference"); a named set that cannot run on the device is an error; runs saved without it load as "auto".
    attention: str = "auto"
    layer_norm_eps: float = 1e-6
    temperature: float = 0.05  # cosine-similarity temperature (recipe: 0.05)
    num_actions: int = 0  # >0: action-type embedding summed into the input + next-action head
    num_categories: int = 0  # >0: category embedding summed into the input
    # side features (hstu.data.features), set from the data: name -> number of values (ids 1..n, 0 = unknown);
    # one embedding table each, summed into the input as the category's; the order is the token columns' 1..F
    features: dict[str, int] = field(default_factory=dict)
    repeat_window: int = 0  # >0: repeat-aware scoring over the last R events (hstu.model.repeat); 0 = off
    # >0: items never seen in training enter the input without their item embedding (a "cold" input: action, category,
    # position and time only), and in training each input event loses its item embedding with this probability (base.embed)
    cold_item_dropout: float = 0.0
    # The item table (issue 18): "dense" = one nn.Embedding; "hashed" = model.embedding.ShardedEmbedding: rows hash-sharded
    # over item_table_shards shards, each on the compute "device" or in "host" memory (one value, or a comma list with one per
    # shard), stored as item_table_dtype, with item_table_cache_bytes of device-side hot-row cache shared by the host shards.
    # Same results for any shard count; the memory plan is checked before the table is allocated.
    item_table: str = "dense"
    item_table_shards: int = 1
    item_table_placement: str = "device"
    item_table_dtype: str = "fp32"
    item_table_cache_bytes: int = 0

    @property
    def width(self) -> int:
        """N: the fixed padded width and attention divisor n."""
        return self.max_seq_len + self.max_output_len

    def validate(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ModelConfig.architecture must be {' or '.join(map(repr, ARCHITECTURES))}, got {self.architecture!r}")
        for name in ("max_seq_len", "embedding_dim", "num_blocks", "num_heads", "d_qk", "d_v", "num_time_buckets"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_output_len < 1:
            raise ValueError(f"ModelConfig.max_output_len must be >= 1, got {self.max_output_len}")
        if self.num_blocks > MAX_BLOCKS:
            raise ValueError(f"ModelConfig.num_blocks must be <= {MAX_BLOCKS}, got {self.num_blocks}")
        if self.width > MAX_WIDTH:
            raise ValueError(f"ModelConfig.max_seq_len + max_output_len must be <= {MAX_WIDTH}, got {self.width}")
        for name in ("num_items", "num_actions", "num_categories", "ffn_hidden"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelConfig.{name} must be >= 0, got {getattr(self, name)}")
        feats = self.features if isinstance(self.features, dict) else {None: None}
        bad = [k for k, v in feats.items() if not isinstance(k, str) or not k or isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise ValueError(f"ModelConfig.features must map feature names to value counts >= 0, got {self.features!r}")
        for name in ("time_bucket_log_base", "layer_norm_eps"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"ModelConfig.{name} must be a finite number > 0, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"ModelConfig.temperature must be a finite number > 0, got {self.temperature}")
        if not 0.0 <= self.cold_item_dropout < 1.0:
            raise ValueError(f"ModelConfig.cold_item_dropout must be in [0, 1), got {self.cold_item_dropout}")
        if self.attention_norm not in ATTENTION_NORMS:
            raise ValueError(f"ModelConfig.attention_norm must be one of {ATTENTION_NORMS}, got {self.attention_norm!r}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"ModelConfig.attention ([model] attention) must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        if not self.query_key_map and not (self.use_position_bias or self.use_time_bias):  # attention from the bias alone
            raise ValueError("ModelConfig.query_key_map = false needs use_position_bias or use_time_bias (else no token attends another)")
        if self.multi_channel and not (self.use_position_bias or self.use_time_bias):  # its channels are the biases
            raise ValueError("ModelConfig.multi_channel = true needs use_position_bias or use_time_bias")
        set_ = [f"{k} = {json.dumps(getattr(self, k))}" for k in _BLOCK if getattr(self, k) != _BLOCK[k]]
        if self.architecture != "hstu" and set_:
            raise ValueError(f"ModelConfig.{', '.join(set_)}: HSTU block options; architecture {self.architecture!r} has none of them")
        if not 0 <= self.repeat_window <= self.max_seq_len:
            raise ValueError(f"ModelConfig.repeat_window must be in 0..max_seq_len={self.max_seq_len}, got {self.repeat_window}")
        self._validate_item_table()

    def table_placements(self) -> list[str]:
        """``item_table_placement`` as one placement per shard (item_table_shards values)."""
        places = [p.strip() for p in self.item_table_placement.split(",")]
        return places * self.item_table_shards if len(places) == 1 else places

    def _validate_item_table(self) -> None:
        """ValueError naming the item_table field that is out of range (see the fields' comment)."""
        if self.item_table not in ITEM_TABLES:
            raise ValueError(f"ModelConfig.item_table must be one of {ITEM_TABLES}, got {self.item_table!r}")
        if self.item_table_shards < 1:
            raise ValueError(f"ModelConfig.item_table_shards must be >= 1, got {self.item_table_shards}")
        places = [p.strip() for p in self.item_table_placement.split(",")]
        if len(places) not in (1, self.item_table_shards) or any(p not in TABLE_PLACEMENTS for p in places):
            raise ValueError(
                f"ModelConfig.item_table_placement must be one of {TABLE_PLACEMENTS} or a comma list of "
                f"item_table_shards={self.item_table_shards} of them, got {self.item_table_placement!r}"
            )
        if self.item_table_dtype not in TABLE_DTYPES:
            raise ValueError(f"ModelConfig.item_table_dtype must be one of {TABLE_DTYPES}, got {self.item_table_dtype!r}")
        if self.item_table_cache_bytes < 0:
            raise ValueError(f"ModelConfig.item_table_cache_bytes must be >= 0, got {self.item_table_cache_bytes}")
        if self.item_table == "dense":
            defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("item_table_")}
            changed = sorted(k for k, v in defaults.items() if getattr(self, k) != v)
            if changed:
                raise ValueError(f"ModelConfig.{changed[0]} applies to item_table = 'hashed' only (item_table is 'dense')")


PRESETS: dict[str, dict[str, Any]] = {
    # Zhai et al. 2024, ML-1M: HSTU 2 blocks, 1 head, d = 50; HSTU-large 8 blocks, 2 heads; issue 20: FuXi-alpha's block.
    "small": dict(num_blocks=2, num_heads=1, embedding_dim=50, d_qk=50, d_v=50, max_seq_len=200, multi_channel=True),
    "large": dict(num_blocks=8, num_heads=2, embedding_dim=50, d_qk=25, d_v=25, max_seq_len=200, multi_channel=True),
    # ML-20M recipe size, used by the quantization benchmark as the "production-size" model.
    "prod": dict(num_blocks=4, num_heads=4, embedding_dim=256, d_qk=64, d_v=64, max_seq_len=200),
}


LOCAL_TABLE_OPTIMIZERS = ("adamw", "rowwise_adagrad")  # TrainConfig.table_optimizer (hstu.train.sparse_optim)
NEGATIVES_MAX = 8192  # TrainConfig.num_negatives, in_batch_negatives: per position (the reference 128; 512 measured, issue 20)


@dataclass
class TrainConfig:
    """Training recipe (HSTU ML-1M: AdamW lr 1e-3, betas (0.9, 0.98), no weight decay, batch 128, 128 uniform negatives)."""

    epochs: int = 10
    batch_size: int = 128
    learning_rate: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.98
    weight_decay: float = 0.0
    num_negatives: int = 128
    negatives_chunk: int = 1  # runs of this many consecutive positions share their negatives (1: per position, the reference's)
    # > 0: per-position negatives from one pool of this many distinct items per batch, one (positions x pool) GEMM (train/losses.py).
    negatives_pool: int = 0
    # > 0: per position, this many negatives more, each the target of a batch position (mixed negative sampling, logQ-corrected
    # to the uniform sampler's objective; train/mixed_negatives.py); not with negatives_pool.
    in_batch_negatives: int = 0
    # "sampled": the sampled softmax above (Zhai et al. 2024 §4.1.1); "full": cross-entropy over every item
    # (train/full_softmax.py; num_negatives and negatives_chunk unused, warned; negatives_pool, in_batch_negatives refused).
    softmax: str = "sampled"
    # Batches sorted by length within pools of this many batches, or 1 = random batches as in the reference (the default).
    length_pool: int = 1
    # A batch's summed loss over: "batch" = its positions P_b (the mean); "epoch" = the epoch's mean P_b (train/loop.py loss_weights).
    loss_divisor: str = "batch"
    # "pack": sequences packed into rows of width max_seq_len (data/batching.py), same-user attention, the padded batch's loss;
    # "off": one sequence a row; "auto": "pack" where the trainer and kernel set can (train/losses.py resolve_packing, recorded).
    packing: str = "auto"
    action_loss_weight: float = 0.5  # weight of the next-action cross-entropy (if num_actions > 0)
    seed: int = 42
    eval_batch_size: int = 256
    early_stopping_patience: int = 5  # epochs without a better valid NDCG@10
    lr_decay_patience: int = 3  # plateau decay (train/recipe.py): lr x lr_decay_factor at each N-th validation not better; 0: off
    lr_decay_factor: float = 0.5
    lr_warmup_steps: int = 0  # > 0: every learning rate rises linearly to its value over the first N steps (train/recipe.py)
    eval_every: int = 1
    num_threads: int = 0  # 0: torch default
    # The item table's optimizer in one process (train/sparse_optim.py): "adamw" (the recipe's) or "rowwise_adagrad" (looked-up
    # rows, one float32 state per row: tables whose AdamW moments do not fit), at table_learning_rate (0: 0.1).
    table_optimizer: str = "adamw"
    table_learning_rate: float = 0.0

    def validate(self) -> None:
        for name in ("epochs", "batch_size", "num_negatives", "eval_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("negatives_pool", "in_batch_negatives", "lr_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("num_negatives", "in_batch_negatives"):  # a batch holds positions x negatives ids, logits and gradients
            if getattr(self, name) > NEGATIVES_MAX:
                raise ValueError(f"TrainConfig.{name} must be <= {NEGATIVES_MAX} (negatives per position), got {getattr(self, name)}")
        if self.softmax not in ("sampled", "full"):
            raise ValueError(f"TrainConfig.softmax ([train] softmax) must be 'sampled' or 'full', got {self.softmax!r}")
        for name in ("negatives_pool", "in_batch_negatives"):
            if self.softmax == "full" and getattr(self, name):
                raise ValueError(f"TrainConfig.{name} is a sampled-softmax option (--{name.replace('_', '-')}): 0 with softmax 'full'")
        if self.negatives_pool and self.in_batch_negatives:
            raise ValueError("TrainConfig.in_batch_negatives, negatives_pool: set one to 0 (--in-batch-negatives, --negatives-pool)")
        if self.packing not in ("auto", "off", "pack"):
            raise ValueError(f"TrainConfig.packing ([train] packing) must be 'auto', 'off' or 'pack', got {self.packing!r}")
        if self.loss_divisor not in ("batch", "epoch"):
            raise ValueError(f"TrainConfig.loss_divisor must be 'batch' or 'epoch', got {self.loss_divisor!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"TrainConfig.learning_rate must be a finite number > 0, got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("weight_decay", "action_loss_weight", "num_threads"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"TrainConfig.{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.lr_decay_patience < 0:
            raise ValueError(f"TrainConfig.lr_decay_patience must be >= 0 (0: a constant learning rate), got {self.lr_decay_patience}")
        if not (math.isfinite(self.lr_decay_factor) and 0 < self.lr_decay_factor < 1):
            raise ValueError(f"TrainConfig.lr_decay_factor must be in (0, 1), got {self.lr_decay_factor}")
        for name in ("length_pool", "negatives_chunk", "early_stopping_patience", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed <= SEED_MAX:  # numpy's generators take 0..2**32 - 1
            raise ValueError(f"TrainConfig.seed ([train] seed, --seed) must be in 0..{SEED_MAX}, got {self.seed}")
        if self.table_optimizer not in LOCAL_TABLE_OPTIMIZERS:
            raise ValueError(f"TrainConfig.table_optimizer: one of {', '.join(LOCAL_TABLE_OPTIMIZERS)}; got {self.table_optimizer!r}")
        if not (math.isfinite(self.table_learning_rate) and self.table_learning_rate >= 0):
            raise ValueError(f"TrainConfig.table_learning_rate must be a finite number >= 0, got {self.table_learning_rate}")


# Decoding ranges, shared by `hstu generate` and the HTTP schema (hstu.serve.schemas.Decoding).
TOP_K_MAX = 100_000
TEMPERATURE_MAX = 100.0  # sampling temperature: in (0, TEMPERATURE_MAX]
BEAM_WIDTH_MAX = 16  # a request's beams run as rows of one batch (serve: also <= max_batch)
SEED_MAX = 2**32 - 1


def check_k(k: int, max_output_len: int, name: str = "k") -> None:
    """ValueError unless 1 <= k <= max_output_len; the one message of the CLI and the HTTP service."""
    if not 1 <= k <= max_output_len:
        raise ValueError(f"{name}: must be in 1..{max_output_len} (the model's max_output_len), got {k}")


@dataclass
class DecodeOptions:
    """How next-k items are chosen (:mod:`hstu.generate.sampler`): the one decoding-options type
    of ``hstu generate``, the Python API (``Recommender.recommend(decoding=...)``) and the HTTP
    service (``hstu.serve.schemas.Decoding`` maps onto it, with the same ranges).

    strategy: "greedy" | "topk" (seeded sampling among the ``top_k`` best at softmax
    ``temperature``) | "beam" (``beam_width`` beams, sum of log-probabilities). top_k in
    1..TOP_K_MAX; temperature in (0, TEMPERATURE_MAX], the sampling temperature (not the model's
    similarity temperature); beam_width in 1..BEAM_WIDTH_MAX; seed in 0..SEED_MAX. Fields other
    than the strategy's are carried and ignored. Raises ValueError naming the field (at construction)."""

    strategy: str = "greedy"  # greedy | topk | beam
    top_k: int = 50
    temperature: float = 1.0
    beam_width: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.strategy not in ("greedy", "topk", "beam"):
            raise ValueError(f"{type(self).__name__}.strategy must be greedy, topk or beam, got {self.strategy!r}")
        for name, hi in (("top_k", TOP_K_MAX), ("beam_width", BEAM_WIDTH_MAX), ("seed", SEED_MAX)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not (0 if name == "seed" else 1) <= v <= hi:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer in {0 if name == 'seed' else 1}..{hi}, got {v!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and 0 < t <= TEMPERATURE_MAX):
            raise ValueError(f"{type(self).__name__}.temperature must be a number in (0, {TEMPERATURE_MAX}], got {t!r}")

    def options(self) -> "DecodeOptions":
        """The decoding fields alone (a GenerateConfig without k and exclude_history)."""
        return DecodeOptions(self.strategy, self.top_k, self.temperature, self.beam_width, self.seed)


@dataclass
class GenerateConfig(DecodeOptions):
    """The [generate] table: :class:`DecodeOptions` plus k (items, >= 1; <= the model's max_output_len, checked against the
    run by :func:`check_k`) and exclude_history (None: the data set's default)."""

    k: int = 5
    exclude_history: bool | None = None  # None: the data set's default

    def validate(self) -> None:
        super().validate()
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"GenerateConfig.k must be an integer >= 1, got {self.k!r}")


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16
    max_wait_ms: float = 5.0
    buckets: list[int] = field(default_factory=lambda: [20, 50, 100, 200])
    max_queue: int = 256
    request_timeout_s: float = 10.0
    memory_threshold: float = 0.10
    body_timeout_s: float = 5.0  # slow clients (s): the body within this of its headers,
    header_timeout_s: float = 5.0  # the headers within this of connect / the last reply
    # engine graphs (docs/configuration.md [serve]): "auto" (device graphs, or the run's graph cache, else eager), "eager", "compiled"
    graphs: str = "auto"
    ann: str = ""  # approximate candidates (hstu.model.ann): a faiss index_factory string ("" = exact), cells probed, rows rescored
    ann_nprobe: int = 16
    ann_candidates: int = 256
    prefix_cache_mb: float = 0.0  # the engine's user-prefix cache per model process, keyed by a request's user_id (0 = off)

    def validate(self) -> None:
        if self.graphs not in ("auto", "eager", "compiled"):
            raise ValueError(f"ServeConfig.graphs must be auto, eager or compiled, got {self.graphs!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServeConfig.port must be in 0..65535, got {self.port}")
        for name in ("max_batch", "max_queue", "ann_nprobe", "ann_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_wait_ms", "prefix_cache_mb"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"ServeConfig.{name} must be finite and >= 0, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"ServeConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")
        for name in ("body_timeout_s", "header_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"ServeConfig.{name} must be a finite number of seconds > 0, got {getattr(self, name)}")
        if not 0.0 <= self.memory_threshold <= 1.0:
            raise ValueError(f"ServeConfig.memory_threshold must be in [0, 1], got {self.memory_threshold}")
        if not self.buckets or any(e < 1 for e in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"ServeConfig.buckets must be distinct, ascending and >= 1, got {self.buckets}")


# Moved (issue 18) to hstu.data.prepare / hstu.runs, still importable from here (PEP 562: both sit above config).
_MOVED = {"DataSpec": "hstu.data.prepare", "PROTOCOLS": "hstu.data.prepare", "RUN_FILES": "hstu.runs"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_TYPE_CHECKS = {  # a field's annotation (a string under `from __future__ import annotations`) -> accepted values
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "str | list[str]": lambda v: isinstance(v, str) or (isinstance(v, list) and bool(v) and all(isinstance(x, str) and x for x in v)),
    "bool": lambda v: isinstance(v, bool),
    "bool | None": lambda v: v is None or isinstance(v, bool),
    "int | None": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    "dict": lambda v: isinstance(v, dict),
    "list[int]": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
}


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """``cls(**data)`` with every field's type and the class's ``validate()`` checked; ValueError
    names ``where`` (a file and table, a preset) and the field."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(data) - set(fields)):
        raise ValueError(f"{where}: unknown field(s) {unknown} for {cls.__name__}; valid: {sorted(fields)}")
    for name, value in data.items():
        check = _TYPE_CHECKS.get(str(fields[name].type))
        if check is not None and not check(value):
            raise ValueError(f"{where}: {name} must be {fields[name].type}, got {value!r}")
    try:
        obj = cls(**data)  # DecodeOptions / GenerateConfig validate on construction; the others now
        getattr(obj, "validate", lambda: None)()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return obj


_TABLES = {"model": ModelConfig, "train": TrainConfig, "generate": GenerateConfig, "serve": ServeConfig, "data": None}
# [data]: hstu.data.prepare.DataSpec (resolved when read); these keys are its loader options (DataSpec.options)
DATA_OPTIONS = ("columns", "format", "time_unit", "meta", "features", "numeric_features")


def data_spec_from_table(table: dict[str, Any], where: str, base: Path | None = None) -> Any:
    """A ``[data]`` table -> :class:`hstu.data.prepare.DataSpec`: its fields (``data_dir``, ``items`` relative to ``base``,
    the config file's directory) and the loader options :data:`DATA_OPTIONS`. ValueError names ``where`` and the field."""
    from hstu.data.prepare import DataSpec, check_loader_options

    valid = {f.name for f in dataclasses.fields(DataSpec)} - {"feature_maps"} | set(DATA_OPTIONS)  # feature_maps: the run's own
    if set(table) - valid:
        raise ValueError(f"{where}: unknown field(s) {sorted(set(table) - valid)} for [data]; valid: {sorted(valid)}")
    rest = {k: v for k, v in table.items() if k not in DATA_OPTIONS}
    opts = {k: table[k] for k in DATA_OPTIONS if k in table}
    check_loader_options(opts, where)
    if opts:
        if not isinstance(rest.get("options", {}), dict):
            raise ValueError(f"{where}: options must be a table, got {rest['options']!r}")
        if k := next((k for k in opts if rest.get("options", {}).get(k, opts[k]) != opts[k]), None):  # one silently won
            raise ValueError(f"{where}: {k} is given twice, {opts[k]!r} and options.{k} = {rest['options'][k]!r}")
        rest["options"] = {**rest.get("options", {}), **opts}
    rest.update({k: _beside(base, rest[k]) for k in ("data_dir", "items") if base is not None and k in rest})  # paths, or a list
    return _from_dict(DataSpec, rest, where)


def _beside(base: Path, v: Any) -> Any:  # a config file's path (or a list's), relative to its directory
    if isinstance(v, list):
        return [_beside(base, x) for x in v]
    return str(base / v) if isinstance(v, str) and v and not Path(v).is_absolute() else v


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON file with optional [model], [train], [generate], [serve], [data] tables: a dict of the
    dataclasses present. Raises ValueError (unknown table or field) or FileNotFoundError."""
    raw = load_config_tables(path := Path(path))
    return {
        k: data_spec_from_table(v, f"{path} [{k}]", path.parent) if k == "data" else _from_dict(_TABLES[k], v, f"{path} [{k}]")
        for k, v in raw.items()
    }


def load_config_tables(path: str | Path) -> dict[str, dict[str, Any]]:
    """The raw tables of a config file ({table: {field: value}}, only the fields it sets), checked
    for shape: a known table name, and a table (not a value). Raises ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: {'is a directory, not a config file' if path.is_dir() else 'no such file'}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark (Windows editors) is not a parse error
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: cannot parse config: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected tables such as [model] and [train], got {type(raw).__name__}")
    if "hstu_version" in raw and isinstance(raw.get("model"), dict):  # a run's config.json: its records are no settings
        from hstu.model.run_files import config_as_settings

        raw = config_as_settings(raw, path)
    if unknown := sorted(set(raw) - set(_TABLES)):
        raise ValueError(f"{path}: unknown table(s) {unknown}; valid: {sorted(_TABLES)}")
    if bad := next((k for k, v in raw.items() if not isinstance(v, dict)), None):
        raise ValueError(f"{path} [{bad}]: must be a table of fields, got {raw[bad]!r}")
    return raw


def model_config_from_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset's values, ``overrides`` over them; its ``multi_channel`` is dropped where ``overrides`` choose what it
    cannot go with (SASRec, no relative bias, the HSTU block). ValueError names a field."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    merged = {**PRESETS[name], **overrides}
    m = {**dataclasses.asdict(ModelConfig()), **merged}  # every field: the defaults where neither sets it
    fits = m["architecture"] == "hstu" and (m["use_position_bias"] or m["use_time_bias"])
    if "multi_channel" not in overrides and not fits:
        merged.pop("multi_channel", None)
    return _from_dict(ModelConfig, merged, f"preset {name}")


to_dict = dataclasses.asdict  # a config dataclass -> its dict of fields


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    return _from_dict(ModelConfig, data, "model config")


# Recipe defaults that changed (issue 20) and their old values: a run's saved config.json without one was trained with these.
LEGACY_TRAIN_DEFAULTS: dict[str, Any] = {"negatives_chunk": 16, "length_pool": 50, "packing": "off", "lr_decay_patience": 0}


def train_config_from_dict(data: dict[str, Any], *, saved: bool = False) -> TrainConfig:
    """A TrainConfig from ``data`` (a ``[train]`` table, or with ``saved`` a run's config.json ``train``
    table, whose missing fields of :data:`LEGACY_TRAIN_DEFAULTS` take those old values, not today's
    defaults: an older run resumes with its own recipe). ValueError names the field."""
    return _from_dict(TrainConfig, {**LEGACY_TRAIN_DEFAULTS, **data} if saved else data, "train config")
