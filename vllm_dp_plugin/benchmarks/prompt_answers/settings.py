"""What one run of ``vllm-dp bench prompt-answers`` measures (``Settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..lib.cli import DEFAULT_OUT
from ..lib.scenarios import ANSWER_TOKENS, DEFAULT_MODEL, DEFAULT_SCENARIOS

# --quick: smoke-test sizes, no mechanism that needs a 49k^2 diameter, 3 scenarios
QUICK = {"mechanisms": ("laplace", "trlap_corrected"), "epsilons": (20.0, 200.0), "limit": 3}


@dataclass
class Settings:
    model: str = DEFAULT_MODEL
    scenarios: str = str(DEFAULT_SCENARIOS)
    out: Path = DEFAULT_OUT
    mechanisms: tuple[str, ...] | None = None  # None: every registered privatizer (``PRIVATIZERS``)
    epsilons: tuple[float, ...] = (5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
    limit: int | None = None  # first N scenarios (None: all)
    seed: int = 0
    delta: float = 1e-6
    max_tokens: int = ANSWER_TOKENS
    quick: bool = False
    progress: bool = True
    append: bool = False
    date: str = ""
    command: str = ""
