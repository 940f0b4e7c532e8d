"""Mode B (``tree``): TreeRelease against brute force, a literal explicit tree, the Mode A oracle,
and the exact noise variance and deterministic error bound of one answer."""

import math

import pytest
import torch

from vllm_dp_plugin.attention.budget import TreeParams, tree_budget
from vllm_dp_plugin.attention.features import InputBounds, TaylorFeatures
from vllm_dp_plugin.attention.reference import DPCrossAttentionReference, reference_arguments
from vllm_dp_plugin.attention.tree import TreeRelease
from vllm_dp_plugin.attention.tree_spec import TreeSpec, make_tree_spec, sample_tree_noise
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.noise import LaplaceNoise

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def leaf(u, lo, hi, n_leaves):
    """0-based leaf, written independently of the package's ``bin_index``."""
    return torch.clamp(torch.floor((u - lo) * n_leaves / (hi - lo)), 0, n_leaves - 1).long()


def make_spec(lo, hi, value_bound, dv, leaves, copies, feature_node=None, sw_node=None, sw_hi=1.0):
    gamma = torch.maximum(lo.abs(), hi.abs())
    bounds = torch.tensor([value_bound] * dv + [1.0], dtype=F64)  # R_w' per column
    sensitivity = 2.0 * bounds[:, None, None] * gamma[None, :, None] ** torch.arange(3, dtype=F64)
    return TreeSpec(
        lo=lo,
        hi=hi,
        sensitivity=sensitivity,
        sw_hi=sw_hi,
        sw_sensitivity=2.0 * bounds * sw_hi**2,
        leaves=leaves,
        copies=copies,
        feature_node=feature_node or Budget(1.0, 1e-3),
        sw_node=sw_node or Budget(1.0, 1e-3),
    )


LO = torch.tensor([0.0, -1.0, -0.5], dtype=F64)
HI = torch.tensor([1.0, 1.0, 1.5], dtype=F64)


def make_data(H, n, m, dv, value_bound, leaves, seed, lo=LO, hi=HI):
    """Keys' features with exact bin edges, u = lo and u = hi; queries incl. 0 and the edges."""
    g = gen(seed)
    F = lo.numel()
    pk = lo + (hi - lo) * torch.rand(H, n, F, generator=g, dtype=F64)
    edges = lo + (hi - lo) * torch.randint(0, leaves + 1, (H, n, F), generator=g).to(F64) / leaves
    pk = torch.where(torch.rand(H, n, F, generator=g) < 0.3, edges, pk)
    pk[:, 0], pk[:, 1] = lo, hi
    values = (torch.rand(H, n, dv, generator=g, dtype=F64) * 2 - 1) * value_bound
    values[:, 0, 0] = value_bound  # weights exactly at the bound are legal
    weights = torch.cat([values, torch.ones(H, n, 1, dtype=F64)], dim=-1)
    pq = lo + (hi - lo) * torch.rand(H, m, F, generator=g, dtype=F64)
    pq[:, 0] = torch.clamp(torch.zeros(F, dtype=F64), lo, hi)
    pq[:, 1] = hi
    pq[:, 2] = lo + (hi - lo) * 3 / leaves
    return pk, weights, pq


def zero_noise(spec, H):
    W, F = spec.sensitivity.shape[:2]
    N, C = spec.leaves, spec.copies
    return torch.zeros(H, W, C, F, 3, 2 * N, dtype=F64), torch.zeros(H, W, C, 2 * N, dtype=F64)


# ------------------------------------------------------------------------------ oracles


def brute_force(pk, weights, pq, spec):
    """Noise-free answers [H, m, W]: 1/2 (P_wx + s_w |v|^2 - sum_f D_f(v_f)) with
    D_f(y) = sum_{j: leaf(u_jf) != leaf(y)} w_j (u_jf - y)^2 (own leaf excluded)."""
    H, m, F = pq.shape
    N = spec.leaves
    lo, hi = spec.lo, spec.hi
    data_leaf = leaf(pk, lo, hi, N)  # [H, n, F]

    def distance(h, y):  # [F] query -> [W]
        mask = data_leaf[h] != leaf(y, lo, hi, N)  # [n, F]
        return torch.einsum("nf,nw->w", mask * (pk[h] - y) ** 2, weights[h])

    sw_own = bool(leaf(torch.tensor(1.0), 0.0, spec.sw_hi, N) == leaf(torch.tensor(0.0), 0.0, spec.sw_hi, N))
    out = torch.empty(H, m, weights.shape[2], dtype=F64)
    for h in range(H):
        p_wx = distance(h, torch.zeros(F, dtype=F64))
        s_w = torch.zeros(weights.shape[2], dtype=F64) if sw_own else weights[h].sum(0)
        for i in range(m):
            v = pq[h, i]
            out[h, i] = 0.5 * (p_wx + s_w * (v @ v) - distance(h, v))
    return out


