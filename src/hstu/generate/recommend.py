"""Recommender: a run directory's model + id map, turning raw histories into next-k items.

Used by ``hstu generate``, the Python API and the HTTP service, which all generate through one
:class:`hstu.generate.engine.Engine` call, :meth:`Recommender.recommend`: the histories padded
into tensors (to a bucket's edge for the server's static shapes), the never-generate mask
(:meth:`Recommender.exclusion`), the engine, the items described in original ids. The
Recommender owns a default engine (:attr:`Recommender.engine`, built on first use with
:func:`default_buckets`); the server builds one per served bucket layout
(:meth:`Recommender.build_engine`) and passes it. Input is validated here (the edge): unknown
item ids (policy "drop" with a warning, or "reject"), empty histories, over-long histories
(the most recent ``max_seq_len`` events are kept and the response says how many were cut),
non-monotonic timestamps (policy "sort", stable, or "reject").

Items without training events (``idmap.json`` ``item_train_counts`` == 0, e.g. the catalogue
items no user of a ``--max-users`` run touched) are never generated unless asked for
(``allow_untrained``), since their embeddings are the random init; runs trained with
``cold_item_dropout`` > 0 allow them by default (trained to take cold items). A history holding
such items gets a warning. A run without counts (older runs) counts every item as trained.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from hstu import backend
from hstu.backend.graph_cache import GraphCache
from hstu.config import DecodeOptions
from hstu.generate.api_checks import check_preps, decode_options, flag_arg, k_arg
from hstu.generate.engine import DEFAULT_BUCKETS, Engine
from hstu.generate.event_tokens import event_tokens
from hstu.generate.hardening import harden
from hstu.generate.histories import History, HistoryError, Prepared, Ranked, check_event_int, event_times  # noqa: F401 (their home)
from hstu.generate.requests import smallest_edge
from hstu.generate.sampler import Exclusions, exclusion_mask, exclusion_pairs
from hstu.data.features import FeatureMaps
from hstu.data.sequences import IdIndex
from hstu.model.hstu import HSTUModel

log = logging.getLogger(__name__)


# pool rows of the Recommender's own engine: a beam of the widest width (hstu.config.BEAM_WIDTH_MAX) fits
ENGINE_MAX_BATCH = 16


def default_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Bucket edges of the Recommender's own engine: the engine's default edges (20, 50, 100, 200)
    below ``max_seq_len``, then ``max_seq_len`` itself, so every prepared history fits (e.g.
    max_seq_len 50 -> (20, 50); 300 -> (20, 50, 100, 200, 300))."""
    return tuple(b for b in DEFAULT_BUCKETS if b < max_seq_len) + (int(max_seq_len),)


