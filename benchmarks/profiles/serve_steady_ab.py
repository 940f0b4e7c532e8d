"""Before/after of DP attention's steady state (issue 37 item 1): ``bench serve``'s steady rows
(demo Llama, P = 2048, 128 requests, suffix 64 + output 64, best of 3 rounds in one engine) for
stock, ``dp_state`` on the baseline tree and ``dp_state`` on the new tree, interleaved, each row
a fresh engine whose ``PYTHONPATH`` selects the code; writes ``ab.json`` into WORK.

Run (under the shared timing lock): ``flock /tmp/vllm-dp-perf.lock python <this file> WORK
--base <tree at the baseline commit> --new <tree> --repeats 3``.
"""

import argparse
import json
import os
from pathlib import Path

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--base", required=True, help="source tree of the baseline (kernels linked in)")
    parser.add_argument("--new", required=True, help="source tree of the new code")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from vllm_dp_plugin.benchmarks import serve

    s = serve.Settings(model=".demo/llama", out=args.work, prefix_lens=(2048,), num_prompts=128,
                       configs=("stock", "dp_state"), latency=False, steady_rounds=3)
    serve.prepare(s, args.work)
    rows = []
    for rep in range(args.repeats):
        for label, tree, config in (("stock", args.new, "stock"), ("dp_state before", args.base, "dp_state"),
                                    ("dp_state after", args.new, "dp_state")):
            os.environ["PYTHONPATH"] = tree
            load = os.getloadavg()[0]
            row = serve.steady_row(config, 2048, s, args.work)
            rows.append({"rep": rep, "label": label, "tree": tree, "load": load, **row.__dict__})
            print(json.dumps(rows[-1]), flush=True)
    (args.work / "ab.json").write_text(json.dumps(rows, indent=1))
