"""What one run of ``python -m benchmarks.prompt`` measures (``Settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import DEFAULT_OUT
from vllm_dp_plugin.prompt import MECHANISMS

DEFAULT_EPS = (1.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


@dataclass
class Settings:
    device: str = "cpu"
    out: Path = DEFAULT_OUT
    mechanisms: tuple[str, ...] = MECHANISMS
    epsilons: tuple[float, ...] = DEFAULT_EPS
    sentences: int = 150
    min_pieces: int = 8
    max_pieces: int = 40
    min_alpha: float = 0.85
    seed: int = 0
    delta: float = 1e-6
    clip_quantile: float = 0.5
    mahalanobis_lambda: float = 0.5
    bootstrap: int = 2000
    batch_size: int = 64
    quick: bool = False
    progress: bool = True
    date: str = ""
    command: str = ""

    @staticmethod
    def quick_defaults() -> dict:
        """Smoke-test sizes (< 60 s on 2 CPU cores): no mechanism that needs the 30k^2 diameter."""
        return {"mechanisms": ("trlap_corrected", "trlap_paper"), "epsilons": (1.0, 20000.0), "sentences": 40}
