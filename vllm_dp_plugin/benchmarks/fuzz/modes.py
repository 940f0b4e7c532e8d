"""The served DP modes ``vllm-dp bench fuzz`` runs, each a ``dp_privacy`` section (from the
bundled examples, with the key and ledgers in the run's work directory and the generation
bounded) and what it keeps private (``checks.Private``), computed with the served tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    """One served mode: its ``dp_privacy`` section and what it keeps private."""

    name: str
    section: dict
    private: Private
    private_requests: bool = False  # the clients' prompts are private (prompt privatization)

    def write_config(self, work: Path) -> Path:
        path = work / f"dp-{self.name}.json"
        path.write_text(json.dumps({"dp_privacy": self.section}, indent=1))
        return path


def _count(tokenizer):
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def aggregate_mode(work: Path, tokenizer, max_model_len: int) -> Mode:
    """DP aggregation (``examples/serve-smollm2-aggregate.yaml``, ``mechanism: answer``): the
    collection's documents, ids and numbers (how many, each one's characters and tokens, each
    member prompt's tokens, the totals) are private."""
    from vllm_dp_plugin.config import parse_section, section_from_file
    from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
    from vllm_dp_plugin.serving.aggregate import load_collections, member_bound

    section = section_from_file(AGGREGATE_EXAMPLE)
    section["key_file"] = str(work / "noise-aggregate.key")
    section["aggregate"].update(max_tokens=AGGREGATE_MAX_TOKENS, answer_tokens=AGGREGATE_ANSWER_TOKENS,
                                budget_file=str(work / "queries-aggregate.jsonl"))
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
    return Mode("aggregate", section, Private.of(texts, [d["id"] for d in docs], derived, public))


def prompt_mode(work: Path, tokenizer, max_model_len: int) -> Mode:
    """Prompt privatization (``dp_privacy.prompt`` at its defaults): no private documents; the
    clients' prompts are private, so no log line may hold one."""
    section = {"key_file": str(work / "noise-prompt.key"), "prompt": {}}
    return Mode("prompt", section, Private.of([], public=[max_model_len]), private_requests=True)


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
    return Mode("attention", section, Private.of([text], derived=[len(text), len(text.strip())],
                                                 public=[max_model_len, tokens]))


MODES = {"aggregate": aggregate_mode, "prompt": prompt_mode, "attention": attention_mode}
