"""items.npz (issue 21, a 120M-item catalogue): idmap.json's per-item lists as NumPy arrays in a sidecar.

The independent check: one tiny log written twice, once inline (today's idmap.json) and once with
``runs.INLINE_ITEM_ROWS`` patched below its item count (the sidecar), reads back to the same values and
serves the same recommendations; every broken sidecar is one ValueError naming items.npz and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hstu import runs
from hstu.config import ModelConfig, TrainConfig
from hstu.data import sequences
from hstu.data.prepare import DataSpec, model_config_for, prepare_data
from hstu.data.sequences import IdIndex, same_item_ids
from hstu.export.bundle import export_run
from hstu.generate.recommend import History, Recommender
from hstu.model.hstu import build_hstu
from hstu.quant import apply_precision
from hstu.serve.popularity import popularity_for_run

ITEMS = 9  # the log's catalogue: I + 1 = 10 rows > the patched INLINE_ITEM_ROWS


def _csv(path: Path, text_ids: bool) -> Path:
    """12 users x 6 events over items 1..9 (item 9 only as user 1's test target: untrained), a price
    and a brand per event."""
    rng = np.random.default_rng(0)
    rows = []
    for u in range(1, 13):
        for t in range(6):
            i = ITEMS if (u, t) == (1, 5) else int(rng.integers(1, ITEMS))
            rows.append(f"{u},{f'SKU-{i:03d}' if text_ids else i},{1000 + 60 * t},{float(rng.uniform(0, 100)):.2f},{'ab'[i % 2]}")
    path.write_text("user,item,ts,price,brand\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return path


def _spec(csv: Path, features: bool = True) -> DataSpec:
    side = {"features": "brand", "numeric_features": "price:3"} if features else {}
    return DataSpec("csv", str(csv), options={"columns": "user=user,item=item,time=ts", **side})


def _run(run: Path, csv: Path, features: bool = True) -> None:
    """A float run: config, id map (inline or sidecar, as INLINE_ITEM_ROWS says), seeded weights."""
    spec = _spec(csv, features)
    log_, split = prepare_data(spec)
    cfg = model_config_for(log_, ModelConfig(max_seq_len=8, max_output_len=3, embedding_dim=8, num_blocks=1, d_qk=8, d_v=8), features)
    cfg.dropout = 0.0
    run.mkdir(parents=True)
    runs.write_config(run, runs.config_json(cfg, TrainConfig(), spec))
    runs.write_idmap(run, log_, split)
    torch.manual_seed(0)
    runs.save_best_weights(run, build_hstu(cfg))


@pytest.fixture(params=["int", "text"])
def pair(request, tmp_path, monkeypatch) -> tuple[Path, Path, Path]:
    """(inline run, sidecar run, the csv) over the same data."""
    csv = _csv(tmp_path / "log.csv", request.param == "text")
    _run(tmp_path / "inline", csv)
    monkeypatch.setattr(runs, "INLINE_ITEM_ROWS", 5)
    _run(tmp_path / "sidecar", csv)
    return tmp_path / "inline", tmp_path / "sidecar", csv


def test_sidecar_round_trips_to_the_inline_values(pair):
    inline, sidecar, csv = pair
    assert not (inline / runs.ITEMS).exists()
    head = json.loads((sidecar / runs.IDMAP).read_text())
    assert head["items_file"] == "items.npz" and head["item_rows"] == ITEMS + 1 and not set(runs.ITEM_FIELDS) & set(head)
    assert head["item_fields"] == list(runs.ITEM_FIELDS)
    with np.load(sidecar / runs.ITEMS, allow_pickle=False) as npz:
        assert npz["item_raw_ids"].dtype.kind in "iU" and npz["item_features"].dtype == np.int64
        assert npz["item_category"].dtype == npz["item_train_counts"].dtype == np.int8  # the smallest that holds them
    a, b = runs.read_idmap(inline), runs.read_idmap(sidecar)
    assert {k: v for k, v in b.items() if k not in ("items_file", "item_rows", "item_fields")}.keys() == a.keys()
    for key in runs.ITEM_FIELDS:
        assert isinstance(b[key], np.ndarray) and b[key].tolist() == a[key], key  # same values, same Python types
    assert {k: v for k, v in a.items() if k not in runs.ITEM_FIELDS} == {k: b[k] for k in a if k not in runs.ITEM_FIELDS}
    assert same_item_ids(a["item_raw_ids"], b["item_raw_ids"])
    assert runs.read_run(sidecar)[1]["item_rows"] == ITEMS + 1  # checked against config.json's num_items
    log_, _ = prepare_data(_spec(csv))
    runs.check_resume_items(sidecar, log_)  # the arrays compare with the data's ids
    with pytest.raises(ValueError, match=r"item ids are not the run's 9"):
        runs.check_resume_items(sidecar, type(log_)(**{**log_.__dict__, "item_raw_ids": log_.item_raw_ids[::-1]}))
    cfg = runs.read_config(inline)
    p, q = popularity_for_run(cfg, a), popularity_for_run(cfg, b)
    assert p.order.tolist() == q.order.tolist() and p.share.tolist() == q.share.tolist()


def test_sidecar_run_recommends_as_the_inline_run(pair):
    inline, sidecar, _ = pair
    ra, rb = Recommender.from_run(inline), Recommender.from_run(sidecar)
    assert rb.features.names == ["brand", "price"] and rb.num_untrained == ra.num_untrained > 0
    assert np.array_equal(ra.item_tokens_np, rb.item_tokens_np) and np.array_equal(ra.raw_ids, rb.raw_ids)
    raw = ra.raw_ids[1:].tolist()
    hist = [History(raw[s : s + n], list(range(1000, 1000 + 60 * n, 60))) for s, n in ((0, 3), (2, 5), (4, 1))]
    got = [r.recommend([r.prepare(h) for h in hist], k=3, allow_untrained=True) for r in (ra, rb)]
    assert got[0] == got[1] and all(len(items) == 3 for items in got[0])
    ma = Recommender.mapping_only(sidecar)  # what an HTTP process holds beside a model process
    assert np.array_equal(ma.raw_ids, rb.raw_ids) and ma.dense_ids(raw[:4]).tolist() == rb.dense_ids(raw[:4]).tolist()


def test_quantized_and_exported_runs_carry_the_sidecar(pair, tmp_path):
    _, sidecar, csv = pair
    want = runs.read_idmap(sidecar)
    model, _, _ = runs.load_run(sidecar)
    runs.save_quantized_run(apply_precision(model, "bf16"), sidecar, tmp_path / "q")
    got = runs.load_run(tmp_path / "q")[2]  # read_idmap: items.npz copied beside idmap.json
    assert all(np.array_equal(got[k], want[k]) for k in runs.ITEM_FIELDS) and (tmp_path / "q" / runs.ITEMS).exists()
    _run(tmp_path / "plain", csv, features=False)  # export refuses side features
    export_run(tmp_path / "plain", tmp_path / "x", "pt2", buckets=(4,))
    assert runs.read_idmap(tmp_path / "x")["item_raw_ids"].tolist() == runs.read_idmap(tmp_path / "plain")["item_raw_ids"].tolist()
    assert (tmp_path / "x" / runs.ITEMS).exists()


def _rewrite(path: Path, **changes) -> None:
    """items.npz with arrays replaced (an array) or removed (None)."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    for k, v in changes.items():
        arrays.pop(k) if v is None else arrays.__setitem__(k, v)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", r"items\.npz: not found, but .*idmap\.json items_file names it"),
        ("truncated", r"items\.npz: not a readable \.npz file"),
        ("no category", r"items\.npz: item_category is missing"),
        ("short counts", r"items\.npz: item_train_counts must hold 10 rows .*got shape \(9,\)"),
        ("bad padding", r"items\.npz: item_raw_ids must start with the padding id"),
        ("float category", r"items\.npz: item_category must be integers, got dtype float64"),
        ("negative count", r"items\.npz: item_train_counts must be >= 0 .*at dense id 3"),
        ("pickled ids", r"items\.npz: item_raw_ids is not readable .*allow_pickle"),
        ("flat features", r"items\.npz: item_features must hold 10 rows .* in 2 dimension"),
    ],
)
def test_a_broken_sidecar_names_file_and_field(pair, damage, message):
    _, run, _ = pair
    path = run / runs.ITEMS
    with np.load(path, allow_pickle=False) as npz:
        raw, counts = npz["item_raw_ids"], npz["item_train_counts"]
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "bad padding":
        _rewrite(path, item_raw_ids=np.concatenate([raw[1:2], raw[1:]]))
    elif damage == "negative count":
        _rewrite(path, item_train_counts=np.where(np.arange(len(counts)) == 3, -1, counts))
    elif damage == "pickled ids":
        _rewrite(path, item_raw_ids=raw.astype(object))  # np.savez pickles an object array
    else:
        _rewrite(
            path,
            **{
                "no category": {"item_category": None},
                "short counts": {"item_train_counts": counts[:-1]},
                "float category": {"item_category": np.zeros(len(raw))},
                "flat features": {"item_features": np.zeros(len(raw), np.int64)},
            }[damage],
        )
    with pytest.raises(ValueError, match=message):
        runs.read_idmap(run)


