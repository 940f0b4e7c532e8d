"""MkDocs hook of the vllm-dp site (``hooks:`` in mkdocs.yml): pages generated at build time, so
they cannot drift from the code, and the repository files the docs link to.

* ``reference/configuration.md``: the ``dp_privacy`` section from the typed config classes of
  ``vllm_dp_plugin/config.py`` (every field's name, type and default, the class docstrings).
* ``reference/cli.md``: every ``vllm-dp`` subcommand's ``--help`` from the argparse parsers
  (``vllm_dp_plugin.cli.build_parser``, the calibration parser and each bench suite's
  ``build_parser``), then each research suite's (``python -m benchmarks.SUITE --help``).
  None of the package's imports vLLM.
* ``benchmarks/index.md``: each suite (``vllm-dp bench`` and research), its example and its
  committed results;
  ``benchmarks/results.md``: every committed result file under ``benchmarks/results/``.
* ``index.md`` from README.md, ``security.md`` from SECURITY.md.
* Repository files outside ``docs/`` (``benchmarks/results/*``, ``examples/*``, ...) are added
  at their repository paths, so the docs keep repository-relative links (``../examples/dp.yaml``
  from ``docs/usage.md``) that work on a code host and in the site: ``on_page_markdown`` rewrites
  each such link to the file's place in the site.

Nothing generated is committed; ``make docs`` (``mkdocs build --strict``) and
``tests/test_docs.py`` build it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
import typing
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the package of this checkout, also without an editable install
    sys.path.insert(0, str(ROOT))

# repository files shown as pages at another site path; docs/X is X
REPO_PAGES = {"README.md": "index.md", "SECURITY.md": "security.md"}
# whole folders of the repository exposed in the site at their own paths
EXPOSED_DIRS = ("benchmarks/results",)
LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
RESULT_SUFFIXES = (".md", ".json", ".csv", ".png", ".log", ".xml")


# --------------------------------------------------------------------------- repository links
def _site_path(repo_path: str) -> str | None:
    """Where a repository file lives in the site (None: not in the site)."""
    if repo_path in REPO_PAGES:
        return REPO_PAGES[repo_path]
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/"):]
    return repo_path if (ROOT / repo_path).is_file() else None


def _repo_path(site_src: str) -> str:
    """The repository file a site page was read or generated from."""
    for repo, site in REPO_PAGES.items():
        if site == site_src:
            return repo
    docs_file = ROOT / "docs" / site_src
    return f"docs/{site_src}" if docs_file.is_file() else site_src


def _resolve(page_repo_path: str, target: str) -> str | None:
    """The repository path a relative link of a repository file points to (None: not a file link)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    joined = os.path.normpath(os.path.join(os.path.dirname(page_repo_path), target))
    return None if joined.startswith("..") else joined.replace(os.sep, "/")


def rewrite_links(markdown: str, page_repo_path: str, page_site_path: str) -> str:
    """Repository-relative links -> links relative to the page's place in the site."""

    def sub(match: re.Match) -> str:
        repo = _resolve(page_repo_path, match.group(2))
        site = None if repo is None else _site_path(repo)
        if site is None:
            return match.group(0)
        rel = os.path.relpath(site, os.path.dirname(page_site_path) or ".").replace(os.sep, "/")
        return f"{match.group(1)}{rel}{match.group(3) or ''}{match.group(4)}"

    return LINK.sub(sub, markdown)


def _linked_repo_files(docs_dir: Path) -> set[str]:
    """Repository files outside docs/ that the docs, README.md and SECURITY.md link to."""
    sources = [(f"docs/{p.relative_to(docs_dir).as_posix()}", p) for p in docs_dir.rglob("*.md")]
    sources += [(name, ROOT / name) for name in REPO_PAGES]
    found = set()
    for repo_path, path in sources:
        for match in LINK.finditer(path.read_text(encoding="utf-8")):
            repo = _resolve(repo_path, match.group(2))
            if (repo and not repo.startswith("docs/") and repo not in REPO_PAGES
                    and (ROOT / repo).is_file()):
                found.add(repo)
    return found


