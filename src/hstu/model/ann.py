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

In generation (``hstu generate / serve --ann FACTORY``) the index only proposes candidates:
:class:`AnnItemIndex` wraps the exact index, and :func:`hstu.model.item_index.stream_topk` (the
engine's streamed picks) then scores the ``candidates`` best approximate rows of each user exactly
(:func:`ann_topk`: the same cosine / temperature, repeat bias and exclusions as the exact path) and
keeps their top-k; a row left with fewer than k candidates after its exclusions falls back to the
exact streamed top-k. Beam search normalises its log-probabilities over the candidates (the exact
path: over every item). The index is built once per weights file and kept beside the run
(:func:`ann_for_run`: RUN/ann/, keyed by the weights' sha256, factory, table shape and dtype).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

ADD_BLOCK = 1 << 18  # rows read, normalised and added per block (32 MB of float32 at d = 32)
ANN_CANDIDATES = 256  # approximate candidates per row rescored exactly (plus the row's exclusions and k)


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
            raise ValueError(f"--ann {factory}: faiss cannot parse it ({_last_line(exc)})") from None
        self.num_rows, self.dim, self.factory = num_rows, dim, factory
        self._params(None)  # an index type the item filter cannot search: refused before any work
        if not self.index.is_trained:
            n = min(train_rows, num_rows - 1)
            pick = np.sort(np.random.default_rng(seed).choice(num_rows - 1, size=n, replace=False)) + 1
            try:
                self.index.train(_sample(rows, pick, dim))
            except RuntimeError as exc:  # e.g. IVF4096 over 3,706 items: fewer training points than cells
                cells = getattr(faiss.try_extract_index_ivf(self.index), "nlist", None) if hasattr(faiss, "try_extract_index_ivf") else None
                hint = f": {cells} IVF cells need at least {cells} rows (~39 per cell trains well); take fewer cells" if cells else ""
                raise ValueError(f"--ann {factory}: cannot train it on {n} item rows{hint} ({_last_line(exc)})") from None
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

    def save(self, path: str | Path) -> None:
        """Write the faiss index to ``path`` (NAME.tmp renamed into place)."""
        tmp = Path(f"{path}.tmp")
        _faiss().write_index(self.index, str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, num_rows: int, dim: int, factory: str, *, nprobe: int = 16, ef_search: int = 64) -> AnnIndex:
        """An index written by :meth:`save`. Raises ValueError naming ``path`` when faiss cannot
        read it or it holds another row count or width than ``num_rows - 1`` x ``dim``."""
        faiss = _faiss()
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as exc:
            raise ValueError(f"{path}: not a readable faiss index ({_last_line(exc)})") from None
        if index.ntotal != num_rows - 1 or index.d != dim:
            raise ValueError(f"{path}: holds {index.ntotal} rows x {index.d}, the table has {num_rows - 1} x {dim}")
        obj = cls.__new__(cls)
        obj.index, obj.num_rows, obj.dim, obj.factory = index, num_rows, dim, factory
        obj.set_search(nprobe=nprobe, ef_search=ef_search)
        return obj

    @staticmethod
    def pack(allowed: torch.Tensor) -> np.ndarray:
        """(I,) bool over items 1..I -> the packed bitmap :meth:`search` takes (bit j: item j + 1)."""
        return np.packbits(allowed.cpu().numpy(), bitorder="little")

    def search(self, user: torch.Tensor, k: int, allowed: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) L2-normalised user vectors -> (cosine (B, k) float32 descending, item ids (B, k)
        int64 in 1..I; -1 where the index found fewer than k). Divide by the model's temperature
        for :func:`hstu.model.item_index.item_scores`' scale. ``allowed``: optional bitmap of the
        items to search (:meth:`pack`), the others never returned (a faiss ``IDSelectorBitmap`` in the
        search parameters, for IVF, HNSW and flat indexes; ValueError for another index type)."""
        x = np.ascontiguousarray(user.detach().to(torch.float32).cpu().numpy())
        if allowed is None:
            d, i = self.index.search(x, k)
        else:
            sel = _faiss().IDSelectorBitmap(self.num_rows - 1, _faiss().swig_ptr(allowed))
            d, i = self.index.search(x, k, params=self._params(sel))
        ids = torch.from_numpy(i).to(torch.int64)
        return torch.from_numpy(d), torch.where(ids >= 0, ids + 1, ids)  # faiss positions 0.. are rows 1..

    def _params(self, sel):
        """Search parameters carrying the selector ``sel`` and the index's own search effort."""
        faiss = _faiss()
        index = faiss.downcast_index(self.index)
        if isinstance(index, faiss.IndexIVF):
            return faiss.SearchParametersIVF(sel=sel, nprobe=index.nprobe)
        if isinstance(index, faiss.IndexHNSW):
            return faiss.SearchParametersHNSW(sel=sel, efSearch=index.hnsw.efSearch)
        if isinstance(index, faiss.IndexFlat):
            return faiss.SearchParameters(sel=sel)
        raise ValueError(
            f"--ann {self.factory}: a {type(index).__name__} cannot filter items; use an IVF (IVF1024,Flat, IVF4096,SQ8, ...), "
            "HNSW (HNSW32) or Flat index"
        )


def _last_line(exc: BaseException) -> str:
    """faiss's message without its C++ location lines."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1].split(": ", 1)[-1] if lines else type(exc).__name__


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


class AnnItemIndex:
    """The exact item index (:mod:`hstu.model.item_index`) with an approximate candidate source:
    every attribute is the exact index's (so evaluation-style calls and the exact fallback see
    it unchanged), and :func:`hstu.model.item_index.stream_topk` takes its top-k through
    :func:`ann_topk`.

    Args:
        exact: the model's item index; it must score row ranges (a float or 16-bit table: the
            fallback streams it).
        ann: an :class:`AnnIndex` over the same rows.
        vectors: ``vectors(ids (n,) int64)`` -> (n, d) float32 L2-normalised item rows.
        candidates: approximate candidates per row (besides its exclusions and k).
    Raises:
        ValueError: ``exact`` cannot score row ranges (the INT8 index).
    """

    def __init__(self, exact, ann: AnnIndex, vectors, candidates: int = ANN_CANDIDATES) -> None:
        from hstu.model.item_index import ItemIndex

        if type(exact).cosine_rows is ItemIndex.cosine_rows:
            raise ValueError(f"--ann: approximate picks need a float or 16-bit item table ({type(exact).__name__} scores no row ranges)")
        self.exact, self.ann, self.vectors, self.candidates = exact, ann, vectors, int(candidates)
        self.fallbacks = 0  # calls answered by the exact streamed top-k (too few candidates left)
        self._shared = (None, None, None)  # (mask, its (pointer, version), packed bitmap): one pack per mask

    def allowed(self, shared: torch.Tensor) -> np.ndarray:
        """The packed bitmap of the items a (1, V) mask shared by every row leaves (:meth:`AnnIndex.pack`),
        packed once per mask: the same tensor unchanged (its storage kept alive here, so no other tensor
        can take its address; ``_version`` moves with any in-place write) reuses it."""
        key = (shared.data_ptr(), shared._version)
        if self._shared[0] is None or self._shared[1] != key or self._shared[0].shape != shared.shape:
            self._shared = (shared, key, self.ann.pack(~shared[0, 1:]))
        return self._shared[2]

    def __getattr__(self, name):
        return getattr(self.exact, name)

    def cosine(self, user, out=None):
        return self.exact.cosine(user, out=out)

    def cosine_rows(self, user, start, end):
        return self.exact.cosine_rows(user, start, end)


def l2_vectors(model):
    """``vectors(ids (n,) int64) -> (n, d) float32`` L2-normalised rows of ``model``'s item table
    (any table: ``model.item_emb(ids)``), what :class:`AnnItemIndex` rescores with."""
    from hstu.model.base import l2_normalize

    return lambda ids: l2_normalize(model.item_emb(ids).to(torch.float32))


def _per_row_excluded(B: int, exclude, exclude_pairs) -> int:
    """The most exclusions of one row that the search does not filter: its pairs, and a per-row mask's."""
    n = 0
    if exclude_pairs is not None and exclude_pairs[0].numel():
        n = int(torch.bincount(exclude_pairs[0], minlength=B).max())
    if exclude is not None and exclude.shape[0] > 1:
        n = max(n, int(exclude.sum(dim=1).max()))
    return n


