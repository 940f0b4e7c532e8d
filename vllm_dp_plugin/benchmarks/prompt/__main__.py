"""``python -m vllm_dp_plugin.benchmarks.prompt``: the same as ``vllm-dp bench prompt``."""

from __future__ import annotations

from vllm_dp_plugin.benchmarks.prompt import main

raise SystemExit(main())
