"""Human-readable privacy reports of a configuration (used by ``vllm-dp account``)."""

from __future__ import annotations

import math

from .config import AttentionPrivacyConfig, DPPrivacyConfig
from .privacy.budget import plan_releases


def budget_report(config: DPPrivacyConfig) -> str:
    """What each configured feature spends, per release and in total."""
    if not config.enabled:
        return "dp_privacy configures nothing: no privacy budget is spent (DP is off)."
    return attention_report(config.attention)


def attention_report(att: AttentionPrivacyConfig) -> str:
    """The per-(layer, kv head) release and the composed total for one private context."""
    k = att.releases()
    ledger = plan_releases(
        att.total, k, att.mechanism, att.composition, label="(layer, kv head) release"
    )
    mechanism = ledger.releases[0].mechanism
    return "\n".join(
        [
            "DP attention over the private context",
            "  unit of privacy: one private K/V row of one layer (replace-one neighbours)",
            (
                f"  releases: {att.num_layers} layers x {att.num_kv_heads} kv heads x "
                f"{att.releases_per_head} per head = {k}"
            ),
            f"  per release (unit sensitivity): {mechanism.statement()}",
            f"  noise std per unit of sensitivity: {math.sqrt(mechanism.variance):.6g}",
            f"  budget asked: {att.total}",
            f"  spent per private context ({att.composition} composition): {ledger.spent()}",
        ]
    )
