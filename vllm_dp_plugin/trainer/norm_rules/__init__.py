"""Per-sample squared gradient norms by module type (ghost clipping, and DPFormer's Phantom
Clipping for tied embeddings), never materialising a per-sample gradient of a large weight: one
small module per supported layer type (the Opacus ``grad_sample/`` pattern), each registering
a ``NormRule`` with ``register_norm_rule``; the engine looks rules up with
``find_rule``/``rule_for``.

Every norm function takes, for one parameter use in the forward graph, the layer input ``a`` and
the gradient ``g`` of ``sum_i L_i`` w.r.t. the layer output (per sample, since nothing mixes
samples), batch-first ``[B, T, ...]``, and returns ``[B]``: ``||dL_i/dW||_F^2`` for each sample
``i``, in float32 or wider (``norm_dtype``).

Supported: ``linear`` (``nn.Linear``), ``conv1d`` (Hugging Face GPT-2 ``Conv1D``), ``embedding``
(``nn.Embedding``; Phantom Clipping for a table tied to an output ``nn.Linear``), ``layernorm``
(``nn.LayerNorm``, last dim), ``rmsnorm`` (``nn.RMSNorm`` and ``*RMSNorm`` classes).
"""

from . import conv1d, embedding, layernorm, linear, rmsnorm  # noqa: F401  (importing registers)
from .base import (
    InputGrams,
    NormRule,
    ParamRole,
    find_rule,
    gram,
    norm_dtype,
    per_sample_role,
    register_norm_rule,
    registered_rules,
    rule_for,
    sq_norms_of,
    supported_names,
    weighted_sum,
)
from .embedding import lookup_sq_norms, tied_embedding_sq_norms
from .layernorm import layernorm_sq_norms
from .linear import bias_sq_norms, linear_sq_norms
from .rmsnorm import rmsnorm_sq_norms

__all__ = [
    "InputGrams",
    "NormRule",
    "ParamRole",
    "bias_sq_norms",
    "find_rule",
    "gram",
    "layernorm_sq_norms",
    "linear_sq_norms",
    "lookup_sq_norms",
    "norm_dtype",
    "per_sample_role",
    "register_norm_rule",
    "registered_rules",
    "rmsnorm_sq_norms",
    "rule_for",
    "sq_norms_of",
    "supported_names",
    "tied_embedding_sq_norms",
    "weighted_sum",
]
