"""``python -m vllm_dp_plugin.benchmarks.faults``: the same as ``vllm-dp bench faults``."""

from __future__ import annotations

from vllm_dp_plugin.benchmarks.faults import main

raise SystemExit(main())
