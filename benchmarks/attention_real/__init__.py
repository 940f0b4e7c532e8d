"""``python -m benchmarks.attention_real``: why DP attention garbles a real chat model's answers, offline.

The context benchmark's scenarios (``bench context``: documents as the chat template's system turn
``C`` = positions [0, P), then a user turn with a question) run through the Hugging Face model in
float32 with eager attention. Every decoder layer's post-RoPE queries, keys and values are taken
from transformers' attention dispatch (a function registered with ``AttentionInterface`` that
delegates to the model's own eager attention, so the model's outputs are unchanged), and each
layer is measured in isolation, with exact inputs, for the public queries (the user-turn tokens,
positions >= P):

1. **sinks**: the exact attention mass on position 0, on the public head [0, h) (the chat
   template's system header ``<|im_start|>system\\n``, h = 3 on SmolLM2; ``serving.context``'s
   ``public_head: auto`` rule), on the rest of the private span [h, P) and on the public tail
   [P, p];
2. **kernel** (noise off): the DP part over the private span, [0, P) (``bare``) and [h, P)
   (``head``), built from the plan (``ContextPlan``: the calibration's mapping, the layer's Taylor
   degree, clamps) as ``DPCrossAttention`` with the release's noise left out
   (``NoiselessAttention``), against exact softmax attention over the same rows: the output's
   relative error and ``|log den_dp - log den|``; ``mapping`` is exact softmax over the mapped
   (centred, clipped) rows, which separates the clipping from the Taylor truncation;
3. **noise**: the same with the plan's noise at each ``--eps`` (``pld`` composition, as served),
   and the ratio of the denominator's noise std ``sigma ||P(q)||`` to the true denominator;
4. **merged output**: the relative error of the layer's attention output (``merge_parts`` of
   the DP part, the exact public head and the exact public tail, as served) against exact full
   attention, per condition: ``exact`` (exact private part: ~0), ``kernel_bare``,
   ``kernel_head``, ``eps<E>_head``, ``eps<E>_bare`` and ``dropped`` (public head and tail only:
   what a closed gate gives).

End to end (``propagated``): the same conditions in every layer at once (the context's own rows
stay exact, as in serving: the context is prefilled before any public query), teacher-forced on
the exact model's greedy answer (``--answer-tokens``): top-1 agreement with it and the mean
KL(exact || condition) of the next-token distributions; with ``--answers`` also each condition's
own greedy answers, scored as ``bench context`` scores them (batched decoding over a cached
800-token context: slow on CPU, about 8 s a step on 2 busy cores).

The token layout, the scenarios, the model import and the cached calibration are ``bench
context``'s (``benchmarks.lib.scenarios``: ``ChatLayout``, ``load_scenarios``, ``ensure_model``,
``cached_calibration``): this suite measures exactly the sequences that suite serves. The releases are built per scenario
(state mode: the noise does not depend on the context length, so the plan's numbers are the same
for every scenario). Nothing here imports vllm.

Writes ``attention-real-<device>-<date>.{md,json,png}`` into ``--out``.

The suite is a package: ``parts`` (conditions, exact and DP parts), ``capture`` (the attention
hooks, greedy decoding), ``measures`` (per layer, per scenario), ``report`` (summaries, markdown,
plot) and here ``add_cli_args``, ``run`` and ``main``. Run it as ``python -m benchmarks.attention_real``
or ``python -m benchmarks.attention_real``.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks import with_example
from benchmarks.attention_real.capture import prepare
from benchmarks.attention_real.measures import LayerStats, Sequences, run_scenario
from benchmarks.attention_real.parts import Plans, conditions
from benchmarks.attention_real.report import (
    aggregate,
    end_to_end,
    layer_rows,
    markdown,
    plot,
    summary,
)
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    command_line,
    floats,
    ints,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import shown, suffixed, write_json, write_text
from vllm_dp_plugin.plan import ModelShape

DEFAULT_EPS = (8.0, 64.0)
DEFAULT_LIMIT = 4
ANSWER_TOKENS = 16


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from vllm_dp_plugin.benchmarks.lib.scenarios import (
        DEFAULT_CACHE,
        DEFAULT_MODEL,
        DEFAULT_SCENARIOS,
    )

    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"Hugging Face model directory (default {DEFAULT_MODEL})")
    parser.add_argument("--scenarios", type=Path, default=DEFAULT_SCENARIOS,
                        help="scenarios JSONL (default: bench context's bundled scenarios)")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"the first N scenarios (default {DEFAULT_LIMIT})")
    parser.add_argument("--questions", type=ints, default=None,
                        help="indices of the questions of each scenario to ask, comma-separated (default all; "
                             "bench context's order: shared facts of support 1, 3, 10, 20, the secret, 2 public)")
    parser.add_argument("--eps", type=floats, default=DEFAULT_EPS,
                        help=f"eps of the noisy conditions, comma-separated (default {','.join(map(str, DEFAULT_EPS))})")
    parser.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                        help=f"greedy answer tokens (teacher forcing and --answers; default {ANSWER_TOKENS})")
    parser.add_argument("--answers", action="store_true",
                        help="also generate each condition's own greedy answers and score them")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="calibration file (default: bench context's cached one in --cache-dir, made when missing)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where bench context caches the calibration")
    parser.add_argument("--seed", type=int, default=0, help="noise seed")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 scenario, questions 3 and 5, eps 8, 4 answer tokens")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    add_out_arg(parser)
    add_date_arg(parser)
    return parser


@with_example
def build_parser(prog: str = "python -m benchmarks.attention_real") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def scenario_sequences(layout, scenarios: Sequence[dict], questions: Sequence[int] | None) -> list[Sequences]:
    """Each scenario's ids (``bench context``'s ``ChatLayout``) and its public head (the serving
    rule ``public_head: auto``)."""
    from vllm_dp_plugin.serving.context import head_length, public_head_ids

    header = public_head_ids(layout.tokenizer)
    out = []
    for s in scenarios:
        ids = layout.context_ids(s["documents"])
        qs = [{"ids": layout.user_ids(s["documents"], q["q"]), "answers": q["answers"], "kind": q["kind"], "q": q["q"]}
              for i, q in enumerate(s["questions"]) if questions is None or i in questions]
        out.append(Sequences(s["id"], ids, head_length(ids, "auto", header, s["id"]), qs))
    return out


def run(model, seqs: Sequence[Sequences], plans_of: Callable[[Sequences], Plans], eps: Sequence[float],
        answer_tokens: int, answers: bool, seed: int, eos: int | None, decode=None, log=print) -> dict:
    """Measure every scenario of ``seqs`` with ``model`` (prepared: ``prepare``); the JSON-ready
    result without the run's description (``layers``, ``aggregate``, ``end_to_end``, ...)."""
    conds = conditions(eps)
    n_layers = model.config.num_hidden_layers
    stats = [LayerStats() for _ in range(n_layers)]
    info, e2e, plans = [], [], None
    for i, s in enumerate(seqs):
        plans = plans_of(s)
        result = run_scenario(model, s, plans, conds, stats, answer_tokens, answers, seed + i, eos, log)
        info.append({"scenario": result["scenario"], "context_tokens": result["context_tokens"],
                     "public_head": result["public_head"]})
        e2e += result["rows"]
    if decode is not None:
        for r in e2e:
            if "answer" in r:
                r["text"] = decode(r["answer"])
    rows = layer_rows(stats, plans, conds)
    from vllm_dp_plugin.benchmarks.lib.scenarios import is_correct

    samples = [{"condition": r["condition"], "text": r["text"]} for r in e2e
               if r["scenario"] == seqs[0].name and r["question"] == 0 and "text" in r]
    return {"eps": list(eps), "conditions": [c.name for c in conds], "layers": rows,
            "aggregate": aggregate(rows, eps, conds), "scenario_info": info,
            "end_to_end": end_to_end(e2e, conds, is_correct), "end_to_end_rows": e2e,
            "samples": samples, "public_head": min(s["public_head"] for s in info) if info else 0}


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed arguments (``add_cli_args``) or an argv list (``python -m benchmarks.attention_real ...``)."""
    args, argv = parse(args, build_parser)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dp_plugin.benchmarks.lib.scenarios import (
        ChatLayout,
        cached_calibration,
        ensure_model,
        load_scenarios,
    )

    log = logger(not args.no_progress)
    eps, limit, questions, answer_tokens = tuple(args.eps), args.limit, args.questions, args.answer_tokens
    if args.quick:
        eps, limit, questions, answer_tokens = (8.0,), 1, (3, 5), 4
    started = time.perf_counter()
    model_dir = ensure_model(args.model)
    scenarios = load_scenarios(args.scenarios)[:limit]
    calibration = str(args.calibration or cached_calibration(model_dir, args.cache_dir))
    layout = ChatLayout(AutoTokenizer.from_pretrained(model_dir))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prepare(model)
    shape = ModelShape.from_pretrained(model_dir)
    seqs = scenario_sequences(layout, scenarios, questions)
    tokenizer = layout.tokenizer
    log(f"python -m benchmarks.attention_real: {len(seqs)} scenarios, eps {', '.join(f'{e:g}' for e in eps)}")
    measured = run(model, seqs, lambda s: Plans.of(shape, len(s.context), s.head, eps, calibration=calibration), eps,
                   answer_tokens, args.answers, args.seed, tokenizer.eos_token_id,
                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True), log)
    device, date = device_label("cpu"), today(args.date)
    data = {"model": model_dir, "device": device, "date": date,
            "command": command_line("python -m benchmarks.attention_real", argv), "calibration": calibration,
            "scenarios": shown(args.scenarios), "questions_per_scenario": len(seqs[0].questions),
            "answer_tokens": answer_tokens, "answers": args.answers, "seed": args.seed,
            "environment": environment("cpu", packages=("transformers",)), "platform": platform.platform(),
            **measured, "wall_s": time.perf_counter() - started}
    stem = args.out / f"attention-real-{device}-{date}"
    write_json(suffixed(stem, ".json"), data, indent=1)
    write_text(suffixed(stem, ".md"), markdown(data))
    plot(data, suffixed(stem, ".png"))
    log(summary(data))
    log(f"python -m benchmarks.attention_real: wrote {suffixed(stem, '.md')} (.json, .png)")
    return 0
