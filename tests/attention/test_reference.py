"""Mode A (``reference``): the paper's Algorithms 1-7 against brute force and closed forms.

Noise-free checks inject all-zero node noise. Statistical checks use fixed seeds and tolerances
derived from the sampling distribution of the estimator (its exact variance and deterministic
error bound: ``predicted_variance_and_bound``).
"""

import math

import pytest
import torch

from vllm_dp_plugin.attention.budget import TreeParams, num_leaves, tree_budget
from vllm_dp_plugin.attention.features import InputBounds, TaylorFeatures
from vllm_dp_plugin.attention.reference import (
    DPCrossAttentionReference,
    DPTree,
    DPTreeDistance,
    DPTreeHighDim,
    DPTreeSoftmax,
    DPTreeSoftmaxAdaptive,
    bin_index,
    reference_arguments,
)
from vllm_dp_plugin.attention.tree_spec import make_tree_spec, sample_tree_noise
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.mechanisms import truncated_laplace_mechanism

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def leaf0(u: torch.Tensor, lo, hi, n_leaves: int) -> torch.Tensor:
    """0-based floor bins on [lo, hi], clamped to [0, N-1] (independent of ``bin_index``)."""
    return torch.clamp(torch.floor((u - lo) * n_leaves / (hi - lo)), 0, n_leaves - 1).long()


def zero_softmax_noise(features: int, n_leaves: int):
    return torch.zeros(features, 3, 2 * n_leaves, dtype=F64), torch.zeros(2 * n_leaves, dtype=F64)


def kernel_plus_bias(u, w, v, lo, hi, n_leaves):
    """Noise-free DPTreeSoftmax = sum_j w_j u_j.v + the own-leaf bias (own leaves are in no
    sibling sum):
    1/2 sum_f [sum_{bin(u_jf)=b_f} w_j (u_jf - v_f)^2 - sum_{bin(u_jf)=b_0} w_j u_jf^2]."""
    bins = leaf0(u, lo, hi, n_leaves)  # [n, F]
    b_v = leaf0(v, lo, hi, n_leaves)  # [F]
    b_0 = leaf0(torch.zeros_like(v), lo, hi, n_leaves)
    own_v = (bins == b_v).to(F64)
    own_0 = (bins == b_0).to(F64)
    bias = 0.5 * ((w[:, None] * own_v * (u - v) ** 2).sum() - (w[:, None] * own_0 * u**2).sum())
    return float(w @ (u @ v) + bias)


# ---------------------------------------------------------------------------- Alg. 4/5 vectors


def test_figure_1_vector():
    """The paper's Figure 1 example: p = 1, y = 0, range [0, 1], N = 16, noise off -> 4.4."""
    x = torch.tensor([0.1, 0.3, 0.3, 0.3, 0.4, 0.6, 0.7, 0.9, 0.9], dtype=F64)
    w = torch.tensor([2.2, 3.1, -2, -3, 2, 6, 0.5, -1, 1], dtype=F64)
    dist = DPTreeDistance(
        x, w, 1, 1.0, 1e-6, 0.0, 1.0, 6.0, 16, noise=torch.zeros(2, 32, dtype=F64)
    )
    assert dist.query(0.0) == pytest.approx(4.4, abs=1e-12)


# ---------------------------------------------------------------------------- Alg. 2


