"""``python -m vllm_dp_plugin.benchmarks.attention_real``: the same as ``vllm-dp bench attention-real``."""

from __future__ import annotations

from vllm_dp_plugin.benchmarks.attention_real import main

raise SystemExit(main())
