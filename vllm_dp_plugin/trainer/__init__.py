"""DP training (issue 6): per-sample gradient norms without per-sample gradients (ghost norms,
Phantom Clipping for tied embeddings), DP-SGD/DP-Adam, Re-Attention. Pure torch, no vLLM."""

from .norms import (
    bias_sq_norms,
    layernorm_sq_norms,
    linear_sq_norms,
    lookup_sq_norms,
    rmsnorm_sq_norms,
    tied_embedding_sq_norms,
)

__all__ = [
    "bias_sq_norms",
    "layernorm_sq_norms",
    "linear_sq_norms",
    "lookup_sq_norms",
    "rmsnorm_sq_norms",
    "tied_embedding_sq_norms",
]
