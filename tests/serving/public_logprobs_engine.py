"""Batch invariance on a CPU engine, for neighbouring collections A and B (B lacks one document):
the public sequence's next-token log-probabilities asked alone and batched with the members of
each (DP aggregation's step: ``{"alone" | "A" | "B": {token id: logprob}}``, top 20), and
``mechanism: answer``'s member answers (one member per document, all in one batch, greedy,
``ANSWER_TOKENS`` tokens, EOS ignored: ``{"answers_A" | "answers_B": {document: token ids}}``).
Prints one ``RESULT {json}`` line. Argument: the model."""

import json
import sys

DOCS = [f"Memo {i}: the Harlow Freight depot number {i} closes at {i % 12 + 1} pm and opens at 7 am." for i in range(12)]
QUESTION = [{"role": "user", "content": "When does depot 3 close?"}]
MEMBERS = 4
ANSWER_TOKENS = 16
REMOVED = 5


def main(model: str) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_dp_plugin.serving.memory import kv_cache_args

    tok = AutoTokenizer.from_pretrained(model)

    def ids(messages) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    def members(docs) -> list[list[int]]:
        return [ids([{"role": "system", "content": "\n".join(docs[i::MEMBERS])}, *QUESTION]) for i in range(MEMBERS)]

    public = ids(QUESTION)
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0, **kv_cache_args(model, 1024))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    out = {}
    for name, batch in (("alone", [public]), ("A", [public, *members(DOCS)]),
                        ("B", [public, *members(DOCS[:5] + DOCS[6:])])):
        first = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)[0]
        out[name] = {str(t): lp.logprob for t, lp in first.outputs[0].logprobs[0].items()}
    answer = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    for name, kept in (("answers_A", range(len(DOCS))), ("answers_B", [i for i in range(len(DOCS)) if i != REMOVED])):
        prompts = [ids([{"role": "system", "content": f"Document: {DOCS[i]}"}, *QUESTION]) for i in kept]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], answer, use_tqdm=False)
        out[name] = {str(i): list(o.outputs[0].token_ids) for i, o in zip(kept, outputs, strict=True)}
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