def ann_topk(index: AnnItemIndex, user, temperature, k, *, exclude=None, exclude_pairs=None, repeat=None, lse=False):
    """:func:`hstu.model.item_index.stream_topk` over approximate candidates: each row's
    ``index.candidates`` + (its own exclusions) + k nearest rows by the approximate index, scored
    as the exact path scores them (cosine / temperature, the repeat bias, -inf at exclusions;
    arguments as there, ``exclude_pairs`` ids being item ids), top-k with ties to the lower id. A
    mask shared by every row (``exclude`` (1, V): the run's untrained items) filters the search
    itself (:meth:`AnnIndex.search` ``allowed``), so it costs no candidates. Returns what
    stream_topk returns (``lse``: over the candidates), or None when a row keeps fewer than k
    candidates (the caller then runs the exact path)."""
    from hstu.model.item_index import top_rows

    B, V = user.shape[0], index.num_rows
    C = min(V - 1, index.candidates + _per_row_excluded(B, exclude, exclude_pairs) + k)
    shared = exclude is not None and exclude.shape[0] == 1
    _, cand = index.ann.search(user, C, allowed=index.allowed(exclude) if shared else None)  # (B, C) ids, -1 past what it found
    cand = cand.to(user.device)
    ids, _ = cand.clamp(min=0).sort(dim=1)  # id order: top_rows' lower-column tie rule is the lower id
    vec = index.vectors(ids.reshape(-1)).view(B, C, -1).to(torch.float32)
    s = torch.bmm(vec, user.to(torch.float32).unsqueeze(2)).squeeze(2).div_(temperature)  # (B, C)
    if repeat is not None:
        module, static, inwin = repeat
        module.add_to(s, user, static.gather(1, ids), inwin.gather(1, ids))
    s.masked_fill_(ids.eq(0), float("-inf"))  # padding: what the index did not fill
    if exclude is not None:
        s.masked_fill_(exclude.expand(B, -1).gather(1, ids), float("-inf"))
    if exclude_pairs is not None and exclude_pairs[0].numel():
        rows, pid = exclude_pairs
        r, c = ids.index_select(0, rows).eq(pid.view(-1, 1)).nonzero(as_tuple=True)
        s[rows[r], c] = float("-inf")
    if int(s.isfinite().sum(dim=1).min()) < k:
        index.fallbacks += 1
        return None
    v, c = top_rows(s, k)
    out = (v, ids.gather(1, c))
    return (*out, torch.logsumexp(s, dim=1)) if lse else out


