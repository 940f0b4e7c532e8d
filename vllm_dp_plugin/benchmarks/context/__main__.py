"""``python -m vllm_dp_plugin.benchmarks.context``: the same as ``vllm-dp bench context``."""

from __future__ import annotations

from vllm_dp_plugin.benchmarks.context import main

raise SystemExit(main())
