"""What HSTU and the SASRec baseline share: the input embeddings (items, positions, optional
action types and categories), the next-action head, input checks, and scoring of L2-normalised
user vectors against L2-normalised item rows (cosine / temperature; Zhai et al. 2024, §4.1.1)."""

from __future__ import annotations

import math

import torch
from torch import nn

from hstu.config import ModelConfig
from hstu.model.item_index import item_scores
from hstu.model.meta import KVView, segment_positions


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / max(||x||_2, eps) over the last axis."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)


def build_item_table(cfg: ModelConfig, device: str | torch.device | None = None) -> nn.Module:
    """The item table ``cfg.item_table`` names: ids (…) int64 in 0..num_items -> (…, d) rows, row 0
    (padding) zero; initial rows normal(0, 0.02) (trunc_normal_ at ±2 = 100 σ: the same law).

    - "dense": ``nn.Embedding(num_items + 1, d, padding_idx=0)``, initialised from the global RNG;
    - "hashed": :class:`hstu.model.embedding.ShardedEmbedding` with ``item_table_shards`` shards,
      ``table_placements()``, ``item_table_dtype`` rows and ``item_table_cache_bytes`` of hot-row cache,
      its memory plan checked before allocation (MemoryPlanError), on compute ``device`` (default
      "cpu"; ``.to()`` moves device shards later). Its init seed is drawn from the global RNG, so a
      seeded run reproduces and the rows do not depend on the shard count. One overflow row, never
      addressed: ids come from the run's id map (1..num_items), unknown ones are dropped before
      the model. Built on PyTorch's "meta" device (``Recommender.mapping_only``: shapes only), the
      hashed table is a meta ``nn.Embedding`` of the same shape, since its row index needs memory.
    """
    d, rows = cfg.embedding_dim, cfg.num_items + 1
    if cfg.item_table == "hashed" and not torch.empty(0).is_meta:
        from hstu.model.embedding import ShardedEmbedding

        seed = int(torch.randint(0, 2**31 - 1, ()))
        placements = cfg.table_placements()
        return ShardedEmbedding(
            rows, d, cfg.item_table_shards, placements, cfg.item_table_dtype, num_overflow_rows=1, padding_idx=0,
            device="cpu" if device is None else device, seed=seed, init_std=0.02, cache_bytes=cfg.item_table_cache_bytes,
        )  # fmt: skip
    emb = nn.Embedding(rows, d, padding_idx=0)
    nn.init.trunc_normal_(emb.weight, std=0.02)
    with torch.no_grad():
        emb.weight[0].zero_()
    return emb


