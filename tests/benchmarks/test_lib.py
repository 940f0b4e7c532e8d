"""``vllm_dp_plugin.benchmarks.lib``: peak memory of a known allocation, the report writers,
the environment description, and the suites' shape (``add_cli_args`` + ``main``, no suite
importing another)."""

import argparse
import ast
import importlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import benchmarks as research
from benchmarks.attention.report import write_csv
from benchmarks.lib import measure
from vllm_dp_plugin import benchmarks
from vllm_dp_plugin.benchmarks.lib import cli, environment, report
from vllm_dp_plugin.cli import BENCH_SUITES

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MIB = 1 << 20


def rss_tolerance() -> int:
    """How far a VmHWM - VmRSS difference may be from the bytes a block touched.

    The kernel's RSS counters (file, anon, shmem) are per-CPU counters read approximately: each
    read is off by at most ncpu * batch pages, batch = max(32, 2 ncpu) (``percpu_counter_batch``);
    the difference takes two reads of three counters. A transparent huge page at either end of
    the buffer may be resident whole (2 MiB each), and the interpreter itself allocates a little
    while the block runs (tensor object, frames: well under 1 MiB)."""
    ncpu = os.cpu_count() or 1
    counters = 2 * 3 * ncpu * max(32, 2 * ncpu) * PAGE
    return counters + 2 * 2 * MIB + 1 * MIB


def touch(nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)  # every page written: resident
    return buf


@pytest.fixture
def cpu_peak():
    probe = measure.PeakMemory("cpu").start()
    probe.stop()
    if probe.measure != measure.VMHWM:
        pytest.skip(f"no resettable high-water mark here ({probe.measure})")


def test_cpu_peak_memory_measures_a_known_allocation(cpu_peak):
    nbytes, tol = 128 * MIB, rss_tolerance()
    assert tol < nbytes / 4  # the check has teeth on this machine
    with measure.PeakMemory("cpu") as mem:
        buf = touch(nbytes)
        del buf  # freed before the block ends: the peak still saw it
    assert mem.measure == measure.VMHWM
    assert nbytes - tol <= mem.peak <= nbytes + tol, (mem.peak, nbytes, tol)


def test_cpu_peak_memory_counts_only_growth_after_the_start(cpu_peak):
    held = touch(64 * MIB)  # in use before the block: not its allocation
    with measure.PeakMemory("cpu") as mem:
        held.add_(1)  # in place: no new memory
    assert mem.peak <= rss_tolerance()
    with measure.PeakMemory("cpu") as mem:
        del held
    assert mem.peak <= rss_tolerance()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory_is_the_allocator_peak():
    nbytes = 64 * MIB  # a multiple of the caching allocator's 2 MiB rounding: exact
    with measure.PeakMemory("cuda") as mem:
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        del buf
    assert mem.peak == nbytes


def test_timed_calls_respect_the_budget():
    calls = []
    times, last = measure.timed_calls(lambda: calls.append(1) or len(calls), "cpu", min_time=0.0, min_calls=3)
    assert len(times) == 3 and last == 3 and all(t >= 0 for t in times)
    times, _ = measure.timed_calls(lambda: None, "cpu", min_time=1e9, max_calls=4)
    assert len(times) == 4


def test_report_json_round_trips_numpy_torch_and_paths(tmp_path):
    data = {
        "float": np.float64(0.25), "int": np.int64(7), "bool": np.bool_(True), "array": np.arange(3.0),
        "tensor": torch.tensor([[1, 2], [3, 4]]), "scalar_tensor": torch.tensor(1.5), "path": Path("a/b.md"),
        "nested": [{"x": np.float32(0.5), "nan": math.nan}], "plain": "text",
    }
    path = report.write_json(tmp_path / "deep" / "r.json", data)
    back = report.read_json(path)
    assert back == {
        "float": 0.25, "int": 7, "bool": True, "array": [0.0, 1.0, 2.0], "tensor": [[1, 2], [3, 4]],
        "scalar_tensor": 1.5, "path": "a/b.md", "nested": [{"x": 0.5, "nan": back["nested"][0]["nan"]}],
        "plain": "text",
    }
    assert math.isnan(back["nested"][0]["nan"])
    assert not path.read_text().endswith("\n")
    assert report.write_json(tmp_path / "n.json", {"a": 1}, indent=2, newline=True).read_text() == '{\n  "a": 1\n}\n'
    assert json.loads(report.write_json(tmp_path / "p.json", [np.int32(1)]).read_text()) == [1]


def test_report_csv_table_and_names(tmp_path):
    rows = [{"a": 1, "b": [1, 2], "c": "x"}, {"d": 2.5, "a": 3}]
    path = write_csv(tmp_path / "r.csv", rows)
    assert path.read_text().splitlines() == ["a,c,d", "1,x,", "3,,2.5"]
    assert write_csv(tmp_path / "none.csv", []) is None and not (tmp_path / "none.csv").exists()
    assert report.table(["n", "v"], [[1, 0.12345], ["s", None]]) == "| n | v |\n|---|---|\n| 1 | 0.123 |\n| s | n/a |"
    assert [report.fmt(x) for x in (np.int64(5), 1e-5, 12345.0, math.inf, 0.0)] == ["5", "1.00e-05", "1.23e+04", "inf", "0"]
    assert report.suffixed(Path("out/x-cpu-2026.1"), ".json") == Path("out/x-cpu-2026.1.json")


