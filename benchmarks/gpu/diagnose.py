"""Where the two missed GPU targets of run_all.sh lose their time (a follow-up of run_all.sh; one call).

``train``: the DP step on SmolLM2's shape split into its phases (forward + per-sample loss, our
backward with per-sample norms and clipping, the noise of ``finish_step``, Adam), each timed with
the device synchronised, against non-private's forward + backward, fp32 and bf16 autocast; then
the top CUDA kernels of one DP step (torch.profiler).
``nearest``: ``fast_topk_triton``'s kernel at 128000 x 4096 over block sizes, warps and stages, and
at k = 1 (the GEMM with almost no top-k work), each against torch's GEMM of the same shape.

    python benchmarks/gpu/diagnose.py [--parts train,nearest] [--quick]
"""

# ruff: noqa: B023 - every closure is called within the iteration that defines it
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch


def sync_time(fn, device, repeats: int) -> float:
    """Median seconds of ``repeats`` synchronised calls of ``fn`` (after one warm-up)."""
    return statistics.median(phases([fn], device, repeats)[0])


def phases(fns, device, repeats: int) -> list[list[float]]:
    """Seconds of each of ``fns`` called in turn, ``repeats`` rounds after one warm-up round, the
    device synchronised between them; per function, its list of seconds."""
    out = [[] for _ in fns]
    for r in range(repeats + 1):
        for i, fn in enumerate(fns):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if r:
                out[i].append(time.perf_counter() - start)
    return out


def train_phases(args, device: torch.device) -> None:
    from benchmarks.train import _spec_from_args, build_parser
    from benchmarks.train.methods import METHODS
    from benchmarks.train.spec import _per_sample_loss, make_model, synthetic_batch
    from vllm_dp_plugin.trainer.engine import DPConfig, DPEngine

    for autocast in ("none", "bf16"):
        parsed = build_parser().parse_args(
            ["--device", str(device), "--model", args.model, "--autocast", autocast]
            + (["--quick"] if args.quick else []))
        spec = _spec_from_args(parsed, args.model)
        batch = synthetic_batch(spec.size, spec.seed, device)
        print(f"== train phases, autocast {autocast}: batch {spec.size.batch} x {spec.size.seq_len}", flush=True)
        for name in ("non_private", "ours"):
            model = make_model(spec, METHODS[name], device)
            engine = (DPEngine(model, DPConfig(noise_multiplier=1.0, expected_batch_size=spec.size.batch,
                                               clip_norm=1.0, clipping="flat", seed=0)) if name == "ours" else None)
            state = {}

            def forward():
                state["loss"] = _per_sample_loss(model, batch, spec)

            def backward():
                if engine is None:
                    state["loss"].mean().backward()
                else:
                    engine.backward(state["loss"])

            def noise():
                if engine is not None:
                    engine.finish_step()
                model.zero_grad(set_to_none=True)

            times = phases([forward, backward, noise], device, args.repeats)
            ms = [1e3 * statistics.median(t) for t in times]
            print(f"  {name}: forward {ms[0]:.1f} ms, backward {ms[1]:.1f} ms, finish_step + zero_grad {ms[2]:.1f} ms",
                  flush=True)
            if engine is not None and device.type == "cuda":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    forward(), backward(), noise()
                    torch.cuda.synchronize(device)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def nearest_sweep(args, device: torch.device) -> None:
    import triton

    from vllm_dp_plugin.kernels import nearest

    n_rows, dim = (2048, 256) if args.quick else (128000, 4096)
    batch = 64 if args.quick else 4096
    gen = torch.Generator(device="cpu").manual_seed(0)
    table = torch.randn(n_rows, dim, generator=gen).to(device)
    queries = torch.randn(batch, dim, generator=gen).to(device)
    sq = table.pow(2).sum(-1)
    flops = 2.0 * batch * n_rows * dim
    kernel = nearest._kernel(nearest.interpret_requested())
    blocks_n, blocks_k, blocks_d = ((64, 128), (64, 128, 256), (32, 64)) if not args.quick else ((16,), (16,), (16,))
    warps, stages = ((4, 8), (3,)) if not args.quick else ((4,), (2,))
    shipped = {dtype: (nearest.BLOCK_N, nearest.BLOCK_K, nearest.BLOCK_D[dtype], 4, 3)  # triton's default warps, stages
               for dtype in nearest.BLOCK_D}
    for dtype in (torch.bfloat16, torch.float32):
        rows, q = table.to(dtype).contiguous(), queries.to(dtype).contiguous()
        gemm = sync_time(lambda: q @ rows.T, device, args.repeats)
        print(f"== nearest {n_rows}x{dim} batch {batch} {dtype}: torch GEMM {flops / gemm / 1e12:.1f} TFLOP/s", flush=True)
        for bn, bk, bd, w, s in itertools.product(blocks_n, blocks_k, blocks_d, warps, stages):
            for k in (32, 1) if (bn, bk, bd, w, s) == shipped[dtype] or args.quick else (32,):
                tiles = triton.cdiv(n_rows, bk)
                wanted = min(triton.cdiv(nearest.TARGET_PROGRAMS, triton.cdiv(batch, bn)),
                             triton.cdiv(tiles, nearest.MIN_TILES_PER_SPLIT))
                per = triton.cdiv(tiles, max(1, min(tiles, wanted)))
                splits = triton.cdiv(tiles, per)
                keys = torch.empty(batch, splits, k, dtype=torch.int64, device=device)

                def launch():
                    kernel[(triton.cdiv(batch, bn), splits)](
                        q, rows, sq, keys, batch, n_rows, dim, k, per,
                        q.stride(0), rows.stride(0), keys.stride(0), keys.stride(1),
                        BLOCK_N=bn, BLOCK_K=bk, BLOCK_D=bd, K_PAD=triton.next_power_of_2(k),
                        PRECISION="ieee" if dtype == torch.float32 else "tf32",
                        UPCAST=dtype != torch.float32 and nearest.interpret_requested(),
                        num_warps=w, num_stages=s)

                try:
                    t = sync_time(launch, device, args.repeats)
                    print(f"  BLOCK_N {bn:3d} BLOCK_K {bk:3d} BLOCK_D {bd:3d} warps {w} stages {s} k {k:2d}: "
                          f"{flops / t / 1e12:6.1f} TFLOP/s = {100 * gemm / t:5.1f}% of the GEMM", flush=True)
                except Exception as err:  # noqa: BLE001 - a config that does not compile is reported
                    print(f"  BLOCK_N {bn} BLOCK_K {bk} BLOCK_D {bd} warps {w} stages {s} k {k}: "
                          f"{type(err).__name__}: {str(err)[:120]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="train,nearest")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=".gpu-model/smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="toy sizes (a CPU dry run)")
    args = p.parse_args()
    device = torch.device(args.device)
    parts = args.parts.split(",")
    if "nearest" in parts:
        nearest_sweep(args, device)
    if "train" in parts:
        train_phases(args, device)


if __name__ == "__main__":
    main()