# --------------------------------------------------------------------------- configuration
def _type_name(annotation: typing.Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return " or ".join(f"`{part.strip()}`" for part in text.split("|"))


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
        if isinstance(value, str) and len(value) > 60:
            return f"`{value[:57]!r}...` (see below)".replace("|", "\\|")
        return f"`{value!r}`".replace("|", "\\|")
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{field.default_factory()!r}`"  # type: ignore[misc]
    return "**required**"


def _docstring(cls: type) -> str:
    import inspect

    return inspect.cleandoc(cls.__doc__ or "")


def _field_description(doc: str, name: str) -> str:
    """The docstring's clause about ``name`` (clauses end at ". " or "; " outside parentheses):
    the first one starting with it in double backticks, else the first one naming it."""
    clauses: list[str] = []
    for piece in re.split(r"(?<=[.;])\s+(?=``|[A-Z])", " ".join(doc.split())):
        prose = re.sub(r"``.*?``", "", clauses[-1]) if clauses else ""  # code may hold "(0, 1]"
        if prose.count("(") > prose.count(")"):
            clauses[-1] += " " + piece
        else:
            clauses.append(piece)
    key = f"``{name}``"
    found = [c for c in clauses if c.startswith(key)] or [c for c in clauses if key in c]
    if not found:
        return ""
    text = found[0].rstrip(";")
    text = text if text.endswith(".") else text + "."
    if len(text) > 500:
        text = text[:497] + "..."
    return text.replace("``", "`").replace("|", "\\|")


def configuration_page() -> str:
    from vllm_dp_plugin import config

    sections = [
        ("dp_privacy", config.DPPrivacyConfig),
        ("dp_privacy.attention", config.AttentionPrivacyConfig),
        ("dp_privacy.prompt", config.PromptPrivacyConfig),
        ("dp_privacy.aggregate", config.AggregatePrivacyConfig),
        ("dp_privacy.aggregate.clients.&lt;name&gt;", config.AggregateClient),
        ("dp_privacy.fact_sheet", config.FactSheetPrivacyConfig),
    ]
    out = [
        "# Configuration reference: `dp_privacy`",
        "",
        "!!! note \"Generated\"",
        "    This page is generated at build time from the typed configuration classes in",
        "    `vllm_dp_plugin/config.py` (`docs/hooks/vllm_dp_docs.py`): names, types and defaults",
        "    are the code's. Unknown keys are errors; a bad value is refused naming its key.",
        "",
        "The section is given to vLLM as `--additional-config '{\"dp_privacy\": {...}}'`, or kept in",
        "a YAML/JSON file for `vllm-dp serve --dp-config FILE` and `vllm-dp account --config FILE`",
        "(the file may hold the section itself or `{dp_privacy: {...}}`; relative paths in it are",
        "relative to the file). Sections not given are off.",
        "",
    ]
    for key, cls in sections:
        doc = _docstring(cls)
        out += [f"## `{key}`", "", f"Class `{cls.__module__}.{cls.__qualname__}`.", "",
                "| Key | Type | Default | Described as |", "|---|---|---|---|"]
        for field in dataclasses.fields(cls):
            if cls is config.AggregateClient and field.name == "name":
                continue  # the mapping's key
            out.append(f"| `{field.name}` | {_type_name(field.type)} | {_default(field)} | "
                       f"{_field_description(doc, field.name)} |")
        long_defaults = [f for f in dataclasses.fields(cls)
                         if isinstance(f.default, str) and len(f.default) > 60]
        out += ["", "**From the class docstring:**", "", _as_markdown(doc), ""]
        for field in long_defaults:
            out += [f"Default of `{field.name}`:", "", "```text", field.default, "```", ""]
    return "\n".join(out) + "\n"


def _as_markdown(doc: str) -> str:
    """reST-ish docstring text -> markdown (double backticks -> single)."""
    return doc.replace("``", "`").replace("\\\\n", "\\n")


# --------------------------------------------------------------------------- CLI
def cli_page() -> str:
    out = [
        "# CLI reference: `vllm-dp`",
        "",
        "!!! note \"Generated\"",
        "    Generated at build time from the argparse parsers (`vllm_dp_plugin/cli.py`,",
        "    `vllm_dp_plugin/calibration.py`, each suite's `build_parser` in",
        "    `vllm_dp_plugin/benchmarks/`, then the repository's research suites in `benchmarks/`):",
        "    each block is what `COMMAND --help` prints.",
        "",
    ]
    from vllm_dp_plugin.cli import help_texts

    for command, text in [*help_texts(), *research_help_texts()]:
        out += [f"## `{command}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(out)


def research_suites():
    """The repository's ``benchmarks`` package (its research suites), found before the top-level
    ``benchmarks`` that Opacus installs into site-packages (which an editable install's path entry
    for this checkout comes after)."""
    if sys.path[0] != str(ROOT):
        sys.path.insert(0, str(ROOT))
    for name in [m for m in sys.modules if m.split(".")[0] == "benchmarks"]:
        if not str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(ROOT)):
            del sys.modules[name]
    return importlib.import_module("benchmarks")


def research_help_texts() -> list[tuple[str, str]]:
    """(``python -m benchmarks.SUITE``, its ``--help``) of each research suite of the repository."""
    benchmarks = research_suites()
    return [(f"{benchmarks.PREFIX}{module}",
             importlib.import_module(f"benchmarks.{module}").build_parser().format_help())
            for module in benchmarks.SUITES]


# --------------------------------------------------------------------------- results
def results_page() -> str:
    results = ROOT / "benchmarks" / "results"
    files = sorted(p for p in results.iterdir() if p.suffix in RESULT_SUFFIXES)
    stems: dict[str, list[Path]] = {}
    for path in files:
        stem = path.name.split(".")[0]
        for suffix in ("-accuracy", "-error-vs-eps", "-error-vs-n", "-real-heads", "-sources", "-speed",
                       "-nearest", "-train"):
            if stem.endswith(suffix) and (results / f"{stem[: -len(suffix)]}.md").exists():
                stem = stem[: -len(suffix)]
        stems.setdefault(stem, []).append(path)
    out = [
        "# Committed results",
        "",
        "!!! note \"Generated\"",
        "    Every file under `benchmarks/results/`, listed at build time. Each run writes a",
        "    `.md` summary (its command line, machine and table), the raw `.json` and, where",
        "    plotted, a `.png`.",
        "",
        "| Run | Files |",
        "|---|---|",
    ]
    for stem, paths in sorted(stems.items()):
        links = ", ".join(f"[{p.name[len(stem):] or p.name}](results/{p.name})" for p in paths)
        out.append(f"| `{stem}` | {links} |")
    return "\n".join(out) + "\n"


# result files whose name does not start with their suite's name
RESULT_PREFIXES = {"prompt": ("prompt-utility",), "attention": ("attention-cpu", "attention-gpu"),
                   "dpformer": ("dpformer",), "context": ("context",),
                   "context_speed": ("context-speed", "context-answer-speed", "context-extract-speed",
                                     "context-answer_batch-speed", "context-answer-sweep")}


def suite_of(name: str, suites: list[str]) -> str | None:
    """The bench suite a result file comes from: the longest suite name (or alias) it starts with."""
    best = None
    for suite in suites:
        for prefix in RESULT_PREFIXES.get(suite, (suite.replace("_", "-"),)):
            if name.startswith(prefix + "-") and (best is None or len(prefix) > best[1]):
                best = (suite, len(prefix))
    return None if best is None else best[0]


def benchmarks_page() -> str:
    benchmarks = research_suites()
    from vllm_dp_plugin.benchmarks.lib.cli import EXAMPLES
    from vllm_dp_plugin.cli import BENCH_SUITES

    results = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    suites = [*BENCH_SUITES, *benchmarks.SUITES]
    out = [
        "# Benchmark suites",
        "",
        "!!! note \"Generated\"",
        "    The suites a user runs against their own deployment are `vllm-dp bench SUITE`",
        "    (`vllm_dp_plugin/cli.py` `BENCH_SUITES`, installed with the package); the research and",
        "    reproduction suites are the repository's `python -m benchmarks.SUITE` (`benchmarks/__init__.py`",
        "    `SUITES`). The example is the one `--help` ends with; the results are the committed",
        "    `benchmarks/results/*.md` of that suite, matched by file name at build time.",
        "",
        "Every suite writes a markdown summary (its command line, machine, table), the raw JSON and",
        "usually a plot, named `SUITE-<machine>-<date>`, into `--out` (default `benchmarks/results/`).",
        "Without options a suite runs its full, committed configuration; `--quick` (where a suite",
        "has it) is a smoke run of toy sizes. `make bench` runs `python -m benchmarks.attention` and `vllm-dp bench serve`. The GPU runs",
        "(`benchmarks/gpu/run_all.sh`) are described in [development](../development.md). Each suite's",
        "options: `--help` or the [CLI reference](../reference/cli.md).",
        "",
        "## Your deployment: `vllm-dp bench`",
        "",
    ]

    def section(suite: str, summary: str, example: str, module: str) -> list[str]:
        files = [p for p in results if suite_of(p.name, suites) == suite]
        lines = [f"### `{suite}`", "", summary[0].upper() + summary[1:] + ".", "",
                 "```bash", example, "```", "", f"Module: `{module}`.", ""]
        lines += ["Committed results:", "", *(f"- [{p.stem}](results/{p.name})" for p in files)] if files else [
            "No committed results."]
        return [*lines, ""]

    for suite, (module, summary) in BENCH_SUITES.items():
        out += section(suite, summary, EXAMPLES[suite], f"vllm_dp_plugin/benchmarks/{module}")
    out += ["## Research and reproduction: `python -m benchmarks.SUITE`", "",
            "Run from the repository root (a checkout, not the installed package).", ""]
    for module, (summary, _) in benchmarks.SUITES.items():
        out += section(module, summary, benchmarks.command(module), f"benchmarks/{module}")
    unmatched = [p for p in results if suite_of(p.name, suites) is None]
    if unmatched:
        out += ["## Other results", ""] + [f"- [{p.stem}](results/{p.name})" for p in unmatched] + [""]
    out += ["All files, JSON and plots included: [committed results](results.md).", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- hooks
def _generated(config, src_uri: str, content: str | bytes) -> File:
    return File.generated(config, src_uri, content=content)


def on_files(files: Files, config) -> Files:
    docs_dir = Path(config["docs_dir"])
    pages = {
        "reference/configuration.md": configuration_page(),
        "reference/cli.md": cli_page(),
        "benchmarks/results.md": results_page(),
        "benchmarks/index.md": benchmarks_page(),
    }
    for repo, site in REPO_PAGES.items():
        pages[site] = (ROOT / repo).read_text(encoding="utf-8")
    for src_uri, content in pages.items():
        files.append(_generated(config, src_uri, content))
    exposed = set(_linked_repo_files(docs_dir))
    for folder in EXPOSED_DIRS:
        exposed |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).iterdir() if p.is_file()}
    for repo in sorted(exposed):
        if files.get_file_from_path(repo) is None:
            files.append(File.generated(config, repo, abs_src_path=str(ROOT / repo)))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    src = page.file.src_uri
    if src.startswith("reference/") and src in ("reference/configuration.md", "reference/cli.md"):
        return markdown
    return rewrite_links(markdown, _repo_path(src), src)
