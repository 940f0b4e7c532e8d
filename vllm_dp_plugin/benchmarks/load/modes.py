"""The served modes of a load run and the ``vllm-dp serve`` command of each.

* ``none``: no ``--dp-config`` (the baseline);
* ``aggregate``: ``examples/serve-smollm2-aggregate.yaml`` (DP aggregation; served with a
  collection total instead of its per-document budgets, set per run, and no reuse, so that it
  runs out part-way and the 429 boundary is crossed under load);
* ``prompt``: prompt privatization with its defaults (``prompt: {}``);
* ``attention``: ``examples/serve-smollm2.yaml`` (DP attention over the bundled context).

Every config gets a fresh ``key_file`` (and so a fresh query / release ledger) in the work
directory."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.vllm import VLLM_DP, engine_flags
from vllm_dp_plugin.config import section_from_file

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MODES = ("aggregate", "none", "prompt", "attention")
EXAMPLE_CONFIGS = {"aggregate": "serve-smollm2-aggregate.yaml", "attention": "serve-smollm2.yaml"}


def dp_section(mode: str, key_file: Path, total_queries: int | None = None, answer_tokens: int | None = None) -> dict | None:
    """The ``dp_privacy`` section of ``mode`` (None for ``none``), paths absolute. ``aggregate``:
    ``total_queries`` sets the collection's total to that many worst-case queries (epsilon;
    delta gets twice as much room, so epsilon is what runs out), ``answer_tokens`` bounds each
    member's answer."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if mode == "none":
        return None
    if mode == "prompt":
        return {"key_file": str(key_file), "prompt": {}}
    raw = section_from_file(EXAMPLES / EXAMPLE_CONFIGS[mode])
    raw["key_file"] = str(key_file)
    if mode == "aggregate":
        agg = raw["aggregate"]
        if total_queries is not None:  # at least one query at the cap (the config's own check)
            for name in ("per_document_epsilon", "per_document_delta"):  # a collection total that runs out
                agg.pop(name, None)
            agg["reuse_answers"] = False  # every query a release: the load crosses the 429 boundary
            agg["total_epsilon"] = max(agg["epsilon"] * total_queries, agg.get("max_epsilon") or agg["epsilon"])
            agg["total_delta"] = min(2 * agg["delta"] * total_queries, 0.5)
        if answer_tokens is not None:
            agg["answer_tokens"] = answer_tokens
    return raw


def server_command(mode: str, model: str, work: Path, concurrency: int, max_model_len: int,
                   total_queries: int | None = None, answer_tokens: int | None = None) -> list[str]:
    """``vllm-dp serve model [--dp-config work/<mode>.json] <engine flags>``: a KV cache for
    ``concurrency`` sequences of ``max_model_len`` tokens."""
    section = dp_section(mode, work / f"{mode}-noise.key", total_queries, answer_tokens)
    config = []
    if section is not None:
        path = work / f"{mode}.json"
        path.write_text(json.dumps({"dp_privacy": section}, indent=1))
        config = ["--dp-config", str(path)]
    return [*VLLM_DP, "serve", model, *config, *engine_flags(model, concurrency, max_model_len=max_model_len)]
