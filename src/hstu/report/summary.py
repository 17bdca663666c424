"""A run's facts for ``hstu report`` (read through :mod:`hstu.runs`: config.json, idmap.json,
history.json, metrics.json) and the Markdown summary of one or several runs.

Markdown (GitHub-flavoured tables): a summary table with one column per run (model, data,
training, test and validation metrics from metrics.json: 4 decimals), the plots, then each run's
per-epoch table (history.json). A run still training (no metrics.json) is reported from its
history, its status "in progress" and its test metrics absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hstu.model.checkpoint import read_json
from hstu.model.run_files import require_run_dir
from hstu.runs import METRICS, read_config, read_history, read_idmap

TEST_METRICS = ("HR@10", "NDCG@10", "HR@50", "NDCG@50", "MRR")
CURVE_METRICS = ("HR@10", "NDCG@10")  # validation metrics plotted per epoch


@dataclass
class RunFacts:
    """What a report shows of one run directory."""

    label: str
    path: Path
    config: dict
    idmap: dict
    history: list[dict]
    metrics: dict | None  # metrics.json; None while the run is in progress

    def curve(self, key: str, split: str | None = None) -> tuple[list[int], list[float]]:
        """(epochs, values) of history ``key`` (``split``: "valid" for a validation metric; epochs
        without it are skipped)."""
        pts = [(h["epoch"], h[split][key] if split else h[key]) for h in self.history if (key in h.get(split, {}) if split else key in h)]
        return [p[0] for p in pts], [p[1] for p in pts]


def read_run_facts(run: str | Path, label: str | None = None) -> RunFacts:
    """A run's files, each checked as :mod:`hstu.runs` reads it. Raises FileNotFoundError naming the
    missing file (a directory without history.json has trained no epoch), ValueError naming file and field
    or a quantized run (:func:`check_not_quantized`)."""
    path = Path(run)
    require_run_dir(path)
    check_not_quantized(path)
    metrics = read_json(path / METRICS) if (path / METRICS).exists() else None
    if metrics is not None and not isinstance(metrics, dict):
        raise ValueError(f"{path / METRICS}: expected a JSON object")
    return RunFacts(label or path.name, path, read_config(path), read_idmap(path), read_history(path), metrics)


def check_not_quantized(run: Path) -> None:
    """ValueError (one line) for a quantized run (quant.json): a copy written by ``hstu quantize`` has no training
    history or metrics (it said "history.json not found"); names the float run it was made from when quant.json
    records it. A broken quant.json is named as :func:`hstu.quant.checkpoint.read_quant_meta` names it."""
    from hstu.quant.checkpoint import read_quant_meta

    meta = read_quant_meta(run)
    if meta is None:
        return
    source = meta.get("source_run")
    where = f"report the float run it was made from: {source}" if source else "report the float run it was made from"
    raise ValueError(f"{run}: a quantized copy (quant.json, scheme {meta.get('scheme')!r}) has no training history; {where}")


def _num(v, digits: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def summary_rows(r: RunFacts) -> dict[str, str]:
    """The summary table's rows for one run: name -> cell text."""
    m, d, facts = r.config["model"], r.config["data"], r.idmap.get("data_facts", {})
    met = r.metrics or {}
    rows = {
        "run": f"`{r.path}`",
        "architecture": m.get("architecture", "hstu"),
        "blocks × heads × d": f"{m['num_blocks']} × {m['num_heads']} × {m['embedding_dim']}",
        "block": _block(m),
        "max_seq_len": str(m["max_seq_len"]),
        "items": str(m["num_items"]),
        "dataset": f"{d['dataset']} ({d['protocol']} protocol)",
        "users / events": f"{facts.get('users', '—')} / {facts.get('events', '—')}",
        "epochs (best)": f"{met.get('epochs', len(r.history))} ({_num(met.get('best_epoch'))})",
        "status": met.get("status", "completed") if r.metrics is not None else "in progress (no metrics.json)",
        "train seconds": _num(met.get("train_seconds"), 1),
        "sequences/s": _num(met.get("sequences_per_s"), 1),
        "recipe": _recipe(r.config),
    }
    for split in ("test", "valid"):
        for k in TEST_METRICS:
            rows[f"{split} {k}"] = _num(met.get(split, {}).get(k))
    return rows


def _block(m: dict) -> str:
    """config.json model's block by name (hstu.train.recipe.block_text, as the training log states it), or "—"."""
    from hstu.config import model_config_from_dict
    from hstu.train.recipe import block_text

    return block_text(model_config_from_dict(m)) or "—"


def _recipe(config: dict) -> str:
    """The run's recipe line (hstu.train.recipe, as its log states it) from config.json's train table
    (fields it lacks: the defaults of the hstu that wrote it) and distributed table."""
    from hstu.config import train_config_from_dict
    from hstu.train.recipe import recipe_text

    return recipe_text(train_config_from_dict(config["train"], saved=True), config.get("distributed"), config["model"].get("num_items"))


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(row) + " |" for row in body)]


def epoch_table(r: RunFacts) -> list[str]:
    """Markdown lines: one row per history entry (loss, validation metrics, throughput, seconds)."""
    body = [
        [
            str(h["epoch"]),
            _num(h["loss"]),
            *(_num(h.get("valid", {}).get(k)) for k in CURVE_METRICS),
            _num(h["sequences_per_s"], 1),
            _num(h["seconds"], 1),
        ]
        for h in r.history
    ]
    return _table(["epoch", "loss", *(f"valid {k}" for k in CURVE_METRICS), "seq/s", "seconds"], body)


def markdown(runs: list[RunFacts], plots: list[Path], slices: list[str] | None = None) -> str:
    """The report's Markdown: the summary table (a column per run), the plots (file names relative
    to the report), the ``slices`` table lines if given, the per-epoch tables."""
    rows = [summary_rows(r) for r in runs]
    title = runs[0].label if len(runs) == 1 else " vs ".join(r.label for r in runs)
    lines = [f"# hstu report: {title}", ""]
    lines += _table(["", *(r.label for r in runs)], [[name, *(row[name] for row in rows)] for name in rows[0]])
    lines += ["", "Test and validation metrics: full ranking over all items (metrics.json, reported weights).", "", "## Curves", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    if slices:
        lines += ["", "## Slices", "", *slices]
    for r in runs:
        lines += ["", f"## Per epoch: {r.label}", "", *epoch_table(r)]
    return "\n".join(lines) + "\n"
