"""DP attention over a private context (after the DP cross-attention paper of Ke et al.).

No vLLM import here."""
