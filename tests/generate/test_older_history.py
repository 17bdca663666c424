"""A history longer than the model reads: the events dropped by truncation (Prepared.older) are still
history, so exclude_history keeps their items out too (the break-it finding: for a 401-event history,
7 of 10 served items were the user's own older films), in the Recommender's mask and room check, through
the model-process wire, and through a server whose largest bucket truncates further."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from hstu.generate.recommend import History, HistoryError
from hstu.serve.runner import Job
from hstu.serve.wire import pack_jobs, unpack_jobs


def _longest(ratings, n: int):
    counts = ratings.groupby("user").size()
    u = counts.index[counts >= n][0]
    return ratings[ratings.user == u].tail(n)


def test_older_events_are_kept_and_excluded(rec, ratings):
    h = _longest(ratings, 3 * rec.max_len)
    prep = rec.prepare(History(h.item.tolist(), h.ts.tolist()))
    every = rec.dense_ids(h.item.tolist())
    assert len(prep.ids) == rec.max_len and prep.older.tolist() == every[: len(every) - rec.max_len].tolist()
    b = rec.batch([prep])
    mask = rec.exclusion(b, [prep], True, True)[0]
    assert mask[every].all()  # every history item, the model's window and the older events alike
    assert not rec.exclusion(b, [prep], False, True)[0][prep.older].any()  # history not excluded: the older events neither
    ranked = rec.rank([prep], 10, exclude_history=True)[0]
    assert not set(ranked.items.tolist()) & set(every.tolist())
    left = rec.model.cfg.num_items - len(np.unique(every))
    with pytest.raises(HistoryError, match="history items"):
        rec.check_room(prep, left + 1, exclude_history=True, allow_untrained=True)
    rec.check_room(prep, left, exclude_history=True, allow_untrained=True)


def test_older_events_travel_to_the_model_process(rec, ratings):
    h = _longest(ratings, 2 * rec.max_len)
    prep = rec.prepare(History(h.item.tolist(), h.ts.tolist()))
    short = rec.prepare(History(h.item.tolist()[-3:], h.ts.tolist()[-3:]))
    _, jobs = unpack_jobs(pack_jobs(50, [Job("generate", prep, k=3), Job("generate", short, k=3)]))
    assert jobs[0].prepared.older.tolist() == prep.older.tolist() and len(prep.older) == rec.max_len
    assert jobs[1].prepared.older.tolist() == []


def test_server_truncating_to_its_largest_bucket_excludes_what_it_dropped(rec, ratings, popularity):
    from serving import LiveServer

    from hstu.config import ServeConfig
    from hstu.serve.app import ServePolicy, create_app

    h = _longest(ratings, rec.max_len)
    body = {"history": [{"item_id": int(i), "timestamp": int(t)} for i, t in zip(h.item, h.ts)], "k": 10, "exclude_history": True}
    app = create_app(ServeConfig(buckets=(20,)), rec, policy=ServePolicy(warmup=False), popularity=popularity)
    with LiveServer(app) as s:
        r = httpx.post(s.url + "/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["history_length"] == 20 and any("kept the most recent 20" in w for w in out["warnings"])
    assert not {it["item_id"] for it in out["items"]} & set(h.item.tolist())