def test_report_png(tmp_path):
    plt = report.pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = report.save_figure(fig, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not plt.get_fignums()


def test_environment_label_and_description():
    cores = environment.cpu_cores()
    assert environment.device_label("cpu") == f"cpu-{cores}core"
    assert environment.device_label(torch.device("cpu"), short=True) == "cpu"
    info = environment.environment("cpu", packages=("triton", "surely-not-a-package"))
    assert {"device", "label", "platform", "python", "torch", "torch_threads", "cpu", "cpu_count",
            "triton", "surely-not-a-package"} <= set(info)
    assert info["device"] == "cpu" and info["label"] == f"cpu-{cores}core" and info["cpu_count"] == cores
    assert info["torch"] == torch.__version__ and info["torch_threads"] == torch.get_num_threads()
    assert info["surely-not-a-package"] == "not installed" and "gpu" not in info
    load = environment.loadavg()
    assert load is None or (len(load) == 3 and all(x >= 0 for x in load))
    assert measure.free_bytes("cpu") > 0


def test_cli_common_options_and_parse():
    parser = argparse.ArgumentParser(prog="x")
    for add in (cli.add_out_arg, cli.add_date_arg, cli.add_device_arg):
        assert add(parser) is parser
    cli.add_quick_arg(parser, "toy")
    args, argv = cli.parse(["--quick"], lambda: parser)
    assert args.out == cli.DEFAULT_OUT == Path("benchmarks/results") and args.quick and argv == ["--quick"]
    assert cli.parse(args, lambda: parser) == (args, None)
    assert cli.ints("1024,1e3,") == (1024, 1000) and cli.floats("0.5, 1") == (0.5, 1.0)
    assert cli.names(" a, b ,") == ("a", "b")
    assert cli.command_line("vllm-dp bench x", ["--out", "a b"]) == "vllm-dp bench x --out 'a b'"
    assert cli.command_line("vllm-dp bench x", None) == "vllm-dp bench x"


# --------------------------------------------------------------------------- suite shape
PACKAGE_DIR = Path(benchmarks.__file__).parent
PACKAGE = benchmarks.__name__
RESEARCH_DIR = Path(research.__file__).parent  # the repository's benchmarks/
ROOT = RESEARCH_DIR.parent
MAX_INSTALLED_LINES = 6000
EXTENDS = {"context_speed": ("context",), "ledger_jsonl": ("ledger",)}  # research suite -> the package suite it extends


def suite_units(root: Path = PACKAGE_DIR) -> dict[str, list[Path]]:
    """Suite name -> its source files: a module ``X.py`` or a package ``X/`` (``lib`` excluded)."""
    units = {p.stem: [p] for p in root.glob("*.py") if p.name != "__init__.py"}
    for d in root.iterdir():
        if d.is_dir() and (d / "__init__.py").exists() and d.name != "lib":
            units[d.name] = sorted(d.rglob("*.py"))
    return units


def imported_units(path: Path, package: str = PACKAGE) -> set[str]:
    """The units of ``package`` that ``path`` imports (absolute or relative)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)  # a.b.__init__ for a package
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target.startswith(package + "."):
                found.add(target[len(package) + 1 :].split(".")[0])
    return found


def test_the_suites_are_the_ones_the_cli_runs():
    """The installed package holds the suites ``vllm-dp bench`` runs (and ``steady``, which ``serve``
    starts in its own process); the research suites are the repository's ``benchmarks/``."""
    units = suite_units()
    assert set(units) == {module for module, _ in BENCH_SUITES.values()} | {"steady"}
    assert not set(units) & set(research.SUITES)


def test_the_installed_benchmark_code_is_small():
    """The benchmark code users install: the suites they run against their own deployment."""
    lines = sum(len(p.read_text().splitlines()) for p in PACKAGE_DIR.rglob("*.py"))
    assert lines <= MAX_INSTALLED_LINES, lines


def test_no_suite_imports_another():
    units = suite_units()
    bad = {}
    for name, files in units.items():
        for path in files:
            others = imported_units(path) - {name, "lib"}
            if others:
                bad[str(path.relative_to(PACKAGE_DIR))] = sorted(others)
    assert not bad, bad
    for path in (PACKAGE_DIR / "lib").rglob("*.py"):
        assert imported_units(path) <= {"lib"}, path


def test_no_research_suite_imports_another():
    """The research suites share ``benchmarks.lib`` and the package's ``lib``; two extend a package
    suite: ``context_speed`` times ``context``'s rows, ``ledger_jsonl`` adds a backend to ``ledger``."""
    units = suite_units(RESEARCH_DIR)
    assert set(units) == set(research.SUITES)
    bad = {}
    for name, files in units.items():
        for path in files:
            others = (imported_units(path, "benchmarks") & set(units)) - {name}
            others |= imported_units(path) - {"lib", *EXTENDS.get(name, ())}
            if others:
                bad[str(path.relative_to(RESEARCH_DIR))] = sorted(others)
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(suite_units()))
def test_every_suite_has_add_cli_args_and_main(name):
    module = importlib.import_module(f"{PACKAGE}.{name}")
    parser = argparse.ArgumentParser(prog=name)
    assert module.add_cli_args(parser) is parser
    assert callable(module.main)


def test_usable_device_refuses_cuda_where_torch_sees_none(monkeypatch):
    assert measure.usable_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda:1 but torch sees no CUDA device"):
        measure.usable_device("cuda:1")
