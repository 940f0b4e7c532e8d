"""A stand-in for vLLM's engine client in DP aggregation tests: records every sub-request and
answers with a deterministic next-token distribution (a function of the prompt's ids), in the
shape ``serving.aggregate.EngineSource`` reads (``FlatLogprobs`` of position 0). Like vLLM, it
refuses a prompt longer than ``max_model_len`` with an error that names the prompt's length:
the leak the service must never pass on; and an empty prompt."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np


@dataclass
class FakeEngine:
    vocab: int
    max_model_len: int
    fail: bool = False  # every sub-request raises (an engine error inside a query)
    calls: list[dict] = field(default_factory=list)  # {"ids", "cache_salt", "request_id", "params"} per sub-request
    # a generation longer than one token (mechanism answer: members, the public answer): its text
    write: Callable[[list[int]], str] = lambda ids: "NONE"
    # the text's token ids (a tokenizer's encode; members are read from their ids); the ids of an
    # ``ignore_eos`` request are the text's, then ``eos``, then ``filler``, to ``max_tokens``
    encode: Callable[[str], list[int]] | None = None
    eos: int = 2
    filler: int = 3

    def logprobs(self, ids: list[int]) -> np.ndarray:
        """``[vocab]`` log-probabilities of the next token: seeded by the prompt's ids."""
        seed = int.from_bytes(hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()[:8], "big")
        scores = np.random.default_rng(seed).normal(0.0, 3.0, self.vocab)
        return scores - np.logaddexp.reduce(scores)

    async def generate(self, prompt: dict, params, request_id: str):
        ids = list(prompt["prompt_token_ids"])
        self.calls.append({"ids": ids, "cache_salt": prompt.get("cache_salt"), "request_id": request_id,
                           "params": params})
        await asyncio.sleep(0)
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        if self.fail or len(ids) >= self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                             f"of {self.max_model_len}.")
        if params.max_tokens > 1:
            text = self.write(ids)[: 8 * params.max_tokens]
            tokens = self.encode(text) if self.encode else list(range(len(text.split())))
            if params.ignore_eos:  # like vLLM: the end token does not stop it, max_tokens does
                tokens = ([*tokens, self.eos] + [self.filler] * params.max_tokens)[: params.max_tokens]
            out = SimpleNamespace(text=text, token_ids=tokens, finish_reason="length" if params.ignore_eos else "stop")
            yield SimpleNamespace(outputs=[out])
            return
        lp = self.logprobs(ids)
        n = self.vocab if params.logprobs == -1 else params.logprobs
        top = np.argsort(-lp, kind="stable")[:n]
        flat = SimpleNamespace(start_indices=[0], end_indices=[len(top)], token_ids=top.tolist(),
                               logprobs=lp[top].tolist())
        yield SimpleNamespace(outputs=[SimpleNamespace(logprobs=flat)])
