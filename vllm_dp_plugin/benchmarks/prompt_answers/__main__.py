"""``python -m vllm_dp_plugin.benchmarks.prompt_answers``: the same as ``vllm-dp bench prompt-answers``."""

from __future__ import annotations

from vllm_dp_plugin.benchmarks.prompt_answers import main

raise SystemExit(main())