def _edge_queries(lo: float, hi: float, n_leaves: int, generator: torch.Generator) -> list[float]:
    width = hi - lo
    edges = [lo + k * width / n_leaves for k in range(n_leaves + 1)]
    nudged = [math.nextafter(e, -math.inf) for e in edges] + [
        math.nextafter(e, math.inf) for e in edges
    ]
    random = (lo + width * torch.rand(50, generator=generator, dtype=F64)).tolist()
    return [lo, hi, 0.5 * (lo + hi), *edges, *nudged, *random]


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (-1.3, 2.1)])
def test_dptree_noise_free_sibling_sums(lo, hi):
    """n = 37 data binned into N = 64 leaves; QUERY returns the exact strictly-left / -right
    bin sums, reads exactly L nodes (one per layer) that tile every leaf but y's own, never
    the root."""
    g = gen(1)
    n = 37
    n_leaves = num_leaves(n)
    assert n_leaves == 64
    x = lo + (hi - lo) * torch.rand(n, generator=g, dtype=F64)
    x[:3] = torch.tensor([lo, hi, 0.5 * (lo + hi)], dtype=F64)
    w = torch.rand(n, generator=g, dtype=F64) * 4 - 2
    bins = leaf0(x, lo, hi, n_leaves)
    leaves = torch.zeros(n_leaves, dtype=F64).index_add_(0, bins, w)
    tree = DPTree(leaves, 4.0, 1.0, 1e-6, lo, hi, node_noise=torch.zeros(2 * n_leaves, dtype=F64))
    levels = tree.levels
    assert levels == 6 and torch.isnan(tree.nodes[:2]).all()
    for y in _edge_queries(lo, hi, n_leaves, g):
        j = bin_index(y, lo, hi, n_leaves)  # 1-based
        assert j == int(leaf0(torch.tensor(y, dtype=F64), lo, hi, n_leaves)) + 1
        c_left, c_right = tree.query(y)
        assert c_left == pytest.approx(float(leaves[: j - 1].sum()), abs=1e-12)
        assert c_right == pytest.approx(float(leaves[j:].sum()), abs=1e-12)
        assert tree.reads == levels and len(tree.last_read) == levels and 1 not in tree.last_read
        covered = []
        for i, k in enumerate(tree.last_read, start=1):
            assert 2**i <= k < 2 ** (i + 1)  # one sibling per layer
            first = k << (levels - i)
            covered += range(first, first + (1 << (levels - i)))
        own = n_leaves + j - 1
        assert sorted(covered) == [k for k in range(n_leaves, 2 * n_leaves) if k != own]
    assert tree.total_reads == levels * len(_edge_queries(lo, hi, n_leaves, g))


def test_bin_index_layers_are_ancestors():
    """Every layer's node for y is the ancestor of y's leaf (also exactly on bin edges)."""
    g = gen(2)
    lo, hi, n_leaves = -0.7, 1.9, 256
    for y in _edge_queries(lo, hi, n_leaves, g):
        leaf = bin_index(y, lo, hi, n_leaves)
        for i in range(1, 9):
            assert bin_index(y, lo, hi, 1 << i) == (leaf - 1) // (n_leaves >> i) + 1
    assert bin_index(lo - 5.0, lo, hi, 8) == 1 and bin_index(hi + 5.0, lo, hi, 8) == 8


