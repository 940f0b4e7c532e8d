"""Exact vs approximate nearest-candidate search on a served model's own table (pure torch and
faiss, no vLLM): the section ``python -m benchmarks.prompt_ttft --search hnsw|ivf`` adds to its report.

* **speed**: ms to project ``queries`` noisy vectors (512: one 512-token prompt) with the exact
  search and with the approximate index, interleaved, median of ``repeats`` calls;
* **utility on the same noisy vectors**: real English text (prose sentences of the help topics
  that ship with Python, ``pydoc_data.topics``) tokenised by the model's tokenizer; every token's
  clipped embedding is noised once per (mechanism, per-token eps) and BOTH searches project the
  same noisy vectors. Reported: the fraction of identical outputs, and token preservation N_w
  (fraction of tokens mapped back to themselves) of each search. Target (approximate search as useful as exact): N_w within
  ``MAX_NW_GAP`` (1 percentage point) of exact search.
"""

from __future__ import annotations

import random
import re
import statistics
import time
import warnings
from collections.abc import Sequence

import torch

from vllm_dp_plugin.config import PromptPrivacyConfig
from vllm_dp_plugin.prompt.approximate import ApproximateIndex
from vllm_dp_plugin.prompt.mechanisms import token_mechanism
from vllm_dp_plugin.prompt.privatizer import candidate_index

MECHANISMS = ("trlap_corrected", "gaussian_analytic", "laplace")
EPSILONS = (10.0, 50.0, 200.0)
MAX_NW_GAP = 0.01  # |N_w approximate - N_w exact| target
SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def english_ids(tokenizer, tokens: int, seed: int = 0) -> torch.Tensor:
    """``[tokens]`` int64: seeded prose sentences of ``pydoc_data.topics`` (letters and spaces
    >= 85% of the characters), each tokenised without special tokens, concatenated and cut."""
    from pydoc_data.topics import topics

    sentences = []
    for key in sorted(topics):
        for sentence in SENTENCE_SPLIT.split(re.sub(r"\s+", " ", topics[key]).strip()):
            if len(sentence) > 20 and sum(c.isalpha() or c == " " for c in sentence) >= 0.85 * len(sentence):
                sentences.append(sentence)
    random.Random(seed).shuffle(sentences)
    ids: list[int] = []
    for sentence in sentences:
        ids += tokenizer.encode(" " + sentence, add_special_tokens=False)
        if len(ids) >= tokens:
            break
    return torch.tensor(ids[:tokens], dtype=torch.int64)


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def compare(table, approx: ApproximateIndex, ids: torch.Tensor, *, mechanisms: Sequence[str] = MECHANISMS,
            epsilons: Sequence[float] = EPSILONS, delta: float = 1e-6, queries: int = 512, repeats: int = 5,
            topk: int = 32, seed: int = 0) -> dict:
    """Speed and utility of ``approx`` vs ``approx.exact`` over ``table`` for the text ``ids``."""
    from vllm_dp_plugin.kernels.nearest_select import default_select

    exact, select = approx.exact, default_select("cpu")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    speed = None
    for name in mechanisms:
        for eps in epsilons:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mechanism = token_mechanism(name, table, eps, delta)
            noisy = mechanism.perturb(table.clipped[ids], gen)  # the same vectors for both searches
            want = exact.nearest(noisy, topk, select=select)
            got = approx.nearest(noisy, topk)
            rows.append({
                "mechanism": name, "eps": eps, "tokens": int(ids.numel()),
                "identical": float((got == want).double().mean()),
                "nw_exact": float((want == ids).double().mean()),
                "nw_approx": float((got == ids).double().mean()),
            })
            rows[-1]["nw_gap"] = rows[-1]["nw_approx"] - rows[-1]["nw_exact"]
            if speed is None:  # timing on the first mechanism's noise (512 queries = one prompt)
                batch = noisy[:queries]
                exact.nearest(batch, topk, select=select), approx.nearest(batch, topk)  # warm-up
                exact_ms, approx_ms = [], []
                for _ in range(repeats):  # interleaved: the shared CPU's load hits both alike
                    exact_ms.append(_ms(lambda b=batch: exact.nearest(b, topk, select=select)))
                    approx_ms.append(_ms(lambda b=batch: approx.nearest(b, topk)))
                speed = {"queries": int(batch.shape[0]), "mechanism": name, "eps": eps,
                         "exact_ms": statistics.median(exact_ms), "approx_ms": statistics.median(approx_ms),
                         "exact_ms_runs": exact_ms, "approx_ms_runs": approx_ms}
    worst = max(abs(r["nw_gap"]) for r in rows)
    return {"search": approx.kind, "index": approx.describe(), "speed": speed, "rows": rows,
            "max_nw_gap": worst, "verdict": "PASS" if worst <= MAX_NW_GAP else "FAIL"}


