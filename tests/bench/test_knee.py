"""The load generator finds the knee by itself: steps until two fail in a row, then bisection to
5 % (hstu.bench.load.step_up), on a fake server whose P99 breaks above a known rate."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from hstu.bench import load


def fake_phases(monkeypatch, knee: float, noisy: set[float] = frozenset()):
    """run_phase replaced by a server that answers every request in 10 ms up to ``knee`` requests/s
    and in 200 ms above it (and at the offered loads in ``noisy``); returns the offered loads run."""
    offered = []

    async def run_phase(client, bodies, phase, rng, max_in_flight, server=None):
        offered.append(phase.offered)
        slow = phase.offered > knee or phase.offered in noisy
        n = max(1, int(phase.offered * phase.seconds))
        phase.sent = n
        for _ in range(n):
            phase.add("200", 0.2 if slow else 0.01)
        return phase

    monkeypatch.setattr(load, "run_phase", run_phase)
    return offered


def knee_of(steps, resolution=0.05):
    return asyncio.run(load.step_up(None, [b"{}"], steps, 1.0, random.Random(0), resolution=resolution))


def test_bisection_brackets_the_knee_within_five_percent(monkeypatch):
    offered = fake_phases(monkeypatch, knee=437.0)
    done, best = knee_of([100, 200, 300, 400, 500, 600, 800])
    # by hand: 400 passes, 500 and 600 fail (two in a row: stop); midpoints sqrt(lo * hi), rounded to 0.1
    mids = [round(math.sqrt(400 * 500), 1)]  # 447.2 fails
    mids.append(round(math.sqrt(400 * mids[0]), 1))  # 422.9 passes
    mids.append(round(math.sqrt(mids[1] * mids[0]), 1))  # 434.9 passes; 447.2 / 434.9 < 1.05: done
    assert offered == [100, 200, 300, 400, 500, 600, *mids]
    assert best.offered == mids[2] and 437.0 / 1.05 < best.offered <= 437.0
    lo, hi = load.knee_bracket(done)
    assert (lo, hi) == (mids[2], mids[0]) and hi / lo <= 1.05


def test_one_noisy_step_does_not_stop_the_steps_and_no_knee_means_no_refinement(monkeypatch):
    offered = fake_phases(monkeypatch, knee=1e9, noisy={200.0})
    done, best = asyncio.run(load.step_up(None, [b"{}"], [100, 200, 300, 400], 1.0, random.Random(0), extend=0))
    assert offered == [100, 200, 300, 400] and best.offered == 400  # 200 failed alone; nothing failed above 400
    assert load.knee_bracket(done) == (400, None)


def test_a_knee_above_the_listed_steps_is_found_by_rising_past_them(monkeypatch):
    offered = fake_phases(monkeypatch, knee=700.0)
    done, best = knee_of([100, 200, 400])
    # by hand: 400 passes; x1.25 -> 500, 625 pass, 781.2 and 976.5 fail (two in a row), then bisection 625..781.2
    assert offered[:7] == [100, 200, 400, 500.0, 625.0, 781.2, 976.5]
    assert 700.0 / 1.05 <= best.offered <= 700.0
    lo, hi = load.knee_bracket(done)
    assert hi / lo <= 1.05 and lo <= 700.0 < hi


def test_a_knee_below_the_listed_steps_is_found_by_halving(monkeypatch):
    offered = fake_phases(monkeypatch, knee=70.0)
    done, best = knee_of([100, 200, 300])
    # by hand: 100 and 200 fail (two in a row: stop); 50 passes; bisection 50..100 to 5 %
    assert offered[:3] == [100, 200, 50.0] and 70.0 / 1.05 <= best.offered <= 70.0


def test_rising_stops_after_max_extra_steps(monkeypatch):
    offered = fake_phases(monkeypatch, knee=1e9)
    done, _ = asyncio.run(load.step_up(None, [b"{}"], [100], 1.0, random.Random(0), max_extra=3))
    assert offered == [100, 125.0, 156.2, 195.2] and load.knee_bracket(done) == (195.2, None)


def test_resolution_zero_is_steps_only(monkeypatch):
    offered = fake_phases(monkeypatch, knee=437.0)
    _, best = knee_of([100, 200, 300, 400, 500, 600], resolution=0)
    assert offered == [100, 200, 300, 400, 500, 600] and best.offered == 400


@pytest.mark.parametrize("knee", [55.0, 120.0, 333.0, 999.0])
def test_the_refined_figure_is_within_resolution_below_the_knee(monkeypatch, knee):
    fake_phases(monkeypatch, knee=knee)
    _, best = knee_of([50, 100, 200, 400, 800, 1600])
    assert knee / 1.05 <= best.offered <= knee


def test_p99_per_bucket_from_the_answers_bucket_field():
    assert load.bucket_of(b'{"items": [3], "bucket": 50, "latency_ms": 1.2}') == "50"
    assert load.bucket_of(b'{"items": [3], "bucket": null}') == "cold_start" and load.bucket_of(b"{}") is None
    ph = load.Phase("p", 10.0, 1.0)
    for i in range(1, 101):  # bucket 50: 1..100 ms; bucket 200: 300 ms twice; numpy's linear percentile by hand
        ph.add("200", i / 1e3, "50")
    ph.add("200", 0.3, "200")
    ph.add("200", 0.3, "200")
    ph.add("429", None, None)
    s = ph.summary()
    assert s["p99_ms_by_bucket"] == {"50": 99.01, "200": 300.0} and s["answered_by_bucket"] == {"50": 100, "200": 2}


def test_beam_requests_are_labelled_apart():
    """--beam-share bodies carry a beam decoding and their latencies are keyed "<bucket>+beam", sorted after the bucket."""
    greedy = load.request_body(1, [10, 11], [5, 6], 5)
    beam = load.request_body(1, [10, 11], [5, 6], 5, beam_width=16)
    assert json.loads(beam)["decoding"] == {"strategy": "beam", "beam_width": 16} and "decoding" not in json.loads(greedy)
    answer = b'{"items": [], "bucket": 20}'
    assert load.latency_label(greedy, answer) == "20" and load.latency_label(beam, answer) == "20+beam"
    assert load.latency_label(beam, b"{}") is None
    ph = load.Phase("p", 10.0, 1.0)
    for key in ("200+beam", "20+beam", "200", "20"):
        ph.add("200", 0.01, key)
    assert list(ph.summary()["p99_ms_by_bucket"]) == ["20", "20+beam", "200", "200+beam"]


def test_bench_reports_the_offered_rate_that_passed_not_a_short_steps_achieved_count(monkeypatch):
    """hstu bench --serve --quick reported 73.0 QPS: the achieved rate (a Poisson count over 2 s) of the 62.5 offered
    step. The figure is the highest offered rate that passed; the achieved count of that step is kept beside it."""
    from hstu.bench.table import HTTP_QPS_ROW, markdown

    offered = []

    async def lucky_phase(client, bodies, phase, rng, max_in_flight, server=None):  # 17 % more arrivals than offered
        offered.append(phase.offered)
        phase.sent = int(phase.offered * phase.seconds * 1.17)
        for _ in range(phase.sent):
            phase.add("200", 0.2 if phase.offered > 30.0 else 0.01)
        return phase

    monkeypatch.setattr(load, "run_phase", lucky_phase)
    got = asyncio.run(load._max_qps("http://127.0.0.1:9", [b"{}"], [10.0, 20.0, 40.0], 2.0, 0, float("inf")))
    best = max(o for o in offered[1:] if o <= 30.0)  # offered[0]: the warm-up phase
    assert 30.0 / 1.05 <= best <= 30.0 and got["max_qps"] == got["offered_qps"] == best
    assert got["achieved_qps"] == round(int(best * 2.0 * 1.17) / 2.0, 1) > best
    cell = {"precision": "fp32", "serve": got}
    md = markdown([{"environment": {"device": "cpu", "device_name": "X"}, "cells": [cell]}])
    row = next(ln for ln in md.splitlines() if ln.startswith(f"| {HTTP_QPS_ROW} |"))
    assert row.split("|")[2].strip() == f"{best:.1f}"
