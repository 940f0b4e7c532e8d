"""Before/after of the shared input Gram (issue 37 item 3): SmolLM2 full fine-tuning, non-private
vs ours at the baseline commit vs ours on this branch, interleaved in one run.

Each repeat runs the three rows in a rotated order, each in a fresh Python process (its
``PYTHONPATH`` selects the code) through ``benchmarks.train.measure.measure_method`` (the
``python -m benchmarks.train`` measurement: pretrained weights, batch 32 x 128, flat clipping, noise
multiplier 1, Adam; median of ``--steps`` steps after ``--warmup``). The table: per row the
median over repeats of the per-repeat medians, and the ratio to non-private of the same repeat.

Run (under the shared timing lock): ``flock /tmp/vllm-dp-perf.lock python <this file> --base
<worktree at the baseline commit> --new <this worktree> --out <stem>``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ONE = """
import json, sys, torch
from vllm_dp_plugin.benchmarks.lib.scenarios import resolve_model
from benchmarks.train import _model_size
from benchmarks.train.measure import measure_method
from benchmarks.train.spec import BenchSpec
import vllm_dp_plugin
torch.set_num_threads(2)
_, path = resolve_model("smollm2")
spec = BenchSpec(size=_model_size(path, 32, 128), device="cpu", autocast="none", warmup={warmup},
                 steps={steps}, seed=0, noise_multiplier=1.0, clip_norm=1.0, lr=1e-4, model=path)
row = measure_method("{method}", spec)
row.pop("first_norms", None)
print("ROW " + json.dumps({{**row, "code": vllm_dp_plugin.__file__}}))
"""
ROWS = {"non_private": ("base", "non_private"), "ours_before": ("base", "ours"), "ours_after": ("new", "ours")}


def run_row(code_root: str, method: str, steps: int, warmup: int) -> dict:
    env = {**os.environ, "PYTHONPATH": code_root, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", ONE.format(method=method, steps=steps, warmup=warmup)],
                         env=env, cwd=code_root, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("ROW "))[4:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--out", required=True, help="output stem (.json written)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    roots = {"base": args.base, "new": args.new}
    names = list(ROWS)
    runs = []
    start, load_start = time.time(), os.getloadavg()
    for r in range(args.repeats):
        for name in names[r % 3:] + names[: r % 3]:  # rotated order
            which, method = ROWS[name]
            row = run_row(roots[which], method, args.steps, args.warmup)
            row.update(repeat=r, row=name, loadavg=os.getloadavg())
            runs.append(row)
            with open(args.out + ".runs.json", "w") as f:  # partial results survive an interrupted run
                json.dump(runs, f, indent=1)
            print(f"repeat {r} {name}: {row['status']} {row.get('step_s', 0):.2f} s/step, "
                  f"peak {row.get('peak_bytes', 0) / 2**20:,.0f} MiB, load {row['loadavg']}", flush=True)
    summary = {}
    for name in names:
        mine = [x for x in runs if x["row"] == name]
        ratios = [x["step_s"] / next(y["step_s"] for y in runs if y["row"] == "non_private" and y["repeat"] == x["repeat"])
                  for x in mine]
        summary[name] = {"step_s": statistics.median(x["step_s"] for x in mine), "per_repeat_s": [x["step_s"] for x in mine],
                         "ratio": statistics.median(ratios), "per_repeat_ratio": ratios,
                         "peak_mib": statistics.median(x["peak_bytes"] / 2**20 for x in mine)}
    result = {"summary": summary, "runs": runs, "args": vars(args), "wall_s": time.time() - start,
              "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
