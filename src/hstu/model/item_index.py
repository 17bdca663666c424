"""Full-catalogue similarity: the cosine of L2-normalised user vectors with every item row
(Zhai et al. 2024, §4.1.1: retrieval by cosine / temperature), laid out by the item table's storage.

Symbols: B user vectors, d width, V = I + 1 item rows (row 0 is padding and scores 0).

At serving sizes this product is a skinny GEMM (one next-item step: B = 16 users against a
26,745 x 256 table, 110 M multiply-adds) that ran at ~8 GMAC/s in float32 here (~12 ms at
2 threads, as long as a whole prefill layer's projection), against ~50 GMAC/s for the model's
Linears. Computing it as table · userᵀ (the table's rows as the long side of the GEMM) and
widening a 16-bit table block by block were each faster here (~11 and ~6-7 ms at 2 threads;
INT8 on the integer GEMM ~2.3 ms). The index keeps the table in the precision it is stored in, never a full-size
float32 copy of a 16-bit or INT8 table:

    FloatIndex  float32 table: the normalised rows, (V, d) · (d, B) written transposed (from
                4 MB of table; below, one (B, d) · (d, V) GEMM).
    HalfIndex   fp16 / bf16 table (the INT8 scheme's default item storage, and the 16-bit
                schemes): the stored rows (no copy) and float32 inverse norms; blocks of rows
                are widened to float32 and multiplied in float32, and each cosine is scaled
                by its row's inverse norm: the similarity stays in float.
    Int8Index   row-wise INT8 table (``--embeddings int8``): r = Q[r] · s[r] normalises to
                Q[r] / ||Q[r]||, so the integer rows with per-row scale 1 / ||Q[r]|| are the
                normalised table exactly, on the integer GEMM of the INT8 Linears
                (the user vectors quantized per row, 7-bit on x86; see hstu.quant.int8). A quarter of the bytes; the similarity is then
                integer, so its quality cost is measured with the scheme (benchmarks/quant.py).
                Without an integer kernel on the device: the float rows, with a warning.
"""

from __future__ import annotations

import logging
from bisect import bisect_left

import torch

log = logging.getLogger(__name__)

HALF_BLOCK_ROWS = 2048  # rows widened per block: 2 MB of float32 at d = 256
TABLE_MAJOR_MIN_ELEMENTS = 1 << 20  # float tables from 4 MB: table-major GEMM
STREAM_BYTES = 256 << 20  # a (B, V) float32 score matrix above this is streamed (:func:`streams`)
STREAM_CHUNK_BYTES = 32 << 20  # one streamed block of (B, rows) float32 scores
ROWS_INDEX_BYTES = 64 << 20  # a hashed table whose float32 copy exceeds this is read by range (RowsIndex)


