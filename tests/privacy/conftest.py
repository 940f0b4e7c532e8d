"""Fixtures shared by the ledger tests."""

import pytest

from vllm_dp_plugin.privacy.keyed_noise import NoiseKey


@pytest.fixture
def key(tmp_path):
    """A fresh noise key in the test's directory."""
    return NoiseKey(tmp_path / "noise.key")
