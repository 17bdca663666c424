"""The batch job of :mod:`hstu.generate.batch` on a cluster engine: Ray Data.

``hstu generate --run RUN --all-users --out recs.parquet --engine ray [--ray-address auto]
[--workers W]``. The driver (the command) reads the data set once and cuts the users into the
same chunks as the local job; Ray Data maps the engine over them:

    ray.data.from_items(one row per chunk: index, users, their histories)
        .map_batches(RayChunkGenerator, batch_size=1, concurrency=W, num_cpus=..., num_gpus=...)

Each of the W actors loads the run once (:class:`hstu.generate.batch.ChunkGenerator`, so the
rows are the ones the local job computes) and returns one Arrow table per chunk. The driver
streams the results back (``Dataset.iter_batches``) and writes each finished chunk into the same
``OUT.parts/`` as the local job, so a cluster job resumes like a local one (finished chunks are
not sent again) and no shared file system is needed. See the Ray Data docs, "Transforming data"
(stateful transforms with a callable class) and "Iterating over data".

Without ``address``, a local Ray instance is started (and stopped at the end); an already
initialised Ray (``ray.init`` by the caller) is used as it is. Each actor gets
``cluster CPUs // W`` CPUs (torch threads = that, or ``threads``) and ``gpus`` GPUs. Needs ``pip install
'hstu[ray]'`` (``ray[data]``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from hstu.generate.batch import BatchSpec, ChunkGenerator, History

log = logging.getLogger(__name__)


class RayChunkGenerator:
    """A Ray Data stateful transform: one :class:`ChunkGenerator` per actor; called on a batch of
    chunk rows (a ``pyarrow.Table`` of columns chunk, users, items, timestamps, actions), returns
    their output rows as one table (the batch columns plus ``_chunk``, ``_pos``: the chunk index
    and row order, for the driver)."""

    def __init__(self, spec: BatchSpec, threads: int) -> None:
        self.gen = ChunkGenerator(spec, threads)

    def __call__(self, batch):
        import pyarrow as pa

        from hstu.generate.batch import arrow_schema

        out = {name: [] for name, _ in self.gen.columns}
        chunk = []
        for row in batch.to_pylist():
            acts = row.get("actions")
            hs = [History(i, t, a) for i, t, a in zip(row["items"], row["timestamps"], acts or [None] * len(row["users"]))]
            cols = self.gen(row["users"], hs)
            for name in out:
                out[name].extend(cols[name])
            chunk.extend([row["chunk"]] * len(cols["user_id"]))
        schema = arrow_schema(self.gen.columns).append(pa.field("_chunk", pa.int64())).append(pa.field("_pos", pa.int64()))
        return pa.table({**out, "_chunk": chunk, "_pos": list(range(len(chunk)))}, schema=schema)


def check_ray() -> None:
    """ValueError saying how to install Ray Data when ``ray.data`` cannot be imported."""
    try:
        import ray.data  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ValueError(f"--engine ray needs {exc.name!r}: pip install 'hstu[ray]'") from None


def run_chunks(
    spec: BatchSpec,
    chunks: Iterator[tuple[int, list[int], list[History]]],
    workers: int,
    *,
    address: str | None = None,
    gpus: float = 0.0,
    threads: int | None = None,
) -> Iterator[tuple[int, dict[str, list]]]:
    """(chunk index, output columns) of each chunk of ``chunks`` ((index, users, histories)),
    computed by ``workers`` Ray actors, in completion order. Raises ValueError when Ray is not
    installed; a failed actor's exception as Ray raises it."""
    check_ray()
    import ray
    import ray.data

    items, expected = [], {}
    for i, users, hs in chunks:
        acts = [h.actions for h in hs] if any(h.actions is not None for h in hs) else None
        items.append({"chunk": i, "users": users, "items": [h.items for h in hs], "timestamps": [h.timestamps for h in hs]})
        items[-1]["actions"] = acts
        expected[i] = len(users) * spec.k
    if not items:
        return
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False  # the command's own bar counts users
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // workers)
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            RayChunkGenerator,
            fn_constructor_kwargs={"spec": spec, "threads": threads or cpus},
            batch_size=1,
            batch_format="pyarrow",
            concurrency=workers,
            num_cpus=cpus,
            num_gpus=gpus,
        )
        yield from _collect(ds.iter_batches(batch_size=None, batch_format="pyarrow"), expected)
    finally:
        if started:
            ray.shutdown()


def _collect(batches, expected: dict[int, int]) -> Iterator[tuple[int, dict[str, list]]]:
    """Regroup streamed Arrow batches by ``_chunk``; yield a chunk once all its rows
    (``expected[chunk]``) arrived, in ``_pos`` order, without the two helper columns."""
    parts: dict[int, list] = {}
    for t in batches:
        d = t.to_pydict()
        for r in range(t.num_rows):
            parts.setdefault(d["_chunk"][r], []).append({k: v[r] for k, v in d.items()})
        for c in [c for c, rows in parts.items() if len(rows) == expected[c]]:
            rows = sorted(parts.pop(c), key=lambda row: row["_pos"])
            yield c, {k: [row[k] for row in rows] for k in rows[0] if k not in ("_chunk", "_pos")}
    if parts:
        raise RuntimeError(f"Ray returned incomplete chunks {sorted(parts)[:5]}")
