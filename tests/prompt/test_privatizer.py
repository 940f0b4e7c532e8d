"""TokenPrivatizer: pass-through, candidates only, per-token independence, determinism, receipts."""

import math
import warnings

import pytest
import torch

from vllm_dp_plugin.privacy import Budget, NotDifferentiallyPrivateWarning
from vllm_dp_plugin.prompt import TokenPrivatizer, token_mechanism

from .conftest import SPECIAL, VOCAB, make_table

VALID = ("trlap_corrected", "laplace", "gaussian_analytic", "expmech", "mahalanobis", "cmp")
ADDITIVE = ("trlap_corrected", "laplace", "gaussian_analytic", "mahalanobis", "cmp")
DELTA = 1e-6


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def privatizer(table, name, eps, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotDifferentiallyPrivateWarning)
        return TokenPrivatizer(table, token_mechanism(name, table, eps, DELTA), **kw)


def prompt(n=400, seed=1):
    """Random ids over the whole input domain (special ids included) and a random mask."""
    g = gen(seed)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    ids[:8] = torch.tensor(SPECIAL * 2)  # special ids both in the template and in user text
    mask = torch.rand(n, generator=g) < 0.6
    mask[:4], mask[4:8] = False, True
    return ids, mask


def all_masked(ids):
    return torch.ones_like(ids, dtype=torch.bool)


@pytest.mark.parametrize("name", VALID + ("trlap_paper",))
def test_unmasked_tokens_pass_through_and_outputs_are_candidates(table, name):
    ids, mask = prompt()
    out, receipt = privatizer(table, name, 0.3).privatize(ids, mask, gen())
    assert out.dtype == torch.int64 and out.shape == ids.shape
    assert torch.equal(out[~mask], ids[~mask])
    assert bool(torch.isin(out[mask], table.candidates).all())  # never a special id
    assert not bool(torch.isin(out[mask], torch.tensor(SPECIAL)).any())
    assert (out[mask] != ids[mask]).float().mean() > 0.5  # low epsilon: most tokens change
    assert receipt.tokens_privatized == int(mask.sum())


@pytest.mark.parametrize("name", VALID)
def test_huge_epsilon_returns_the_input_tokens(table, name):
    """Noise scale ~ linf / 400, far below half the smallest gap between candidate rows."""
    eps = 400 * table.sensitivity_l1 / table.sensitivity_linf
    ids = table.candidates.repeat(3)
    out, _ = privatizer(table, name, eps).privatize(ids, all_masked(ids), gen())
    assert torch.equal(out, ids)


@pytest.mark.parametrize("name", VALID + ("trlap_paper",))
def test_same_seed_same_output(table, name):
    ids, mask = prompt()
    priv = privatizer(table, name, 1.0)
    first, receipt = priv.privatize(ids, mask, gen(7))
    again, receipt_again = priv.privatize(ids, mask, gen(7))
    other, _ = priv.privatize(ids, mask, gen(8))
    assert torch.equal(first, again) and receipt == receipt_again
    assert not torch.equal(first, other)


def consecutive_correlation(noise: torch.Tensor) -> float:
    """Pearson correlation between the noise of tokens 2i and 2i+1, over all coordinates."""
    a, b = noise[0::2].flatten(), noise[1::2].flatten()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


@pytest.mark.parametrize("name", ADDITIVE)
def test_per_token_noise_is_fresh_and_independent(table, name):
    """The same token repeated: the noise vectors (read back through embedding mode) are pairwise
    distinct and uncorrelated (|rho| <= 5 / sqrt(pairs)); one vector shared by all tokens (the
    repo's behaviour) gives rho = 1 and fails the same check."""
    ids = torch.full((4000,), 9)
    embeds, _ = privatizer(table, name, 1.0).privatize_embeddings(ids, all_masked(ids), gen())
    noise = embeds.double() - table.mean - table.clipped[9]
    tolerance = 5 / math.sqrt(noise[0::2].numel())
    assert abs(consecutive_correlation(noise)) <= tolerance
    assert torch.unique(noise, dim=0).shape[0] == len(ids)
    assert consecutive_correlation(noise[0].expand_as(noise)) > tolerance


