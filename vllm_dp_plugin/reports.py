"""Human-readable privacy reports of a configuration (used by ``vllm-dp account``)."""

from __future__ import annotations

import math

from .config import AttentionPrivacyConfig, DPPrivacyConfig, PromptPrivacyConfig
from .privacy.budget import plan_releases


def budget_report(config: DPPrivacyConfig) -> str:
    """What each configured feature spends, per release and in total."""
    parts = []
    if config.attention is not None:
        parts.append(attention_report(config.attention))
    if config.prompt is not None:
        parts.append(prompt_report(config.prompt))
    return "\n\n".join(parts) or "dp_privacy configures nothing: no privacy budget is spent (DP is off)."


PAPER_MODES = {"trlap_paper", "trlap_repro"}
METRIC_MODES = {"mahalanobis", "cmp"}


def prompt_report(prompt: PromptPrivacyConfig) -> str:
    """The per-token statement of prompt privatization; what a prompt of n user tokens spends
    (basic composition: n eps, n delta). The exact per-token statement needs the served model's
    embedding table (sensitivities, and the true delta of the paper calibrations): it is logged
    at serving start and returned in every request's receipt."""
    eps, delta = prompt.epsilon, prompt.delta
    if prompt.mechanism in PAPER_MODES:
        guarantee = (f"{prompt.mechanism} (paper-literal reproduction): the claimed delta is NOT "
                     "valid for d > 1; the true delta is computed from the served table at start")
    elif prompt.mechanism in METRIC_MODES:
        guarantee = (f"{prompt.mechanism}: metric DP, eps = {eps:g} per unit embedding distance "
                     "(eps_DP = eps x the table's l2 diameter, in the receipt)")
    else:
        guarantee = f"{prompt.mechanism}: ({eps:g}, {delta:g})-DP per token"
    return "\n".join(
        [
            "Prompt privatization of user-authored tokens",
            ("  unit of privacy: one user token (replace-one, any token <-> any token); length, "
            "positions and template are not protected"),
            f"  per token: {guarantee}",
            (f"  a prompt of n user tokens (basic composition): ({eps:g} n, {delta:g} n); receipts "
            "also give advanced composition and count cached (reused) turns once"),
            f"  requests may override mechanism/epsilon: {prompt.allow_request_override}"
            + (f" (epsilon <= {prompt.max_epsilon:g})" if prompt.max_epsilon is not None else ""),
        ]
    )


def attention_report(att: AttentionPrivacyConfig) -> str:
    """The per-(layer, kv head) release and the composed total for one private context, and
    which contexts the configuration serves (each spends that total on its own)."""
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
            *([contexts_line(att)] if att.serves_context else []),
        ]
    )


def contexts_line(att: AttentionPrivacyConfig) -> str:
    """The served private contexts by name (a ``contexts`` directory is not listed: its paths
    are relative to the served configuration file)."""
    if isinstance(att.contexts, str):
        names = f"the *.txt / *.jsonl files of {att.contexts}, named by stem"
    else:
        names = ", ".join(att.context_files())
    return f"  private contexts: {names}; each is its own protected dataset and spends the budget above on its own"
