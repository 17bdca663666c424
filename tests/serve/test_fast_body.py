"""hstu.serve.fast_body against the pydantic schemas it mirrors: it may refuse more, never accept more,
and what it accepts has pydantic's values (generated bodies, boundary cases, the declarations)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hstu.config import BEAM_WIDTH_MAX, INT64_MAX, SEED_MAX, TEMPERATURE_MAX, TIME_S_MAX, TOP_K_MAX
from hstu.data.sequences import ID_MAX_CHARS
from hstu.serve import fast_body, schemas

PAIRS = [(schemas.GenerateRequest, fast_body.GenerateRequest), (schemas.ScoreRequest, fast_body.ScoreRequest)]
NESTED = [(schemas.Event, fast_body.Event), (schemas.Decoding, fast_body.Decoding)]


def _check(model, body: bytes) -> bool:
    """Assert the one-way contract for ``body``; returns whether the fast path took it."""
    fast = fast_body.decode(model.__name__, body)
    try:
        slow = model.model_validate_json(body)
    except Exception as exc:  # noqa: BLE001 - pydantic refuses: so must the fast path
        assert fast is None, f"fast path accepted a body pydantic refuses ({type(exc).__name__}): {body[:300]!r}"
        return False
    if fast is not None:
        assert msgspec.to_builtins(fast) == slow.model_dump(mode="python"), body[:300]
    return fast is not None


@pytest.mark.parametrize("slow,fast", PAIRS + NESTED, ids=lambda c: c.__name__)
def test_declarations_agree(slow, fast):
    """The same field names, required fields and defaults (a field added to the schema must be mirrored)."""
    f = {
        n: d
        for n, d in zip(
            fast.__struct_fields__,
            (msgspec.NODEFAULT,) * (len(fast.__struct_fields__) - len(fast.__struct_defaults__)) + fast.__struct_defaults__,
        )
    }
    s = {n: (msgspec.NODEFAULT if info.is_required() else info.default) for n, info in slow.model_fields.items()}
    assert f == s


def test_typical_bodies_take_the_fast_path():
    hist = [{"item_id": 10 + i, "timestamp": 978300000 + 60 * i} for i in range(200)]
    bodies = [
        {"history": hist, "k": 5},
        {"user_id": "u1", "history": hist[:3], "k": 3, "exclude": [1, "x"], "decoding": {"strategy": "beam", "beam_width": 16}},
        {"history": [{"item_id": "a", "timestamp": 0, "action": "buy", "features": {"price": 3, "brand": "b", "x": None}}]},
        {"history": hist[:5], "decoding": {"strategy": "topk", "top_k": 7, "temperature": 5, "seed": SEED_MAX}, "request_time": TIME_S_MAX},
    ]
    for b in bodies:
        assert _check(schemas.GenerateRequest, json.dumps(b).encode())
    assert _check(schemas.ScoreRequest, json.dumps({"history": hist[:4], "candidates": [1, "2"]}).encode())
    req = fast_body.decode("GenerateRequest", json.dumps(bodies[3]).encode())
    assert req.decoding.options() == schemas.Decoding(strategy="topk", top_k=7, temperature=5.0, seed=SEED_MAX).options()


BAD = [
    '{"history": [{"item_id": true, "timestamp": 1}]}',
    '{"history": [{"item_id": 1.0, "timestamp": 1}]}',
    '{"history": [{"item_id": 1, "timestamp": 1.0}]}',
    '{"history": [{"item_id": 1, "timestamp": -1}]}',
    '{"history": [{"item_id": 1, "timestamp": "1"}]}',
    f'{{"history": [{{"item_id": {INT64_MAX + 1}, "timestamp": 1}}]}}',
    f'{{"history": [{{"item_id": {-INT64_MAX - 2}, "timestamp": 1}}]}}',
    f'{{"history": [{{"item_id": "{"x" * (ID_MAX_CHARS + 1)}", "timestamp": 1}}]}}',
    '{"history": [{"item_id": 1, "timestamp": 1, "action": "' + "a" * 65 + '"}]}',
    '{"history": [{"item_id": 1, "timestamp": 1, "features": {"' + "f" * 65 + '": 1}}]}',
    '{"history": [{"item_id": 1, "timestamp": 1, "features": {' + ", ".join(f'"f{i}": 1' for i in range(65)) + "}}]}",
    '{"history": [{"item_id": 1, "timestamp": 1, "features": {"a": [1]}}]}',
    '{"history": [{"item_id": 1, "timestamp": 1, "features": {"a": true}}]}',
    '{"history": [{"item_id": 1, "timestamp": 1, "extra": 1}]}',
    '{"history": [], "exlude": [1]}',
    '{"history": [], "k": "5"}',
    '{"history": [], "k": true}',
    '{"history": [], "exclude_history": 1}',
    '{"history": [], "user_id": false}',
    '{"history": [], "unknown_items": "keep"}',
    '{"history": [], "timestamp_order": "SORT"}',
    '{"history": [], "decoding": {"strategy": "sample"}}',
    '{"history": [], "decoding": {"temperature": 0}}',
    f'{{"history": [], "decoding": {{"temperature": {TEMPERATURE_MAX * 1.0001}}}}}',
    '{"history": [], "decoding": {"temperature": NaN}}',
    '{"history": [], "decoding": {"temperature": 1e400}}',
    f'{{"history": [], "decoding": {{"top_k": {TOP_K_MAX + 1}}}}}',
    '{"history": [], "decoding": {"top_k": 0}}',
    f'{{"history": [], "decoding": {{"beam_width": {BEAM_WIDTH_MAX + 1}}}}}',
    f'{{"history": [], "decoding": {{"seed": {SEED_MAX + 1}}}}}',
    '{"history": [], "decoding": {"seed": -1}}',
    '{"history": [], "request_time": -1}',
    f'{{"history": [], "request_time": {TIME_S_MAX + 1}}}',
    '{"history": [{"item_id": 1, "timestamp": 1700000000000}]}',  # milliseconds: refused, never read as seconds
    '{"history": [], "exclude": ' + json.dumps(list(range(100_001))) + "}",
    '{"history": [{"item_id": "\\ud800", "timestamp": 1}]}',  # a lone surrogate
    '{"k": 5}',
    '{"history": {}}',
    '{"history": [], "k": 3, "k": 7}',  # duplicate key: the last one, both ways
    '[{"history": []}]',
    '{"history": []',
    "",
]


@pytest.mark.parametrize("body", BAD, ids=range(len(BAD)))
def test_boundary_bodies(body):
    _check(schemas.GenerateRequest, body.encode())


RAW = [
    b'\xef\xbb\xbf{"history": []}',  # a UTF-8 byte-order mark
    b'{"history": [{"item_id": "\xff\xfe", "timestamp": 1}]}',  # not UTF-8
    b'{"history": [{"item_id": "\xed\xa0\x80", "timestamp": 1}]}',  # an encoded surrogate
    b'{"history": []} x',
    b' {"history": []}\n',
    b'{"history": [{"item_id": "a\\u0000b", "timestamp": 1}]}',
    b'{"history": [], "k": -0}',
    b'{"history": [], "k": 1E2}',
    b'{"history": [], "k": 00}',
    b'{"history": [], "decoding": {"temperature": 1E2}}',
    b'{"history": [], "decoding": {"temperature": -0.0}}',
]


@pytest.mark.parametrize("body", RAW, ids=range(len(RAW)))
def test_raw_bytes(body):
    _check(schemas.GenerateRequest, body)


def test_score_boundaries():
    for b in ('{"history": [], "candidates": []}', '{"history": [], "candidates": [true]}', '{"history": [], "k": 5, "candidates": [1]}'):
        assert not _check(schemas.ScoreRequest, b.encode())


_ints = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([INT64_MAX, INT64_MAX + 1, -INT64_MAX - 1, -INT64_MAX - 2, SEED_MAX, SEED_MAX + 1, TOP_K_MAX, TOP_K_MAX + 1]),
    st.integers(),
)
_scalars = st.one_of(_ints, st.booleans(), st.none(), st.floats(allow_nan=False), st.text(max_size=3), st.text(min_size=60, max_size=70))
_vals = st.recursive(_scalars, lambda c: st.lists(c, max_size=2) | st.dictionaries(st.text(max_size=3), c, max_size=2), max_leaves=4)
_event = st.fixed_dictionaries(
    {"item_id": _scalars, "timestamp": _ints},
    optional={
        "action": st.one_of(st.none(), st.text(max_size=66), _ints),
        "features": st.one_of(st.none(), st.dictionaries(st.text(max_size=66), _scalars, max_size=3)),
        "xtra": _scalars,
    },
)
_decoding = st.fixed_dictionaries(
    {},
    optional={
        "strategy": st.sampled_from(["greedy", "topk", "beam", "x"]),
        "top_k": _ints,
        "temperature": st.one_of(_ints, st.floats(allow_nan=False, allow_infinity=False)),
        "beam_width": _ints,
        "seed": _ints,
    },
)
_generate = st.fixed_dictionaries(
    {"history": st.lists(_event, max_size=3)},
    optional={
        "user_id": _scalars,
        "k": _scalars,
        "exclude": st.one_of(st.none(), st.lists(_scalars, max_size=3)),
        "exclude_history": _scalars,
        "allow_untrained_items": _scalars,
        "request_time": _scalars,
        "decoding": st.one_of(st.none(), _decoding, _vals),
        "unknown_items": st.sampled_from(["drop", "reject", "x", None]),
        "timestamp_order": st.sampled_from(["sort", "reject", 1, None]),
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_generate)
def test_generated_generate_bodies(body):
    _check(schemas.GenerateRequest, json.dumps(body).encode())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_event, max_size=3), st.lists(_scalars, max_size=3), _scalars)
def test_generated_score_bodies(history, candidates, user_id):
    _check(schemas.ScoreRequest, json.dumps({"history": history, "candidates": candidates, "user_id": user_id}).encode())
