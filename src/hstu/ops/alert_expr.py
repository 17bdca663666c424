"""Alert-rule expressions: samples as series, the expression AST (conditions joined by and / or) and its parser.

The grammar and its semantics are described in :mod:`hstu.ops.alerts`, which builds rules and the
engine on top of this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hstu.ops._common import parse_quantity

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, metric name excluded
SEVERITIES = ("info", "warning", "critical")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_METRIC_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@dataclass(frozen=True)
class Sample:
    """One metric value: ``name`` (Prometheus metric name), ``labels`` (sorted pairs), ``value``."""

    name: str
    labels: Labels
    value: float

    @staticmethod
    def of(metric: str, value: float, /, **labels: str) -> Sample:
        """``Sample.of("hstu_device_temperature_celsius", 71, backend="cuda", device="0")``."""
        return Sample(metric, tuple(sorted((k, str(v)) for k, v in labels.items())), float(value))


SampleInput = Iterable[Sample] | Mapping[str, float]
Series = dict[str, dict[Labels, float]]  # metric name -> {labels: value}


def to_series(samples: SampleInput) -> Series:
    """Index samples by metric name. A mapping ``{name: value}`` means unlabelled samples."""
    out: Series = {}
    if isinstance(samples, Mapping):
        for name, value in samples.items():
            out.setdefault(name, {})[()] = float(value)
        return out
    for s in samples:
        out.setdefault(s.name, {})[s.labels] = s.value
    return out


# ------------------------------------------------------------------------------------------ AST

_CMP = {
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


def _fmt_num(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() or abs(x) >= 1e16 else str(int(x))


@dataclass(frozen=True)
class Condition:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, "=" | "!=", value)
    op: str
    threshold: float

    def evaluate(self, series: Series) -> dict[Labels, float]:
        out = {}
        for labels, value in series.get(self.metric, {}).items():
            d = dict(labels)
            if all((d.get(k, "") == v) == (mop == "=") for k, mop, v in self.matchers) and _CMP[self.op](value, self.threshold):
                out[labels] = value
        return out

    def promql(self) -> str:
        sel = ""
        if self.matchers:
            sel = "{" + ",".join(f"{k}{op}{json.dumps(v)}" for k, op, v in self.matchers) + "}"
        return f"{self.metric}{sel} {self.op} {_fmt_num(self.threshold)}"

    def metrics(self) -> set[str]:
        return {self.metric}


@dataclass(frozen=True)
class BinaryOp:
    op: str  # "and" | "or"
    left: Expr
    right: Expr
    on: tuple[str, ...] | None = None

    def evaluate(self, series: Series) -> dict[Labels, float]:
        left, right = self.left.evaluate(series), self.right.evaluate(series)

        def key(labels: Labels) -> Labels:
            if self.on is None:
                return labels
            d = dict(labels)
            return tuple((k, d.get(k, "")) for k in self.on)

        rkeys = {key(lb) for lb in right}
        if self.op == "and":
            return {lb: v for lb, v in left.items() if key(lb) in rkeys}
        lkeys = {key(lb) for lb in left}
        out = dict(left)
        out.update({lb: v for lb, v in right.items() if key(lb) not in lkeys})
        return out

    def promql(self) -> str:
        on = f" on({', '.join(self.on)})" if self.on is not None else ""
        return f"({self.left.promql()}) {self.op}{on} ({self.right.promql()})"

    def metrics(self) -> set[str]:
        return self.left.metrics() | self.right.metrics()


Expr = Condition | BinaryOp

# ------------------------------------------------------------------------------------------ parser

_TOKEN_RE = re.compile(
    r"""\s*(?:
        (?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?:%|[kKMGTP]i?)?(?:B/s|B|/s)?)
      | (?P<str>"(?:[^"\\]|\\.)*")
      | (?P<cmp>>=|<=|==|!=|>|<)
      | (?P<eq>=)
      | (?P<punct>[(){},])
      | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    )""",
    re.VERBOSE,
)


class ExprError(ValueError):
    """A malformed rule expression; the message names the column."""


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    toks, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN_RE.match(text, pos)
        if not m or m.end() == pos:
            idx = len(text) - len(text[pos:].lstrip())
            raise ExprError(f"unexpected character {text[idx]!r} at column {idx + 1}")
        kind = m.lastgroup or ""
        toks.append((kind, m.group(kind), m.start(kind) + 1))
        pos = m.end()
    return toks


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    def peek(self) -> tuple[str, str, int] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def fail(self, what: str) -> ExprError:
        t = self.peek()
        where = f"at column {t[2]} ({t[1]!r})" if t else "at the end"
        return ExprError(f"expected {what} {where}")

    def take(self, kind: str, value: str | None = None) -> str:
        t = self.peek()
        if t is None or t[0] != kind or (value is not None and t[1].lower() != value):
            raise self.fail(value or kind)
        self.i += 1
        return t[1]

    def keyword(self, word: str) -> bool:
        t = self.peek()
        if t and t[0] == "ident" and t[1].lower() == word:
            self.i += 1
            return True
        return False

    def parse(self) -> Expr:
        if not self.toks:
            raise ExprError("empty expression")
        e = self.expr()
        if self.peek() is not None:
            raise self.fail("'and', 'or' or the end")
        return e

    def on_clause(self) -> tuple[str, ...] | None:
        if not self.keyword("on"):
            return None
        self.take("punct", "(")
        labels: list[str] = []
        if self.peek() and self.peek()[1] != ")":
            labels.append(self.take("ident"))
            while self.peek() and self.peek()[1] == ",":
                self.i += 1
                labels.append(self.take("ident"))
        self.take("punct", ")")
        return tuple(labels)

    def expr(self) -> Expr:
        left = self.term()
        while self.keyword("or"):
            on = self.on_clause()
            left = BinaryOp("or", left, self.term(), on)
        return left

    def term(self) -> Expr:
        left = self.atom()
        while self.keyword("and"):
            on = self.on_clause()
            left = BinaryOp("and", left, self.atom(), on)
        return left

    def atom(self) -> Expr:
        t = self.peek()
        if t and t[1] == "(":
            self.i += 1
            e = self.expr()
            self.take("punct", ")")
            return e
        if not t or t[0] != "ident" or t[1].lower() in ("and", "or", "on"):
            raise self.fail("a metric name or '('")
        metric = self.take("ident")
        matchers: list[tuple[str, str, str]] = []
        if self.peek() and self.peek()[1] == "{":
            self.i += 1
            while True:
                label = self.take("ident")
                nt = self.peek()
                if nt and nt[0] == "eq":
                    self.i += 1
                    mop = "="
                elif nt and nt[0] == "cmp" and nt[1] == "!=":
                    self.i += 1
                    mop = "!="
                else:
                    raise self.fail("'=' or '!=' in the label matcher")
                value = json.loads(self.take("str"))
                matchers.append((label, mop, value))
                if self.peek() and self.peek()[1] == ",":
                    self.i += 1
                    continue
                self.take("punct", "}")
                break
        op = self.take("cmp")
        num = self.take("num")
        try:
            threshold = parse_quantity(num)
        except ValueError as exc:
            raise ExprError(str(exc)) from exc
        if metric.endswith("_ratio") and abs(threshold) > 1:  # a percent written as a plain number: never (or always) true
            raise ExprError(f"{metric} is a 0..1 ratio, compared with {num}: write {num}% or {threshold / 100:g}")
        return Condition(metric, tuple(matchers), op, threshold)


def parse_expr(text: str) -> Expr:
    """Parse a rule condition; raises :class:`ExprError` (a ValueError) naming the column."""
    return _Parser(text).parse()
