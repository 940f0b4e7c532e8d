"""Serving's per-layer release of a private context: rows by position, released once with keyed
noise, identical across restarts and tensor-parallel layouts, and nothing exact kept."""

import dataclasses

import pytest
import torch

from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.attention.params import DPAttentionParams
from vllm_dp_plugin.attention.private_context import HeadLayout, PrivateContextLayer, noise_stream
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey

D, N, H_KV, H_Q = 4, 12, 2, 4
PARAMS = DPAttentionParams(1.0, 1e-6, scope="layer", degree=2, query_dtype="float64")
MAPPING = HeadMapping(0.5, 1.0, 1.0, 1.0, key_center=torch.full((H_KV, D), 0.1, dtype=torch.float64))
CONTEXT = "ctx-a"


@pytest.fixture
def key(tmp_path):
    return NoiseKey(tmp_path / "noise.key")


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(N, H_KV, D, generator=g) - 0.5, torch.rand(N, H_KV, D, generator=g) - 0.5


ALL_HEADS = HeadLayout(H_KV, H_Q, 0, H_KV)


def _layer(heads=ALL_HEADS, layer=0, mapping=MAPPING):
    return PrivateContextLayer(PARAMS, mapping, layer, heads, D, N, budget_heads=2 * H_KV)


def _released(key, k, v, context=CONTEXT, layer=0):
    dp = _layer(layer=layer)
    dp.collect(torch.arange(N), k, v)
    dp.release(key, context)
    return dp


def _query(seed=5, m=3):
    return torch.rand(m, H_Q, D, generator=torch.Generator().manual_seed(seed)) - 0.5


def test_rows_arrive_by_position_in_any_order_and_duplicates_count_once(key):
    k, v = _rows()
    dp = _layer()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    dp.collect(order[:7], k[order[:7]], v[order[:7]])
    assert not dp.complete
    with pytest.raises(RuntimeError, match="7/12 rows"):
        dp.release(key, CONTEXT)
    dp.collect(order[4:], k[order[4:]], v[order[4:]])  # rows 4..6 again (recomputed prefix)
    assert dp.complete
    dp.release(key, CONTEXT)
    assert dp.released and not dp.complete
    torch.testing.assert_close(dp.answer(_query()).out, _released(key, k, v).answer(_query()).out)


@pytest.mark.parametrize("mode", ["state", "tree", "reference"])
def test_each_head_is_a_keyed_dpcrossattention_over_its_rows(key, mode):
    """All local heads are answered in one batch; head g equals a one-head DPCrossAttention
    released with the generator of (context, layer, g) alone."""
    params = dataclasses.replace(PARAMS, mode=mode, degree=2 if mode == "state" else 1)
    k, v = _rows()
    dp = PrivateContextLayer(params, MAPPING, 1, ALL_HEADS, D, N, budget_heads=2 * H_KV)
    dp.collect(torch.arange(N), k, v)
    dp.release(key, CONTEXT)
    q = _query()
    for g in range(H_KV):
        ref = DPCrossAttention(params, _head(MAPPING, g), 1, D, D, H_Q // H_KV, budget_heads=2 * H_KV)
        ref.build(k[:, g][None].double(), v[:, g][None].double(), key.generator(CONTEXT, noise_stream(1, g)))
        expected = ref.query_parts(q[:, 2 * g : 2 * g + 2].transpose(0, 1)).part()
        torch.testing.assert_close(dp.answer(q).out[2 * g : 2 * g + 2], expected.out)


def _head(mapping, g):
    return HeadMapping(mapping.beta, 1.0, 1.0, 1.0, key_center=mapping.key_center[g : g + 1])


def test_same_key_and_context_reproduce_the_release_other_contexts_layers_keys_do_not(key, tmp_path):
    k, v = _rows()
    q = _query()
    first = _released(key, k, v).answer(q).out
    assert torch.equal(_released(NoiseKey(key.path), k, v).answer(q).out, first)  # restart
    assert not torch.equal(_released(key, k, v, context="ctx-b").answer(q).out, first)
    assert not torch.equal(_released(key, k, v, layer=1).answer(q).out, first)
    other_key = NoiseKey(tmp_path / "other.key")
    assert not torch.equal(_released(other_key, k, v).answer(q).out, first)


def test_tensor_parallel_ranks_release_the_heads_of_tp_1(key):
    k, v = _rows()
    q = _query()
    whole = _released(key, k, v).answer(q).out
    parts = []
    for rank in range(2):
        heads = HeadLayout.for_rank(H_KV, H_Q, tp_size=2, rank=rank)
        assert heads == HeadLayout(1, 2, rank, H_KV)
        dp = _layer(heads)
        dp.collect(torch.arange(N), k[:, rank : rank + 1], v[:, rank : rank + 1])
        dp.release(key, CONTEXT)
        parts.append(dp.answer(q[:, 2 * rank : 2 * rank + 2]).out)
    torch.testing.assert_close(torch.cat(parts), whole)


def test_replicated_kv_heads_when_tp_exceeds_them():
    assert [HeadLayout.for_rank(2, 8, 4, r).kv_offset for r in range(4)] == [0, 0, 1, 1]


def test_after_release_nothing_exact_is_kept_and_late_rows_are_ignored(key):
    k, v = _rows()
    dp = _released(key, k, v)
    before = dp.answer(_query()).out
    dp.collect(torch.arange(N), k * 100, v * 100)  # a recomputed prefix after release
    assert torch.equal(dp.answer(_query()).out, before)
    held = [t for t in vars(dp).values() if torch.is_tensor(t)]
    assert held == []


def test_answer_before_release_and_too_long_context_are_errors():
    with pytest.raises(RuntimeError, match="not released"):
        _layer().answer(_query())
    params = DPAttentionParams(1.0, 1e-6, max_context=N - 1, degree=2)
    with pytest.raises(ValueError, match="exceeds max_context"):
        PrivateContextLayer(params, MAPPING, 0, HeadLayout(H_KV, H_Q, 0, H_KV), D, N, 4)
