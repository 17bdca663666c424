"""Request and response bodies of the HTTP service (pydantic v2, strict types).

Types are strict (https://docs.pydantic.dev/latest/concepts/strict_mode/): ``"5"`` is not an
integer and ``true`` is not an item id, so a wrong type answers 422 naming the field instead of
being coerced. Unknown fields are rejected too (``extra="forbid"``), which catches misspelt
options such as ``"exlude"``. Ranges that depend on the loaded model (``k`` up to the model's
``max_output_len``, the number of candidates) are checked by the app after parsing and answered
with the same 422 body.

Units: timestamps and ``request_time`` are Unix seconds (int); ``latency_ms`` is milliseconds
measured in the server from the request's arrival to the response; scores are the model's
cosine similarity / temperature (DESIGN.md "The model"), except on the cold-start path where a
score is the item's share of the training events (documented on :class:`GenerateResponse`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from hstu.data.sequences import ID_MAX_CHARS
from hstu.config import BEAM_WIDTH_MAX, INT64_MAX, SEED_MAX, TEMPERATURE_MAX, TIME_S_MAX, TOP_K_MAX, DecodeOptions
from hstu.generate.histories import TIME_FIELDS, ms_hint


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _user_id(v: Any) -> int | str | None:
    return None if v is None else _item_id(v, "user_id_type", " or null")


def _item_id(v: Any, error: str = "id_type", null: str = "") -> int | str:
    """An original id as given: an int64 integer or a string of at most USER_ID_MAX_CHARS characters
    (the run maps it: :mod:`hstu.data.sequences`); anything else one error naming the field."""
    if (isinstance(v, str) and len(v) <= USER_ID_MAX_CHARS) or (
        isinstance(v, int) and not isinstance(v, bool) and -INT64_MAX - 1 <= v <= INT64_MAX
    ):
        return v
    kind = {
        dict: "an object",
        list: "an array",
        bool: "a boolean",
        float: "a number that is not an integer",
        int: "an integer outside int64",
        str: f"a string over {USER_ID_MAX_CHARS} characters",
    }.get(type(v), type(v).__name__)
    raise PydanticCustomError(
        error,
        "must be an int64 integer" + ("," if null else " or") + " a string of at most {n} characters" + null + ", got {kind}",
        {"kind": kind, "n": USER_ID_MAX_CHARS},
    )


USER_ID_MAX_CHARS = ID_MAX_CHARS  # text ids: users and items alike
_ID_SCHEMA = [{"type": "integer", "minimum": -INT64_MAX - 1, "maximum": INT64_MAX}, {"type": "string", "maxLength": USER_ID_MAX_CHARS}]

# an original item id, int or text (one error naming the field, as UserId). An int64 integer is checked
# natively (pydantic-core; a 200-event history parsed 45 us faster than through the Python validator
# alone); anything else goes to _item_id, whose error public_errors keeps as the field's only one.
_INT_MEMBER = "constrained-int"
ItemId = Annotated[
    Annotated[int, Field(strict=True, ge=-INT64_MAX - 1, le=INT64_MAX)] | Annotated[Any, PlainValidator(_item_id)],
    Field(union_mode="left_to_right"),
    WithJsonSchema({"anyOf": _ID_SCHEMA}),
]
_ID_MEMBER = "function-plain[_item_id()]"


_FEATURE_MEMBERS = ("float", "str")  # the members of a feature value's union (Event.features), as pydantic names them


def public_errors(errors: list[dict]) -> list[dict]:
    """Pydantic errors as a client should read them: an ItemId's two union-member errors become its
    _item_id error alone, at the field's own location (``history[3].item_id``, not ``....constrained-int``);
    a feature value's two become one at ``history[i].features.NAME`` (not ``....float`` and ``....str``); a
    feature name's error is at ``history[i].features``, naming the name (not ``....NAME.[key]``)."""
    out, seen = [], set()
    for e in errors:
        loc = tuple(e.get("loc", ()))
        if loc and loc[-1] == _INT_MEMBER and e.get("type") != "missing":
            continue
        if len(loc) >= 3 and loc[-3] == "features" and loc[-1] in _FEATURE_MEMBERS:
            if loc[:-1] not in seen:
                seen.add(loc[:-1])
                out.append(
                    {
                        **e,
                        "loc": loc[:-1],
                        "type": "feature_type",
                        "msg": "Input should be a number or a string (as the feature's kind: numeric or categorical), or null",
                    }
                )
            continue
        if len(loc) >= 3 and loc[-3] == "features" and loc[-1] == "[key]":
            out.append({**e, "loc": loc[:-2], "msg": f"name {str(loc[-2])[:80]!r}: {e.get('msg', 'invalid')}"})
            continue
        if e.get("type") == "less_than_equal" and loc and loc[-1] in TIME_FIELDS:  # as the CLI and the Python API say it
            e = {**e, "msg": f"{e.get('msg', 'invalid')} (Unix seconds, up to 2262-04-11{ms_hint(e.get('input'))})"}
        out.append({**e, "loc": loc[:-1]} if loc and loc[-1] == _ID_MEMBER else e)
    return out


