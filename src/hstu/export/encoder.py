"""The exportable encoder prefill: a run's model from raw padded histories to the user vector.

:class:`UserEncoder` wraps a loaded :class:`hstu.model.hstu.HSTUModel` (or the SASRec baseline,
same interface) and runs its own :meth:`encode` and :meth:`last_rows`; it adds only the input
layout the engine's prefill uses (hstu.generate.runners.prefill_fn, pool.BucketPool.load): ids
zero past each length, the request time at position ``length`` (the last live row's time-bias
query, Zhai et al. 2024, §3 rab^t) and after, categories looked up from the run's item category
map. So the exported program holds no second copy of the equations and gives the engine's user
vector up to float rounding (checked on export, :func:`max_abs_error`).

Symbols: B batch (dynamic in the exported programs unless fixed), E the bucket edge (static),
d the embedding width, I items (dense ids 1..I, 0 padding).

Inputs (int64 each; names as in the exported graphs):
    item_ids      (B, E)  dense item ids of idmap.json ``item_raw_ids``, oldest first, 0 after the history
    timestamps    (B, E)  Unix seconds, non-decreasing over the live events; padding ignored
    lengths       (B,)    live events per row, 1..E
    request_time  (B,)    Unix seconds the recommendation is for (>= the last event; the engine's default: it)
    actions       (B, E)  action ids 1..num_actions (idmap.json ``action_names`` order), 0 none;
                          only for a run whose model has action embeddings
Output:
    user_vector   (B, d)  float32, L2-normalised: the last live row, what next-item scoring reads
                          (score = user_vector · items[j] / temperature, items from
                          :meth:`hstu.model.base.SequentialRecommender.item_vectors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hstu.model.kernels import REFERENCE


@dataclass(frozen=True)
class Tensor:
    """One named graph input or output: dtype name, shape with "batch" for the dynamic axis."""

    name: str
    dtype: str
    shape: tuple
    doc: str

    def as_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "doc": self.doc}


class UserEncoder(nn.Module):
    """(item_ids, timestamps, lengths, request_time[, actions]) -> user_vector (B, d) float32.

    Args:
        model: a loaded run's model in eval mode (hstu.runs.load_run), on the CPU.
        item_category: (I + 1,) int64 dense category of each item (idmap.json ``item_category``),
            needed when the model has category embeddings, ignored otherwise.
    The model's kernel set is set to the reference one (:data:`hstu.model.kernels.REFERENCE`):
    plain PyTorch ops that every exporter and runtime takes (a Triton or NPU kernel is not a
    graph op). Raises ValueError when the model needs categories and none are given, or has side
    features (:mod:`hstu.data.features`; their per-event values are no input of the exported program).
    """

    def __init__(self, model: nn.Module, item_category: torch.Tensor | None = None) -> None:
        super().__init__()
        model.kernels = REFERENCE
        self.model = model.eval()
        self.uses_actions = model.action_emb is not None
        self.uses_categories = model.category_emb is not None
        if getattr(model, "feature_emb", None) is not None:  # per-event token columns (hstu.data.features): not an input here
            raise ValueError(
                f"the model has side features {list(model.cfg.features)} (ModelConfig.features): export does not take them yet"
            )
        if self.uses_categories and item_category is None:
            raise ValueError("the model has category embeddings: pass idmap.json's item_category")
        cat = item_category if self.uses_categories else torch.zeros(1, dtype=torch.int64)
        self.register_buffer("item_category", cat.to(torch.int64), persistent=False)

    @property
    def input_names(self) -> list[str]:
        return ["item_ids", "timestamps", "lengths", "request_time"] + (["actions"] if self.uses_actions else [])

    def signature(self, edge: int | str, batch: int | None) -> tuple[list[Tensor], list[Tensor]]:
        """The graph's inputs and outputs for bucket ``edge`` (module docstring); batch None: dynamic."""
        B = "batch" if batch is None else batch
        docs = {
            "item_ids": "dense item ids (idmap.json item_raw_ids index), oldest first, 0 after the history",
            "timestamps": "Unix seconds of the events, non-decreasing; padding ignored",
            "lengths": f"live events per row, 1..{edge}",
            "request_time": "Unix seconds of the request, >= the last event (default: the last event's time)",
            "actions": "action ids 1..num_actions in idmap.json action_names order, 0 none",
        }
        shapes = {"lengths": (B,), "request_time": (B,)}
        ins = [Tensor(n, "int64", shapes.get(n, (B, edge)), docs[n]) for n in self.input_names]
        d = self.model.cfg.embedding_dim
        out = Tensor("user_vector", "float32", (B, d), "L2-normalised user vector of the last live row; score = user_vector . items[j] / T")
        return ins, [out]

    def forward(
        self,
        item_ids: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        request_time: torch.Tensor,
        actions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Shapes and dtypes as the module docstring; returns (B, d) float32."""
        B, E = item_ids.shape
        pos = torch.arange(E + 1, device=item_ids.device)
        live = pos.view(1, E + 1) < lengths.view(B, 1)  # (B, E + 1): one column more for the request time
        zero = torch.zeros_like(item_ids[:, :1])
        ids = torch.cat([item_ids, zero], dim=1) * live  # (B, E + 1), 0 past each length
        t = torch.where(live, torch.cat([timestamps, zero], dim=1), request_time.view(B, 1))  # request time at length
        acts = None if actions is None else torch.cat([actions, zero], dim=1) * live
        cats = self.item_category[ids] if self.uses_categories else None
        x = self.model.encode(ids, t, lengths, actions=acts, categories=cats)  # (B, E + 1, d) L2-normalised
        return self.model.last_rows(x, lengths).to(torch.float32)  # (B, d)


def example_inputs(enc: UserEncoder, edge: int, batch: int = 3, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded valid inputs for bucket ``edge``: ``batch`` rows (>= 2: a batch of 1 would let the
    exporter specialise the dynamic axis), lengths spread over 1..edge (1, edge and between),
    random catalogue ids, increasing timestamps, request time after the last event."""
    g = torch.Generator().manual_seed(seed)
    c = enc.model.cfg
    ids = torch.randint(1, c.num_items + 1, (batch, edge), generator=g)
    ts = 978_300_000 + torch.cumsum(torch.randint(0, 86_400, (batch, edge), generator=g), dim=1)
    lengths = torch.linspace(1, edge, batch).round().to(torch.int64)
    rt = ts.gather(1, (lengths - 1).view(-1, 1)).view(-1) + 3600
    out = [ids, ts, lengths, rt]
    if enc.uses_actions:
        out.append(torch.randint(1, c.num_actions + 1, (batch, edge), generator=g))
    return tuple(out)


def max_abs_error(got, want: torch.Tensor) -> float:
    """max |got - want| of an exported program's output (tensor or array) against the eager one."""
    return float((torch.as_tensor(got, dtype=torch.float32) - want.to(torch.float32)).abs().max())


__all__ = ["Tensor", "UserEncoder", "example_inputs", "max_abs_error"]
