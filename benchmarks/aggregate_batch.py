"""``python -m benchmarks.aggregate_batch``: answer-level aggregation's member batch against one plain
request, in transformers (no vLLM: it runs where only torch and transformers are installed).

Answer-level aggregation (``aggregate.mechanism: answer``) asks each of k members, all in one batch, for a short greedy
answer: the member's documents in the system turn, the question and a public extraction
instruction (``INSTRUCTION``) in the user turn. This suite times that batch against one plain
request (the question alone, as many new tokens) on the same model and reports the ratio. Target:
``TARGET_RATIO`` (answer-level aggregation's target bounds seconds per answer, members batched, at 3x its `full` row,
whose prompt holds every document; the plain request here is shorter, so the bound is stricter).

* Documents: the bundled private-context scenarios (``lib.scenarios.DEFAULT_SCENARIOS``), the
  first ``--scenarios`` pooled into one collection and split into ``--members`` members by a keyed
  hash of each document's id (``aggregate.documents.Collection.partition`` under the fixed public
  key ``PARTITION_KEY``, as a server splits under its deployment key): 3 scenarios' 72 short
  documents give 21 members 0-7 documents each, member prompts of 41-298 SmolLM2 tokens (median
  ~150; the plain request ~45). Questions: the first question of each of those scenarios.
* Model: ``--model`` (``smollm2``, imported on first use, or a Hugging Face directory; one with
  only a ``config.json`` and a tokenizer gets seeded random weights, ``benchmarks.lib.models.load_causal_lm``:
  the times do not depend on the values), its tokenizer's chat template; float32 on CPU, bfloat16
  on CUDA (``--dtype``).
* Generation: ``model.generate``, greedy, the prompts left-padded into one batch, KV cache, exactly
  ``--answer-tokens`` new tokens per row (EOS suppressed until then, so that every row does the
  same work whatever the weights say).
* Timing: per question ``--warmup`` untimed calls of each, then ``--repeats`` timed calls, batch
  and plain interleaved (``lib.measure.timed``: the device synchronised around each); the ratio of
  the medians. The summary is the median ratio over the questions.

Not timed here: the public sequence (the plain request itself, decoded beside the members in
token-level aggregation) and answer-level aggregation's final public request that writes the
answer from the released key.

Writes ``aggregate-batch-<model>-<device>-<date>.{md,json}`` (``<device>``: ``cpu`` or
``gpu-<family>``) into ``--out``. Run as ``python -m benchmarks.aggregate_batch`` or ``python -m
benchmarks.aggregate_batch`` (``--quick``: 4 members, one question, 4 tokens).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks import with_example
from benchmarks.lib.measure import timed, usable_device
from benchmarks.lib.models import has_weights, load_causal_lm
from vllm_dp_plugin.aggregate.documents import Collection, Document, member_texts
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_device_arg,
    add_out_arg,
    add_quick_arg,
    command_line,
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
from vllm_dp_plugin.benchmarks.lib.report import suffixed, table, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_SCENARIOS, load_scenarios, resolve_model

PARTITION_KEY = b"python -m benchmarks.aggregate_batch"  # public: a server uses its deployment's key
INSTRUCTION = "Answer with a short phrase copied from the documents above, or NONE."
TARGET_RATIO = 3.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULTS = {"members": 21, "scenarios": 3, "answer_tokens": 32, "warmup": 1, "repeats": 3}
QUICK = {"members": 4, "scenarios": 1, "answer_tokens": 4, "warmup": 1, "repeats": 1}


# ---------------------------------------------------------------------------------- prompts


def collection(scenarios: Sequence[dict]) -> Collection:
    """The scenarios' documents as one collection (ids ``<scenario id>-<index>``)."""
    docs = tuple(Document(f"{s['id']}-{i}", text) for s in scenarios for i, text in enumerate(s["documents"]))
    return Collection("bench", docs)


def digest(doc_id: str) -> bytes:
    return hmac.new(PARTITION_KEY, doc_id.encode(), hashlib.sha256).digest()


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's rendering of ``messages`` with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def member_prompts(tokenizer, members: Sequence[str], question: str) -> list[list[int]]:
    """One prompt per member: its documents as the system turn, the question + ``INSTRUCTION``."""
    user = {"role": "user", "content": f"{question}\n{INSTRUCTION}"}
    return [chat_ids(tokenizer, [{"role": "system", "content": docs}, user]) for docs in members]


