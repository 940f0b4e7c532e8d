"""Hand a command line to vLLM's own CLI (``vllm serve``, ``vllm bench ...``)."""

from __future__ import annotations

import sys

from .vllm_compat import install_version_shim


def run_vllm_cli(argv: list[str]) -> int:
    """Run ``vllm <argv>`` in this process; returns its exit status."""
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
