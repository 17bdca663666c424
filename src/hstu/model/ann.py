"""An optional approximate nearest-neighbour index over the item table (faiss, the ``ann`` extra).

Retrieval in HSTU ranks items by the cosine of the user vector with the L2-normalised item rows
(Zhai et al. 2024, §4.1.1); :func:`hstu.model.item_index.stream_topk` does it exactly, block by
block, at a cost linear in the catalogue. For very large catalogues an inverted-file or graph
index answers the same maximum-inner-product query approximately in sub-linear time (faiss:
Johnson, Douze and Jégou, "Billion-scale similarity search with GPUs", 2017; index types and the
``index_factory`` strings in the faiss wiki, "The index factory" / "Faiss indexes"). Its quality
is measured, not assumed: :func:`recall_at_k` against the exact streamed top-k
(benchmarks/catalogue.py reports recall@10 and latency).

Rows 1..I are indexed (row 0 is padding and is never returned); ids are the dense item ids.
"""

from __future__ import annotations

import numpy as np
import torch

ADD_BLOCK = 1 << 18  # rows read, normalised and added per block (32 MB of float32 at d = 32)


def _faiss():
    try:
        import faiss
    except ImportError as exc:  # pragma: no cover - exercised where faiss is absent
        raise ImportError("the approximate item index needs faiss: pip install 'hstu[ann]' (faiss-cpu)") from exc
    return faiss


class AnnIndex:
    """Approximate top-k cosine search over item rows 1..I with a faiss index.

    Args:
        rows: ``rows(start, end)`` -> (end - start, d) float32 L2-normalised item rows
            (``model.item_vectors``); read in blocks of :data:`ADD_BLOCK`, never whole.
        num_rows: V = I + 1 (row 0 padding).
        dim: d.
        factory: a faiss ``index_factory`` string with inner-product metric, e.g. "IVF1024,Flat"
            (inverted lists over k-means cells), "IVF4096,SQ8" (8-bit rows: a quarter of the bytes),
            "HNSW32" (a graph, no training).
        nprobe: cells visited per query for IVF indexes (``nprobe`` = the cell count is exact).
        ef_search: candidate list length for HNSW indexes.
        train_rows: rows sampled (seeded, without replacement) to train an IVF quantizer.
        seed: the sample's seed.
    Raises:
        ImportError: faiss is not installed. ValueError: ``num_rows`` < 2 or a factory string
        faiss rejects (its message included).
    """

    def __init__(
        self,
        rows,
        num_rows: int,
        dim: int,
        factory: str = "IVF1024,Flat",
        *,
        nprobe: int = 16,
        ef_search: int = 64,
        train_rows: int = 1 << 16,
        seed: int = 0,
    ) -> None:
        faiss = _faiss()
        if num_rows < 2:
            raise ValueError(f"AnnIndex: need at least one item row besides padding, got num_rows={num_rows}")
        try:
            self.index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as exc:
            raise ValueError(f"AnnIndex: faiss rejects the factory string {factory!r}: {exc}") from None
        self.num_rows, self.dim, self.factory = num_rows, dim, factory
        if not self.index.is_trained:
            n = min(train_rows, num_rows - 1)
            pick = np.sort(np.random.default_rng(seed).choice(num_rows - 1, size=n, replace=False)) + 1
            self.index.train(_sample(rows, pick, dim))
        for a in range(1, num_rows, ADD_BLOCK):
            b = min(num_rows, a + ADD_BLOCK)
            self.index.add(np.ascontiguousarray(rows(a, b).detach().to(torch.float32).cpu().numpy()))
        self.set_search(nprobe=nprobe, ef_search=ef_search)

    def set_search(self, *, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Change the search effort (IVF ``nprobe``, HNSW ``efSearch``) without rebuilding."""
        faiss = _faiss()
        ps = faiss.ParameterSpace()
        if nprobe is not None and "IVF" in self.factory:
            ps.set_index_parameter(self.index, "nprobe", int(nprobe))
        if ef_search is not None and "HNSW" in self.factory:
            ps.set_index_parameter(self.index, "efSearch", int(ef_search))

    def search(self, user: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) L2-normalised user vectors -> (cosine (B, k) float32 descending, item ids (B, k)
        int64 in 1..I; -1 where the index found fewer than k). Divide by the model's temperature
        for :func:`hstu.model.item_index.item_scores`' scale."""
        d, i = self.index.search(np.ascontiguousarray(user.detach().to(torch.float32).cpu().numpy()), k)
        ids = torch.from_numpy(i).to(torch.int64)
        return torch.from_numpy(d), torch.where(ids >= 0, ids + 1, ids)  # faiss positions 0.. are rows 1..


def _sample(rows, pick: np.ndarray, dim: int) -> np.ndarray:
    """(n, d) float32 rows at the sorted ids ``pick``, read one block range at a time."""
    out = np.empty((len(pick), dim), np.float32)
    j = 0
    while j < len(pick):
        a = int(pick[j])
        b = min(a + ADD_BLOCK, int(pick[-1]) + 1)
        sel = pick[j : np.searchsorted(pick, b)]
        out[j : j + len(sel)] = rows(a, b).detach().to(torch.float32).cpu().numpy()[sel - a]
        j += len(sel)
    return out


def recall_at_k(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over rows of |approx ∩ exact| / k for (B, k) id tensors (the ANN literature's
    recall k@k): 1.0 when the approximate top-k holds every exact one."""
    hits = (approx.unsqueeze(2) == exact.unsqueeze(1)).any(dim=2).sum(dim=1)  # (B,)
    return float(hits.double().mean() / exact.shape[1])


__all__ = ["AnnIndex", "recall_at_k"]
