"""DPCrossAttention in state mode: exactness without noise, the noise law, GQA, chunking,
accounting and bad inputs."""

import math

import pytest
import torch
from scipy import stats

from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.attention.params import DPAttentionParams

from .contexts import random_context

D, DV = 4, 3


def _context(heads=2, n=40, m=5, seed=0):
    return random_context(heads, n, m, D, DV, seed)


def _attention(heads=2, **kw):
    params = DPAttentionParams(kw.pop("epsilon", 1.0), 1e-6, query_dtype="float64", **kw)
    return DPCrossAttention(params, HeadMapping.paper(D), heads, D, DV)


def _kernel_sums(att, k, v, q):
    """Noise-free P(Q) P(K)^T [V | 1]: [H, m, W]."""
    pk, pq = att.features(k), att.features(q)
    weights = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    return pq @ (pk.transpose(1, 2) @ weights)


def test_answer_is_kernel_attention_plus_the_noise_drawn_once_from_the_generator():
    k, v, q = _context()
    att = _attention(clamp=False).build(k, v, torch.Generator().manual_seed(7))
    mech = att.account.per_head
    noise = mech.sample((2, att.features.dim, DV + 1), torch.Generator().manual_seed(7))
    expected = _kernel_sums(att, k, v, q) + att.features(q) @ noise
    parts = att.query_parts(q)
    assert torch.allclose(parts.num, expected[..., :DV], rtol=1e-12, atol=1e-9)
    assert torch.allclose(parts.den, expected[..., DV], rtol=1e-12, atol=1e-9)


def test_noise_free_state_equals_kernel_attention_which_tracks_softmax_within_eps_s():
    k, v, q = _context(n=200)
    att = _attention(epsilon=1e6, clamp=False).build(k, v, torch.Generator().manual_seed(0))
    sums = _kernel_sums(att, k, v, q)
    kernel_out = sums[..., :DV] / sums[..., DV:]
    # noise of std sigma ||P(q)|| on num and den; 6 std of both, relative to den
    noise = 6 * att.account.per_head.noise.sigma * att.features(q).norm(dim=-1) / sums[..., DV]
    assert ((att.query(q) - kernel_out).abs() <= noise[..., None] * (1 + kernel_out.abs())).all()
    logits = q @ k.transpose(1, 2) / D
    exact = torch.softmax(logits, -1) @ v
    ref = torch.softmax(logits, -1) @ v.abs()  # signed V: relative to D^-1 A |V|, not to |O|
    eps_s = att.kernel_error
    assert ((kernel_out - exact).abs() <= 2 * eps_s / (1 - eps_s) * ref + 1e-12).all()


def test_numerator_variance_over_2000_seeds_is_sigma_squared_times_feature_norm():
    k, v, q = _context(heads=1, n=30, m=1)
    seeds = 2000
    draws = torch.stack([
        _attention(heads=1, epsilon=2.0, clamp=False).build(k, v, torch.Generator().manual_seed(s)).query_parts(q).num[0, 0]
        for s in range(seeds)
    ])  # [seeds, DV]
    att = _attention(heads=1, epsilon=2.0)
    pq = att.features(q)[0, 0]
    sigma = _attention(heads=1, epsilon=2.0, clamp=False).build(k, v).account.per_head.noise.sigma
    predicted = sigma**2 * float(pq @ pq)
    truth = _kernel_sums(att, k, v, q)[0, 0, :DV]
    for col in range(DV):
        x = draws[:, col].numpy()
        # (n-1) s^2 / var ~ chi2(n-1): two-sided 1e-4 acceptance region
        stat = (seeds - 1) * x.var(ddof=1) / predicted
        assert stats.chi2.ppf(5e-5, seeds - 1) < stat < stats.chi2.ppf(1 - 5e-5, seeds - 1)
        assert abs(x.mean() - float(truth[col])) < 4.5 * math.sqrt(predicted / seeds)
        # the same acceptance region rejects 10% mis-scaled noise
        stat_wrong = (seeds - 1) * ((x - x.mean()) * 1.1).var(ddof=1) / predicted
        assert not stats.chi2.ppf(5e-5, seeds - 1) < stat_wrong < stats.chi2.ppf(1 - 5e-5, seeds - 1)


def test_released_state_noise_is_normal_ks():
    k, v, _ = _context(heads=1, n=30)
    exact = _attention(heads=1).features(k)[0].T @ torch.cat([v[0], torch.ones(30, 1, dtype=torch.float64)], -1)
    z = []
    for seed in range(40):  # 40 x 60 state entries
        att = _attention(heads=1).build(k, v, torch.Generator().manual_seed(seed))
        z.append(((att._release.state[0] - exact) / att.account.per_head.noise.sigma).flatten())
    z = torch.cat(z).numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z * 1.25, "norm").pvalue < 1e-3  # the same test rejects mis-scaled noise


def test_repeated_queries_are_identical_and_chunked_build_equals_whole_build():
    k, v, q = _context(n=33)
    whole = _attention().build(k, v, torch.Generator().manual_seed(5))
    chunked = _attention()
    for start in range(0, 33, 10):
        chunked.add(k[:, start : start + 10], v[:, start : start + 10])
    chunked.finalize(torch.Generator().manual_seed(5))
    assert torch.equal(whole.query(q), whole.query(q))
    assert torch.allclose(whole.query(q), chunked.query(q), rtol=1e-10, atol=1e-12)


