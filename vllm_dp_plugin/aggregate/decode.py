"""Lockstep decoding of one query: ``k`` member sequences and one public sequence, one token a
step, each step chosen by ``Aggregator`` and appended to every sequence.

What reaches the caller is the chosen tokens and how many steps spent budget: a function of the
DP choices and public quantities only (the gate's and the mechanism's outcomes). The members'
distributions never leave ``Aggregator.step``.

``source`` is the engine: ``await source(prompts)`` returns, for each prompt (token ids), the
``TopLogprobs`` of its next token (``serving.aggregate`` asks vLLM; ``torch_source`` a torch
model, for tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..privacy.accountant import Budget
from ..privacy.aggregation import (
    AggregationParams,
    SparseVector,
    clipped_mixture,
    disagreement,
    exponential_mechanism,
    vote_counts,
)


@dataclass(frozen=True)
class TopLogprobs:
    """A sequence's next-token log-probabilities, its top ``N`` tokens, best first:
    ``ids: [N]``, ``logprobs: [N]``."""

    ids: np.ndarray
    logprobs: np.ndarray

    @classmethod
    def of(cls, pairs: dict[int, float]) -> TopLogprobs:
        return cls.sorted(np.array(list(pairs), dtype=np.int64), np.array(list(pairs.values()), dtype=np.float64))

    @classmethod
    def sorted(cls, ids: np.ndarray, logprobs: np.ndarray) -> TopLogprobs:
        """From unsorted ``ids: [N]``, ``logprobs: [N]`` (best first after sorting; ties by id)."""
        ids, logprobs = np.asarray(ids, dtype=np.int64), np.asarray(logprobs, dtype=np.float64)
        order = np.lexsort((ids, -logprobs))
        return cls(ids[order], logprobs[order])

    @property
    def top(self) -> int:
        return int(self.ids[0])

    def lookup(self, tokens: np.ndarray) -> np.ndarray:
        """``[K]`` log-probabilities of ``tokens``; a token outside the top ``N`` gets the
        smallest one listed (an upper bound on its own, computed from this sequence alone)."""
        where = dict(zip(self.ids.tolist(), self.logprobs.tolist()))
        floor = float(self.logprobs[-1])
        return np.array([where.get(int(t), floor) for t in tokens], dtype=np.float64)


@dataclass(frozen=True)
class Step:
    token: int
    private: bool  # this step spent budget (gate said yes, the mechanism chose)


class Aggregator:
    """The DP choice of each step of one query (``params``; ``rng``: fresh randomness)."""

    def __init__(self, params: AggregationParams, rng: np.random.Generator):
        self.params, self.rng = params, rng
        self.private_steps = 0
        self.gate_open = False  # the current gate instance answered no since its last yes
        members = params.members
        self._gate = SparseVector(params.threshold * members, params.eps_gate, rng) if params.gated else None

    def step(self, public: TopLogprobs, members: Sequence[TopLogprobs]) -> Step:
        p = self.params
        if len(members) != p.members:
            raise ValueError(f"expected {p.members} member distributions, got {len(members)}")
        if self.private_steps >= p.max_private_tokens or np.exp(public.logprobs[0]) >= p.confidence:
            return Step(public.top, False)
        tops = np.array([m.top for m in members])
        if self._gate is not None:
            if not self._gate.above(disagreement(tops, public.top)):
                self.gate_open = True
                return Step(public.top, False)
            self.gate_open = False
        candidates = public.ids[: p.candidates]
        if p.mechanism == "vote":
            index = exponential_mechanism(vote_counts(tops, candidates), p.sensitivity, p.eps_select, self.rng,
                                          base=public.logprobs[: p.candidates])
        else:
            own = np.stack([m.lookup(candidates) for m in members])  # [k, K]
            scores = clipped_mixture(own, public.logprobs[: p.candidates], p.clip)
            index = exponential_mechanism(scores, p.sensitivity, p.eps_select, self.rng)
        self.private_steps += 1
        return Step(int(candidates[index]), True)

    def settlement(self) -> Budget:
        """What this query settles in the ledger (and states in its receipt): its private steps
        and an open gate instance, charged within the reserved ``params.worst_case``
        (``AggregationParams.settlement``)."""
        return self.params.settlement(self.private_steps, self.gate_open)


Source = Callable[[list[list[int]]], Awaitable[list[TopLogprobs]]]


async def generate(source: Source, public_prompt: Sequence[int], member_prompts: Sequence[Sequence[int]],
                   aggregator: Aggregator, max_tokens: int, stop_ids: Sequence[int] = ()) -> AsyncIterator[Step]:
    """Yield each step until a stop token (yielded too) or ``max_tokens`` steps."""
    prompts = [list(public_prompt), *(list(m) for m in member_prompts)]
    stops = {int(s) for s in stop_ids}
    for _ in range(max_tokens):
        dists = await source(prompts)
        step = aggregator.step(dists[0], dists[1:])
        yield step
        if step.token in stops:
            return
        for prompt in prompts:
            prompt.append(step.token)
