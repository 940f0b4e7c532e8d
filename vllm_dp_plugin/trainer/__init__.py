"""DP training: per-sample gradient norms without per-sample gradients (ghost norms,
Phantom Clipping for tied embeddings), DP-SGD/DP-Adam with Poisson sampling and an accountant,
Re-Attention, and ``vllm-dp train``. Pure torch, no vLLM."""

from .accounting import TrainingAccountant, noise_multiplier_for
from .engine import (
    DPConfig,
    DPEngine,
    causal_lm_per_sample_loss,
    warmup_linear_decay,
    warmup_linear_decay_scheduler,
)
from .metrics import RankingMetrics, evaluate_ranking
from .norm_rules import (
    bias_sq_norms,
    layernorm_sq_norms,
    linear_sq_norms,
    lookup_sq_norms,
    rmsnorm_sq_norms,
    tied_embedding_sq_norms,
)
from .reattention import (
    ReAttentionConfig,
    apply_reattention,
    dp_sequence_frequencies,
    remove_reattention,
)
from .recsys import DPFormerRec
from .sampling import PoissonSampler, shard_for_rank, virtual_batches

__all__ = [
    "DPConfig",
    "DPEngine",
    "DPFormerRec",
    "PoissonSampler",
    "RankingMetrics",
    "ReAttentionConfig",
    "TrainingAccountant",
    "apply_reattention",
    "bias_sq_norms",
    "causal_lm_per_sample_loss",
    "dp_sequence_frequencies",
    "evaluate_ranking",
    "layernorm_sq_norms",
    "linear_sq_norms",
    "lookup_sq_norms",
    "noise_multiplier_for",
    "remove_reattention",
    "rmsnorm_sq_norms",
    "shard_for_rank",
    "tied_embedding_sq_norms",
    "virtual_batches",
    "warmup_linear_decay",
    "warmup_linear_decay_scheduler",
]
