"""Request-level faults over HTTP (issue 22, faults 2, 3 and 11): a real uvicorn server on
127.0.0.1 (port 0) driven through httpx, on test_serve's tiny 200-user ML-1M run.

- One request whose ``exclude`` leaves fewer than k items was a 500 for itself and for every
  request of its micro-batch (engine on), or a 500 "Out of range float values are not JSON
  compliant" (engine off); now it alone is a 422 naming ``exclude``, checked before batching.
- Top-k at temperature 1e-38 / 1e-300 / 5e-324 was a 500; now 200 with the greedy items.
- Items without training events are not returned; a history holding them is warned about.
Expected items come from a second Recommender called directly; the untrained set from pandas.
"""

from __future__ import annotations

import math

import pytest

from hstu.config import ServeConfig
from hstu.serve.app import ServePolicy, create_app
from conftest import untrained_items
from serving import BUCKETS, LiveServer, direct, events, gather, post

TINY = (1e-38, 1e-300, 5e-324)


@pytest.fixture(scope="module", params=["auto", "never"])
def server(request, rec):  # noqa: F811
    cfg = ServeConfig(buckets=BUCKETS, max_batch=16, max_wait_ms=50)
    with LiveServer(create_app(cfg, rec, policy=ServePolicy(use_engine=request.param))) as s:
        s.engine = request.param
        yield s


@pytest.fixture(scope="module")
def untrained(ratings) -> set[int]:  # noqa: F811
    return untrained_items(ratings)


def test_one_bad_exclude_among_eight_concurrent_requests_is_422_alone(server, ratings, ref) -> None:  # noqa: F811
    users = sorted(ratings.user.unique())[:8]
    hists = [events(ratings, u, 20 + 3 * i) for i, u in enumerate(users)]
    all_but_two = [int(r) for r in ref.raw_ids[3:]]
    bodies = [{"history": h, "k": 10} for h in hists]
    bodies[3]["exclude"] = all_but_two
    res = gather(server.url, "/v1/generate", bodies)
    assert res[3].status_code == 422, res[3].text
    err = res[3].json()["error"]
    assert err["field"] == "exclude" and err["message"].startswith("exclude: only ") and "fewer than the 10 needed" in err["message"]
    for i, r in enumerate(res):
        if i == 3:
            continue
        assert r.status_code == 200, (server.engine, i, r.text)
        assert [it["item_id"] for it in r.json()["items"]] == [it["item_id"] for it in direct(ref, hists[i], 10)]
    # beam: the beam width counts too; k alone names "k" when no exclude is given
    r = post(
        server.url,
        "/v1/generate",
        {"history": hists[0], "k": 2, "exclude": all_but_two[1:], "decoding": {"strategy": "beam", "beam_width": 4}},
    )
    assert r.status_code == 422 and r.json()["error"]["field"] == "exclude", r.text
    ok = post(server.url, "/v1/generate", {"history": hists[0], "k": 2, "exclude": all_but_two[2:], "exclude_history": False})
    assert ok.status_code == 200 and all(math.isfinite(it["score"]) for it in ok.json()["items"]), ok.text


@pytest.mark.parametrize("temperature", TINY)
def test_topk_at_a_tiny_temperature_is_200_with_the_greedy_items(server, ratings, temperature) -> None:  # noqa: F811
    hist = events(ratings, sorted(ratings.user.unique())[5], 30)
    greedy = post(server.url, "/v1/generate", {"history": hist, "k": 10})
    got = post(server.url, "/v1/generate", {"history": hist, "k": 10, "decoding": {"strategy": "topk", "temperature": temperature}})
    assert got.status_code == 200, got.text
    assert [i["item_id"] for i in got.json()["items"]] == [i["item_id"] for i in greedy.json()["items"]]
    assert all(math.isfinite(i["score"]) for i in got.json()["items"])


def test_untrained_items_are_not_returned_and_a_history_holding_them_is_warned(server, ratings, untrained) -> None:  # noqa: F811
    users = sorted(ratings.user.unique())[:30]
    bodies = [
        {"history": events(ratings, u, 25), "k": 10, "decoding": {"strategy": "topk", "top_k": 200, "temperature": 5.0, "seed": i}}
        for i, u in enumerate(users)
    ]
    # one at a time: 30 at once can be shed (429 queue_full) on a machine busy with other jobs
    res = [post(server.url, "/v1/generate", b) for b in bodies]
    assert all(r.status_code == 200 for r in res), [r.text for r in res if r.status_code != 200][:1]
    got = {it["item_id"] for r in res for it in r.json()["items"]}
    assert len(got) > 50 and not got & untrained
    cold = sorted(untrained)[:3]
    hist = events(ratings, users[0], 5) + [{"item_id": c, "timestamp": 978400000 + n} for n, c in enumerate(cold)]
    r = post(server.url, "/v1/generate", {"history": hist, "k": 5})
    assert r.status_code == 200, r.text
    assert any("3 event(s) of item(s) with no training events" in w for w in r.json()["warnings"]), r.json()["warnings"]
    # every trained item excluded: only the option leaves items to return, and they are all untrained
    trained = sorted(set(ratings.item) - untrained)
    body = {"history": hist, "k": 10, "exclude": trained}
    refused = post(server.url, "/v1/generate", body)
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "exclude", refused.text
    allowed = post(server.url, "/v1/generate", {**body, "allow_untrained_items": True})
    assert allowed.status_code == 200, allowed.text
    assert {it["item_id"] for it in allowed.json()["items"]} <= untrained - set(cold)
