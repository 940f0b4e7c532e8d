"""DPTree budget cascade (the paper's splits down to per-node noise, the tight composition
constant c, the theory copy count l) and the totals it reports."""

import math

import pytest

from vllm_dp_plugin.attention.budget import (
    TreeParams,
    feature_epsilon,
    num_leaves,
    theory_copies,
    tight_c,
    tree_budget,
)
from vllm_dp_plugin.privacy.accountant import Budget, advanced_epsilon

HEAD = Budget(1.0, 1e-6)


def test_closed_form_node_budget_matches_spec_5_9():
    params = TreeParams(c=0.1, output_level="entry", copies=3)
    r, n = 2145, 1000
    b = tree_budget(HEAD, params, r, 64, n)
    A, l, L = 2, 3, 10
    eps_node = 0.1 * 1.0 / (9 * A * l * L * math.sqrt(r * math.log(2 * A * l / 1e-6)))
    delta_node = 1e-6 / (9 * A * l * r * L)
    assert math.isclose(b.feature_node.epsilon, eps_node, rel_tol=1e-12)
    assert math.isclose(b.feature_node.delta, delta_node, rel_tol=1e-12)
    assert math.isclose(b.sw_node.epsilon, 1.0 / (9 * A * l * L), rel_tol=1e-12)


def test_spec_d6_laplace_scale_at_l1():
    b = tree_budget(HEAD, TreeParams(c=0.1, output_level="entry"), 2145, 64, 1024)
    assert 6.4e5 < 2.0 / b.feature_node.epsilon < 6.6e5  # node scale ~6.5e5 (d 64, n 1k)


@pytest.mark.parametrize("params", [TreeParams(), TreeParams.paper(), TreeParams(copies=3, output_level="entry")])
@pytest.mark.parametrize("features", [65, 2145])
def test_spent_never_exceeds_the_head_budget_plus_delta_prime(params, features):
    b = tree_budget(HEAD, params, features, 64, 4096)
    spent = b.spent()
    assert spent.epsilon <= HEAD.epsilon * (1 + 1e-9)
    assert spent.delta <= HEAD.delta + params.delta_prime


def test_paper_c_spends_about_0_38_eps_and_tight_c_spends_two_thirds():
    paper = tree_budget(HEAD, TreeParams(c=0.1), 2145, 64, 1024).spent()
    tight = tree_budget(HEAD, TreeParams(), 2145, 64, 1024).spent()
    assert 0.37 < paper.epsilon < 0.39  # eps/3 (s_w) + ~0.047 eps (features at c = 0.1)
    assert math.isclose(tight.epsilon, 2 / 3, rel_tol=1e-6)  # eps/3 (features) + eps/3 (s_w)


def test_tight_c_is_about_0_7_and_binds():
    for r in (65, 2145):
        c = tight_c(1.0, 1e-6, 1e-6, r)
        assert 0.69 < c < 1.0  # ~0.70 by Thm A.10; the optimal theorem is never looser
        eps_f = feature_epsilon(1.0, 1e-6, r, c)
        total_delta = r * 1e-6 / (3 * r) + 0.5e-6
        assert advanced_epsilon(eps_f, 1e-6 / (3 * r), r, total_delta) <= 1 / 3
        eps_more = feature_epsilon(1.0, 1e-6, r, c * 1.001)
        assert advanced_epsilon(eps_more, 1e-6 / (3 * r), r, total_delta) > 1 / 3


def test_theory_copies_match_spec_a13():
    assert abs(theory_copies(2145, 64, 1.0, 0.1) - 1.06e5) < 0.01e5
    assert abs(theory_copies(64, 64, 1.0, 0.1) - 3.2e3) < 0.01e3
    assert theory_copies(5, 2, 1.0, 0.1) % 2 == 1


def test_leaves_and_bad_parameters():
    assert [num_leaves(n) for n in (1, 2, 3, 37, 1024, 1025)] == [2, 2, 4, 64, 1024, 2048]
    with pytest.raises(ValueError, match="odd"):
        TreeParams(copies=2)
    with pytest.raises(ValueError, match="c must"):
        TreeParams(c=1.5)
    with pytest.raises(ValueError, match="output_level"):
        TreeParams(output_level="column")
    with pytest.raises(ValueError, match="epsilon"):
        tree_budget(Budget(0.0, 1e-6), TreeParams(), 10, 4, 16)
