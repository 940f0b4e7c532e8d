"""The certified int8 pass against the certified fp32 pass on a served model's own table (pure
torch, no vLLM): the section ``python -m benchmarks.prompt_ttft`` adds to its report.

Real English text (``prompt_search.english_ids``) tokenised by the model's tokenizer, every
token's clipped embedding noised by ``trlap_corrected`` at each per-token eps of ``EPSILONS``
until ``queries`` noisy vectors exist; both passes project the same vectors. Reported: whether
every answer is identical (both are certified to equal float64 brute force, so any difference is a
bug), and the time of each pass on 512 queries (one 512-token prompt), interleaved, median of
``repeats`` calls.
"""

from __future__ import annotations

import statistics
import time

import torch

from vllm_dp_plugin.prompt.mechanisms import token_mechanism
from vllm_dp_plugin.prompt.privatizer import candidate_index

EPSILONS = (1.0, 10.0, 50.0, 200.0)  # per token: from far from every row to mostly preserved
DTYPES = {"float32": torch.float32, "int8": torch.int8}


def compare(model: str, *, queries: int = 10240, repeats: int = 5, seed: int = 0) -> dict:
    """Identical answers of the int8 and fp32 passes on ``queries`` noisy vectors of ``model``'s
    table, and their speed on 512 of them."""
    from benchmarks.lib.prompt_search import english_ids, model_table

    tokenizer, table, info = model_table(model)
    indexes = {name: candidate_index(table, dtype) for name, dtype in DTYPES.items()}
    ids = english_ids(tokenizer, -(-queries // len(EPSILONS)), seed)
    gen = torch.Generator().manual_seed(seed)
    noisy = torch.cat([token_mechanism("trlap_corrected", table, eps, 1e-6).perturb(table.clipped[ids], gen)
                       for eps in EPSILONS])[:queries]
    answers = {name: index.nearest(noisy) for name, index in indexes.items()}
    runs = {name: [] for name in DTYPES}
    for _ in range(repeats):
        for name, index in indexes.items():
            start = time.perf_counter()
            index.nearest(noisy[:512])
            runs[name].append(1e3 * (time.perf_counter() - start))
    return {"table": info.describe(), "queries": int(noisy.shape[0]), "epsilons": list(EPSILONS),
            "identical": bool(torch.equal(answers["float32"], answers["int8"])),
            "differing": int((answers["float32"] != answers["int8"]).sum()),
            "ms_runs": runs, "ms": {name: statistics.median(r) for name, r in runs.items()},
            "threads": torch.get_num_threads()}


def markdown(result: dict) -> list[str]:
    """The report's section (lines)."""
    ms = result["ms"]
    return [
        "## Nearest-candidate search: certified int8 pass vs certified fp32 pass", "",
        (f"Table: {result['table']}. {result['queries']:,} noisy vectors of English prose (`trlap_corrected`, "
         f"eps {', '.join(f'{e:g}' for e in result['epsilons'])} per token, a quarter each), projected by both "
         f"passes (pure torch, {result['threads']} threads, no vLLM): identical answers: "
         f"**{'yes' if result['identical'] else 'NO'}** ({result['differing']} differ)."), "",
        (f"One 512-token prompt's search, median of {len(result['ms_runs']['int8'])} interleaved calls: "
         f"fp32 **{ms['float32']:.1f} ms**, int8 **{ms['int8']:.1f} ms** ({ms['float32'] / ms['int8']:.2f}x)."), "",
    ]
