"""The item table as a TorchRec ``EmbeddingCollection``, sharded across processes (extra ``hstu[dist]``).

One table (``item``, feature ``item_id``) of V x d rows, sharded by TorchRec over a process group
(gloo on CPU, nccl on CUDA) in one of three layouts (TorchRec docs, "Sharding" /
``torchrec.distributed.sharding_plan``):

    row_wise      rows split into contiguous blocks, one per rank
    column_wise   columns split into equal blocks, one per rank (d divisible by the world size)
    table_wise    the whole table on one rank (``rank``, default 0)

Lookups are sequence lookups (``EmbeddingCollection``: one row per id, no pooling), so all three
layouts work on CPU with gloo (only the *bag* collections lack row-wise on CPU).

Compute kernel: ``fused`` (FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``, optimizer fused into
the backward). The ``dense`` kernel is not used: with fbgemm-gpu-cpu 1.8.0 its CPU lookup
(``dense_embedding_codegen_lookup_function`` with ``PoolingMode.NONE``) sums each bag into one row
instead of returning one row per id, and TorchRec's output dist then corrupts the heap
("malloc(): unaligned tcache chunk detected"); checked with torch 2.13.0 CPU + torchrec 1.8.0.

Known-good versions on CPU (install with ``--no-deps``: torchrec's own requirement ``fbgemm-gpu``
is the CUDA build)::

    pip install --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0
    pip install tensordict pyre-extensions torchmetrics==1.0.3   # torchrec's pure-Python deps

Symbols: V rows, d width, n ids looked up on this rank, W world size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SHARDING_TYPES = ("row_wise", "column_wise", "table_wise")
TABLE = "item"
FEATURE = "item_id"
INSTALL_HINT = (
    "TorchRec is not installed: pip install 'hstu[dist]' && pip install --no-deps "
    "fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0 (CPU; on CUDA use the fbgemm-gpu wheel matching your torch)"
)


def torchrec_available() -> str | None:
    """None when torchrec and fbgemm_gpu import, else the reason (with the install command)."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
        from torchrec.distributed.embedding import EmbeddingCollectionSharder  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:
        return f"{INSTALL_HINT} ({type(exc).__name__}: {exc})"
    return None


def require_torchrec() -> None:
    """Raise ImportError with the install command when TorchRec cannot be used."""
    why = torchrec_available()
    if why is not None:
        raise ImportError(why)


def build_item_collection(
    num_embeddings: int,
    embedding_dim: int,
    *,
    table: str = TABLE,
    feature: str = FEATURE,
    device: str | torch.device = "meta",
) -> Any:
    """An unsharded ``torchrec.EmbeddingCollection`` with one fp32 table ``table`` of V x d rows.

    ``device="meta"`` (default) allocates nothing: the sharded module allocates only its local
    shards, filled afterwards with :func:`load_rows`.

    Raises:
        ImportError: TorchRec is missing (message gives the install command).
        ValueError: V or d < 1.
    """
    require_torchrec()
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    if num_embeddings < 1 or embedding_dim < 1:
        raise ValueError(f"num_embeddings and embedding_dim must be >= 1, got {num_embeddings}, {embedding_dim}")
    cfg = EmbeddingConfig(num_embeddings=int(num_embeddings), embedding_dim=int(embedding_dim), name=table, feature_names=[feature])
    return EmbeddingCollection(tables=[cfg], device=torch.device(device))


