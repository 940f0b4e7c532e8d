"""Prompt-privatization speed: privatized tokens per second.

Three parts, on synthetic seeded Gaussian embedding tables (default 30k x 384 and 128k x 4096):

1. **nearest step**: ``CandidateIndex.nearest`` (fast-pass top-32 per chunk of 512 queries +
   exact float64 re-rank) for queries ``r = e_w + z`` (a random row plus N(0, ``--query-noise``^2)
   per coordinate), torch fast pass vs the Triton kernel (CUDA only), fp32 vs bf16 fast rows;
2. **whole privatizer**: ``TokenPrivatizer.privatize`` with ``trlap_corrected`` at eps 10
   (delta ``--delta``) over every token of the batch: table lookup, TrLaplace noise, nearest
   step, receipt;
3. **roofline**: the Triton fast pass alone (``fast_topk_triton``, top-32 of the same queries; the
   fp32 rows in IEEE fp32, bf16 rows with fp32 accumulate) against a torch GEMM of its scoring
   part, ``[n, d] @ [d, V]`` in the rows' dtype (cuBLAS on CUDA; fp32 as torch's TF32 setting says,
   off by default: recorded), timed the same way on the same device in the same run. Achieved
   FLOP/s = ``2 n V d`` / seconds for both; ``fraction`` = GEMM seconds / kernel seconds, the share
   of the measured GEMM roofline the fused GEMM + top-k reaches. Target (``ROOFLINE_TARGET``): >= 50%
   at 128k x 4096. Needs CUDA (or ``TRITON_INTERPRET=1``, where the numbers mean nothing).

Each case is timed on ``batch`` tokens (default 512 and 4096) after one warm-up call; the timed
call is repeated until ``--min-time`` seconds have passed (at most ``--max-repeats``) and the
median is reported as tokens/s = batch / seconds. ``agree_fp32_torch``: fraction of the batch
whose nearest id equals the torch fp32 pass's (same queries). Cases larger than ``--max-macs``
(n * V * d multiply-adds per timed call; CPU default 3e11 so the run stays within minutes) and
privatizer tables whose build would take more than half the free memory are skipped and listed
with the reason.

Writes ``prompt-speed-<device>-<date>.md`` and ``.json`` into ``--out``; prints every target's
PASS/FAIL line. Run as
``python -m benchmarks.prompt_speed`` (``--quick``: toy sizes, seconds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks import with_example
from benchmarks.lib.measure import free_bytes, synchronize, timed_calls, usable_device
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_device_arg,
    add_out_arg,
    add_quick_arg,
    ints,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import (
    default_device,
    device_label,
    environment,
    loadavg,
)
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import suffixed, write_json, write_text
from vllm_dp_plugin.kernels.nearest_reference import fast_topk_torch, select_within_bound
from vllm_dp_plugin.kernels.nearest_select import default_select
from vllm_dp_plugin.kernels.tree_build import interpret_requested, triton_available
from vllm_dp_plugin.kernels.types import FastPass, SelectPass
from vllm_dp_plugin.prompt import EmbeddingTable, TokenPrivatizer, token_mechanism
from vllm_dp_plugin.prompt.nearest import CandidateIndex

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
TOPK, CHUNK = 32, 512
PRIVATIZER_BYTES_PER_ENTRY = 30  # peak bytes per V*d entry while building table + index
CPU_MAX_MACS = 3e11
CPU_WARMUP = 64  # tokens of the untimed warm-up call on CPU
ROOFLINE_TARGET = {"vocab": 128000, "dim": 4096, "fraction": 0.5}  # kernel >= 50% of the GEMM's FLOP/s


def _tables(text: str) -> list[tuple[int, int]]:
    """``"30000x384,128000x4096"`` -> [(30000, 384), (128000, 4096)]."""
    out = []
    for item in text.split(","):
        vocab, dim = item.lower().split("x")
        out.append((int(vocab), int(dim)))
    return out


def timed(
    fn: Callable[[int], object], batch: int, device: torch.device, min_time: float, max_repeats: int
):
    """(median seconds, repeats, last result) of ``fn(batch)`` after one untimed warm-up call:
    the full batch on CUDA (compilation, kernel selection), at most ``CPU_WARMUP`` tokens on CPU
    (first-call allocations only; a full-size CPU warm-up would double the run time)."""
    fn(batch if device.type == "cuda" else min(batch, CPU_WARMUP))
    times, result = timed_calls(lambda: fn(batch), device, min_time=min_time, max_calls=max_repeats)
    return statistics.median(times), len(times), result


Search = tuple[FastPass, SelectPass]  # (fast pass, selection of the certified fp32 search)


def fast_passes(device: torch.device) -> dict[str, Search]:
    """``torch`` everywhere; ``torch+C++ select`` on CPU when the fused selection builds (used
    by fp32 rows only: bf16 rows take the top-k path); ``triton`` on CUDA when triton is
    installed."""
    passes: dict[str, Search] = {"torch": (fast_topk_torch, select_within_bound)}
    if device.type == "cpu" and default_select(device) is not select_within_bound:
        passes["torch+C++ select"] = (fast_topk_torch, default_select(device))
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            from vllm_dp_plugin.kernels.nearest import fast_topk_triton

            passes["triton"] = (fast_topk_triton, select_within_bound)
        except ImportError:
            pass
    return passes


def applies(pass_name: str, dtype_name: str, device: torch.device) -> bool:
    """The C++ selection only changes the fp32 certified search; the int8 search (CPU only) has its
    own GEMM and selection, run once under the ``torch`` pass's name."""
    if dtype_name == "int8":
        return pass_name == "torch" and device.type == "cpu"
    return not (pass_name == "torch+C++ select" and dtype_name != "fp32")


