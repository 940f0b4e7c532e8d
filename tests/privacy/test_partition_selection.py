"""DP partition selection (``privacy.partition_selection``): the statement from exact formulas,
the sampler's release law against them (OpenDP's generator cannot be seeded: tolerances are set
for a false failure well below 1e-6), and a distinguishing test that a half-noise mutant fails."""

import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from tests.privacy.test_aggregation import cp_lower, cp_upper
from vllm_dp_plugin.privacy.partition_selection import ThresholdRelease, tail

pytest.importorskip("opendp")

PVALUE = 1e-7


def draws(r: ThresholdRelease, count: int, n: int, seed: int | None = None) -> list[int | None]:
    """``n`` independent releases of a key counted ``count`` times (one call: n keys, each its
    own noise): the released value or None. ``seed``: the keyed sampler (``keyed_release``) with
    a generator of that seed, else OpenDP's."""
    counts = {f"k{i}": count for i in range(n)}
    out = r.release(counts) if seed is None else r.keyed_release(counts, torch.Generator().manual_seed(seed))
    return [out.get(f"k{i}") for i in range(n)]


def law(scale: float, count: int, threshold: int) -> dict:
    """Exact outcome law of one key of ``count``: value -> probability (None: not released)."""
    q = math.exp(-1.0 / scale)
    norm = (1 - q) / (1 + q)
    out = {v: norm * q ** abs(v - count) for v in range(threshold, count + 60)}
    out[None] = 1.0 - sum(out.values())
    return out


@pytest.mark.parametrize("epsilon,delta,l0", [(1.0, 1e-6, 1), (2.0, 1e-6, 1), (4.0, 1e-6, 1), (8.0, 1e-6, 1),
                                              (4.0, 1e-5, 2), (0.5, 1e-8, 1)])
def test_calibration_is_the_smallest_threshold_meeting_delta(epsilon, delta, l0):
    r = ThresholdRelease.calibrated(epsilon, delta, l0)
    assert l0 / epsilon <= r.scale < l0 / epsilon + 2.0 ** -20 and r.budget.epsilon <= epsilon
    q = math.exp(-epsilon / l0)
    assert r.budget.epsilon == pytest.approx(epsilon)
    assert r.budget.delta == pytest.approx(l0 * q ** (r.threshold - 1) / (1 + q)) and r.budget.delta <= delta
    assert l0 * tail(r.scale, r.threshold - 2) > delta or r.threshold == 2  # one less would not do


def test_thresholds_at_the_recommended_settings():
    assert [ThresholdRelease.calibrated(e, 1e-6).threshold for e in (1, 2, 4, 8)] == [15, 8, 5, 3]


@pytest.mark.parametrize("scale,seed", [(1.0, None), (1.0, 3), (0.75, 4), (ThresholdRelease.calibrated(3.0, 1e-6).scale, 5)])
def test_release_law_matches_the_exact_formula(scale, seed):
    """A key of count c is released with value v >= threshold with probability
    (1-q)/(1+q) q^|v-c| (chi-square over 20,000 draws), so a single vote (count 1) is released
    with exactly the statement's delta: OpenDP's sampler and the keyed one (``seed``), at an
    integer and at rational scales (the keyed sampler's t/s form)."""
    r = ThresholdRelease(scale=scale, threshold=4)
    for count in (1, 4, 6):
        expected = law(r.scale, count, r.threshold)
        seen = Counter(draws(r, count, 20_000, seed))
        keys = [None, *sorted(k for k in expected if k is not None and expected[k] * 20_000 >= 5)]
        observed = [seen.get(k, 0) for k in keys]
        probs = [expected[k] for k in keys]
        observed.append(20_000 - sum(observed))
        probs.append(1.0 - sum(probs))
        assert stats.chisquare(observed, np.array(probs) * 20_000).pvalue > PVALUE, (count, seen)
    assert law(r.scale, 1, r.threshold)[None] == pytest.approx(1.0 - r.budget.delta)


@pytest.mark.parametrize("seed", [None, 7])
def test_a_distinguisher_stays_within_epsilon_and_catches_half_the_noise(seed):
    """Neighbours: a key counted 5 or 6 times (one document more). The event 'released at >= 7'
    has probability ratio e^(1/scale) = e^eps; Clopper-Pearson bounds over 40,000 draws each keep
    the honest log-ratio below eps and put a mutant with half the scale (2 eps) above it (OpenDP's
    sampler and the keyed one)."""
    n, alpha = 40_000, 1e-7

    def lower_log_ratio(scale: float) -> float:
        r = ThresholdRelease(scale=scale, threshold=3)
        hit = {c: sum(v is not None and v >= 7 for v in draws(r, c, n, seed)) for c in (5, 6)}
        return math.log(cp_lower(hit[6], n, alpha) / cp_upper(hit[5], n, alpha))

    eps = 0.5
    assert lower_log_ratio(1 / eps) <= eps  # honest
    assert lower_log_ratio(0.5 / eps) > eps  # half the noise: caught


def test_the_keyed_release_is_a_function_of_its_generator():
    r, counts = ThresholdRelease.calibrated(2.0, 1e-6), {f"k{i}": 9 for i in range(50)}
    one, again, other = (r.keyed_release(counts, torch.Generator().manual_seed(s)) for s in (1, 1, 2))
    assert one == again and one != other
    with pytest.raises(ValueError, match="grid"):
        ThresholdRelease(scale=1 / 3, threshold=3).keyed_release(counts, torch.Generator())


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="threshold must be an integer >= 2"):
        ThresholdRelease(scale=1.0, threshold=1)
    with pytest.raises(ValueError, match="epsilon"):
        ThresholdRelease.calibrated(0.0, 1e-6)
    with pytest.raises(ValueError, match="counts must map"):
        ThresholdRelease(scale=1.0, threshold=3).release({"a": -1})


def test_the_statement_takes_the_samplers_release_probability_not_opendps_map():
    """A single vote (count 1) is released with probability P(Z >= threshold - 1): this module's
    delta. OpenDP 0.16's privacy map of the same measurement states P(Z >= threshold), which the
    sampler exceeds (measured), so it is not used (module docstring)."""
    from vllm_dp_plugin.privacy.partition_selection import _measurement

    r, n = ThresholdRelease(scale=1.0, threshold=5), 200_000
    hits = sum(v is not None for v in draws(r, 1, n))
    assert r.budget.delta == pytest.approx(tail(1.0, 4))
    assert cp_lower(hits, n) <= r.budget.delta <= cp_upper(hits, n)
    _, opendp_delta = _measurement(1.0, 5).map((1, 1, 1))
    assert opendp_delta == pytest.approx(tail(1.0, 5)) and cp_lower(hits, n) > opendp_delta
