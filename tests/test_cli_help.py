"""Every ``vllm-dp`` (sub)command's ``--help`` ends with one worked example that parses and names
files that exist; building every help text imports no vLLM."""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """command -> help text, built in a fresh interpreter (so ``vllm`` cannot be imported already)."""
    code = ("import json, sys; from vllm_dp_plugin.cli import help_texts; texts = help_texts(); "
            "print(json.dumps({'vllm': 'vllm' in sys.modules, 'texts': texts}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert not data["vllm"], "building the CLI's help imported vllm"
    return dict(data["texts"])


def _example(text: str) -> list[str]:
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    assert lines[-2].strip() == "example:", lines[-2:]
    return shlex.split(lines[-1].strip())


def test_every_command_is_covered(helps):
    from vllm_dp_plugin.cli import BENCH_SUITES, build_parser, subcommands

    expected = {"vllm-dp", *(f"vllm-dp {name}" for name in subcommands(build_parser())),
                *(f"vllm-dp bench {suite}" for suite in BENCH_SUITES)}
    assert set(helps) == expected


def test_every_help_ends_with_a_working_example(helps):
    from vllm_dp_plugin.benchmarks.lib.cli import with_example
    from vllm_dp_plugin.calibration import build_parser as calibration_parser
    from vllm_dp_plugin.cli import BENCH_SUITES, build_parser

    for command, text in helps.items():
        argv = _example(text)
        assert argv[0] == "vllm-dp", (command, argv)
        words = command.split()[1:]
        if command != "vllm-dp":  # the top level's example may be any command
            assert argv[1: 1 + len(words)] == words, (command, argv)
        if argv[1] == "serve":  # the rest is vLLM's; our option and the files it names
            config = argv[argv.index("--dp-config") + 1]
            assert (ROOT / config).is_file(), config
        elif argv[1] == "calibrate":
            calibration_parser().parse_args(argv[2:])
        elif argv[1] == "bench":
            module = importlib.import_module(f"vllm_dp_plugin.benchmarks.{BENCH_SUITES[argv[2]][0]}")
            with_example(module.build_parser()).parse_args(argv[3:])
        else:
            args = build_parser().parse_args(argv[1:])
            config = getattr(args, "config", None)
            assert config is None or (ROOT / config).is_file(), config


def test_serve_help_prints_ours_after_vllms(monkeypatch, capsys):
    launch = pytest.importorskip("vllm_dp_plugin.serving.launch")
    from vllm_dp_plugin import cli

    calls = []
    monkeypatch.setattr(launch, "run_vllm_cli", lambda argv: calls.append(argv) or print("vLLM's help") or 0)
    assert cli.main(["serve", "--help"]) == 0
    assert calls == [["serve", "--help"]]
    out = capsys.readouterr().out
    assert out.index("vLLM's help") < out.index("--dp-config FILE")
    assert _example(out)[:2] == ["vllm-dp", "serve"]


def test_every_research_suite_s_help_ends_with_a_working_example():
    """The repository's research suites (``python -m benchmarks.SUITE``): each help ends with its
    example, which parses; ``benchmarks`` is this repository's (Opacus installs one of that name)."""
    import benchmarks

    assert Path(benchmarks.__file__).resolve() == ROOT / "benchmarks" / "__init__.py"
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in (ROOT / "benchmarks").glob("*/__main__.py")}
    assert set(benchmarks.SUITES) == modules
    for module in benchmarks.SUITES:
        parser = importlib.import_module(f"benchmarks.{module}").build_parser()
        argv = _example(parser.format_help())
        assert argv[:3] == ["python", "-m", f"benchmarks.{module}"], argv
        parser.parse_args(argv[3:])


def test_a_research_suite_runs_as_a_module_from_the_repository_root(tmp_path):
    out = tmp_path / "s.jsonl"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.make_scenarios", str(out), "--count", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 1