def ann_for_run(run_dir, model, factory: str, *, nprobe: int = 16) -> AnnIndex:
    """The approximate index of ``model``'s item rows for the run at ``run_dir``: loaded from
    RUN/ann/ when an index of this factory was built there for the same weights file (sha256:
    model.safetensors, or a quantized run's model.quant.safetensors), table shape and dtype, else
    built (:class:`AnnIndex` over ``model.item_vectors``, logged with its seconds) and stored there
    (its key in a JSON file beside it)."""
    import time

    from hstu.model.checkpoint import file_sha256, write_json
    from hstu.model.run_files import WEIGHTS

    if getattr(model.item_emb, "weight_int8", None) is not None:
        raise ValueError("--ann: approximate picks need a float or 16-bit item table; this run's item rows are INT8 (--embeddings int8)")
    run = Path(run_dir)
    wfile = run / next((f for f in (WEIGHTS, "model.quant.safetensors") if (run / f).exists()), WEIGHTS)
    V, d = model.cfg.num_items + 1, model.cfg.embedding_dim
    key = {
        "factory": factory,
        "weights_sha256": file_sha256(wfile),
        "rows": V,
        "dim": d,
        "dtype": str(model.item_vectors(0, 1).dtype),
        "faiss": _faiss().__version__,
    }
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path, meta = run / "ann" / f"{name}.faiss", run / "ann" / f"{name}.json"
    if path.exists() and meta.exists():
        try:
            if json.loads(meta.read_text()) == key:
                return AnnIndex.load(path, V, d, factory, nprobe=nprobe)
        except ValueError as exc:
            log.warning("ann: %s; rebuilding", exc)
    t = time.perf_counter()
    with torch.inference_mode():
        index = AnnIndex(lambda a, b: model.item_vectors(a, b).to(torch.float32), V, d, factory, nprobe=nprobe)
    log.info("ann: built %s over %d items in %.1f s", factory, V - 1, time.perf_counter() - t)
    try:
        path.parent.mkdir(exist_ok=True)
        index.save(path)
        write_json(meta, key)
    except (OSError, RuntimeError) as exc:  # a read-only run directory (faiss raises RuntimeError): the index serves, unsaved
        log.warning("ann: cannot store the index in %s (%s); it is rebuilt at the next start", path.parent, exc)
    return index


def recall_at_k(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over rows of |approx ∩ exact| / k for (B, k) id tensors (the ANN literature's
    recall k@k): 1.0 when the approximate top-k holds every exact one."""
    hits = (approx.unsqueeze(2) == exact.unsqueeze(1)).any(dim=2).sum(dim=1)  # (B,)
    return float(hits.double().mean() / exact.shape[1])


__all__ = ["ANN_CANDIDATES", "AnnIndex", "AnnItemIndex", "ann_for_run", "ann_topk", "l2_vectors", "recall_at_k"]
