"""Plan k identical releases (e.g. H kv heads x L layers x R releases) under a total budget."""

from __future__ import annotations

from typing import Literal

from .accountant import (
    Budget,
    Composition,
    PrivacyLedger,
    calibrate_noise_multiplier,
    split_budget,
)
from .mechanisms import (
    Mechanism,
    gaussian_from_noise_multiplier,
    gaussian_mechanism,
    laplace_mechanism,
    truncated_laplace_mechanism,
)
from .validation import check_count

MechanismKind = Literal["gaussian", "laplace", "truncated_laplace"]
MECHANISM_KINDS: tuple[str, ...] = ("gaussian", "laplace", "truncated_laplace")


def plan_releases(
    total: Budget,
    releases: int,
    kind: MechanismKind,
    composition: Composition,
    sensitivity: float = 1.0,
    label: str = "release",
) -> PrivacyLedger:
    """A ledger of ``releases`` identical mechanisms whose composition spends at most ``total``.

    Gaussian/Laplace under ``pld``/``rdp`` are calibrated on the composed privacy curve
    (tightest); every other combination splits ``total`` with basic or advanced composition
    (``pld`` for the truncated Laplace splits by advanced composition and then reports the
    tighter PLD total).
    """
    k = check_count(releases, "releases")
    if kind not in MECHANISM_KINDS:
        raise ValueError(f"unknown mechanism {kind!r}; use one of {MECHANISM_KINDS}")
    if composition == "rdp" and kind == "truncated_laplace":
        raise ValueError("rdp accounting supports gaussian and laplace only; use pld or advanced")
    if kind != "truncated_laplace" and composition in ("pld", "rdp"):
        mechanism = _calibrated_on_curve(total, k, kind, composition, sensitivity)
    else:
        split = split_budget(total, k, "basic" if composition == "basic" else "advanced")
        mechanism = _from_split(split, kind, sensitivity)
    ledger = PrivacyLedger(composition=composition, target_delta=total.delta)
    ledger.record(mechanism, k, label)
    return ledger


def _from_split(split: Budget, kind: MechanismKind, sensitivity: float) -> Mechanism:
    if kind == "gaussian":
        return gaussian_mechanism(sensitivity, split.epsilon, split.delta)
    if kind == "laplace":
        return laplace_mechanism(sensitivity, split.epsilon)
    return truncated_laplace_mechanism(sensitivity, split.epsilon, split.delta)


def _calibrated_on_curve(
    total: Budget, k: int, kind: MechanismKind, composition: Composition, sensitivity: float
) -> Mechanism:
    multiplier = calibrate_noise_multiplier(total, k, kind, composition)
    if kind == "laplace":
        return laplace_mechanism(sensitivity, 1.0 / multiplier)
    return gaussian_from_noise_multiplier(
        sensitivity, multiplier, total.delta / k, name=f"gaussian({composition}-calibrated)"
    )
