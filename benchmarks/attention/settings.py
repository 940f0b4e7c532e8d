"""What one ``python -m benchmarks.attention`` run measures: sizes, epsilons, tree plan, and the
command-line options that set them."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import (
    DEFAULT_OUT,
    add_date_arg,
    add_device_arg,
    add_out_arg,
    add_quick_arg,
    command_line,
    floats,
    ints,
)

GIB = float(1 << 30)
MODES = ("state", "tree")
PARTS = ("accuracy", "real", "speed")
BUILD_CHUNK = 4096  # rows per DPCrossAttention.add call (chunked prefill)
STATE_TARGET = {"n": 32768, "d": 64, "eps": 1.0, "max_median_rel": 0.1}
SPEED_TARGETS = {"state_query_speedup": 5.0, "state_ns": (16384, 32768), "tree_build_ratio": 3.0, "tree_n": 16384}
EXACT_PASS = (
    "one exact attention pass = SDPA prefill of the n-token private context over itself "
    "(n queries x n keys, 1 head, float32, same device)"
)


@dataclass
class TreePlan:
    """Which (eps, seeds) the tree mode runs at each (d, n): its CPU build is dominated by
    truncated-Laplace sampling of ~6 r (d+1) n node noises, so the default thins large sizes."""

    kind: str = "default"  # default | full | none

    def runs(self, d: int, n: int, epsilons: Sequence[float], seeds: int) -> tuple[list[float], int]:
        if self.kind == "none":
            return [], 0
        if self.kind == "full":
            return list(epsilons), seeds
        eps = list(epsilons)
        pick = [e for e in eps if e in (1.0, 16.0)] or eps[:1]
        if d > 64:
            return (pick, 1) if n <= 1024 else ([], 0)
        if n <= 1024:
            return eps, seeds
        if n <= 4096:
            return eps, 1
        if n <= 16384:
            return pick, 1
        return [e for e in pick if e == 1.0] or pick[:1], 1

    def describe(self) -> str:
        if self.kind == "full":
            return "tree: every eps and seed wherever the table fits the memory cap"
        if self.kind == "none":
            return "tree: not run (--tree-plan none)"
        return (
            "tree (CPU time budget, --tree-plan default): d<=64: all eps x all seeds at n<=1k, "
            "all eps x 1 seed at n<=4k, eps in {1,16} x 1 seed at n<=16k, eps=1 x 1 seed above; "
            "d>64: eps in {1,16} x 1 seed at n<=1k only (others 'skipped: time'). "
            "Use --tree-plan full for everything"
        )


@dataclass
class Settings:
    device: str = "cpu"
    out: Path = DEFAULT_OUT
    seeds: int = 3
    ns: tuple[int, ...] = (1024, 4096, 16384, 32768)
    ds: tuple[int, ...] = (64, 128)
    epsilons: tuple[float, ...] = (0.5, 1.0, 4.0, 16.0)
    m: int = 256
    delta: float = 1e-6
    tree_degree: int = 1
    tree_plan: TreePlan = field(default_factory=TreePlan)
    memory_cap_gib: float = 2.0
    speed_ns: tuple[int, ...] = (1024, 4096, 16384, 32768)
    speed_d: int = 64
    speed_min_time: float = 1.0
    probe_d: int = 8
    probe_seeds: int = 12
    probe_m: int = 64
    parts: tuple[str, ...] = PARTS
    quick: bool = False
    progress: bool = True
    date: str = ""
    command: str = ""
    real: dict = field(default_factory=dict)

    @staticmethod
    def quick_defaults() -> dict:
        return {
            "seeds": 2,
            "ns": (512, 2048),
            "ds": (16,),
            "epsilons": (1.0, 16.0),
            "m": 32,
            "speed_ns": (512, 2048),
            "speed_d": 16,
            "speed_min_time": 0.05,
            "probe_d": 4,
            "probe_seeds": 3,
            "probe_m": 16,
            "tree_plan": TreePlan("full"),
        }

    @property
    def memory_cap(self) -> int:
        return int(self.memory_cap_gib * GIB)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    add_quick_arg(p, "toy sizes for tests (< 60 s on 2 CPU cores)")
    add_device_arg(p)
    add_out_arg(p)
    p.add_argument("--seeds", type=int, help="noise seeds per configuration (default 3; quick 2)")
    p.add_argument("--n", dest="ns", type=ints, help="context lengths, comma separated (default 1024,4096,16384,32768)")
    p.add_argument("--d", dest="ds", type=ints, help="head dims for the accuracy part (default 64,128)")
    p.add_argument("--eps", dest="epsilons", type=floats, help="epsilons per head (default 0.5,1,4,16)")
    p.add_argument("--m", type=int, help="query tokens (default 256)")
    p.add_argument("--delta", type=float, help="delta per head (default 1e-6)")
    p.add_argument("--speed-n", dest="speed_ns", type=ints, help="context lengths of the speed part")
    p.add_argument("--tree-degree", type=int, help="Taylor degree of the tree mode (default 1)")
    p.add_argument("--tree-plan", choices=("default", "full", "none"), help="tree runs (default: thinned on CPU, full on CUDA)")
    p.add_argument("--memory-cap-gib", type=float, help="skip tree configs whose table exceeds this (default 2 on CPU, 64 on CUDA)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of accuracy,real,speed")
    p.add_argument("--real-n", type=int, help="real heads: private context tokens (default 4096; quick 512)")
    p.add_argument("--real-tree-n", type=int, help="real heads: context tokens of the tree run (default 512)")
    p.add_argument("--real-layers", type=ints, help="real heads: layer indices (default all 6)")
    add_date_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--render", type=Path, metavar="JSON", help="only re-render the markdown/CSV/plots of a saved results JSON")
    return p


def settings_from_args(args: argparse.Namespace, argv: Sequence[str] | None) -> Settings:
    base = Settings.quick_defaults() if args.quick else {}
    cuda = str(args.device).startswith("cuda")
    if cuda and not args.quick:
        base["tree_plan"] = TreePlan("full")
    base["memory_cap_gib"] = 64.0 if cuda else (1.0 if args.quick else 2.0)
    for key in ("seeds", "ns", "ds", "epsilons", "m", "delta", "speed_ns", "tree_degree", "memory_cap_gib"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    if args.tree_plan:
        base["tree_plan"] = TreePlan(args.tree_plan)
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown --parts {sorted(unknown)}")
    real = {}
    for key in ("real_n", "real_tree_n", "real_layers"):
        if getattr(args, key) is not None:
            real[key.removeprefix("real_")] = getattr(args, key)
    return Settings(
        device=args.device,
        out=args.out,
        parts=parts,
        quick=args.quick,
        progress=not args.no_progress,
        date=args.date,
        command=command_line("python -m benchmarks.attention", argv),
        real=real,
        **base,
    )
