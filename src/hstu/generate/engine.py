"""Bucketed generative inference engine: static shapes per length bucket, a preallocated KV-cache
pool per bucket, graph capture / compilation per bucket, beam search, user-prefix cache.

API (what a server calls)::

    eng = Engine(model, buckets=(20, 50, 100, 200), max_batch=16, k_max=10, device="cpu",
                 kernels=None, graphs="auto", prefix_cache_bytes=0)
    eng.bucket_for(length) -> int                     # bucket edge a history of that length runs in
    eng.warmup() -> dict[int, float]                  # capture / compile every bucket now (s per bucket)
    eng.graph_report() -> list[dict]                  # compiled graphs: key, mode (compiled / loaded / built / fallback), seconds, bytes
    eng.cache_bytes_per_bucket() -> dict[int, int]    # bytes of each bucket's view of the one KV pool
    eng.memory_report() -> dict; eng.release_caches() -> int   # drop the prefix cache (bytes freed)
    res = eng.generate(ids, timestamps, lengths, k, request_time=None, exclude=None,
                       strategy="greedy"|"topk"|"beam", top_k=50, temperature=1.0, beam_width=4,
                       seed=0, actions=None, categories=None, item_category=None,
                       user_ids=None, use_cache=True)
    res: EngineResult(items (B, k), scores (B, k), actions, beam_logprob,
                      bucket (B,), truncated (B,), prefix_rows (B,), warnings)

From a Recommender's prepared histories (what a server does; tests/generate/test_engine.py)::

    b = rec.batch(preps)                                  # padded tensors on the device
    mask = exclusion_mask(I, len(preps), b["ids"] if exclude_history else None, b["lengths"],
                          [p.block for p in preps], device=eng.device)
    res = eng.generate(b["ids"], b["timestamps"], b["lengths"], k, request_time=b["request_time"],
                       exclude=mask, actions=b["actions"], categories=b["categories"],
                       item_category=rec.item_category, user_ids=[...])
    items = [[rec.describe(i, s) for i, s in zip(r, sc)] for r, sc in zip(res.items.tolist(), res.scores.tolist())]

Inputs are padded (B, W) int64 tensors on the engine's device, rows of any lengths in one call
(users are grouped by bucket, chunked by ``max_batch``, results returned in input order).
``exclude`` is the (B, I+1) bool mask of :func:`hstu.generate.sampler.exclusion_mask` (history,
block lists) and gets the generated items added in place; already generated items are always
excluded. Not thread-safe: one caller at a time (a server's batcher thread).

How it works. Symbols: B users, E a bucket's upper edge, C = E + 1 history capacity (row E is a
scratch row for padding writes), K = k_max, R = max_batch pool rows, Ly layers, H heads, N the
model's fixed width, I items.

- Buckets. A history of length L runs in the smallest bucket with E >= L, padded right to E.
  Because the attention divisor is the fixed N and padding rows are masked, padding never
  changes a live row (hstu.py), so bucketed == unbucketed up to float reassociation
  (tests/generate/test_engine.py checks 1e-5). Histories longer than the largest edge keep their most
  recent E events; ``truncated`` reports how many were cut. Under graph capture or compilation
  the batch is padded to the next size in ``batch_sizes`` (default 1, 2, 4, ..., max_batch) so
  every call has a static shape; eager runs any batch size unpadded.
- KV-cache pool, per bucket, allocated once at construction and written in place:
  Ly x R x H x (C + K) x d: history slots 0..C-1 filled by the prefill, then K slots filled
  one per decode step with the generated tokens' K/V (one beam: user b's token s in row b,
  slot C + s; beam search: beam r's tokens in row r of those K slots, while the history, shared
  by all the beams of a user, stays in row b's history slots; beam search reorders only the
  small generated part). No cache growth, no torch.cat, no factory call (empty / zeros /
  arange ...) in the decode loop (tests/generate/test_engine_alloc.py).
- One forward. Every pass below runs the model's own HSTUModel.forward_layers (HSTULayer.forward
  with an AttentionMeta and per-layer KVView pool slices, hstu.model.meta); runners.py builds them
  per bucket, pool.py holds the buffers, decode_loop.py the loops, requests.py the checks.
- Prefill: every row through every layer (their K/V fill the cache), except that in the last
  layer only the last live row, whose output is the user vector, is attended and projected
  (as an LLM prefill computes only the last token's logits). Square causal attention runs in
  ``prefill_blocks`` row blocks from 64 rows on (a block's queries never see later keys; each block's
  time buckets are computed for its own (query, key) pairs only); with several heads, masked scores get a -M bias whose SiLU is
  exactly 0 (kernels/reference.py).
- A decode step with one beam per user (greedy, top-k) attends to a user's history and
  generated slots in one call (per-row key positions and validity set once per request);
  beam search attends to the shared history rows and to each beam's generated rows in two
  pieces and adds them: HSTU attention is pointwise SiLU with no softmax, so A·V splits over
  key segments.
  An appended token has timestamp = request time = the query time, so a cached step equals a
  full recompute of the grown sequence.
- Graphs (``graphs``), one per (bucket, batch size of ``batch_sizes``, step kind: prefill,
  extend of T rows, decode step of W beams), made at warmup or first use: "eager"; "compile"
  (torch.compile, static shapes, one graph each, Inductor's C++ code on the CPU:
  :func:`hstu.backend.graphs.compile_graph`; a graph whose compilation fails runs eager with a
  warning, :meth:`graph_report` says which and how long each took; with ``graph_cache``, AOTInductor
  packages loaded from / built into the run's graph cache, hstu.backend.graph_cache); "cuda_graph"
  (torch.cuda.CUDAGraph); "npu_graph" (torch.npu.NPUGraph where torch_npu has it). "compiled": the
  platform object decides (the device's graph capture where it has one, else "compile"). "auto":
  cuda_graph on CUDA, npu_graph on NPU when available, eager on CPU (whether compiling pays on a
  CPU: benchmarks/generate.py --graphs eager,compiled). The decode loop's scoring, exclusion and
  picks run eagerly between the graphs, on preallocated buffers. Compiled graphs replay without guard
  checks (``guard_checks``, :func:`hstu.backend.graphs.replay_stance`); ``compile_new``: see runners.graph_runner.
- Kernels: the model's own :class:`hstu.model.kernels.KernelSet` (``model.kernels``, the set
  training and evaluation run), or one named from the device backend's registry ("auto": the
  backend's ``default_kernels``; "triton" on CUDA by name).
- Prefix cache (``prefix_cache_bytes`` > 0 and ``user_ids`` given): see prefix_cache.py. A hit copies the cached rows
  0..P-1 into the pool and computes only rows P..L-1 (the new events and the old last row, whose time bias used the old request time).
- Decoding: greedy; "topk" (seeded sampling among the top_k best at ``temperature``; the same
  call with the same seed returns the same items, whatever the prefix cache holds: its chunks stay the uncached
  ones, :func:`hstu.generate.requests.row_groups`; :func:`hstu.generate.sampler.sample_topk`, finite for
  any temperature > 0); "beam" (width W, ranked by the **sum of
  log-probabilities**, log-softmax over the non-excluded items; every beam has length k, so
  length normalisation would not change the ranking; width 1 equals greedy). With a
  next-action head, the predicted action of each generated token is fed to the next step in
  every strategy (decode.py's beam feeds none; the two differ only for such models).
- ``use_cache=False``: the same engine (buckets, kernels, padding) recomputes the whole grown
  sequence at every step, at width E + K: the benchmark's "no cache" side and a second oracle.
- ``streamed`` (item_index.streams for max_batch rows): no (R, I+1) buffers; exact picks block by block
  with sparse exclusions (decode_loop.py); ``exclude=None`` or an Exclusions forms no (B, I+1) mask either.

Errors (ValueError unless noted): k < 1 or k > k_max; an empty history (the model has no
cold-start path: position 0 needs an item; serve popular items upstream); an item id outside
1..num_items in a live position (row and position named); fewer than max(k, beam width) items
left after exclusion (row named); shapes / dtypes; inputs on another device (StrayTensorError).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable, Sequence

import torch

from hstu.backend import for_device
from hstu.backend.graph_cache import CachedRunner, GraphCache
from hstu.backend.graphs import CompiledRunner, replay_stance, runs_as
from hstu.generate import decode_loop, runners
from hstu.generate.hardening import harden
from hstu.generate.pool import BucketPool, batch_sizes_for, kv_pool_for, log_setup
from hstu.generate.prefix_cache import PrefixCache, PrefixEntry
from hstu.generate.requests import EngineResult, EngineCall, check_engine_sizes, prepare_request, row_groups, smallest_edge
from hstu.generate.sampler import MASK_DTYPE, pick
from hstu.model import item_index
from hstu.model.hstu import HSTUModel
from hstu.model.kernels import KernelSet, get_kernels

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (20, 50, 100, 200)
TB_CHUNK_ELEMENTS = 1 << 15  # (query, key) pairs per time-bucket call on CPU: int64 / float64 passes of 256 KB stay in L2


class Engine:
    """See the module docstring. Construction hardens the model (eval, frozen, on ``device``),
    allocates every bucket's pool and logs its bytes.

    Args:
        model: an HSTUModel; moved to ``device`` and hardened in place.
        buckets: increasing bucket edges; the largest must be <= model max_seq_len.
        max_batch: pool rows per bucket (users per chunk; beam search runs max_batch // W users).
        k_max: the largest k a call may ask for (<= model max_output_len).
        device: "cpu", "cuda", "cuda:1", "npu", ... or None for the model's device.
        kernels: None (default) = the model's own set (``model.kernels``, what training and
            evaluation run); or a kernel-set name for the device's backend ("auto" = the backend's
            ``default_kernels``, "reference", "triton", "npu"), resolved by
            :func:`hstu.model.kernels.get_kernels` for the platform object's name.
        graphs: "auto" | "eager" | "compiled" | "compile" | "cuda_graph" | "npu_graph" (module docstring).
        batch_sizes: padded batch sizes (default: powers of two up to max_batch under graph
            capture or compilation, every size 1..max_batch in eager mode).
        prefix_cache_bytes: > 0 enables the user-prefix cache with that LRU bound.
        compile_backend: torch.compile backend under graphs="compile" ("inductor"; "aot_eager"
            traces the same graphs without code generation, which the tests use; or a callable backend).
        graph_cache: under graphs="compile", an :class:`hstu.backend.graph_cache.GraphCache` whose
            AOTInductor packages the graphs load from (or are built into); None: compile in memory.
            Under "auto" where the device has no graph capture: the graphs it holds, eager for the rest.
        ann: an :class:`hstu.model.ann.AnnIndex` of the item rows: streamed picks among its
            ``ann_candidates`` per row, scored exactly (:func:`hstu.model.ann.ann_topk`); None: exact.
    Raises:
        ValueError: bad buckets / sizes / graph mode / kernel-set name (the message quotes the value).
        RuntimeError: a named kernel set that cannot run here (the reason).
    """

    def __init__(
        self,
        model: HSTUModel,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_batch: int = 16,
        k_max: int = 10,
        device: torch.device | str | None = None,
        kernels: str | None = None,
        graphs: str = "auto",
        batch_sizes: Sequence[int] | None = None,
        prefix_cache_bytes: int = 0,
        compile_backend: str | Callable = "inductor",
        graph_cache: GraphCache | None = None,
        ann=None,
        ann_candidates: int | None = None,
    ) -> None:
        self.edges = check_engine_sizes(model.cfg, buckets, max_batch, k_max)
        self.max_batch, self.k_max = int(max_batch), int(k_max)
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        self.platform = for_device(dev)  # graph capture, host or device memory, kernel sets (hstu.backend)
        dev = dev if self.platform.is_host else self.platform.device  # "cuda" -> the current cuda:N
        self.device = dev
        self.model = harden(model.to(dev), dev)
        self.dtype = model.pos_emb.weight.dtype  # activations and KV cache
        with torch.inference_mode():  # similarity / scores: item_vectors' dtype (float32 for 16-bit models)
            self.score_dtype = self.model.item_vectors(0, 1).dtype
        self.kernels: KernelSet = self.model.kernels if kernels is None else get_kernels(self.platform.name, kernels)
        self.graphs = self.platform.resolve_graph_mode(graphs)
        self.cache_only = graphs == "auto" and self.graphs == "eager" and graph_cache is not None  # cached graphs, else eager
        self.graphs = "compile" if self.cache_only else self.graphs
        # causal row blocks of a prefill's attention from 64 rows (1: one square; None: 2, or 4 from 150 rows).
        # Measured (small ML-1M model, one thread, next-5 of 16 histories at bucket 200): 4 blocks with
        # per-block time buckets 1.6x the one square's call, 2 blocks 1.4x; 1.1x at bucket 100
        self.prefill_blocks: int | None = None
        self.tb_chunk_elements = TB_CHUNK_ELEMENTS  # time buckets in groups of batch rows (runners.time_buckets); 0: one call
        self.chunk_time_buckets = self.platform.is_host  # cache-sized passes pay off on host memory
        self.batch_sizes = batch_sizes_for(self.graphs, self.max_batch, batch_sizes)
        self.compile_backend = compile_backend
        self.guard_checks = False  # True: TorchDynamo checks its guards at every graph call (replay_stance)
        self.compile_new = True  # False (a server outside warm-up): a graph first needed now runs eager / cached
        self.graph_cache = graph_cache if self.graphs == "compile" else None
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.ann, self.ann_candidates = ann, ann_candidates  # approximate candidates (hstu.model.ann): streamed picks
        self.kv_pool = kv_pool_for(self, max(self.edges) + 1)  # one KV cache, viewed by every bucket
        self._buckets = {E: BucketPool(self, E, self.kv_pool) for E in self.edges}
        self._recompute: dict[int, BucketPool] = {}  # use_cache=False buckets (width E + K), made on first use
        self.refresh()
        self._decode_buffers()
        log_setup(self)

    def _decode_buffers(self) -> None:
        """The decode loop's buffers, shared by the buckets: (R, I+1) additive exclusion mask (MASK_DTYPE), scores (none when
        ``streamed``: item_index.streams for R rows, decode_loop.py); (R, k_max) picks; allocated once."""
        R, K, I1, dev = self.max_batch, self.k_max, self.model.cfg.num_items + 1, self.device
        self._arange = torch.arange(max(self.model.cfg.width + K + 2, R + 1), device=dev)  # positions and batch rows
        self._bidx = self._arange[:R]
        self.streamed = self.ann is not None or item_index.streams(self._index, R)
        if self.streamed:
            self._excl = self._excl_scratch = self._scores = None
            saved = R * I1 * (2 * MASK_DTYPE.itemsize + self.score_dtype.itemsize) / 2**20
            log.info("engine: streamed scoring of %d rows x %d items: no (R, I+1) score / exclusion buffers (%.1f MiB saved)", R, I1, saved)
        else:
            self._excl = torch.zeros(R, I1, dtype=MASK_DTYPE, device=dev)  # additive: 0, -inf where excluded
            self._excl_scratch = torch.zeros_like(self._excl)
            self._scores = torch.zeros(R, I1, dtype=self.score_dtype, device=dev)
        self._out_items = torch.zeros(R, K, dtype=torch.int64, device=dev)
        self._out_scores = torch.zeros(R, K, dtype=self.score_dtype, device=dev)
        self._out_actions = torch.zeros(R, K, dtype=torch.int64, device=dev)
        self._items_scratch = torch.zeros(R, K, dtype=torch.int64, device=dev)
        self._scores_scratch = torch.zeros(R, K, dtype=self.score_dtype, device=dev)
        self._zero_tb = torch.zeros(R, 1, K, dtype=torch.int64, device=dev)  # bucket(|rt - rt|) = 0
        self._gen = torch.Generator(device=dev)

    # ----- setup -----
    def refresh(self) -> None:
        """Rebuild the similarity index (:mod:`hstu.model.item_index`) after the model's weights change."""
        with torch.inference_mode():
            self._index = self.model.item_index()  # .cosine(user (R, d)) -> (R, I+1), in the table's storage
        if self.ann is not None:  # the approximate index is the caller's: rebuilt by it when the weights change
            from hstu.model.ann import ANN_CANDIDATES, AnnItemIndex, l2_vectors

            cand = self.ann_candidates or ANN_CANDIDATES
            self._index = AnnItemIndex(self._index, self.ann, l2_vectors(self.model), cand)

    # ----- public helpers -----
    def bucket_for(self, length: int) -> int:
        """Edge of the bucket a history of ``length`` events runs in (the largest edge for longer
        histories, which are truncated). ValueError for length < 1."""
        if length < 1:
            raise ValueError(f"history length must be >= 1 (empty history), got {length}")
        return smallest_edge(self.edges, length, truncate=True)

    def cache_bytes_per_bucket(self) -> dict[int, int]:
        """Bytes of each bucket's view of the one preallocated KV pool (history + generated K/V + beam
        scratch); the pool itself is :attr:`kv_pool` (``memory_report()["kv_pool"]``), the largest view."""
        return {E: b.kv_bytes() for E, b in self._buckets.items()}

    def memory_report(self) -> dict:
        """Bytes of the one KV pool, per bucket (kv: its view of the pool, total: with its static
        inputs), decode buffers and the prefix cache."""
        shared = (
            sum(t.numel() * t.element_size() for t in (self._excl, self._excl_scratch, self._scores) if t is not None) + self._index.nbytes
        )
        return {
            "kv_pool": self.kv_pool.nbytes(),
            "buckets": {E: {"kv": b.kv_bytes(), "total": b.total_bytes()} for E, b in self._buckets.items()},
            "shared_decode_buffers": shared,
            "prefix_cache": self.prefix.bytes if self.prefix else 0,
            "prefix_cache_max": self.prefix.max_bytes if self.prefix else 0,
        }

    def release_caches(self) -> int:
        """Drop the user-prefix cache (rebuildable; the KV pools are preallocated and stay).
        Returns the bytes released. For a memory guard under pressure."""
        if self.prefix is None:
            return 0
        freed = self.prefix.bytes
        self.prefix.clear()
        return freed

    def warmup(self, strategies: Sequence[str] = ("greedy",)) -> dict[int, float]:
        """Run every bucket at every batch size once (capturing graphs / compiling now rather than
        on the first request). Returns seconds per bucket edge."""
        out = {}
        for E in self.edges:
            t0 = time.perf_counter()
            for Bp in self.batch_sizes:
                ids = torch.ones(Bp, E, dtype=torch.int64, device=self.device)
                ts = torch.zeros(Bp, E, dtype=torch.int64, device=self.device)
                lengths = torch.full((Bp,), E, dtype=torch.int64, device=self.device)
                for s in strategies:
                    self.generate(ids, ts, lengths, min(2, self.k_max), strategy=s, beam_width=min(2, Bp), request_time=ts[:, 0] + 1)
            out[E] = time.perf_counter() - t0
            log.info("warmup bucket %d (%s): %.2f s", E, self.graphs, out[E])
        return out

    def graph_report(self) -> list[dict]:
        """The compiled runners built so far (graphs "compile"; empty otherwise), one dict each: bucket
        (edge), key (kind, batch size[, T | W]), mode ("compiled" | "eager (fallback)" | "pending"; from a graph
        cache "loaded" | "built" | "fallback"), runs (:func:`hstu.backend.graphs.runs_as`: what runs now),
        compile_s (seconds of the first call: compilation + one run) and error (None, or why it fell back)."""
        pools = [*self._buckets.values(), *self._recompute.values()]
        return [
            {
                "bucket": b.E,
                "key": list(key),
                "mode": r.mode,
                "runs": runs_as(r),
                "compile_s": round(r.compile_s, 3),
                "error": r.error,
                "bytes": r.bytes,
            }
            for b in pools
            for key, r in b.runners.items()
            if isinstance(r, (CompiledRunner, CachedRunner))
        ]

    # ----- compiled / captured pieces -----
    def _runner(self, b: BucketPool, key: tuple, make: Callable) -> Callable[[], torch.Tensor]:
        """The cached runner of ``key``; ``make(eng, b)`` builds its function on the first call only
        (:func:`hstu.generate.runners.graph_runner`: eager, captured, compiled or from the graph cache)."""
        r = b.runners.get(key)
        if r is None:
            r = b.runners[key] = runners.graph_runner(self, b, key, make)
        return r

    # ----- the call -----
    @torch.inference_mode()
    def generate(
        self,
        ids: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        k: int,
        *,
        request_time: torch.Tensor | None = None,
        exclude: torch.Tensor | None = None,
        strategy: str = "greedy",
        top_k: int = 50,
        temperature: float = 1.0,
        beam_width: int = 4,
        seed: int = 0,
        actions: torch.Tensor | None = None,
        categories: torch.Tensor | None = None,
        item_category: torch.Tensor | None = None,
        user_ids: Sequence[Hashable] | None = None,
        use_cache: bool = True,
        bucket: int | None = None,
    ) -> EngineResult:
        """Next-k items for a batch of histories of any lengths.

        Args:
            ids, timestamps: (B, W) int64 dense item ids (1..I) and Unix seconds, oldest first,
                anything after each length (ignored).
            lengths: (B,) int64 >= 1.
            k: 1..k_max steps.
            request_time: (B,) int64 Unix seconds (default: each row's last event time); the
                query time of the last history row and the timestamp of generated tokens.
            exclude: (B, I+1) bool, True = never generate; updated in place with the generated
                items (default: only padding id 0 excluded). Or sampler.Exclusions (pairs, not updated).
            strategy: "greedy" | "topk" | "beam" (see the module docstring).
            actions, categories: optional (B, W) int64 history features (0 = none); categories
                (B, W, 1 + F) for a model with side features (``model.token_shape``, :mod:`hstu.data.features`);
                item_category: (I+1,) int64 category of each item, fed with generated items ((I+1, 1 + F) so).
            user_ids: B hashable user keys for the prefix cache (a tensor's or array's values; None: that row not cached).
            use_cache: False = recompute the grown sequence each step (greedy / topk only).
            bucket: run every row in this bucket (one of ``edges``; each history must fit, after
                truncation to the largest edge) instead of each row's smallest: a server that
                batches short histories with long ones pays one call instead of two. Results are
                the same either way (padding never changes a live row).
        Returns:
            EngineResult, rows in input order.
        Raises:
            ValueError: see the module docstring. StrayTensorError: an input on another device.
        """
        r = prepare_request(
            self, ids, timestamps, lengths, k, request_time=request_time, exclude=exclude, strategy=strategy, top_k=top_k,
            temperature=temperature, beam_width=beam_width, actions=actions, categories=categories, item_category=item_category,
            user_ids=user_ids, use_cache=use_cache, bucket=bucket,
        )  # fmt: skip
        self._gen.manual_seed(seed)
        with replay_stance(self.graphs == "compile" and not self.guard_checks):
            self._run_buckets(r)
        return r.out

    def _run_buckets(self, r: EngineCall) -> None:
        """Every bucket's rows, prefix-cache hits apart from misses, in chunks of max_batch // W users."""
        per_group = max(1, self.max_batch // r.width)
        for E in self.edges:
            rows = [i for i in range(len(r.bucket_of)) if r.bucket_of[i] == E]
            hits: dict[int, tuple[PrefixEntry, int]] = {}  # row -> (entry, its rows P at the lookup)
            if rows and r.events is not None:
                for i in (i for i in rows if r.user_ids[i] is not None):  # None: a row not cached
                    if (e := self.prefix.lookup(r.user_ids[i], r.events[i, : r.lengths[i]])) is not None:
                        hits[i] = (e, e.rows)
            for chunk, used in row_groups(rows, hits, per_group, r.strategy == "topk"):
                for i in (i for i in chunk if i in hits and i not in used):
                    self.prefix.unhit(hits[i][1])  # found, not used: counted a miss
                self._run_group(E, chunk, r, used)

    def _bucket(self, E: int, use_cache: bool) -> BucketPool:
        if use_cache:
            return self._buckets[E]
        if E not in self._recompute:
            self._recompute[E] = BucketPool(self, E + self.k_max, kv_pool_for(self, E + self.k_max + 1))
        return self._recompute[E]

    def _pad_users(self, n: int, W: int) -> int:
        cap = self.max_batch // W
        for s in self.batch_sizes:
            if s >= n and s <= cap:
                return s
        return cap if W > 1 else self.max_batch

    def _run_group(self, E: int, rows: list[int], r: EngineCall, hits: dict[int, tuple[PrefixEntry, int]]) -> None:
        """Rows ``rows`` of the call (one bucket, at most max_batch // W users): load the bucket's
        static inputs, prefill (or copy cached prefixes and extend), decode, write ``r.out``."""
        dev, W, k, req, out, use_cache = self.device, r.width, r.k, r.req, r.out, r.use_cache
        strategy, top_k, temperature = r.strategy, r.top_k, r.temperature
        b = self._bucket(E, use_cache)
        Bu = len(rows)
        Bp = self._pad_users(Bu, W)
        R = Bp * W
        ri = torch.tensor(rows, dtype=torch.int64, device=dev)
        L = req["lengths"][ri]  # (Bu,)
        rt = req["request_time"][ri]
        Eb = b.E
        b.load(req, ri, L, rt, Bp, self._arange)  # static inputs: real rows then padding users (length 1, item 1)
        steps = 0 if not use_cache else (k - 1 if self.graphs == "eager" else self.k_max - 1)  # graphs: one for every k
        self._runner(b, ("setup", Bp, W == 1, steps), lambda e, p: runners.setup_fn(e, p, Bp, W == 1, steps))()
        # ---- encode: prefill, or copy the cached prefix and extend ----
        if hits:
            P = torch.tensor([hits[i][1] for i in rows], dtype=torch.int64, device=dev)
            b.start[:Bp].zero_()
            b.start[:Bu] = P
            b.load_prefixes([hits[i][0] for i in rows], [hits[i][1] for i in rows])
            need = int((L - P).max())
            T = next((s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s >= need and s <= Eb), Eb)
            user = self._runner(b, ("extend", Bp, T), lambda e, p: runners.extend_fn(e, p, Bp, T))()
            out.prefix_rows[ri] = P
        else:
            user = self._runner(b, ("prefill", Bp), lambda e, p: runners.prefill_fn(e, p, Bp))()
        for j, i in enumerate(rows if r.events is not None else ()):  # the prefix cache: rows 0..L-2 of each history
            if r.lengths[i] >= 2 and r.user_ids[i] is not None:  # a hit's entry grows in place unless a row before changed it
                old = hits[i][0] if i in hits and hits[i][0].rows == hits[i][1] else None
                self.prefix.put(r.user_ids[i], b.prefix_entry(j, r.events[i, : r.lengths[i]], old, self.edges[-1]))
        # ---- decode ----
        if W > 1:
            user = user.repeat_interleave(W, dim=0)  # (R, d)
            b.len_r[:R] = b.lengths[:Bp].repeat_interleave(W)
        else:
            b.len_r[:R] = b.lengths[:Bp]
        pairs = decode_loop.load_exclusions(self, req["exclude"], ri, Bu, Bp, W)  # into self._excl, or streamed (row, id) pairs
        b.pos[:R] = b.len_r[:R]
        b.gpos[:R] = b.len_r[:R].view(R, 1) + self._arange[: self.k_max].view(1, self.k_max)
        ic = req["item_category"] if (req["item_category"] is not None and b.has_features[1]) else None
        if use_cache:
            step = self._runner(b, ("step", Bp, W), lambda e, p: runners.step_fn(e, p, Bp, W))
            res = self._decode(b, Bp, W, k, user, step, strategy, top_k, temperature, ic, self._repeat(req, ri, Bp, W), pairs)
        else:
            prefill = self._runner(b, ("prefill", Bp), lambda e, p: runners.prefill_fn(e, p, Bp))
            res = self._decode_recompute(b, Bp, k, user, prefill, strategy, top_k, temperature, ic, self._repeat(req, ri, Bp, 1), pairs)
        items, scores, acts, blp, final_excl = res
        out.items[ri] = items[:Bu]
        out.scores[ri] = scores[:Bu]
        if out.actions is not None and acts is not None:
            out.actions[ri] = acts[:Bu]
        if out.beam_logprob is not None and blp is not None:
            out.beam_logprob[ri] = blp[:Bu]
        decode_loop.store_exclusions(req["exclude"], ri, None if final_excl is None else final_excl[:Bu], items[:Bu])

    def _repeat(self, req: dict, ri: torch.Tensor, Bp: int, W: int) -> tuple | None:
        """The repeat head's bias of a group (rows ``ri`` of the request, padded to Bp users, each
        repeated for its W beams): (model.repeat, static (Bp*W, I+1), in_window (Bp*W, I+1) bool),
        as :func:`hstu.generate.sampler.next_scores` takes it; None without a repeat head. Fixed
        while generating (the history's window; generated items add none, as decode.py)."""
        m = self.model
        if m.repeat is None:
            return None
        parts = m.repeat_parts(req["ids"][ri], req["actions"][ri], req["lengths"][ri])  # (Bu, I+1) each
        pad = Bp - len(ri)
        static, inwin = (torch.nn.functional.pad(t, (0, 0, 0, pad)).repeat_interleave(W, dim=0) for t in parts)  # (Bp*W, I+1)
        return m.repeat, static, inwin

    def _pick(self, scores: torch.Tensor, strategy: str, top_k: int, temperature: float) -> torch.Tensor:
        return pick(scores, strategy, top_k, temperature, self._gen)  # the shared, underflow-safe sampler

    def _next_action(self, user: torch.Tensor) -> torch.Tensor | None:
        if self.model.action_head is None:
            return None
        return self.model.action_head(user)[:, 1:].argmax(dim=1) + 1

    _decode = decode_loop.decode  # methods of the engine, kept in their own module (tests wrap Engine._decode)
    _decode_recompute = decode_loop.decode_recompute


__all__ = ["Engine", "EngineResult", "DEFAULT_BUCKETS"]
