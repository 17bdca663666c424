"""Bounded schema fuzz: schemathesis against the app's own OpenAPI (``/openapi.json``), live.

The real app serves the tiny trained run of :mod:`test_serve` on uvicorn (127.0.0.1, port 0,
the HTTP protocol ``hstu serve`` runs). Every documented operation gets a fixed number of
generated requests: schema-valid ones (positive) for all operations, half of those on the JSON
endpoints as a typical client writes them (:func:`known_ids`: the run's item ids, integers
without ".0"), and schema-invalid ones (negative) for the two JSON endpoints; Hypothesis is
derandomized (fixed seed, no example database) so CI sees the same requests every run. Each response must not be a 5xx,
must have a documented status code, content type and headers, and a body valid against the
documented schema; schema-invalid requests must be refused with a 4xx.

One test drives schemathesis' Python API (no per-operation parametrization) so that the one
live server serves every operation; the count of requests sent is checked at the end.
"""

from __future__ import annotations

from collections import Counter

import hypothesis
import pytest
from test_serve_http import make_server

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra: pip install -e '.[test]'")
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

POSITIVE = {"POST /v1/generate": 120, "POST /v1/score": 120}  # examples per operation; the GET probes: GET_EXAMPLES
NEGATIVE = {"POST /v1/generate": 40, "POST /v1/score": 40}
GET_EXAMPLES = 5
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance, response_schema_conformance]


def known_ids(known: list[int], max_k: int):
    """A Case -> the same Case as a typical client sends it, so that schema-valid requests reach the
    model instead of stopping at a 422: integral floats written as integers (JSON Schema counts 0.0
    as an integer, the server's strict types do not), item ids mapped onto the run's ids (id %
    catalogue size; random int64 ids are unknown to the run) and k into 1..max_k."""

    def ints(x):
        if isinstance(x, float) and x.is_integer() and abs(x) < 2**63:
            return int(x)
        if isinstance(x, dict):
            return {k: ints(v) for k, v in x.items()}
        return [ints(v) for v in x] if isinstance(x, list) else x

    def remap(x):
        return known[x % len(known)] if isinstance(x, int) and not isinstance(x, bool) else x

    def fix(case):
        body = case.body = ints(case.body)
        if isinstance(body, dict):
            for e in body.get("history") or []:
                if isinstance(e, dict) and "item_id" in e:
                    e["item_id"] = remap(e["item_id"])
            if isinstance(body.get("candidates"), list):
                body["candidates"] = [remap(c) for c in body["candidates"]]
            if isinstance(body.get("k"), int) and not isinstance(body["k"], bool):
                body["k"] = 1 + body["k"] % max_k
        return case

    return fix


def run_operation(op, base_url: str, mode: GenerationMode, examples: int, codes: Counter, fix=None) -> None:
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])
    strategy = op.as_strategy(generation_mode=mode)

    @hypothesis.settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=strategy if fix is None else hypothesis.strategies.one_of(strategy, strategy.map(fix)))
    def fuzz(case) -> None:
        response = case.call(base_url=base_url, timeout=60)
        codes[response.status_code] += 1
        case.validate_response(response, checks=checks)

    fuzz()


def test_openapi_schema_fuzz(rec, popularity) -> None:  # noqa: F811
    with make_server(rec, popularity) as s:
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
        ops = {op.label: op for op in (r.ok() for r in schema.get_all_operations())}
        assert {"POST /v1/generate", "POST /v1/score", "GET /healthz", "GET /readyz", "GET /metrics"} <= set(ops)
        codes: Counter = Counter()
        fix = known_ids([int(r) for r in rec.raw_ids[1:]], rec.model.cfg.max_output_len)
        for label, op in sorted(ops.items()):
            run_operation(op, s.url, GenerationMode.POSITIVE, POSITIVE.get(label, GET_EXAMPLES), codes, fix if label in POSITIVE else None)
            if label in NEGATIVE:
                run_operation(op, s.url, GenerationMode.NEGATIVE, NEGATIVE[label], codes)
        print(f"schemathesis: {sum(codes.values())} requests over {len(ops)} operations, by status {dict(sorted(codes.items()))}")
        assert sum(codes.values()) >= 300 and codes[200] > 0 and codes[422] > 0