class _NoRandomInit(TorchFunctionMode):
    """Skips the initialisers (``torch.nn.init.*``, ``Tensor.normal_`` / ``uniform_``) of a model built on
    the meta device, whose values do not exist anyway: on meta tensors they run through ``torch._refs``,
    which imports ``torch._dynamo`` and through it triton, whose extension prints reference-leak lines
    at every exit of the HTTP process (:meth:`Recommender.mapping_only`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in (torch.Tensor.normal_, torch.Tensor.uniform_):
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)


class Recommender:
    """A run's model and id map: raw :class:`History` -> :class:`Prepared` -> next-k items (module doc: the policies).

    Symbols: B histories of a call, n events kept (<= max_seq_len), k items (1..max_output_len).

    - :meth:`from_run` (run_dir, device, precision) loads a run; :meth:`mapping_only` its id map alone.
    - :meth:`prepare` (History) -> :class:`Prepared`: (n,) int64 dense ids, timestamps, actions,
      categories, with warnings. HistoryError (a ValueError) naming the field and index, with the
      messages of ``hstu generate --history`` (``history[0].timestamp must be an integer, got 1.9``).
    - :meth:`recommend` (B Prepared, k, decoding: :class:`hstu.config.DecodeOptions` or its fields as
      keywords, exclude_history, allow_untrained) -> B lists of k dicts {"item_id", "score"(float), and
      "title" / "action" / "category" / "meta" where known}; :meth:`rank` the same as B :class:`Ranked`
      ((k,) int64 dense ids, (k,) float scores). TypeError for a History not prepared or a decoding
      not a DecodeOptions; ValueError for a k not an int in range (a bool neither), a bad decoding
      field, or fewer than max(k, beam width) items left (:meth:`check_room`).

    Threads: safe to share. One lock (reentrant) guards the default :attr:`engine`'s construction and
    every generation, whichever engine runs it (an engine holds static buffers: one call at a time), so
    concurrent :meth:`rank` / :meth:`recommend` calls serialize; prepare and describe run unlocked."""

    def __init__(self, model: HSTUModel, idmap: dict, device: str = "cpu") -> None:
        self.model = model.eval()
        self.device = backend.select(device).device
        self.idmap = idmap
        self.ids = IdIndex(idmap["item_raw_ids"])  # original -> dense (int64 or text ids)
        raw = np.asarray(idmap["item_raw_ids"], dtype=object if self.ids.text else np.int64)
        self.raw_ids = raw  # (I+1,) original id of each dense id
        self.titles = idmap.get("titles", {})
        self.item_meta: dict[str, dict] = idmap.get("item_meta") or {}  # str(original id) -> {column: value} (--items FILE)
        self.item_category_np = np.asarray(idmap.get("item_category", np.zeros(len(raw), np.int64)), dtype=np.int64)  # (I+1,) for prepare
        self.item_category = torch.from_numpy(self.item_category_np).to(self.device)  # (I+1,) for generation
        self.category_raw = idmap.get("category_raw_ids")
        # side features (hstu.data.features): the run's maps, when the model reads them, and the (I+1, 1+F)
        # item token columns [category, features...] of prepare and generation (the category alone without)
        self.features = FeatureMaps(idmap.get("features") if model.token_shape else None)
        self.item_tokens_np = (
            np.column_stack([self.item_category_np, np.asarray(idmap["item_features"], dtype=np.int64)])
            if self.features.names
            else self.item_category_np
        )
        self.item_tokens = torch.from_numpy(self.item_tokens_np).to(self.device)
        self.action_names: list[str] = idmap.get("action_names", [])
        self.exclude_history_default = bool(idmap.get("exclude_history_default", True))
        self.untrained_np = _untrained(idmap.get("item_train_counts"), len(raw))  # (I+1,) bool or None
        self.untrained = None if self.untrained_np is None else torch.from_numpy(self.untrained_np).to(self.device)
        self.num_untrained = 0 if self.untrained_np is None else int(self.untrained_np.sum())
        self.allow_untrained_default = float(getattr(model.cfg, "cold_item_dropout", 0.0)) > 0
        self._engine: Engine | None = None
        self._lock = threading.RLock()  # the default engine's construction and every generation (class doc)
        self.run_dir: Path | None = None  # set by from_run: where the graph cache lives (RUN/graphs)

    def build_engine(self, buckets=None, max_batch: int = ENGINE_MAX_BATCH, **engine_kwargs) -> Engine:
        """A new :class:`hstu.generate.engine.Engine` for this run's model on its device, k_max =
        the model's max_output_len; ``buckets`` default :func:`default_buckets`; other keywords
        (graphs, kernels, prefix_cache_bytes, ...) go to the engine; graphs "compiled" (and "auto" on
        the CPU) load from the run's graph cache where one was built (``hstu export --graphs``). Raises
        ValueError as the engine (buckets past max_seq_len, max_batch < 1, ...)."""
        cfg = self.model.cfg
        buckets = tuple(buckets or default_buckets(cfg.max_seq_len))
        graphs = engine_kwargs.get("graphs", "auto")
        if graphs in ("auto", "compiled", "compile") and "graph_cache" not in engine_kwargs:
            auto = graphs == "auto"  # only a cache with graphs for this engine (precision, layout); else eager, unwarned
            lay = (buckets, max_batch)
            engine_kwargs["graph_cache"] = GraphCache.beside(self.run_dir, self.model, self.device, holding=auto, layout=lay)
        if self.ann is not None:  # :meth:`attach_ann`
            engine_kwargs = {"ann": self.ann, "ann_candidates": self.ann_candidates, **engine_kwargs}
        return Engine(
            self.model,
            buckets=buckets,
            max_batch=max_batch,
            k_max=cfg.max_output_len,
            device=self.device,
            **engine_kwargs,
        )

    ann = None  # an hstu.model.ann.AnnIndex of the item rows (attach_ann), or None: exact picks
    ann_candidates: int | None = None

    def attach_ann(self, factory: str | None, nprobe: int | None = None, candidates: int | None = None) -> None:
        """Generate from approximate candidates from now on (``hstu generate / serve --ann``): an
        :class:`hstu.model.ann.AnnIndex` of ``factory`` (a faiss index_factory string; None or ""
        does nothing) probing ``nprobe`` IVF cells (default 16), loaded from RUN/ann/ or built and
        stored there (:func:`hstu.model.ann.ann_for_run`); each engine built after this rescores
        ``candidates`` per row (default :data:`hstu.model.ann.ANN_CANDIDATES`) exactly. Raises
        ImportError without faiss, ValueError for a factory faiss rejects or a table the index
        cannot rescore (INT8) or a Recommender without a run directory."""
        if not factory:
            return
        from hstu.model.ann import ann_for_run

        if self.run_dir is None:
            raise ValueError("--ann: the approximate index is kept beside a run; load the Recommender with from_run")
        try:
            index = ann_for_run(self.run_dir, self.model, factory, nprobe=nprobe or 16)
        except ImportError as exc:  # faiss is an optional extra: a usage error, said in one line
            raise ValueError(f"--ann: {exc}") from None
        with self._lock:  # not while a generation runs on the engine this drops
            self.ann, self.ann_candidates, self._engine = index, candidates, None

    def engine_for(self, preps: list[Prepared], decoding: DecodeOptions, graphs: str = "eager") -> Engine:
        """The smallest engine for one call on ``preps``: the one default bucket that holds the
        longest history, rows for the batch (x beam width), ``graphs`` (eager). What a one-shot ``hstu
        generate`` builds: a third of the default engine's construction here (pools of one
        bucket), and the same results (each row runs in that bucket either way). With compiled graphs and a
        graph cache, a layout its graphs were built for (``hstu export --graphs``: the server's), whose graphs it then loads."""
        W = decoding.beam_width if decoding.strategy == "beam" else 1
        L = max(len(p.ids) for p in preps)
        lays = GraphCache.layouts(self.run_dir) if graphs in ("auto", "compiled") else []
        if lay := next((x for x in lays if W <= x["max_batch"] and L <= max(x["buckets"])), None):  # the first recorded that fits
            return self.build_engine(tuple(lay["buckets"]), max_batch=lay["max_batch"], graphs=graphs)
        E = smallest_edge(default_buckets(self.max_len), L)  # prepared histories fit: max_len is the last edge
        return self.build_engine((E,), max_batch=max(W, min(len(preps), ENGINE_MAX_BATCH // W) * W), graphs=graphs)

    @property
    def engine(self) -> Engine:
        """The engine :meth:`recommend` uses by default, built on first use: default buckets,
        ENGINE_MAX_BATCH rows, eager (a one-shot ``hstu generate`` pays no graph capture; build
        one with graphs="auto" for many calls on CUDA)."""
        with self._lock:  # one engine, however many threads ask first
            if self._engine is None:
                self._engine = self.build_engine(graphs="eager")
            return self._engine

    @classmethod
    def from_run(cls, run_dir, device: str = "cpu", precision: str | None = None) -> "Recommender":
        """Load a float or quantized run; ``precision`` ("fp32" | "bf16" | "fp16" | "int8" | None
        = as saved) converts a float run in memory (:func:`hstu.quant.load_for_inference`).
        Raises FileNotFoundError (not a run), QuantCheckpointError / ValueError (precision)."""
        from hstu.quant.checkpoint import load_for_inference

        model, _, ids = load_for_inference(run_dir, device, precision)
        rec = cls(harden(model, backend.select(device).device), ids, device)
        rec.run_dir = Path(run_dir)
        return rec

    @classmethod
    def mapping_only(cls, run_dir) -> "Recommender":
        """The id map, titles and the model's config of a run, without its weights: the model is
        built on PyTorch's "meta" device (shapes, no storage), so ``prepare`` / ``batch`` /
        ``describe`` work and nothing can run it. What an HTTP process needs when a model process
        holds the weights: no second full-size copy of the tables. Raises FileNotFoundError /
        ValueError naming a missing or broken run file."""
        from hstu.config import model_config_from_dict
        from hstu.model.checkpoint import read_idmap, read_json
        from hstu.model.hstu import build_hstu

        cfg, ids = read_json(Path(run_dir) / "config.json"), read_idmap(run_dir)  # with a large catalogue's items.npz
        with torch.device("meta"), _NoRandomInit():
            model = build_hstu(model_config_from_dict(cfg["model"]))
        return cls(model, ids, "cpu")

    @property
    def max_len(self) -> int:
        return self.model.cfg.max_seq_len

    def prepare(self, h: History, unknown: str = "drop", order: str = "sort") -> Prepared:
        """Validate and map one history. Raises HistoryError naming the field/index; TypeError for ``h`` not a
        History, ValueError for ``unknown`` not drop / reject or ``order`` not sort / reject."""
        if not isinstance(h, History):
            raise TypeError(f"prepare takes a History (hstu.History(items=[...], timestamps=[...])), got {type(h).__name__}")
        if unknown not in ("drop", "reject") or order not in ("sort", "reject"):
            raise ValueError(f"unknown must be 'drop' or 'reject' and order 'sort' or 'reject', got {unknown!r} and {order!r}")
        n = len(h.items)
        if n == 0:
            raise HistoryError("history: empty; at least one event is needed")
        if len(h.timestamps) != n or (h.actions is not None and len(h.actions) != n):
            raise HistoryError(f"history: items ({n}), timestamps ({len(h.timestamps)}) and actions must have equal lengths")
        warnings: list[str] = []
        ts = event_times(h.timestamps)  # (n,) int64; the checks and messages of `hstu generate --history`
        if h.request_time is not None:
            check_event_int("history", "request_time", h.request_time)
        idx = np.arange(n)
        if (np.diff(ts) < 0).any():
            if order == "reject":
                bad = int(np.nonzero(np.diff(ts) < 0)[0][0]) + 1
                raise HistoryError(f"history[{bad}].timestamp: earlier than the event before it (timestamps must not decrease)")
            idx = np.argsort(ts, kind="stable")
            warnings.append("history was not in time order; sorted by timestamp (stable)")
        dense_all = self.dense_ids(h.items)  # (n,) 0 = unknown
        known = dense_all[idx] > 0
        if unknown == "reject" and not known.all():
            i = int(idx[np.argmin(known)])
            raise HistoryError(f"history[{i}].item_id: unknown item id {h.items[i]}")
        keep_a, ids = idx[known], dense_all[idx][known]
        if len(keep_a) < n:
            gone = [h.items[i] for i in idx[~known]]  # named, as the untrained-items warning names them (the first 5)
            more = f", ... ({len(gone)} in all)" if len(gone) > 5 else ""
            warnings.append(f"dropped {len(gone)} event(s) with unknown item ids: {', '.join(map(repr, gone[:5]))}{more}")
        if not len(keep_a):
            raise HistoryError("history: no known item ids left after dropping unknown ones")
        older = ids[: max(0, len(ids) - self.max_len)]  # known events the model will not read: still history to exclude
        if len(keep_a) > self.max_len:
            warnings.append(f"history has {len(keep_a)} events; kept the most recent {self.max_len}")
            keep_a, ids = keep_a[-self.max_len :], ids[-self.max_len :]
        acts = self._action_ids(h.actions, keep_a, warnings)
        self._warn_untrained(ids, warnings)
        # NumPy, not a torch op: in the HTTP process a torch op releases the GIL and may wait to get it
        # back from the executor threads (measured: ~0.2 ms per request under load vs ~1 us here)
        cats = event_tokens(self.features, self.item_tokens_np, h, ids, keep_a, warnings)
        rt = int(h.request_time) if h.request_time is not None else int(ts[keep_a].max())
        if rt < int(ts[keep_a].max()):
            warnings.append("request_time is earlier than the last event; using the last event's time")
            rt = int(ts[keep_a].max())
        block = [int(d) for d in self.dense_ids(h.exclude, "exclude[{i}]") if d > 0] if h.exclude else []
        return Prepared(ids, ts[keep_a], acts, cats, rt, warnings, block, older)

    def _warn_untrained(self, ids: np.ndarray, warnings: list[str]) -> None:
        """Append a warning when the kept history ``ids`` ((n,) dense) hold items without training events."""
        if self.untrained_np is None:
            return
        cold = self.untrained_np[ids]
        if cold.any():
            raw = sorted(set(self.raw_ids[ids[cold]].tolist()))
            how = (
                "the model ignores their embeddings (cold_item_dropout)"
                if self.allow_untrained_default
                else "their embeddings were never trained, so they carry no signal"
            )
            more = f" (+{len(raw) - 10} more)" if len(raw) > 10 else ""
            warnings.append(f"history holds {int(cold.sum())} event(s) of item(s) with no training events {raw[:10]}{more}: {how}")

    def allows_untrained(self, allow_untrained: bool | None) -> bool:
        """Whether items without training events may be generated: ``allow_untrained``, or by
        default only for a run trained with cold_item_dropout > 0."""
        allow_untrained = flag_arg(allow_untrained, "allow_untrained")
        return self.allow_untrained_default if allow_untrained is None else allow_untrained

    def check_room(
        self, prep: Prepared, need: int, *, exclude_history: bool | None, allow_untrained: bool | None, field: str = "exclude"
    ) -> None:
        """Raise HistoryError("{field}: ...") when fewer than ``need`` items (k, or max(k, beam
        width)) are left to generate for ``prep`` after its block list, its history (when
        excluded) and the items without training events (unless allowed). The one check every
        caller runs before a request joins a batch (each row of a batch must pass it, else
        ``generate`` raises for the whole batch)."""
        I = self.model.cfg.num_items
        if prep.block:
            block = np.unique(np.asarray(prep.block, dtype=np.int64))
            block = block[(block > 0) & (block <= I)]
        else:
            block = np.zeros(0, np.int64)
        if not self._excl_hist(exclude_history):
            hist = np.zeros(0, np.int64)
        else:
            seen = np.concatenate([prep.ids, prep.older]) if len(prep.older) else prep.ids
            hist = np.setdiff1d(seen, block) if len(block) else np.unique(seen)
        cold = 0
        if self.untrained_np is not None and not self.allows_untrained(allow_untrained):
            cold = self.num_untrained - int(self.untrained_np[block].sum()) - int(self.untrained_np[hist].sum())
        left = I - len(block) - len(hist) - cold
        if left < need:
            raise HistoryError(
                f"{field}: only {left} of the run's {I} items are left to generate ({len(block)} excluded by "
                f"'exclude', {len(hist)} history items, {cold} items without training events), fewer than "
                f"the {need} needed (k, or the beam width if larger)"
            )

    def _excl_hist(self, exclude_history: bool | None) -> bool:
        exclude_history = flag_arg(exclude_history, "exclude_history")
        return self.exclude_history_default if exclude_history is None else exclude_history

    def exclusion(
        self, b: dict[str, torch.Tensor], preps: list[Prepared], exclude_history: bool | None, allow_untrained: bool | None, sparse=False
    ) -> torch.Tensor | Exclusions:
        """(B, I+1) bool never-generate mask of a batch (``b`` from :meth:`batch`): padding, the
        block lists, the histories when excluded (with their ``older`` events), and the untrained items
        unless allowed; the one mask builder of every generation path (``recommend`` and the server's
        engine adapter). ``sparse``: the same set as :class:`hstu.generate.sampler.Exclusions` (a streamed engine's)."""
        never, hist = None if self.allows_untrained(allow_untrained) else self.untrained, self._excl_hist(exclude_history)
        blocks = [p.block + p.older.tolist() if hist and len(p.older) else p.block for p in preps]
        ids = b["ids"] if hist else None
        return (exclusion_pairs if sparse else exclusion_mask)(
            self.model.cfg.num_items, len(preps), ids, b["lengths"], blocks, self.device, never
        )

    def ranked(self, items: torch.Tensor, scores: torch.Tensor, actions: torch.Tensor | None, k: int) -> list[Ranked]:
        """One :class:`Ranked` per row of (B, >= k) generated ``items`` / ``scores`` / ``actions``
        (host arrays; bfloat16 scores widened to float32, exactly). Raises ValueError naming the
        row when a score is not finite (JSON has no inf / nan)."""
        bad = (~torch.isfinite(scores[:, :k])).nonzero()
        if len(bad):
            r, j = (int(v) for v in bad[0])
            raise ValueError(f"generation produced a non-finite score ({float(scores[r, j])}) at row {r}, step {j}")
        sc = scores[:, :k].float() if scores.dtype == torch.bfloat16 else scores[:, :k]
        it, sc = items[:, :k].cpu().numpy(), sc.cpu().numpy()
        acts = actions[:, :k].cpu().numpy() if actions is not None else None
        return [Ranked(it[i], sc[i], acts[i] if acts is not None else None) for i in range(len(it))]

    def describe_ranked(self, r: Ranked) -> list[dict]:
        """The item dicts (:meth:`describe`) of one history's :class:`Ranked` items, in rank order."""
        acts = r.actions.tolist() if r.actions is not None else [None] * len(r.items)
        return [self.describe(i, s, a) for i, s, a in zip(r.items.tolist(), r.scores.tolist(), acts)]

    def _action_ids(self, actions: list[str] | None, keep: np.ndarray, warnings: list[str]) -> np.ndarray:
        """(len(keep),) int64 action ids (1.. in ``action_names`` order, 0 = none) of the kept
        events; an action this run does not know counts as none, with a warning that names it."""
        if not actions or not any(a is not None for a in actions):
            return np.zeros(len(keep), np.int64)
        if not self.action_names:
            warnings.append("this run has no action types; the events' actions were ignored")
            return np.zeros(len(keep), np.int64)
        lut = {a: i + 1 for i, a in enumerate(self.action_names)}
        acts = np.array([lut.get(str(actions[i]), 0) if actions[i] is not None else 0 for i in keep], np.int64)
        unknown = sorted({str(actions[i]) for i in keep if actions[i] is not None and str(actions[i]) not in lut})
        if unknown:
            warnings.append(f"unknown action(s) {unknown[:5]} (this run's: {self.action_names}); those events count as no action")
        return acts

    def dense_ids(self, raw_ids, where: str = "history[{i}].item_id") -> np.ndarray:
        """Original item ids (int or text) -> (n,) int64 dense ids, 0 where unknown
        (:class:`hstu.data.sequences.IdIndex`). Raises HistoryError naming ``where`` (``{i}``: the
        index) for a value that is no id of this run's kind (a bool, a non-integer text for
        integer ids, an empty text)."""
        try:
            return self.ids.dense(raw_ids, where)
        except ValueError as exc:
            raise HistoryError(str(exc)) from None

    def batch(self, preps: list[Prepared], width: int | None = None) -> dict[str, torch.Tensor]:
        """Right-padded tensors (B, W) for prepared histories; W = width or the longest."""
        W = width or max(len(p.ids) for p in preps)
        B = len(preps)
        # filled in NumPy, one tensor per field: a row copy is ~1 us there, several torch ops here
        host = {k: np.zeros((B, W), dtype=np.int64) for k in ("ids", "timestamps", "actions")}
        host["categories"] = np.zeros((B, W, *self.item_tokens_np.shape[1:]), dtype=np.int64)  # (B, W[, 1+F])
        for b, p in enumerate(preps):
            L = len(p.ids)
            host["ids"][b, :L] = p.ids
            host["timestamps"][b, :L] = p.timestamps
            host["actions"][b, :L] = p.actions
            host["categories"][b, :L] = p.categories
        host["lengths"] = np.array([len(p.ids) for p in preps], dtype=np.int64)
        host["request_time"] = np.array([p.request_time for p in preps], dtype=np.int64)
        return {k: torch.from_numpy(v).to(self.device) for k, v in host.items()}

    def describe(self, dense: int, score: float, action: int | None = None) -> dict:
        raw = self.raw_ids[dense]
        raw = raw if self.ids.text else int(raw)
        item = {"item_id": raw, "score": float(score)}
        title = self.titles.get(str(raw))
        if title is not None:
            item["title"] = title
        if action is not None and 0 < action <= len(self.action_names):
            item["action"] = self.action_names[action - 1]
        if self.category_raw is not None:
            item["category"] = int(self.category_raw[int(self.item_category[dense])])
        meta = self.item_meta.get(str(raw))
        if meta:
            item["meta"] = meta
        return item

    def recommend(self, preps: list[Prepared], k: int = 5, **options) -> list[list[dict]]:
        """Next-k items for each prepared history: one list of k item dicts (:meth:`describe`)
        per history, in order. ``options`` and errors as :meth:`rank`, whose items these are."""
        return [self.describe_ranked(r) for r in self.rank(preps, k, **options)]

    @torch.inference_mode()
    def rank(
        self,
        preps: list[Prepared],
        k: int = 5,
        *,
        decoding: DecodeOptions | None = None,
        exclude_history: bool | None = None,
        allow_untrained: bool | None = None,
        engine: Engine | None = None,
        bucket: int | None = None,
        user_ids: list | None = None,
        **decode_kwargs,
    ) -> list[Ranked]:
        """Next-k items for each prepared history, through the engine, as dense ids: one
        :class:`Ranked` per history, in order (:meth:`recommend` describes them).

        Args:
            preps: histories from :meth:`prepare` (1..max_seq_len known events each).
            k: 1..the model's max_output_len.
            decoding: the decoding options; or give their fields as keywords (``strategy``,
                ``top_k``, ``temperature``, ``beam_width``, ``seed``; not both). Top-k draws
                from one generator seeded with ``seed`` over the whole batch (the server runs
                each top-k request alone, so there a seed gives the same items in any batch).
            exclude_history: None = the data set's default; allow_untrained: see :meth:`allows_untrained`.
            engine: the engine to run (default :attr:`engine`); bucket: one of its edges to pad
                every history to (static (B, E) inputs; the server's), default each row's smallest. user_ids: one key
                per history for an engine with a user-prefix cache (``prefix_cache_bytes``; None entries are not cached).
        Raises:
            TypeError: ``preps`` not a list of Prepared (a History: call :meth:`prepare` first);
                ``decoding`` not a DecodeOptions; an unknown decoding keyword.
            ValueError: k not an int (a bool neither) in 1..max_output_len (:func:`hstu.config.check_k`); bad decoding options;
                a history whose exclusions leave fewer than max(k, beam width) items (check
                :meth:`check_room` first); as the engine.
        """
        d = decode_options(decoding, decode_kwargs)  # TypeError / ValueError naming decoding or the field
        k = k_arg(k, self.model.cfg.max_output_len)
        check_preps(preps)
        if not preps:
            return []
        b = self.batch(preps, width=bucket)  # (B, E) or (B, longest)
        with self._lock:  # an engine is one caller at a time (class doc)
            eng = engine if engine is not None else self.engine
            mask = self.exclusion(b, preps, exclude_history, allow_untrained, sparse=eng.streamed)  # (B, I+1), or pairs
            res = eng.generate(
                b["ids"],
                b["timestamps"],
                b["lengths"],
                k,
                request_time=b["request_time"],
                exclude=mask,
                actions=b["actions"],
                categories=b["categories"],
                item_category=self.item_tokens,
                bucket=bucket,
                user_ids=user_ids,
                **vars(d),  # strategy, top_k, temperature, beam_width, seed (a flat dataclass: no deep copy as asdict)
            )
        return self.ranked(res.items, res.scores, res.actions, k)


def _untrained(counts, n: int) -> np.ndarray | None:
    """(n,) bool, True = dense id with no training event (padding 0 False), from idmap.json's
    ``item_train_counts``; None when the run has none (or a count list of another length)."""
    if counts is None:
        return None
    if len(counts) != n:
        log.warning("idmap.json item_train_counts has %d entries for %d ids; every item counts as trained", len(counts), n)
        return None
    out = np.asarray(counts) == 0  # a list, or items.npz's array in its stored dtype (no int64 copy)
    out[0] = False
    return out