# one error naming user_id (a plain ``int | str`` union reports "user_id.int" and "user_id.str")
UserId = Annotated[
    int | str | None,
    PlainValidator(_user_id),
    WithJsonSchema({"anyOf": [*_ID_SCHEMA, {"type": "null"}]}),
]


class Event(_Strict):
    """One history event: original item id, Unix seconds, optional action name (e.g. "buy")."""

    item_id: ItemId = Field(description="original item id as in the training data: an integer, or a text (trimmed, case kept)")
    timestamp: int = Field(ge=0, le=TIME_S_MAX, description="Unix seconds (up to 2262-04-11: milliseconds are refused)")
    action: str | None = Field(
        default=None, max_length=64, description="action name from the run's idmap (unknown names count as none, with a warning)"
    )
    features: dict[Annotated[str, Field(max_length=64)], float | str | None] | None = Field(
        default=None,
        max_length=64,
        description="side features of the event (runs trained with them, idmap.json features): name -> a number (numeric: "
        "bucketised with the run's quantile edges) or a text (categorical; unknown texts count as none); null = unknown; a "
        "feature not named takes the item's last training value; an unknown name is a 422 naming history[i].features.NAME",
    )


class Decoding(_Strict):
    """How the k items are chosen (:class:`hstu.config.DecodeOptions`, :mod:`hstu.generate.sampler`).

    - ``greedy``: the best remaining item at every step; deterministic and independent of the
      batch a request lands in.
    - ``topk``: sample among the ``top_k`` best at softmax ``temperature``, seeded by ``seed``;
      each such request runs on its own so that a seed always gives the same items.
    - ``beam``: ``beam_width`` beams ranked by the sum of log-probabilities.
    """

    strategy: Literal["greedy", "topk", "beam"] = "greedy"
    top_k: int = Field(default=50, ge=1, le=TOP_K_MAX)
    temperature: float = Field(default=1.0, gt=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False)
    beam_width: int = Field(default=4, ge=1, le=BEAM_WIDTH_MAX)
    seed: int = Field(default=0, ge=0, le=SEED_MAX)

    def options(self) -> DecodeOptions:
        """The same choice as the one decoding-options type of every generation path."""
        return DecodeOptions(self.strategy, self.top_k, self.temperature, self.beam_width, self.seed)


UnknownPolicy = Literal["drop", "reject"]
OrderPolicy = Literal["sort", "reject"]