def test_exponential_mechanism_draws_are_independent(table):
    """Two draws for the same token agree with probability sum_c p_c^2 (independence); shared
    randomness would make them always agree."""
    eps, ids = 15.0, torch.full((20_000,), 17)
    out, _ = privatizer(table, "expmech", eps).privatize(ids, all_masked(ids), gen())
    dist = torch.cdist(table.clipped[17][None], table.clipped[table.candidates])[0]
    probs = torch.softmax(-eps * dist / (2 * table.sensitivity_l2), 0)
    collide = float((probs**2).sum())
    agree = float((out[0::2] == out[1::2]).float().mean())
    tolerance = 5 * math.sqrt(collide * (1 - collide) / (len(ids) // 2))
    assert abs(agree - collide) <= tolerance
    assert 1.0 - collide > tolerance  # shared randomness (agree = 1) would be rejected


def test_candidate_set_is_fixed_and_reachable_from_any_input(table):
    """Near eps = 0 the exponential mechanism is uniform over the candidates: a special input
    and an ordinary one reach exactly the same fixed set, and the table is untouched."""
    before = table.candidates.clone()
    priv = privatizer(table, "expmech", 1e-3)
    for token in (2, 17):
        ids = torch.full((20_000,), token)
        out, _ = priv.privatize(ids, all_masked(ids), gen(token))
        assert torch.equal(torch.unique(out), before)
    assert torch.equal(table.candidates, before)


@pytest.mark.parametrize("name", VALID)
def test_receipt_basic_composition_is_k_times_the_token_guarantee(table, name):
    ids, mask = prompt(n=12)
    priv = privatizer(table, name, 0.5)
    _, receipt = priv.privatize(ids, mask, gen())
    k, g = int(mask.sum()), priv.mechanism.guarantee
    assert receipt.mechanism == name and receipt.statement == g.statement() and receipt.valid
    assert (receipt.epsilon_token, receipt.delta_token) == (g.epsilon, g.delta)
    assert receipt.basic == Budget(pytest.approx(k * g.epsilon), pytest.approx(k * g.delta))
    assert receipt.advanced.epsilon >= receipt.basic.epsilon  # few tokens: basic is tighter
    assert receipt.total == receipt.basic
    if name in ("laplace", "expmech", "mahalanobis", "cmp"):
        assert receipt.total.delta == 0.0
    if name == "cmp":  # metric epsilon 0.5 per unit of l2 distance -> 0.5 * diameter per token
        assert receipt.basic.epsilon == pytest.approx(k * 0.5 * table.sensitivity_l2)


def test_receipt_reports_advanced_composition_when_smaller(table):
    eps, k, slack = 0.05, 2000, 1e-6
    ids = torch.full((k,), 17)
    _, receipt = privatizer(table, "laplace", eps).privatize(ids, all_masked(ids), gen())
    assert receipt.basic == Budget(pytest.approx(k * eps), 0.0)
    drv = eps * math.sqrt(2 * k * math.log(1 / slack)) + k * eps * math.expm1(eps)
    assert receipt.advanced.epsilon <= drv < k * eps
    assert receipt.advanced.delta == pytest.approx(slack)
    assert receipt.total == receipt.advanced


def test_receipt_with_no_private_tokens(table):
    ids = torch.arange(10)
    out, receipt = privatizer(table, "laplace", 1.0).privatize(
        ids, torch.zeros(10, dtype=torch.bool), gen()
    )
    assert torch.equal(out, ids)
    assert receipt.tokens_privatized == 0 and receipt.total == Budget(0.0, 0.0)


def test_paper_mode_receipt_records_the_true_delta():
    table = make_table(vocab=120, dim=16)
    with pytest.warns(NotDifferentiallyPrivateWarning):
        priv = TokenPrivatizer(table, token_mechanism("trlap_paper", table, 0.1))
    ids = torch.arange(4, 9)
    _, one = priv.privatize(ids, torch.arange(5) == 0, gen())
    _, five = priv.privatize(ids, all_masked(ids), gen())
    assert one.delta_token == priv.mechanism.guarantee.delta > 1e6 * 4.0**-16
    assert one.total == Budget(0.1, one.delta_token)  # the only valid statement, per token
    assert five.total == Budget(math.inf, 1.0)  # 5 * delta >= 1: no guarantee at all


def keep_rate_bound(eps, delta, vocab, tokens):
    """The bound (e^eps + V delta) / V on the mean keep rate of any (eps, delta)-DP token
    mechanism, plus 3 binomial standard deviations."""
    bound = min(1.0, (math.exp(eps) + vocab * delta) / vocab)
    return bound + 3 * math.sqrt(bound * (1 - bound) / tokens)


def test_keep_rate_bound_holds_for_valid_modes_and_fails_for_the_paper():
    """Every (eps, delta)-DP token mechanism keeps on average at most (e^eps + V delta) / V of
    uniformly drawn tokens (sum Pr[w -> w] <= e^eps Pr[w' -> w] + delta over w). The paper
    calibration breaks the bound at its claimed delta (regression guard: its Thm 3 is not DP for
    d > 1) and respects it at its recorded true delta."""
    table = make_table(vocab=200, dim=16, special=())
    ids = torch.arange(200).repeat(50)
    for name in VALID:
        priv = privatizer(table, name, 1.0)
        scale = 1.0 / priv.mechanism.guarantee.epsilon  # metric modes: eps_DP = 1 per token
        priv = privatizer(table, name, scale if name in ("mahalanobis", "cmp") else 1.0)
        out, receipt = priv.privatize(ids, all_masked(ids), gen())
        keep = float((out == ids).float().mean())
        assert receipt.epsilon_token == pytest.approx(1.0)
        assert keep <= keep_rate_bound(1.0, receipt.delta_token, 200, len(ids)), name
    paper = privatizer(table, "trlap_paper", 0.1)
    out, receipt = paper.privatize(ids, all_masked(ids), gen())
    keep = float((out == ids).float().mean())
    assert keep > keep_rate_bound(0.1, 4.0**-16, 200, len(ids))
    assert keep <= keep_rate_bound(0.1, receipt.delta_token, 200, len(ids))


@pytest.mark.parametrize("name", ("laplace", "mahalanobis", "expmech"))
def test_embedding_mode_matches_id_mode(table, name):
    """Pass-through rows are the model's own rows; masked rows project (additive) or are
    (expmech) exactly the ids that id mode outputs with the same generator state."""
    ids, mask = prompt()
    priv = privatizer(table, name, 1.0)
    embeds, receipt = priv.privatize_embeddings(ids, mask, gen(3))
    out, receipt_ids = priv.privatize(ids, mask, gen(3))
    assert embeds.dtype == table.embeddings.dtype and embeds.shape == (len(ids), table.dim)
    assert torch.equal(embeds[~mask], table.embeddings[ids[~mask]])
    if name == "expmech":
        assert torch.equal(embeds[mask], table.embeddings[out[mask]])
    else:
        assert torch.equal(priv.index.nearest(embeds[mask].double() - table.mean), out[mask])
    assert receipt == receipt_ids


def test_bad_privatize_inputs(table):
    priv = privatizer(table, "laplace", 1.0)
    ids, mask = prompt(n=10)
    cases = [
        (ids.float(), mask, "int64"),
        (ids[None], mask[None], "1-D"),
        (ids, mask.long(), "bool"),
        (ids, mask[:5], "shape"),
        (torch.tensor([0, VOCAB]), torch.ones(2, dtype=torch.bool), "prompt token ids must lie in"),
        (torch.tensor([-1, 3]), torch.ones(2, dtype=torch.bool), "prompt token ids must lie in"),
    ]
    for bad_ids, bad_mask, match in cases:
        with pytest.raises(ValueError, match=match):
            priv.privatize(bad_ids, bad_mask, gen())


def test_mechanism_must_belong_to_the_table(table):
    other = make_table(seed=1)
    with pytest.raises(ValueError, match="different EmbeddingTable"):
        TokenPrivatizer(table, token_mechanism("laplace", other, 1.0))
    with pytest.raises(ValueError, match="topk"):
        TokenPrivatizer(table, token_mechanism("laplace", table, 1.0), topk=0)