def test_dptree_node_noise_and_calibration():
    """Node k holds exact + noise[k]; sampled noise is TLap(Delta, eps/L, delta/L)."""
    leaves = torch.arange(8, dtype=F64)
    noise = torch.randn(16, generator=gen(3), dtype=F64)
    tree = DPTree(leaves, 2.0, 0.6, 3e-6, 0.0, 1.0, node_noise=noise)
    exact = torch.zeros(16, dtype=F64)
    exact[8:] = leaves
    for k in range(7, 0, -1):
        exact[k] = exact[2 * k] + exact[2 * k + 1]
    torch.testing.assert_close(tree.nodes[2:], exact[2:] + noise[2:], rtol=0, atol=1e-15)
    mech = tree.mechanism
    assert (mech.epsilon, mech.delta, mech.sensitivity) == pytest.approx(
        (0.2, 1e-6, 2.0), rel=1e-15
    )
    sampled = DPTree(leaves, 2.0, 0.6, 3e-6, 0.0, 1.0, generator=gen(4))
    expected = truncated_laplace_mechanism(2.0, 0.2, 1e-6).sample((16,), gen(4))
    torch.testing.assert_close(sampled.nodes[2:], exact[2:] + expected[2:], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------- Alg. 4/5/6


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("lo,hi", [(0.0, 1.5), (-1.5, 1.0)])
def test_distance_noise_free_matches_brute_force(p, lo, hi):
    """Noise-free Alg. 5 = sum over j with bin(x_j) != bin(y) of w_j |x_j - y|^p."""
    g = gen(5)
    n, n_leaves, r_w = 29, 32, 2.0
    x = lo + (hi - lo) * torch.rand(n, generator=g, dtype=F64)
    w = (torch.rand(n, generator=g, dtype=F64) * 2 - 1) * r_w
    dist = DPTreeDistance(
        x, w, p, 1.0, 1e-6, lo, hi, r_w, n_leaves, noise=torch.zeros(p + 1, 64, dtype=F64)
    )
    rng = max(abs(lo), abs(hi))
    assert dist.sensitivities == pytest.approx([2 * r_w * rng**q for q in range(p + 1)], rel=1e-15)
    for tree in dist.trees:
        assert tree.mechanism.epsilon == pytest.approx(1.0 / (p + 1) / 5, rel=1e-15)
    for y in [
        lo,
        hi,
        0.0,
        *x[:5].tolist(),
        *(lo + (hi - lo) * torch.rand(20, generator=g, dtype=F64)).tolist(),
    ]:
        outside = leaf0(x, lo, hi, n_leaves) != leaf0(torch.tensor(y, dtype=F64), lo, hi, n_leaves)
        brute = float((w * (x - y).abs() ** p)[outside].sum())
        assert dist.query(y) == pytest.approx(brute, abs=1e-12 * float((w.abs() * 4**p).sum()))


def test_high_dim_noise_free_and_budget():
    """Alg. 6 = sum of per-dimension distances; eps_i = c eps/sqrt(d ln(1/delta')), delta/d."""
    g = gen(6)
    n, d, p, n_leaves = 19, 3, 2, 32
    x = torch.rand(n, d, generator=g, dtype=F64)
    w = torch.rand(n, generator=g, dtype=F64) * 2 - 1
    hd = DPTreeHighDim(
        x,
        w,
        p,
        2.0,
        3e-6,
        1e-5,
        0.09,
        0.0,
        1.0,
        1.0,
        n_leaves,
        noise=torch.zeros(d, p + 1, 64, dtype=F64),
    )
    eps_i = 0.09 * 2.0 / math.sqrt(d * math.log(1e5))
    for dim in hd.dims:
        for tree in dim.trees:
            assert tree.mechanism.epsilon == pytest.approx(eps_i / (p + 1) / 5, rel=1e-14)
            assert tree.mechanism.delta == pytest.approx(1e-6 / (p + 1) / 5, rel=1e-14)
    for _ in range(10):
        y = torch.rand(d, generator=g, dtype=F64)
        outside = leaf0(x, 0.0, 1.0, n_leaves) != leaf0(y, 0.0, 1.0, n_leaves)
        brute = float((w[:, None] * (x - y) ** 2 * outside).sum())
        assert hd.query(y) == pytest.approx(brute, abs=1e-12)


# ---------------------------------------------------------------------------- Alg. 3 noise-free


@pytest.mark.parametrize("signed", [False, True])
def test_softmax_noise_free_equals_kernel_plus_own_leaf_bias(signed):
    """d = 3, s = 2, beta = 1/d, K, Q in [0, 1] (or [-1, 1] for signed inputs)."""
    g = gen(7)
    d, n, r_w = 3, 37, 2.0
    fmap = TaylorFeatures(d, 2, 1.0 / d)
    hi = fmap.coordinate_bounds(InputBounds.of(1.0, None, d))
    lo = -hi if signed else torch.zeros_like(hi)
    keys = torch.rand(n, d, generator=g, dtype=F64) * (2 if signed else 1) - (1 if signed else 0)
    w = (torch.rand(n, generator=g, dtype=F64) * 2 - 1) * r_w
    u = fmap(keys)
    n_leaves = num_leaves(n)
    sm = DPTreeSoftmax(
        u,
        w,
        1.0,
        1e-6,
        1e-6,
        0.09,
        lo,
        hi,
        r_w,
        1.0,
        n_leaves,
        noise=zero_softmax_noise(fmap.dim, n_leaves),
        generator=gen(0),
    )
    assert sm.s_w == pytest.approx(float(w.sum()), abs=1e-12)
    queries = torch.rand(12, d, generator=g, dtype=F64) * (2 if signed else 1) - (
        1 if signed else 0
    )
    queries = torch.cat(
        [queries, torch.zeros(1, d, dtype=F64), torch.ones(1, d, dtype=F64), keys[:2]]
    )
    for y in queries:
        v = fmap(y)
        scale = float((w.abs() * ((u**2).sum(1) + (v**2).sum())).sum())
        expected = kernel_plus_bias(u, w, v, lo, hi, n_leaves)
        assert sm.query(v) == pytest.approx(expected, abs=1e-12 * scale)


# ---------------------------------------------------------------------------- Alg. 3 noise path

VAR_SEEDS = 4000
# Tolerance in standard errors of s^2 (SE ~ 2.5% of Var here). 4 SE balances the two errors:
# a correct implementation fails w.p. ~6e-5, the x1.1 twin (Var x1.21) passes w.p. ~1e-3.
VAR_SIGMAS = 4.0
VAR_EPS, VAR_DELTA, VAR_DELTA_PRIME, VAR_C = 50.0, 1e-6, 1e-6, 0.09
VAR_N, VAR_LEAVES, VAR_RW = 12, 16, 1.5


@pytest.fixture(scope="module")
def small_softmax():
    """d = 2, s = 1 (F = 3: x1, x2, 1), n = 12 -> N = 16, L = 4; one weight column."""
    g = gen(8)
    fmap = TaylorFeatures(2, 1, 0.5)
    hi = fmap.coordinate_bounds(InputBounds.of(1.0, None, 2))
    lo = torch.zeros_like(hi)
    u = fmap(torch.rand(VAR_N, 2, generator=g, dtype=F64))
    w = (torch.rand(VAR_N, generator=g, dtype=F64) * 2 - 1) * VAR_RW
    v = fmap(torch.tensor([0.03, 0.2], dtype=F64))  # leaves: same as 0, 3, last -> h = 0, 2, 4
    build = lambda noise, generator: DPTreeSoftmax(
        u,
        w,
        VAR_EPS,
        VAR_DELTA,
        VAR_DELTA_PRIME,
        VAR_C,
        lo,
        hi,
        VAR_RW,
        1.0,
        VAR_LEAVES,
        noise=noise,
        generator=generator,
    )
    truth = build(zero_softmax_noise(3, VAR_LEAVES), gen(0)).query(v)
    assert truth == pytest.approx(kernel_plus_bias(u, w, v, lo, hi, VAR_LEAVES), rel=1e-12)
    return {"build": build, "u": u, "w": w, "v": v, "lo": lo, "hi": hi, "truth": truth}


def node_mechanisms(case):
    """Independent recomputation of the per-node laws: feature (f, q) and s_w q = 2."""
    levels = VAR_LEAVES.bit_length() - 1
    features = case["u"].shape[1]
    eps_f = VAR_C * VAR_EPS / (3 * math.sqrt(features * math.log(2 / VAR_DELTA_PRIME)))
    delta_f = VAR_DELTA / (3 * features)
    feature = [
        [
            truncated_laplace_mechanism(
                2 * VAR_RW * float(case["hi"][f]) ** q, eps_f / 3 / levels, delta_f / 3 / levels
            )
            for q in range(3)
        ]
        for f in range(features)
    ]
    sw = truncated_laplace_mechanism(2 * VAR_RW, VAR_EPS / 9 / levels, VAR_DELTA / 9 / levels)
    return feature, sw


def predicted_variance_and_bound(case):
    """Exact per-copy variance of one DPTreeSoftmax answer and its deterministic error bound (TLap
    noise is bounded, so the bound holds for every query at once) for query features v. With
    h_f = bitlength(b_f XOR b_0) (the paths to v_f's leaf and to 0's differ in 2 h_f siblings),
    node variances V_q / bounds B_q of moment q and L levels:
    ``Var = 1/4 [sum_f (2 h_f V_2 + L v_f^4 V_0 + 4 L v_f^2 V_1) + L ||v||^4 V_sw]`` and
    ``|noise| <= 1/2 [sum_f (2 h_f B_2 + L v_f^2 B_0 + 2 L |v_f| B_1) + L ||v||^2 B_sw]``."""
    levels = VAR_LEAVES.bit_length() - 1
    feature, sw = node_mechanisms(case)
    v = case["v"].tolist()
    b_v = leaf0(case["v"], case["lo"], case["hi"], VAR_LEAVES).tolist()
    b_0 = leaf0(torch.zeros(len(v), dtype=F64), case["lo"], case["hi"], VAR_LEAVES).tolist()
    h = [(bf ^ b0).bit_length() for bf, b0 in zip(b_v, b_0, strict=True)]
    assert sorted(h) == [0, 2, 4]  # exercises equal, partially and fully split paths
    norm2 = sum(x * x for x in v)
    var, bound = norm2**2 * levels * sw.variance, levels * norm2 * sw.noise.bound
    for f, vf in enumerate(v):
        V = [m.variance for m in feature[f]]
        B = [m.noise.bound for m in feature[f]]
        var += 2 * h[f] * V[2] + levels * vf**4 * V[0] + 4 * levels * vf**2 * V[1]
        bound += 2 * h[f] * B[2] + levels * vf**2 * B[0] + 2 * levels * abs(vf) * B[1]
    return var / 4, bound / 2


@pytest.fixture(scope="module")
def generator_answers(small_softmax):
    """VAR_SEEDS answers at v, each from a DPTreeSoftmax drawing its own noise (seed s)."""
    v = small_softmax["v"]
    return torch.tensor(
        [small_softmax["build"](None, gen(s)).query(v) for s in range(VAR_SEEDS)], dtype=F64
    )


def variance_test(answers: torch.Tensor, truth: float, predicted: float) -> tuple[bool, bool, str]:
    """(variance ok, mean ok, message): |s^2 - Var| <= VAR_SIGMAS SE(s^2), SE from the empirical
    4th central moment; |mean - truth| <= VAR_SIGMAS sqrt(Var / S)."""
    n = answers.numel()
    centred = answers - answers.mean()
    s2 = float(centred.pow(2).sum() / (n - 1))
    m4 = float(centred.pow(4).mean())
    se = math.sqrt(max(m4 - s2**2 * (n - 3) / (n - 1), 0.0) / n)
    mean_err = abs(float(answers.mean()) - truth)
    mean_tol = VAR_SIGMAS * math.sqrt(predicted / n)
    message = (
        f"s2/Var = {s2 / predicted:.4f} (tol {VAR_SIGMAS * se / predicted:.4f}); "
        f"mean err {mean_err:.4g} (tol {mean_tol:.4g})"
    )
    return abs(s2 - predicted) <= VAR_SIGMAS * se, mean_err <= mean_tol, message


def test_softmax_noise_variance_matches_formula(small_softmax, generator_answers):
    predicted, _ = predicted_variance_and_bound(small_softmax)
    var_ok, mean_ok, message = variance_test(generator_answers, small_softmax["truth"], predicted)
    assert var_ok and mean_ok, message


def test_variance_check_rejects_noise_scaled_by_1_1(small_softmax):
    """Twin: node noise sampled here (independent calibration), injected x1.1 (variance x1.21):
    the same tolerance must reject it, so the check above can fail."""
    feature, sw = node_mechanisms(small_softmax)
    g = gen(9)
    nodes = 2 * VAR_LEAVES
    f_noise = torch.stack(
        [torch.stack([m.sample((VAR_SEEDS, nodes), g) for m in row], dim=1) for row in feature],
        dim=1,
    )  # [S, F, 3, 2N]
    sw_noise = sw.sample((VAR_SEEDS, nodes), g)
    v, build = small_softmax["v"], small_softmax["build"]
    answers = torch.tensor(
        [build((1.1 * f_noise[s], 1.1 * sw_noise[s]), g).query(v) for s in range(VAR_SEEDS)],
        dtype=F64,
    )
    predicted, _ = predicted_variance_and_bound(small_softmax)
    var_ok, mean_ok, message = variance_test(answers, small_softmax["truth"], predicted)
    assert mean_ok, message
    assert not var_ok, message


def test_noise_present_and_bounded(small_softmax, generator_answers):
    """Different seeds differ; |answer - noise-free| <= the deterministic bound for every seed."""
    _, bound = predicted_variance_and_bound(small_softmax)
    errors = (generator_answers - small_softmax["truth"]).abs()
    assert generator_answers[0] != generator_answers[1]
    assert len(set(generator_answers.tolist())) == VAR_SEEDS
    assert float(errors.max()) <= bound
    assert float(errors.max()) > 1e-3 * bound  # the bound is not vacuous for this noise


# ---------------------------------------------------------------------------- Alg. 1 / 7


def small_head(
    params: TreeParams, signed: bool, n: int = 13, d: int = 2, degree: int = 2, dv: int = 2
):
    g = gen(10)
    value_bound = 1.5
    fmap = TaylorFeatures(d, degree, 1.0 / d)
    keys = InputBounds.of(1.0, None, d)
    budget = tree_budget(Budget(3.0, 1e-5), params, fmap.dim, dv, n)
    spec = make_tree_spec(fmap, keys, value_bound, signed, params, budget, dv, n)
    k = torch.rand(n, d, generator=g, dtype=F64) * (2 if signed else 1) - (1 if signed else 0)
    values = (torch.rand(n, dv, generator=g, dtype=F64) * 2 - 1) * value_bound
    kwargs = reference_arguments(spec, budget, params, value_bound)
    return fmap, fmap(k), values, spec, budget, kwargs


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize(
    "params",
    [
        TreeParams(),
        TreeParams(copies=3, output_level="entry"),
        TreeParams.paper(),
        TreeParams.paper(copies=3),
    ],
    ids=["default", "entry-l3", "paper", "paper-l3"],
)
def test_literal_cascade_matches_tree_budget_and_spec(params, signed):
    """The reference's own per-node (eps, delta, Delta, range) = budget.feature_node /
    sw_node and spec.sensitivity / sw_sensitivity, for every (column, copy, feature, moment)."""
    _, pk, values, spec, budget, kwargs = small_head(params, signed)
    ref = DPCrossAttentionReference(pk, values, **kwargs, generator=gen(11))
    W, F = spec.sensitivity.shape[:2]
    assert len(ref.columns) == W and ref.parts == budget.columns
    feat_scale, feat_ratio = spec.feature_noise_scale()
    sw_scale, _ = spec.sw_noise_scale()
    for w_idx, column in enumerate(ref.columns):
        assert len(column.copies) == spec.copies
        for copy in column.copies:
            assert len(copy.distances) == F
            for f, dist in enumerate(copy.distances):
                for q, tree in enumerate(dist.trees):
                    mech = tree.mechanism
                    assert (tree.lo, tree.hi) == (float(spec.lo[f]), float(spec.hi[f]))
                    assert tree.levels == spec.levels and tree.leaves == spec.leaves
                    assert mech.epsilon == pytest.approx(budget.feature_node.epsilon, rel=1e-12)
                    assert mech.delta == pytest.approx(budget.feature_node.delta, rel=1e-12)
                    assert mech.sensitivity == pytest.approx(
                        float(spec.sensitivity[w_idx, f, q]), rel=1e-12
                    )
                    assert mech.noise.scale == pytest.approx(
                        float(feat_scale[w_idx, f, q]), rel=1e-12
                    )
                    assert mech.noise.bound / mech.noise.scale == pytest.approx(
                        feat_ratio, rel=1e-12
                    )
            sw_tree = copy.sw.trees[2]
            assert (sw_tree.lo, sw_tree.hi) == (0.0, spec.sw_hi)
            assert sw_tree.mechanism.epsilon == pytest.approx(budget.sw_node.epsilon, rel=1e-12)
            assert sw_tree.mechanism.delta == pytest.approx(budget.sw_node.delta, rel=1e-12)
            assert sw_tree.mechanism.sensitivity == pytest.approx(
                float(spec.sw_sensitivity[w_idx]), rel=1e-12
            )
            assert sw_tree.mechanism.noise.scale == pytest.approx(float(sw_scale[w_idx]), rel=1e-12)


def test_cross_attention_noise_free_and_injected_plumbing():
    """Zero noise: every column = kernel + own-leaf bias, query = num/den. Canonical noise
    (sample_tree_noise): column answer = median of independently built copies."""
    params = TreeParams(copies=3)
    fmap, pk, values, spec, budget, kwargs = small_head(params, signed=False)
    W, F = spec.sensitivity.shape[:2]
    N, C = spec.leaves, spec.copies
    zero = (torch.zeros(W, C, F, 3, 2 * N, dtype=F64), torch.zeros(W, C, 2 * N, dtype=F64))
    ref = DPCrossAttentionReference(pk, values, **kwargs, noise=zero, generator=gen(12))
    queries = torch.rand(4, 2, generator=gen(13), dtype=F64)
    pq = fmap(queries)
    weights = torch.cat([values, torch.ones(values.shape[0], 1, dtype=F64)], dim=1)
    answer = ref.answer(pq)
    for i, v in enumerate(pq):
        for k in range(W):
            expected = kernel_plus_bias(pk, weights[:, k], v, spec.lo, spec.hi, N)
            assert float(answer[i, k]) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(ref.query(pq), answer[:, :-1] / answer[:, -1:], rtol=0, atol=0)

    feature_noise, sw_noise = sample_tree_noise(spec, 1, gen(14))
    noisy = DPCrossAttentionReference(
        pk, values, **kwargs, noise=(feature_noise[0], sw_noise[0]), generator=gen(15)
    )
    answer = noisy.answer(pq)
    A, l = budget.columns, C
    bounds = [kwargs["value_bound"]] * (W - 1) + [kwargs["ones_bound"]]
    for k in range(W):
        copies = [
            DPTreeSoftmax(
                pk,
                weights[:, k],
                3.0 / A / l,
                1e-5 / A / l,
                params.delta_prime / A / l,
                budget.c,
                spec.lo,
                spec.hi,
                bounds[k],
                spec.sw_hi,
                N,
                noise=(feature_noise[0, k, i], sw_noise[0, k, i]),
                generator=gen(16),
            )
            for i in range(C)
        ]
        for i, v in enumerate(pq):
            each = torch.tensor([copy.query(v) for copy in copies], dtype=F64)
            torch.testing.assert_close(
                noisy.columns[k].copy_answers(v), each, rtol=1e-12, atol=1e-9
            )
            assert float(answer[i, k]) == pytest.approx(float(each.median()), rel=1e-12, abs=1e-9)


def test_repeated_queries_identical_and_no_raw_data_kept():
    """Noise is fixed at INIT; no tensor or list shaped like the n private rows survives."""
    params = TreeParams(copies=3)
    fmap, pk, values, spec, _, kwargs = small_head(params, signed=True)
    n = pk.shape[0]
    assert n not in (spec.leaves, 2 * spec.leaves, pk.shape[1], values.shape[1] + 1, 3)
    ref = DPCrossAttentionReference(pk, values, **kwargs, generator=gen(17))
    pq = fmap(torch.rand(3, 2, generator=gen(18), dtype=F64) * 2 - 1)
    first = ref.answer(pq)
    torch.testing.assert_close(ref.answer(pq), first, rtol=0, atol=0)
    torch.testing.assert_close(ref.answer(pq.clone()), first, rtol=0, atol=0)

    seen, found = set(), []

    def walk(obj, path):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.dim() > 0 and obj.shape[0] == n:
                found.append(path)
        elif isinstance(obj, (list, tuple)):
            if len(obj) == n:
                found.append(path)
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]")
        elif isinstance(obj, dict):
            for key, item in obj.items():
                walk(item, f"{path}.{key}")
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(
            "vllm_dp_plugin.attention"
        ):
            walk(vars(obj), path)

    walk(ref, "ref")
    assert not found, found
    assert len(seen) > 100  # the walk really reached the trees
    raw = set(pk.reshape(-1).tolist()) | set(values.reshape(-1).tolist())
    stored = [
        x
        for col in ref.columns
        for c in col.copies
        for d in c.distances
        for t in d.trees
        for x in t._nodes
    ]
    assert not raw & set(stored)


