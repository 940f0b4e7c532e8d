"""Where a benchmark ran: the device label of result file names and the machine description.

``device_label(device)`` is the one label: ``cpu-<cores>core`` (the cores this process may run
on) or the GPU's name in lower case with dashes (``nvidia-h100-80gb-hbm3``); ``short=True`` gives
the family tag instead, ``cpu`` or ``gpu-<model>`` (``gpu-h100``). ``environment(device)`` is
the one description stored with a result (its keys are listed there). torch is imported only
when a function needs it: client-side suites (serving benchmarks) run without it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

GIB = float(1 << 30)
GPU_FAMILIES = ("h200", "h100", "a100", "l40s", "l4", "a10", "b200", "gh200", "v100", "t4")


def _device(device):
    import torch

    return torch.device(device)


def cpu_cores() -> int:
    """Logical cores this process may run on (its affinity; all cores where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        if names:
            return names[0]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_gib() -> float | None:
    """Total memory of the host in GiB (``/proc/meminfo``), None where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            kb = int(next(line for line in fh if line.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None
    return round(kb / 2**20, 1)


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages of the host (other processes compete for the CPU)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _dashed(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def device_label(device, *, short: bool = False) -> str:
    """``cpu-<cores>core`` or the GPU's dashed lower-case name (``nvidia-h200``); ``short``:
    ``cpu`` or ``gpu-<family>`` (``gpu-h100``; the dashed name, cut to 24 characters, for an
    unknown family)."""
    device = _device(device)
    if device.type != "cuda":
        return "cpu" if short else f"cpu-{cpu_cores()}core"
    import torch

    name = _dashed(torch.cuda.get_device_name(device))
    if not short:
        return name
    family = next((key for key in GPU_FAMILIES if key in name), None)
    return f"gpu-{family}" if family else f"gpu-{name[:24].strip('-')}"


def default_device() -> str:
    """``cuda`` when torch sees a CUDA device, else ``cpu``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def environment(device, packages: tuple[str, ...] = ("triton",)) -> dict:
    """The machine and software a result was measured on.

    Keys: ``device`` (as given), ``label`` (``device_label``), ``platform``, ``python``,
    ``torch``, ``torch_threads`` (intra-op threads), ``cpu`` (model), ``cpu_count`` (cores this
    process may use), ``ram_gib``, one key per name in ``packages`` (its version or "not
    installed"); on CUDA also ``gpu``, ``gpu_memory_gib``, ``cuda``, ``tf32_matmul``."""
    import torch

    dev = _device(device)
    info = {
        "device": str(device),
        "label": device_label(dev),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_count": cpu_cores(),
    }
    ram = ram_gib()
    if ram is not None:
        info["ram_gib"] = ram
    for name in packages:
        info[name] = package_version(name)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / GIB, 1)
        info["cuda"] = torch.version.cuda
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return info
