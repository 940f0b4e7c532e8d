"""EmbeddingTable: padded rows, centring, clipping, candidates, exact public sensitivities."""

import math

import pytest
import torch

from vllm_dp_plugin.prompt import EmbeddingTable
from vllm_dp_plugin.prompt.table import l2_diameter

from .conftest import DIM, PADDED, SPECIAL, VOCAB, make_table, random_embeddings


def pairwise_max(rows: torch.Tensor, p: float) -> float:
    """Brute-force max over all pairs of ||x_w - x_w'||_p (float64)."""
    return float(torch.cdist(rows, rows, p=p).max())


def test_padded_rows_are_dropped_and_centring_uses_the_domain_mean(table):
    raw = random_embeddings(VOCAB + PADDED, DIM, seed=0)
    assert table.vocab_size == VOCAB and table.dim == DIM
    assert torch.equal(table.embeddings, raw[:VOCAB])
    assert torch.allclose(table.mean, raw[:VOCAB].double().mean(0), rtol=0, atol=1e-12)
    uncentred = make_table(center=False)
    assert torch.count_nonzero(uncentred.mean) == 0
    assert uncentred.clip_norm > table.clip_norm  # the rows have a 0.5 offset: centring shrinks C


def test_clip_norm_is_the_quantile_and_rows_are_clipped_per_eq_1(table):
    centred = table.embeddings.double() - table.mean
    norms = centred.norm(dim=1)
    assert table.clip_norm == pytest.approx(float(torch.quantile(norms, 0.5)), rel=1e-12)
    clipped_norms = table.clipped.norm(dim=1)
    small = norms <= table.clip_norm
    assert torch.allclose(table.clipped[small], centred[small], rtol=0, atol=1e-12)  # unchanged
    assert torch.allclose(
        clipped_norms[~small], torch.full_like(clipped_norms[~small], table.clip_norm)
    )
    directions = torch.nn.functional.cosine_similarity(table.clipped[~small], centred[~small])
    assert torch.allclose(directions, torch.ones_like(directions))  # same direction
    assert make_table(clip_quantile=0.9).clip_norm > table.clip_norm
    assert make_table(clip_norm=1.5).clip_norm == 1.5


def test_candidates_exclude_special_ids_and_padding(table):
    expected = [i for i in range(VOCAB) if i not in SPECIAL]
    assert table.candidates.tolist() == expected
    assert table.candidates.dtype == torch.int64


def test_sensitivities_bound_every_input_domain_pair(table):
    """Each bound is >= the brute-force maximum over all V^2 pairs (special rows included) and
    equals the stated formula."""
    rows = table.clipped
    ranges = rows.max(0).values - rows.min(0).values
    radius = float(rows.norm(dim=1).max())
    assert table.sensitivity_l1 == pytest.approx(
        min(2 * math.sqrt(DIM) * radius, float(ranges.sum())), rel=1e-12
    )
    assert table.sensitivity_linf == pytest.approx(min(2 * radius, float(ranges.max())), rel=1e-12)
    assert pairwise_max(rows, 1) <= table.sensitivity_l1
    assert pairwise_max(rows, math.inf) <= table.sensitivity_linf
    exact = pairwise_max(rows, 2)
    assert exact <= table.sensitivity_l2 <= exact * (1 + 1e-12)  # exact diameter, never below
    assert table.sensitivity_l2 <= 2 * radius


def test_l2_diameter_with_small_chunks(monkeypatch):
    """The chunked GEMM finds the diameter whatever the block size (pair split across blocks)."""
    rows = torch.randn(97, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rows[90] = 40.0
    rows[5] = -40.0
    monkeypatch.setattr("vllm_dp_plugin.prompt.table.DIAMETER_BLOCK_ELEMENTS", 97 * 4)
    assert l2_diameter(rows) == pytest.approx(pairwise_max(rows, 2), rel=1e-12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"vocab_size": VOCAB + PADDED + 1}, "exceeds"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"special_ids": [VOCAB]}, "special id"),
        ({"special_ids": [-1]}, "special id"),
        ({"special_ids": range(VOCAB)}, "empty"),
        ({"clip_quantile": 0.0}, "clip_quantile"),
        ({"clip_norm": float("nan")}, "clip_norm"),
    ],
)
def test_bad_table_arguments(kwargs, match):
    args = {"vocab_size": VOCAB, "special_ids": SPECIAL} | kwargs
    with pytest.raises(ValueError, match=match):
        EmbeddingTable.build(random_embeddings(VOCAB + PADDED, DIM, 0), **args)


def test_non_finite_embeddings_are_rejected():
    raw = random_embeddings(VOCAB, DIM, 0)
    raw[7, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        EmbeddingTable.build(raw, VOCAB, SPECIAL)
