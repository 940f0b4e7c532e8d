"""What one run of ``vllm-dp bench prompt-answers`` measures (``Settings``) and the engine it starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import DEFAULT_OUT
from vllm_dp_plugin.benchmarks.lib.scenarios import ANSWER_TOKENS, DEFAULT_MODEL, DEFAULT_SCENARIOS

DEFAULT_EPS = (5.0, 10.0, 20.0, 50.0, 100.0, 200.0)


@dataclass
class Settings:
    model: str = DEFAULT_MODEL
    scenarios: str = str(DEFAULT_SCENARIOS)
    out: Path = DEFAULT_OUT
    mechanisms: tuple[str, ...] | None = None  # None: every registered privatizer (``PRIVATIZERS``)
    epsilons: tuple[float, ...] = DEFAULT_EPS
    limit: int | None = None  # first N scenarios (None: all)
    seed: int = 0
    delta: float = 1e-6
    max_tokens: int = ANSWER_TOKENS
    quick: bool = False
    progress: bool = True
    append: bool = False
    date: str = ""
    command: str = ""

    @staticmethod
    def quick_defaults() -> dict:
        """Smoke-test sizes: no mechanism that needs a 49k^2 diameter, 3 scenarios."""
        return {"mechanisms": ("laplace", "trlap_corrected"), "epsilons": (20.0, 200.0), "limit": 3}
