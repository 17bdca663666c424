"""``hstu bench`` output: the Markdown table laid out as the reference port's (rows P50, P99, QPS,
memory, model bytes, HR@10; one column per device x precision), the result JSON, ``--compare``.

The reference port's published figures (single device, next-5 at batch 16; its latency growth at
batch 32 from 50 to 200 events) are printed as separate columns labelled "reference port"; they
are quoted, not measured here. Their QPS is the port's served throughput, not batch ÷ mean call time as
the measured columns' (:data:`QPS_NOTE`, printed under the table).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

FORMAT = 1  # result JSON version ("hstu_bench" key)

REFERENCE = {  # column -> row -> figure, as published by the reference port
    "A100 FP16 (reference port)": {"p50": 42.3, "p99": 89.5, "qps": 368, "memory_gb": 24.1, "growth": "+123 %"},
    "910B FP16 (reference port)": {"p50": 58.7, "p99": 112.4, "qps": 272, "memory_gb": 28.7, "growth": "+387 % (unoptimised)"},
    "910B INT8 (reference port)": {"p50": 39.1, "p99": 86.3, "qps": 498, "memory_gb": 12.3},
}
DASH = "—"
QPS_NOTE = (  # the reference port's QPS is its served throughput; 16 / 39.1 ms = 409, not its 498
    "QPS (users/s): a measured column's is batch ÷ mean call time (users per second of back-to-back calls, one batch "
    "in flight); a reference column's is the port's published throughput (served, several batches in flight), "
    "not derivable from its P50 (910B INT8: 16 / 39.1 ms = 409, published 498)."
)
HTTP_QPS_ROW = "HTTP QPS offered at P99 ≤ 100 ms"  # the highest offered rate (requests/s) that kept P99 <= 100 ms, only 200s


def load_result(path: str | Path) -> dict:
    """A result file written by ``hstu bench --out`` (``bench.json``). Raises FileNotFoundError, or
    ValueError naming the file and what is wrong (not JSON, not an hstu bench result, bad cells)."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: result file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: not a JSON file: {exc}") from None
    if not isinstance(obj, dict) or obj.get("hstu_bench") != FORMAT:
        raise ValueError(f'{p}: not an hstu bench result (needs "hstu_bench": {FORMAT}; written by hstu bench --out)')
    cells = obj.get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, dict) and isinstance(c.get("precision"), str) for c in cells):
        raise ValueError(f"{p}: field 'cells' must be a list of objects with a 'precision'")
    if len({c["precision"] for c in cells}) != len(cells):
        raise ValueError(f"{p}: field 'cells' names a precision twice ({', '.join(c['precision'] for c in cells)})")
    env = obj.get("environment")
    if not isinstance(env, dict):
        raise ValueError(f"{p}: field 'environment' must be an object")
    if env.get("load_average") is not None and not isinstance(env["load_average"], list):
        raise ValueError(f"{p}: field 'environment.load_average' must be a list or null, got {env['load_average']!r}")
    for i, cell in enumerate(cells):
        _check_cell(p, f"cells[{i}]", cell)
    obj["source_file"] = str(p)
    return obj


FIGURES = ("p50_ms", "p99_ms", "mean_ms", "min_ms", "max_ms", "qps", "calls", "history", "batch", "model_bytes")
SERVE_FIGURES = ("max_qps", "offered_qps", "achieved_qps", "p50_ms", "p99_ms")


def _check_number(p: Path, field: str, v, signed: bool = False) -> None:
    """ValueError naming the file and field unless ``v`` is null or a finite number (>= 0 unless ``signed``)."""
    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (signed or v >= 0)):
        return
    raise ValueError(f"{p}: field '{field}' must be a finite number{'' if signed else ' >= 0'} or null, got {v!r}")


def _check_object(p: Path, field: str, v) -> dict:
    if v is not None and not isinstance(v, dict):
        raise ValueError(f"{p}: field '{field}' must be an object or null, got {v!r}")
    return v or {}


