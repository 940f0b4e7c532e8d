"""Noise-free probe of ``mechanism: answer``'s members on SmolLM2, offline (one vLLM ``LLM``, no
server): for every shared and secret question of a scenario file, each document's member answers
(greedy, ``answer_tokens`` tokens, EOS ignored, cut as served), votes (``aggregate.answer``), and
the report counts, per variant of the member request:

* stating members: members whose document holds one of the question's accepted answers;
* their votes for the answer (a key contained in an accepted answer or containing one), for a
  fragment (a key that is a proper part of the accepted answer's words), or for something else;
* the noise-free release (threshold 2): right, fragment, wrong or nothing, per question.

Variants: ``plain`` (today's request), ``vocab`` (decoding restricted to the tokens of the
member's own document, ``allowed_token_ids``), ``fewshot`` (public worked examples after the
instruction; their words are not the instruction's, so they may vote where a document holds them)
and ``extract`` (no model: ``aggregate.answer.extract_key``, ``answer_member: extract``).
Releases are reported at each of ``--thresholds`` (2: noise-free; 5: the DP threshold of eps 4,
delta 1e-6, one document per member, where the noise of scale 0.25 rarely moves a count).

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
    p.add_argument("--thresholds", default="2,5", help="release thresholds to report (comma-separated)")
    p.add_argument("--out", type=Path, default=Path("/tmp/member_probe.json"))
    args = p.parse_args()
    thresholds = [int(x) for x in args.thresholds.split(",")]
    scenarios = [json.loads(line) for line in args.scenarios.read_text().splitlines() if line.strip()][: args.limit]
    variants = args.variants.split(",")
    llm = tok = None
    if set(variants) - {"extract"}:
        os.environ.setdefault("VLLM_PLUGINS", "")
        from transformers import AutoTokenizer
        from vllm import LLM

        from vllm_dp_plugin.serving.memory import kv_cache_args

        tok = AutoTokenizer.from_pretrained(args.model)
        llm = LLM(model=args.model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
                  **kv_cache_args(args.model, 2048, sequences=8))
    report = {}
    for variant in variants:
        stating = Counter()
        releases = Counter()
        examples = []
        for s in scenarios:
            docs = s["documents"]
            vocab = [None] * len(docs)
            if variant == "vocab":
                from vllm_dp_plugin.serving.aggregate import document_vocabulary

                vocab = [document_vocabulary(tok, [d], (tok.eos_token_id,)) for d in docs]
            for q in s["questions"]:
                if q["kind"] == "public":
                    continue
                answers = (extract_answers(docs, q["q"]) if variant == "extract"
                           else model_answers(llm, tok, docs, vocab, q["q"], variant, args.answer_tokens))
                keys = [key for key, _ in answers]
                holds = [any(re.search(re.escape(a), d, re.IGNORECASE) for a in q["answers"]) for d in docs]
                for k, h in zip(keys, holds, strict=True):
                    if h:
                        stating[(q["kind"], verdict(k, q["answers"]))] += 1
                votes = Counter(k for k in keys if k)
                best = max(votes, key=lambda k: (votes[k], k)) if votes else None
                for threshold in thresholds:
                    top = best if best is not None and votes[best] >= threshold else None
                    releases[(threshold, q["kind"], q.get("support", 0), verdict(top, q["answers"]))] += 1
                if len(examples) < 12:
                    examples.append({"q": q["q"], "answers": q["answers"], "top": best,
                                     "votes": votes[best] if best else 0,
                                     "member_answers": [a for (_, a), h in zip(answers, holds, strict=True) if h][:3]})
        report[variant] = {"stating_members": {f"{k}/{v}": n for (k, v), n in sorted(stating.items())},
                           "releases": {f"t{t}/{k}/{s}/{v}": n for (t, k, s, v), n in sorted(releases.items())},
                           "examples": examples}
        print(variant, json.dumps(report[variant]["stating_members"]), json.dumps(report[variant]["releases"]),
              flush=True)
    args.out.write_text(json.dumps(report, indent=1))


def extract_answers(docs: list[str], question: str) -> list[tuple[str | None, str]]:
    """(key, shown answer) per member of ``extract``: the key is also what the member "said"."""
    from vllm_dp_plugin.aggregate.answer import extract_key

    return [(k, k or "") for k in (extract_key([d], question) for d in docs)]


def model_answers(llm, tok, docs: list[str], vocab: list, question: str, variant: str,
                  answer_tokens: int) -> list[tuple[str | None, str]]:
    """(key, first line) per member: the served member request (``variant``: plain, vocab or
    fewshot), decoded greedily for exactly ``answer_tokens`` tokens, read as served."""
    from vllm import SamplingParams

    from vllm_dp_plugin.aggregate.answer import answer_key
    from vllm_dp_plugin.config import ANSWER_INSTRUCTION
    from vllm_dp_plugin.serving.aggregate import ANSWER_SYSTEM, member_text

    stops = (tok.eos_token_id,)
    instruction = ANSWER_INSTRUCTION + (EXAMPLES if variant == "fewshot" else "")
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": ANSWER_SYSTEM.format(documents=d, instruction=instruction)},
         {"role": "user", "content": question}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False) for d in docs]
    params = [SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True,
                             allowed_token_ids=list(v) if variant == "vocab" else None) for v in vocab]
    outs = llm.generate([{"prompt_token_ids": x} for x in prompts], params, use_tqdm=False)
    texts = [member_text(tok, list(o.outputs[0].token_ids), stops) for o in outs]
    return [(answer_key(t, [d], question, [ANSWER_INSTRUCTION]), t) for t, d in zip(texts, docs, strict=True)]


if __name__ == "__main__":
    main()
