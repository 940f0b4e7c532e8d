"""Time and peak memory, measured one way in every suite.

Time: ``time.perf_counter`` around a call, the device synchronised before and after it (CUDA
kernels run asynchronously), with torch's thread count as is (``torch.utils.benchmark.Timer``
would pin one thread). ``timed`` times one call, ``timed_calls`` repeats one until a time budget
is spent; warm-up calls are the caller's (suites warm up differently: full size, a smaller
input, or none).

Peak memory (``PeakMemory``): the most the block allocated above what was in use when it
started, in bytes.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
  ``memory_allocated`` at the start: tensors of the caching allocator, exact.
* CPU (Linux): the process's resident-set high-water mark ``VmHWM``, reset to the current
  resident set through ``/proc/self/clear_refs`` at the start (after ``malloc_trim``, which hands
  freed heap back to the OS, so that reusing it counts as growth), minus the resident set at the
  start. The kernel keeps the high-water mark, so no peak between samples is missed and no
  sampling thread competes with the measured code for the cores (torch's CPU allocations are
  invisible to ``tracemalloc``). Without ``clear_refs``: ``ru_maxrss``, which cannot be reset
  (an upper bound that may include earlier peaks); ``measure`` says which. Elsewhere: 0.

The CPU figure covers the whole process (every thread) and one ``PeakMemory`` at a time: an
inner one resets the outer one's high-water mark.
"""

from __future__ import annotations

import re
import resource
import statistics
import time
from collections.abc import Callable
from typing import Self

import torch

VMHWM = "VmHWM (reset)"
RU_MAXRSS = "ru_maxrss (no reset: an upper bound, set-up peaks included)"
UNAVAILABLE = "unavailable (no /proc): 0"
CUDA = "cuda max_memory_allocated"


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: str | torch.device) -> tuple[float, object]:
    """(seconds, result) of one call of ``fn``, the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def time_once(fn: Callable[[], object], device: str | torch.device) -> float:
    """Seconds of one synchronised call of ``fn``."""
    return timed(fn, device)[0]


def timed_calls(
    fn: Callable[[], object],
    device: str | torch.device,
    *,
    min_time: float,
    min_calls: int = 1,
    max_calls: int = 10_000,
) -> tuple[list[float], object]:
    """(seconds of every call, last result): synchronised calls of ``fn`` until they took
    ``min_time`` seconds together and at least ``min_calls`` ran, at most ``max_calls``."""
    times: list[float] = []
    result = None
    while len(times) < max_calls and (sum(times) < min_time or len(times) < min_calls):
        seconds, result = timed(fn, device)
        times.append(seconds)
    return times, result


def median_time(
    fn: Callable[[], object],
    device: str | torch.device,
    min_time: float,
    *,
    warmup: int = 2,
    min_calls: int = 5,
    max_calls: int = 10_000,
) -> float:
    """Median seconds per call after ``warmup`` untimed calls (``timed_calls`` for the rest)."""
    for _ in range(warmup):
        fn()
    times, _ = timed_calls(fn, device, min_time=min_time, min_calls=min_calls, max_calls=max_calls)
    return statistics.median(times)


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_bytes(key: str) -> int | None:
    """``key`` (``VmRSS``, ``VmHWM``) of ``/proc/self/status`` in bytes; None without it."""
    try:
        with open("/proc/self/status") as fh:
            match = re.search(rf"^{key}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class PeakMemory:
    """Peak bytes allocated above the start while the block runs (see the module docstring).

    ``with PeakMemory(device) as mem: ...`` then ``mem.peak``; or ``start()`` / ``stop()``.
    ``measure`` names the method used."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.peak = 0
        self.measure = CUDA if self.device.type == "cuda" else UNAVAILABLE
        self._base = 0

    def start(self) -> Self:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        _malloc_trim()
        base = _status_bytes("VmRSS")
        if base is None:
            self.measure = UNAVAILABLE
            return self
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # resets VmHWM to the current VmRSS
            self.measure = VMHWM
        except OSError:
            self.measure = RU_MAXRSS
        self._base = _status_bytes("VmRSS") or base
        return self

    def stop(self) -> int:
        """Sets and returns ``peak``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self.measure == VMHWM:
            self.peak = max((_status_bytes("VmHWM") or 0) - self._base, 0)
        elif self.measure == RU_MAXRSS:
            self.peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._base, 0)
        else:
            self.peak = 0
        return self.peak

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_bytes(device) -> int:
    """Free memory of ``device`` in bytes: CUDA free device memory, else the host's
    ``MemAvailable`` (2^62 where unknown)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def usable_device(name: str):
    """``torch.device(name)``; SystemExit when it is a CUDA device and torch sees none."""
    import torch

    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name} but torch sees no CUDA device")
    return device
