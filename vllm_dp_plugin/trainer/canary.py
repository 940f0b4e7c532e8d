"""The secret sharer test (Carlini et al. 2019): random secrets ("canaries") inserted once or a
few times into the training data, and how far a trained model ranks the true secret ahead of
every other candidate.

A canary is ``"{prefix} {secret}."`` with a uniformly random ``digits``-digit secret; the
candidate space is all ``10**digits`` secrets. Each candidate is scored by its negative
log-likelihood after the prefix (the prefix is common to all, so this orders them as the
sequence's log-perplexity does); ``rank`` is 1 + the number of candidates scored strictly
better than the true secret, and ``exposure = log2(10**digits) - log2(rank)`` bits. A model that
learnt nothing about the secret puts it at a uniformly random rank: exposure >= x then has
probability ``rank / 10**digits = 2**-x`` (``chance_p``; mean exposure log2(e) ~ 1.44 bits).

Each repetition of a canary is its own document, hence its own training record: under DP for
one record, a canary inserted k times is protected with group privacy (k times the budget).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .engine import causal_lm_per_sample_loss

NAMES = ("Alice Moreau", "Bilal Okafor", "Chen Wei", "Dana Kowalski", "Emeka Adeyemi", "Farah Haddad",
         "Goran Petrovic", "Hana Sato", "Ines Duarte", "Jonas Lindqvist", "Kavya Iyer", "Luca Bianchi")


@dataclass(frozen=True)
class Canary:
    """``text = "{prefix} {secret}."``, inserted ``repetitions`` times."""

    prefix: str
    secret: str
    repetitions: int

    @property
    def text(self) -> str:
        return f"{self.prefix} {self.secret}."


def make_canaries(repetitions: Sequence[int], per_level: int = 2, digits: int = 4, seed: int = 0) -> list[Canary]:
    """``per_level`` canaries for each repetition count, each with its own person and a uniformly
    random secret (``random.Random(seed)``: the secrets are the experiment's, not private data)."""
    count = per_level * len(repetitions)
    if count > len(NAMES):
        raise ValueError(f"at most {len(NAMES)} canaries, asked for {count}")
    rng = random.Random(seed)
    reps = [k for k in repetitions for _ in range(per_level)]
    return [Canary(f"{name}'s PIN is", "".join(rng.choice("0123456789") for _ in range(digits)), k)
            for name, k in zip(NAMES, reps, strict=False)]


def insert_canaries(docs: Sequence[str], canaries: Sequence[Canary], seed: int = 0) -> list[str]:
    """``docs`` plus each canary's text as ``repetitions`` separate documents, shuffled."""
    out = list(docs) + [c.text for c in canaries for _ in range(c.repetitions)]
    random.Random(seed).shuffle(out)
    return out


def rank_of(nll: torch.Tensor, secret: int) -> int:
    """1 + the number of candidates with strictly smaller ``nll: [C]`` than candidate ``secret``."""
    return 1 + int((nll < nll[secret]).sum())


def exposure(rank: int, candidates: int) -> float:
    """``log2(candidates) - log2(rank)`` bits (0 for the last rank, log2(candidates) for the first)."""
    if not 1 <= rank <= candidates:
        raise ValueError(f"rank must lie in [1, {candidates}], got {rank}")
    return math.log2(candidates) - math.log2(rank)


def canary_ids(tokenizer, canary: Canary) -> tuple[list[int], list[int]]:
    """``(context, digit_ids)``: the token ids before the secret (bos included) and the id of
    each digit 0-9, such that the canary's text tokenizes as ``context + digits + rest`` for every
    candidate secret (ValueError for a tokenizer that does not split digits)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    n = len(canary.secret)
    probe = tokenizer.encode(f"{canary.prefix} 0123456789", add_special_tokens=False)
    context, digit_ids = bos + probe[:-10], probe[-10:]
    for candidate in (canary.secret, "0" * n, "9" * n):
        ids = bos + tokenizer.encode(f"{canary.prefix} {candidate}.", add_special_tokens=False)
        if ids[: len(context) + n] != context + [digit_ids[int(d)] for d in candidate]:
            raise ValueError(f"the tokenizer does not give {canary.prefix!r} + one token per digit: "
                             "the digit-tree scoring needs single-digit tokens")
    return context, digit_ids


@torch.no_grad()
def secret_nll(model, context: list[int], digit_ids: list[int], digits: int) -> torch.Tensor:
    """``[10**digits]`` float64: ``-log p(d_1 .. d_n | context)`` of every candidate (index =
    the secret read as an integer), by the digit tree: one forward of the context, then one token
    per node of each level with the parent's KV cache (10 + 100 + ... + 10**(n-1) tokens)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    tokens = torch.tensor(digit_ids, device=device)
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([context], device=device), past_key_values=cache, use_cache=True)
    nll = torch.zeros(1, dtype=torch.float64, device=device)  # [10**level], parents in index order
    for level in range(digits):
        logp = torch.log_softmax(out.logits[:, -1].double(), -1)[:, tokens]  # [10**level, 10]
        nll = (nll[:, None] - logp).reshape(-1)  # child index = parent * 10 + digit
        if level + 1 == digits:
            break
        cache.batch_repeat_interleave(10)
        step = tokens.repeat(10**level)[:, None]  # [10**(level+1), 1]: each parent's 10 children
        out = model(input_ids=step, past_key_values=cache, use_cache=True)
    return nll


def canary_exposure(model, tokenizer, canary: Canary) -> dict:
    """Rank and exposure of ``canary``'s secret among all candidates under ``model``."""
    context, digit_ids = canary_ids(tokenizer, canary)
    nll = secret_nll(model, context, digit_ids, len(canary.secret))
    rank = rank_of(nll, int(canary.secret))
    return {"prefix": canary.prefix, "repetitions": canary.repetitions, "rank": rank, "candidates": nll.numel(),
            "exposure": exposure(rank, nll.numel()), "chance_p": rank / nll.numel()}


@torch.no_grad()
def perplexity(model, records, batch_size: int = 16) -> float:
    """Token-level perplexity ``exp(sum NLL / tokens)`` of ``records`` (``train.Records``)."""
    total, tokens = 0.0, 0
    for start in range(0, len(records), batch_size):
        index = torch.arange(start, min(start + batch_size, len(records)))
        logits = model(**records.batch(index)).logits
        labels = records.labels[index]
        mean = causal_lm_per_sample_loss(logits, labels)
        count = (labels[:, 1:] != -100).sum(1)
        total += float((mean.double() * count).sum())
        tokens += int(count.sum())
    return math.exp(total / tokens)
