"""The package's layers (docs/architecture.md): each package imports only the layers below it,
vLLM is imported by ``serving/`` alone (the benchmarks drive vLLM as a user does), and the
modules of ``attention/`` import one another without a cycle (``TYPE_CHECKING`` imports count)."""

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
ACYCLIC = ("attention",)  # packages whose modules import one another without a cycle


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


def _module_imports(source: str, package: str) -> set[str]:
    """The modules of ``vllm_dp_plugin.<package>`` (top-level files, by stem) that a module of that
    package with text ``source`` imports anywhere (``TYPE_CHECKING`` and function bodies too)."""
    out = set()
    prefix = f"vllm_dp_plugin.{package}."
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
            out.add(node.module[len(prefix):].split(".")[0])
        elif isinstance(node, ast.Import):
            out |= {a.name[len(prefix):].split(".")[0] for a in node.names if a.name.startswith(prefix)}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> modules it imports) as [a, b, ..., a], or []."""
    done, path = set(), []

    def visit(node: str) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            found = visit(dep)
            if found:
                return found
        path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        found = visit(node)
        if found:
            return found
    return []


@pytest.mark.parametrize("package", ACYCLIC)
def test_a_package_s_modules_import_one_another_without_a_cycle(package):
    graph = {p.stem: _module_imports(p.read_text(encoding="utf-8"), package) - {p.stem}
             for p in sorted((ROOT / package).glob("*.py"))}
    assert not _cycle(graph), f"import cycle in {package}/: {' -> '.join(_cycle(graph))}"


def test_the_cycle_check_sees_a_cycle():
    """The cycle the release modes once had (modes imported them, they imported its types back
    under TYPE_CHECKING) fails; relative and absolute forms are both seen."""
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .modes import Release\n"
    assert _module_imports(src, "attention") == {"modes"}
    assert _module_imports("from vllm_dp_plugin.attention.state import X\nfrom . import tree\n", "attention") == {
        "state", "tree"}
    assert _cycle({"modes": {"state"}, "state": {"base", "modes"}, "base": set()}) == ["modes", "state", "modes"]
    assert _cycle({"modes": {"state", "base"}, "state": {"base"}, "base": set()}) == []
