"""The package's layers (docs/architecture.md): each package imports only the layers below it,
vLLM is imported by ``serving/`` alone (the benchmarks drive vLLM as a user does), and the
modules of ``attention/`` import one another without a cycle (``TYPE_CHECKING`` imports count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "vllm_dp_plugin"
# packages whose sources live outside vllm_dp_plugin/ (setup.py's package_dir)
SOURCES = {"kernels": REPO / "kernels"}

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
VLLM_ALLOWED = {"serving", "benchmarks"}  # (the research suites, benchmarks/, too)
ACYCLIC = ("attention", "kernels")  # packages whose modules import one another without a cycle


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


def _package_path(path: Path) -> tuple[str, ...]:
    """The parts of ``path`` under ``vllm_dp_plugin`` as imported (``kernels/x.py`` -> kernels, x.py)."""
    for name, source in SOURCES.items():
        if path.is_relative_to(source):
            return (name, *path.relative_to(source).parts)
    return path.relative_to(ROOT).parts


def _file_imports(path: Path) -> set[str]:
    return _imports(path.read_text(encoding="utf-8"), _package_path(path)[:-1])


def _package_dir(name: str) -> Path:
    return SOURCES.get(name, ROOT / name)


def _package_files(name: str) -> list[Path]:
    return sorted(_package_dir(name).rglob("*.py")) if _package_dir(name).is_dir() else [ROOT / f"{name}.py"]


def _all_files() -> list[Path]:
    return sorted([*ROOT.rglob("*.py"), *(p for source in SOURCES.values() for p in source.rglob("*.py"))])


def test_kernels_are_installed_from_the_top_level_kernels_directory():
    """setup.py's package_dir: ``vllm_dp_plugin.kernels`` is imported from ``kernels/``."""
    import vllm_dp_plugin.kernels

    assert Path(vllm_dp_plugin.kernels.__file__).resolve().parent == SOURCES["kernels"]
    assert not (ROOT / "kernels").exists()


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below(package):
    bad = {}
    for path in _package_files(package):
        above = _file_imports(path) - ALLOWED[package] - {package, "vllm"}
        if above:
            bad["/".join(_package_path(path))] = sorted(above)
    assert not bad, f"{package} imports layers above it: {bad}"


def test_only_serving_imports_vllm():
    bad = ["/".join(_package_path(p)) for p in _all_files()
           if "vllm" in _file_imports(p) and _package_path(p)[0] not in VLLM_ALLOWED]
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
             for p in sorted(_package_dir(package).glob("*.py"))}
    assert not _cycle(graph), f"import cycle in {package}/: {' -> '.join(_cycle(graph))}"


def _module_name(path: Path) -> str:
    """``vllm_dp_plugin.a.b`` for ``a/b.py`` (``a/__init__.py``: ``vllm_dp_plugin.a``)."""
    parts = _package_path(path)
    parts = (*parts[:-1], Path(parts[-1]).stem)
    return ".".join(("vllm_dp_plugin", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _import_edges(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere (function bodies and
    ``TYPE_CHECKING`` blocks too): ``from X import y`` is an edge to ``X.y`` where that is a
    module, else to ``X``."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != module}
    return out


def _repo_module_name(path: Path) -> str:
    """``benchmarks.a.b`` for the repository's ``benchmarks/a/b.py`` (``__init__.py``: its package)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _research_files() -> dict[str, Path]:
    return {_repo_module_name(p): p for p in sorted((REPO / "benchmarks").rglob("*.py"))}


def test_no_import_cycle_anywhere():
    """Every module of vllm_dp_plugin (kernels included) and of the repository's research suites
    (``benchmarks/``), every import anywhere in them: no cycle (three were there: bench context's
    report, rows and running; benchmarks.train's methods and spec; cli, calibration and serving/launch)."""
    files = {_module_name(p): p for p in _all_files()} | _research_files()
    graph = {name: _import_edges(p.read_text(encoding="utf-8"), name, p.name == "__init__.py", set(files))
             for name, p in files.items()}
    assert not _cycle(graph), f"import cycle: {' -> '.join(_cycle(graph))}"


def test_the_installed_package_needs_nothing_of_the_repository_s_benchmarks():
    """The research suites import the package; the package (what users install) never imports them."""
    research = set(_research_files())
    hits = [f"{p.relative_to(REPO)}: {sorted(edges)}" for p in _all_files()
            if (edges := _import_edges(p.read_text(encoding="utf-8"), _module_name(p), p.name == "__init__.py",
                                       research | {"benchmarks"}))]
    assert not hits, hits


def test_the_package_wide_check_resolves_each_import_form():
    known = {"vllm_dp_plugin.cli", "vllm_dp_plugin.calibration", "vllm_dp_plugin.serving.launch",
             "vllm_dp_plugin.serving"}
    src = "def f():\n    from ..cli import X\nfrom ..calibration import run\nfrom . import launch\n"
    assert _import_edges(src, "vllm_dp_plugin.serving.launch", False, known) == {
        "vllm_dp_plugin.calibration", "vllm_dp_plugin.cli"}  # a function's import counts; itself does not
    assert _import_edges("import vllm_dp_plugin.serving.launch\n", "vllm_dp_plugin.cli", False, known) == {
        "vllm_dp_plugin.serving.launch"}
    assert _import_edges("from .cli import X\n", "vllm_dp_plugin.calibration", False, known) == {"vllm_dp_plugin.cli"}


def test_the_cycle_check_sees_a_cycle():
    """The cycle the release modes once had (modes imported them, they imported its types back
    under TYPE_CHECKING) fails; relative and absolute forms are both seen."""
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .modes import Release\n"
    assert _module_imports(src, "attention") == {"modes"}
    assert _module_imports("from vllm_dp_plugin.attention.state import X\nfrom . import tree\n", "attention") == {
        "state", "tree"}
    assert _cycle({"modes": {"state"}, "state": {"base", "modes"}, "base": set()}) == ["modes", "state", "modes"]
    assert _cycle({"modes": {"state", "base"}, "state": {"base"}, "base": set()}) == []
