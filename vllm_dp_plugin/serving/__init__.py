"""vLLM adapters: the only package that imports vllm (lazily)."""
