"""``python -m vllm_dp_plugin.benchmarks.train``: the same as ``vllm-dp bench train``."""

from __future__ import annotations

from vllm_dp_plugin.benchmarks.train import main

raise SystemExit(main())
