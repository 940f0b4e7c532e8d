"""``python -m benchmarks.prompt_ttft``: what prompt privatization adds to vLLM's time to first token.

``vllm bench serve`` (dataset ``random``: ``--input-len`` tokens, 512 by default, ``--output-len``
4, concurrency 1) against ``vllm serve`` of the same model in two configurations:

* ``stock``: ``VLLM_PLUGINS=""``;
* ``prompt-<fast dtype>``: ``dp_privacy.prompt`` with ``--tokenizer-mode dp_private`` (mechanism
  ``--mechanism``, default ``trlap_corrected``, eps ``--epsilon`` per token), one server per
  ``--fast-dtypes`` entry (``prompt.fast_dtype``; default ``auto``: the certified int8 pass on
  CPU; ``--fast-dtypes auto float32`` compares it with the certified fp32 pass in the same run).
  A completion prompt is user content, so every one of its tokens is privatized in the API
  server before the engine sees it.

``--search`` picks the prompt server's nearest-candidate search (``prompt.search``: ``exact``, or
an approximate faiss index ``hnsw`` / ``ivf``). With an approximate search the report gains a
pure-torch section (``prompt_search``, no vLLM): the search alone, exact vs approximate, on 512
queries, and the utility of both on the SAME noisy vectors of real English text tokenised by the
model's tokenizer (identical outputs, token preservation N_w for ``trlap_corrected``,
``gaussian_analytic`` and ``laplace`` at eps 10, 50, 200 per token; target: N_w within 1 pp).

The two servers run ``--repeats`` times, interleaved; the median over runs of the mean TTFT is
compared. Target (prompt privatization's speed): overhead <= 10% on CPU for 512-token prompts on SmolLM2-135M-Instruct
(``--model .models/smollm2-135m-instruct``, vocabulary 49,152 x 576; the demo model's vocabulary
search is half its prefill, so the demo is no longer the target's model).
``--fast-check-queries`` (default 10,240) adds a pure-torch section before the servers start
(``benchmarks.lib.fast_pass``): the certified int8 pass against the certified fp32 pass on that
many noisy vectors of the model's own table (identical answers), and both passes' time on 512.
Writes ``prompt-ttft-<device>-<date>.{md,json}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks import with_example
from vllm_dp_plugin.benchmarks.lib.cli import add_out_arg, add_quick_arg, command_line, parse, today
from vllm_dp_plugin.benchmarks.lib.environment import device_label
from vllm_dp_plugin.benchmarks.lib.report import suffixed, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.vllm import config_env, served_latency
from vllm_dp_plugin.config import FAST_DTYPES, SEARCHES

TARGET_OVERHEAD = 0.10  # (prompt TTFT / stock TTFT) - 1, CPU, SmolLM2-135M-Instruct, 512-token prompts
TARGET_MODEL = ".models/smollm2-135m-instruct"
# --shape wide: the demo vocabulary with a body whose parameters per token dwarf the vocabulary
# search as in real models (V d / params ~ 4%; an 8B model with a 128k vocabulary: ~7%)
SHAPES = {"demo": {}, "wide": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                               "num_attention_heads": 16, "num_key_value_heads": 2}}


def config_of(name: str, args: argparse.Namespace, work: Path) -> tuple[list[str], dict]:
    """(server flags, environment) of ``stock`` or ``prompt-<fast dtype>``; both without vLLM's
    periodic stats log, which a server that may run private prompts must not have (a request may
    pick ``paraphrase``: ``serving.http.check_log_stats``)."""
    if name == "stock":
        return ["--disable-log-stats"], config_env("stock")
    section = {"key_file": str(work / "noise.key"),
               "prompt": {"mechanism": args.mechanism, "epsilon": args.epsilon, "search": args.search,
                          "fast_dtype": name.removeprefix("prompt-")}}
    flags = ["--disable-log-stats", "--tokenizer-mode", "dp_private",
             "--additional-config", json.dumps({"dp_privacy": section})]
    return flags, config_env("dp_prompt")


def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    """Every run's latency row, runs interleaved (stock, prompt-..., stock, prompt-..., ...)."""
    from tqdm import tqdm

    dataset = ["--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--random-range-ratio", "0"]
    jobs = [(r, name) for r in range(args.repeats) for name in configs(args)]
    rows = []
    for run, name in tqdm(jobs, desc="bench serve", unit="server"):
        flags, env = config_of(name, args, work)
        rows += served_latency(f"{name}-{run}", args.model, flags, env, dataset, (1,), args.num_prompts,
                               work, {"run": run})
    for row in rows:
        row["config"] = row["config"].rsplit("-", 1)[0]
    return rows


def configs(args: argparse.Namespace) -> list[str]:
    """``stock``, then one ``prompt-<fast dtype>`` per ``--fast-dtypes`` entry."""
    return ["stock", *(f"prompt-{dtype}" for dtype in args.fast_dtypes)]


def summary(rows: list[dict], names: list[str]) -> dict:
    """Median over runs of each config's mean and median TTFT (ms); per prompt config its overhead
    on stock and verdict (the first prompt config's are the summary's own)."""
    out = {}
    for name in names:
        mine = [r for r in rows if r["config"] == name]
        out[name] = {k: statistics.median(r[k] for r in mine) for k in ("mean_ttft_ms", "median_ttft_ms")}
        out[name]["runs_mean_ttft_ms"] = [r["mean_ttft_ms"] for r in mine]
    for name in names[1:]:
        out[name]["overhead"] = out[name]["mean_ttft_ms"] / out["stock"]["mean_ttft_ms"] - 1.0
        out[name]["verdict"] = "PASS" if out[name]["overhead"] <= TARGET_OVERHEAD else "FAIL"
    out["overhead"], out["verdict"] = out[names[1]]["overhead"], out[names[1]]["verdict"]
    return out