def plain_prompt(tokenizer, question: str) -> list[int]:
    return chat_ids(tokenizer, [{"role": "user", "content": question}])


# ---------------------------------------------------------------------------------- generation


def greedy(model, prompts: Sequence[list[int]], tokens: int, pad_id: int) -> Callable[[], int]:
    """A call generating exactly ``tokens`` greedy tokens for every prompt, left-padded into one
    batch on the model's device; it returns the number of new tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)

    def call() -> int:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=pad_id)
        return out.shape[1] - width

    return call


def time_pair(batch: Callable[[], int], plain: Callable[[], int], device, tokens: int, warmup: int,
              repeats: int) -> dict:
    """Median seconds of ``batch`` and ``plain`` (interleaved after ``warmup`` calls of each) and
    every timed call's; RuntimeError if a call did not generate ``tokens`` tokens."""
    for _ in range(warmup):
        batch(), plain()
    times: dict[str, list[float]] = {"batch": [], "plain": []}
    for _ in range(repeats):
        for name, call in (("batch", batch), ("plain", plain)):
            seconds, new = timed(call, device)
            if new != tokens:
                raise RuntimeError(f"{name} generated {new} tokens, not {tokens}")
            times[name].append(seconds)
    out = {f"{name}_s": statistics.median(ts) for name, ts in times.items()}
    return {**out, "ratio": out["batch_s"] / out["plain_s"], **{f"{name}_times_s": ts for name, ts in times.items()}}


# ---------------------------------------------------------------------------------- report


def verdict(ratio: float) -> str:
    return "PASS" if ratio <= TARGET_RATIO else "FAIL"


def target_line(summary: dict) -> str:
    return (f"{summary['verdict']} member batch (k = {summary['members']}) <= {TARGET_RATIO:g}x one plain request: "
            f"median ratio {summary['ratio']:.2f}x over {summary['questions']} questions")


def render_markdown(results: dict) -> str:
    meta, summary = results["meta"], results["summary"]
    env = meta["env"]
    gpu = f", GPU {env['gpu']} (CUDA {env['cuda']})" if "gpu" in env else ""
    weights = "pretrained weights" if not meta["random_weights"] else (
        f"random weights (seed {meta['seed']}) of its architecture: config.json and tokenizer only, the times do not "
        "depend on the values")
    rows = [[r["question"], f"{r['member_tokens'][0]} / {r['member_tokens'][1]:g} / {r['member_tokens'][2]}",
             r["plain_tokens"], r["batch_s"] * 1e3, r["plain_s"] * 1e3, f"{r['ratio']:.2f}x",
             r["members"] * meta["answer_tokens"] / r["batch_s"]]
            for r in results["questions"]]
    return "\n".join([
        (f"# Answer-level aggregation, member batch vs plain request, {meta['model_name']}: {meta['device']} "
         f"({meta['date']})"),
        "",
        f"Command: `{meta['command']}`",
        "",
        (f"torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, "
         f"{env['torch_threads']} threads{gpu}."),
        "",
        (f"Model: `{meta['model_path']}` ({weights}), {meta['dtype']}, transformers `generate` (greedy, KV cache, "
         f"exactly {meta['answer_tokens']} new tokens per row). Members: {meta['members']}, over the {meta['documents']} "
         f"documents of {meta['scenarios']} bundled scenarios split by keyed hash ({meta['empty_members']} members "
         f"got none); each member prompt = its documents (system turn) + the question + \"{INSTRUCTION}\" "
         "(user turn); plain = the question alone. Times: median of "
         f"{meta['repeats']} interleaved calls after {meta['warmup']} warm-up call(s) of each."),
        "",
        table(["question", "member prompt tokens (min / median / max)", "plain prompt tokens", "batch ms", "plain ms",
               "batch / plain", "batch new tokens / s"], rows),
        "",
        f"**{target_line(summary)}**",
        "",
        (f"Total wall time {meta['wall_s']:.0f} s; host load average (1/5/15 min) at start {meta['loadavg_start']}, "
         f"at end {meta['loadavg_end']}."),
        "",
    ])


