"""FP16 / BF16 inference: the HSTU blocks and embeddings in a 16-bit float, similarity in float32.

Every parameter except the next-action head is cast to ``dtype`` (bf16 or fp16): embeddings
(a hashed item table's shards too, placement kept), UVQK and output projections, relative-bias
tables. Activations inside the encoder, and hence the KV cache (``KVCache.for_model`` follows
``pos_emb``'s dtype), are in ``dtype``; layer norm and SiLU run in ``dtype`` with PyTorch's float32 internal accumulation ("opmath") for
reductions. The outputs the callers compare — user vectors from ``encode`` / ``step`` and item
vectors from ``item_vectors`` / ``score_items`` — are widened to float32 and L2-normalised in
float32, so similarity and ranking run in float32 (a bf16 score has 8 significant bits: at
|score| ~ 16 its step is 0.125, enough to tie many items under the pessimistic-rank protocol).

This is done by switching the instance's class to :class:`LowPrecisionHSTUModel` (a subclass of
HSTUModel that only widens those outputs), so ``isinstance(model, HSTUModel)`` still holds and
no copy of the weights is made.

On CPUs without native bf16/fp16 matrix instructions (e.g. AVX2-only x86) the 16-bit GEMMs are
emulated and slower than float32; the benefit there is memory. See the benchmark for numbers.
"""

from __future__ import annotations

import logging

import torch

from hstu.model.embedding import ShardedEmbedding
from hstu.model.hstu import HSTUModel, l2_normalize

log = logging.getLogger(__name__)

LOWP = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LowPrecisionHSTUModel(HSTUModel):
    """HSTUModel whose encoder runs in a 16-bit float and whose outputs are float32 (see module)."""

    def encode(self, ids, timestamps, lengths, *, actions=None, categories=None, kv_cache=None, normalize=True):
        """As :meth:`HSTUModel.encode`; returns (B, W, d) float32 (normalised in float32)."""
        x = (
            super()
            .encode(ids, timestamps, lengths, actions=actions, categories=categories, kv_cache=kv_cache, normalize=False)
            .to(torch.float32)
        )  # (B, W, d)
        return l2_normalize(x) if normalize else x

    def step(self, ids, pos, timestamps, t_query, kv_cache, *, actions=None, categories=None):
        """As :meth:`HSTUModel.step`; returns (B, d) float32, re-normalised in float32."""
        return l2_normalize(super().step(ids, pos, timestamps, t_query, kv_cache, actions=actions, categories=categories).to(torch.float32))

    def item_vectors(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """(end - start, d) float32 L2-normalised item rows."""
        end = self.cfg.num_items + 1 if end is None else end
        rows = self.item_emb.rows(start, end) if hasattr(self.item_emb, "rows") else self.item_emb.weight[start:end]
        return l2_normalize(rows.to(torch.float32))

    def score_items(self, user_vecs: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """(B, d) and (B, C) int64 -> (B, C) float32 cosine / temperature."""
        return super().score_items(user_vecs.to(torch.float32), items)


@torch.no_grad()
def to_low_precision(model: HSTUModel, precision: str) -> HSTUModel:
    """Cast ``model`` in place to "bf16" | "fp16" (see module docstring) and return it.

    Records ``model.quant_meta = {"scheme": precision, ...}``. Raises ValueError for another
    precision, TypeError for a model that is not an HSTUModel.
    """
    if precision not in LOWP:
        raise ValueError(f"precision: {precision!r} is not a 16-bit float scheme; valid: {sorted(LOWP)}")
    if not isinstance(model, HSTUModel):
        raise TypeError(f"low-precision inference supports HSTUModel, got {type(model).__name__}")
    dtype = LOWP[precision]
    head = model.action_head
    model.action_head = None
    model.to(dtype)
    if isinstance(model.item_emb, ShardedEmbedding):  # .to() changes only its compute dtype: store the shards in dtype too
        model.item_emb.cast_storage(dtype)
    model.action_head = head  # the next-action head reads the float32 user vector
    model.__class__ = LowPrecisionHSTUModel
    model.quant_meta = {
        "scheme": precision,
        "embeddings": precision,
        "keep_float": ["action_head"] if head is not None else [],
        "quantized": [],
        "stored_as": {},
    }
    log.info("model cast to %s (outputs and similarity in float32)", precision)
    return model
