"""Receipts: the privacy accounting of one prompt. ``PromptReceipt`` states the per-token
guarantee, how many tokens were privatized in this prompt, how many of them were noised now (the
budget this request spent) versus reused from the cache, and the composition (basic, advanced
and the smaller) over both counts. It contains no text, no ids and nothing about the noise seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..privacy.accountant import Budget
from .privatizer import PrivacyReceipt


def _budget_json(budget: Budget) -> dict:
    return {"epsilon": _finite(budget.epsilon), "delta": _finite(budget.delta)}


def _finite(value: float) -> float | str:
    """Strict-JSON number: ``inf`` (no guarantee) becomes the string ``"inf"``."""
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def _composition(receipt: PrivacyReceipt) -> dict:
    return {
        "basic": _budget_json(receipt.basic),
        "advanced": _budget_json(receipt.advanced),
        "min": _budget_json(receipt.total),
    }


@dataclass(frozen=True)
class PromptReceipt:
    """What privatizing one prompt spent. ``prompt`` composes the per-token guarantee over all
    ``tokens_privatized`` private tokens of the prompt (its protection as a whole); ``spent`` over
    the ``tokens_new`` tokens noised by this request (``tokens_reused`` came from the history
    cache and were paid for by the request that first privatized them)."""

    mode: str
    mechanism: str
    valid: bool
    statement: str
    epsilon_token: float
    delta_token: float
    tokens_privatized: int
    tokens_new: int
    tokens_reused: int
    prompt: PrivacyReceipt
    spent: PrivacyReceipt

    def to_json(self) -> dict:
        """Strict-JSON dict (no text, no token ids): what responses and logs carry."""
        return {
            "mode": self.mode,
            "mechanism": self.mechanism,
            "valid": self.valid,
            "epsilon_token": _finite(self.epsilon_token),
            "delta_token": _finite(self.delta_token),
            "tokens_privatized": self.tokens_privatized,
            "tokens_new": self.tokens_new,
            "tokens_reused": self.tokens_reused,
            "prompt_total": _composition(self.prompt),
            "spent": _composition(self.spent),
            "statement": self.statement,
        }
