"""vllm-dp: differentially private LLM serving as a vLLM plugin.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process it
starts (API server, engine core, workers), so it is idempotent and imports vLLM lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """vLLM general-plugin hook (every vLLM process); idempotent, imports vLLM lazily.

    Installs the DP attention backend (``CPU_ATTN`` override on CPU, ``CUSTOM`` on CUDA) and
    the ``dp_private`` tokenizer mode; both are exact pass-throughs until ``dp_privacy`` is
    configured (``--additional-config '{"dp_privacy": {...}}'``).
    """
    global _registered
    if _registered:
        return
    from .serving.plugin import install

    install()
    _registered = True
