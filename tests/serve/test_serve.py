"""HTTP service: a real uvicorn server on 127.0.0.1 (port 0) driven through httpx, no mocks.

A tiny run (small preset, max_seq_len 50, 200 ML-1M users, one epoch) is trained once per
session; the servers use buckets 10, 20, 50. Expected values come from a second path: the
Recommender called directly (a separate instance), a float64 copy of the model for scores,
and pandas over ratings.dat for cold-start popularity.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pydantic
import pytest

from hstu.config import ServeConfig
from hstu.generate.prefix_cache import entry_bytes
from hstu.generate.recommend import History, Recommender
from hstu.model.checkpoint import read_json
from hstu.serve.app import ServePolicy, create_app
from hstu.generate.requests import fit_buckets, parse_buckets
from hstu.serve.cli import bind
from hstu.serve.popularity import popularity_for_run

from conftest import ML1M, REPO, USERS  # noqa: F401 - the tiny run's data and size (its fixtures are conftest's)
from serving import BUCKETS, LiveServer, direct, events, gather, metrics, post, score64, serve, user_vector64


@pytest.fixture(scope="module")
def server(rec, popularity):
    with serve(rec, popularity, max_batch=16, max_wait_ms=30, max_body_bytes=64 * 1024) as s:
        yield s


def test_probes_docs_and_metric_names(server) -> None:
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    r = httpx.get(server.url + "/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert r.json()["buckets"] == {"10": True, "20": True, "50": True}
    assert r.json()["precision"] == "fp32" and r.json()["embeddings"] == "fp32"  # the run is float
    for path in ("/healthz", "/readyz", "/metrics"):  # HEAD as load balancers probe (it was a 405)
        with httpx.Client() as c:  # one keep-alive connection: a HEAD answered with a body would break the next request
            assert c.head(server.url + path).status_code == 200 and c.get(server.url + "/healthz").json() == {"status": "ok"}
    assert "swagger" in httpx.get(server.url + "/docs").text.lower()
    spec = httpx.get(server.url + "/openapi.json").json()
    paths, comps = spec["paths"], spec["components"]["schemas"]
    assert {"/v1/generate", "/v1/score", "/healthz", "/readyz", "/metrics"} <= set(paths)
    for path, model, field in (("/v1/generate", "GenerateRequest", "history"), ("/v1/score", "ScoreRequest", "candidates")):
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and field in comps[model]["properties"]
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert {"Event", "Decoding"} <= refs and refs <= set(comps)  # every reference resolves
    m = metrics(server.url)
    names = {n for n, _ in m}
    for name in (
        "hstu_serve_request_duration_seconds_bucket",
        "hstu_serve_batch_size_bucket",
        "hstu_serve_queue_depth",
        "hstu_serve_generated_items_total",
        "hstu_serve_rejected_requests_total",
        "hstu_serve_memory_free_bytes",
        "hstu_serve_memory_total_bytes",
        "hstu_serve_requests_total",
        "hstu_serve_ready",
    ):
        assert name in names, name
    assert m[("hstu_serve_model_info", (("embeddings", "fp32"), ("precision", "fp32")))] == 1
    for b in BUCKETS:  # the ops alert rule "data-movement storm" reads this exact series name and label
        assert m[("hstu_serve_queue_depth", (("bucket", str(b)),))] == 0
        assert m[("hstu_serve_bucket_warm", (("bucket", str(b)),))] == 1
    assert m[("hstu_serve_ready", ())] == 1
    assert m[("hstu_serve_memory_free_bytes", (("memory", "host"),))] > 0


# ----------------------------------------------------------------------------------------------
# results equal the model called directly
# ----------------------------------------------------------------------------------------------
def test_generate_concurrent_equals_direct_recommender(server, ratings, ref) -> None:
    """24 concurrent greedy requests of mixed lengths (all three buckets) and k: each equals the
    Recommender run on that history alone, so batching and bucket padding change nothing."""
    users = sorted(ratings.user.unique())[:24]
    bodies = [{"history": events(ratings, u, n), "k": k} for u, n, k in zip(users, [3, 8, 10, 15, 20, 35, 50, 12] * 3, [1, 5, 10] * 8)]
    before = metrics(server.url)
    resp = gather(server.url, "/v1/generate", bodies)
    after = metrics(server.url)
    for body, r in zip(bodies, resp):
        assert r.status_code == 200, r.text
        got = r.json()
        want = direct(ref, body["history"], body["k"])
        assert [i["item_id"] for i in got["items"]] == [i["item_id"] for i in want]
        np.testing.assert_allclose([i["score"] for i in got["items"]], [i["score"] for i in want], rtol=1e-4, atol=1e-4)
        n = len(body["history"])
        assert got["bucket"] == min(b for b in BUCKETS if b >= n) and got["history_length"] == n and not got["cold_start"]
        assert got["latency_ms"] > 0 and "title" in got["items"][0]
    # batching grouped concurrent requests: fewer batches than requests (observed in the metrics)
    count = sum(
        after.get(("hstu_serve_batch_size_count", (("bucket", str(b)),)), 0)
        - before.get(("hstu_serve_batch_size_count", (("bucket", str(b)),)), 0)
        for b in BUCKETS
    )
    total = sum(
        after.get(("hstu_serve_batch_size_sum", (("bucket", str(b)),)), 0)
        - before.get(("hstu_serve_batch_size_sum", (("bucket", str(b)),)), 0)
        for b in BUCKETS
    )
    assert total == len(bodies) and count < len(bodies), (count, total)
    gen = after[("hstu_serve_generated_items_total", ())] - before[("hstu_serve_generated_items_total", ())]
    assert gen == sum(b["k"] for b in bodies)


def test_prefix_cache_keyed_by_user_id(rec, popularity, ratings, ref, caplog) -> None:
    """[serve] prefix_cache_mb: a request's user_id keys the engine's user-prefix cache: the user's next
    request with one more event reuses the cached rows (the engine's counts, and /metrics') and answers
    as the Recommender called directly (no cache); a request without user_id is neither looked up nor stored."""
    u = next(u for u in sorted(ratings.user.unique()) if (ratings.user == u).sum() >= 31)
    app = create_app(ServeConfig(buckets=BUCKETS, prefix_cache_mb=4), rec, popularity=popularity)
    caplog.set_level("INFO", logger="hstu.serve.service")
    with LiveServer(app) as s:
        per = entry_bytes(rec.model.cfg, 50)
        assert f"user-prefix cache 4 MiB in the model thread, keyed by user_id (~{4 * 2**20 // per} users of 50 events" in caplog.text
        prefix = app.state.service.model.runner.engine.prefix
        for n, uid in ((30, "u1"), (31, "u1"), (31, None), (30, 7)):
            hist = events(ratings, u, n)
            r = post(s.url, "/v1/generate", {"history": hist, "k": 5, "user_id": uid})
            assert r.status_code == 200, r.text
            want = direct(ref, hist, 5)
            assert [i["item_id"] for i in r.json()["items"]] == [i["item_id"] for i in want]
            np.testing.assert_allclose([i["score"] for i in r.json()["items"]], [i["score"] for i in want], rtol=1e-4, atol=1e-4)
        assert (prefix.stats.hits, prefix.stats.misses, prefix.stats.rows_reused, len(prefix)) == (1, 2, 29, 2)
        m = metrics(s.url)
        lookups = "hstu_serve_prefix_cache_lookups_total"
        assert (m[(lookups, (("result", "hit"),))], m[(lookups, (("result", "miss"),))]) == (1, 2)
        assert m[("hstu_serve_prefix_cache_rows_reused_total", ())] == 29
        assert m[("hstu_serve_prefix_cache_evictions_total", ())] == 0 and m[("hstu_serve_prefix_cache_entries", ())] == 2
        assert m[("hstu_serve_prefix_cache_bytes", ())] == prefix.bytes > 0
    with LiveServer(create_app(ServeConfig(buckets=BUCKETS, prefix_cache_mb=per / 2**21), rec)):  # half an entry
        assert "holds no user of 50 events" in caplog.text


def test_beam_and_topk_equal_direct(server, ratings, ref) -> None:
    hist = events(ratings, sorted(ratings.user.unique())[3], 18)
    bodies = [
        {"history": hist, "k": 4, "decoding": {"strategy": "beam", "beam_width": 3}},
        {"history": hist, "k": 6, "decoding": {"strategy": "topk", "top_k": 20, "temperature": 0.5, "seed": 7}},
        {"history": hist, "k": 6, "decoding": {"strategy": "topk", "top_k": 20, "temperature": 0.5, "seed": 7}},
        {"history": hist, "k": 5, "exclude_history": False},
    ]
    resp = gather(server.url, "/v1/generate", bodies)
    items = [[i["item_id"] for i in r.json()["items"]] for r in resp]
    assert items[0] == [i["item_id"] for i in direct(ref, hist, 4, strategy="beam", beam_width=3)]
    want_topk = [i["item_id"] for i in direct(ref, hist, 6, strategy="topk", top_k=20, temperature=0.5, seed=7)]
    assert items[1] == items[2] == want_topk  # a seed gives the same items whatever the batch
    assert items[3] == [i["item_id"] for i in direct(ref, hist, 5, exclude_history=False)]


def test_score_is_target_aware_and_equals_float64_model(server, ratings, ref) -> None:
    hist = events(ratings, sorted(ratings.user.unique())[5], 30)
    cands = [int(x) for x in ratings.item.unique()[:40]]
    r = post(server.url, "/v1/score", {"history": hist, "candidates": cands})
    assert r.status_code == 200, r.text
    got = np.array(r.json()["scores"])
    want = score64(ref, user_vector64(ref, hist), cands)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # float32 server vs float64 reference
    assert r.json()["bucket"] == 50 and r.json()["history_length"] == 30
    # each candidate sees only the history: alone, reversed or duplicated, its score is the same
    alone = [post(server.url, "/v1/score", {"history": hist, "candidates": [c]}).json()["scores"][0] for c in cands[:3]]
    np.testing.assert_allclose(alone, got[:3], rtol=1e-5, atol=1e-5)
    rev = post(server.url, "/v1/score", {"history": hist, "candidates": cands[::-1] + cands[:1]}).json()["scores"]
    np.testing.assert_allclose(rev, list(got[::-1]) + [got[0]], rtol=1e-5, atol=1e-5)
    # the first generated item's score equals its target-aware score
    g = post(server.url, "/v1/generate", {"history": hist, "k": 1}).json()["items"][0]
    s = post(server.url, "/v1/score", {"history": hist, "candidates": [g["item_id"]]}).json()["scores"][0]
    assert s == pytest.approx(g["score"], rel=1e-4, abs=1e-4)


# ----------------------------------------------------------------------------------------------
# input policies and bad input
# ----------------------------------------------------------------------------------------------
def test_cold_start_is_training_popularity(server, ratings, ref) -> None:
    # independent popularity: each user's events but the last two (protocol "clean"), by count then id
    train = ratings.groupby("user", group_keys=False).apply(lambda g: g.iloc[:-2])
    counts = train.item.value_counts()
    table = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    r = post(server.url, "/v1/generate", {"history": [], "k": 5, "user_id": "new-user"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["cold_start"] is True and got["bucket"] is None and got["user_id"] == "new-user" and got["history_length"] == 0
    assert [i["item_id"] for i in got["items"]] == [int(i) for i, _ in table[:5]]
    np.testing.assert_allclose([i["score"] for i in got["items"]], [c / len(train) for _, c in table[:5]])
    top = [int(i) for i, _ in table[:7]]
    r = post(server.url, "/v1/generate", {"history": [], "k": 5, "exclude": top[:2]})
    assert [i["item_id"] for i in r.json()["items"]] == top[2:7]
    # exclusions that leave fewer than k popular items: the 422 a request with a history gets (it was a 200 with fewer items)
    all_but_3 = sorted({int(i) for i in ref.idmap["item_raw_ids"][1:]} - set(top[:3]))  # the run's catalogue but 3 items
    r = post(server.url, "/v1/generate", {"history": [], "k": 5, "exclude": all_but_3})
    assert r.status_code == 422 and r.json()["error"]["field"] == "exclude", r.text
    assert "only 3 of the run's popular items" in r.json()["error"]["message"] and "fewer than the 5 needed" in r.json()["error"]["message"]
    # every id unknown under "drop": cold start, with the warning
    r = post(server.url, "/v1/generate", {"history": [{"item_id": 10**9, "timestamp": 5}], "k": 2}).json()
    assert r["cold_start"] and "unknown" in r["warnings"][0] and [i["item_id"] for i in r["items"]] == top[:2]


def test_cold_start_skips_untrained_items_and_warns_of_ignored_decoding(server, ratings, ref) -> None:
    """A cold start follows allow_untrained_items as a model answer does (it returned items with
    no training events, share 0.0) and says that a topk / beam strategy is not used."""
    train = ratings.groupby("user", group_keys=False).apply(lambda g: g.iloc[:-2])
    trained = set(train.item)
    run_items = {int(i) for i in ref.idmap["item_raw_ids"][1:]}
    untrained = sorted(run_items - trained)
    assert untrained, "the tiny run's catalogue has items without training events"
    body = {"history": [], "k": 3, "exclude": sorted(trained)}
    r = post(server.url, "/v1/generate", body)
    assert r.status_code == 422 and r.json()["error"]["field"] == "exclude", r.text
    assert "only 0 of the run's popular items with training events" in r.json()["error"]["message"]
    r = post(server.url, "/v1/generate", {**body, "allow_untrained_items": True})
    assert r.status_code == 200, r.text
    got = r.json()["items"]
    assert [i["item_id"] for i in got] == untrained[:3] and all(i["score"] == 0.0 for i in got)  # ties: smaller dense id first
    greedy = post(server.url, "/v1/generate", {"history": [], "k": 4}).json()
    assert greedy["warnings"] == []
    for dec in ({"strategy": "beam", "beam_width": 4}, {"strategy": "topk", "seed": 3}):
        r = post(server.url, "/v1/generate", {"history": [], "k": 4, "decoding": dec}).json()
        assert r["items"] == greedy["items"] and r["cold_start"]
        assert r["warnings"] == [
            f"decoding: strategy '{dec['strategy']}' is not used for a cold-start answer (the most popular items, in order)"
        ]


def test_decoding_fields_the_strategy_does_not_read_are_warned(server, ratings) -> None:
    """A trial: {"strategy": "beam", "top_k": 3} answered with no warning (top_k is topk's alone, silently dropped)."""
    hist = events(ratings, sorted(ratings.user.unique())[3], 12)
    body = {"history": hist, "k": 3}
    r = post(server.url, "/v1/generate", {**body, "decoding": {"strategy": "beam", "top_k": 3, "temperature": 0.5}}).json()
    assert r["warnings"] == ["decoding.top_k=3, decoding.temperature=0.5: not used by strategy 'beam', ignored"], r
    r = post(server.url, "/v1/generate", {**body, "decoding": {"strategy": "topk", "top_k": 3, "seed": 2, "beam_width": 8}}).json()
    assert r["warnings"] == ["decoding.beam_width=8: not used by strategy 'topk', ignored"], r
    r = post(server.url, "/v1/generate", {**body, "decoding": {"strategy": "greedy", "top_k": 50, "beam_width": 4}}).json()
    assert r["warnings"] == []  # the defaults: nothing was asked for


def test_unknown_items_drop_or_reject(server, ratings, ref) -> None:
    hist = events(ratings, sorted(ratings.user.unique())[7], 12)
    dirty = hist[:4] + [{"item_id": 10**9, "timestamp": hist[4]["timestamp"]}] + hist[4:]
    r = post(server.url, "/v1/generate", {"history": dirty, "k": 3}).json()
    assert r["history_length"] == 12 and any("unknown" in w for w in r["warnings"])
    assert [i["item_id"] for i in r["items"]] == [i["item_id"] for i in direct(ref, hist, 3)]
    r = post(server.url, "/v1/generate", {"history": dirty, "k": 3, "unknown_items": "reject"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "history[4].item_id"
    # scoring: unknown candidates get null (drop) or 422 naming the index (reject)
    r = post(server.url, "/v1/score", {"history": hist, "candidates": [hist[0]["item_id"], 10**9]}).json()
    assert r["scores"][0] is not None and r["scores"][1] is None and r["warnings"]
    r = post(server.url, "/v1/score", {"history": hist, "candidates": [hist[0]["item_id"], 10**9], "unknown_items": "reject"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "candidates[1]"


def test_actions_on_a_run_without_action_types_are_reported(server, ratings, ref) -> None:
    """ML-1M has no action types: actions in a request change nothing and the answer says so
    (they were silently dropped)."""
    hist = events(ratings, sorted(ratings.user.unique())[8], 10)
    r = post(server.url, "/v1/generate", {"history": [dict(e, action="click") for e in hist], "k": 3}).json()
    assert r["warnings"] == ["this run has no action types; the events' actions were ignored"]
    assert [i["item_id"] for i in r["items"]] == [i["item_id"] for i in direct(ref, hist, 3)]
    assert post(server.url, "/v1/generate", {"history": hist, "k": 3}).json()["warnings"] == []


def test_long_history_keeps_most_recent_events(server, ratings, ref) -> None:
    u = next(u for u in sorted(ratings.user.unique()) if (ratings.user == u).sum() >= 80)
    hist = events(ratings, u, 80)
    r = post(server.url, "/v1/generate", {"history": hist, "k": 5}).json()
    assert r["bucket"] == 50 and r["history_length"] == 50
    assert any("most recent 50" in w for w in r["warnings"])
    assert [i["item_id"] for i in r["items"]] == [i["item_id"] for i in direct(ref, hist[-50:], 5)]


def test_unsorted_timestamps_sort_or_reject(server, ratings, ref) -> None:
    hist = events(ratings, sorted(ratings.user.unique())[11], 9)
    hist = [dict(e, timestamp=1_000_000 + 60 * i) for i, e in enumerate(hist)]  # distinct times
    shuffled = [hist[i] for i in (3, 0, 1, 2, 8, 4, 5, 7, 6)]
    r = post(server.url, "/v1/generate", {"history": shuffled, "k": 4}).json()
    assert any("sorted" in w for w in r["warnings"])
    assert [i["item_id"] for i in r["items"]] == [i["item_id"] for i in direct(ref, hist, 4)]
    r = post(server.url, "/v1/generate", {"history": shuffled, "k": 4, "timestamp_order": "reject"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "history[1].timestamp"


def test_malformed_text_id_on_an_integer_run_is_422_under_either_unknown_items_policy(server, ratings) -> None:
    """This run's ids are integers: a text that is no integer is malformed, not unknown, so it is a 422
    naming the field and the value also under ``unknown_items: drop`` (which drops only well-formed
    ids the run does not know); an integer text ("12") is that integer."""
    hist = events(ratings, sorted(ratings.user.unique())[3], 4)
    bad = [*hist[:2], {"item_id": "SKU-1", "timestamp": hist[2]["timestamp"]}, *hist[2:]]
    msg = "history[2].item_id: not an integer id: 'SKU-1' (this run's ids are integers)"
    for policy in ("drop", "reject"):
        r = post(server.url, "/v1/generate", {"history": bad, "k": 3, "unknown_items": policy})
        assert r.status_code == 422 and r.json()["error"] == {"type": "validation_error", "message": msg, "field": "history[2].item_id"}
    for h in (hist, []):  # exclude: with a history and on the cold-start path
        r = post(server.url, "/v1/generate", {"history": h, "k": 3, "exclude": [hist[0]["item_id"], "SKU-1"]})
        assert (
            r.status_code == 422 and r.json()["error"]["message"] == "exclude[1]: not an integer id: 'SKU-1' (this run's ids are integers)"
        )
    r = post(server.url, "/v1/score", {"history": hist, "candidates": [hist[0]["item_id"], " x1 "]})
    assert r.status_code == 422 and r.json()["error"]["message"] == "candidates[1]: not an integer id: ' x1 ' (this run's ids are integers)"
    as_text = [dict(e, item_id=f" {e['item_id']} ") for e in hist]
    same = [post(server.url, "/v1/generate", {"history": h, "k": 3}).json()["items"] for h in (hist, as_text)]
    assert same[0] == same[1]


def test_beam_wider_than_the_max_batch_is_the_same_422_with_or_without_a_history(rec, popularity) -> None:
    """decoding.beam_width is checked against the server's max batch before the request is split into
    a cold start (no history) and a queued one: both answer the same 422 (the cold start was a 200)."""
    with serve(rec, popularity, max_batch=4, warmup=False) as s:
        beam = {"strategy": "beam", "beam_width": 8}
        want = {
            "type": "validation_error",
            "message": "decoding.beam_width: at most the server's max batch 4, got 8",
            "field": "decoding.beam_width",
        }
        for hist in ([], [{"item_id": 1, "timestamp": 978300760}, {"item_id": 48, "timestamp": 978300761}]):
            r = post(s.url, "/v1/generate", {"history": hist, "k": 3, "decoding": beam})
            assert r.status_code == 422 and r.json()["error"] == want, (hist, r.text)
            r = post(s.url, "/v1/generate", {"history": hist, "k": 3, "decoding": {**beam, "beam_width": 4}})
            assert r.status_code == 200 and len(r.json()["items"]) == 3 and r.json()["cold_start"] == (not hist), r.text
        m = metrics(s.url)
        assert m[("hstu_serve_requests_total", (("code", "422"), ("endpoint", "/v1/generate")))] == 2
        assert m[("hstu_serve_rejected_requests_total", (("reason", "invalid"),))] == 2


@pytest.mark.parametrize(
    "body, field",
    [
        ({"history": [{"item_id": 1, "timestamp": 1}], "k": 0}, "k"),
        ({"history": [{"item_id": 1, "timestamp": 1}], "k": 11}, "k"),  # model max_output_len = 10
        ({"history": [{"item_id": True, "timestamp": 1}]}, "history[0].item_id"),  # "1" is an id now (text ids: 1 for this run)
        ({"history": [{"item_id": 1, "timestamp": 1.5}]}, "history[0].timestamp"),
        ({"history": [{"item_id": 1, "timestamp": -3}]}, "history[0].timestamp"),
        ({"history": [{"item_id": 1}]}, "history[0].timestamp"),
        ({"history": [{"item_id": 1, "timestamp": 1}], "k": "5"}, "k"),
        ({"history": [{"item_id": 1, "timestamp": 1}], "k": True}, "k"),
        ({"history": {"item_id": 1}}, "history"),
        ({"k": 5}, "history"),
        ({"history": [], "exlude": [1]}, "exlude"),
        ({"history": [], "decoding": {"strategy": "nucleus"}}, "decoding.strategy"),
        ({"history": [], "decoding": {"strategy": "beam", "beam_width": 0}}, "decoding.beam_width"),
        ({"history": [], "user_id": {"a": 1}}, "user_id"),  # was "user_id.int" (pydantic's union branch)
        ({"history": [], "user_id": True}, "user_id"),
    ],
)
def test_generate_bad_input_names_the_field(server, body, field) -> None:
    r = post(server.url, "/v1/generate", body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["message"].startswith(field), err


def test_wrong_user_id_type_is_one_error() -> None:
    from hstu.serve.schemas import GenerateRequest, ScoreRequest

    for cls, body in ((GenerateRequest, {"history": []}), (ScoreRequest, {"history": [], "candidates": [1]})):
        for bad, kind in (
            (1.5, "a number that is not an integer"),
            (2**64, "an integer outside int64"),
            ("u" * 257, "a string over 256 characters"),
        ):
            with pytest.raises(pydantic.ValidationError) as e:
                cls.model_validate_json(json.dumps({**body, "user_id": bad}))
            assert [(x["loc"], x["msg"]) for x in e.value.errors()] == [
                (("user_id",), f"must be an int64 integer, a string of at most 256 characters or null, got {kind}")
            ]
        ok = (7, -(2**63), 2**63 - 1, "u" * 256, None)
        assert [cls.model_validate_json(json.dumps({**body, "user_id": u})).user_id for u in ok] == list(ok)


def test_wrong_item_id_is_one_error_at_the_field(server) -> None:
    """An item id is checked natively when it is an int64 integer and by one validator otherwise; a bad
    one is one error at ``history[1].item_id`` (not pydantic's two union-member errors)."""
    from hstu.serve.schemas import GenerateRequest, public_errors

    for bad, kind in (
        (1.5, "a number that is not an integer"),
        (2**64, "an integer outside int64"),
        (True, "a boolean"),
        (None, "NoneType"),
    ):
        body = {"history": [{"item_id": 1, "timestamp": 1}, {"item_id": bad, "timestamp": 2}], "exclude": [bad]}
        with pytest.raises(pydantic.ValidationError) as e:
            GenerateRequest.model_validate_json(json.dumps(body))
        msg = f"must be an int64 integer or a string of at most 256 characters, got {kind}"
        assert [(x["loc"], x["msg"]) for x in public_errors(e.value.errors())] == [(("history", 1, "item_id"), msg), (("exclude", 0), msg)]
        r = post(server.url, "/v1/generate", body)
        assert r.status_code == 422 and r.json()["error"]["field"] == "history[1].item_id"
        assert [x["field"] for x in r.json()["errors"]] == ["history[1].item_id", "exclude[0]"]
    ok = [7, -(2**63), 2**63 - 1, " SKU-1 "]
    req = GenerateRequest.model_validate_json(json.dumps({"history": [{"item_id": i, "timestamp": 1} for i in ok]}))
    assert [e.item_id for e in req.history] == ok and [type(e.item_id) for e in req.history] == [int, int, int, str]


def test_feature_errors_name_the_feature_and_k_null_is_the_default(server) -> None:
    """A feature value of a wrong type was two errors at pydantic's union branches (``....features.a.float`` and
    ``....a.str``), a too long feature name one at ``....NAME.[key]``; now one error each at the feature or at
    ``features`` naming the name. ``"k": null`` was refused while other optional fields take null: it is 5."""
    from hstu.serve.schemas import GenerateRequest, public_errors

    long = "n" * 70
    body = {"history": [{"item_id": 1, "timestamp": 1, "features": {"a": [1, 2], long: 1.0}}]}
    with pytest.raises(pydantic.ValidationError) as e:
        GenerateRequest.model_validate_json(json.dumps(body))
    got = [(x["loc"], x["msg"]) for x in public_errors(e.value.errors())]
    assert got == [
        (("history", 0, "features", "a"), "Input should be a number or a string (as the feature's kind: numeric or categorical), or null"),
        (("history", 0, "features"), f"name {long!r}: String should have at most 64 characters"),
    ]
    r = post(server.url, "/v1/generate", body)
    assert r.status_code == 422 and [x["field"] for x in r.json()["errors"]] == ["history[0].features.a", "history[0].features"]
    assert GenerateRequest.model_validate_json(b'{"history": [{"item_id": 1, "timestamp": 1}], "k": null}').k == 5
    r = post(server.url, "/v1/generate", {"history": [{"item_id": 1, "timestamp": 1}], "k": None})
    assert r.status_code == 200 and len(r.json()["items"]) == 5, r.text


def test_k_out_of_range_names_the_models_range(server) -> None:
    """Both ends of k answer the message `hstu generate -k` gives (hstu.config.check_k); k = 0
    used to be pydantic's "Input should be greater than or equal to 1"."""
    for k in (0, -3, 11):
        r = post(server.url, "/v1/generate", {"history": [{"item_id": 1, "timestamp": 1}], "k": k})
        assert r.status_code == 422 and r.json()["error"]["field"] == "k"
        assert r.json()["error"]["message"] == f"k: must be in 1..10 (the model's max_output_len), got {k}"


def test_score_bad_input_and_malformed_json(server) -> None:
    r = post(server.url, "/v1/score", {"history": [], "candidates": [1]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "history"
    r = post(server.url, "/v1/score", {"history": [{"item_id": 1, "timestamp": 1}], "candidates": []})
    assert r.status_code == 422 and r.json()["error"]["field"] == "candidates"
    r = post(server.url, "/v1/score", {"history": [{"item_id": 1, "timestamp": 1}], "candidates": list(range(1, 1002))})
    assert r.status_code == 422 and r.json()["error"]["field"] == "candidates"
    r = httpx.post(server.url + "/v1/generate", content=b'{"history": [', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "validation_error"
    assert (
        r.json()["error"]["field"] == "body"
        and r.json()["error"]["message"] == "body: Invalid JSON: EOF while parsing a list at line 1 column 13"
    )
    nan = b'{"history": [], "decoding": {"strategy": "topk", "temperature": NaN}}'  # JSON extension Python parses
    r = httpx.post(server.url + "/v1/generate", content=nan, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "decoding.temperature"
    assert r.json()["error"]["message"] == "decoding.temperature: Input should be a finite number"


def test_body_too_large_413(server) -> None:
    big = {"history": [{"item_id": 1, "timestamp": i} for i in range(3000)]}  # ~100 KB > 64 KiB limit
    before = metrics(server.url)[("hstu_serve_rejected_requests_total", (("reason", "body_too_large"),))]
    r = post(server.url, "/v1/generate", big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "body_too_large"
    data = json.dumps(big).encode()  # the same body streamed without Content-Length (chunked)
    r = httpx.post(
        server.url + "/v1/generate",
        content=iter([data[i : i + 8192] for i in range(0, len(data), 8192)]),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    after = metrics(server.url)[("hstu_serve_rejected_requests_total", (("reason", "body_too_large"),))]
    assert after - before == 2


# ----------------------------------------------------------------------------------------------
# backpressure, timeout, memory shedding, graceful shutdown
# ----------------------------------------------------------------------------------------------
def test_queue_full_429_and_timeout_503(rec) -> None:
    """Queue of 2 per bucket, batches held for 3 s, 1.5 s timeout: of 10 simultaneous requests in
    one bucket, 2 are queued (then time out: 503) and 8 are refused at once (429), all with
    Retry-After; once the held batch closes, the queue is free again."""
    with serve(rec, max_queue=2, max_batch=64, max_wait_ms=3000, request_timeout_s=1.5) as s:
        body = {"history": [{"item_id": 1, "timestamp": 1}, {"item_id": 2, "timestamp": 2}], "k": 2}
        resp = gather(s.url, "/v1/generate", [body] * 10)
        codes = sorted(r.status_code for r in resp)
        assert codes == [429] * 8 + [503] * 2, codes
        for r in resp:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == ("queue_full" if r.status_code == 429 else "timeout")
        m = metrics(s.url)
        assert m[("hstu_serve_rejected_requests_total", (("reason", "queue_full"),))] == 8
        assert m[("hstu_serve_rejected_requests_total", (("reason", "timeout"),))] == 2
        assert m[("hstu_serve_requests_total", (("code", "429"), ("endpoint", "/v1/generate")))] == 8
        svc = s.app.state.service
        deadline = time.monotonic() + 30
        while svc.batcher.depth() and time.monotonic() < deadline:  # the held batch (of expired jobs) closes and is skipped
            time.sleep(0.05)
        assert metrics(s.url)[("hstu_serve_queue_depth", (("bucket", "10"),))] == 0
        assert metrics(s.url).get(("hstu_serve_batch_size_count", (("bucket", "10"),)), 0) == 0  # nothing ran for them
        r = post(s.url, "/v1/generate", body)  # queued again (not refused), then times out like the others
        assert r.status_code == 503 and r.json()["error"]["type"] == "timeout"
        assert httpx.get(s.url + "/healthz").status_code == 200


def test_memory_guard_sheds_with_503_and_stays_up(rec) -> None:
    """A threshold of 100 % of memory can never be met: caches are released, the batch is shed
    with 503 and the metrics say so; the process keeps answering."""
    with serve(rec, memory_threshold=1.0, max_wait_ms=1) as s:
        body = {"history": [{"item_id": 1, "timestamp": 1}], "k": 2}
        for _ in range(3):
            r = post(s.url, "/v1/generate", body)
            assert r.status_code == 503 and r.json()["error"]["type"] == "memory" and int(r.headers["retry-after"]) >= 1
        r = post(s.url, "/v1/score", {"history": body["history"], "candidates": [1, 2]})
        assert r.status_code == 503
        m = metrics(s.url)
        assert m[("hstu_serve_rejected_requests_total", (("reason", "memory"),))] == 4
        assert m[("hstu_serve_memory_guard_triggers_total", ())] == 4
        assert httpx.get(s.url + "/healthz").status_code == 200
        assert post(s.url, "/v1/generate", {"history": [], "k": 2}).status_code == 422  # no popularity given: cold start off


def test_graceful_shutdown_drains_in_flight(rec) -> None:
    s = serve(rec, max_wait_ms=3000, max_batch=64).__enter__()  # a 3 s batch window: all 4 are in flight at stop
    svc = s.app.state.service
    body = {"history": [{"item_id": 1, "timestamp": 1}], "k": 3}
    results: list = []

    def client() -> None:
        results.extend(gather(s.url, "/v1/generate", [body] * 4))

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 30
    while svc.batcher.in_flight < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert svc.batcher.in_flight == 4
    s.stop()  # like SIGTERM: stop accepting, finish in-flight requests, then the lifespan drains
    t.join(60)
    assert [r.status_code for r in results] == [200] * 4
    assert not s.thread.is_alive() and svc.batcher.draining
    with pytest.raises(httpx.TransportError):
        httpx.get(s.url + "/healthz", timeout=2)


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------
def test_bucket_options() -> None:
    assert parse_buckets("10,20,50") == [10, 20, 50]
    for bad in ("10,x", "20,10", "0,5", ""):
        with pytest.raises(ValueError, match="--buckets"):
            parse_buckets(bad)
    assert fit_buckets(None, 50) == [20, 50] and fit_buckets(None, 200) == [20, 50, 100, 200]
    with pytest.raises(ValueError, match="max_seq_len=50"):
        fit_buckets([10, 100], 50)


def test_a_serve_config_without_buckets_keeps_the_clipped_defaults(tmp_path) -> None:
    """Found by a fresh-user trial: any --config made the default edges explicit, so a run with max_seq_len 50
    was refused ("--buckets: edge 200 exceeds ...") although no bucket was asked for; [serve] buckets errors
    now name the file's field."""
    from hstu.cli import build_parser
    from hstu.serve.cli import _settings

    cfg = tmp_path / "s.toml"
    cfg.write_text("[serve]\nmax_batch = 8\n")
    parse = lambda *a: _settings(build_parser().parse_args(["serve", "--run", "r", "--config", str(cfg), *a]))  # noqa: E731
    _, _, edges, source = parse()
    assert edges is None and fit_buckets(edges, 50, source) == [20, 50]
    cfg.write_text("[serve]\nbuckets = [10, 100]\n")
    _, _, edges, source = parse()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(cfg))}: \[serve\] buckets: edge 100 exceeds the model's max_seq_len=50$"):
        fit_buckets(edges, 50, source)
    _, _, edges, source = parse("--buckets", "10,40")
    assert fit_buckets(edges, 50, source) == [10, 40]


def test_a_serve_config_says_which_tables_it_does_not_use(tmp_path, caplog) -> None:
    """A fresh user's [model] table in serve's --config was ignored without a word: the run's model is served."""
    from hstu.cli import build_parser
    from hstu.serve.cli import _settings

    cfg = tmp_path / "s.toml"
    cfg.write_text("[model]\nembedding_dim = 64\n[serve]\nmax_batch = 8\n")
    with caplog.at_level("WARNING", logger="hstu.serve.cli"):
        assert _settings(build_parser().parse_args(["serve", "--run", "r", "--config", str(cfg)]))[0].max_batch == 8
    assert f"--config {cfg}: hstu serve reads its [serve] table only; [model] not used" in caplog.text


def _cli_server(run_dir, *flags: str, **popen) -> tuple[subprocess.Popen, str]:
    """`hstu serve --run RUN --port 0 --threads 1 FLAGS` in a subprocess, once ready: (process, base URL)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "hstu.cli", "serve", "--run", str(run_dir), "--port", "0", "--threads", "1", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, **popen)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split("listening on ")[1].split()[0]
        deadline = time.monotonic() + 120
        while httpx.get(url + "/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
    except BaseException:
        proc.kill()  # never a server left behind by a failed start
        raise
    return proc, url


def test_cli_serve_on_a_run_directory(run_dir, ratings) -> None:
    """`hstu serve --run RUN --port 0` in a subprocess: ready, answers, exits 0 on SIGTERM; --access-log lines go to
    stderr with the other log lines (they went to stdout, which holds only the "listening" line)."""
    proc, url = _cli_server(run_dir, "--buckets", "10,20,50", "--access-log")
    try:
        hist = events(ratings, sorted(ratings.user.unique())[0], 15)
        r = post(url, "/v1/generate", {"history": hist, "k": 3})
        assert r.status_code == 200 and len(r.json()["items"]) == 3 and r.json()["bucket"] == 20
        assert post(url, "/v1/generate", {"history": [], "k": 3}).json()["cold_start"] is True  # data found via config.json
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0
    assert proc.stdout.read() == "" and '"POST /v1/generate HTTP/1.1" 200' in proc.stderr.read()


def test_sigterm_to_the_process_group_drains_in_flight_requests(run_dir, ratings) -> None:
    """A trial's finding: SIGTERM to the server's whole process group (systemd's KillMode=control-group, `timeout`,
    `kill -TERM -PGID`) killed the model process too: the request in flight got 503 model_restart, and a new model
    process loaded during shutdown. The model process now leaves SIGTERM to the server, which drains, then stops it."""
    import threading

    proc, url = _cli_server(run_dir, "--buckets", "20,50", "--max-wait-ms", "1500", start_new_session=True)  # 1.5 s: in flight
    got: dict = {}
    try:
        hist = events(ratings, sorted(ratings.user.unique())[0], 15)
        t = threading.Thread(target=lambda: got.update(r=post(url, "/v1/generate", {"history": hist, "k": 3})))
        t.start()
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its model process alike
        t.join(60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    err = proc.stderr.read()
    assert got["r"].status_code == 200 and len(got["r"].json()["items"]) == 3, got["r"].text
    assert rc == 0 and "died" not in err, err[-2000:]


def test_cli_rejects_buckets_beyond_the_model(run_dir, capsys) -> None:
    from hstu.cli import main

    assert main(["serve", "--run", str(run_dir), "--buckets", "10,100"]) == 2
    err = capsys.readouterr().err
    assert "--buckets" in err and "max_seq_len=50" in err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--port", "70000", "must be in 0..65535, got 70000"),
        ("--port", "-1", "must be in 0..65535, got -1"),
        ("--max-batch", "0", "must be >= 1, got 0"),
        ("--max-wait-ms", "-1", "must be >= 0, got -1"),
        ("--max-wait-ms", "nan", "must be a finite number >= 0, got nan"),
        ("--max-queue", "0", "must be >= 1, got 0"),
        ("--request-timeout-s", "0", "must be > 0, got 0"),
        ("--max-queue-delay-ms", "-5", "must be > 0, got -5"),
        ("--memory-threshold", "1.5", "must be in [0, 1], got 1.5"),
        ("--max-candidates", "0", "must be >= 1, got 0"),
        ("--limit-concurrency", "0", "must be >= 1, got 0"),
        ("--threads", "0", "must be >= 1, got 0"),
        ("--model-workers", "0", "must be >= 1, got 0"),
        ("--prefix-cache-mb", "-1", "must be >= 0, got -1"),
        ("--prefix-cache-mb", "inf", "must be a finite number >= 0, got inf"),
        ("--max-batch", "two", "expected an integer, got 'two'"),
    ],
)
def test_cli_serve_rejects_out_of_range_flags(tmp_path, capsys, flag, value, message) -> None:
    """A fresh user's report: --port 70000 listened on another port, --max-wait-ms -1 printed
    "listening" then died, --max-batch 0 gave BrokenProcessPool tracebacks. Each flag is refused
    by argparse (exit 2, the flag and its range named) before the run is even looked at."""
    from hstu.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--run", str(tmp_path / "no_run"), flag, value])
    assert exc.value.code == 2
    assert f"hstu serve: error: argument {flag}: {message}" in capsys.readouterr().err


_MEMORY_MB = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-body-bytes", "100"], "--max-body-bytes: must be >= 1024 bytes, got 100"),
        (["--max-body-bytes", "lots"], "--max-body-bytes: cannot parse 'lots'"),
        (["--buckets", "50,20"], "--buckets: edges must be distinct, ascending and >= 1"),
        (["--buckets", "0,20"], "--buckets: edges must be distinct, ascending and >= 1"),
        (["--buckets", ""], "--buckets: edges must be distinct, ascending and >= 1, got ''"),  # was: the defaults, silently
        (["--config", "serve.toml"], "serve.toml [serve]: ServeConfig.max_batch must be >= 1, got 0"),
        (["--prefix-cache-mb", "8", "--engine", "never"], "--prefix-cache-mb: the cache is the engine's; drop --engine never"),
        (["--prefix-cache-mb", "1e12"], "--prefix-cache-mb 1e+12 is more than this machine's"),  # was accepted: never evicts
        (
            ["--prefix-cache-mb", str(0.6 * _MEMORY_MB), "--model-workers", "2"],
            f"--prefix-cache-mb {0.6 * _MEMORY_MB:g} x 2 model processes is more than this machine's",
        ),
    ],
)
def test_cli_serve_checks_settings_before_loading_the_run(tmp_path, capsys, monkeypatch, args, message) -> None:
    from hstu.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "serve.toml").write_text("[serve]\nmax_batch = 0\n")
    assert main(["serve", "--run", str(tmp_path / "no_run"), "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert f"hstu serve: error: {message}" in err and "no_run" not in err  # refused before the run is read


def test_cli_serve_busy_port_or_unknown_host_is_one_line_and_starts_no_process(run_dir, capsys) -> None:
    """A port in use and an unresolvable --host were raw tracebacks (after the model process had
    started): now one line naming host:port, exit 2, and no model process is ever started."""
    import multiprocessing

    from hstu.cli import main

    before = set(multiprocessing.active_children())
    busy = bind("127.0.0.1", 0)
    try:
        port = busy.getsockname()[1]
        assert main(["serve", "--run", str(run_dir), "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hstu serve: error: cannot listen on 127.0.0.1:{port}: ") and "in use" in err, err
        assert len(err.strip().splitlines()) == 1
    finally:
        busy.close()
    assert main(["serve", "--run", str(run_dir), "--host", "no-such-host.invalid", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hstu serve: error: cannot listen on no-such-host.invalid:0: the host does not resolve"), err
    assert set(multiprocessing.active_children()) == before


# ----------------------------------------------------------------------------------------------
# pieces without HTTP
# ----------------------------------------------------------------------------------------------
def test_popularity_from_counts_orders_by_count_then_id() -> None:
    from hstu.serve.popularity import popularity_for_run, popularity_from_counts

    counts = [99, 3, 7, 7, 0, 1]  # index 0 (padding) is ignored whatever it holds
    p = popularity_from_counts(counts)
    assert p.order.tolist() == [2, 3, 1, 5, 4] and p.events == 18
    assert p.top(3, blocked={3}) == [(2, 7 / 18), (1, 3 / 18), (5, 1 / 18)]
    stored = popularity_for_run({}, {"item_raw_ids": [0, 10, 20, 30, 40, 50], "item_train_counts": counts})
    assert stored is not None and stored.order.tolist() == p.order.tolist()
    assert popularity_for_run({}, {"item_raw_ids": [0, 10]}) is None  # no counts, no data entry: cold start off
    with pytest.raises(ValueError, match="item_train_counts"):
        popularity_from_counts([0, -1])


def test_cold_start_data_dir_env(run_dir, rec, popularity, monkeypatch, tmp_path) -> None:
    """Without stored counts, cold start reads the run's data: --data-dir, else $HSTU_DATA_DIR
    (as train / eval / generate), else the directory recorded in the run (the env was ignored)."""
    cfg = read_json(run_dir / "config.json")
    cfg["data"]["data_dir"] = str(tmp_path / "gone")  # the data moved since training
    idmap = {k: v for k, v in rec.idmap.items() if k != "item_train_counts"}
    monkeypatch.delenv("HSTU_DATA_DIR", raising=False)
    assert popularity_for_run(cfg, idmap) is None
    monkeypatch.setenv("HSTU_DATA_DIR", str(ML1M))
    got = popularity_for_run(cfg, idmap)
    assert got is not None and got.order.tolist() == popularity.order.tolist()
    assert popularity_for_run(cfg, idmap, tmp_path / "gone") is None  # the argument over the env


def test_runner_engine_and_recommender_paths_agree(rec, ratings) -> None:
    """One mixed batch (greedy k 1..10, beam, no-history-exclusion, score) through the engine
    path and through Recommender.recommend: same items, scores within float32 reassociation."""
    from hstu.serve.runner import BatchRunner, DecodeOptions, Job

    users = sorted(ratings.user.unique())[30:38]
    preps = [
        rec.prepare(History([e["item_id"] for e in h], [e["timestamp"] for e in h]))
        for h in (events(ratings, u, n) for u, n in zip(users, [21, 30, 44, 50, 25, 33, 40, 49]))
    ]

    def jobs():
        return [
            Job("generate", preps[0], k=1),
            Job("generate", preps[1], k=10),
            Job("generate", preps[2], k=4),
            Job("generate", preps[3], k=3, decoding=DecodeOptions("beam", beam_width=2)),
            Job("generate", preps[4], k=5, exclude_history=False),
            Job("score", preps[5], candidates=np.array([1, 2, 0, 3])),
            Job("generate", preps[6], k=2),
            Job("score", preps[7], candidates=np.array([5])),
        ]

    a = BatchRunner(rec, BUCKETS, 16, use_engine="require").run_batch(50, jobs())
    b = BatchRunner(rec, BUCKETS, 16, use_engine="never").run_batch(50, jobs())
    for x, y in zip(a, b):
        assert not isinstance(x, Exception) and not isinstance(y, Exception), (x, y)
        if isinstance(x, np.ndarray):
            assert np.isnan(x).tolist() == np.isnan(y).tolist() == [c == 0 for c in ([1, 2, 0, 3] if len(x) == 4 else [5])]
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
        else:
            assert [i["item_id"] for i in x] == [i["item_id"] for i in y]
            np.testing.assert_allclose([i["score"] for i in x], [i["score"] for i in y], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not fit bucket 20"):
        BatchRunner(rec, BUCKETS, 16, use_engine="never").run_batch(20, jobs())


# ----------------------------------------------------------------------------------------------
# batch planning and the model process
# ----------------------------------------------------------------------------------------------
def test_plan_batch_mixes_buckets_only_when_cheaper() -> None:
    from hstu.serve.batcher import plan_batch

    # fixed 5 ms everywhere; 0.2 ms per request at 20 events, 2 ms at 200 (the measured shape)
    costs = {20: (5e-3, 0.2e-3), 50: (5e-3, 0.5e-3), 200: (5e-3, 2e-3)}
    # 2 short ones ride with the long ones: 2 x 2 ms < 5 + 2 x 0.2 ms
    assert plan_batch({20: 2, 50: 0, 200: 3}, 200, 16, costs) == (200, {200: 3, 20: 2})
    # 4 short ones cost 8 ms at 200 vs 5.8 ms alone: they keep their own batch; the oldest (200) runs first
    assert plan_batch({20: 4, 50: 0, 200: 3}, 200, 16, costs) == (200, {200: 3})
    # ... unless the oldest request is a short one: its bucket runs (no starvation)
    assert plan_batch({20: 4, 50: 0, 200: 3}, 20, 16, costs) == (20, {20: 4})
    # 50s join the 200 batch (1 x 2 < 5 + 0.5), then 20s fill what room is left (2 x 2 < 5.4)
    assert plan_batch({20: 2, 50: 1, 200: 13}, 20, 16, costs) == (200, {200: 13, 50: 1, 20: 2})
    assert plan_batch({20: 9, 50: 0, 200: 16}, 200, 16, costs) == (200, {200: 16})  # full: no room
    assert plan_batch({20: 2, 200: 3}, 200, 16, {}) == (200, {200: 3})  # no costs measured: buckets never mix
    assert plan_batch({20: 20}, 20, 16, costs) == (20, {20: 16})


def _kill_model_process(svc, i: int = 0) -> None:
    import psutil

    worker = psutil.Process(svc.model.pid(i))  # that model process
    worker.kill()
    worker.wait(30)


def test_readyz_and_metrics_name_the_precision_the_model_process_serves(run_dir, rec) -> None:
    """A float run served with --precision int8 (converted in the model process): /readyz and the
    hstu_serve_model_info series say int8 with the FP16 item table, not the HTTP process's float copy."""
    policy = ServePolicy(model_process=True, threads=1, precision="int8")
    with LiveServer(create_app(ServeConfig(buckets=BUCKETS, max_wait_ms=2), rec, run_dir=str(run_dir), policy=policy)) as s:
        body = httpx.get(s.url + "/readyz").json()
        assert body["precision"] == "int8" and body["embeddings"] == "fp16"
        assert metrics(s.url)[("hstu_serve_model_info", (("embeddings", "fp16"), ("precision", "int8")))] == 1


def test_model_process_answers_like_the_recommender_and_survives_its_death(run_dir, ratings, ref, rec) -> None:
    """``model_process=True``: batches run in a spawned process that loads the run itself. The
    answers equal the Recommender called here. A killed model process costs the batch in flight
    a 503 (model_restart); while its replacement loads, /readyz says "restarting" and requests get
    a quick 503 (never a hang); then the replacement answers."""
    users = sorted(ratings.user.unique())[40:46]
    bodies = [{"history": events(ratings, u, n), "k": 4} for u, n in zip(users, [5, 12, 19, 33, 48, 50])]
    policy = ServePolicy(model_process=True, threads=1)
    with LiveServer(create_app(ServeConfig(buckets=BUCKETS, max_wait_ms=20), rec, run_dir=str(run_dir), policy=policy)) as s:
        svc = s.app.state.service
        assert svc.model.costs.keys() == set(BUCKETS) and svc.model.backend_name.endswith("(model process)")
        for body, r in zip(bodies, gather(s.url, "/v1/generate", bodies)):
            assert r.status_code == 200, r.text
            want = direct(ref, body["history"], 4)
            assert [i["item_id"] for i in r.json()["items"]] == [i["item_id"] for i in want]
            np.testing.assert_allclose([i["score"] for i in r.json()["items"]], [i["score"] for i in want], rtol=1e-4, atol=1e-4)
        _kill_model_process(svc)
        r = post(s.url, "/v1/generate", bodies[0])
        assert r.status_code == 503 and r.json()["error"]["type"] == "model_restart" and int(r.headers["retry-after"]) >= 1
        ready = httpx.get(s.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "restarting"
        deadline, codes = time.monotonic() + 120, []
        while True:
            t0 = time.monotonic()
            r = post(s.url, "/v1/generate", bodies[0])
            assert time.monotonic() - t0 < 5, "a request waited instead of being refused quickly"
            codes.append(r.status_code)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            assert r.status_code == 503 and r.json()["error"]["type"] == "model_restart"
            time.sleep(0.2)
        assert codes[-1] == 200 and [i["item_id"] for i in r.json()["items"]] == [
            i["item_id"] for i in direct(ref, bodies[0]["history"], 4)
        ]
        assert httpx.get(s.url + "/readyz").status_code == 200
        assert metrics(s.url)[("hstu_serve_rejected_requests_total", (("reason", "model_restart"),))] == len(codes)
        assert svc.model.restarts == 1


def test_two_model_processes_answer_through_the_death_of_one(run_dir, ratings, ref, rec) -> None:
    """With two model processes, the batch of a killed one is retried on the other: no request fails."""
    hist = events(ratings, sorted(ratings.user.unique())[7], 30)
    want = [i["item_id"] for i in direct(ref, hist, 3)]
    policy = ServePolicy(model_process=True, threads=1, model_workers=2)
    with LiveServer(create_app(ServeConfig(buckets=BUCKETS, max_wait_ms=2), rec, run_dir=str(run_dir), policy=policy)) as s:
        svc = s.app.state.service
        assert svc.model.available == 2 and svc.model.backend_name.endswith("(2 model processes)")
        _kill_model_process(svc, 0)
        for _ in range(3):
            resp = gather(s.url, "/v1/generate", [{"history": hist, "k": 3}] * 4)
            assert [r.status_code for r in resp] == [200] * 4, [r.text for r in resp]
            assert all([i["item_id"] for i in r.json()["items"]] == want for r in resp)
        assert svc.model.restarts == 1 and httpx.get(s.url + "/readyz").status_code == 200


def test_model_process_dying_before_warmup_is_replaced_and_warmed(run_dir) -> None:
    """A model process that dies before (or during) a bucket's warm-up is replaced and the bucket
    warms on the replacement: warm-up does not fail for good."""
    import psutil

    from hstu.serve.worker import ProcessModel, WorkerSpec

    model = ProcessModel(WorkerSpec(str(run_dir), buckets=tuple(BUCKETS), max_batch=4, threads=1))
    try:
        worker = psutil.Process(model.pid(0))
        worker.kill()
        worker.wait(30)

        async def warm_all() -> None:
            for e in BUCKETS:
                await model.warmup(e)

        asyncio.run(warm_all())
        assert model.warm == set(BUCKETS) and model.restarts == 1 and model.available == 1
        assert all(fixed > 0 and per_row >= 0 for fixed, per_row in model.costs.values())
    finally:
        model.close()


def test_model_process_load_error_is_raised_as_itself(run_dir) -> None:
    """A run the model process cannot load (here: a missing run directory; a wrong --precision alike)
    raises the loader's own error in the server process, not a broken-pool error, so that
    `hstu serve` prints it as a one-line error (a fresh user's report)."""
    from hstu.serve.worker import ProcessModel, WorkerSpec

    with pytest.raises(FileNotFoundError, match="not found"):
        ProcessModel(WorkerSpec(str(run_dir / "no_such_run"), buckets=tuple(BUCKETS), max_batch=4, threads=1))


def test_vectorised_id_map_equals_a_dict_lookup(rec) -> None:
    """``Recommender.dense_ids`` (binary search over the sorted id map) against a per-id dict
    lookup: known, unknown, negative, past-int64 and numeric-string ids; junk names its index."""
    from hstu.generate.recommend import HistoryError

    lookup = {int(r): i for i, r in enumerate(rec.raw_ids) if i > 0}
    rng = np.random.default_rng(0)
    q = np.concatenate([rng.choice(rec.raw_ids[1:], 300), rng.integers(-5, 5000, 300), [0, 2**62, -(2**62)]]).tolist()
    want = [lookup.get(int(x), 0) for x in q]
    assert rec.dense_ids(q).tolist() == want
    assert rec.dense_ids([str(x) for x in q[:40]]).tolist() == want[:40]
    assert rec.dense_ids([2**70, q[0]]).tolist() == [0, want[0]]
    with pytest.raises(HistoryError, match=r"history\[1\].item_id: not an integer id: 'x'"):
        rec.dense_ids([q[0], "x"])


def test_mapping_only_recommender_prepares_like_the_full_one_without_weights(run_dir, rec) -> None:
    """What the HTTP process loads when a model process holds the model: the same id map and
    prepared histories, a model with no storage (no second copy of the tables)."""
    light = Recommender.mapping_only(run_dir)
    assert all(p.is_meta for p in light.model.parameters())
    assert light.model.cfg == rec.model.cfg and light.raw_ids.tolist() == rec.raw_ids.tolist()
    items = [int(x) for x in rec.raw_ids[1:30]] + [999_999_999]
    h = History(items, list(range(1_000_000, 1_000_000 + 30 * 60, 60)))
    a, b = light.prepare(h), rec.prepare(h)
    for f in ("ids", "timestamps", "actions", "categories"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.warnings == b.warnings and a.request_time == b.request_time
    assert light.describe(3, 0.5) == rec.describe(3, 0.5)


def test_cli_refuses_ann_settings_it_cannot_serve_before_starting(run_dir, capsys, monkeypatch) -> None:
    """--ann with --engine never, or on a run whose item rows are INT8 (quant.json embeddings = int8),
    exits 2 with one line before a socket or model process exists (a model process would fail at
    every restart)."""
    import hstu.quant.checkpoint as qc
    from hstu.cli import main

    assert main(["serve", "--run", str(run_dir), "--ann", "Flat", "--engine", "never"]) == 2
    assert "drop --engine never" in capsys.readouterr().err
    monkeypatch.setattr(qc, "read_quant_meta", lambda run: {"scheme": "int8", "embeddings": "int8"})
    assert main(["serve", "--run", str(run_dir), "--ann", "Flat"]) == 2
    err = capsys.readouterr().err
    assert "--ann: approximate picks need a float or 16-bit item table" in err and err.count("\n") == 1
