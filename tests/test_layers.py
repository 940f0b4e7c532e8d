"""The package's layers (docs/architecture.md): each package imports only the layers below it,
and vLLM is imported by ``serving/`` alone (the benchmarks drive vLLM as a user does)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "vllm_dp_plugin"

# package -> the vllm_dp_plugin packages/modules it may import (besides itself)
ALLOWED = {
    "lru": set(),
    "kernels": set(),
    "privacy": set(),
    "aggregate": {"privacy"},
    "attention": {"privacy", "kernels"},
    "prompt": {"privacy", "kernels", "lru"},
    "trainer": {"privacy", "demo"},
    "config": {"privacy", "attention", "prompt"},
    "plan": {"privacy", "attention", "aggregate", "config", "lru"},
}
VLLM_ALLOWED = {"serving", "benchmarks"}


def _imports(source: str, here: tuple[str, ...]) -> set[str]:
    """Top-level vllm_dp_plugin names (``attention``, ``config``, ...) and ``vllm`` that a module
    of package ``vllm_dp_plugin.<here>`` with text ``source`` imports."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = list(here[: len(here) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [a.name for a in node.names][:1])
                names = ["vllm_dp_plugin." + ".".join(parts)] if parts else []
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")
            if top[0] == "vllm":
                out.add("vllm")
            elif top[0] == "vllm_dp_plugin" and len(top) > 1:
                out.add(top[1])
    return out


def _file_imports(path: Path) -> set[str]:
    return _imports(path.read_text(encoding="utf-8"), path.relative_to(ROOT).parts[:-1])


def _package_files(name: str) -> list[Path]:
    return sorted((ROOT / name).rglob("*.py")) if (ROOT / name).is_dir() else [ROOT / f"{name}.py"]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below(package):
    bad = {}
    for path in _package_files(package):
        above = _file_imports(path) - ALLOWED[package] - {package, "vllm"}
        if above:
            bad[str(path.relative_to(ROOT))] = sorted(above)
    assert not bad, f"{package} imports layers above it: {bad}"


def test_only_serving_imports_vllm():
    bad = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
           if "vllm" in _file_imports(p) and p.relative_to(ROOT).parts[0] not in VLLM_ALLOWED]
    assert not bad, f"vllm imported outside serving/: {bad}"


def test_the_checker_sees_relative_and_absolute_imports():
    """A test that cannot fail is a defect: the parser finds every import form."""
    src = "from ..config import X\nimport vllm_dp_plugin.serving.http\nfrom vllm import LLM\nfrom . import core\n"
    assert _imports(src, ("attention",)) == {"config", "serving", "vllm", "attention"}
    assert _imports("from .attention.params import MODES\n", ()) == {"attention"}
