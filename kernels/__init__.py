"""Triton kernels, each beside its torch reference; the leaf of the package (imports nothing else of vllm_dp_plugin)."""
