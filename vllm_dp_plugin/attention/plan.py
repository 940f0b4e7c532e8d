"""From the typed ``dp_privacy.attention`` config and a model's shape to what serving releases.

``ContextPlan`` is public: the parameters, the per-layer public head mappings (from a
calibration file or explicit bounds, never from the private context) and the accounting of one
private context over the whole model. Serving's workers build releases from it; the API
server reports it (``/v1/dp/budget``, start-up log).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from ..config import AttentionPrivacyConfig, ConfigError
from .accounting import AttentionAccount
from .features import taylor_degree, taylor_kernel_error
from .mapping import HeadMapping
from .params import DPAttentionParams
from .private_context import HeadLayout, PrivateContextLayer

KINDS = ("self_attention", "cross_attention")
MAX_DEGREE = 64


def attention_params(cfg: AttentionPrivacyConfig) -> DPAttentionParams:
    """The per-layer ``DPAttentionParams`` whose (eps, delta) is the whole model's total
    (``scope="layer"``: split over every (layer, KV head) release by ``composition``)."""
    return DPAttentionParams(
        epsilon=cfg.epsilon,
        delta=cfg.delta,
        mode=cfg.mode,
        scope="layer",
        composition=cfg.composition,
        features=cfg.features,
        degree=cfg.degree,
        kernel_error=cfg.kernel_error,
        max_features=cfg.max_features,
        num_random_features=cfg.num_random_features,
        state_mechanism=cfg.mechanism,
        max_context=cfg.max_context,
    )


def layer_mapping(cfg: AttentionPrivacyConfig, kind: str, layer: int, beta: float) -> HeadMapping:
    """The public head mapping of ``layer`` (``kind`` in ``KINDS``) with logit scale ``beta``
    (the served layer's softmax scale; a calibration made for another scale is refused)."""
    if cfg.bounds is not None:
        return HeadMapping(beta=beta, **cfg.bounds)
    if cfg.calibration is None:
        raise ConfigError(
            "attention: DP attention needs public bounds: set `calibration` (a file from "
            "`vllm-dp calibrate MODEL --out FILE`) or explicit `bounds`"
        )
    mapping = _calibration(cfg.calibration).mapping(kind, layer)
    if abs(mapping.beta - beta) > 1e-6 * beta:
        raise ConfigError(
            f"attention.calibration {cfg.calibration}: {kind} layer {layer} was calibrated with "
            f"softmax scale {mapping.beta:.6g} but the served layer uses {beta:.6g}"
        )
    return mapping


def _finite(x: float) -> float | None:
    """JSON-safe: an unbounded (overflowing) error is reported as null."""
    return x if math.isfinite(x) else None


@functools.lru_cache(maxsize=4)
def _calibration(path: str):
    from ..calibration import Calibration

    return Calibration.from_file(path)


@dataclass(frozen=True)
class ContextPlan:
    """One private context over the model: ``layers`` attention layers of ``kind``, each with
    ``total_kv_heads`` KV heads of size ``head_dim``, a context of ``context_len`` rows."""

    cfg: AttentionPrivacyConfig
    kind: str
    layers: int
    total_kv_heads: int
    total_query_heads: int
    head_dim: int
    beta: float
    context_len: int

    @property
    def params(self) -> DPAttentionParams:
        return attention_params(self.cfg)

    @property
    def budget_heads(self) -> int:
        """Per-(layer, KV head) releases sharing the total budget."""
        return self.layers * self.total_kv_heads

    def layer_params(self, index: int) -> DPAttentionParams:
        """Layer ``index``'s parameters; Taylor features without an explicit ``degree`` get the
        degree rule's choice capped at ``max_features`` (the achieved kernel error is reported)."""
        params = self.params
        if params.features != "taylor" or params.degree is not None:
            return params
        mapping = layer_mapping(self.cfg, self.kind, index, self.beta)
        fits = max(p for p in range(MAX_DEGREE) if math.comb(self.head_dim + p, p) <= params.max_features)
        try:
            wanted = taylor_degree(mapping.logit_bound(self.head_dim), params.kernel_error, mapping.signed)
        except ValueError:  # out of regime (huge logit bound): the cap decides, the error is reported
            wanted = fits
        return dataclasses.replace(params, degree=min(wanted, fits))

    def kernel_error(self, index: int) -> float:
        """Guaranteed relative kernel error of layer ``index``'s Taylor map (nan for PRF)."""
        if self.params.features != "taylor":
            return math.nan
        mapping = layer_mapping(self.cfg, self.kind, index, self.beta)
        degree = self.layer_params(index).degree
        return taylor_kernel_error(mapping.logit_bound(self.head_dim), degree, mapping.signed)

    def logit_bound(self, index: int) -> float:
        """T = beta sup |<q, k>| of layer ``index`` under its public bounds (regime: T of a few)."""
        return layer_mapping(self.cfg, self.kind, index, self.beta).logit_bound(self.head_dim)

    def layer(self, index: int, heads: HeadLayout) -> PrivateContextLayer:
        """The collector/release of layer ``index`` for the heads this process holds."""
        if not 0 <= index < self.layers:
            raise ValueError(f"layer {index} outside [0, {self.layers})")
        return PrivateContextLayer(
            self.layer_params(index),
            layer_mapping(self.cfg, self.kind, index, self.beta),
            index,
            heads,
            self.head_dim,
            self.context_len,
            self.budget_heads,
        )

    def account(self) -> AttentionAccount:
        """What one private context spends (per head -> per layer -> whole model)."""
        heads = HeadLayout(1, self.total_query_heads // self.total_kv_heads, 0, self.total_kv_heads)
        mechanism = self.layer(0, heads).planned_mechanism()
        return AttentionAccount(mechanism, self.total_kv_heads, self.params.composition)

    def report(self) -> dict[str, Any]:
        """JSON-ready privacy statement of one private context (the guarantee and its unit)."""
        account = self.account()
        total = account.spent(self.layers)
        head = account.per_head
        return {
            "mode": self.cfg.mode,
            "kind": self.kind,
            "unit": "one private K/V row of one attention layer (replace-one neighbours)",
            "context_tokens": self.context_len,
            "layers": self.layers,
            "kv_heads": self.total_kv_heads,
            "releases": self.budget_heads,
            "composition": self.params.composition,
            "per_release": {"epsilon": head.epsilon, "delta": head.delta, "mechanism": head.name},
            "spent": {"epsilon": total.epsilon, "delta": total.delta},
            "logit_bound": [self.logit_bound(i) for i in range(self.layers)],
            "taylor_degree": [self.layer_params(i).degree for i in range(self.layers)],
            "kernel_error": [_finite(self.kernel_error(i)) for i in range(self.layers)],
            "budget": {"epsilon": self.cfg.epsilon, "delta": self.cfg.delta},
        }
