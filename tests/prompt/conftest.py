"""Small synthetic embedding tables shared by the prompt-privatization tests."""

import pytest
import torch

from vllm_dp_plugin.prompt import EmbeddingTable

VOCAB, DIM, PADDED, SPECIAL = 300, 32, 12, (0, 1, 2, 3)


def random_embeddings(rows: int, dim: int, seed: int) -> torch.Tensor:
    """``[rows, dim]`` float32 Gaussian rows with anisotropic coordinate scales and an offset
    (so that centring, clipping and the Mahalanobis covariance all matter)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.3, 2.0, dim)
    return torch.randn(rows, dim, generator=gen) * scales + 0.5


def make_table(
    vocab=VOCAB, dim=DIM, padded=PADDED, special=SPECIAL, seed=0, **kw
) -> EmbeddingTable:
    return EmbeddingTable.build(random_embeddings(vocab + padded, dim, seed), vocab, special, **kw)


@pytest.fixture(scope="module")
def table() -> EmbeddingTable:
    """V = 300 input-domain rows (+12 padded), d = 32, special ids 0-3."""
    return make_table()
