"""Merging DP and exact attention parts; the public head mapping."""

import math

import pytest
import torch

from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.attention.merge import exact_part, merge_parts, private_part
from vllm_dp_plugin.attention.params import DPAttentionParams


def _qkv(h, n, m, d, dv, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * scale
    return r(h, m, d), r(h, n, d), r(h, n, dv)


def test_merging_exact_parts_equals_attention_over_the_union_even_with_huge_logits():
    q, k, v = _qkv(2, 30, 4, 8, 5, 0, scale=12.0)  # logits up to ~1e3: naive exp overflows
    beta = 1 / math.sqrt(8)
    whole = exact_part(q, k, v, beta)
    merged = merge_parts(exact_part(q, k[:, :11], v[:, :11], beta), exact_part(q, k[:, 11:], v[:, 11:], beta))
    assert torch.isfinite(merged.out).all()
    assert torch.allclose(merged.out, whole.out, atol=1e-10)
    assert torch.allclose(merged.lse, whole.lse, atol=1e-10)


def test_private_part_with_log_scale_merges_exactly():
    q, k, v = _qkv(1, 20, 3, 4, 2, 1)
    beta, shift = 0.5, torch.tensor([[0.3, -2.0, 7.0]], dtype=torch.float64)
    logits = beta * q @ k.transpose(1, 2) - shift[..., None]  # private part stored shifted
    num, den = torch.exp(logits) @ v, torch.exp(logits).sum(-1)
    merged = merge_parts(private_part(num[:, :, :], den, shift), exact_part(q, k, v, beta))
    both = exact_part(q, torch.cat([k, k], 1), torch.cat([v, v], 1), beta)
    assert torch.allclose(merged.out, both.out, atol=1e-12)
    with pytest.raises(ValueError, match="> 0"):
        private_part(num, -den, shift)


def test_centred_dp_part_merges_into_the_true_softmax_when_noise_is_negligible():
    h, d, dv = 2, 4, 3
    q, k, v = _qkv(h, 64, 5, d, dv, 2, scale=0.3)
    k_pub = k + 0.5  # public calibration keys with an offset mean
    mapping = HeadMapping.calibrate(k_pub, q, v, beta=1 / d, quantile=1.0)
    mapping = HeadMapping(mapping.beta, 1.5, 1.5, 2.0, key_center=mapping.key_center)  # clips nothing here
    k_priv = k + 0.5
    att = DPCrossAttention(DPAttentionParams(1e6, 1e-6, degree=8, clamp=False), mapping, h, d, dv)
    att.build(k_priv, v, torch.Generator().manual_seed(0))
    _, pub_k, pub_v = _qkv(h, 10, 5, d, dv, 3)
    merged = merge_parts(att.query_parts(q).part(), exact_part(q, pub_k, pub_v, 1 / d))
    truth = exact_part(q, torch.cat([k_priv, pub_k], 1), torch.cat([v, pub_v], 1), 1 / d)
    assert torch.allclose(merged.out, truth.out, atol=1e-3)
    assert torch.allclose(merged.lse, truth.lse, atol=1e-3)


def test_mapping_clips_and_centres_with_public_constants_only():
    center = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    m = HeadMapping(0.5, key_bound=1.0, query_bound=2.0, value_bound=0.5, key_norm=1.2, key_center=center)
    k = torch.tensor([[[3.0, -1.0], [2.5, 0.5]]], dtype=torch.float64)
    mk = m.keys(k)
    assert torch.allclose(mk[0, 0], torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert math.isclose(float(mk[0, 1].norm()), 1.2)
    assert (m.values(torch.full((1, 2, 3), 9.0)) == 0.5).all()
    assert math.isclose(m.logit_bound(2), 0.5 * 1.2 * 2.0 * math.sqrt(2))


def test_calibrate_uses_quantiles_of_the_public_data():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 5000, 4, generator=g, dtype=torch.float64)
    m = HeadMapping.calibrate(k, k, k, beta=0.5, quantile=0.99)
    assert 2.4 < m.key_bound < 2.8  # 99% quantile of |N(0,1)| is 2.576
    assert m.key_center.shape == (1, 4)
    with pytest.raises(ValueError, match="public keys contains NaN"):
        HeadMapping.calibrate(k * float("nan"), k, k, beta=0.5)