def test_idmap_json_of_a_sidecar_run_is_checked(pair):
    _, run, _ = pair
    head = json.loads((run / runs.IDMAP).read_text())
    for bad, message in (
        ({**head, "items_file": "../elsewhere.npz"}, r"idmap\.json: items_file must be 'items\.npz'"),
        ({**head, "item_rows": 0}, r"idmap\.json: item_rows must be an integer >= 1"),
        ({**head, "item_fields": ["item_category"]}, r"idmap\.json: item_fields must be a list of .* holding item_raw_ids"),
        ({**head, "item_category": [0] * (ITEMS + 1)}, r"idmap\.json: item_category is both inline and in items\.npz"),
        ({**head, "item_rows": ITEMS}, r"items\.npz: item_raw_ids must hold 9 rows"),
    ):
        (run / runs.IDMAP).write_text(json.dumps(bad), encoding="utf-8")
        with pytest.raises(ValueError, match=message):
            runs.read_idmap(run)


def test_small_runs_stay_inline_and_drop_an_old_sidecar(pair, monkeypatch):
    inline, sidecar, csv = pair
    monkeypatch.setattr(runs, "INLINE_ITEM_ROWS", 1_000_000)
    log_, split = prepare_data(_spec(csv))
    runs.write_idmap(sidecar, log_, split)  # rewritten inline (e.g. a resume under a larger threshold)
    assert not (sidecar / runs.ITEMS).exists()
    assert (sidecar / runs.IDMAP).read_text() == (inline / runs.IDMAP).read_text()  # byte for byte today's file
    runs.write_idmap_dict(sidecar, {"item_raw_ids": np.arange(4)})  # arrays given to a small write become lists
    assert json.loads((sidecar / runs.IDMAP).read_text()) == {"item_raw_ids": [0, 1, 2, 3]}