def model_table(model: str):
    """(tokenizer, ``EmbeddingTable``, ``TableInfo``) of ``model`` as its server builds them
    (``serving.prompt_table``: candidates, centring and clipping of the default ``PromptPrivacyConfig``)."""
    from transformers import AutoTokenizer

    from vllm_dp_plugin.serving.prompt_table import (
        build_table,
        load_embedding_matrix,
        special_token_ids,
    )

    tokenizer = AutoTokenizer.from_pretrained(model)
    table, info = build_table(load_embedding_matrix(model), len(tokenizer), special_token_ids(tokenizer),
                              PromptPrivacyConfig())
    return tokenizer, table, info


def model_comparison(model: str, search: str, *, tokens: int = 4096, **kw) -> dict:
    """``compare`` on ``model``'s own table (``model_table``) with a fresh ``search`` index."""
    tokenizer, table, info = model_table(model)
    start = time.perf_counter()
    approx = ApproximateIndex.build(candidate_index(table), search)
    built = time.perf_counter() - start
    out = compare(table, approx, english_ids(tokenizer, tokens), **kw)
    out["table"] = info.describe()
    out["build_s"] = built
    return out


def markdown(result: dict) -> list[str]:
    """The report's section (lines)."""
    speed = result["speed"]
    lines = [
        f"## Search: exact vs `{result['search']}` on the same noisy vectors", "",
        (f"Index: {result['index']}, built in {result['build_s']:.1f} s at start-up. Table: {result['table']}. "
         f"Text: {result['rows'][0]['tokens']} tokens of English prose (`pydoc_data.topics`, seeded), every token "
         "noised once per row; both searches project the same noisy vectors (pure torch + faiss, no vLLM)."), "",
        (f"Search alone, {speed['queries']} queries ({speed['mechanism']}, eps {speed['eps']:g}), median of "
         f"{len(speed['exact_ms_runs'])} interleaved calls: exact **{speed['exact_ms']:.1f} ms**, "
         f"{result['search']} **{speed['approx_ms']:.1f} ms** ({speed['exact_ms'] / speed['approx_ms']:.2f}x)."), "",
        "| mechanism | eps / token | identical outputs | N_w exact | N_w approx | difference (pp) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['mechanism']} | {r['eps']:g} | {r['identical']:.4f} | {r['nw_exact']:.4f} | "
                     f"{r['nw_approx']:.4f} | {100 * r['nw_gap']:+.2f} |")
    lines += ["", (f"Largest N_w difference: {100 * result['max_nw_gap']:.2f} pp (target <= {100 * MAX_NW_GAP:.0f} pp): "
                   f"{result['verdict']}."), ""]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.lib.prompt_search --search hnsw``: the section alone."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.lib.prompt_search",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".models/smollm2-135m-instruct")
    parser.add_argument("--search", choices=("hnsw", "ivf"), default="ivf")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of English text")
    args = parser.parse_args(argv)
    print("\n".join(markdown(model_comparison(args.model, args.search, tokens=args.tokens))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
