"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a missing page
or a page that fails to generate fails it), generated pages are not committed, and the docs
name features, not tracker numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("docs/reference/configuration.md", "docs/reference/cli.md", "docs/benchmarks/results.md", "docs/benchmarks/index.md",
             "docs/index.md", "docs/security.md")


def test_strict_build(tmp_path):
    """The README's command as written, `make docs` (only its output directory moved), from the
    repository root with nothing added to the environment (it passed once only with PYTHONPATH)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    venv = Path(sys.executable).parent.parent
    if not (venv / ".installed-stamp").is_file():  # the Makefile's install marker
        pytest.skip("`make docs` needs the Makefile's installed .venv (make install)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    stamp = venv / ".installed-stamp"  # -o: never reinstall from inside a test
    out = subprocess.run(["make", "-o", str(stamp), "docs", f"VENV={venv}", f"SITE={tmp_path / 'site'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    config = (site / "reference" / "configuration" / "index.html").read_text(encoding="utf-8")
    for key in ("total_epsilon", "facts_per_document", "paraphrase_max_tokens", "public_head"):
        assert key in config, key
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "python -m benchmarks.aggregate_batch" in cli and "example:" in cli
    assert (site / "benchmarks" / "results" / "context-answer-cpu-2core-2026-11-28" / "index.html").is_file()
    assert (site / "examples" / "serve-smollm2-aggregate.yaml").is_file()


def test_generated_pages_are_not_committed():
    assert not [p for p in GENERATED if (ROOT / p).exists()]


def test_no_tracker_numbers_in_docs():
    pattern = re.compile(r"\bissues? \d+|\(#\d+\)", re.IGNORECASE)
    files = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", ROOT / "SECURITY.md"]
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for p in files
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)
