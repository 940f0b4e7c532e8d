"""Approximate nearest-candidate search (``prompt.search: hnsw | ivf``): recall against the exact
brute force, never a non-candidate id, the exact fallback, config validation and wiring."""

import pytest
import torch

from vllm_dp_plugin.config import ConfigError, DPPrivacyConfig, PromptPrivacyConfig
from vllm_dp_plugin.prompt import CandidateIndex, brute_force_nearest
from vllm_dp_plugin.prompt.privatizer import candidate_index

from .conftest import make_table

faiss = pytest.importorskip("faiss")

from vllm_dp_plugin.prompt.approximate import (
    ApproximateIndex,
    ivf_nlist,
    search_index,
)

K, D, QUERIES = 4000, 64, 1000
# Measured with these seeds (faiss-cpu 1.15.1, re-rank of faiss's best 8): noise of the rows' mean
# norm -> hnsw 1.000, ivf 0.996; twice that -> hnsw 0.987, ivf 0.927 (HNSW's parallel build is not
# deterministic). Asserted with a margin below. On SmolLM2's real table the fractions are far lower
# at DP noise levels (see ``python -m benchmarks.prompt_ttft --search``): queries lie far from every row.
MIN_RECALL = {("hnsw", 1.0): 0.97, ("ivf", 1.0): 0.97, ("hnsw", 2.0): 0.95, ("ivf", 2.0): 0.85}


@pytest.fixture(scope="module")
def exact() -> CandidateIndex:
    """K random anisotropic rows, non-contiguous candidate ids."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(K, D, generator=gen) * torch.linspace(0.3, 2.0, D)
    return CandidateIndex.build(torch.arange(K) * 2 + 5, rows)


@pytest.fixture(scope="module", params=["hnsw", "ivf"])
def approx(request, exact) -> ApproximateIndex:
    return ApproximateIndex.build(exact, request.param)


def noisy(rows: torch.Tensor, n: int, relative: float, seed: int) -> torch.Tensor:
    """``n`` queries: a random row plus a random direction of norm ``relative`` x the mean row
    norm (DP noise is of that order or larger on real tables)."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, rows.shape[0], (n,), generator=gen)
    direction = torch.randn(n, rows.shape[1], generator=gen, dtype=torch.float64)
    direction *= rows.norm(dim=1).mean() * relative / direction.norm(dim=1, keepdim=True)
    return rows[picks].double() + direction


@pytest.fixture(scope="module")
def answers(exact) -> dict:
    """relative noise -> (queries, brute-force ids), computed once for both indexes."""
    out = {}
    for relative in (1.0, 2.0):
        queries = noisy(exact.rows, QUERIES, relative, seed=1)
        out[relative] = queries, exact.ids[brute_force_nearest(queries, exact.rows)]
    return out


@pytest.mark.parametrize("relative", [1.0, 2.0])
def test_returns_the_exact_nearest_on_a_high_fraction(approx, answers, relative):
    queries, want = answers[relative]
    got = approx.nearest(queries, k=32)
    recall = float((got == want).double().mean())
    assert recall >= MIN_RECALL[approx.kind, relative], f"{approx.kind}: recall {recall:.4f}"


def test_reranks_exactly(approx, exact):
    """Queries ON a row: the exact re-rank of faiss's top-k returns that row's id every time
    (fp32 faiss distances alone could not separate near-duplicate rows)."""
    picks = torch.arange(0, K, 7)
    assert torch.equal(approx.nearest(exact.rows[picks].double(), k=8), exact.ids[picks])


def test_never_returns_a_special_id():
    """A table with special ids 0-3: queries at (and near) the special rows' own embeddings, and
    far-away ones, come back as candidates only, also when IVF finds fewer than k per query."""
    table = make_table(vocab=600, dim=16)
    exact = candidate_index(table)
    special = torch.tensor([0, 1, 2, 3])
    gen = torch.Generator().manual_seed(3)
    queries = torch.cat([
        table.clipped[special].repeat(25, 1),
        table.clipped[special].repeat(25, 1) + 0.01 * torch.randn(100, 16, generator=gen),
        50.0 * torch.randn(100, 16, generator=gen),
    ]).double()
    indexes = [ApproximateIndex.build(exact, "hnsw"),
               ApproximateIndex.build(exact, "ivf", nlist=15, nprobe=1)]  # ~40 rows a list < k
    assert (indexes[1].positions(queries.float(), 64) < 0).any()  # the padding path runs
    allowed = set(table.candidates.tolist())
    assert not allowed & set(special.tolist())
    for index in indexes:
        got = index.nearest(queries, k=64)
        assert set(got.tolist()) <= allowed


