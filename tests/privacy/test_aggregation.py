"""Per-query DP aggregation math (``privacy.aggregation``): the exponential mechanism's law
against its exact softmax, the score functions on hand-checked arrays, sensitivities, the
accountant against closed-form upper bounds, exact values computed directly with dp-accounting
and the exact epsilon of a neighbouring pair vote realizes (a lower bound; an accountant with
half the rho fails it), calibration against the direct values, and empirical audits of the
sparse vector gate with Clopper-Pearson intervals (one answer; a whole instance, which catches a
gate at twice its epsilon).

Statistical checks use fixed seeds, so they are deterministic; the thresholds (p-value 1e-3,
Clopper-Pearson confidence 1e-6 a side) are the false-alarm rates they would have under fresh
randomness, and the effects they must see are many interval widths away (derived inline).
"""

import math
import types

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import integrate, optimize, stats

from vllm_dp_plugin.privacy import aggregation
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.aggregation import (
    AggregationParams,
    SparseVector,
    clipped_mixture,
    disagreement,
    exponential_logits,
    exponential_mechanism,
    vote_counts,
)

PVALUE = 1e-3
ALPHA = 1e-6  # one-sided Clopper-Pearson error


def cp_lower(hits: int, n: int, alpha: float = ALPHA) -> float:
    return 0.0 if hits == 0 else float(stats.beta.ppf(alpha, hits, n - hits + 1))


def cp_upper(hits: int, n: int, alpha: float = ALPHA) -> float:
    return 1.0 if hits == n else float(stats.beta.ppf(1 - alpha, hits + 1, n - hits))


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


# --- the exponential mechanism ------------------------------------------------------------------

SCORES = np.array([0.0, 1.0, 2.0, 3.0, 0.5, -1.0])
BASE = np.array([0.3, -0.2, 0.0, -1.0, 0.5, 0.1])


def test_exponential_logits_formula():
    logits = exponential_logits(SCORES, 0.5, 1.2)
    assert logits.dtype == np.float64
    np.testing.assert_allclose(logits, SCORES * 1.2 / (2 * 0.5), rtol=1e-15)
    np.testing.assert_allclose(exponential_logits(SCORES, 0.5, 1.2, BASE), logits + BASE, rtol=1e-15)


@pytest.mark.parametrize("base", [None, BASE], ids=["no_base", "base"])
@pytest.mark.parametrize("sensitivity", [1.0, 0.5])
def test_exponential_mechanism_samples_its_softmax(base, sensitivity):
    """20000 draws against softmax(exponential_logits): the smallest expected count is > 100
    (chi-square's approximation wants > 5). The same counts against the law without the factor
    2 (softmax(eps * u / sensitivity)), a far more peaked law, must be rejected: the test can
    tell the two apart."""
    eps, n = 1.2, 20_000
    rng = np.random.default_rng(11)
    draws = [exponential_mechanism(SCORES, sensitivity, eps, rng, base=base) for _ in range(n)]
    counts = np.bincount(draws, minlength=len(SCORES))
    expected = n * softmax(exponential_logits(SCORES, sensitivity, eps, base))
    assert expected.min() > 100
    assert stats.chisquare(counts, expected).pvalue > PVALUE
    wrong = n * softmax(exponential_logits(SCORES, sensitivity / 2, eps, base))
    assert stats.chisquare(counts, wrong).pvalue < PVALUE


# --- score functions ----------------------------------------------------------------------------


def test_vote_counts_hand_checked():
    # members vote 3, 5, 3, 9, 5, 3; candidates 5, 3, 7: 9 is no candidate and counts for none
    counts = vote_counts(np.array([3, 5, 3, 9, 5, 3]), np.array([5, 3, 7]))
    assert counts.dtype == np.float64
    np.testing.assert_array_equal(counts, [2.0, 3.0, 0.0])
    np.testing.assert_array_equal(vote_counts(np.array([8, 9]), np.array([1, 2])), [0.0, 0.0])