def test_release_holds_no_exact_private_data():
    k, v, _ = _context()
    att = _attention().build(k, v)
    assert att._builder is None
    tensors = [x for x in vars(att).values() if torch.is_tensor(x)]
    tensors += [x for x in vars(att._release).values() if torch.is_tensor(x)]
    exact = att.features(k).transpose(1, 2) @ torch.cat([v, torch.ones_like(v[..., :1])], -1)
    assert all(x.shape[-2:] != k.shape[-2:] for x in tensors)
    assert not any(x.shape == exact.shape and torch.allclose(x, exact) for x in tensors)


def test_gqa_folds_query_heads_onto_their_kv_head():
    k, v, q = _context(heads=2, m=3)
    params = DPAttentionParams(1.0, 1e-6, query_dtype="float64")
    att = DPCrossAttention(params, HeadMapping.paper(D), 2, D, DV, num_query_heads=4)
    att.build(k, v, torch.Generator().manual_seed(1))
    q4 = torch.cat([q[:1], q[:1], q[1:], q[1:]])  # query heads 0,1 -> kv 0; 2,3 -> kv 1
    out = att.query(q4)
    assert torch.allclose(out[0], out[1]) and torch.allclose(out[2], out[3])
    single = DPCrossAttention(params, HeadMapping.paper(D), 2, D, DV).build(k, v, torch.Generator().manual_seed(1))
    assert torch.allclose(out[[0, 2]], single.query(q))


def test_layer_scope_splits_the_budget_over_heads():
    k, v, _ = _context(heads=2)
    per_head = _attention(heads=2).build(k, v).account
    per_layer = _attention(heads=2, scope="layer").build(k, v).account
    assert math.isclose(per_layer.spent(1).epsilon, 1.0, rel_tol=1e-3)
    assert per_head.spent(1).epsilon > per_layer.spent(1).epsilon
    assert per_layer.spent(4).epsilon > per_layer.spent(1).epsilon
    assert "whole model (4 layers x 2 heads)" in per_layer.report(4)


def test_truncated_laplace_state_is_bounded_and_accounted():
    k, v, q = _context(heads=1)
    att = _attention(heads=1, mechanism="truncated_laplace").build(k, v)
    mech = att.account.per_head
    assert mech.valid and mech.epsilon == 1.0 and math.isfinite(mech.noise.bound)
    assert att.query(q).shape == (1, 5, DV)


def test_clamps_keep_outputs_in_the_value_box():
    k, v, q = _context(n=8)
    out = _attention(epsilon=0.01).build(k, v).query(q)
    assert (out.abs() <= 1.0 + 1e-12).all()


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"k": float("nan")}, "K contains NaN"),
        ({"v": float("inf")}, "V contains NaN or inf"),
        ({"kshape": (2, 10, D + 1)}, "K must have shape"),
        ({"vlen": 9}, "disagree on context length"),
    ],
)
def test_bad_context_inputs_raise_and_leave_nothing_half_built(bad, match):
    k, v, _ = _context(n=10)
    if "k" in bad:
        k = k.clone()
        k[0, 3, 1] = bad["k"]
    if "v" in bad:
        v = v.clone()
        v[1, 2, 0] = bad["v"]
    if "kshape" in bad:
        k = torch.rand(bad["kshape"], dtype=torch.float64)
    if "vlen" in bad:
        v = v[:, : bad["vlen"]]
    att = _attention()
    with pytest.raises(ValueError, match=match):
        att.add(k, v)
    assert att.rows == 0
    with pytest.raises(ValueError, match="empty"):
        att.finalize()


def test_bad_queries_and_parameters():
    k, v, q = _context()
    att = _attention().build(k, v)
    with pytest.raises(ValueError, match="Q contains NaN"):
        att.query(torch.full_like(q, float("nan")))
    with pytest.raises(ValueError, match="Q must have shape"):
        att.query(q[:1])
    with pytest.raises(ValueError, match="negative entries"):
        att.query(-q)
    with pytest.raises(RuntimeError, match="final"):
        att.add(k, v)
    with pytest.raises(RuntimeError, match="before querying"):
        _attention().query(q)
    with pytest.raises(ValueError, match="epsilon"):
        DPAttentionParams(0.0, 1e-6)
    with pytest.raises(ValueError, match="unknown mode"):
        DPAttentionParams(1.0, 1e-6, mode="exact")
    with pytest.raises(ValueError, match="max_context"):
        DPCrossAttention(DPAttentionParams(1.0, 1e-6, max_context=5), HeadMapping.paper(D), 2, D, DV).add(k, v)
    with pytest.raises(ValueError, match="key_bound"):
        HeadMapping(0.1, float("nan"), 1.0, 1.0)
    with pytest.raises(ValueError, match="max_features"):
        DPCrossAttention(DPAttentionParams(1.0, 1e-6, degree=6), HeadMapping.paper(64), 1, 64, 64)


def test_float32_queries_match_float64_queries_to_float32_precision():
    k, v, q = _context()
    # degree 2: the tensor-power fast query path (degree <= 2) is what float32 queries take
    fast = DPCrossAttention(DPAttentionParams(1.0, 1e-6, degree=2), HeadMapping.paper(D), 2, D, DV)
    exact = DPCrossAttention(DPAttentionParams(1.0, 1e-6, degree=2, query_dtype="float64"), HeadMapping.paper(D), 2,
                             D, DV)
    fast.build(k, v, torch.Generator().manual_seed(2))
    exact.build(k, v, torch.Generator().manual_seed(2))
    assert fast.query(q).dtype == torch.float64
    assert torch.allclose(fast.query(q), exact.query(q), rtol=1e-4, atol=1e-5)
    assert torch.equal(fast._release.state, exact._release.state)  # the release is float64 either way
