"""DP attention over a private context (DP cross-attention spec): no vLLM import here."""