def test_adaptive_median_and_copy_budget():
    g = gen(19)
    fmap = TaylorFeatures(2, 1, 0.5)
    hi = fmap.coordinate_bounds(InputBounds.of(1.0, None, 2))
    u = fmap(torch.rand(10, 2, generator=g, dtype=F64))
    w = torch.rand(10, generator=g, dtype=F64)
    ad = DPTreeSoftmaxAdaptive(
        u,
        w,
        3.0,
        3e-6,
        3e-6,
        0.09,
        torch.zeros(3, dtype=F64),
        hi,
        1.0,
        1.0,
        16,
        5,
        generator=gen(20),
    )
    v = fmap(torch.tensor([0.4, 0.9], dtype=F64))
    each = ad.copy_answers(v)
    assert len(set(each.tolist())) == 5
    assert ad.query(v) == float(each.median())
    levels = 4
    eps_f = 0.09 * (3.0 / 5) / (3 * math.sqrt(3 * math.log(2 / (3e-6 / 5))))
    for copy in ad.copies:
        assert copy.epsilon_f == pytest.approx(eps_f, rel=1e-14)
        assert copy.delta_f == pytest.approx(3e-6 / 5 / 9, rel=1e-14)
        assert copy.sw.trees[2].mechanism.epsilon == pytest.approx(
            3.0 / 5 / 3 / 3 / levels, rel=1e-14
        )


