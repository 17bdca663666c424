"""``hstu bench`` output: the Markdown table laid out as the reference port's (rows P50, P99, QPS,
memory, model bytes, HR@10; one column per device x precision), the result JSON, ``--compare``.

The reference port's published figures (single device, next-5 at batch 16; its latency growth at
batch 32 from 50 to 200 events) are printed as separate columns labelled "reference port"; they
are quoted, not measured here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FORMAT = 1  # result JSON version ("hstu_bench" key)

REFERENCE = {  # column -> row -> figure, as published by the reference port
    "A100 FP16 (reference port)": {"p50": 42.3, "p99": 89.5, "qps": 368, "memory_gb": 24.1, "growth": "+123 %"},
    "910B FP16 (reference port)": {"p50": 58.7, "p99": 112.4, "qps": 272, "memory_gb": 28.7, "growth": "+387 % (unoptimised)"},
    "910B INT8 (reference port)": {"p50": 39.1, "p99": 86.3, "qps": 498, "memory_gb": 12.3},
}
DASH = "—"


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
    if not isinstance(obj.get("environment"), dict):
        raise ValueError(f"{p}: field 'environment' must be an object")
    obj["source_file"] = str(p)
    return obj


def short_device(env: dict) -> str:
    """A column's device name: the backend's device name without vendor marks ("(R)", "NVIDIA ", ...)."""
    name = env.get("device_name") or env.get("device") or "?"
    name = re.sub(r"\((R|TM)\)|\bNVIDIA\b|\bProcessor\b|\bCPU\b|@.*$", "", name)
    return " ".join(name.split()) or str(env.get("device"))


def columns(results: list[dict]) -> list[tuple[str, dict]]:
    """(label, cell) for every cell of every result, this run first; a label seen before gets the
    result's file name (or its position) appended."""
    out, seen = [], set()
    for i, res in enumerate(results):
        for cell in res["cells"]:
            label = f"{short_device(res['environment'])} {cell['precision'].upper()}"
            if label in seen:
                label += f" ({Path(res['source_file']).name if res.get('source_file') else f'result {i + 1}'})"
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
    sweep_b = sorted({c["sweep"]["batch"] for _, c in cols if c.get("sweep")})
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
        rows.append(("HTTP QPS at P99 ≤ 100 ms", [_fmt((c.get("serve") or {}).get("max_qps"), ".1f") for _, c in cols], None))
        rows.append(("HTTP P50 / P99 there (ms)", [_serve_lat(c) for _, c in cols], None))
    return rows


def _sweep_p50(cell: dict, L: int) -> str:
    sweep = cell.get("sweep") or {}
    if str(L) in (sweep.get("unavailable") or {}):
        return "n/a (> max_seq_len)"
    got = (sweep.get("lengths") or {}).get(str(L))
    return DASH if got is None else f"{got['p50_ms']:.2f}"


def _serve_lat(cell: dict) -> str:
    s = cell.get("serve") or {}
    if s.get("p50_ms") is None:
        return DASH
    return f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f}"


def _ref(column: str, key: str | None) -> str:
    v = REFERENCE[column].get(key) if key else None
    return DASH if v is None else v if isinstance(v, str) else format(v, "g")


def markdown(results: list[dict]) -> str:
    """The table for ``results`` (this run first, then ``--compare`` files), the reference port's
    columns, a line per result naming its machine and settings, and a note per unavailable cell."""
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
    return "\n".join(lines + [""] + texts + ([""] + notes if notes else [])) + "\n"


def _caption(res: dict) -> str:
    env, st = res["environment"], res.get("settings", {})
    la = env.get("load_average")
    return (
        f"- {short_device(env)} ({env.get('device')}; torch {env.get('torch')}, {env.get('torch_threads')} threads, "
        f"load average {la[0] if la else '?'}; commit {str(env.get('git_commit'))[:12]}): {res.get('source', '?')}, "
        f"next-{st.get('k', '?')} at batch {st.get('batch', '?')}, {st.get('repeats', '?')} calls per figure"
        + (f"; `{res['command']}`" if res.get("command") else "")
    )