def shard_item_collection(
    collection: Any,
    *,
    sharding: str = "row_wise",
    pg: dist.ProcessGroup | None = None,
    device: str | torch.device = "cpu",
    table: str = TABLE,
    rank: int = 0,
    fused_params: dict[str, Any] | None = None,
) -> Any:
    """Shard ``collection``'s ``table`` over the process group ``pg`` (default: WORLD).

    Args:
        sharding: "row_wise", "column_wise" (d divisible by W) or "table_wise" (on ``rank``).
        device: this rank's compute device ("cpu" with gloo; "cuda:LOCAL_RANK" with nccl).
        fused_params: FBGEMM optimizer settings for the fused kernel, e.g.
            ``{"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}`` (torchrec ``EmbeddingCollectionSharder``).
    Returns:
        ``ShardedEmbeddingCollection``; collective: every rank must call it with the same arguments.
    Raises:
        ValueError: unknown sharding type, or d not divisible by W for column_wise.
        RuntimeError: torch.distributed is not initialised.
    """
    require_torchrec()
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first (or run under torchrun)")
    pg = pg if pg is not None else dist.group.WORLD
    world = dist.get_world_size(pg)
    kernel = "fused"
    if sharding == "row_wise":
        gen = row_wise(compute_kernel=kernel)
    elif sharding == "column_wise":
        d = collection.embedding_configs()[0].embedding_dim
        if d % world:
            raise ValueError(f"column_wise sharding needs embedding_dim ({d}) divisible by the world size ({world})")
        gen = column_wise(ranks=list(range(world)), compute_kernel=kernel)
    elif sharding == "table_wise":
        gen = table_wise(rank=rank, compute_kernel=kernel)
    else:
        raise ValueError(f"unknown sharding {sharding!r}; valid: {', '.join(SHARDING_TYPES)}")
    dev = torch.device(device)
    sharder = EmbeddingCollectionSharder(fused_params=fused_params)
    plan = construct_module_sharding_plan(
        collection, {table: gen}, local_size=world, world_size=world, device_type=dev.type, sharder=sharder
    )
    log.info("sharding item table %s over %d ranks", sharding, world)
    return shard(collection, plan, env=ShardingEnv.from_process_group(pg), device=dev, sharder=sharder)


def local_shards(sharded: Any, table: str = TABLE) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """This rank's pieces of ``table``: ((row offset, column offset), (rows, cols) tensor) pairs.

    The tensors are views of the module's weights: writing to them changes the table.
    """
    weight = sharded.state_dict()[f"embeddings.{table}.weight"]
    out = []
    for sh in weight.local_shards():
        r0, c0 = sh.metadata.shard_offsets
        out.append(((int(r0), int(c0)), sh.tensor))
    return out


@torch.no_grad()
def load_rows(
    sharded: Any, rows: Callable[[int, int], torch.Tensor] | torch.Tensor, *, table: str = TABLE, chunk_rows: int = 1 << 16
) -> None:
    """Fill this rank's shards of ``table`` from a dense source, ``chunk_rows`` rows at a time.

    Args:
        rows: a (V, d) tensor, or ``rows(start, end) -> (end - start, d)`` (e.g. ``ShardedEmbedding.rows``),
            so that a large table is never materialised whole.
    """
    for (r0, c0), piece in local_shards(sharded, table):
        n, w = piece.shape
        for a in range(0, n, chunk_rows):
            b = min(a + chunk_rows, n)
            block = rows[r0 + a : r0 + b] if isinstance(rows, torch.Tensor) else rows(r0 + a, r0 + b)
            piece[a:b].copy_(block[:, c0 : c0 + w])


def lookup(sharded: Any, ids: torch.Tensor, *, feature: str = FEATURE) -> torch.Tensor:
    """Rows for this rank's ``ids`` (n,) int64 in [0, V) -> (n, d), in input order.

    Collective: every rank calls it (with its own ids; n may differ between ranks). Ids outside
    [0, V) are not checked here (FBGEMM does not bound-check on CPU): map them first, e.g. with
    :func:`hstu.model.embedding.to_global_rows` and a table that includes the overflow rows.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids = ids.reshape(-1).to(torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[feature], values=ids, lengths=torch.tensor([ids.numel()], dtype=torch.int64))
    out = sharded(kjt)
    if hasattr(out, "wait"):
        out = out.wait()
    return out[feature].values()


__all__ = [
    "SHARDING_TYPES",
    "INSTALL_HINT",
    "torchrec_available",
    "require_torchrec",
    "build_item_collection",
    "shard_item_collection",
    "local_shards",
    "load_rows",
    "lookup",
]
