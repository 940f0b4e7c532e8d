"""``python -m benchmarks.attention``: DP cross-attention (state, tree) against exact attention.

One run measures, side by side:

1. accuracy on in-regime synthetic data (the paper's setting: beta = 1/d, K, Q ~ U[0,1]^d,
   V rows ``clip(mu + 0.5 U[-1,1]^dv, -1, 1)`` with one ``mu ~ U[-1,1]^dv`` per head, so outputs
   have a non-trivial norm), split into error sources E0..E4 against exact SDPA in float64;
2. real heads of a small public BERT encoder (``attention.real_heads``);
3. speed and memory of build and query against exact SDPA.

Writes ``attention-<device>-<date>.md`` (+ ``.json``, ``-accuracy.csv``, ``-sources.csv``,
``-speed.csv``, ``-real-heads.csv``, ``-error-vs-n.png``, ``-error-vs-eps.png``) into ``--out``
(``<device>``: ``cpu`` or ``gpu-<family>``). Peak memory of a build is
``benchmarks.lib.measure.PeakMemory``: the CUDA allocator's peak, or on CPU the kernel's
resident-set high-water mark, both above the level at the start of the build.

Error sources (each consecutive pair isolates one distortion: clipping, kernel, own-leaf bias,
DP noise), all float64:
* E0 exact attention on the raw inputs;  E1 exact attention on the mapped (centred/clipped) inputs;
* E2 noise-free kernel attention ``P(Q) P(K)^T [V | 1]`` divided (``P`` = the release's public
  feature map ``att.features``);  E3 the tree mode with zero node noise (own-leaf bias);
* E4 the DP output (denominator clamped into [n e^{t_min}, n e^T] and outputs into
  [-R_w, R_w], as served).

The suite is a package: ``settings`` (what a run measures, its options), ``experiments`` (the
measurements), ``real_heads`` (part 2), ``report`` (targets, notes, markdown/JSON/CSV/PNG) and
here the driver, ``add_cli_args`` and ``main``. Run it as ``python -m benchmarks.attention`` or
``python -m benchmarks.attention``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks import with_example
from benchmarks.attention.experiments import run_accuracy, run_probe, run_speed
from benchmarks.attention.report import (
    default_notes,
    load_results,
    target_line,
    targets,
    write_results,
)
from benchmarks.attention.settings import (
    Settings,
    TreePlan,
    add_cli_args,
    settings_from_args,
)
from benchmarks.lib.measure import usable_device
from vllm_dp_plugin.benchmarks.lib.cli import parse, today
from vllm_dp_plugin.benchmarks.lib.environment import environment
from vllm_dp_plugin.benchmarks.lib.progress import Progress

__all__ = ["add_cli_args", "build_parser", "main", "run"]


def run(settings: Settings) -> dict:
    """Run the selected parts and write every result file; returns the results dict."""
    start = time.perf_counter()
    settings.date = today(settings.date)
    usable_device(settings.device)
    progress = Progress(settings.progress)
    results: dict = {"machine": environment(settings.device), "notes": []}
    results["settings"] = {k: (str(v) if isinstance(v, Path | TreePlan) else v) for k, v in asdict(settings).items()}
    results["settings"]["tree_plan"] = settings.tree_plan.kind
    cache: dict = {}
    if "accuracy" in settings.parts:
        results["accuracy"] = run_accuracy(settings, progress, cache)
        results["accuracy"]["probe"] = run_probe(settings, progress)
    if "real" in settings.parts:
        # imported here: `python -m ...attention.real_heads` runs this package's __init__ first
        from benchmarks.attention import real_heads

        results["real"] = real_heads.run(settings, progress)
    if "speed" in settings.parts:
        results["speed"] = run_speed(settings, progress, cache)
    results["targets"] = targets(results)
    results["runtime_s"] = time.perf_counter() - start
    results["notes"] = default_notes(results, settings)
    write_results(results, settings)
    return results


@with_example
def build_parser(prog: str = "python -m benchmarks.attention") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog,
        description="DP cross-attention (state, tree) vs exact attention: accuracy on synthetic "
        "in-regime data, real BERT heads, speed and memory. Writes markdown/JSON/CSV/PNG results.",
    ))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``python -m benchmarks.attention ...``)."""
    args, argv = parse(args, build_parser)
    if args.render:
        results, settings = load_results(args.render)
        write_results(results, settings)
    else:
        results = run(settings_from_args(args, argv))
    print()
    for t in results["targets"]:
        print(target_line(t))
    print(f"runtime {results['runtime_s'] / 60:.1f} min; results:")
    for path in results["files"]:
        print(f"  {path}")
    return 0
