"""The README runs as written: every ```python block and every ```bash block marked ``<!-- test -->``
is executed, in README order, in one temporary working directory (the tutorial CSV,
tests/fixtures/tutorial/events.csv, and examples/ copied in), with only the settings that make it
tiny substituted (epochs, buckets, the port). Also: every relative link of README.md and docs/*.md
names an existing file, and docs/configuration.md names every config dataclass field."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hstu.config import GenerateConfig, ModelConfig, ServeConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"(<!-- test -->\s*\n)?```(\w*)\n(.*?)```", re.S)
SMALL = [("--epochs 10", "--epochs 1"), ("epochs=2", "epochs=1"), ("--format onnx --out", "--format onnx --buckets 20 --out")]


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of the README's python blocks and of its bash blocks marked <!-- test -->."""
    return [(lang, code) for mark, lang, code in FENCE.findall(text) if lang == "python" or (lang == "bash" and mark)]


def shell(code: str, port: int) -> str:
    """A bash block made tiny; a backgrounded `hstu serve` is waited for (/readyz) and stopped at exit."""
    for old, new in SMALL:
        code = code.replace(old, new)
    code = code.replace("8000", str(port))
    ready = f"\ntrap 'kill %1' EXIT; for i in $(seq 240); do curl -sf localhost:{port}/readyz >/dev/null && break; sleep 0.5; done\n"
    return "set -euo pipefail\n" + re.sub(r"(hstu serve [^\n]*&)\n", lambda m: m.group(1) + ready, code)


def test_readme_blocks_run(tmp_path):
    found = blocks(README.read_text(encoding="utf-8"))
    langs = [lang for lang, _ in found]
    assert langs.count("python") >= 1 and langs.count("bash") >= 4, langs  # the tutorial, report, serve, batch/export
    shutil.copytree(REPO / "tests" / "fixtures" / "tutorial", tmp_path / "tests" / "fixtures" / "tutorial")
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "2"}
    for i, (lang, code) in enumerate(found):
        cmd = ["bash", "-c", shell(code, port)] if lang == "bash" else [sys.executable, "-c", _tiny(code)]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"README block {i} ({lang}):\n{code}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-2000:]}"
        if "curl" in code:
            assert '"items"' in r.stdout and '"item_id"' in r.stdout, r.stdout
    assert (tmp_path / "runs" / "shop" / "metrics.json").is_file()
    assert (tmp_path / "recs.parquet").is_file() and (tmp_path / "reports" / "shop" / "report.md").is_file()
    assert (tmp_path / "export" / "shop" / "encoder_E20.onnx").is_file()


def _tiny(code: str) -> str:
    for old, new in SMALL:
        code = code.replace(old, new)
    return code


def test_tiny_substitutions_apply():
    """Each substitution still matches README text: a README edit that dodges one would run the full size."""
    text = README.read_text(encoding="utf-8")
    for old, _ in SMALL:
        assert old in text, old
    assert "hstu serve --run runs/shop --port 8000 &" in text


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_exist(page):
    text = page.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name}: link {target!r} -> {path} does not exist"


@pytest.mark.parametrize("cls", [ModelConfig, TrainConfig, GenerateConfig, ServeConfig], ids=lambda c: c.__name__)
def test_configuration_page_names_every_field(cls):
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(cls) if f"| `{f.name}` |" not in text]
    assert not missing, f"docs/configuration.md lacks {cls.__name__} field(s) {missing}"
