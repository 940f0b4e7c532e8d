"""A ``decode.Source`` over a Hugging Face causal LM (tests and offline studies): the prompts of
one query batched (left-padded) with a KV cache, one token a step, top-``N`` log-probabilities
as vLLM returns them (raw model log-softmax)."""

from __future__ import annotations

import numpy as np
import torch

from .decode import TopLogprobs


class TorchSource:
    def __init__(self, model, top_n: int = 20, pad_id: int = 0):
        self.model, self.top_n, self.pad_id = model, top_n, pad_id
        self._seen: list[list[int]] | None = None
        self._cache = None
        self._mask: torch.Tensor | None = None

    async def __call__(self, prompts: list[list[int]]) -> list[TopLogprobs]:
        with torch.no_grad():
            return self._next(prompts)

    def _next(self, prompts: list[list[int]]) -> list[TopLogprobs]:
        if self._extends(prompts):
            new = torch.tensor([[p[-1]] for p in prompts])
            self._mask = torch.cat([self._mask, torch.ones(len(prompts), 1, dtype=self._mask.dtype)], dim=1)
        else:
            width = max(len(p) for p in prompts)
            new = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])
            self._mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            self._cache = None
        positions = (self._mask.cumsum(dim=1) - 1).clamp(min=0)[:, -new.shape[1]:]
        out = self.model(input_ids=new, attention_mask=self._mask, position_ids=positions,
                         past_key_values=self._cache, use_cache=True)
        self._cache, self._seen = out.past_key_values, [list(p) for p in prompts]
        logprobs = torch.log_softmax(out.logits[:, -1].double(), dim=-1)
        values, ids = logprobs.topk(self.top_n, dim=-1)
        return [TopLogprobs(i.numpy().astype(np.int64), v.numpy()) for i, v in zip(ids, values)]

    def _extends(self, prompts: list[list[int]]) -> bool:
        return (self._seen is not None and len(prompts) == len(self._seen)
                and all(len(p) == len(s) + 1 and p[:-1] == s for p, s in zip(prompts, self._seen)))
