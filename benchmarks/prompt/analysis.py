"""Reading ``python -m benchmarks.prompt``'s results: the eps grid, the keep-bound curves, the checks
(N_w within the DP bound) and the notes."""

from __future__ import annotations

import math
from collections.abc import Sequence

from benchmarks.prompt.mechanisms import (
    HOEFFDING_ALPHA,
    REPRODUCTION,
    keep_bound,
    text_keep_bound,
)
from vllm_dp_plugin.benchmarks.lib.report import fmt


def eps_grid(results: dict) -> list[float]:
    return sorted({r["eps"] for r in results["rows"]})


def bound_curves(results: dict, epsilons: Sequence[float]) -> list[dict]:
    """The vocabulary-average keep-rate bound and the text-weighted bound at ``settings.delta``."""
    vocab = results["table"]["vocab_size"]
    delta = results["settings"]["delta"]
    freqs = results["reference"]["piece_frequencies"]
    return [
        {"eps": e, "vocab_bound": keep_bound(e, delta, vocab), "text_bound": text_keep_bound(freqs, e, delta, vocab)}
        for e in epsilons
    ]


def checks(results: dict) -> list[dict]:
    """Per row: N_w against the text-weighted keep-rate bound of the row's own guarantee (valid
    mechanisms) or of the claimed guarantee (reproductions), with the Hoeffding tolerance."""
    vocab = results["table"]["vocab_size"]
    freqs = results["reference"]["piece_frequencies"]
    tol = results["reference"]["hoeffding_tolerance"]
    out = []
    for r in results["rows"]:
        if "preservation" not in r:
            continue
        if r["mechanism"] in REPRODUCTION:
            claimed = 10.0 ** max(r["claimed_log10_delta"], -320)
            bound = text_keep_bound(freqs, r["epsilon"], claimed, vocab)
            kind = "claimed"
        else:
            bound = text_keep_bound(freqs, r["epsilon"], r["delta"], vocab)
            kind = "proven"
        out.append({"mechanism": r["mechanism"], "eps": r["eps"], "kind": kind, "bound": bound,
                    "preservation": r["preservation"], "ok": r["preservation"] <= bound + tol})
    return out


def eps_for(rows: list[dict], name: str, key: str, level: float) -> float | None:
    """Smallest grid eps at which ``key`` of mechanism ``name`` reaches ``level``."""
    hits = [r["eps"] for r in rows if r["mechanism"] == name and r.get(key, -1) >= level]
    return min(hits) if hits else None


def eps_for_bound(freqs: Sequence[float], level: float, delta: float, vocab: int) -> float | None:
    """Smallest eps at which ``text_keep_bound`` reaches ``level`` (None if it never does)."""
    mass, budget = 0.0, 0.0
    for f in sorted(freqs, reverse=True):
        if mass + f >= level:
            budget += (level - mass) / f
            break
        mass += f
        budget += 1.0
    else:
        return None
    room = budget - vocab * delta
    return math.log(room) if room > 0 else 0.0


def _eps(x: float | None) -> str:
    return "never (on this grid)" if x is None else f"{x:g}"


def notes(results: dict) -> list[str]:
    rows = results["rows"]
    mechs = list(dict.fromkeys(r["mechanism"] for r in rows))
    lines = []
    for name in mechs:
        lines.append(
            f"{name}: N_w >= 0.5 from eps = {_eps(eps_for(rows, name, 'preservation', 0.5))}, N_w >= 0.9 "
            f"from eps = {_eps(eps_for(rows, name, 'preservation', 0.9))}, sentence cosine >= 0.9 from eps = "
            f"{_eps(eps_for(rows, name, 'cosine', 0.9))}."
        )
    bad = [c for c in checks(results) if not c["ok"]]
    proven_bad = [c for c in bad if c["kind"] == "proven"]
    claimed_bad = [c for c in bad if c["kind"] == "claimed"]
    tol = results["reference"]["hoeffding_tolerance"]
    if proven_bad:
        lines.append("BOUND VIOLATED by a mechanism with a proven guarantee (a bug): " + ", ".join(
            f"{c['mechanism']} eps={c['eps']:g} N_w={fmt(c['preservation'])} > {fmt(c['bound'])}"
            for c in proven_bad))
    else:
        lines.append(
            "Every mechanism with a proven guarantee keeps N_w below the text-weighted DP keep bound of its own "
            f"(eps, delta) plus the Hoeffding tolerance {fmt(tol)} (failure probability {HOEFFDING_ALPHA:g}) "
            "at every eps, as it must."
        )
    if claimed_bad:
        lines.append("Empirical refutation of a claimed guarantee: " + ", ".join(
            f"{c['mechanism']} eps={c['eps']:g} keeps N_w={fmt(c['preservation'])} > {fmt(c['bound'])}, the most "
            "any mechanism with the claimed delta could keep" for c in claimed_bad) + ".")
    return lines
