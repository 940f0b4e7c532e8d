"""vllm-dp: differentially private LLM serving as a vLLM plugin.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process it
starts (API server, engine core, workers), so it is idempotent and imports vLLM lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """vLLM general-plugin hook; idempotent, imports nothing from vLLM.

    Installs nothing yet: the DP components (attention backend, private-context renderer,
    budget endpoint) register here as they land, and act only when ``dp_privacy`` is
    configured. Until then a loaded plugin leaves vLLM's behaviour unchanged.
    """
    global _registered
    _registered = True