def _check_cell(p: Path, at: str, cell: dict) -> None:
    """Every figure the table, the plots and --compare read from one cell: ValueError naming the file and the field."""
    for k in FIGURES:
        _check_number(p, f"{at}.{k}", cell.get(k))
    times = cell.get("times_ms")
    if times is not None and not isinstance(times, list):
        raise ValueError(f"{p}: field '{at}.times_ms' must be a list of numbers, got {times!r}")
    for j, t in enumerate(times or []):
        _check_number(p, f"{at}.times_ms[{j}]", t)
    for k, v in _check_object(p, f"{at}.memory", cell.get("memory")).items():
        _check_number(p, f"{at}.memory.{k}", v)
    if isinstance(cell.get("quality"), dict):
        for k in ("HR@10", "NDCG@10"):
            _check_number(p, f"{at}.quality.{k}", cell["quality"].get(k))
            if cell["quality"].get(k) is None:
                raise ValueError(f"{p}: field '{at}.quality.{k}' is missing")
    sweep = _check_object(p, f"{at}.sweep", cell.get("sweep"))
    _check_number(p, f"{at}.sweep.batch", sweep.get("batch"))
    _check_number(p, f"{at}.sweep.growth_percent", sweep.get("growth_percent"), signed=True)
    for part in ("lengths", "unavailable"):
        for L, v in _check_object(p, f"{at}.sweep.{part}", sweep.get(part)).items():
            if not L.isdigit():
                raise ValueError(f"{p}: field '{at}.sweep.{part}' must be keyed by history lengths, got {L!r}")
            if part == "lengths":
                for k in FIGURES:
                    _check_number(p, f"{at}.sweep.lengths.{L}.{k}", _check_object(p, f"{at}.sweep.lengths.{L}", v).get(k))
    for k in SERVE_FIGURES:
        _check_number(p, f"{at}.serve.{k}", _check_object(p, f"{at}.serve", cell.get("serve")).get(k))


def short_device(env: dict) -> str:
    """A column's device name: the backend's device name without vendor marks ("(R)", "NVIDIA ", ...)."""
    name = env.get("device_name") or env.get("device") or "?"
    name = re.sub(r"\((R|TM)\)|\bNVIDIA\b|\bProcessor\b|\bCPU\b|@.*$", "", name)
    return " ".join(name.split()) or str(env.get("device"))


def columns(results: list[dict]) -> list[tuple[str, dict]]:
    """(label, cell) for every cell of every result, this run first; a label seen before gets the
    result's file name appended (its path when another result's file has that name; its position when the same
    file is given twice): every label is distinct."""
    out, seen = [], set()
    names = [Path(r["source_file"]).name for r in results if r.get("source_file")]
    for i, res in enumerate(results):
        path = res.get("source_file")
        tag = path and (Path(path).name if names.count(Path(path).name) == 1 else path)  # dir1/bench.json, dir2/bench.json
        for cell in res["cells"]:
            base = f"{short_device(res['environment'])} {cell['precision'].upper()}"
            # two machines with the same device name: the file's name (its path where names repeat), else its position
            for label in (base, *([f"{base} ({tag})"] if tag else []), f"{base} (result {i + 1})"):
                if label not in seen:
                    break
            seen.add(label)
            out.append((label, cell))
    return out


def _fmt(v, spec: str) -> str:
    return DASH if v is None else format(v, spec)


def _memory(cell: dict) -> str:
    mem = cell.get("memory") or {}
    if mem.get("device_peak_bytes") is not None:
        return f"{mem['device_peak_bytes'] / 1e9:.2f}"
    if mem.get("host_rss_peak_bytes") is not None:
        return f"{mem['host_rss_peak_bytes'] / 1e9:.2f} (host RSS)"
    return DASH


def _quality(cell: dict, key: str) -> str:
    q = cell.get("quality")
    return format(q[key], ".4f") if isinstance(q, dict) else DASH