class ItemIndex:
    """cosine(user, out=None): (B, d) float32 -> (B, V) float32; written into ``out`` when
    given ((B, V) float32, may be a row slice of a larger buffer). ``nbytes``: memory held."""

    num_rows: int
    nbytes: int
    dead = (0,)  # positions that are never an item (the padding row), scored -inf by the streamed paths

    def item_ids(self, start: int, end: int) -> torch.Tensor | None:
        """The item id at each position [start, end) of :meth:`cosine_rows`, (end - start,) int64
        (-1: no item), or None where position r is item r (every index but :class:`ShardIndex`)."""
        return None

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 item ids -> (n,) int64 positions of :meth:`cosine_rows` (the identity here)."""
        return ids

    def ids_at(self, pos: torch.Tensor) -> torch.Tensor:
        """int64 positions (any shape) -> the int64 item ids stored there (the identity here)."""
        return pos

    storage_order = False  # True: positions are not item ids (:class:`ShardIndex`)

    def blocks(self, step: int) -> list[tuple[int, int]]:
        """The streamed paths' position ranges [a, b): ``step`` rows each, the last one short."""
        return [(a, min(self.num_rows, a + step)) for a in range(0, self.num_rows, step)]

    def dead_in(self, start: int, end: int) -> list[int]:
        """The :attr:`dead` positions in [start, end), relative to ``start``."""
        return [p - start for p in self.dead[bisect_left(self.dead, start) : bisect_left(self.dead, end)]]

    def cosine(self, user: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def cosine_rows(self, user: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """(B, d) float32 -> (B, end - start) float32: the cosine with rows [start, end) only
        (the streamed scoring's block, :func:`stream_topk`). Raises NotImplementedError where the
        storage has no row-range product (the INT8 index)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a range of rows; streamed scoring needs a float or 16-bit table")


class FloatIndex(ItemIndex):
    def __init__(self, vecs: torch.Tensor) -> None:
        # large tables: (V, d) · (d, B) then a transposed copy; small ones (ML-1M: 3,706 x 50): one
        # (B, d) · (d, V) GEMM into ``out``, where the extra copy cost more than it saved (paired runs)
        self.table_major = vecs.numel() >= TABLE_MAJOR_MIN_ELEMENTS
        self.vecs = vecs.contiguous() if self.table_major else vecs.T.contiguous()  # (V, d) or (d, V)
        self.num_rows = vecs.shape[0]
        self.nbytes = self.vecs.numel() * self.vecs.element_size()

    def cosine(self, user, out=None):
        if not self.table_major:
            return torch.matmul(user, self.vecs) if out is None else torch.matmul(user, self.vecs, out=out)
        y = torch.mm(self.vecs, user.T)  # (V, B)
        return y.T.contiguous() if out is None else out.copy_(y.T)

    def cosine_rows(self, user, start, end):
        if not self.table_major:
            return torch.matmul(user, self.vecs[:, start:end])
        return torch.mm(self.vecs[start:end], user.T).T.contiguous()


class HalfIndex(ItemIndex):
    def __init__(self, rows: torch.Tensor, block: int = HALF_BLOCK_ROWS) -> None:
        self.rows = rows  # (V, d) fp16 / bf16, the model's own table (no copy)
        norm = torch.cat([rows[a : a + block].to(torch.float32).norm(dim=1) for a in range(0, rows.shape[0], block)])
        self.inv_norm = 1.0 / norm.clamp(min=1e-6)  # (V,) float32, as l2_normalize
        self.block = block
        self.buf = torch.empty(min(block, rows.shape[0]), rows.shape[1], dtype=torch.float32, device=rows.device)
        self.num_rows = rows.shape[0]
        self.nbytes = self.inv_norm.numel() * 4 + self.buf.numel() * 4  # beyond the model's table

    def _into(self, user: torch.Tensor, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        for a in range(start, end, self.block):
            b = min(end, a + self.block)
            w = self.buf[: b - a]
            w.copy_(self.rows[a:b])  # (rows, d) widened to float32
            out[:, a - start : b - start].copy_(torch.mm(w, user.T).T)  # (B, rows) dot products
        return out.mul_(self.inv_norm[start:end])  # cosine

    def cosine(self, user, out=None):
        if out is None:
            out = torch.empty(user.shape[0], self.num_rows, dtype=torch.float32, device=user.device)
        return self._into(user, 0, self.num_rows, out)

    def cosine_rows(self, user, start, end):
        return self._into(user, start, end, torch.empty(user.shape[0], end - start, dtype=torch.float32, device=user.device))


class RowsIndex(ItemIndex):
    """A table read range by range, never whole: ``rows(start, end)`` -> (end - start, d) float32
    L2-normalised rows (``model.item_vectors``; the hashed table's ``ShardedEmbedding.rows``), for
    catalogues whose float32 copy would not fit (120M x 32 rows: 15 GB). ``nbytes`` is 0: the
    rows of one block live only while it is scored."""

    def __init__(self, rows, num_rows: int, block: int = 1 << 16) -> None:
        self.rows, self.num_rows, self.block, self.nbytes = rows, num_rows, block, 0

    def _into(self, user: torch.Tensor, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        for a in range(start, end, self.block):
            b = min(end, a + self.block)
            out[:, a - start : b - start].copy_(torch.mm(self.rows(a, b).to(torch.float32), user.T).T)  # (B, rows)
        return out

    def cosine_rows(self, user, start, end):
        return self._into(user, start, end, torch.empty(user.shape[0], end - start, dtype=torch.float32, device=user.device))

    def cosine(self, user, out=None):
        return self.cosine_rows(user, 0, self.num_rows) if out is None else self._into(user, 0, self.num_rows, out)


class ShardIndex(ItemIndex):
    """A hash-sharded table (:class:`hstu.model.embedding.ShardedEmbedding`, 16- or 32-bit shards)
    scored in storage order: position p is row p of the shards laid end to end
    (``ShardedEmbedding.storage_positions``), each shard scored as a :class:`HalfIndex` over its own
    rows (no copy, no hashing or gather per call; 12M x 32 fp16 rows, 2 users, one thread: 0.61 s
    for a streamed top-10 against 5.7 s reading rows by item id through :class:`RowsIndex`).

    A shard stores its rows in increasing id order, so the streamed blocks (:meth:`blocks`) stay
    inside one shard and :func:`stream_topk` merges their candidates in id order: ties at the k-th
    score go to the lower id, as on every other index. The streamed paths map exclusions to
    positions (:meth:`positions`) and picks back to ids (:meth:`ids_at`). Overflow rows read as ids
    V, V+1, ... and are never scored (:attr:`dead`, with the padding row).
    Holds (T,) float32 inverse norms and (T,) int32 / int64 ids: 8 to 12 bytes per row.
    """

    storage_order = True

    def __init__(self, emb, block: int = 8192) -> None:
        self.emb, self.block = emb, block
        self.parts = [HalfIndex(w.detach(), block=block) for w in emb.shards]  # storage order
        self.starts = [0]
        for w in emb.shards:
            self.starts.append(self.starts[-1] + w.shape[0])
        V, T = emb.num_embeddings, self.starts[-1]
        dev = emb.compute_device
        item = torch.full((T,), -1, dtype=torch.int32 if T < 2**31 else torch.int64, device=dev)
        for a in range(0, V, 1 << 18):  # blocks of ids: the hashing temporaries stay ~10 x 2 MB
            ids = torch.arange(a, min(V, a + (1 << 18)), device=dev)
            item[emb.storage_positions(ids)] = ids.to(item.dtype)
        over = item.lt(0).nonzero().view(-1)  # the overflow rows' positions
        item[over] = torch.arange(V, V + over.numel(), device=dev).to(item.dtype)
        self.item = item  # (T,): the id at each position (overflow: V ..)
        self.dead = tuple(sorted(self.positions(torch.zeros(1, dtype=torch.int64, device=dev)).tolist() + over.tolist()))
        self.num_rows = T
        self.nbytes = sum(x.nbytes for x in self.parts) + item.numel() * item.element_size()

    def blocks(self, step):
        return [(a, min(hi, a + step)) for lo, hi in zip(self.starts, self.starts[1:]) for a in range(lo, hi, step)]

    def item_ids(self, start, end):
        return self.item[start:end].long()

    def positions(self, ids):
        return self.emb.storage_positions(ids)

    def ids_at(self, pos):
        return self.item[pos].long()

    def cosine_rows(self, user, start, end):
        out = torch.empty(user.shape[0], end - start, dtype=torch.float32, device=user.device)
        for part, lo in zip(self.parts, self.starts):
            a, b = max(start, lo), min(end, lo + part.num_rows)
            if a < b:
                part._into(user, a - lo, b - lo, out[:, a - start : b - start])
        return out

    def cosine(self, user, out=None):
        """(B, d) -> (B, V) in id order (overflow rows left out), block by block."""
        V = self.emb.num_embeddings
        out = torch.empty(user.shape[0], V, dtype=torch.float32, device=user.device) if out is None else out
        for a, b in self.blocks(max(self.block, STREAM_CHUNK_BYTES // (4 * max(user.shape[0], 1)))):
            ids = self.item_ids(a, b)
            keep = ids.lt(V).nonzero().view(-1)
            out.index_copy_(1, ids[keep], self.cosine_rows(user, a, b).index_select(1, keep))
        return out


class Int8Index(ItemIndex):
    def __init__(self, q: torch.Tensor, engine: str) -> None:
        from hstu.quant.int8 import Int8Linear

        norm = q.to(torch.float32).norm(dim=1)
        self.lin = Int8Linear(q.shape[1], q.shape[0], bias=False, kernel=engine)  # the table as a (V x d) Linear
        self.lin.weight_int8 = q  # the model's rows, shared
        self.lin.weight_scale = torch.where(norm > 0, 1.0 / norm.clamp(min=1e-12), torch.ones_like(norm))  # padding row: Q = 0
        self.lin.prepare()
        self.num_rows = q.shape[0]
        self.nbytes = q.numel() * self.lin._packed.copies  # the prepacked copies of the int8 rows

    def cosine(self, user, out=None):
        y = self.lin(user.to(torch.float32))  # (B, V)
        return y if out is None else out.copy_(y)


def item_scores(
    index: ItemIndex, user: torch.Tensor, temperature: float, *, repeat: tuple | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Retrieval scores of every item: cosine(user, item) / ``temperature`` (Zhai et al. 2024,
    §4.1.1), plus the repeat head's bias (:mod:`hstu.model.repeat`) when given; the one place
    these are formed for evaluation (``history_scores``, ``score_all``) and generation
    (:func:`hstu.generate.sampler.next_scores`).

    Args:
        index: an :class:`ItemIndex` of V = I + 1 rows.
        user: (B, d) L2-normalised user vectors.
        temperature: the model's similarity temperature (> 0).
        repeat: (RepeatBias, static (B, V), in_window (B, V) bool) from ``model.repeat`` and
            ``model.repeat_parts``, or None.
        out: optional (B, V) float32 buffer written in place.
    Returns:
        (B, V) float scores (``out`` when given); row 0 is padding (callers set it to -inf).
    """
    scores = index.cosine(user) if out is None else index.cosine(user, out=out)  # (B, V): a fresh tensor or out
    scores.div_(temperature)
    if repeat is not None:
        module, static, inwin = repeat
        module.add_to(scores, user, static, inwin)
    return scores


def streams(index: ItemIndex, batch: int) -> bool:
    """True when scoring ``batch`` users against ``index`` would build a (batch, V) float32 matrix
    over :data:`STREAM_BYTES`: the callers (evaluation's ranks, generation's picks) then stream
    (:func:`stream_topk`, :func:`stream_ranks`); below it they keep the full (B, V) path. An index
    without a row-range product (:class:`Int8Index`: one prepacked GEMM over the whole table) never
    streams."""
    return type(index).cosine_rows is not ItemIndex.cosine_rows and batch * index.num_rows * 4 > STREAM_BYTES


def chunk_rows(batch: int, k: int = 1, chunk_bytes: int | None = None, align: int = HALF_BLOCK_ROWS) -> int:
    """Rows per streamed block: (batch, rows) float32 within ``chunk_bytes`` (default
    :data:`STREAM_CHUNK_BYTES`), a multiple of ``align`` (the index's own block: its blocks then
    fall where the full product's do, so the streamed scores are the full ones bit for bit), at
    least one ``align`` and ``k``."""
    rows = (STREAM_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * max(batch, 1))
    rows = max(align, rows - rows % align)
    return max(rows, k)


def top_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``x`` (B, C), ties by lower column: (values (B, k)
    descending, columns (B, k) int64), equal to the first k of ``x.sort(descending=True,
    stable=True)``. (CPU ``torch.topk`` leaves the order of ties unspecified; -inf ties too.)"""
    v, i = x.topk(k, dim=1)  # (B, k): the k-th value is exact, which of its ties is not
    thr = v[:, -1:]
    if not bool(((x == thr).sum(dim=1, keepdim=True) > (v == thr).sum(dim=1, keepdim=True)).any()):
        # every tie of the k-th value was taken: the columns are exact, only their order among ties is not
        o = i.argsort(dim=1)
        v, i = v.gather(1, o), i.gather(1, o)  # by column
        o = v.argsort(dim=1, descending=True, stable=True)
        return v.gather(1, o), i.gather(1, o)
    gt, eq = x > thr, x == thr
    need = k - gt.sum(dim=1, keepdim=True)  # ties at the k-th value to keep, lowest columns first
    take = gt | (eq & (eq.cumsum(dim=1) <= need))  # exactly k per row
    cols = take.nonzero()[:, 1].view(x.shape[0], k)  # ascending
    vals = x.gather(1, cols)
    order = vals.argsort(dim=1, descending=True, stable=True)
    return vals.gather(1, order), cols.gather(1, order)


def _block_scores(index, user, temperature, a, b, exclude, exclude_pairs, repeat) -> torch.Tensor:
    """(B, b - a) item_scores of positions [a, b) (:meth:`ItemIndex.item_ids`) with -inf at the dead
    positions (padding row 0) and the exclusions; ``exclude_pairs`` as (rows, positions)."""
    s = index.cosine_rows(user, a, b).div_(temperature)
    ids = index.item_ids(a, b) if repeat is not None or exclude is not None else None  # None: position = item id, or unused
    cols = (lambda m: m[:, a:b]) if ids is None else (lambda m: m.index_select(1, ids.clamp(max=m.shape[1] - 1)))  # overflow ids: dead  # noqa: E731
    if repeat is not None:
        module, static, inwin = repeat
        module.add_to(s, user, cols(static), cols(inwin))
    dead = index.dead_in(a, b)
    if dead:
        s[:, dead] = float("-inf")
    if exclude is not None:
        s.masked_fill_(cols(exclude), float("-inf"))
    if exclude_pairs is not None:
        rows, pos = exclude_pairs
        hit = (pos >= a) & (pos < b)
        s[rows[hit], pos[hit] - a] = float("-inf")
    return s


def stream_topk(
    index: ItemIndex,
    user: torch.Tensor,
    temperature: float,
    k: int,
    *,
    exclude: torch.Tensor | None = None,
    exclude_pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    repeat: tuple | None = None,
    rows: int | None = None,
    lse: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Exact top-k of :func:`item_scores` without the (B, V) matrix: blocks of ``rows`` table
    rows (default :func:`chunk_rows`) scored one at a time, excluded items and the padding row 0
    at -inf, merged into a running top-k (ties by lower item id, :func:`top_rows`).

    Args:
        index, user, temperature, repeat: as :func:`item_scores`.
        k: 1 <= k <= V candidates per row.
        exclude: optional (B, V) bool, True = excluded (sliced per block).
        exclude_pairs: optional (rows (n,), ids (n,)) int64: item ``ids[j]`` excluded for user
            ``rows[j]``; the sparse form for catalogues whose (B, V) mask is itself too large.
        lse: also return each row's logsumexp over all its scores (B,) float32, accumulated
            block by block (``torch.logaddexp``): the log-softmax normaliser beam search needs.
    Returns:
        (values (B, k) float32 descending, item ids (B, k) int64[, logsumexp (B,)]): the first two
        equal to the first k of ``scores.sort(descending=True, stable=True)`` on the full scores.
        An index with an approximate candidate source (:class:`hstu.model.ann.AnnItemIndex`)
        ranks its candidates instead (:func:`hstu.model.ann.ann_topk`).
    Raises:
        ValueError: k outside [1, V].
    """
    V = index.num_rows
    if not 1 <= k <= V:
        raise ValueError(f"stream_topk: k={k} outside [1, {V}] (the table's rows)")
    if getattr(index, "ann", None) is not None:  # approximate candidates, scored exactly (hstu.model.ann)
        from hstu.model.ann import ann_topk

        out = ann_topk(index, user, temperature, k, exclude=exclude, exclude_pairs=exclude_pairs, repeat=repeat, lse=lse)
        if out is not None:
            return out
        index = index.exact
    step = chunk_rows(user.shape[0], k, align=getattr(index, "block", HALF_BLOCK_ROWS)) if rows is None else rows
    best_v = best_i = None
    total = torch.full((user.shape[0],), float("-inf"), device=user.device) if lse else None
    if exclude_pairs is not None:
        exclude_pairs = (exclude_pairs[0], index.positions(exclude_pairs[1]))
    for a, b in index.blocks(step):
        s = _block_scores(index, user, temperature, a, b, exclude, exclude_pairs, repeat)
        if lse:
            total = torch.logaddexp(total, torch.logsumexp(s, dim=1))
        v, i = top_rows(s, min(k, b - a))
        i = index.ids_at(i + a)  # item ids, ascending with the position inside a block
        if best_v is None:
            best_v, best_i = v, i
            continue
        cv, ci = torch.cat([best_v, v], dim=1), torch.cat([best_i, i], dim=1)  # identity order: ids ascending already
        if index.storage_order:  # candidates put in id order: top_rows's lower-column tie rule is then the lower id
            o = ci.argsort(dim=1, stable=True)
            cv, ci = cv.gather(1, o), ci.gather(1, o)
        best_v, pos = top_rows(cv, k)
        best_i = ci.gather(1, pos)
    return (best_v, best_i, total) if lse else (best_v, best_i)


def stream_ranks(
    index: ItemIndex,
    user: torch.Tensor,
    temperature: float,
    targets: torch.Tensor,
    *,
    exclude: torch.Tensor | None = None,
    exclude_pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    repeat: tuple | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """(B,) int64 pessimistic 1-based ranks of ``targets`` (B,) int64 among the scores
    :func:`stream_topk` streams: the count of items scoring >= the target, equal to
    :func:`hstu.train.metrics.target_ranks` on the full (B, V) scores. The target scores are read
    first from the blocks that hold them (the same block calls, so the same float values), then
    every block is counted: V / rows + (distinct target blocks) block products."""
    step = chunk_rows(user.shape[0], align=getattr(index, "block", HALF_BLOCK_ROWS)) if rows is None else rows
    if exclude_pairs is not None:
        exclude_pairs = (exclude_pairs[0], index.positions(exclude_pairs[1]))
    spans = index.blocks(step)
    starts = torch.tensor([a for a, _ in spans], dtype=torch.int64, device=user.device)
    block = lambda j: _block_scores(index, user, temperature, *spans[j], exclude, exclude_pairs, repeat)  # noqa: E731
    t = torch.empty(user.shape[0], 1, dtype=torch.float32, device=user.device)
    tpos = index.positions(targets)
    where = torch.searchsorted(starts, tpos, right=True) - 1  # (B,) the block holding each target
    for j in where.unique().tolist():
        sel = (where == j).nonzero().view(-1)
        t[sel] = block(j)[sel].gather(1, (tpos[sel] - spans[j][0]).view(-1, 1))
    ranks = torch.zeros(user.shape[0], dtype=torch.int64, device=user.device)
    for j in range(len(spans)):
        ranks += (block(j) >= t).sum(dim=1)
    from hstu.train.metrics import UNREACHABLE_RANK  # an excluded (-inf) target: never recommended, as target_ranks

    return ranks.masked_fill_(t.view(-1) == float("-inf"), UNREACHABLE_RANK)


def build_item_index(model) -> ItemIndex:
    """The index for ``model``'s item table (``model.item_emb``): see the module docstring."""
    emb = model.item_emb
    q = getattr(emb, "weight_int8", None)
    if q is not None:
        from hstu.quant.int8 import select_int8_kernel

        kern = select_int8_kernel(q.device)
        if kern.name in ("fbgemm", "onednn", "qnnpack"):
            return Int8Index(q, kern.name)
        log.warning("INT8 item table on %s: no integer kernel for the similarity (%s); float32 rows instead", q.device, kern.reason)
    w = getattr(emb, "weight", None)
    if isinstance(w, torch.Tensor) and w.dtype in (torch.float16, torch.bfloat16):
        return HalfIndex(w.detach())
    rows = model.cfg.num_items + 1
    big = rows * model.cfg.embedding_dim * 4 > ROWS_INDEX_BYTES
    if big and hasattr(emb, "storage_positions") and all(w.dtype in (torch.float16, torch.bfloat16, torch.float32) for w in emb.shards):
        return ShardIndex(emb)
    if hasattr(emb, "rows") and big:
        return RowsIndex(lambda a, b: model.item_vectors(a, b).detach().to(torch.float32), rows)
    return FloatIndex(model.item_vectors())