def markdown(args: argparse.Namespace, summ: dict, meta: dict, search: dict | None = None,
             fast: dict | None = None) -> str:
    from benchmarks.lib.fast_pass import markdown as fast_markdown
    from benchmarks.lib.prompt_search import markdown as search_markdown

    search_lines = [] if search is None else search_markdown(search)
    fast_lines = [] if fast is None else fast_markdown(fast)
    shape = f" (shape `{args.shape}`)" if str(args.model).startswith(".demo") else ""

    def row(name: str) -> str:
        runs = ", ".join(f"{t:.1f}" for t in summ[name]["runs_mean_ttft_ms"])
        return f"| {name} | {summ[name]['mean_ttft_ms']:.1f} | {summ[name]['median_ttft_ms']:.1f} | {runs} |"

    return "\n".join([
        f"# python -m benchmarks.prompt_ttft ({meta['device']}, {meta['date']})", "",
        (f"Command: `{meta['command']}`. Model `{args.model}`{shape}; `vllm bench serve`, dataset random, "
        f"{args.input_len} prompt tokens (all privatized), {args.output_len} output tokens, concurrency 1, "
        f"{args.num_prompts} prompts per run, {args.repeats} interleaved runs per config (median reported). "
        f"`prompt`: mechanism `{args.mechanism}`, eps {args.epsilon:g} per token, nearest-candidate search "
        f"`{args.search}`."), "",
        "| config | mean TTFT (ms) | median TTFT (ms) | mean TTFT of each run (ms) |", "|---|---|---|---|",
        *(row(name) for name in configs(args)), "",
        *(f"Overhead of `{name}` on mean TTFT: **{100 * summ[name]['overhead']:+.1f}%** "
          f"(target <= {100 * TARGET_OVERHEAD:.0f}% on SmolLM2-135M-Instruct, `{TARGET_MODEL}`): "
          f"{summ[name]['verdict']}" + ("." if Path(args.model) == Path(TARGET_MODEL) else " (not the target's model).")
          for name in configs(args)[1:]), "",
        *fast_lines,
        *search_lines,
    ])


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument("--model", default=None,
                   help="model dir (default .demo/llama, or .demo/llama-<shape>; built if missing)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="demo",
                   help="geometry of a demo Llama built when --model is missing (wide: 8 layers of 512)")
    add_out_arg(p)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="runs per config, interleaved; median reported")
    p.add_argument("--mechanism", default="trlap_corrected")
    p.add_argument("--epsilon", type=float, default=10.0, help="per-token epsilon")
    p.add_argument("--fast-dtypes", nargs="+", choices=FAST_DTYPES, default=["auto"],
                   help="prompt.fast_dtype of each prompt server (default auto: int8 on CPU)")
    p.add_argument("--search", choices=SEARCHES, default="exact",
                   help="prompt.search of the prompt server: exact (default) or an approximate faiss index")
    p.add_argument("--fast-check-queries", type=int, default=10240,
                   help="noisy vectors for the int8-vs-fp32 identical-answers section (0: skip it)")
    p.add_argument("--utility-tokens", type=int, default=4096,
                   help="tokens of English text for the exact-vs-approximate utility section (0: skip it)")
    add_quick_arg(p, "smoke run: 64-token prompts, 4 prompts, 1 run")
    return p


@with_example
def build_parser(prog: str = "python -m benchmarks.prompt_ttft") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``python -m benchmarks.prompt_ttft ...``)."""
    args, argv = parse(args, build_parser)
    if args.quick:
        args.input_len, args.num_prompts, args.repeats = 64, 4, 1
        args.fast_check_queries = min(args.fast_check_queries, 1024)
    if args.model is None:
        args.model = ".demo/llama" if args.shape == "demo" else f".demo/llama-{args.shape}"
    if not (Path(args.model) / "config.json").exists():
        from vllm_dp_plugin.demo import DemoLlamaShape, make_demo_llama

        make_demo_llama(args.model, DemoLlamaShape(**SHAPES[args.shape]))
    work = Path(tempfile.mkdtemp(prefix="vllm-dp-bench-ttft-"))
    search = None
    if args.search != "exact" and args.utility_tokens > 0:  # pure torch + faiss, before the servers
        from benchmarks.lib.prompt_search import model_comparison

        search = model_comparison(args.model, args.search, tokens=args.utility_tokens)
    fast = None
    if args.fast_check_queries > 0:
        from benchmarks.lib.fast_pass import compare

        fast = compare(args.model, queries=args.fast_check_queries)
    rows = measure(args, work)
    summ = summary(rows, configs(args))
    date = today()
    meta = {"date": date, "device": device_label("cpu"), "platform": platform.platform(),
            "command": command_line("python -m benchmarks.prompt_ttft", argv, quote=False), "work_dir": str(work)}
    shape = "" if args.shape == "demo" else f"{args.shape}-"
    stem = Path(args.out) / f"prompt-ttft-{shape}{meta['device']}-{date}"
    write_json(suffixed(stem, ".json"), {"meta": meta, "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": rows, "summary": summ,
        "search": search, "fast_pass": fast},
        indent=1)
    write_text(suffixed(stem, ".md"), markdown(args, summ, meta, search, fast))
    print(suffixed(stem, ".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
