"""Alert rules: expression parsing, PromQL-style evaluation, ``for`` duration semantics on synthetic
metric streams (hand-computed and a run-length reference), config files, and the exported rules
checked by promtool (``check rules``, and ``test rules`` replaying the same streams, so Prometheus
itself confirms the in-process engine)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hstu.ops.alerts import (
    AlertEngine,
    AlertRule,
    BinaryOp,
    Condition,
    ExprError,
    Sample,
    export_prometheus_rules,
    load_rules,
    parse_expr,
)

BW = "hstu_device_memory_bandwidth_utilization_ratio"
CU = "hstu_device_compute_utilization_ratio"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install -y --no-install-recommends prometheus)"
)


def dev(d: str) -> dict:
    return {"backend": "npu", "device": d}


def rule(when: str, for_: str = "0s", name: str = "R") -> AlertRule:
    return AlertRule.from_dict({"name": name, "when": when, "for": for_})


# ------------------------------------------------------------------------------------------ parsing


def test_precedence_and_parentheses():
    e = parse_expr("a > 1 or b > 2 and c > 3")
    assert isinstance(e, BinaryOp) and e.op == "or"
    assert isinstance(e.right, BinaryOp) and e.right.op == "and"
    e = parse_expr("(a > 1 OR b > 2) AND c > 3")
    assert e.op == "and" and e.left.op == "or"


def test_conditions_units_matchers_on():
    e = parse_expr('x{direction="d2h", kind!="test"} > 8GB/s and on() q >= 200')
    assert e.on == ()
    assert e.left == Condition("x", (("direction", "=", "d2h"), ("kind", "!=", "test")), ">", 8e9)
    assert e.right == Condition("q", (), ">=", 200.0)
    assert parse_expr(f"{BW} > 85%").threshold == pytest.approx(0.85)
    assert parse_expr("a < 2 and on(device, backend) b < 1").on == ("device", "backend")


@pytest.mark.parametrize(
    "text,match",
    [
        ("a >", "expected num at the end"),
        ("a 5", r"expected cmp at column 3"),
        ("a > 1 b > 2", r"expected 'and', 'or' or the end at column 7"),
        ("> 1", "expected a metric name"),
        ("a{b=c} > 1", "expected str at column 5"),
        ("a > 1 $", r"unexpected character '\$' at column 7"),
        ("", "empty expression"),
        ("a > 8XB", "expected"),
        ("(a > 1", r"expected \)"),
    ],
)
def test_parse_errors_name_the_column(text, match):
    with pytest.raises(ExprError, match=match):
        parse_expr(text)


def test_promql_round_trip():
    for text in ('(a > 0.5 or b{x="y"} < 2) and on(device) c != 3', "a > 1 or b > 2 and c > 3", "q > 200"):
        e = parse_expr(text)
        assert parse_expr(e.promql()) == e


# ------------------------------------------------------------------------------------------ evaluation


def series(*samples):
    from hstu.ops.alerts import to_series

    return to_series(samples)


def lbl(d: str):
    return tuple(sorted(dev(d).items()))


def test_and_matches_identical_label_sets():
    s = series(
        Sample.of(BW, 0.9, **dev("0")),
        Sample.of(BW, 0.9, **dev("1")),
        Sample.of(CU, 0.3, **dev("0")),
        Sample.of(CU, 0.7, **dev("1")),
    )
    assert parse_expr(f"{BW} > 0.85 and {CU} < 0.4").evaluate(s) == {lbl("0"): 0.9}


def test_and_on_empty_matches_any_series():
    d2h = Sample.of("d2h", 9e9, direction="d2h", **dev("0"))
    e = parse_expr('d2h{direction="d2h"} > 8GB/s and on() q > 200')
    assert e.evaluate(series(d2h, Sample.of("q", 250))) == {d2h.labels: 9e9}
    assert e.evaluate(series(d2h, Sample.of("q", 150))) == {}
    # without on(), the label sets differ, so nothing matches (PromQL behaves the same)
    assert parse_expr("d2h > 1 and q > 200").evaluate(series(d2h, Sample.of("q", 250))) == {}


def test_or_keeps_left_and_unmatched_right():
    s = series(Sample.of("a", 5, **dev("0")), Sample.of("b", 7, **dev("0")), Sample.of("b", 8, **dev("1")))
    assert parse_expr("a > 1 or b > 1").evaluate(s) == {lbl("0"): 5.0, lbl("1"): 8.0}


def test_label_matchers_and_missing_metric():
    s = series(Sample.of("t", 80, **dev("0")), Sample.of("t", 90, **dev("1")))
    assert parse_expr('t{device!="1"} > 75').evaluate(s) == {lbl("0"): 80.0}
    assert parse_expr("absent_metric > 0").evaluate(s) == {}


# ------------------------------------------------------------------------------------------ for / duration


def bottleneck_stream(t: int, on: range) -> list[Sample]:
    bw = 0.9 if t in on else 0.5
    return [
        Sample.of(BW, bw, **dev("0")),
        Sample.of(CU, 0.3, **dev("0")),
        Sample.of(BW, 0.95, **dev("1")),
        Sample.of(CU, 0.8, **dev("1")),
    ]  # device 1 is never a bottleneck


def test_for_30s_pending_firing_resolved():
    eng = AlertEngine([rule(f"{BW} > 85% and {CU} < 40%", "30s", "MemoryBandwidthBottleneck")])
    events = {}
    states = {}
    for t in range(0, 61):
        for ev in eng.evaluate(bottleneck_stream(t, range(10, 46)), now=t):
            events.setdefault(ev.kind, []).append((t, dict(ev.alert.labels)["device"]))
        states[t] = [a.state for a in eng.alerts()]
    # true from t=10 to t=45: pending at 10, firing once 30 s have passed (t=40), resolved at t=46
    assert events == {"pending": [(10, "0")], "firing": [(40, "0")], "resolved": [(46, "0")]}
    assert states[9] == [] and states[10] == ["pending"] and states[39] == ["pending"]
    assert states[40] == ["firing"] and states[45] == ["firing"] and states[46] == []


def test_for_restarts_after_a_false_evaluation():
    eng = AlertEngine([rule(f"{BW} > 85% and {CU} < 40%", "30s")])
    fired = []
    on = set(range(10, 26)) | set(range(27, 70))  # one false sample at t=26
    for t in range(0, 70):
        fired += [t for ev in eng.evaluate(bottleneck_stream(t, on), now=t) if ev.kind == "firing"]
    assert fired == [57]  # 27 + 30, not 10 + 30


def test_for_zero_fires_immediately_and_irregular_times():
    eng = AlertEngine([rule("t > 75", "0s")])
    assert [e.kind for e in eng.evaluate({"t": 80}, now=0)] == ["pending", "firing"]
    eng = AlertEngine([rule("t > 75", "30s")])
    assert [e.kind for e in eng.evaluate({"t": 80}, now=100.0)] == ["pending"]
    assert eng.evaluate({"t": 80}, now=129.9) == []
    assert [e.kind for e in eng.evaluate({"t": 80}, now=130.0)] == ["firing"]
    assert eng.firing()[0].fired_at == 130.0 and eng.firing()[0].active_at == 100.0
    with pytest.raises(ValueError, match="backwards"):
        eng.evaluate({"t": 80}, now=120.0)


def test_missing_sample_resolves_like_a_false_condition():
    eng = AlertEngine([rule("t > 75", "0s")])
    eng.evaluate({"t": 80}, now=0)
    assert [e.kind for e in eng.evaluate({}, now=1)] == ["resolved"]


def test_serving_style_mapping_input_and_counts():
    eng = AlertEngine(load_rules())
    d2h = Sample.of("hstu_device_copy_bandwidth_bytes_per_second", 9e9, direction="d2h", backend="cuda", device="0")
    for t in range(0, 11):
        eng.evaluate([d2h, Sample.of("hstu_serve_queue_depth", 250)], now=t)
    (a,) = eng.firing()
    assert a.rule.name == "DataMovementStorm" and a.fired_at == 10 and a.to_dict()["labels"]["direction"] == "d2h"
    counts = eng.counts()
    assert counts[("DataMovementStorm", "firing")] == 1 and counts[("ThermalThrottlingRisk", "firing")] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(min_value=0, max_value=6))
def test_for_matches_run_length_reference(stream, for_s):
    """Firing at step t iff the condition held at every step of the current run and the run is >= for_s old."""
    eng = AlertEngine([rule("x > 0.5", f"{for_s}s")])
    run_start = None
    for t, on in enumerate(stream):
        eng.evaluate({"x": 1.0 if on else 0.0}, now=t)
        run_start = (t if run_start is None else run_start) if on else None
        expect = "firing" if on and t - run_start >= for_s else ("pending" if on else None)
        got = [a.state for a in eng.alerts()]
        assert got == ([expect] if expect else [])


# ------------------------------------------------------------------------------------------ config files


def test_default_rules():
    rules = {r.name: r for r in load_rules()}
    assert {"MemoryBandwidthBottleneck", "DataMovementStorm", "ThermalThrottlingRisk"} <= set(rules)
    mb = rules["MemoryBandwidthBottleneck"]
    assert mb.for_s == 30 and mb.summary == "memory-bandwidth bottleneck"
    assert mb.expr.left.threshold == pytest.approx(0.85) and mb.expr.right.threshold == pytest.approx(0.40)
    assert rules["DataMovementStorm"].expr.left.threshold == 8e9
    assert rules["ThermalThrottlingRisk"].expr.threshold == 75


def test_rules_file_errors_name_file_line_and_field(tmp_path):
    f = tmp_path / "rules.yaml"
    f.write_text("rules:\n  - name: Ok\n    when: a > 1\n\n  - name: Bad\n    when: a > 1\n    colour: red\n")
    with pytest.raises(ValueError, match=r"rules\.yaml:5 \(.*unknown key\(s\) \['colour'\]|rules\.yaml:5: unknown key"):
        load_rules(f)
    f.write_text("rules:\n  - name: Bad\n    when: a >> 1\n")
    with pytest.raises(ValueError, match=r"rules\.yaml:2 \(Bad\): when: expected num at column 4"):
        load_rules(f)
    f.write_text("rules:\n  - {name: A, when: a > 1}\n  - {name: A, when: b > 1}\n")
    with pytest.raises(ValueError, match="duplicate rule name 'A'"):
        load_rules(f)
    for bad, match in [
        ("{name: my-alert, when: a > 1}", "Prometheus alert name"),
        ("{name: A, when: a > 1, severity: huge}", "severity must be one of"),
        ("{name: A, when: a > 1, for: soon}", "for: expected a duration"),
    ]:
        f.write_text(f"rules:\n  - {bad}\n")
        with pytest.raises(ValueError, match=match):
            load_rules(f)
    f.write_text("groups: []\n")
    with pytest.raises(ValueError, match="top-level 'rules' list"):
        load_rules(f)


def test_toml_and_json_rules(tmp_path):
    t = tmp_path / "r.toml"
    t.write_text('[[rules]]\nname = "Hot"\nwhen = "hstu_device_temperature_celsius > 75"\nfor = "15s"\n')
    j = tmp_path / "r.json"
    j.write_text('{"rules": [{"name": "Hot", "when": "hstu_device_temperature_celsius > 75", "for": 15}]}')
    assert load_rules(t)[0].for_s == load_rules(j)[0].for_s == 15


# ------------------------------------------------------------------------------------------ export + promtool


def test_export_shape():
    doc = yaml.safe_load(export_prometheus_rules(load_rules(), interval_s=1.0))
    (g,) = doc["groups"]
    assert g["name"] == "hstu" and g["interval"] == "1s"
    mb = next(r for r in g["rules"] if r["alert"] == "MemoryBandwidthBottleneck")
    assert mb["expr"] == f"({BW} > 0.85) and ({CU} < 0.4)"
    assert mb["for"] == "30s" and mb["labels"] == {"severity": "warning"} and mb["annotations"]["summary"]


@needs_promtool
def test_promtool_check_rules(tmp_path):
    f = tmp_path / "rules.yml"
    f.write_text(export_prometheus_rules(load_rules()))
    out = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 5 rules found" in out.stdout


def _stream(t: int) -> list[Sample]:
    """Synthetic 1 Hz metrics: a bottleneck on npu 0/0 for t in [10, 45], heat from t=20, a storm from t=30."""
    s = [
        Sample.of(BW, 0.9 if 10 <= t <= 45 else 0.5, **dev("0/0")),
        Sample.of(CU, 0.3, **dev("0/0")),
        Sample.of(BW, 0.9, **dev("1/0")),
        Sample.of(CU, 0.8, **dev("1/0")),
        Sample.of("hstu_device_temperature_celsius", 80 if t >= 20 else 70, **dev("0/0")),
        Sample.of("hstu_device_copy_bandwidth_bytes_per_second", 9e9, direction="d2h", **dev("0/0")),
        Sample.of("hstu_serve_queue_depth", 250 if t >= 30 else 100),
    ]
    return s


@needs_promtool
def test_promtool_test_rules_agrees_with_engine(tmp_path):
    rules = load_rules()
    exported = yaml.safe_load(export_prometheus_rules(rules, interval_s=1.0))
    annotations = {r["alert"]: r["annotations"] for r in exported["groups"][0]["rules"]}
    (tmp_path / "rules.yml").write_text(export_prometheus_rules(rules, interval_s=1.0))
    horizon = 60
    eng = AlertEngine(rules)
    firing_at: dict[int, list] = {}
    for t in range(horizon + 1):
        eng.evaluate(_stream(t), now=t)
        firing_at[t] = [(a.rule.name, {**dict(a.labels), "severity": a.rule.severity}) for a in eng.firing()]
    # hand-computed: bottleneck 10..45 for 30 s -> firing 40..45; heat from 20 for 15 s -> 35..60;
    # storm (queue > 200 from 30) for 10 s -> 40..60
    names = {t: sorted({n for n, _ in firing_at[t]}) for t in firing_at}
    assert names[34] == [] and names[35] == ["ThermalThrottlingRisk"]
    assert names[40] == ["DataMovementStorm", "MemoryBandwidthBottleneck", "ThermalThrottlingRisk"]
    assert names[46] == ["DataMovementStorm", "ThermalThrottlingRisk"]
    assert [lb["device"] for n, lb in firing_at[40] if n == "MemoryBandwidthBottleneck"] == ["0/0"]

    input_series = {}
    for t in range(horizon + 1):
        for s in _stream(t):
            sel = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in s.labels) + "}"
            input_series.setdefault(sel, []).append(repr(s.value))
    checks = []
    for t in (9, 10, 34, 35, 39, 40, 45, 46, 50, 60):
        for name in annotations:
            exp = [{"exp_labels": lb, "exp_annotations": annotations[name]} for n, lb in firing_at[t] if n == name]
            checks.append({"eval_time": f"{t}s", "alertname": name, "exp_alerts": exp})
    test_doc = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1s",
        "tests": [
            {
                "interval": "1s",
                "input_series": [{"series": k, "values": " ".join(v)} for k, v in input_series.items()],
                "alert_rule_test": checks,
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test_doc, sort_keys=False))
    out = subprocess.run([PROMTOOL, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