def _reference_dense(raw: np.ndarray, values) -> list[int]:
    """Dense ids by a dict (first dense id of a repeated raw id), 0 unknown."""
    first: dict = {}
    for d, r in enumerate(raw.tolist()):
        if d:
            first.setdefault(r, d)
    return [first.get(v, 0) for v in values]


@pytest.mark.parametrize("text", [False, True])
def test_id_index_sorted_fast_path_equals_the_argsort_path(text, monkeypatch):
    rng = np.random.default_rng(1)
    for n in (0, 1, 2, 5, 200):
        ids = np.sort(rng.choice(10_000, size=n, replace=False))
        for raw_ids in (ids, rng.permutation(ids)):
            raw = np.concatenate([[0], raw_ids + 1])
            if text:
                raw = np.array([""] + [f"k{v:05d}" for v in raw[1:]], dtype=object)
            queries = list(raw[1:]) + ([7_777_777, 10_001, 1] if not text else ["nope", "k99999", "a"])
            queries = rng.permutation(np.array(queries, dtype=object)).tolist()
            fast = IdIndex(raw)
            assert (fast.dense_sorted is None) == bool(sequences._ascending(raw[1:]))
            monkeypatch.setattr(sequences, "_ascending", lambda a: False)
            slow = IdIndex(raw)
            monkeypatch.undo()
            assert slow.dense_sorted is not None or n == 0
            want = _reference_dense(raw, queries)
            assert fast.dense(queries).tolist() == slow.dense(queries).tolist() == want
    assert IdIndex(np.arange(6)).sorted.base is not None  # a view of the ids: no sorted copy


def test_id_index_repeated_ids_and_blocked_order_check():
    raw = np.array([0, 3, 3, 5, 9], dtype=np.int64)  # not unique (never so in an id map): the first dense id, both paths
    assert IdIndex(raw).dense([3, 5, 4, 9]).tolist() == [1, 3, 0, 4]
    a = np.arange(1000)
    assert sequences._ascending(a, block=7) and not sequences._ascending(np.r_[a, 998], block=7)
    assert not sequences._ascending(np.r_[a[:500], 0, a[500:]], block=7)


def test_same_item_ids_across_forms():
    assert same_item_ids([0, 5, 7], np.array([0, 5, 7]))
    assert same_item_ids(["", "a"], np.array(["", "a"], dtype=object)) and same_item_ids(["", "a"], np.array(["", "a"]))
    assert not same_item_ids([0, 5], [0, 5, 7]) and not same_item_ids([0, 5], [0, 6])
    assert not same_item_ids(["", "5"], [0, 5])  # text ids never equal integer ids