def test_disagreement_hand_checked():
    assert disagreement(np.array([4, 4, 4]), 4) == 0.0  # everyone agrees with the public token
    assert disagreement(np.array([4, 7, 7, 9, 4, 4]), 4) == 2.0  # 7 twice; 4's three do not count
    assert disagreement(np.array([1, 2, 3]), 4) == 1.0


def test_clipped_mixture_hand_checked():
    """public + mean over members of clip(member - public, -C, C), clipping both sides."""
    public = np.array([-1.0, -2.0, -3.0])
    members = np.array([
        [-1.0 + 5.0, -2.0 - 0.5, -3.0 - 7.0],  # +5 -> +2 (clipped above), -0.5 kept, -7 -> -2
        [-1.0 - 4.0, -2.0 + 1.0, -3.0 + 0.0],  # -4 -> -2 (clipped below), +1 kept, 0
    ])
    out = clipped_mixture(members, public, clip=2.0)
    np.testing.assert_allclose(out, public + np.array([(2.0 - 2.0) / 2, (-0.5 + 1.0) / 2, (-2.0 + 0.0) / 2]),
                               rtol=0, atol=1e-15)
    # one member moved anywhere moves every coordinate by at most 2C / k
    moved = members.copy()
    moved[0] = [-50.0, 40.0, 0.0]
    change = np.abs(clipped_mixture(moved, public, 2.0) - out)
    assert change.max() <= 2 * 2.0 / 2 + 1e-12


# --- parameters and accounting ------------------------------------------------------------------


def params(mechanism="expmech", members=4, eps_select=1.0, eps_gate=0.0, max_private_tokens=8,
           delta=1e-6, **fields) -> AggregationParams:
    return AggregationParams(mechanism, members, eps_select, eps_gate, max_private_tokens, delta, **fields)


def test_sensitivity():
    assert params("vote", members=7).sensitivity == 1.0
    assert params("vote", members=7, clip=3.0).sensitivity == 1.0
    assert params("expmech", members=4, clip=1.0).sensitivity == pytest.approx(2 * 1.0 / 4)
    assert params("expmech", members=10, clip=2.5).sensitivity == pytest.approx(2 * 2.5 / 10)


def test_spent_zero_is_free():
    for p in (params(), params("vote", eps_gate=0.5)):
        assert p.spent(0) == Budget(0.0, 0.0)


GRID = [(0.1, 0.0), (0.5, 0.1), (1.0, 0.0), (2.0, 0.5), (4.0, 1.0), (0.05, 0.05)]


@pytest.mark.parametrize("eps_select,eps_gate", GRID)
@pytest.mark.parametrize("delta", [1e-6, 1e-9])
def test_spent_is_monotone_and_below_basic_and_zcdp_closed_form(eps_select, eps_gate, delta):
    """spent(n) = min(basic composition, RDP accountant on zCDP events); both are valid, so it
    must not exceed either the basic sum n (eps_select + eps_gate) or the classic zCDP
    conversion rho + 2 sqrt(rho ln(1/delta)) with rho = n (eps_select^2/8 + eps_gate^2/2) (the
    accountant's conversion is tighter than the classic one; its order grid may cost a hair)."""
    p = params(eps_select=eps_select, eps_gate=eps_gate, max_private_tokens=64, delta=delta)
    previous = 0.0
    for n in [1, 2, 3, 5, 8, 16, 32, 64]:
        spent = p.spent(n)
        basic = n * (eps_select + eps_gate)
        rho = n * (eps_select ** 2 / 8 + eps_gate ** 2 / 2)
        closed = rho + 2 * math.sqrt(rho * math.log(1 / delta))
        assert spent.epsilon >= previous
        assert spent.epsilon <= basic * (1 + 1e-12)
        assert spent.epsilon <= closed * (1 + 1e-9)
        # pure basic composition comes with delta 0; the accountant's figure with the query's delta
        assert spent.delta == (0.0 if spent.epsilon == basic else delta)
        previous = spent.epsilon
    assert p.worst_case == p.spent(64)


