"""``python -m vllm_dp_plugin.benchmarks.attention``: the same as ``vllm-dp bench attention``."""

from vllm_dp_plugin.benchmarks.attention import main

raise SystemExit(main())
