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
                (``quantized::linear_dynamic``: the user vectors are quantized per call, 7-bit
                on x86; see hstu.quant.int8). A quarter of the bytes; the similarity is then
                integer, so its quality cost is measured with the scheme (benchmarks/quant.py).
                Without an integer kernel on the device: the float rows, with a warning.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

HALF_BLOCK_ROWS = 2048  # rows widened per block: 2 MB of float32 at d = 256
TABLE_MAJOR_MIN_ELEMENTS = 1 << 20  # float tables from 4 MB: table-major GEMM


class ItemIndex:
    """cosine(user, out=None): (B, d) float32 -> (B, V) float32; written into ``out`` when
    given ((B, V) float32, may be a row slice of a larger buffer). ``nbytes``: memory held."""

    num_rows: int
    nbytes: int

    def cosine(self, user: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


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


class HalfIndex(ItemIndex):
    def __init__(self, rows: torch.Tensor, block: int = HALF_BLOCK_ROWS) -> None:
        self.rows = rows  # (V, d) fp16 / bf16, the model's own table (no copy)
        norm = torch.cat([rows[a : a + block].to(torch.float32).norm(dim=1) for a in range(0, rows.shape[0], block)])
        self.inv_norm = 1.0 / norm.clamp(min=1e-6)  # (V,) float32, as l2_normalize
        self.block = block
        self.buf = torch.empty(min(block, rows.shape[0]), rows.shape[1], dtype=torch.float32, device=rows.device)
        self.num_rows = rows.shape[0]
        self.nbytes = self.inv_norm.numel() * 4 + self.buf.numel() * 4  # beyond the model's table

    def cosine(self, user, out=None):
        V = self.num_rows
        if out is None:
            out = torch.empty(user.shape[0], V, dtype=torch.float32, device=user.device)
        for a in range(0, V, self.block):
            b = min(V, a + self.block)
            w = self.buf[: b - a]
            w.copy_(self.rows[a:b])  # (rows, d) widened to float32
            out[:, a:b].copy_(torch.mm(w, user.T).T)  # (B, rows) dot products
        return out.mul_(self.inv_norm)  # cosine


class Int8Index(ItemIndex):
    def __init__(self, q: torch.Tensor, engine: str) -> None:
        from hstu.quant.int8 import Int8Linear

        norm = q.to(torch.float32).norm(dim=1)
        self.lin = Int8Linear(q.shape[1], q.shape[0], bias=False, kernel=engine)  # the table as a (V x d) Linear
        self.lin.weight_int8 = q  # the model's rows, shared
        self.lin.weight_scale = torch.where(norm > 0, 1.0 / norm.clamp(min=1e-12), torch.ones_like(norm))  # padding row: Q = 0
        self.lin.prepare()
        self.num_rows = q.shape[0]
        self.nbytes = q.numel()  # the prepacked copy of the int8 rows

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


def build_item_index(model) -> ItemIndex:
    """The index for ``model``'s item table (``model.item_emb``): see the module docstring."""
    emb = model.item_emb
    q = getattr(emb, "weight_int8", None)
    if q is not None:
        from hstu.quant.int8 import select_int8_kernel

        kern = select_int8_kernel(q.device)
        if kern.name in ("fbgemm", "qnnpack"):
            return Int8Index(q, kern.name)
        log.warning("INT8 item table on %s: no integer kernel for the similarity (%s); float32 rows instead", q.device, kern.reason)
    w = getattr(emb, "weight", None)
    if isinstance(w, torch.Tensor) and w.dtype in (torch.float16, torch.bfloat16):
        return HalfIndex(w.detach())
    return FloatIndex(model.item_vectors())
