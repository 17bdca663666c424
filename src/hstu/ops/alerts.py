"""Composite alert rules over metric samples, evaluated in-process with Prometheus semantics, and
exported as a Prometheus alerting-rules file.

A rule is a condition expression plus a duration::

    - name: MemoryBandwidthBottleneck
      when: hstu_device_memory_bandwidth_utilization_ratio > 85% and hstu_device_compute_utilization_ratio < 40%
      for: 30s
      severity: warning
      summary: memory-bandwidth bottleneck

Expression grammar (``and`` binds tighter than ``or``; keywords are case-insensitive)::

    expr   := term  ( "or"  [on] term )*
    term   := atom  ( "and" [on] atom )*
    atom   := "(" expr ")" | metric [ "{" label ("="|"!=") "value" , ... "}" ] ("<"|"<="|">"|">="|"=="|"!=") number
    on     := "on" "(" [label ("," label)*] ")"
    number := 0.85 | 85% | 8GB/s | 2GiB | 1e9      (see hstu.ops._common.parse_quantity)

Semantics follow PromQL so that the exported rule means what the in-process engine does
(https://prometheus.io/docs/prometheus/latest/querying/operators/):

- ``metric > x`` keeps the series of ``metric`` whose value is > x (label sets without the name).
- ``a and b`` keeps the series of ``a`` for which ``b`` has a series with the same labels; with
  ``on(l1, l2)`` only those labels must match, and ``on()`` matches whenever ``b`` has any series.
- ``a or b`` is every series of ``a`` plus the series of ``b`` whose labels match none of ``a``.
- ``for``: an alert instance (rule x result label set) is *pending* from the first evaluation at which
  it appears and *firing* once it has been present at every evaluation for at least ``for`` seconds
  (Prometheus alerting-rules docs, "for" clause); it is dropped (resolved, if it fired) at the first
  evaluation without it. ``for: 0s`` fires at the first evaluation.

The engine is independent of where samples come from: ``hstu monitor`` feeds device/host metrics, and
the serving module can feed its own (queue depth, latency) by calling :meth:`AlertEngine.evaluate`.
Thread safety: one lock guards evaluate/alerts, so a scrape thread may read while another evaluates.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hstu.ops._common import format_prom_duration, parse_duration

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


from hstu.ops.alert_expr import (  # noqa: F401 (Sample, Condition, BinaryOp, Series re-exported: the old import path)
    _NAME_RE,
    SEVERITIES,
    BinaryOp,
    Condition,
    Expr,
    ExprError,
    Labels,
    Sample,
    SampleInput,
    Series,
    parse_expr,
    to_series,
)

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ rules


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: Expr
    when: str  # the source text
    for_s: float = 0.0
    severity: str = "warning"
    summary: str = ""
    description: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    where: str = field(default="rule", compare=False)  # where it was read, e.g. "alerts.yaml:2", for errors

    def ref(self) -> str:
        """``alerts.yaml:2 (Name)``: how an error about this rule starts, as the loader's errors do."""
        return f"{self.where} ({self.name})"

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "rule") -> AlertRule:
        """Build a rule from a config mapping; ValueError names ``where`` and the field."""
        allowed = {"name", "when", "for", "severity", "summary", "description", "labels"}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; valid: {sorted(allowed)}")
        name = d.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"{where}: 'name' must match [A-Za-z_][A-Za-z0-9_]* (a Prometheus alert name), got {name!r}")
        when = d.get("when")
        if not isinstance(when, str):
            raise ValueError(f"{where} ({name}): 'when' must be an expression string")
        try:
            expr = parse_expr(when)
        except ExprError as exc:
            raise ValueError(f"{where} ({name}): when: {exc}") from exc
        severity = d.get("severity", "warning")
        if severity not in SEVERITIES:
            raise ValueError(f"{where} ({name}): severity must be one of {SEVERITIES}, got {severity!r}")
        labels = d.get("labels") or {}
        if not isinstance(labels, Mapping) or not all(isinstance(k, str) and _NAME_RE.match(k) for k in labels):
            raise ValueError(f"{where} ({name}): labels must map label names to strings")
        if "severity" in labels or "alertname" in labels:
            raise ValueError(f"{where} ({name}): labels may not set 'severity' or 'alertname' (use the fields)")
        return AlertRule(
            name=name,
            expr=expr,
            when=when,
            for_s=parse_duration(d.get("for", 0), field=f"{where} ({name}): for"),
            severity=severity,
            summary=str(d.get("summary") or name),
            description=str(d.get("description") or ""),
            labels=tuple(sorted((k, str(v)) for k, v in labels.items())),
            where=where,
        )