def synthetic_table(vocab: int, dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """``[vocab, dim]`` fp32 N(0, 1) rows from a seeded generator on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(vocab, dim, generator=gen, device=device)


def skip_reason(batch: int, vocab: int, dim: int, max_macs: float) -> str:
    macs = batch * vocab * dim
    return f"skipped: {macs:.2g} MACs > --max-macs {max_macs:.2g}" if macs > max_macs else ""


def table_and_queries(args, device: torch.device, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded table ``[vocab, dim]`` and ``max(batches)`` queries: a random row plus
    N(0, ``query_noise``^2) per coordinate."""
    table = synthetic_table(vocab, dim, args.seed, device)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    n_max = max(args.batches)
    picks = torch.randint(0, vocab, (n_max,), generator=gen, device=device)
    return table, table[picks] + args.query_noise * torch.randn(n_max, dim, generator=gen, device=device)


def bench_nearest(args, device: torch.device, vocab: int, dim: int, log) -> list[dict]:
    """Part 1 rows for one table."""
    rows_out: list[dict] = []
    table, queries = table_and_queries(args, device, vocab, dim)
    ids = torch.arange(vocab, device=device)
    passes = fast_passes(device)
    for dtype_name in args.dtypes:
        index = CandidateIndex.build(ids, table, DTYPES[dtype_name])
        for batch in args.batches:
            base = {
                "part": "nearest",
                "vocab": vocab,
                "dim": dim,
                "dtype": dtype_name,
                "batch": batch,
            }
            reason = skip_reason(batch, vocab, dim, args.max_macs)
            for pass_name, (fast_pass, select) in passes.items():
                if not applies(pass_name, dtype_name, device):
                    continue
                row = {**base, "pass": pass_name}
                if reason:
                    rows_out.append({**row, "status": reason})
                    continue

                def call(size, fast_pass=fast_pass, select=select, index=index):
                    return index.nearest(queries[:size], TOPK, CHUNK, fast_pass, select)

                seconds, repeats, got = timed(call, batch, device, args.min_time, args.max_repeats)
                key = (vocab, dim, batch)
                if dtype_name == "fp32" and pass_name == "torch":
                    args.reference[key] = got
                ref = args.reference.get(key)
                agree = None if ref is None else float((got == ref).float().mean())
                row.update(
                    status="ok",
                    seconds=seconds,
                    repeats=repeats,
                    tokens_per_s=batch / seconds,
                    agree_fp32_torch=agree,
                )
                rows_out.append(row)
                log(
                    f"  nearest {vocab}x{dim} {dtype_name} {pass_name} batch {batch}: "
                    f"{batch / seconds:,.0f} tok/s ({seconds * 1e3:.1f} ms, {repeats} runs)"
                )
        del index
    return rows_out


def bench_privatizer(args, device: torch.device, vocab: int, dim: int, log) -> list[dict]:
    """Part 2 rows for one table."""
    need = PRIVATIZER_BYTES_PER_ENTRY * vocab * dim
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the nearest part's cached blocks would count as used
    free = free_bytes(device)
    passes = fast_passes(device)
    base = {
        "part": "privatizer",
        "vocab": vocab,
        "dim": dim,
        "mechanism": "trlap_corrected",
        "epsilon": args.epsilon,
        "delta": args.delta,
    }
    if need > free / 2:
        reason = (
            f"skipped: table build needs ~{need / 2**30:.1f} GiB, "
            f"more than half of the {free / 2**30:.1f} GiB free"
        )
        return [
            {**base, "dtype": d, "batch": b, "pass": p, "status": reason}
            for d in args.dtypes
            for b in args.batches
            for p in passes
            if applies(p, d, device)
        ]
    start = time.perf_counter()
    table = EmbeddingTable.build(synthetic_table(vocab, dim, args.seed, device), vocab)
    mech = token_mechanism("trlap_corrected", table, args.epsilon, args.delta)
    synchronize(device)
    build_s = time.perf_counter() - start
    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    n_max = max(args.batches)
    ids = torch.randint(0, vocab, (n_max,), generator=gen, device=device)
    rows_out = []
    for dtype_name in args.dtypes:
        for pass_name, (fast_pass, select) in passes.items():
            if not applies(pass_name, dtype_name, device):
                continue
            start = time.perf_counter()
            priv = TokenPrivatizer(table, mech, fast_dtype=DTYPES[dtype_name], fast_pass=fast_pass, select=select)
            synchronize(device)
            index_s = time.perf_counter() - start
            for batch in args.batches:
                row = {**base, "dtype": dtype_name, "batch": batch, "pass": pass_name}
                reason = skip_reason(batch, vocab, dim, args.max_macs)
                if reason:
                    rows_out.append({**row, "status": reason})
                    continue

                def call(size, priv=priv):
                    noise = torch.Generator(device=device).manual_seed(args.seed + 3)
                    mask = torch.ones(size, dtype=torch.bool, device=device)
                    return priv.privatize(ids[:size], mask, noise)

                seconds, repeats, (_, receipt) = timed(
                    call, batch, device, args.min_time, args.max_repeats
                )
                row.update(
                    status="ok",
                    seconds=seconds,
                    repeats=repeats,
                    tokens_per_s=batch / seconds,
                    table_build_s=build_s,
                    index_build_s=index_s,
                    receipt_epsilon=receipt.total.epsilon,
                )
                rows_out.append(row)
                log(
                    f"  privatizer {vocab}x{dim} {dtype_name} {pass_name} batch {batch}: "
                    f"{batch / seconds:,.0f} tok/s ({seconds * 1e3:.1f} ms, {repeats} runs)"
                )
            del priv
    return rows_out


def roofline_verdict(row: dict) -> str:
    """PASS/FAIL at the target's table size, ``-`` elsewhere."""
    if (row["vocab"], row["dim"]) != (ROOFLINE_TARGET["vocab"], ROOFLINE_TARGET["dim"]):
        return "-"
    return "PASS" if row["fraction"] >= ROOFLINE_TARGET["fraction"] else "FAIL"


def bench_roofline(args, device: torch.device, vocab: int, dim: int, log) -> list[dict]:
    """Part 3 rows for one table: the Triton fast pass vs the torch GEMM of its scores."""
    base = {"part": "roofline", "vocab": vocab, "dim": dim}
    dtypes = [d for d in args.dtypes if d != "int8"]  # the Triton pass reads float rows
    if not (triton_available() and (device.type == "cuda" or interpret_requested())):
        reason = "skipped: the Triton pass needs triton and CUDA (or TRITON_INTERPRET=1)"
        return [{**base, "dtype": d, "batch": b, "status": reason} for d in dtypes for b in args.batches]
    from vllm_dp_plugin.kernels.nearest import fast_topk_triton

    table, queries = table_and_queries(args, device, vocab, dim)
    sq_norms = table.pow(2).sum(-1)
    rows_out = []
    for dtype_name in dtypes:
        rows, cast = table.to(DTYPES[dtype_name]), queries.to(DTYPES[dtype_name])
        for batch in args.batches:
            row = {**base, "dtype": dtype_name, "batch": batch}
            if reason := skip_reason(batch, vocab, dim, args.max_macs):
                rows_out.append({**row, "status": reason})
                continue

            def kernel(size, rows=rows):
                return fast_topk_triton(queries[:size], rows, sq_norms, TOPK)

            def gemm(size, rows=rows, cast=cast):
                return cast[:size] @ rows.T

            kernel_s, kernel_runs, _ = timed(kernel, batch, device, args.min_time, args.max_repeats)
            gemm_s, gemm_runs, _ = timed(gemm, batch, device, args.min_time, args.max_repeats)
            flops = 2.0 * batch * vocab * dim
            row.update(status="ok", kernel_s=kernel_s, gemm_s=gemm_s, kernel_runs=kernel_runs, gemm_runs=gemm_runs,
                       kernel_tflops=flops / kernel_s / 1e12, gemm_tflops=flops / gemm_s / 1e12,
                       fraction=gemm_s / kernel_s)
            row["target"] = roofline_verdict(row)
            rows_out.append(row)
            log(f"  roofline {vocab}x{dim} {dtype_name} batch {batch}: kernel {row['kernel_tflops']:.3g} TFLOP/s, "
                f"GEMM {row['gemm_tflops']:.3g} TFLOP/s: {100 * row['fraction']:.0f}% of the GEMM")
    return rows_out


def target_lines(results: dict) -> list[str]:
    """One PASS/FAIL line per roofline row at the target's table size; one n/a line without any."""
    t = ROOFLINE_TARGET
    name = f"nearest-candidate kernel >= {100 * t['fraction']:.0f}% of the GEMM roofline at {t['vocab']} x {t['dim']}"
    lines = [f"{r['target']} {name} ({r['dtype']}, batch {r['batch']}): {100 * r['fraction']:.1f}% "
             f"({r['kernel_tflops']:.3g} vs {r['gemm_tflops']:.3g} TFLOP/s)"
             for r in results["roofline"] if r.get("target") in ("PASS", "FAIL")]
    return lines or [f"n/a  {name} (not measured in this run)"]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
    return str(value)


def _agree(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _roofline_row(r: dict) -> str:
    head = f"| {r['vocab']} x {r['dim']} | {r['dtype']} | {r['batch']} | "
    if r["status"] != "ok":
        return head + f"- | - | - | - | - | - | {r['status']} |"
    return head + (f"{r['kernel_s'] * 1e3:.3g} | {r['gemm_s'] * 1e3:.3g} | {r['kernel_tflops']:.3g} | "
                   f"{r['gemm_tflops']:.3g} | {100 * r['fraction']:.1f}% | {r['target']} | ok |")


def render_markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        f"# Prompt privatization speed: {meta['device']} ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"torch {meta['env']['torch']}, triton {meta['env']['triton']}, "
        f"python {meta['env']['python']}, {meta['env']['torch_threads']} threads"
        + (
            f", GPU {meta['env']['gpu']} (CUDA {meta['env']['cuda']})"
            if "gpu" in meta["env"]
            else ""
        ),
        "",
        (
            f"Synthetic N(0, 1) tables (seed {meta['seed']}), top-{TOPK} fast pass per chunk of "
            f"{CHUNK} queries + exact float64 re-rank (fp32 rows: the certified window). tokens/s = batch / median seconds of one call "
            f"(after a warm-up call: full batch on CUDA, {CPU_WARMUP} tokens on CPU). `agree` = "
            "fraction of ids equal to the torch fp32 pass on the same queries."
        ),
        "",
        "## 1. Nearest-candidate step (`CandidateIndex.nearest`)",
        "",
        f"Queries: a random table row + N(0, {meta['query_noise']}^2) per coordinate.",
        "",
        "| table V x d | fast rows | pass | batch | tokens/s | ms / call | runs | agree | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["nearest"]:
        lines.append(
            f"| {r['vocab']} x {r['dim']} | {r['dtype']} | {r['pass']} | {r['batch']} | "
            f"{_cell(r.get('tokens_per_s'))} | "
            f"{_cell(r['seconds'] * 1e3) if 'seconds' in r else '-'} | {_cell(r.get('repeats'))} | "
            f"{_agree(r.get('agree_fp32_torch'))} | {r['status']} |"
        )
    lines += [
        "",
        (
            f"## 2. Whole `TokenPrivatizer` (trlap_corrected, eps {meta['epsilon']}, "
            f"delta {meta['delta']}, every token private)"
        ),
        "",
        (
            "| table V x d | fast rows | pass | batch | tokens/s | ms / call | runs "
            "| table + index build s | status |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["privatizer"]:
        build = (
            f"{r['table_build_s']:.2f} + {r['index_build_s']:.2f}" if "table_build_s" in r else "-"
        )
        lines.append(
            f"| {r['vocab']} x {r['dim']} | {r['dtype']} | {r['pass']} | {r['batch']} | "
            f"{_cell(r.get('tokens_per_s'))} | "
            f"{_cell(r['seconds'] * 1e3) if 'seconds' in r else '-'} | {_cell(r.get('repeats'))} | "
            f"{build} | {r['status']} |"
        )
    lines += [
        "",
        "## 3. Nearest-candidate kernel vs the GEMM roofline (`fast_topk_triton` alone)",
        "",
        (
            f"Kernel: the Triton fast pass (top-{TOPK}; fp32 rows in IEEE fp32, bf16 rows with fp32 "
            "accumulate). GEMM: torch `queries @ rows.T` in the rows' dtype, the kernel's scoring part "
            f"(TF32 for fp32 matmuls: {meta['env'].get('tf32_matmul', 'n/a')}). FLOP/s = 2 n V d / median "
            "seconds of one call (after a warm-up call); fraction = GEMM seconds / kernel seconds. Target: "
            f"kernel >= {100 * ROOFLINE_TARGET['fraction']:.0f}% of the GEMM's FLOP/s at "
            f"{ROOFLINE_TARGET['vocab']} x {ROOFLINE_TARGET['dim']}."
        ),
        "",
        "| table V x d | rows | batch | kernel ms | GEMM ms | kernel TFLOP/s | GEMM TFLOP/s | fraction | target | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[_roofline_row(r) for r in results["roofline"]],
        "",
        *[f"**{line}**" for line in target_lines(results)],
        "",
        (
            f"Total wall time: {meta['wall_s']:.1f} s. Host load average (1/5/15 min) at start "
            f"{meta['loadavg_start']}, at end {meta['loadavg_end']} (on a shared CPU box other "
            "processes compete for the cores: compare rows of one run, not runs)."
        ),
        "",
    ]
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    add_device_arg(p, default_device(), "cpu or cuda[:i] (default: cuda when available)")
    add_out_arg(p)
    add_quick_arg(p, "toy sizes (seconds; for tests)")
    p.add_argument(
        "--tables",
        type=_tables,
        help="VxD list (default 30000x384,128000x4096; quick 2000x64,3000x128)",
    )
    p.add_argument("--batches", type=ints, help="tokens per call (default 512,4096; quick 32,128)")
    p.add_argument("--dtypes", default="fp32,bf16,int8",
                   help="fast-pass row dtypes (default fp32,bf16,int8; int8: CPU only)")
    p.add_argument("--parts", default="nearest,privatizer,roofline",
                   help="comma list of nearest,privatizer,roofline (default: all)")
    p.add_argument(
        "--max-macs",
        type=float,
        help=f"skip calls above n*V*d multiply-adds (CPU default {CPU_MAX_MACS:.0e}, CUDA: none)",
    )
    p.add_argument(
        "--min-time",
        type=float,
        help="repeat a timed call until this many seconds (default 1; quick 0)",
    )
    p.add_argument(
        "--max-repeats", type=int, default=10, help="at most this many timed calls (default 10)"
    )
    p.add_argument(
        "--query-noise", type=float, default=1.0, help="std of the query noise (default 1)"
    )
    p.add_argument(
        "--epsilon", type=float, default=10.0, help="privatizer per-token epsilon (default 10)"
    )
    p.add_argument(
        "--delta", type=float, default=1e-6, help="privatizer per-token delta (default 1e-6)"
    )
    p.add_argument("--seed", type=int, default=0, help="table/query seed (default 0)")
    add_date_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


@with_example
def build_parser(prog: str = "python -m benchmarks.prompt_speed") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog,
        description="Privatized-token throughput: nearest-candidate step and TokenPrivatizer.",
    ))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``python -m benchmarks.prompt_speed ...``)."""
    args, argv = parse(args, build_parser)
    device = usable_device(args.device)
    args.tables = args.tables or (
        [(2000, 64), (3000, 128)] if args.quick else [(30000, 384), (128000, 4096)]
    )
    args.batches = args.batches or ([32, 128] if args.quick else [512, 4096])
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    for name in args.dtypes:
        if name not in DTYPES:
            raise SystemExit(f"unknown dtype {name!r}; use {sorted(DTYPES)}")
    parts = {p for p in args.parts.split(",") if p}
    if args.max_macs is None:
        args.max_macs = CPU_MAX_MACS if device.type == "cpu" else float("inf")
    if args.min_time is None:
        args.min_time = 0.0 if args.quick else 1.0
    args.date = today(args.date)
    args.reference = {}
    log = logger(not args.quiet)

    load_start = loadavg()
    start = time.perf_counter()
    results: dict = {"nearest": [], "privatizer": [], "roofline": []}
    for vocab, dim in args.tables:
        if "nearest" in parts:
            log(f"== nearest step, table {vocab} x {dim}")
            results["nearest"] += bench_nearest(args, device, vocab, dim, log)
        if "privatizer" in parts:
            log(f"== privatizer, table {vocab} x {dim}")
            results["privatizer"] += bench_privatizer(args, device, vocab, dim, log)
        if "roofline" in parts:
            log(f"== roofline, table {vocab} x {dim}")
            results["roofline"] += bench_roofline(args, device, vocab, dim, log)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    label = device_label(device)
    results["meta"] = {
        "device": label,
        "date": args.date,
        "command": " ".join(["python -m benchmarks.prompt_speed", *(argv or [])]),
        "env": environment(device),
        "seed": args.seed,
        "query_noise": args.query_noise,
        "epsilon": args.epsilon,
        "delta": args.delta,
        "topk": TOPK,
        "chunk": CHUNK,
        "max_macs": args.max_macs if args.max_macs != float("inf") else None,
        "wall_s": time.perf_counter() - start,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }
    stem = Path(args.out) / f"prompt-speed-{label}-{args.date}"
    write_json(suffixed(stem, ".json"), results, indent=2, newline=True)
    write_text(suffixed(stem, ".md"), render_markdown(results))
    for line in target_lines(results):
        log(line)
    log(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