# ---------------------------------------------------------------------------------- main


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    add_device_arg(p, default_device(), "cpu or cuda[:i] (default: cuda when available)")
    add_out_arg(p)
    add_quick_arg(p, f"{QUICK['members']} members, {QUICK['scenarios']} question, {QUICK['answer_tokens']} tokens, "
                     f"{QUICK['repeats']} repeat (seconds; for tests)")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (SmolLM2-135M-Instruct, imported on first use) or a Hugging Face directory with a "
                        "tokenizer (only a config.json besides: random weights) (default smollm2)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="model dtype (default auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--members", type=int, help=f"k, members per query (default {DEFAULTS['members']})")
    p.add_argument("--scenarios", type=int,
                   help=f"bundled scenarios whose documents are pooled; one question each (default {DEFAULTS['scenarios']})")
    p.add_argument("--answer-tokens", type=int, help=f"new tokens per row (default {DEFAULTS['answer_tokens']})")
    p.add_argument("--warmup", type=int, help=f"untimed calls of each per question (default {DEFAULTS['warmup']})")
    p.add_argument("--repeats", type=int, help=f"timed calls of each per question (default {DEFAULTS['repeats']})")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed (config-only model; default 0)")
    add_date_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


@with_example
def build_parser(prog: str = "python -m benchmarks.aggregate_batch") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog, description="Answer-level aggregation: k member prompts batched vs one plain request (transformers)."))


def _settings(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else DEFAULTS
    settings = {key: base[key] if getattr(args, key) is None else getattr(args, key) for key in base}
    if min(settings["members"], settings["scenarios"], settings["answer_tokens"], settings["repeats"]) < 1:
        raise SystemExit("--members, --scenarios, --answer-tokens and --repeats must be >= 1")
    return settings


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``python -m benchmarks.aggregate_batch ...``)."""
    from transformers import AutoTokenizer

    args, argv = parse(args, build_parser)
    device = usable_device(args.device)
    settings = _settings(args)
    try:
        model_name, path = resolve_model(args.model)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    date, log = today(args.date), logger(not args.quiet)
    load_start, start = loadavg(), time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = load_causal_lm(path, dtype=DTYPES[dtype_name], seed=args.seed).to(device).eval()
    scenarios = load_scenarios(DEFAULT_SCENARIOS)[: settings["scenarios"]]
    docs = collection(scenarios)
    members = member_texts(docs.partition(settings["members"], digest))
    log(f"== {model_name} ({dtype_name}) on {args.device}: {settings['members']} members over {len(docs.documents)} "
        f"documents, {settings['answer_tokens']} new tokens")

    rows = []
    for scenario in scenarios:
        question = scenario["questions"][0]["q"]
        prompts = member_prompts(tokenizer, members, question)
        plain = plain_prompt(tokenizer, question)
        times = time_pair(greedy(model, prompts, settings["answer_tokens"], pad_id),
                          greedy(model, [plain], settings["answer_tokens"], pad_id),
                          device, settings["answer_tokens"], settings["warmup"], settings["repeats"])
        lengths = sorted(len(p) for p in prompts)
        rows.append({"question": question, "members": len(prompts),
                     "member_tokens": [lengths[0], statistics.median(lengths), lengths[-1]],
                     "plain_tokens": len(plain), **times})
        log(f"  {question[:60]!r}: batch {times['batch_s'] * 1e3:,.0f} ms, plain {times['plain_s'] * 1e3:,.0f} ms, "
            f"{times['ratio']:.2f}x")

    ratio = statistics.median(r["ratio"] for r in rows)
    summary = {"members": settings["members"], "questions": len(rows), "ratio": ratio, "target": TARGET_RATIO,
               "verdict": verdict(ratio)}
    results = {
        "questions": rows,
        "summary": summary,
        "meta": {
            "device": device_label(device, short=True), "date": date,
            "command": command_line("python -m benchmarks.aggregate_batch", argv),
            "env": environment(device, packages=("transformers",)),
            "model_name": model_name, "model_path": path, "random_weights": not has_weights(path),
            "dtype": dtype_name, **settings, "seed": args.seed, "documents": len(docs.documents),
            "empty_members": sum(not m for m in members),
            "wall_s": time.perf_counter() - start, "loadavg_start": load_start, "loadavg_end": loadavg(),
        },
    }
    stem = Path(args.out) / f"aggregate-batch-{model_name}-{results['meta']['device']}-{date}"
    write_json(suffixed(stem, ".json"), results, indent=2, newline=True)
    write_text(suffixed(stem, ".md"), render_markdown(results))
    log(target_line(summary))
    log(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
