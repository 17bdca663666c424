"""hstu serve says when the CPU will run eager for want of a graph cache (hstu.serve.cli.graph_cache_hint)."""

from __future__ import annotations

from hstu.backend.graph_cache import GraphCache
from hstu.serve.cli import graph_cache_hint, layout_record_warning


def test_no_cache_names_the_export_command(tmp_path):
    line = graph_cache_hint(tmp_path, "auto", "cpu", [20, 50], 16, None)
    assert line is not None and "buckets [20, 50], max batch 16" in line
    # the command builds this server's layout, not the export's defaults
    assert f"`hstu export --run {tmp_path} --graphs --buckets 20,50 --max-batch 16`" in line


def test_the_command_carries_a_non_default_precision(tmp_path):
    line = graph_cache_hint(tmp_path, "auto", "cpu", [50, 200], 4, "bf16")
    assert line is not None and f"`hstu export --run {tmp_path} --graphs --buckets 50,200 --max-batch 4 --precision bf16`" in line


def _entries(run, *precisions):
    import json

    from hstu.backend import graph_cache as gc

    d = GraphCache.create(run)
    entries = {f"g{i}": {"precision": p} for i, p in enumerate(precisions)}
    (d / gc.MANIFEST).write_text(json.dumps({"format": gc.FORMAT, "entries": entries}))


def test_a_matching_cache_or_another_mode_says_nothing(tmp_path):
    _entries(tmp_path, "float32")
    GraphCache.add_layout(tmp_path, [20, 50], 16)
    assert graph_cache_hint(tmp_path, "auto", "cpu", [20, 50], 16, None) is None
    assert graph_cache_hint(tmp_path, "auto", "cpu", [20, 50], 16, "fp32") is None
    assert graph_cache_hint(tmp_path / "none", "eager", "cpu", [20, 50], 16, None) is None
    assert graph_cache_hint(tmp_path / "none", "auto", "cuda", [20, 50], 16, None) is None


def test_a_cache_without_the_served_precision_is_named(tmp_path):
    """INT8 graphs are cached too (hstu::int8_linear): a server at --precision int8 on a cache of float graphs
    runs eager, and the line says so with the command that builds them."""
    _entries(tmp_path, "float32")
    GraphCache.add_layout(tmp_path, [20, 50], 16)
    line = graph_cache_hint(tmp_path, "auto", "cpu", [20, 50], 16, "int8")
    assert line is not None and "no graph cache for buckets [20, 50], max batch 16 at int8 (its graphs are fp32)" in line
    assert "--precision int8`" in line
    _entries(tmp_path, "float32", "int8")
    assert graph_cache_hint(tmp_path, "auto", "cpu", [20, 50], 16, "int8") is None


def test_a_cache_for_another_layout_is_named(tmp_path):
    GraphCache.create(tmp_path)
    GraphCache.add_layout(tmp_path, [20, 50], 8)
    line = graph_cache_hint(tmp_path, "auto", "cpu", [20, 50], 16, None)
    assert line is not None and "its cache is for buckets [20, 50], max batch 8" in line


def test_a_cache_without_a_readable_layout_record_is_not_called_missing(tmp_path):
    """A cache whose layout.json is missing or unreadable is still used under auto (GraphCache.beside cannot rule it
    out: its graphs load where their names match this server's shapes), so no line says "runs eager"; a warning
    names the file and the command that rewrites it (a fresh-user trial: the log said eager, /readyz "2 loaded")."""
    from hstu.backend import graph_cache as gc

    _entries(tmp_path, "float32")
    for content in (None, "garbage{"):
        p = tmp_path / gc.DIRNAME / gc.LAYOUT
        p.unlink(missing_ok=True)
        if content is not None:
            p.write_text(content)
        assert graph_cache_hint(tmp_path, "auto", "cpu", [20, 50], 16, None) is None
        line = layout_record_warning(tmp_path, "auto", "cpu", [20, 50], 16, None)
        assert line is not None and "the rest run eager" in line and gc.LAYOUT in line
        assert f"`hstu export --run {tmp_path} --graphs --buckets 20,50 --max-batch 16`" in line
        assert GraphCache.layouts(tmp_path) == []  # GraphCache.beside(holding=True) then keeps the cache: no layout rules it out
    GraphCache.add_layout(tmp_path, [20, 50], 16)  # a readable record: nothing to warn about
    assert layout_record_warning(tmp_path, "auto", "cpu", [20, 50], 16, None) is None
    assert layout_record_warning(tmp_path / "none", "auto", "cpu", [20, 50], 16, None) is None


def test_an_unreadable_manifest_is_a_warning(tmp_path):
    """A fresh-user finding: with `{bad` in graphs/manifest.json the server said at INFO "no graph cache ... (its graphs
    are none)", not naming the file."""
    from hstu.backend import graph_cache as gc

    d = GraphCache.create(tmp_path)
    GraphCache.add_layout(tmp_path, [20, 50], 16)
    for bad in ("{bad", '{"entries": 5}'):
        (d / gc.MANIFEST).write_text(bad)
        line = layout_record_warning(tmp_path, "auto", "cpu", [20, 50], 16, None)
        assert line is not None and line.startswith(f"{d / gc.MANIFEST}: not a graph-cache manifest (")
        assert line.endswith(
            f"the model runs eager; `hstu export --run {tmp_path} --graphs --buckets 20,50 --max-batch 16` builds a new cache"
        )
    assert layout_record_warning(tmp_path, "eager", "cpu", [20, 50], 16, None) is None
