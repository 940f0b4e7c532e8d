"""The operator's private context: its tokens, its id, and how requests are laid out around it.

The renderer (API process) and the attention backend (workers) both call ``load_private_context``
so that they agree on the tokens, their number P and the context id without talking to each
other. The id keys the noise; it covers the model, the DP configuration and the tokens, so the
same text served by another model or under other bounds draws independent noise (two releases
sharing noise over different exact states would leak their difference).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..privacy.keyed_noise import context_id


@dataclass(frozen=True)
class PrivateContext:
    """``token_ids`` occupy positions ``[0, P)`` of every request; ``context_id`` keys the noise."""

    token_ids: tuple[int, ...]
    context_id: str
    bos_token_id: int | None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def prepend(self, prompt_ids: list[int]) -> list[int]:
        """``private ids + prompt ids`` with the prompt's own leading BOS dropped (the private
        context already starts the sequence). Raises if nothing public would remain: the first
        generated token would then come from a private position."""
        ids = list(prompt_ids)
        if ids and self.bos_token_id is not None and ids[0] == self.bos_token_id:
            ids = ids[1:]
        if not ids:
            raise ValueError("the prompt is empty: at least one public token must follow the private context")
        return [*self.token_ids, *ids]


def tokenize_context(text: str, tokenizer) -> list[int]:
    """The context's ids: BOS (if the tokenizer has one) + the text, no other special tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return ids if bos is None else [bos, *ids]


@functools.lru_cache(maxsize=4)
def load_private_context(path: str, tokenizer_name: str, model_name: str, dp_config_json: str) -> PrivateContext:
    """Read and tokenize ``path`` with ``tokenizer_name``'s HF tokenizer (cached per process)."""
    from transformers import AutoTokenizer

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"attention.private_context: no such file {path!r}")
    text = file.read_text(encoding="utf-8")
    if not text.strip():
        raise ConfigError(f"attention.private_context: {path!r} is empty")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    ids = tokenize_context(text, tokenizer)
    ident = context_id(json.dumps({"model": model_name, "dp_privacy": json.loads(dp_config_json), "ids": ids}))
    return PrivateContext(tuple(ids), ident, tokenizer.bos_token_id)