def _rows(cols: list[tuple[str, dict]]) -> list[tuple[str, list[str], str | None]]:
    """(row label, one text per measured column, reference-row key or None)."""
    sweeps = [c.get("sweep") or {} for _, c in cols]
    lengths = sorted({int(L) for s in sweeps for part in ("lengths", "unavailable") for L in s.get(part) or {}})
    sweep_b = sorted({s["batch"] for s in sweeps if s.get("batch") is not None})
    rows = [
        ("P50 latency (ms)", [_fmt(c.get("p50_ms"), ".2f") for _, c in cols], "p50"),
        ("P99 latency (ms)", [_fmt(c.get("p99_ms"), ".2f") for _, c in cols], "p99"),
        ("QPS (users/s)", [_fmt(c.get("qps"), ".1f") for _, c in cols], "qps"),
        ("memory peak (GB)", [_memory(c) for _, c in cols], "memory_gb"),
        ("model bytes (MB)", [_fmt(c.get("model_bytes") and c["model_bytes"] / 1e6, ".3f") for _, c in cols], None),
        ("HR@10 (test)", [_quality(c, "HR@10") for _, c in cols], None),
        ("NDCG@10 (test)", [_quality(c, "NDCG@10") for _, c in cols], None),
    ]
    b = "/".join(map(str, sweep_b)) or "32"
    for L in lengths:
        rows.append((f"P50 at {L} events, batch {b} (ms)", [_sweep_p50(c, L) for _, c in cols], None))
    growth = [_fmt((c.get("sweep") or {}).get("growth_percent"), "+.0f") for _, c in cols]
    rows.append(("latency growth, shortest → longest", [g if g == DASH else f"{g} %" for g in growth], "growth"))
    if any(c.get("serve") for _, c in cols):
        rows.append((HTTP_QPS_ROW, [_serve_qps(c) for _, c in cols], None))
        rows.append(("HTTP P50 / P99 there (ms)", [_serve_lat(c) for _, c in cols], None))
    return rows


def _sweep_p50(cell: dict, L: int) -> str:
    sweep = cell.get("sweep") or {}
    if str(L) in (sweep.get("unavailable") or {}):
        return "n/a (> max_seq_len)"
    got = (sweep.get("lengths") or {}).get(str(L))
    return DASH if got is None else _fmt(got.get("p50_ms"), ".2f")


def _serve_qps(cell: dict) -> str:
    """The highest offered rate that passed; a result written before ``offered_qps`` existed holds the achieved rate there."""
    s = cell.get("serve") or {}
    got = _fmt(s.get("max_qps"), ".1f")
    return got if got == DASH or "offered_qps" in s else f"{got} (achieved)"


def _serve_lat(cell: dict) -> str:
    s = cell.get("serve") or {}
    if s.get("p50_ms") is None:
        return DASH
    return f"{_fmt(s['p50_ms'], '.1f')} / {_fmt(s.get('p99_ms'), '.1f')}"


def _ref(column: str, key: str | None) -> str:
    v = REFERENCE[column].get(key) if key else None
    return DASH if v is None else v if isinstance(v, str) else format(v, "g")


def markdown(results: list[dict]) -> str:
    """The table for ``results`` (this run first, then ``--compare`` files), the reference port's
    columns, a line per result naming its machine and settings, :data:`QPS_NOTE` (how each column's QPS is
    defined) and a note per unavailable cell."""
    cols = columns(results)
    missing = [(label, c) for label, c in cols if "unavailable" in c]
    notes = [f"[{n + 1}] {label}: {c['unavailable']}" for n, (label, c) in enumerate(missing)]
    marks = {label: f"n/a [{n + 1}]" for n, (label, _) in enumerate(missing)}
    texts = []
    rows = _rows(cols)
    head = [label for label, _ in cols] + list(REFERENCE)
    texts.append("| | " + " | ".join(head) + " |")
    texts.append("|---|" + "---:|" * len(head))
    for name, vals, ref_key in rows:
        vals = [marks.get(label, v) if v == DASH else v for (label, _), v in zip(cols, vals)]
        texts.append(f"| {name} | " + " | ".join(vals + [_ref(r, ref_key) for r in REFERENCE]) + " |")
    lines = [_caption(res) for res in results]
    return "\n".join(lines + [""] + texts + ["", QPS_NOTE] + ([""] + notes if notes else [])) + "\n"


def _caption(res: dict) -> str:
    env, st = res["environment"], res.get("settings", {})
    la = env.get("load_average")
    return (
        f"- {short_device(env)} ({env.get('device')}; torch {env.get('torch')}, {env.get('torch_threads')} threads, "
        f"load average {la[0] if la else '?'}; commit {str(env.get('git_commit'))[:12]}): {res.get('source', '?')}, "
        f"next-{st.get('k', '?')} at batch {st.get('batch', '?')}, {st.get('repeats', '?')} calls per figure"
        + (f"; `{res['command']}`" if res.get("command") else "")
    )