def test_queries_faiss_cannot_answer_fall_back_to_exact(exact, monkeypatch):
    approx = ApproximateIndex.build(exact, "ivf")
    queries = noisy(exact.rows, 50, 2.0, seed=4)
    real = approx.positions

    def partly_empty(q, k):
        found = real(q, k)
        found[::2] = -1  # every other query: nothing found
        return found

    monkeypatch.setattr(approx, "positions", partly_empty)
    got = approx.nearest(queries, k=8)
    want = exact.ids[brute_force_nearest(queries, exact.rows)]
    assert torch.equal(got[::2], want[::2])
    assert approx.nearest(queries[:0], k=8).numel() == 0
    with pytest.raises(ValueError, match="non-finite"):
        approx.nearest(torch.full((2, D), float("nan")), k=8)


def test_search_index_and_nlist():
    exact = candidate_index(make_table())
    assert search_index(exact, "exact") is exact
    assert isinstance(search_index(exact, "hnsw"), ApproximateIndex)
    assert ivf_nlist(49135) == 887 and ivf_nlist(300) == 7 and ivf_nlist(10) == 1
    with pytest.raises(ValueError, match="approximate search must be one of"):
        ApproximateIndex.build(exact, "annoy")


def test_config_key_is_validated_and_named():
    assert PromptPrivacyConfig().search == "exact"
    assert PromptPrivacyConfig(search="ivf").search == "ivf"
    for bad in ("annoy", "HNSW", "", None, 1):
        with pytest.raises(ConfigError, match=r"prompt\.search must be one of \['exact', 'hnsw', 'ivf'\]"):
            PromptPrivacyConfig(search=bad)
    section = DPPrivacyConfig.from_dict({"prompt": {"search": "hnsw"}})
    assert section.prompt.search == "hnsw"
    with pytest.raises(ConfigError, match="prompt.search"):
        DPPrivacyConfig.from_dict({"prompt": {"search": "flat"}})


@pytest.mark.parametrize("search", ["exact", "hnsw", "ivf"])
def test_session_uses_the_configured_search(search):
    from vllm_dp_plugin.prompt.session import PromptPrivacy, Segment

    table = make_table()
    service = PromptPrivacy(table, PromptPrivacyConfig(search=search, epsilon=50.0, mechanism="gaussian_analytic"))
    assert isinstance(service._index, ApproximateIndex) == (search != "exact")
    assert (search if search != "exact" else "exact (certified") in service.search.lower()
    ids = tuple(range(4, 200))
    done = service.privatize([Segment(ids, True)], service.options(), seed=b"0123456789abcdef")
    assert set(done.ids) <= set(table.candidates.tolist()) and len(done.ids) == len(ids)


def test_expmech_ignores_the_approximate_index():
    """``expmech`` samples over exact distances: with ``search=hnsw`` it draws exactly what it
    draws with the exact index (same generator state); an additive mechanism goes through faiss."""
    from vllm_dp_plugin.prompt.mechanisms import token_mechanism
    from vllm_dp_plugin.prompt.privatizer import TokenPrivatizer

    table = make_table()
    ids = torch.arange(4, 300)
    mask = torch.ones_like(ids, dtype=torch.bool)
    expmech = token_mechanism("expmech", table, 5.0, 0.0)
    out = {}
    for search in ("exact", "hnsw"):
        privatizer = TokenPrivatizer(table, expmech, search=search)
        out[search], _ = privatizer.privatize(ids, mask, torch.Generator().manual_seed(7))
    assert torch.equal(out["exact"], out["hnsw"])
    additive = TokenPrivatizer(table, token_mechanism("laplace", table, 50.0, 0.0), search="ivf")
    assert isinstance(additive.index, ApproximateIndex)
    calls = []
    real = additive.index.positions
    additive.index.positions = lambda q, k: calls.append(k) or real(q, k)
    additive.privatize(ids, mask, torch.Generator().manual_seed(7))
    assert calls == [8]
