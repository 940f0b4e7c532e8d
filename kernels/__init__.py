"""Triton kernels, each beside its torch reference; installed as ``vllm_dp_plugin.kernels``."""