class GenerateRequest(_Strict):
    """``POST /v1/generate`` body.

    An empty ``history`` takes the cold-start path (most popular training items; see
    :class:`GenerateResponse`). ``unknown_items`` and ``timestamp_order`` override the server's
    policies for this request. ``exclude``, the history (when excluded) and the items without
    training events (unless ``allow_untrained_items``) must leave at least k items (beam:
    max(k, beam_width)), else 422 naming ``exclude`` (or ``k`` when no ``exclude`` is given).
    ``decoding.temperature`` may be any value in (0, 100]: a tiny one (5e-324) samples in the
    greedy limit, never a non-finite score.
    """

    user_id: UserId = Field(
        default=None, description="echoed back; routing key for a load balancer; keys the user-prefix cache (hstu serve --prefix-cache-mb)"
    )
    history: list[Event] = Field(description="events, ideally oldest first")
    # range checked by the app against the loaded model (hstu.config.check_k: the message `hstu generate -k` gives)
    k: Annotated[int | None, BeforeValidator(lambda v: 5 if v is None else v)] = Field(  # null: the default, as other optional fields
        default=5, description="items to return, 1..the model's max_output_len (null: 5)", json_schema_extra={"minimum": 1}
    )
    exclude: list[ItemId] | None = Field(default=None, max_length=100_000, description="original item ids never to return")
    exclude_history: bool | None = Field(default=None, description="never return history items (default: the data set's)")
    allow_untrained_items: bool | None = Field(
        default=None, description="may return items without training events (default: only for a run trained with cold_item_dropout > 0)"
    )
    request_time: int | None = Field(default=None, ge=0, le=TIME_S_MAX, description="Unix seconds; default: the last event's time")
    decoding: Decoding | None = None
    unknown_items: UnknownPolicy | None = Field(default=None, description="drop (with a warning) or reject unknown item ids")
    timestamp_order: OrderPolicy | None = Field(default=None, description="sort (stable) or reject out-of-order histories")


class ScoreRequest(_Strict):
    """``POST /v1/score`` body: candidates are scored each against the history alone
    (target-aware: no candidate sees another one). Scores come back in input order."""

    user_id: UserId = None
    history: list[Event] = Field(description="at least one event (no cold-start scoring)")
    candidates: list[ItemId] = Field(min_length=1, description="original item ids to score")
    request_time: int | None = Field(default=None, ge=0, le=TIME_S_MAX)
    unknown_items: UnknownPolicy | None = None
    timestamp_order: OrderPolicy | None = None


class Item(BaseModel):
    item_id: int | str
    score: float
    action: str | None = None
    title: str | None = None
    category: int | None = None
    meta: dict[str, str | int | float | bool | None] | None = Field(
        default=None, description="the item's metadata columns (hstu train --items FILE); absent for runs without them"
    )


class GenerateResponse(BaseModel):
    """Next-k items.

    ``bucket``: the length bucket (upper edge, events) the history ran in; ``null`` on the
    cold-start path. ``cold_start``: true when the history was empty (or empty after dropping
    unknown ids): the items are the run's most popular training items (by event count, ties by
    id) minus exclusions, and each ``score`` is the item's share of training events (0..1), not
    a model score. ``history_length``: events actually used (after dropping unknown ids and
    keeping the most recent ones). ``warnings``: what was changed in the input.
    """

    user_id: int | str | None = None
    items: list[Item]
    bucket: int | None
    latency_ms: float
    history_length: int
    cold_start: bool = False
    warnings: list[str] = Field(default_factory=list)


class ScoreResponse(BaseModel):
    """``scores[i]`` belongs to ``candidates[i]``; null for an unknown candidate id (policy "drop")."""

    user_id: int | str | None = None
    scores: list[float | None]
    bucket: int
    latency_ms: float
    history_length: int
    warnings: list[str] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    type: str
    message: str
    field: str | None = None


class ErrorBody(BaseModel):
    """The one error body of every non-2xx answer."""

    error: ErrorInfo
    errors: list[ErrorInfo] | None = None


__all__ = [
    "Decoding",
    "ErrorBody",
    "ErrorInfo",
    "Event",
    "GenerateRequest",
    "GenerateResponse",
    "Item",
    "ScoreRequest",
    "ScoreResponse",
]