class SequentialRecommender(nn.Module):
    """Embeddings, head and scoring; subclasses add ``layers`` and ``encode`` / ``step``.

    The item table is built from ``cfg`` (:func:`build_item_table`, on compute ``device`` for a
    hashed table) unless ``item_embedding`` is passed in; either maps (…) int64 ids to (…, d)
    rows and has row 0 for padding. ``repeat`` is None unless a subclass sets a repeat head
    (:mod:`hstu.model.repeat`).
    """

    def __init__(self, cfg: ModelConfig, *, item_embedding: nn.Module | None = None, device: str | torch.device | None = None) -> None:
        super().__init__()
        cfg.validate()
        if cfg.num_items <= 0:
            raise ValueError(f"ModelConfig.num_items must be set from the data (> 0), got {cfg.num_items}")
        self.cfg = cfg
        d, N = cfg.embedding_dim, cfg.width
        self.item_emb = build_item_table(cfg, device) if item_embedding is None else item_embedding
        self.pos_emb = nn.Embedding(N, d)
        nn.init.trunc_normal_(self.pos_emb.weight, std=math.sqrt(1.0 / d))  # same scale as item_emb · √d
        self.action_emb = nn.Embedding(cfg.num_actions + 1, d, padding_idx=0) if cfg.num_actions > 0 else None
        self.category_emb = nn.Embedding(cfg.num_categories + 1, d, padding_idx=0) if cfg.num_categories > 0 else None
        # side features (hstu.data.features): token columns 1..F of ``categories``, in cfg.features order
        self.feature_emb = nn.ModuleList(nn.Embedding(n + 1, d, padding_idx=0) for n in cfg.features.values()) if cfg.features else None
        self.action_head = nn.Linear(d, cfg.num_actions + 1) if cfg.num_actions > 0 else None
        self.repeat: nn.Module | None = None
        self._init_extra_heads()
        for emb in (self.action_emb, self.category_emb, *(self.feature_emb or ())):
            if emb is not None:
                nn.init.trunc_normal_(emb.weight, std=0.02)
        for emb in self.feature_emb or ():
            with torch.no_grad():
                emb.weight[0].zero_()  # an unknown feature value adds nothing (padding_idx keeps it there)
        self.input_dropout = nn.Dropout(cfg.dropout)
        if cfg.cold_item_dropout > 0:  # (I+1,) True = never seen in training: no item embedding as input
            self.register_buffer("cold_items", torch.zeros(cfg.num_items + 1, dtype=torch.bool))
        else:
            self.cold_items = None

    def set_cold_items(self, train_counts) -> None:
        """Mark the items with zero training events (``train_counts``: (I+1,) counts) as cold."""
        if self.cold_items is None:
            raise ValueError("set_cold_items: the model was built with cold_item_dropout = 0")
        counts = torch.as_tensor(train_counts, device=self.cold_items.device)
        if counts.shape != self.cold_items.shape:
            raise ValueError(f"set_cold_items: expected {tuple(self.cold_items.shape)} counts, got {tuple(counts.shape)}")
        self.cold_items.copy_(counts == 0)
        self.cold_items[0] = False

    def _init_extra_heads(self) -> None:
        """Hook for heads created right after the action head (keeps the seeded init order)."""

    # ----- input -----
    def embed(
        self, ids: torch.Tensor, positions: torch.Tensor, actions: torch.Tensor | None = None, categories: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids, positions (and optional actions, categories): (…) int64 -> (…, d) input rows.

        ``categories`` is (…) category ids, or for a model with side features (``cfg.features``,
        :mod:`hstu.data.features`) the (…, 1 + F) token columns: the category, then one id per
        feature, each looked up in its own table and summed (0 = unknown adds nothing). A (…)
        tensor given to such a model carries the category only.

        With ``cold_item_dropout`` > 0, a cold item (never in training) adds no item embedding, and
        in training each event drops its item embedding with that probability. Found on Taobao:
        60 % of test histories end with an item that is not in training (the held-out valid
        event), whose untrained embedding made the last row, the query, meaningless (test HR@10
        .066 against .151 with that event dropped; valid histories never end cold)."""
        e = self.item_emb(ids)
        if self.cold_items is not None:
            keep = ~self.cold_items[ids]
            if self.training:
                keep = keep & (torch.rand(ids.shape, device=ids.device) >= self.cfg.cold_item_dropout)
            e = e * keep.unsqueeze(-1).to(e.dtype)
        x = e * math.sqrt(self.cfg.embedding_dim) + self.pos_emb(positions)
        if self.action_emb is not None and actions is not None:
            x = x + self.action_emb(actions)
        if categories is not None:
            cols = categories.dim() > ids.dim()  # (…, 1 + F) token columns
            if self.category_emb is not None:
                x = x + self.category_emb(categories[..., 0] if cols else categories)
            if self.feature_emb is not None and cols:
                for j, emb in enumerate(self.feature_emb, 1):
                    x = x + emb(categories[..., j])
        return x

    @property
    def token_shape(self) -> tuple[int, ...]:
        """The trailing shape of ``categories`` this model reads: () or (1 + F,) with side features."""
        return (1 + len(self.feature_emb),) if self.feature_emb is not None else ()

    @property
    def reads_categories(self) -> bool:
        """Whether ``categories`` changes the input (a category table or side-feature tables)."""
        return self.category_emb is not None or self.feature_emb is not None

    def check_inputs(self, ids: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor) -> None:
        """TypeError for non-int64 inputs; ValueError when shapes disagree or W > N."""
        if ids.dtype != torch.int64 or timestamps.dtype != torch.int64 or lengths.dtype != torch.int64:
            raise TypeError(f"ids, timestamps, lengths must be int64, got {ids.dtype}, {timestamps.dtype}, {lengths.dtype}")
        if ids.shape != timestamps.shape or ids.dim() != 2:
            raise ValueError(f"ids and timestamps must both be (B, W), got {tuple(ids.shape)} and {tuple(timestamps.shape)}")
        if ids.shape[1] > self.cfg.width:
            raise ValueError(f"padded width W={ids.shape[1]} exceeds the model width N={self.cfg.width}")

    def inputs(
        self,
        ids: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        actions: torch.Tensor | None,
        categories: torch.Tensor | None,
        segments: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked inputs -> encoder input rows x (B, W, d) (dropout in training, padding rows 0)
        and the validity mask (B, W, 1) in the model dtype. ``segments`` (B, W) int64 (packed rows,
        :class:`hstu.model.meta.AttentionMeta`): positions count from each segment's first row.
        Raises as :meth:`check_inputs`."""
        self.check_inputs(ids, timestamps, lengths)
        B, W = ids.shape
        pos = torch.arange(W, device=ids.device)
        valid = (pos.view(1, W) < lengths.view(B, 1)).unsqueeze(-1).to(self.pos_emb.weight.dtype)  # (B, W, 1)
        positions = pos.expand(B, W) if segments is None else segment_positions(segments)  # (B, W)
        return self.input_dropout(self.embed(ids, positions, actions, categories)) * valid, valid

    def encode(
        self,
        ids: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        *,
        actions: torch.Tensor | None = None,
        categories: torch.Tensor | None = None,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        normalize: bool = True,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the encoder over padded sequences: the subclass's ``attention_meta`` (one full
        causal pass) and ``forward_layers``; padding rows 0 (SASRec's final LayerNorm would not
        keep them 0; HSTU's layers already do).

        Args:
            ids: (B, W) int64 dense item ids, oldest first, 0 after the sequence.
            timestamps: (B, W) int64 Unix seconds; position ``length`` (when < W) holds the
                query time used by the last live row's time bias (HSTU; SASRec checks the shape
                only); other padding is ignored.
            lengths: (B,) int64 live lengths (1..W).
            actions, categories: optional (B, W) int64 feature ids (0 = none).
            kv_cache: optional per-layer (k, v) views (B, H, S, d), S >= W, written in place.
            normalize: L2-normalise the output rows.
            segments: (B, W) int64 packed training rows (:func:`hstu.data.batching.packed_train_batch`):
                the user of each row, -1 after ``lengths``; each user's rows are encoded as if alone
                (positions, mask and time buckets within the segment). None: one sequence per row.
        Returns:
            (B, W, d) output rows (padding rows 0).
        Raises:
            TypeError: non-int64 inputs. ValueError: shapes disagree or W > N.
        """
        x, valid = self.inputs(ids, timestamps, lengths, actions, categories, segments)  # (B, W, d), (B, W, 1)
        W = x.shape[1]
        kv = None if kv_cache is None else [KVView(k[:, :, :W], v[:, :, :W]) for k, v in kv_cache]
        meta = self.attention_meta(timestamps, valid) if segments is None else self.attention_meta(timestamps, valid, segments=segments)
        x = self.forward_layers(x, meta, kv) * valid  # (B, W, d)
        return l2_normalize(x) if normalize else x

    def step(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        timestamps: torch.Tensor,
        t_query: torch.Tensor,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        actions: torch.Tensor | None = None,
        categories: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append one token per sequence through every layer using the KV cache (the oracle's
        decode step, :mod:`hstu.generate.decode`; the subclass's ``step_meta``).

        Args:
            ids: (B,) int64 new item ids; pos: (B,) int64 their positions.
            timestamps: (B, S) int64 cache timestamps, with the new token's time already at ``pos``.
            t_query: (B,) int64 the time the new row's bias compares against (its t[i+1]).
            kv_cache: per-layer (k, v) caches (B, H, S, d), rows < pos filled; row pos written.
        Returns:
            (B, d) L2-normalised output row of the new token.
        """
        x = self.embed(ids, pos, actions, categories)  # (B, d)
        x = self.forward_layers(x.unsqueeze(1), self.step_meta(pos, timestamps, t_query), [KVView(k, v) for k, v in kv_cache])  # (B, 1, d)
        return l2_normalize(x.squeeze(1))  # (B, d)

    def last_rows(self, seq: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, W, d), (B,) -> (B, d) the rows at lengths - 1 (the user vectors)."""
        return seq[torch.arange(seq.shape[0], device=seq.device), lengths - 1]

    # ----- scoring -----
    def item_vectors(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """L2-normalised item rows [start, end): (end - start, d). Row 0 (padding) is 0."""
        end = self.cfg.num_items + 1 if end is None else end
        rows = self.item_emb.rows(start, end) if hasattr(self.item_emb, "rows") else self.item_emb.weight[start:end]
        return l2_normalize(rows.to(self.pos_emb.weight.dtype))

    def item_index(self):
        """The full-catalogue similarity of this table's storage (:mod:`hstu.model.item_index`):
        ``.cosine(user (B, d) float32) -> (B, I+1)``. Build once per weight change and reuse."""
        from hstu.model.item_index import build_item_index

        return build_item_index(self)

    def score_all(self, user_vecs: torch.Tensor) -> torch.Tensor:
        """Cosine similarity / temperature against every item: (B, d) -> (B, num_items + 1).

        Column 0 (padding) is set to -inf.
        """
        s = item_scores(self.item_index(), user_vecs, self.cfg.temperature)  # (B, I+1)
        s[:, 0] = float("-inf")
        return s

    def repeat_parts(
        self, ids: torch.Tensor, actions: torch.Tensor | None, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The user-independent part of the repeat bias (:mod:`hstu.model.repeat`) for histories
        ``ids`` (B, W) / ``actions`` / ``lengths``: (static (B, I+1), in_window (B, I+1) bool), to
        pass to ``repeat.add_to`` with each user vector; None when the model has no repeat head."""
        if self.repeat is None:
            return None
        items, acts = self.repeat.history_windows(ids, actions if self.cfg.num_actions > 0 else None, lengths)
        return self.repeat.full(items, acts, self.cfg.num_items)

    def history_scores(
        self, user_vecs: torch.Tensor, ids: torch.Tensor, actions: torch.Tensor | None, lengths: torch.Tensor, index=None
    ) -> torch.Tensor:
        """Full-ranking scores of users with these histories: cosine / temperature against every
        item (``index``, default :meth:`item_index`; pass one built once when scoring many
        batches) plus the repeat bias when the model has a repeat head: (B, I+1), column 0
        (padding) -inf."""
        index = self.item_index() if index is None else index
        parts = self.repeat_parts(ids, actions, lengths)
        scores = item_scores(index, user_vecs, self.cfg.temperature, repeat=None if parts is None else (self.repeat, *parts))  # (B, I+1)
        scores[:, 0] = float("-inf")
        return scores

    def score_items(self, user_vecs: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """(B, d) and (B, C) int64 candidate ids -> (B, C) cosine / temperature."""
        emb = l2_normalize(self.item_emb(items).to(user_vecs.dtype))  # (B, C, d)
        return torch.einsum("bd,bcd->bc", user_vecs, emb) / self.cfg.temperature


__all__ = ["SequentialRecommender", "build_item_table", "l2_normalize"]
