"""The soak: moderate load for a fixed time, the server's memory and the latency sampled every
``interval_s`` seconds, and their least-squares trends (MiB/min, ms/min).

Memory: the resident set (RSS) of the API server (the process ``vllm-dp serve`` started) and of
the engine (its descendant processes: vLLM's engine core and worker, summed), read with psutil. Latency: the median
of the requests completed in full during the interval."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.report import pyplot, save_figure
from vllm_dp_plugin.benchmarks.load import client
from vllm_dp_plugin.benchmarks.load.stats import histogram, percentile, slope

MIB = float(1 << 20)


@dataclass(frozen=True)
class Sample:
    """One interval: its end (minutes since the soak began), the two processes' RSS (MiB), the
    median latency (ms, None if nothing completed) and how many requests ended in it."""

    minute: float
    api_rss_mib: float
    engine_rss_mib: float
    p50_ms: float | None
    completed: int
    ended: int


class ServerProcesses:
    """The API server's process (``pid``) and the engine: its descendants when first asked
    (vLLM's engine core and its worker), their RSS summed."""

    def __init__(self, pid: int):
        import psutil

        self.api = psutil.Process(pid)
        self.engine = self.api.children(recursive=True)

    def rss_mib(self) -> tuple[float, float]:
        return self.api.memory_info().rss / MIB, sum(p.memory_info().rss for p in self.engine) / MIB

    def names(self) -> dict:
        return {"api": " ".join(self.api.cmdline()[:4]), "engine": ", ".join(p.name() for p in self.engine)}


def trend(samples: Sequence[Sample], field: str) -> float | None:
    """The least-squares slope of ``field`` per minute over the samples that have it (None for
    fewer than two)."""
    points = [(s.minute, getattr(s, field)) for s in samples if getattr(s, field) is not None]
    if len(points) < 2:
        return None
    return slope([p[0] for p in points], [p[1] for p in points])[0]


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
    window: list[client.Outcome] = []
    samples: list[Sample] = []

    async def sampler() -> None:
        while time.perf_counter() < deadline:
            await asyncio.sleep(min(interval_s, max(deadline - time.perf_counter(), 0.0)))
            done, window[:] = list(window), []
            latencies = [o.latency_s * 1e3 for o in done if o.completed]
            api, engine = processes.rss_mib()
            samples.append(Sample((time.perf_counter() - start) / 60.0, api, engine, percentile(latencies, 50),
                                  len(latencies), len(done)))

    task = asyncio.create_task(sampler())
    outcomes = await client.run(base, client.endless(cancel_fraction, seed), model, max_tokens, concurrency,
                                deadline=deadline, on_done=window.append)
    await task
    return samples, {"requests": len(outcomes), "status": histogram("disconnected" if o.status is None else o.status
                                                                for o in outcomes),
                     "cancelled": sum(o.cancelled for o in outcomes)}


def summary(samples: Sequence[Sample], minutes: float, tolerance: float) -> dict:
    """Trends (per minute) of both RSS and the latency, and whether each is flat: it moves less
    than ``tolerance`` of its median level over the soak."""
    out = {}
    for field in ("api_rss_mib", "engine_rss_mib", "p50_ms"):
        values = [getattr(s, field) for s in samples if getattr(s, field) is not None]
        per_minute = trend(samples, field)
        level = percentile(values, 50) if values else None
        out[field] = {"per_minute": per_minute, "median": level, "first": values[0] if values else None,
                      "last": values[-1] if values else None,
                      "flat": is_flat(per_minute, level or 0.0, minutes, tolerance)}
    return out


def plot(samples: Sequence[Sample], title: str, path: Path) -> Path:
    """RSS (both processes) and median latency against time, each with its fitted line."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    minutes = [s.minute for s in samples]
    panels = ((axes[0], ("api_rss_mib", "engine_rss_mib"), "RSS (MiB)"), (axes[1], ("p50_ms",), "median latency (ms)"))
    for ax, fields, label in panels:
        for field in fields:
            points = [(s.minute, getattr(s, field)) for s in samples if getattr(s, field) is not None]
            if not points:
                continue
            line = ax.plot(*zip(*points, strict=True), marker=".", label=field)[0]
            if len(points) >= 2:
                b, a = slope([p[0] for p in points], [p[1] for p in points])
                ax.plot([minutes[0], minutes[-1]], [a + b * minutes[0], a + b * minutes[-1]], "--",
                        color=line.get_color(), label=f"fit {b:+.3g}/min")
        ax.set_xlabel("minutes")
        ax.set_ylabel(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def samples_json(samples: Sequence[Sample]) -> list[dict]:
    return [asdict(s) for s in samples]