def direct_spent(eps_select: float, eps_gate: float, steps: int, open_gate: bool, delta: float) -> Budget:
    """What a query with ``steps`` private steps (and an open gate instance) spends, computed
    directly: zCDP composes by adding rho, so one ``ZCDpEvent`` of the query's total rho =
    steps x eps_select^2 / 8 (bounded range) + gate instances x eps_gate^2 / 2 (pure DP) through
    dp-accounting's RDP accountant, or basic composition of the pure epsilons where smaller."""
    gates = (steps + open_gate) if eps_gate > 0 else 0
    basic = steps * eps_select + gates * eps_gate
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_event.ZCDpEvent(steps * eps_select ** 2 / 8 + gates * eps_gate ** 2 / 2))
    rdp = accountant.get_epsilon(delta)
    return Budget(basic, 0.0) if basic <= rdp else Budget(rdp, delta)


@pytest.mark.parametrize("eps_select,eps_gate", GRID)
@pytest.mark.parametrize("open_gate", [False, True])
def test_spent_and_worst_case_equal_dp_accounting_on_the_total_rho(eps_select, eps_gate, open_gate):
    """Exact values (not only upper bounds): an accountant that drops a term (the gate, the open
    instance) or mis-scales rho differs here. Both branches occur on this grid (basic for few
    steps, RDP for many)."""
    delta = 1e-6
    p = params(eps_select=eps_select, eps_gate=eps_gate, max_private_tokens=64, delta=delta)
    branches = set()
    for n in [0, 1, 2, 3, 5, 8, 16, 32, 64]:
        expected = direct_spent(eps_select, eps_gate, n, open_gate, delta)
        spent = p.spent(n, open_gate)
        assert spent.epsilon == pytest.approx(expected.epsilon, rel=1e-12, abs=0)
        assert spent.delta == expected.delta
        branches.add(spent.delta)
    assert branches == {0.0, delta}
    worst, expected = p.worst_case, direct_spent(eps_select, eps_gate, 64, False, delta)
    assert worst.epsilon == pytest.approx(expected.epsilon, rel=1e-12, abs=0) and worst.delta == expected.delta


def vote_pair_epsilon(eps_select: float, steps: int, delta: float, prior: float) -> float:
    """The smallest epsilon at ``delta`` of ``steps`` vote steps (k = 2, no gate, candidates A and
    B, public prior ``prior`` on A) on the neighbours D (votes A, B) and D' (B, B): the law
    ``test_vote_law_and_audit_worst_case_pair_and_double_eps_mutant`` checks, P_D(A) = prior,
    P_D'(A) = prior / (prior + (1 - prior) e^eps), so each step's privacy loss ln(P_D/P_D') is
    l_A = ln(prior + (1 - prior) e^eps) on A and l_A - eps on B (an eps-bounded-range pair). With
    j of ``steps`` outcomes A, the loss is j l_A + (steps - j)(l_A - eps); delta(x) is the hockey
    stick E[(1 - e^(x - loss))+] in each direction (j binomial under the law of that direction)."""
    l_a = math.log(prior + (1 - prior) * math.exp(eps_select))
    j = np.arange(steps + 1)
    loss = j * l_a + (steps - j) * (l_a - eps_select)
    laws = [(stats.binom.pmf(j, steps, prior), loss),
            (stats.binom.pmf(j, steps, prior / (prior + (1 - prior) * math.exp(eps_select))), -loss)]

    def excess(x: float) -> float:
        return max(float(np.sum(pmf * -np.expm1(np.minimum(x - l, 0.0)))) for pmf, l in laws) - delta

    return 0.0 if excess(0.0) <= 0 else optimize.brentq(excess, 0.0, steps * eps_select, xtol=1e-12)


