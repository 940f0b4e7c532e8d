"""The soak: moderate load for a fixed time, the server's memory and the latency sampled every
``interval_s`` seconds, and their least-squares trends (MiB/min, ms/min) over the whole soak and
over its parts (``WINDOWS``), so that a warm-up that settles is told from a leak that keeps its slope.

Memory (psutil): the RSS of the API server (the process ``vllm-dp serve`` started) and of the
engine (its descendants: vLLM's engine core and worker; summed, and each on its own), and their
anonymous parts (``RssAnon``: heap and tensors, where a leak grows; the rest is mapped files and
shared memory). Latency: the median of the requests completed in full during the interval."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.report import pyplot, save_figure
from vllm_dp_plugin.benchmarks.load import client

MIB = float(1 << 20)
# The parts of a soak its trends are also fitted over, as fractions of its length: a warm-up
# shows a first half steeper than the second, a leak the same slope in every part.
WINDOWS = {"all": (0.0, 1.0), "first_half": (0.0, 0.5), "second_half": (0.5, 1.0), "last_third": (2 / 3, 1.0)}
MEMORY = ("api_rss_mib", "engine_rss_mib", "api_anon_mib", "engine_anon_mib")  # a Sample's, in MiB
Points = list[tuple[float, float]]


@dataclass(frozen=True)
class Sample:
    """One interval: its end (minutes since the soak began), both RSS (MiB), the median latency (ms,
    None if nothing completed), the requests completed and ended in it, and (None where not read)
    each RSS's anonymous part and each engine process's RSS (``"name pid"`` -> MiB)."""

    minute: float
    api_rss_mib: float
    engine_rss_mib: float
    p50_ms: float | None
    completed: int
    ended: int
    api_anon_mib: float | None = None
    engine_anon_mib: float | None = None
    engine_parts: dict | None = None


def anon_mib(pid: int) -> float | None:
    """``RssAnon`` of ``/proc/<pid>/status`` in MiB (None where there is none: not Linux)."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("RssAnon:"))
        return int(line.split()[1]) / 1024.0
    except (OSError, StopIteration, ValueError, IndexError):
        return None


class ServerProcesses:
    """The API server's process (``pid``) and the engine: its descendants when first asked."""

    def __init__(self, pid: int):
        import psutil

        self.api = psutil.Process(pid)
        self.engine = self.api.children(recursive=True)

    def memory(self) -> dict:
        """A ``Sample``'s memory fields (an anonymous part None when any of its processes has none)."""
        parts = {f"{p.name()} {p.pid}": p.memory_info().rss / MIB for p in self.engine}
        anon = [anon_mib(p.pid) for p in self.engine]
        return {"api_rss_mib": self.api.memory_info().rss / MIB, "engine_rss_mib": sum(parts.values()),
                "api_anon_mib": anon_mib(self.api.pid), "engine_anon_mib": None if None in anon else sum(anon),
                "engine_parts": parts}

    def names(self) -> dict:
        return {"api": " ".join(self.api.cmdline()[:4]), "engine": ", ".join(p.name() for p in self.engine)}


def points(samples: Sequence[Sample], field: str) -> Points:
    """(minute, value) of the samples that have ``field`` (``"engine_parts:<name>"``: that process's RSS)."""
    if field.startswith("engine_parts:"):
        values = [(s.engine_parts or {}).get(field.split(":", 1)[1]) for s in samples]
    else:
        values = [getattr(s, field) for s in samples]
    return [(s.minute, v) for s, v in zip(samples, values, strict=True) if v is not None]


def fit(pts: Points) -> tuple[float, float] | None:
    """(slope per minute, intercept) of the least-squares line (None: fewer than two distinct minutes)."""
    if len({m for m, _ in pts}) < 2:
        return None
    return tuple(statistics.linear_regression([m for m, _ in pts], [v for _, v in pts]))


def trend(pts: Points) -> float | None:
    """The least-squares slope per minute (None: fewer than two distinct minutes)."""
    line = fit(pts)
    return None if line is None else line[0]


def in_window(pts: Points, minutes: float, part: tuple[float, float]) -> Points:
    """The points whose minute falls in ``part`` (fractions of ``minutes``, both ends kept)."""
    return [p for p in pts if part[0] * minutes - 1e-9 <= p[0] <= part[1] * minutes + 1e-9]


def is_flat(per_minute: float | None, level: float | None, minutes: float, tolerance: float) -> bool | None:
    """Whether the trend moves its quantity by less than ``tolerance`` of ``level`` over the soak."""
    if per_minute is None or not level:
        return None
    return abs(per_minute * minutes) < tolerance * abs(level)


def _part(pts: Points, level: float | None, minutes: float, tolerance: float) -> dict:
    """A part's slope, its first and last minute, the change between them, and the verdict."""
    slope, (first, last) = trend(pts), (pts[0], pts[-1]) if pts else ((None, None), (None, None))
    return {"per_minute": slope, "from_minute": first[0], "to_minute": last[0],
            "change": last[1] - first[1] if pts else None, "flat": is_flat(slope, level, minutes, tolerance)}


