"""The served DP modes ``vllm-dp bench fuzz`` runs, each a ``dp_privacy`` section (from the
bundled examples, with the key and ledgers in the run's work directory and the generation
bounded) and what it keeps private (``checks.Private``), computed with the served tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dp_plugin.benchmarks.fuzz.checks import Private

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
AGGREGATE_EXAMPLE = EXAMPLES / "serve-smollm2-aggregate.yaml"
ATTENTION_EXAMPLE = EXAMPLES / "serve-smollm2.yaml"
# DP aggregation's own caps on a response (the example's defaults: 256 and 32 tokens)
AGGREGATE_MAX_TOKENS = 16
AGGREGATE_ANSWER_TOKENS = 8


@dataclass(frozen=True)
class Mode:
    """One served mode: its ``dp_privacy`` section, what it keeps private, and the ``vllm_xargs``
    DP options with the values a client of it sends (``runner``'s ``dp`` cases; empty: none)."""

    name: str
    section: dict
    private: Private
    private_requests: bool = False  # the clients' prompts are private (prompt privatization)
    options: dict = field(default_factory=dict)

    def write_config(self, work: Path) -> Path:
        path = work / f"dp-{self.name}.json"
        path.write_text(json.dumps({"dp_privacy": self.section}, indent=1))
        return path


def _count(tokenizer):
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def aggregate_mode(work: Path, tokenizer, max_model_len: int, total_epsilon: float | None = None) -> Mode:
    """DP aggregation (``examples/serve-smollm2-aggregate.yaml``, ``mechanism: answer``; its
    ``total_epsilon`` unless given): the collection's documents, ids and numbers (how many, each
    one's characters and tokens, each member prompt's tokens, the totals) are private."""
    from vllm_dp_plugin.config import parse_section, section_from_file
    from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
    from vllm_dp_plugin.serving.aggregate import load_collections, member_bound

    section = section_from_file(AGGREGATE_EXAMPLE)
    section["key_file"] = str(work / "noise-aggregate.key")
    section["aggregate"].update(max_tokens=AGGREGATE_MAX_TOKENS, answer_tokens=AGGREGATE_ANSWER_TOKENS,
                                budget_file=str(work / "queries-aggregate.jsonl"))
    if total_epsilon is not None:
        section["aggregate"]["total_epsilon"] = total_epsilon
    cfg = parse_section(section).aggregate
    count, bound = _count(tokenizer), member_bound(cfg, max_model_len)
    served = load_collections(cfg, tokenizer, NoiseKey(section["key_file"]), bound)
    docs = [json.loads(line) for path in cfg.collection_sources().values()
            for line in Path(path).read_text().splitlines() if line.strip()]
    texts = [d["text"] for d in docs]
    prefixes = [len(p) for c in served for p in c.member_prefixes]
    derived = [len(docs), sum(map(len, texts)), sum(map(count, texts)), sum(prefixes), *prefixes,
               *map(len, texts), *map(count, texts)]
    public = [max_model_len, bound, cfg.max_tokens, cfg.answer_tokens, cfg.max_document_tokens, cfg.members,
              int(cfg.total_epsilon)]
    epsilons = (cfg.min_epsilon, (cfg.min_epsilon + cfg.epsilon) / 2, cfg.epsilon, cfg.cap)
    options = {"dp_context": tuple(cfg.contexts), "dp_epsilon": epsilons}
    return Mode("aggregate", section, Private.of(texts, [d["id"] for d in docs], derived, public), options=options)


def prompt_mode(work: Path, tokenizer, max_model_len: int) -> Mode:
    """Prompt privatization (``dp_privacy.prompt`` at its defaults): no private documents; the
    clients' prompts are private, so no log line may hold one."""
    from vllm_dp_plugin.prompt.options import PROMPT_MECHANISMS

    section = {"key_file": str(work / "noise-prompt.key"), "prompt": {}}
    options = {"dp_epsilon": (1.0, 10.0, 30.0, 100.0), "dp_mechanism": PROMPT_MECHANISMS, "dp_session": ()}
    return Mode("prompt", section, Private.of([], public=[max_model_len]), private_requests=True, options=options)


def attention_mode(work: Path, tokenizer, max_model_len: int) -> Mode:
    """DP attention (``examples/serve-smollm2.yaml``): the private context's text is private;
    its length P in tokens is public by design (stated in ``/v1/dp/budget``), its length in
    characters is not."""
    from vllm_dp_plugin.config import section_from_file

    section = section_from_file(ATTENTION_EXAMPLE)
    section["key_file"] = str(work / "noise-attention.key")
    section["ledger_file"] = str(work / "releases-attention.jsonl")
    text = Path(section["attention"]["private_context"]).read_text()
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    from vllm_dp_plugin.config import DEFAULT_CONTEXT

    return Mode("attention", section, Private.of([text], derived=[len(text), len(text.strip())],
                                                 public=[max_model_len, tokens]),
                options={"dp_context": (DEFAULT_CONTEXT,)})


MODES = {"aggregate": aggregate_mode, "prompt": prompt_mode, "attention": attention_mode}