LOWER_CASES = [(0.5, 1, 1e-6), (1.0, 4, 1e-6), (1.0, 16, 1e-6), (1.0, 64, 1e-6), (0.1, 256, 1e-9),
               (2.0, 64, 1e-5), (4.0, 16, 1e-6)]
PRIORS = [*np.geomspace(1e-6, 0.3, 24), 0.5, 0.7, 0.9]


def test_spent_is_at_least_what_a_vote_pair_truly_spends(monkeypatch):
    """Lower bounds (an accountant that under-reports fails): ``spent(n)`` of vote without a gate
    must be at least the exact epsilon at delta of n steps on a neighbouring pair the mechanism
    realizes (``vote_pair_epsilon``, the worst prior of a grid). The bound is tight: 0.83-1.0 of
    the reported figure on these cases, so an accountant reporting 80% fails; the test runs one
    with rho halved (eps_select^2/16 per step) and sees it fail."""
    bounds = [max(vote_pair_epsilon(eps, n, delta, prior) for prior in PRIORS) for eps, n, delta in LOWER_CASES]

    def reported() -> list[float]:
        return [params("vote", eps_select=eps, max_private_tokens=n, delta=delta).spent(n).epsilon
                for eps, n, delta in LOWER_CASES]

    honest = reported()
    for case, bound, eps in zip(LOWER_CASES, bounds, honest, strict=True):
        assert bound <= eps * (1 + 1e-9), case
        assert bound >= 0.8 * eps, case  # the bound is close: the check has power
    half_rho = types.SimpleNamespace(ComposedDpEvent=dp_event.ComposedDpEvent,
                                     SelfComposedDpEvent=dp_event.SelfComposedDpEvent,
                                     ZCDpEvent=lambda rho: dp_event.ZCDpEvent(rho / 2))
    monkeypatch.setattr(aggregation, "dp_event", half_rho)
    assert any(eps < bound for bound, eps in zip(bounds, reported(), strict=True))


@pytest.mark.parametrize("mechanism,budget,steps,share", [
    ("vote", Budget(2.0, 1e-6), 8, 0.0),
    ("expmech", Budget(8.0, 1e-5), 64, 0.25),
    ("expmech", Budget(0.5, 1e-8), 1, 0.5),
    ("vote", Budget(1.0, 1e-6), 200, 0.1),
])
def test_calibrated_fits_the_budget_tightly(mechanism, budget, steps, share):
    p = AggregationParams.calibrated(mechanism, 4, budget, steps, share, clip=2.0)
    assert p.mechanism == mechanism and p.members == 4 and p.max_private_tokens == steps
    assert p.delta == budget.delta and p.clip == 2.0
    # the worst case computed directly (not through the class's own accountant): every private
    # step taken fits the budget, and the bisection (60 halvings) leaves nothing measurable unused
    worst = direct_spent(p.eps_select, p.eps_gate, steps, False, budget.delta).epsilon
    assert worst <= budget.epsilon * (1 + 1e-12)
    assert worst >= budget.epsilon * (1 - 1e-9)
    assert p.worst_case.epsilon == pytest.approx(worst, rel=1e-12)
    # gate_share splits one step's epsilon gate : select
    total = p.eps_select + p.eps_gate
    assert p.eps_gate == pytest.approx(share * total, rel=1e-12, abs=0)
    assert p.eps_select == pytest.approx((1 - share) * total, rel=1e-12)
    assert p.gated == (share > 0)
    text = p.statement()
    assert mechanism in text and f"at most {steps} private tokens" in text and "one document" in text


