"""Runnable benchmark suites (installed as vllm_dp_plugin.benchmarks)."""
