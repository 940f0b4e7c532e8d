"""Noise-free probe of ``mechanism: answer``'s members on SmolLM2, offline (one vLLM ``LLM``, no
server): for every shared and secret question of a scenario file, each document's member answers
(greedy, ``answer_tokens`` tokens, EOS ignored, cut as served), votes (``aggregate.answer``), and
the report counts, per variant of the member request:

* stating members: members whose document holds one of the question's accepted answers;
* their votes for the answer (a key contained in an accepted answer or containing one), for a
  fragment (a key that is a proper part of the accepted answer's words), or for something else;
* the noise-free release (threshold 2): right, fragment, wrong or nothing, per question.

Variants: ``plain`` (today's request), ``vocab`` (decoding restricted to the tokens of the
member's own document, ``allowed_token_ids``) and ``fewshot`` (public worked examples after the
instruction; their words are not the instruction's, so they may vote where a document holds them).

    PYTHONPATH=. python benchmarks/profiles/member_probe.py --scenarios FILE --out /tmp/probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from pathlib import Path

MODEL = ".models/smollm2-135m-instruct"
EXAMPLES = ("\n\nExamples of answers: \"Who leads the Quennel office?\" -> Marta Vosk. "
            "\"Where is the Blorvik kiosk?\" -> Zandor Square. \"When does the Tarrow desk open?\" -> 7 am.")


def norm(text: str) -> list[str]:
    from vllm_dp_plugin.aggregate.answer import ORDINAL, THOUSANDS, words

    return words(ORDINAL.sub("", THOUSANDS.sub("", text)))


def verdict(key: str | None, answers: list[str]) -> str:
    """right | fragment | wrong | none for one key against the accepted answers."""
    if key is None:
        return "none"
    k = norm(key)
    for a in answers:
        w = [x for x in norm(a) if x not in ("the", "a", "an")]
        if k == w or (set(w) <= set(k) and len(k) <= len(w) + 1):
            return "right"
    for a in answers:
        if set(k) < set(norm(a)):
            return "fragment"
    return "wrong"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--scenarios", type=Path, required=True)
    p.add_argument("--limit", type=int, default=None, help="first N scenarios")
    p.add_argument("--variants", default="plain,vocab,fewshot")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("/tmp/member_probe.json"))
    args = p.parse_args()
    os.environ.setdefault("VLLM_PLUGINS", "")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_dp_plugin.aggregate.answer import answer_key
    from vllm_dp_plugin.config import ANSWER_INSTRUCTION
    from vllm_dp_plugin.serving.aggregate import ANSWER_SYSTEM, member_text
    from vllm_dp_plugin.serving.memory import kv_cache_args

    tok = AutoTokenizer.from_pretrained(args.model)
    stops = (tok.eos_token_id,)
    scenarios = [json.loads(line) for line in args.scenarios.read_text().splitlines() if line.strip()][: args.limit]
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              **kv_cache_args(args.model, 2048, sequences=8))
    report = {}
    for variant in args.variants.split(","):
        stating = Counter()
        releases = Counter()
        examples = []
        for s in scenarios:
            docs = s["documents"]
            if variant == "vocab":
                from vllm_dp_plugin.serving.aggregate import document_vocabulary

                vocab = [document_vocabulary(tok, [d], stops) for d in docs]
            else:
                vocab = [None] * len(docs)
            for q in s["questions"]:
                if q["kind"] == "public":
                    continue
                instruction = ANSWER_INSTRUCTION + (EXAMPLES if variant == "fewshot" else "")
                prompts = [tok.encode(tok.apply_chat_template(
                    [{"role": "system", "content": ANSWER_SYSTEM.format(documents=d, instruction=instruction)},
                     {"role": "user", "content": q["q"]}], tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False) for d in docs]
                params = [SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True,
                                         allowed_token_ids=list(v) if variant == "vocab" else None) for v in vocab]
                outs = llm.generate([{"prompt_token_ids": x} for x in prompts], params, use_tqdm=False)
                keys = [answer_key(member_text(tok, list(o.outputs[0].token_ids), stops), [d], q["q"],
                                   [ANSWER_INSTRUCTION]) for o, d in zip(outs, docs, strict=True)]
                holds = [any(re.search(re.escape(a), d, re.IGNORECASE) for a in q["answers"]) for d in docs]
                for k, h in zip(keys, holds, strict=True):
                    if h:
                        stating[(q["kind"], verdict(k, q["answers"]))] += 1
                votes = Counter(k for k in keys if k)
                top = max(votes, key=lambda k: (votes[k], k)) if votes and max(votes.values()) >= 2 else None
                releases[(q["kind"], q.get("support", 0), verdict(top, q["answers"]))] += 1
                if len(examples) < 12:
                    examples.append({"q": q["q"], "answers": q["answers"], "released": top,
                                     "member_answers": [member_text(tok, list(o.outputs[0].token_ids), stops)
                                                        for o, h in zip(outs, holds, strict=True) if h][:3]})
        report[variant] = {"stating_members": {f"{k}/{v}": n for (k, v), n in sorted(stating.items())},
                           "releases": {f"{k}/{s}/{v}": n for (k, s, v), n in sorted(releases.items())},
                           "examples": examples}
        print(variant, json.dumps(report[variant]["stating_members"]), json.dumps(report[variant]["releases"]),
              flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
