"""DPCrossAttention in tree and reference modes: wiring, accounting, memory cap."""

import pytest
import torch

from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.attention.params import DPAttentionParams

from .contexts import random_context

D, DV = 3, 2


def _context(heads=2, n=21, m=4, seed=0):
    return random_context(heads, n, m, D, DV, seed, query_heads=2 * heads)


@pytest.mark.parametrize("mode", ["tree", "reference"])
@pytest.mark.parametrize("paper", [False, True])
def test_tree_modes_answer_gqa_queries_and_account_within_budget(mode, paper):
    k, v, q = _context()
    params = DPAttentionParams.paper(1.0, 1e-6, mode=mode) if paper else DPAttentionParams(1.0, 1e-6, mode=mode, degree=1)
    att = DPCrossAttention(params, HeadMapping.paper(D), 2, D, DV, num_query_heads=4)
    att.build(k, v, torch.Generator().manual_seed(0))
    out = att.query(q)
    assert out.shape == (4, 4, DV) and torch.isfinite(out).all()
    assert torch.equal(out, att.query(q))
    spent = att.account.per_head
    assert spent.name.startswith("dptree") and spent.epsilon <= 1.0 and spent.delta <= 2e-6
    assert att._builder is None


def test_tree_and_reference_modes_release_the_same_mechanism():
    k, v, _ = _context()
    tree = DPCrossAttention(DPAttentionParams(1.0, 1e-6, mode="tree", degree=1), HeadMapping.paper(D), 2, D, DV)
    ref = DPCrossAttention(DPAttentionParams(1.0, 1e-6, mode="reference", degree=1), HeadMapping.paper(D), 2, D, DV)
    tree.build(k, v)
    ref.build(k, v)
    assert tree.account.per_head == ref.account.per_head


def test_tree_memory_cap_refuses_before_drawing_noise():
    k, v, _ = _context()
    params = DPAttentionParams(1.0, 1e-6, mode="tree", degree=1, memory_limit_bytes=1024)
    att = DPCrossAttention(params, HeadMapping.paper(D), 2, D, DV)
    with pytest.raises(ValueError, match="GiB"):
        att.build(k, v)
    with pytest.raises(RuntimeError, match="after finalize"):
        _ = att.account
    assert att.rows == 21 and len(att._builder.chunks) == 1  # nothing half-applied: the context is kept