def _yaml_item_lines(text: str) -> list[int]:
    """1-based line of each item of the top-level ``rules`` sequence (for error messages)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return []
    if not isinstance(node, yaml.MappingNode):
        return []
    for k, v in node.value:
        if getattr(k, "value", None) == "rules" and isinstance(v, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in v.value]
    return []


def rules_from_text(text: str, where: str, fmt: str = "yaml") -> list[AlertRule]:
    """Parse a rules document (``fmt``: yaml, json or toml) with a top-level ``rules`` list."""
    lines: list[int] = []
    try:
        if fmt == "toml":
            data = tomllib.loads(text)
        elif fmt == "json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
            lines = _yaml_item_lines(text)
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{where}: cannot parse {fmt}: {exc}") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get("rules"), list):
        raise ValueError(f"{where}: expected a top-level 'rules' list")
    extra = set(data) - {"rules"}
    if extra:
        raise ValueError(f"{where}: unknown top-level key(s) {sorted(extra)}; only 'rules' is allowed")
    rules, names = [], set()
    for i, item in enumerate(data["rules"]):
        ref = f"{where}:{lines[i]}" if i < len(lines) else f"{where}: rules[{i}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{ref}: each rule must be a mapping")
        rule = AlertRule.from_dict(item, ref)
        if rule.name in names:
            raise ValueError(f"{ref}: duplicate rule name {rule.name!r}")
        names.add(rule.name)
        rules.append(rule)
    return rules


def load_rules(path: str | Path | None = None) -> list[AlertRule]:
    """Load rules from a .yaml/.yml/.json/.toml file, or the packaged ``default_alerts.yaml``."""
    if path is None:
        text = resources.files("hstu.ops").joinpath("default_alerts.yaml").read_text("utf-8")
        return rules_from_text(text, "hstu/ops/default_alerts.yaml")
    p = Path(path)
    fmt = {".toml": "toml", ".json": "json"}.get(p.suffix.lower(), "yaml")
    return rules_from_text(p.read_text(encoding="utf-8"), str(p), fmt)


def export_prometheus_rules(rules: Iterable[AlertRule], group: str = "hstu", interval_s: float | None = None) -> str:
    """The rules as a Prometheus alerting-rules YAML file (``promtool check rules`` format)."""
    out_rules = []
    for r in rules:
        item: dict[str, Any] = {"alert": r.name, "expr": r.expr.promql()}
        if r.for_s > 0:
            item["for"] = format_prom_duration(r.for_s)
        item["labels"] = {"severity": r.severity, **dict(r.labels)}
        ann = {"summary": r.summary}
        ann["description"] = r.description or f"{r.when} (for {format_prom_duration(r.for_s)})"
        item["annotations"] = ann
        out_rules.append(item)
    grp: dict[str, Any] = {"name": group}
    if interval_s:
        grp["interval"] = format_prom_duration(interval_s)
    grp["rules"] = out_rules
    header = "# Generated by `hstu monitor --export-rules`; evaluate with the metrics `hstu monitor` exports.\n"
    return header + yaml.safe_dump({"groups": [grp]}, sort_keys=False, allow_unicode=True, width=1000)


# ------------------------------------------------------------------------------------------ engine


@dataclass
class Alert:
    """One alert instance: a rule and the label set of one result series."""

    rule: AlertRule
    labels: Labels
    active_at: float  # when the condition was first seen true (s, the clock passed to evaluate)
    value: float
    state: str = "pending"  # "pending" | "firing"
    fired_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "alertname": self.rule.name,
            "state": self.state,
            "severity": self.rule.severity,
            "labels": {**dict(self.labels), **dict(self.rule.labels)},
            "value": self.value,
            "active_at": self.active_at,
            "fired_at": self.fired_at,
            "for_s": self.rule.for_s,
            "summary": self.rule.summary,
            "description": self.rule.description,
        }


@dataclass(frozen=True)
class AlertEvent:
    kind: str  # "pending" | "firing" | "resolved"
    alert: Alert
    at: float


@dataclass
class AlertEngine:
    """Evaluate rules on successive sample sets; keep pending/firing state with ``for`` semantics."""

    rules: list[AlertRule]
    _state: dict[tuple[str, Labels], Alert] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    last_evaluated: float | None = None

    def evaluate(self, samples: SampleInput, now: float | None = None) -> list[AlertEvent]:
        """Evaluate every rule on ``samples`` at time ``now`` (seconds; default ``time.time()``).

        Returns the state changes (pending / firing / resolved) of this evaluation, which are also
        logged (firing at WARNING, resolved at INFO). ``now`` must not go backwards.
        """
        now = time.time() if now is None else float(now)
        series = to_series(samples)
        events: list[AlertEvent] = []
        with self._lock:
            if self.last_evaluated is not None and now < self.last_evaluated:
                raise ValueError(f"evaluation time went backwards: {now} < {self.last_evaluated}")
            self.last_evaluated = now
            for rule in self.rules:
                result = rule.expr.evaluate(series)
                for labels, value in result.items():
                    key = (rule.name, labels)
                    a = self._state.get(key)
                    if a is None:
                        a = self._state[key] = Alert(rule, labels, active_at=now, value=value)
                        events.append(AlertEvent("pending", a, now))
                    a.value = value
                    if a.state == "pending" and now - a.active_at >= rule.for_s:
                        a.state, a.fired_at = "firing", now
                        events.append(AlertEvent("firing", a, now))
                for key in [k for k in self._state if k[0] == rule.name and k[1] not in result]:
                    a = self._state.pop(key)
                    if a.state == "firing":
                        events.append(AlertEvent("resolved", a, now))
        for ev in events:
            lbl = ",".join(f"{k}={v}" for k, v in ev.alert.labels) or "-"
            if ev.kind == "firing":
                log.warning(
                    "ALERT FIRING %s [%s] %s: %s (value %g)",
                    ev.alert.rule.name,
                    ev.alert.rule.severity,
                    lbl,
                    ev.alert.rule.summary,
                    ev.alert.value,
                )
            elif ev.kind == "resolved":
                log.info("alert resolved %s %s", ev.alert.rule.name, lbl)
            else:
                log.debug("alert pending %s %s", ev.alert.rule.name, lbl)
        return events

    def alerts(self, state: str | None = None) -> list[Alert]:
        """Current instances (optionally only ``"pending"`` or ``"firing"``), in rule order."""
        order = {r.name: i for i, r in enumerate(self.rules)}
        with self._lock:
            out = [a for a in self._state.values() if state is None or a.state == state]
        return sorted(out, key=lambda a: (order[a.rule.name], a.labels))

    def firing(self) -> list[Alert]:
        return self.alerts("firing")

    def counts(self) -> dict[tuple[str, str], int]:
        """{(rule name, state): number of instances} including zeros for every rule and state."""
        out = {(r.name, s): 0 for r in self.rules for s in ("pending", "firing")}
        for a in self.alerts():
            out[(a.rule.name, a.state)] += 1
        return out
