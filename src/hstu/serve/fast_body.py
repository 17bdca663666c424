"""The model endpoints' request bodies decoded by msgspec: the fast path of :func:`hstu.serve.edge.read_body`.

pydantic (:mod:`hstu.serve.schemas`) stays the schema of record: the OpenAPI document, every error
body and every body this path does not take. A body is first decoded here into :class:`msgspec.Struct`
types that mirror :class:`~hstu.serve.schemas.GenerateRequest` and :class:`~hstu.serve.schemas.ScoreRequest`
field by field (names, defaults, strict types, ranges, lengths, unknown fields refused); a body that
passes gives the same values pydantic would (tests/serve/test_fast_body.py checks both ways on generated
bodies), and one that does not is handed to pydantic, whose error is answered. So the fast path may only
ever refuse more than pydantic, never accept more: a constraint added to the schemas belongs here too
(the test compares the two declarations' fields and defaults).

Why: a 200-event history took ~130-170 us to validate as pydantic models and 25-35 us here, and the
service's per-event attribute reads 38 against 12 us (one CPU thread; ``benchmarks/serve_wire.py``
measures both side by side): the HTTP process's largest single cost per request after the protocol
itself. msgspec: https://jcristharif.com/msgspec/ (``msgspec.json.Decoder``, ``msgspec.Meta``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from hstu.config import BEAM_WIDTH_MAX, INT64_MAX, SEED_MAX, TEMPERATURE_MAX, TIME_S_MAX, TOP_K_MAX, DecodeOptions
from hstu.data.sequences import ID_MAX_CHARS

_Int64 = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
_Id = _Int64 | Annotated[str, msgspec.Meta(max_length=ID_MAX_CHARS)]  # schemas.ItemId / UserId (JSON int and str are disjoint)
_Time = Annotated[int, msgspec.Meta(ge=0, le=TIME_S_MAX)]  # Unix seconds (hstu.config.TIME_S_MAX)
_Name = Annotated[str, msgspec.Meta(max_length=64)]
_Features = Annotated[dict[_Name, float | str | None], msgspec.Meta(max_length=64)]
_Unknown = Literal["drop", "reject"]
_Order = Literal["sort", "reject"]


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    pass


class Event(_Body):
    """:class:`hstu.serve.schemas.Event`."""

    item_id: _Id
    timestamp: _Time
    action: _Name | None = None
    features: _Features | None = None


class Decoding(_Body):
    """:class:`hstu.serve.schemas.Decoding`."""

    strategy: Literal["greedy", "topk", "beam"] = "greedy"
    top_k: Annotated[int, msgspec.Meta(ge=1, le=TOP_K_MAX)] = 50
    temperature: Annotated[float, msgspec.Meta(gt=0.0, le=TEMPERATURE_MAX)] = 1.0
    beam_width: Annotated[int, msgspec.Meta(ge=1, le=BEAM_WIDTH_MAX)] = 4
    seed: Annotated[int, msgspec.Meta(ge=0, le=SEED_MAX)] = 0

    def options(self) -> DecodeOptions:
        """As :meth:`hstu.serve.schemas.Decoding.options`."""
        return DecodeOptions(self.strategy, self.top_k, self.temperature, self.beam_width, self.seed)


class GenerateRequest(_Body):
    """:class:`hstu.serve.schemas.GenerateRequest`."""

    history: list[Event]
    user_id: _Id | None = None
    k: int = 5
    exclude: Annotated[list[_Id], msgspec.Meta(max_length=100_000)] | None = None
    exclude_history: bool | None = None
    allow_untrained_items: bool | None = None
    request_time: _Time | None = None
    decoding: Decoding | None = None
    unknown_items: _Unknown | None = None
    timestamp_order: _Order | None = None


class ScoreRequest(_Body):
    """:class:`hstu.serve.schemas.ScoreRequest`."""

    history: list[Event]
    candidates: Annotated[list[_Id], msgspec.Meta(min_length=1)]
    user_id: _Id | None = None
    request_time: _Time | None = None
    unknown_items: _Unknown | None = None
    timestamp_order: _Order | None = None


DECODERS = {
    "GenerateRequest": msgspec.json.Decoder(GenerateRequest),
    "ScoreRequest": msgspec.json.Decoder(ScoreRequest),
}  # by the pydantic model's name


def decode(model_name: str, body: bytes) -> msgspec.Struct | None:
    """``body`` decoded as the Struct mirroring the pydantic model named ``model_name``, or None when
    there is no mirror or msgspec refuses the body (the caller then validates it with pydantic,
    which answers the error). Never raises for a bad body."""
    dec = DECODERS.get(model_name)
    if dec is None:
        return None
    try:
        return dec.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


__all__ = ["DECODERS", "Decoding", "Event", "GenerateRequest", "ScoreRequest", "decode"]
