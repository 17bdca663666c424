"""PNG plots with matplotlib (the ``plot`` extra), drawn off-screen (the Agg backend).

:func:`plot_curves` draws one line per run (epoch -> value): ``hstu report``'s loss and validation
curves and the benchmarks' NDCG@10 plots (benchmarks/reproduce_ml1m.py, taobao.py).
:func:`save_png` writes a figure atomically (temp file + rename), as every run file is written.
"""

from __future__ import annotations

from pathlib import Path

MISSING = "matplotlib is not installed: pip install 'hstu[plot]'"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend. Raises ImportError with :data:`MISSING` when
    matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(MISSING) from None
    return plt


def save_png(fig, path: Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` as PNG through ``path.tmp`` and a rename, close it; returns ``path``."""
    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.tight_layout()
    fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_curves(
    path: Path,
    curves: dict[str, tuple[list[int], list[float]]],
    *,
    title: str,
    ylabel: str = "validation NDCG@10",
    hlines: dict[str, float] | None = None,
    points: dict[str, tuple[list[int], list[float]]] | None = None,
) -> Path:
    """One line per name in ``curves`` (epochs, values), optional marker series ``points`` and
    horizontal reference lines ``hlines`` (name -> y); x axis: epoch. Writes the PNG ``path``
    (:func:`save_png`) and returns it. Raises ImportError without matplotlib."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for name, (x, y) in curves.items():
        ax.plot(x, y, label=name, linewidth=1.6, marker="o" if len(x) < 15 else None, markersize=3)
    for name, (x, y) in (points or {}).items():
        ax.plot(x, y, "o", label=name, markersize=5)
    for i, (name, y) in enumerate((hlines or {}).items()):
        ax.axhline(y, linestyle="--", linewidth=1.0, color=f"C{len(curves) + len(points or {}) + i}", label=name)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_png(fig, path, dpi=120)
