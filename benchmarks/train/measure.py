"""Measuring one method of ``python -m benchmarks.train``: step time and peak memory (``measure_method``), each
method in its own forkserver process (``run_isolated``)."""

from __future__ import annotations

import multiprocessing
import statistics

import torch

from benchmarks.lib.measure import PeakMemory, timed
from benchmarks.train.methods import METHODS, _error_text
from benchmarks.train.spec import (
    BenchSpec,
    make_model,
    synthetic_batch,
    unique_parameter_count,
)


def measure_method(name: str, spec: BenchSpec) -> dict:
    """Build the model and method ``name``, run ``spec.warmup`` + ``spec.steps`` steps and return
    ``{"status": "ok", "step_s", "times_s", "peak_bytes", ...}``, or ``{"status": reason}`` for a
    method that is skipped or raises (the error text is kept, not hidden)."""
    method, device = METHODS[name], torch.device(spec.device)
    model = make_model(spec, method, device)
    batch = synthetic_batch(spec.size, spec.seed, device)
    params = unique_parameter_count(model)
    param_bytes = sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))
    base = {"method": name, "parameters": params}
    if method.skip_reason and (reason := method.skip_reason(spec.size, params, device)):
        return {**base, "status": reason}
    memory = PeakMemory(device).start()
    times, first_norms, step = [], None, None
    try:
        step = method.build(model, batch, spec)
        for i in range(spec.warmup + spec.steps):
            seconds, norms = timed(step, device)
            if i >= spec.warmup:
                times.append(seconds)
            if i == 0 and norms is not None:
                first_norms = norms.detach().double().cpu().tolist()
    except Exception as err:  # noqa: BLE001 - reported in the table: the point is to show what fails
        return {**base, **getattr(step, "row", {}), "status": _error_text(err)}
    memory.stop()
    return {
        **base,
        **getattr(step, "row", {}),
        "status": "ok",
        "step_s": statistics.median(times),
        "times_s": times,
        "peak_bytes": param_bytes + memory.peak,
        "param_bytes": param_bytes,
        "memory_measure": memory.measure,
        "first_norms": first_norms,
    }


def _worker(name: str, spec: BenchSpec, conn) -> None:
    try:
        conn.send(measure_method(name, spec))
    except BaseException as err:  # noqa: BLE001 - e.g. MemoryError during set-up
        conn.send({"method": name, "status": _error_text(err)})
    finally:
        conn.close()


def run_isolated(name: str, spec: BenchSpec, timeout: float) -> dict:
    """``measure_method`` in a fresh process forked from the forkserver (see the docstring);
    a worker that dies (e.g. killed for memory) or exceeds ``timeout`` seconds is an error row."""
    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(name, spec, send), daemon=True)
    proc.start()
    send.close()
    answered = receive.poll(timeout)
    try:
        result = receive.recv() if answered else None
    except EOFError:  # the worker died before sending
        result = None
    if result is None and proc.is_alive():
        proc.kill()
    proc.join()
    if result is None:
        why = (f"worker died without a result (exit code {proc.exitcode}; out of memory?)" if answered
               else f"no result within {timeout:.0f} s")
        result = {"method": name, "status": f"error: {why}"}
    return {"label": METHODS[name].label, "tied": METHODS[name].tied, "lora": METHODS[name].lora, **result}