def summary(samples: Sequence[Sample], minutes: float, tolerance: float) -> dict:
    """Per quantity (both RSS, their anonymous parts, each engine process's RSS, the latency): its
    first, last and median value, slope per minute and whether it is flat (the slope, held over the
    soak, moves it by less than ``tolerance`` of its median); the same per part (``WINDOWS``)."""
    out = {}
    for field in [*MEMORY, "p50_ms", *(f"engine_parts:{name}" for name in part_names(samples))]:
        pts = points(samples, field)
        if not pts and field.endswith("_anon_mib"):
            continue  # not read (not Linux)
        slope, level = trend(pts), client.percentile([v for _, v in pts], 50)
        out[field] = {"per_minute": slope, "median": level, "first": pts[0][1] if pts else None,
                      "last": pts[-1][1] if pts else None, "flat": is_flat(slope, level, minutes, tolerance),
                      "windows": {name: _part(in_window(pts, minutes, part), level, minutes, tolerance)
                                  for name, part in WINDOWS.items()}}
    return out


async def soak(base: str, processes: ServerProcesses, model: str, max_tokens: int, concurrency: int,
               minutes: float, interval_s: float, cancel_fraction: float, seed: int = 0) -> tuple[list[Sample], dict]:
    """Load ``base`` with ``concurrency`` clients for ``minutes``; (samples, request counts)."""
    start = time.perf_counter()
    deadline = start + minutes * 60.0
    ended: list[client.Outcome] = []
    samples: list[Sample] = []

    async def sampler() -> None:
        while time.perf_counter() < deadline:
            await asyncio.sleep(min(interval_s, max(deadline - time.perf_counter(), 0.0)))
            done, ended[:] = list(ended), []
            latencies = [o.latency_s * 1e3 for o in done if o.completed]
            samples.append(Sample((time.perf_counter() - start) / 60.0, p50_ms=client.percentile(latencies, 50),
                                  completed=len(latencies), ended=len(done), **processes.memory()))

    task = asyncio.create_task(sampler())
    outcomes = await client.run(base, client.endless(cancel_fraction, seed), model, max_tokens, concurrency,
                                deadline=deadline, on_done=ended.append)
    await task
    return samples, {"requests": len(outcomes), "status": client.statuses(outcomes),
                     "cancelled": sum(o.cancelled for o in outcomes)}


def part_names(samples: Sequence[Sample]) -> list[str]:
    """The engine processes the samples name (``"name pid"``), in the order first seen."""
    return list(dict.fromkeys(name for s in samples for name in (s.engine_parts or {})))


def per_minute(samples: Sequence[Sample]) -> list[dict]:
    """One row per whole minute: the memory of the last sample by its end, and the requests answered
    in full and ended in it."""
    rows = []
    for minute in range(1, math.floor(max((s.minute for s in samples), default=0.0) + 1e-6) + 1):
        inside = [s for s in samples if minute - 1 < s.minute <= minute + 1e-6]
        last = [s for s in samples if s.minute <= minute + 1e-6]
        if last:
            rows.append({"minute": minute, **{k: getattr(last[-1], k) for k in (*MEMORY, "engine_parts")},
                         "completed": sum(x.completed for x in inside), "ended": sum(x.ended for x in inside)})
    return rows


def _plot_fit(ax, pts: Points, color, style: str, label: str) -> None:
    """The least-squares line through ``pts`` over their own span."""
    line = fit(pts)
    if line is not None:
        (b, a), x0, x1 = line, pts[0][0], pts[-1][0]
        ax.plot([x0, x1], [a + b * x0, a + b * x1], style, color=color, label=f"{label} {b:+.3g}/min")


def plot(samples: Sequence[Sample], title: str, path: Path, minutes: float) -> Path:
    """Both RSS and the median latency against time, fitted over the whole soak (dashed) and its
    second half (dotted); each process's RSS change since its first sample."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, fields in zip(axes, (("api_rss_mib", "engine_rss_mib"), ("p50_ms",)), strict=False):
        for field in fields:
            if pts := points(samples, field):
                line = ax.plot(*zip(*pts, strict=True), marker=".", markersize=3, label=field)[0]
                _plot_fit(ax, pts, line.get_color(), "--", "fit, all")
                _plot_fit(ax, in_window(pts, minutes, WINDOWS["second_half"]), line.get_color(), ":", "fit, 2nd half")
    for field in ("api_rss_mib", *(f"engine_parts:{name}" for name in part_names(samples))):
        if pts := points(samples, field):
            axes[2].plot([m for m, _ in pts], [v - pts[0][1] for _, v in pts], label=field.split(":")[-1])
    for ax, label in zip(axes, ("RSS (MiB)", "median latency (ms)", "RSS change since the first sample (MiB)"),
                         strict=True):
        ax.set_xlabel("minutes")
        ax.set_ylabel(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
