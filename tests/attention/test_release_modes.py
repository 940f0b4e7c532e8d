"""The release-mode protocol and registry: every mode of ``params.MODES`` is registered, satisfies
the protocol, and a new mode plugs into ``DPCrossAttention`` as one class + one registry entry."""

import pytest
import torch

from vllm_dp_plugin.attention.base import Release, ReleaseBuilder, ReleaseMode
from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.attention.modes import RELEASE_MODES, release_mode
from vllm_dp_plugin.attention.params import MODES, DPAttentionParams
from vllm_dp_plugin.attention.state import KernelStateBuilder, NoisyKernelState, StateMode

from .contexts import random_context

D, DV = 3, 2


def _context(heads=2, n=9, m=4, seed=0):
    return random_context(heads, n, m, D, DV, seed)


def _attention(mode, **kw):
    params = DPAttentionParams(1.0, 1e-6, mode=mode, degree=1, **kw)
    return DPCrossAttention(params, HeadMapping.paper(D), 2, D, DV)


def test_every_params_mode_is_registered_and_satisfies_the_protocol():
    assert set(RELEASE_MODES) == set(MODES)
    assert all(isinstance(mode, ReleaseMode) for mode in RELEASE_MODES.values())
    with pytest.raises(ValueError, match="unknown mode 'exact'"):
        release_mode("exact")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_head", [False, True])
def test_each_mode_builds_a_release_through_its_builder(mode, per_head):
    k, v, q = _context()
    att = _attention(mode)
    assert att.mode is RELEASE_MODES[mode]
    att.add(k, v)
    assert isinstance(att._builder, ReleaseBuilder)
    generator = [torch.Generator().manual_seed(h) for h in range(2)] if per_head else torch.Generator()
    att.finalize(generator)
    assert att._builder is None and isinstance(att._release, Release)
    assert att.query(q).shape == (2, 4, DV)
    if mode != "reference":  # the literal oracle's Python objects report no tensor bytes
        assert att.mode.planned_nbytes(att, k.shape[1]) == att.release_nbytes


class _ExactStateBuilder(KernelStateBuilder):
    def release(self, mechanism, generator):
        return NoisyKernelState(self._state, self.rows)  # no noise: a toy, NOT private


class _ExactState(StateMode):
    """A toy mode (the exact kernelised state): only the builder differs from ``state``."""

    def query_dtype(self, layer):
        return torch.float64

    def builder(self, layer, device):
        return _ExactStateBuilder(layer.kv_heads, layer.features.dim, layer.value_dim, device)


def test_a_new_mode_is_one_class_and_one_registry_entry(monkeypatch):
    monkeypatch.setitem(RELEASE_MODES, "state", _ExactState())
    k, v, q = _context()
    att = _attention("state", clamp=False).build(k, v)
    pk, pq = att.features(k), att.features(q)
    weights = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    sums = pq @ (pk.transpose(1, 2) @ weights)  # [H, m, W]
    torch.testing.assert_close(att.query(q), sums[..., :DV] / sums[..., DV:], rtol=1e-12, atol=1e-12)