def explicit_tree_answers(pk, weights, pq, spec, noise):
    """Alg. 2/4/5/3/7 spelled out on explicit heap arrays: [H, m, W] medians over copies."""
    feature_noise, sw_noise = noise
    H, m, F = pq.shape
    W = weights.shape[2]
    N, L, C = spec.leaves, spec.levels, spec.copies

    def build(u, moment_weights, lo, hi, node_noise):
        b = [0.0] * (2 * N)
        for x, w in zip(u.tolist(), moment_weights.tolist(), strict=True):
            b[N + int(leaf(torch.tensor(x), lo, hi, N))] += w
        for k in range(N - 1, 0, -1):
            b[k] = b[2 * k] + b[2 * k + 1]
        return [b[k] + float(node_noise[k]) if k >= 2 else math.nan for k in range(2 * N)]

    def query(c, y, lo, hi):  # Alg. 2 QUERY: c_left + c_right
        total = 0.0
        for i in range(1, L + 1):
            j = min(max(math.floor((y - lo) * 2**i / (hi - lo)) + 1, 1), 2**i)
            total += c[2**i + j - 2] if j % 2 == 0 else c[2**i + j]
        return total

    out = torch.empty(H, m, W, dtype=F64)
    for h in range(H):
        for k in range(W):
            per_copy = torch.empty(C, m, dtype=F64)
            for c in range(C):
                w = weights[h, :, k]
                sw_tree = build(torch.ones_like(w), w, 0.0, spec.sw_hi, sw_noise[h, k, c])
                s_w = query(sw_tree, 0.0, 0.0, spec.sw_hi)
                trees = [
                    [
                        build(pk[h, :, f], w * pk[h, :, f] ** q, float(spec.lo[f]), float(spec.hi[f]), feature_noise[h, k, c, f, q])
                        for q in range(3)
                    ]
                    for f in range(F)
                ]

                def distance(f, y, trees=trees):
                    lo, hi = float(spec.lo[f]), float(spec.hi[f])
                    s0, s1, s2 = (query(trees[f][q], y, lo, hi) for q in range(3))
                    return y * y * s0 - 2 * y * s1 + s2

                p_wx = sum(distance(f, 0.0) for f in range(F))
                for i in range(m):
                    v = pq[h, i].tolist()
                    value = sum(distance(f, v[f]) for f in range(F))
                    per_copy[c, i] = 0.5 * (p_wx + s_w * sum(x * x for x in v) - value)
            out[h, :, k] = per_copy.median(dim=0).values
    return out


