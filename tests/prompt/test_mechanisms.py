"""Token mechanisms: noise laws (KS / chi-square with power checks), honest guarantees, errors."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from vllm_dp_plugin.privacy import NotDifferentiallyPrivateWarning, true_delta
from vllm_dp_plugin.prompt import MECHANISMS, token_mechanism
from vllm_dp_plugin.prompt.mechanisms import regularized_covariance

from .conftest import make_table

PVALUE = 1e-3
MISSCALE = 1.10  # the weakest mis-scaling (10 %) every distribution check must reject
TOKENS = 4000  # noise vectors per KS test: 4000 x 32 = 128k coordinates


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def make(name, table, eps, delta=1e-6, **kw):
    if name in ("trlap_paper", "trlap_repro"):
        with pytest.warns(NotDifferentiallyPrivateWarning):
            return token_mechanism(name, table, eps, None, **kw)
    return token_mechanism(name, table, eps, delta, **kw)


# --- additive per-coordinate laws: KS of all coordinates against the exact CDF ------------


@pytest.mark.parametrize(
    "name,eps",
    [("trlap_corrected", 2.0), ("laplace", 2.0), ("gaussian_analytic", 2.0), ("trlap_paper", 0.1)],
)
def test_coordinate_noise_matches_its_law_and_rejects_misscaling(table, name, eps):
    mech = make(name, table, eps)
    z = mech.sample_noise(TOKENS, gen()).numpy()
    assert z.dtype == np.float64 and z.shape == (TOKENS, table.dim)
    law = mech.noise.noise
    assert stats.kstest(z.ravel(), law.cdf).pvalue > PVALUE
    assert stats.kstest(MISSCALE * z.ravel(), law.cdf).pvalue < PVALUE
    assert np.abs(z).max() <= law.bound


def test_corrected_trlaplace_uses_the_tables_exact_sensitivities(table):
    mech = make("trlap_corrected", table, 2.0)
    scale = mech.noise.noise.scale
    assert scale == pytest.approx(table.sensitivity_l1 / 2.0, rel=1e-12)
    ratio = table.sensitivity_l1 / table.sensitivity_linf
    bound = scale * math.log1p(ratio * math.expm1(2.0 / ratio) / 2e-6)
    assert mech.noise.noise.bound == pytest.approx(bound, rel=1e-12)  # corrected bound A
    gauss = make("gaussian_analytic", table, 2.0)
    assert gauss.noise.sensitivity == table.sensitivity_l2


def test_perturb_adds_fresh_noise_to_each_row(table):
    mech = make("laplace", table, 2.0)
    rows = table.clipped[torch.tensor([5, 5, 9])]
    noise = mech.perturb(rows, gen(3)) - rows
    assert torch.allclose(noise, mech.sample_noise(3, gen(3)), rtol=0, atol=1e-12)
    assert not torch.allclose(noise[0], noise[1])  # same token, different noise


# --- Mahalanobis / CMP: radius and direction laws -------------------------------------------


def whitened(table, lam, z):
    values, vectors = torch.linalg.eigh(regularized_covariance(table.clipped, lam))
    inv_sqrt = vectors @ torch.diag(values.rsqrt()) @ vectors.T
    return z @ inv_sqrt, vectors[:, -1]  # and the top eigenvector


@pytest.mark.parametrize("name,lam", [("mahalanobis", 0.5), ("cmp", 0.0)])
def test_metric_noise_radius_and_direction(table, name, lam):
    """||S^-1 z|| ~ Gamma(d, 1/eps_m); S^-1 z / ||S^-1 z|| uniform on the sphere, so its projection
    on the top covariance direction v has (u.v + 1)/2 ~ Beta((d-1)/2, (d-1)/2)."""
    eps_m, d = 3.0, table.dim
    mech = make(name, table, eps_m)
    w, top = whitened(table, lam, mech.sample_noise(TOKENS * 4, gen(1)))
    radius = w.norm(dim=1).numpy()
    gamma = stats.gamma(a=d, scale=1 / eps_m).cdf
    assert stats.kstest(radius, gamma).pvalue > PVALUE
    assert stats.kstest(MISSCALE * radius, gamma).pvalue < PVALUE
    beta = stats.beta((d - 1) / 2, (d - 1) / 2).cdf
    projection = ((w / w.norm(dim=1, keepdim=True)) @ top + 1) / 2
    assert stats.kstest(projection.numpy(), beta).pvalue > PVALUE


def test_mahalanobis_direction_check_rejects_the_repo_bug(table):
    """The repo scales by Sigma_lambda instead of its square root; the direction test sees it."""
    mech = make("mahalanobis", table, 3.0)
    z = mech.sample_noise(TOKENS * 4, gen(1)) @ mech.sqrt_cov  # = R Sigma_lambda u
    w, top = whitened(table, 0.5, z)
    projection = ((w / w.norm(dim=1, keepdim=True)) @ top + 1) / 2
    beta = stats.beta((table.dim - 1) / 2, (table.dim - 1) / 2).cdf
    assert stats.kstest(projection.numpy(), beta).pvalue < PVALUE


def test_metric_guarantee_converts_with_the_metric_diameter(table):
    cmp = make("cmp", table, 0.5)
    assert cmp.guarantee.metric_epsilon == 0.5
    assert cmp.guarantee.epsilon == pytest.approx(0.5 * table.sensitivity_l2, rel=1e-12)
    maha = make("mahalanobis", table, 0.5)
    w, _ = whitened(table, 0.5, table.clipped)
    diameter = float(torch.cdist(w, w).max())
    assert maha.guarantee.epsilon == pytest.approx(0.5 * diameter, rel=1e-9)
    assert maha.guarantee.delta == 0.0 and maha.guarantee.valid
    assert (
        "metric-DP" in maha.guarantee.statement()
        and "eps_DP = eps_m * Delta_2" in maha.guarantee.statement()
    )


@pytest.mark.parametrize("name", ["mahalanobis", "cmp"])
def test_a_new_epsilon_costs_no_eigendecomposition_and_no_diameter(monkeypatch, name):
    """Per-request epsilons redo no set-up: requests picking fresh epsilons must not redo the epsilon-free O(d^3) and
    O(V^2 d) work; mechanisms of one table share it, a new table computes its own."""
    from vllm_dp_plugin.prompt import mechanisms

    calls = {"eigh": 0, "diameter": 0}
    eigh, diameter = torch.linalg.eigh, mechanisms.l2_diameter

    def counting_eigh(*args, **kwargs):
        calls["eigh"] += 1
        return eigh(*args, **kwargs)

    def counting_diameter(*args, **kwargs):
        calls["diameter"] += 1
        return diameter(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", counting_eigh)
    monkeypatch.setattr(mechanisms, "l2_diameter", counting_diameter)
    table = make_table(seed=7)  # a table no other test has built mechanisms for
    first, second = make(name, table, 0.5), make(name, table, 2.0)
    assert calls == {"eigh": 1, "diameter": 1 if name == "mahalanobis" else 0}
    assert torch.equal(first.sqrt_cov, second.sqrt_cov)
    assert second.guarantee.epsilon == pytest.approx(4 * first.guarantee.epsilon, rel=1e-12)
    make(name, make_table(seed=8), 0.5)
    assert calls["eigh"] == 2


# --- exponential mechanism: chi-square of sampled candidates -----------------------------------


def expmech_probabilities(table, eps, token):
    cand = table.clipped[table.candidates]
    dist = torch.cdist(table.clipped[token][None], cand)[0]
    return torch.softmax(-eps * dist / (2 * table.sensitivity_l2), 0).numpy()


def chi_square_pvalue(picks, probs):
    """Chi-square goodness of fit; bins with expected count < 5 are merged into one."""
    n = len(picks)
    observed = np.bincount(picks, minlength=len(probs)).astype(float)
    big = probs * n >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    return stats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue


@pytest.mark.parametrize("token,eps", [(17, 15.0), (2, 25.0)])  # a candidate and a special id
def test_expmech_sampling_law_and_power(table, token, eps):
    rows = table.clipped[torch.full((20_000,), token)]
    probs = expmech_probabilities(table, eps, token)
    picks = make("expmech", table, eps).select(rows, gen(2)).numpy()
    assert chi_square_pvalue(picks, probs) > PVALUE
    wrong = make("expmech", table, eps * MISSCALE).select(rows, gen(2)).numpy()
    assert chi_square_pvalue(wrong, probs) < PVALUE


# --- guarantees, reproduction modes, errors ----------------------------------------------------


def test_paper_mode_warns_and_records_the_true_delta():
    table = make_table(vocab=120, dim=16)
    with pytest.warns(NotDifferentiallyPrivateWarning) as caught:
        mech = token_mechanism("trlap_paper", table, 0.1)
    loud = f"TRUE per-token delta at eps=0.1 is {mech.guarantee.delta:.4g}"
    assert any(loud in str(w.message) for w in caught)
    claimed = 4.0**-16
    assert mech.noise.delta == pytest.approx(claimed, rel=1e-9)
    exact = true_delta(mech.noise, table.clipped)
    assert mech.guarantee.delta == pytest.approx(exact, rel=1e-12)
    assert mech.guarantee.delta > 0.1 > 1e6 * claimed
    assert "claims (0.1, 2.33e-10)" in mech.guarantee.statement()


def test_repro_mode_uses_the_repo_switch_and_records_a_subsample_bound(monkeypatch, table):
    """Over budget, the true delta is a lower bound from sampled rows and no guarantee is stated."""
    monkeypatch.setattr("vllm_dp_plugin.prompt.mechanisms.EXACT_DELTA_TERMS", 50 * 50 * table.dim)
    with pytest.warns(NotDifferentiallyPrivateWarning) as caught:
        mech = token_mechanism("trlap_repro", table, 0.5)
    assert any("lower bound" in str(w.message) for w in caught)
    assert not mech.guarantee.valid and mech.guarantee.delta > 0.1
    assert mech.noise.noise.truncation_mass == pytest.approx(
        2 * 0.5 / math.sqrt(table.dim), rel=1e-12
    )


@pytest.mark.parametrize("name", [n for n in MECHANISMS if n not in ("trlap_paper", "trlap_repro")])
def test_valid_mechanisms_state_their_guarantee(table, name):
    mech = make(name, table, 1.0)
    g = mech.guarantee
    assert g.valid and g.name == name and mech.table is table
    expected_delta = 1e-6 if name in ("trlap_corrected", "gaussian_analytic") else 0.0
    assert g.delta == expected_delta
    assert f"{g.epsilon:.6g}" in g.statement()


BAD_EPS = [0.0, -1.0, float("nan"), float("inf"), "x", None]


@pytest.mark.parametrize("eps", BAD_EPS)
def test_bad_epsilon_fails_before_any_computation(eps):
    table = make_table()
    for name in ("gaussian_analytic", "expmech", "laplace", "mahalanobis"):
        with pytest.raises(ValueError, match="epsilon"):
            token_mechanism(name, table, eps, 1e-6)
    assert "sensitivity_l2" not in table.__dict__  # the O(V^2 d) diameter was never computed


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("gauss", {}, "unknown token mechanism"),
        ("trlap_corrected", {"delta": None}, "needs delta"),
        ("gaussian_analytic", {"delta": 1.5}, "delta"),
        ("trlap_paper", {"delta": 0.0}, "delta"),
        ("mahalanobis", {"mahalanobis_lambda": 1.0}, "mahalanobis_lambda"),
        ("trlap_paper", {"effective_dim": 0}, "effective_dim"),
    ],
)
def test_bad_arguments_fail_before_any_computation(name, kwargs, match):
    table = make_table()
    args = {"delta": 1e-6} | kwargs
    with pytest.raises(ValueError, match=match):
        token_mechanism(name, table, 1.0, args.pop("delta"), **args)
    assert "sensitivity_l2" not in table.__dict__


def test_huge_epsilon_overflow_is_a_clear_error(table):
    with pytest.raises(ValueError, match="too large"):
        token_mechanism("trlap_corrected", table, 1e6, 1e-6)
