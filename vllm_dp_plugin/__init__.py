"""vllm-dp: differentially private LLM serving as a vLLM plugin.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process it
starts (API server, engine core, workers), so it is idempotent and imports vLLM lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """vLLM general-plugin hook. Idempotent; installs nothing while DP is not configured.

    The serving components (DP attention backend, private-context renderer, budget endpoint)
    are installed here as they land; until then loading the plugin leaves vLLM unchanged.
    """
    global _registered
    if _registered:
        return
    _registered = True
    from .serving.plugin import install

    install()