def assert_answers_close(got, expected, rel):
    """Elementwise agreement relative to the answers' overall scale (answers near 0 are the
    difference of large noisy terms, so an elementwise relative test would be meaningless)."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=rel * scale)


# ------------------------------------------------------------------------------ (a), (b)


@pytest.mark.parametrize("copies, sw_hi", [(1, 1.0), (3, 1.0), (3, 1.5)])
def test_noise_free_equals_brute_force(copies, sw_hi):
    H, n, m, dv, N = 2, 13, 6, 2, 16
    spec = make_spec(LO, HI, 1.5, dv, N, copies, sw_hi=sw_hi)
    pk, weights, pq = make_data(H, n, m, dv, 1.5, N, seed=1)
    release = TreeRelease.build(pk, weights, spec, gen(2), zero_noise(spec, H), dtype=F64)
    answers = release.answer(pq)
    assert answers.shape == (H, m, dv + 1) and answers.dtype == F64
    expected = brute_force(pk, weights, pq, spec)
    assert_answers_close(answers, expected, 1e-12)
    # noise-free: = sum_j w_j P(x_j).v + own-leaf bias (s_w = sum_j w_j when 1 and 0 part)
    if sw_hi == 1.0:
        own_v = leaf(pk[:, None], LO, HI, N) == leaf(pq[:, :, None], LO, HI, N)  # [H, m, n, F]
        own_0 = leaf(pk, LO, HI, N) == leaf(torch.zeros(3, dtype=F64), LO, HI, N)  # [H, n, F]
        bias = 0.5 * (
            torch.einsum("hmnf,hnw->hmw", own_v * (pk[:, None] - pq[:, :, None]) ** 2, weights)
            - torch.einsum("hnf,hnw->hw", own_0 * pk**2, weights)[:, None]
        )
        kernel = torch.einsum("hnf,hmf,hnw->hmw", pk, pq, weights)
        assert_answers_close(answers, kernel + bias, 1e-12)


def test_float32_table_noise_free():
    H, n, m, dv, N = 1, 13, 5, 2, 8
    spec = make_spec(LO, HI, 1.5, dv, N, 1)
    pk, weights, pq = make_data(H, n, m, dv, 1.5, N, seed=3)
    release = TreeRelease.build(pk, weights, spec, gen(4), zero_noise(spec, H))
    assert release.table.dtype == torch.float32
    assert_answers_close(release.answer(pq), brute_force(pk, weights, pq, spec), 1e-6)


@pytest.mark.parametrize("copies", [1, 3])
def test_injected_noise_equals_explicit_tree(copies):
    H, n, m, dv, N = 2, 11, 5, 2, 8
    spec = make_spec(LO, HI, 1.5, dv, N, copies)
    pk, weights, pq = make_data(H, n, m, dv, 1.5, N, seed=5)
    noise = sample_tree_noise(spec, H, gen(6))
    release = TreeRelease.build(pk, weights, spec, gen(7), noise, dtype=F64)
    expected = explicit_tree_answers(pk, weights, pq, spec, noise)
    got = release.answer(pq)
    assert_answers_close(got, expected, 1e-12)
    assert float((got - brute_force(pk, weights, pq, spec)).abs().max()) > 1.0  # noise is in

    # the root and position 0 are never read
    tampered = (noise[0].clone(), noise[1].clone())
    tampered[0][..., :2] = 1e30
    tampered[1][..., :2] = -1e30
    again = TreeRelease.build(pk, weights, spec, gen(7), tampered, dtype=F64).answer(pq)
    assert torch.equal(again, got)

    # float32 storage: the same release up to storage rounding
    stored32 = TreeRelease.build(pk, weights, spec, gen(7), noise).answer(pq)
    assert_answers_close(stored32, got, 1e-6)

    # chunking (one (head, feature) slab per chunk) does not change the release
    chunked = TreeRelease.build(pk, weights, spec, gen(7), noise, dtype=F64, chunk_bytes=1)
    assert_answers_close(chunked.answer(pq), got, 1e-13)


def small_head(params: TreeParams, signed: bool, coord: float, n=13, d=2, degree=2, dv=2):
    """One head as the pipeline makes it: Taylor features of keys, make_tree_spec ranges."""
    g = gen(20)
    value_bound = 1.5
    fmap = TaylorFeatures(d, degree, 1.0 / d)
    keys = InputBounds.of(coord, None, d)
    budget = tree_budget(Budget(3.0, 1e-5), params, fmap.dim, dv, n)
    spec = make_tree_spec(fmap, keys, value_bound, signed, params, budget, dv, n)
    low = -coord if signed else 0.0
    k = low + (coord - low) * torch.rand(n, d, generator=g, dtype=F64)
    q = low + (coord - low) * torch.rand(5, d, generator=g, dtype=F64)
    values = (torch.rand(n, dv, generator=g, dtype=F64) * 2 - 1) * value_bound
    kwargs = reference_arguments(spec, budget, params, value_bound)
    return fmap(k), values, fmap(q), spec, kwargs


@pytest.mark.parametrize(
    "params, signed, coord",
    [
        (TreeParams(), False, 1.0),
        (TreeParams(copies=3), True, 1.0),
        (TreeParams.paper(copies=3), False, 1.5),  # s_w over [0, R = 1.5]: 1 is not in the last leaf
    ],
    ids=["default", "signed-l3", "paper-l3-R1.5"],
)
def test_matches_mode_a_reference(params, signed, coord):
    pk, values, pq, spec, kwargs = small_head(params, signed, coord)
    weights = torch.cat([values, torch.ones(values.shape[0], 1, dtype=F64)], dim=1)
    feature_noise, sw_noise = sample_tree_noise(spec, 1, gen(21))
    ref = DPCrossAttentionReference(
        pk, values, **kwargs, noise=(feature_noise[0], sw_noise[0]), generator=gen(22)
    )
    release = TreeRelease.build(pk[None], weights[None], spec, gen(23), (feature_noise, sw_noise), dtype=F64)
    expected = ref.answer(pq)
    assert_answers_close(release.answer(pq[None])[0], expected, 1e-9)
    # and noise-free
    zero = zero_noise(spec, 1)
    ref0 = DPCrossAttentionReference(pk, values, **kwargs, noise=(zero[0][0], zero[1][0]), generator=gen(22))
    release0 = TreeRelease.build(pk[None], weights[None], spec, gen(23), zero, dtype=F64)
    assert_answers_close(release0.answer(pq[None])[0], ref0.answer(pq), 1e-9)


# ------------------------------------------------------------------------------ (c) state


def test_answers_are_post_processing_of_a_fixed_state():
    H, n, m, dv, N = 2, 9, 7, 1, 8
    spec = make_spec(LO, HI, 1.0, dv, N, 3)
    pk, weights, pq = make_data(H, n, m, dv, 1.0, N, seed=8)
    release = TreeRelease.build(pk, weights, spec, gen(9))
    first = release.answer(pq)
    assert torch.equal(release.answer(pq), first)
    for i in range(m):  # a query's answer does not depend on its batch
        assert_answers_close(release.answer(pq[:, i : i + 1])[:, 0], first[:, i], 1e-13)
    per_copy = release.answer_copies(pq)
    assert per_copy.shape == (H, m, 3, dv + 1)
    assert torch.equal(per_copy.median(dim=2).values, first)
    # fresh noise each build; copies and heads independent
    assert not torch.equal(TreeRelease.build(pk, weights, spec, gen(10)).answer(pq), first)
    assert len(set(per_copy[0, 0, :, 0].tolist())) == 3


def test_state_holds_no_private_data_and_reports_its_size():
    H, n, m, dv, N = 2, 9, 3, 2, 8
    spec = make_spec(LO, HI, 1.0, dv, N, 3)
    pk, weights, _ = make_data(H, n, m, dv, 1.0, N, seed=11)
    for dtype in (torch.float32, torch.float64):
        release = TreeRelease.build(pk, weights, spec, gen(12), dtype=dtype)
        assert set(vars(release)) == {"table", "p_wx", "s_w", "lo", "hi", "leaves", "copies"}
        assert release.table.shape == (H, 3, N, 3 * 3 * (dv + 1)) and release.table.dtype == dtype
        assert release.nbytes == TreeRelease.planned_nbytes(spec, H, dtype)
        item = 4 if dtype == torch.float32 else 8
        assert release.nbytes >= H * 3 * N * 3 * 3 * (dv + 1) * item


# ------------------------------------------------------------------------------ (d) noise law


def tlap_excess_kurtosis(ratio: float) -> float:
    """E Z^4 / (E Z^2)^2 - 3 for Laplace(1) truncated to [-ratio, ratio] (closed form)."""
    tail = math.exp(-ratio)
    mass = -math.expm1(-ratio)
    m2 = (2 - tail * (ratio**2 + 2 * ratio + 2)) / mass
    m4 = (24 - tail * (ratio**4 + 4 * ratio**3 + 12 * ratio**2 + 24 * ratio + 24)) / mass
    assert m2 == pytest.approx(LaplaceNoise(1.0, ratio).variance, rel=1e-12)
    return m4 / m2**2 - 3


def test_sampled_noise_variance_and_bound():
    """K i.i.d. releases (as K heads over identical data, one build); per (query, column) the
    empirical variance of answer - noise-free answer vs the exact variance (h_f =
    bitlength(b_f XOR b_0): the paths to v_f's leaf and to 0's differ in 2 h_f siblings):
    Var = 1/4 [sum_f (2 h_f V_2 + L v_f^4 V_0 + 4 L v_f^2 V_1) + |v|^4 L V^sw_2],
    tolerance 5 standard errors: Var(s^2) ~ (mu_4 - s^4)/K with mu_4 <= (3 + kappa+) s^4 for a
    linear combination of independent symmetric terms of excess kurtosis <= kappa."""
    K, n, dv, N = 20_000, 5, 1, 8
    lo = torch.tensor([0.0, -2.0], dtype=F64)  # Gamma = (1, 2): node scales differ by feature
    hi = torch.tensor([1.0, 2.0], dtype=F64)
    # big node delta -> strongly truncated noise (ratio ~2): a missing truncation would show
    spec = make_spec(lo, hi, 2.0, dv, N, 1, Budget(1.0, 0.1), Budget(0.5, 0.05))
    g = gen(30)
    pk1 = lo + (hi - lo) * torch.rand(1, n, 2, generator=g, dtype=F64)
    w1 = torch.cat([torch.rand(1, n, dv, generator=g, dtype=F64) * 4 - 2, torch.ones(1, n, 1, dtype=F64)], -1)
    pq1 = torch.tensor([[[0.9, -1.6], [0.05, 0.2], [0.3, 1.4]]], dtype=F64)
    truth = TreeRelease.build(pk1, w1, spec, g, zero_noise(spec, 1), dtype=F64).answer(pq1)[0]
    release = TreeRelease.build(pk1.expand(K, -1, -1), w1.expand(K, -1, -1), spec, g, dtype=F64)
    err = release.answer(pq1.expand(K, -1, -1)) - truth  # [K, m, W]

    scale, ratio = spec.feature_noise_scale()  # [W, F, 3]
    sw_scale, sw_ratio = spec.sw_noise_scale()  # [W]
    V = scale**2 * LaplaceNoise(1.0, ratio).variance
    V_sw = sw_scale**2 * LaplaceNoise(1.0, sw_ratio).variance
    B, B_sw = scale * ratio, sw_scale * sw_ratio
    L = spec.levels
    b0 = leaf(torch.zeros(2, dtype=F64), lo, hi, N)
    kappa = max(0.0, tlap_excess_kurtosis(ratio), tlap_excess_kurtosis(sw_ratio))
    checked_h = set()
    for i, v in enumerate(pq1[0]):
        h = [int(x).bit_length() for x in (leaf(v, lo, hi, N) ^ b0)]
        checked_h.update(h)
        for w in range(dv + 1):
            per_f = [2 * h[f] * V[w, f, 2] + L * v[f] ** 4 * V[w, f, 0] + 4 * L * v[f] ** 2 * V[w, f, 1] for f in range(2)]
            var = float(0.25 * (sum(per_f) + (v @ v) ** 2 * L * V_sw[w]))
            tol = 5 * math.sqrt((2 + kappa) / K) * var
            e = err[:, i, w]
            assert float(e.var()) == pytest.approx(var, abs=tol), (i, w)
            assert abs(float(e.mean())) <= 5 * math.sqrt(var / K), (i, w)
            # deterministic bound (TLap noise is bounded), for every query at once
            bound = 0.5 * (
                sum(2 * h[f] * B[w, f, 2] + L * v[f] ** 2 * B[w, f, 0] + 2 * L * abs(v[f]) * B[w, f, 1] for f in range(2))
                + L * (v @ v) * B_sw[w]
            )
            assert float(e.abs().max()) <= float(bound) * (1 + 1e-12)
    assert checked_h == {0, 2, 3}  # own leaf shared with 0, and two path lengths
    assert len(set(err[:, 0, 0].tolist())) == K  # every head drew its own noise


# ------------------------------------------------------------------------------ (e) inputs


def test_bad_inputs_raise():
    H, n, m, dv, N = 1, 7, 3, 2, 8
    spec = make_spec(LO, HI, 1.5, dv, N, 1)
    pk, weights, pq = make_data(H, n, m, dv, 1.5, N, seed=40)
    g = gen(41)
    bad = pk.clone()
    bad[0, 3, 1] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        TreeRelease.build(bad, weights, spec, g)
    with pytest.raises(ValueError, match="W=4 columns but the spec was made for W=3"):
        TreeRelease.build(pk, torch.cat([weights, weights[..., :1]], -1), spec, g)
    with pytest.raises(ValueError, match="F=2 features but the spec was made for F=3"):
        TreeRelease.build(pk[..., :2], weights, spec, g)
    with pytest.raises(ValueError, match="disagree"):
        TreeRelease.build(pk, weights[:, :-1], spec, g)
    with pytest.raises(ValueError, match=r"\[H, n, F\]"):
        TreeRelease.build(pk[0], weights, spec, g)
    out_of_range = pk.clone()
    out_of_range[0, 2, 0] = 1.1
    with pytest.raises(ValueError, match="outside its public range"):
        TreeRelease.build(out_of_range, weights, spec, g)
    heavy = weights.clone()
    heavy[0, 2, 1] = 1.6
    with pytest.raises(ValueError, match="above its public bound"):
        TreeRelease.build(pk, heavy, spec, g)
    feature, sw = zero_noise(spec, H)
    with pytest.raises(ValueError, match="canonical shape"):
        TreeRelease.build(pk, weights, spec, g, (feature[..., :-1], sw))
    with pytest.raises(ValueError, match="dtype"):
        TreeRelease.build(pk, weights, spec, g, dtype=torch.float16)
    release = TreeRelease.build(pk, weights, spec, g)
    with pytest.raises(ValueError, match="does not match"):
        release.answer(pq[..., :2])
    bad_q = pq.clone()
    bad_q[0, 0, 0] = math.inf
    with pytest.raises(ValueError, match="NaN/inf"):
        release.answer(bad_q)