def test_invalid_inputs_rejected():
    x, w = torch.tensor([0.2, 0.5], dtype=F64), torch.tensor([1.0, -1.0], dtype=F64)
    with pytest.raises(ValueError, match="power of 2"):
        DPTreeDistance(x, w, 2, 1.0, 1e-6, 0.0, 1.0, 1.0, 12)
    with pytest.raises(ValueError, match="outside the public range"):
        DPTreeDistance(x + 1.0, w, 2, 1.0, 1e-6, 0.0, 1.0, 1.0, 8)
    with pytest.raises(ValueError, match="R_w"):
        DPTreeDistance(x, 3 * w, 2, 1.0, 1e-6, 0.0, 1.0, 1.0, 8)
    with pytest.raises(ValueError, match="shape"):
        DPTreeDistance(x, w, 2, 1.0, 1e-6, 0.0, 1.0, 1.0, 8, noise=torch.zeros(3, 8, dtype=F64))
    with pytest.raises(ValueError, match="delta < 0.5"):
        DPTree(torch.zeros(2, dtype=F64), 1.0, 1.0, 0.7, 0.0, 1.0)
    u = torch.rand(4, 3, generator=gen(0), dtype=F64)
    with pytest.raises(ValueError, match="odd"):
        DPTreeSoftmaxAdaptive(
            u,
            torch.ones(4, dtype=F64),
            1.0,
            1e-6,
            1e-6,
            0.09,
            torch.zeros(3),
            torch.ones(3),
            1.0,
            1.0,
            4,
            2,
        )
    with pytest.raises(ValueError, match="output_level"):
        DPCrossAttentionReference(
            u,
            torch.zeros(4, 1, dtype=F64),
            1.0,
            1e-6,
            1e-6,
            0.09,
            1,
            "cell",
            torch.zeros(3),
            torch.ones(3),
            1.0,
            1.0,
            1.0,
            4,
        )