@pytest.mark.parametrize("kwargs,match", [
    ({"mechanism": "median"}, "mechanism"),
    ({"members": 0}, "members"),
    ({"members": 2.0}, "members"),
    ({"max_private_tokens": 0}, "max_private_tokens"),
    ({"candidates": 0}, "candidates"),
    ({"eps_select": 0.0}, "eps_select"),
    ({"eps_select": float("inf")}, "eps_select"),
    ({"eps_gate": -1.0}, "eps_gate"),
    ({"eps_gate": float("nan")}, "eps_gate"),
    ({"delta": 0.0}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"clip": 0.0}, "clip"),
    ({"confidence": 0.0}, "confidence"),
    ({"confidence": 1.5}, "confidence"),
    ({"threshold": 1.5}, "threshold"),
    ({"threshold": -0.1}, "threshold"),
])
def test_bad_parameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        params(**kwargs)


def test_bad_calibration_arguments_raise():
    with pytest.raises(ValueError, match="gate_share"):
        AggregationParams.calibrated("vote", 4, Budget(1.0, 1e-6), 8, 1.0)
    with pytest.raises(ValueError, match="gate_share"):
        AggregationParams.calibrated("vote", 4, Budget(1.0, 1e-6), 8, -0.1)
    with pytest.raises(ValueError, match="epsilon"):
        AggregationParams.calibrated("vote", 4, Budget(0.0, 1e-6), 8, 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        AggregationParams.calibrated("vote", 4, Budget(float("inf"), 1e-6), 8, 0.0)
    with pytest.raises(ValueError, match="delta"):
        AggregationParams.calibrated("vote", 4, Budget(1.0, 0.0), 8, 0.0)
    with pytest.raises(ValueError, match="mechanism"):
        AggregationParams.calibrated("median", 4, Budget(1.0, 1e-6), 8, 0.0)


# --- the sparse vector gate ---------------------------------------------------------------------

THRESHOLD, N_SVT = 0.0, 20_000


def positive_rate(query: float, epsilon: float, seed: int) -> int:
    """How many of ``N_SVT`` fresh SparseVectors answer yes to ``query`` (one query each)."""
    rng = np.random.default_rng(seed)
    return sum(SparseVector(THRESHOLD, epsilon, rng).above(query) for _ in range(N_SVT))


def log_ratio_lower_bounds(q: float, epsilon: float) -> tuple[float, float]:
    """Lower confidence bounds of ln P(yes | q+1)/P(yes | q) and ln P(no | q)/P(no | q+1)."""
    yes_q, yes_q1 = positive_rate(q, epsilon, 1), positive_rate(q + 1, epsilon, 2)
    yes = math.log(cp_lower(yes_q1, N_SVT)) - math.log(cp_upper(yes_q, N_SVT))
    no = math.log(cp_lower(N_SVT - yes_q, N_SVT)) - math.log(cp_upper(N_SVT - yes_q1, N_SVT))
    return yes, no


@pytest.mark.parametrize("q", [-8.0, -3.0, -1.0, 0.0, 2.0, 6.0])
def test_sparse_vector_one_answer_is_eps_dp(q):
    """Neighbouring queries q and q + 1 (sensitivity 1), threshold fixed, a fresh SparseVector a
    trial. Why the bound must hold: one answer of AboveThreshold is the whole output of an
    instance that stops at its first yes (or has answered no so far), which Dwork & Roth (Thm
    3.23) show is eps-DP for sensitivity-1 queries, with threshold noise Lap(2/eps) and query
    noise Lap(4/eps); so P(yes | q+1) <= e^eps P(yes | q) and P(no | q) <= e^eps P(no | q+1).
    Each Clopper-Pearson interval holds with probability >= 1 - 1e-6 a side, so the ratio of
    the lower bound of one rate to the upper bound of the other exceeds the true ratio, hence
    e^eps, with probability <= 2e-6. (For one query the true ratio is at most e^(eps/4): the
    shift can be paid by the query noise alone; it approaches that far below the threshold
    (q = -8: ~0.23 for eps = 1), so this check is loose for an honest gate; the sequence audit
    below catches a gate at 2 eps.)"""
    eps = 1.0
    yes, no = log_ratio_lower_bounds(q, eps)
    assert yes <= eps
    assert no <= eps


NO_NO_YES = (-0.5,) * 5 + (0.5,), (0.5,) * 5 + (-0.5,)  # D, D': every query moved by 1


def no_then_yes(queries: tuple[float, ...], epsilon: float, seed: int) -> int:
    """How many of ``N_SVT`` fresh SparseVectors, each asked ``queries`` in turn (as one query's
    gate is asked at every step), answer no to all but the last and yes to the last."""
    rng = np.random.default_rng(seed)
    event = [False] * (len(queries) - 1) + [True]
    hits = 0
    for _ in range(N_SVT):
        gate = SparseVector(THRESHOLD, epsilon, rng)
        hits += [gate.above(q) for q in queries] == event
    return hits


def no_then_yes_law(queries: tuple[float, ...], epsilon: float) -> float:
    """Exactly: P(no to all but the last, yes to the last) = E over the noisy threshold
    T ~ THRESHOLD + Lap(2/eps) of prod_i P(q_i + Lap(4/eps) < T) x P(q_last + Lap(4/eps) >= T)."""
    *nos, last = queries

    def density(t: float) -> float:
        no = np.prod([stats.laplace.cdf(t - q, scale=4 / epsilon) for q in nos])
        return stats.laplace.pdf(t, THRESHOLD, 2 / epsilon) * no * stats.laplace.sf(t - last, scale=4 / epsilon)

    return integrate.quad(density, -50, 50, points=sorted({THRESHOLD, *queries}), limit=200)[0]


def test_sparse_vector_audit_catches_noise_at_double_epsilon():
    """One instance's whole answer sequence (what a query's gate releases until its yes). One
    answer alone cannot see a factor 2: its ratio is at most e^(eps/4) (the query noise's), e^(eps/2)
    for a gate at 2 eps. Five no then a yes, with D's five queries at -0.5 and last at +0.5 and D'
    the reverse (each query moves by 1, as one member's vote can in either direction), pays both
    halves of the proof's eps (threshold shift, last query shifted by 2). At eps = 2, exactly
    (``no_then_yes_law``): P_D = 0.0520, P_D' = 0.0092, ln ratio 1.73 <= 2; a gate at 2 eps (noise
    halved) audited at 2: P_D = 0.1017, P_D' = 0.00355, ln ratio 3.35. At n = 20000 the CP bounds
    cost ~0.1 (2000 hits) + ~0.65 (71 hits): mutant lower bound ~2.6 > 2, caught; the honest
    gate's counts lie inside their intervals around the exact law, and its bound stays <= eps."""
    eps = 2.0
    d, d2 = NO_NO_YES
    honest = no_then_yes(d, eps, 3), no_then_yes(d2, eps, 4)
    for hits, queries in zip(honest, NO_NO_YES, strict=True):
        assert cp_lower(hits, N_SVT) <= no_then_yes_law(queries, eps) <= cp_upper(hits, N_SVT)
    assert 1.0 < math.log(cp_lower(honest[0], N_SVT)) - math.log(cp_upper(honest[1], N_SVT)) <= eps
    mutant = no_then_yes(d, 2 * eps, 3), no_then_yes(d2, 2 * eps, 4)
    assert math.log(cp_lower(mutant[0], N_SVT)) - math.log(cp_upper(mutant[1], N_SVT)) > eps


def test_sparse_vector_restarts_after_a_yes_only():
    rng = np.random.default_rng(5)
    gate = SparseVector(0.0, 1.0, rng)
    first = gate._noisy_threshold
    assert not gate.above(-1e9)
    assert gate._noisy_threshold == first  # a no keeps the threshold: it is paid by the next yes
    assert gate.above(1e9)
    assert gate._noisy_threshold != first  # a yes draws a fresh one
    for eps in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="eps_gate"):
            SparseVector(0.0, eps, rng)
