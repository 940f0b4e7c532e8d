"""The soak: moderate load for a fixed time, the server's memory and the latency sampled every
``interval_s`` seconds, and their least-squares trends (MiB/min, ms/min), over the whole soak and
over its parts (``WINDOWS``: first half, second half, last third), so that a warm-up that
settles is told from a leak that keeps its slope.

Memory: the resident set (RSS) of the API server (the process ``vllm-dp serve`` started) and of
the engine (its descendant processes: vLLM's engine core and worker, summed), read with psutil,
with each one's anonymous part (``RssAnon`` of ``/proc/<pid>/status``: heap and tensors, where a
leak grows; the rest is mapped files and shared memory) and each engine process on its own.
Latency: the median of the requests completed in full during the interval."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.report import pyplot, save_figure
from vllm_dp_plugin.benchmarks.load import client
from vllm_dp_plugin.benchmarks.load.stats import histogram, percentile, slope

MIB = float(1 << 20)
# The parts of a soak its trends are also fitted over, as fractions of its length: a warm-up
# shows a first half steeper than the second, a leak the same slope in every part.
WINDOWS = {"all": (0.0, 1.0), "first_half": (0.0, 0.5), "second_half": (0.5, 1.0), "last_third": (2 / 3, 1.0)}
QUANTITIES = ("api_rss_mib", "engine_rss_mib", "api_anon_mib", "engine_anon_mib", "p50_ms")


@dataclass(frozen=True)
class Sample:
    """One interval: its end (minutes since the soak began), the two processes' RSS (MiB), the
    median latency (ms, None if nothing completed), how many requests ended in it, and (None
    where not read) the anonymous part of each RSS and the RSS of each engine process
    (``"name pid"`` -> MiB)."""

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
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


class ServerProcesses:
    """The API server's process (``pid``) and the engine: its descendants when first asked
    (vLLM's engine core and its worker), their RSS summed."""

    def __init__(self, pid: int):
        import psutil

        self.api = psutil.Process(pid)
        self.engine = self.api.children(recursive=True)

    def rss_mib(self) -> tuple[float, float]:
        return self.api.memory_info().rss / MIB, sum(p.memory_info().rss for p in self.engine) / MIB

    def memory(self) -> dict:
        """The fields of a ``Sample`` that describe memory: both RSS, their anonymous parts (None
        when any process has none) and each engine process's RSS."""
        api, parts = self.api.memory_info().rss / MIB, {f"{p.name()} {p.pid}": p.memory_info().rss / MIB
                                                       for p in self.engine}
        anon = [anon_mib(p.pid) for p in self.engine]
        return {"api_rss_mib": api, "engine_rss_mib": sum(parts.values()), "api_anon_mib": anon_mib(self.api.pid),
                "engine_anon_mib": None if None in anon else sum(anon), "engine_parts": parts}

    def names(self) -> dict:
        return {"api": " ".join(self.api.cmdline()[:4]), "engine": ", ".join(p.name() for p in self.engine)}


def _value(sample: Sample, field: str) -> float | None:
    """``field`` of a sample; ``"engine_parts:<name>"``: that engine process's RSS."""
    if field.startswith("engine_parts:"):
        return (sample.engine_parts or {}).get(field.split(":", 1)[1])
    return getattr(sample, field)


def trend(samples: Sequence[Sample], field: str) -> float | None:
    """The least-squares slope of ``field`` per minute over the samples that have it (None for
    fewer than two)."""
    points = [(s.minute, _value(s, field)) for s in samples if _value(s, field) is not None]
    if len(points) < 2 or len({p[0] for p in points}) < 2:
        return None
    return slope([p[0] for p in points], [p[1] for p in points])[0]


def window(samples: Sequence[Sample], minutes: float, part: tuple[float, float]) -> list[Sample]:
    """The samples whose minute falls in ``part`` (fractions of ``minutes``, both ends kept)."""
    low, high = part[0] * minutes, part[1] * minutes
    return [s for s in samples if low - 1e-9 <= s.minute <= high + 1e-9]


def windowed(samples: Sequence[Sample], field: str, minutes: float, tolerance: float) -> dict:
    """Per part of the soak (``WINDOWS``): the slope per minute, the change from the part's
    first sample to its last, and whether the slope is flat (``is_flat`` over the whole soak:
    would it move the quantity by less than ``tolerance`` of its median if it held throughout)."""
    values = [_value(s, field) for s in samples if _value(s, field) is not None]
    level = percentile(values, 50) if values else None
    out = {}
    for name, part in WINDOWS.items():
        mine = [s for s in window(samples, minutes, part) if _value(s, field) is not None]
        per_minute = trend(mine, field)
        out[name] = {"per_minute": per_minute, "from_minute": mine[0].minute if mine else None,
                     "to_minute": mine[-1].minute if mine else None,
                     "change": _value(mine[-1], field) - _value(mine[0], field) if mine else None,
                     "flat": is_flat(per_minute, level or 0.0, minutes, tolerance)}
    return out


def is_flat(per_minute: float | None, level: float, minutes: float, tolerance: float) -> bool | None:
    """Whether a trend moves its quantity by less than ``tolerance`` (a fraction) of ``level``
    over the whole soak."""
    if per_minute is None or not level:
        return None
    return abs(per_minute * minutes) < tolerance * abs(level)


async def soak(base: str, processes: ServerProcesses, model: str, max_tokens: int, concurrency: int,
               minutes: float, interval_s: float, cancel_fraction: float, seed: int = 0) -> tuple[list[Sample], dict]:
    """Load ``base`` with ``concurrency`` clients for ``minutes``; (samples, status histogram)."""
    start = time.perf_counter()
    deadline = start + minutes * 60.0
    ended: list[client.Outcome] = []
    samples: list[Sample] = []

    async def sampler() -> None:
        while time.perf_counter() < deadline:
            await asyncio.sleep(min(interval_s, max(deadline - time.perf_counter(), 0.0)))
            done, ended[:] = list(ended), []
            latencies = [o.latency_s * 1e3 for o in done if o.completed]
            memory = processes.memory()
            samples.append(Sample((time.perf_counter() - start) / 60.0, p50_ms=percentile(latencies, 50),
                                  completed=len(latencies), ended=len(done), **memory))

    task = asyncio.create_task(sampler())
    outcomes = await client.run(base, client.endless(cancel_fraction, seed), model, max_tokens, concurrency,
                                deadline=deadline, on_done=ended.append)
    await task
    return samples, {"requests": len(outcomes), "status": histogram("disconnected" if o.status is None else o.status
                                                                for o in outcomes),
                     "cancelled": sum(o.cancelled for o in outcomes)}


def part_names(samples: Sequence[Sample]) -> list[str]:
    """The engine processes the samples name (``"name pid"``), in the order first seen."""
    return list(dict.fromkeys(name for s in samples for name in (s.engine_parts or {})))


def summary(samples: Sequence[Sample], minutes: float, tolerance: float) -> dict:
    """Trends (per minute) of both RSS, their anonymous parts, each engine process's RSS and the
    latency, and whether each is flat: it moves less than ``tolerance`` of its median level over
    the soak; with the same per part of the soak (``windowed``)."""
    out = {}
    fields = [*QUANTITIES, *(f"engine_parts:{name}" for name in part_names(samples))]
    for field in fields:
        values = [_value(s, field) for s in samples if _value(s, field) is not None]
        if not values and field not in ("api_rss_mib", "engine_rss_mib", "p50_ms"):
            continue  # a part not read (an older sample, or not Linux)
        per_minute = trend(samples, field)
        level = percentile(values, 50) if values else None
        out[field] = {"per_minute": per_minute, "median": level, "first": values[0] if values else None,
                      "last": values[-1] if values else None,
                      "flat": is_flat(per_minute, level or 0.0, minutes, tolerance),
                      "windows": windowed(samples, field, minutes, tolerance)}
    return out


def per_minute(samples: Sequence[Sample]) -> list[dict]:
    """One row per whole minute of the soak: the last sample at or before the minute's end
    (both RSS, their anonymous parts, the engine processes) and the requests answered in full
    and ended in that minute."""
    rows = []
    for minute in range(1, math.floor(max((s.minute for s in samples), default=0.0) + 1e-6) + 1):
        inside = [s for s in samples if minute - 1 < s.minute <= minute + 1e-6]
        last = [s for s in samples if s.minute <= minute + 1e-6]
        if not last:
            continue
        s = last[-1]
        rows.append({"minute": minute, "api_rss_mib": s.api_rss_mib, "engine_rss_mib": s.engine_rss_mib,
                     "api_anon_mib": s.api_anon_mib, "engine_anon_mib": s.engine_anon_mib,
                     "engine_parts": s.engine_parts, "completed": sum(x.completed for x in inside),
                     "ended": sum(x.ended for x in inside)})
    return rows


def _fit(ax, points: list[tuple[float, float]], color, style: str, label: str) -> None:
    """The least-squares line through ``points`` over their own span."""
    if len({p[0] for p in points}) < 2:
        return
    b, a = slope([p[0] for p in points], [p[1] for p in points])
    x0, x1 = points[0][0], points[-1][0]
    ax.plot([x0, x1], [a + b * x0, a + b * x1], style, color=color, label=f"{label} {b:+.3g}/min")


def plot(samples: Sequence[Sample], title: str, path: Path, minutes: float | None = None) -> Path:
    """RSS (both processes) and median latency against time, each with its line fitted over the
    whole soak (dashed) and over its second half (dotted); a third panel: each process's RSS
    change since its first sample (the API server, each engine process)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    total = minutes if minutes is not None else max((s.minute for s in samples), default=0.0)
    second = window(samples, total, WINDOWS["second_half"])
    panels = ((axes[0], ("api_rss_mib", "engine_rss_mib"), "RSS (MiB)"), (axes[1], ("p50_ms",), "median latency (ms)"))
    for ax, fields, label in panels:
        for field in fields:
            points = [(s.minute, _value(s, field)) for s in samples if _value(s, field) is not None]
            if not points:
                continue
            line = ax.plot(*zip(*points, strict=True), marker=".", markersize=3, label=field)[0]
            _fit(ax, points, line.get_color(), "--", "fit, all")
            _fit(ax, [(s.minute, _value(s, field)) for s in second if _value(s, field) is not None],
                 line.get_color(), ":", "fit, 2nd half")
        ax.set_xlabel("minutes")
        ax.set_ylabel(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for field in ("api_rss_mib", *(f"engine_parts:{name}" for name in part_names(samples))):
        points = [(s.minute, _value(s, field)) for s in samples if _value(s, field) is not None]
        if points:
            axes[2].plot([p[0] for p in points], [p[1] - points[0][1] for p in points], label=field.split(":")[-1])
    axes[2].set_xlabel("minutes")
    axes[2].set_ylabel("RSS change since the first sample (MiB)")
    if axes[2].get_legend_handles_labels()[0]:
        axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def samples_json(samples: Sequence[Sample]) -> list[dict]:
    return [asdict(s) for s in samples]
