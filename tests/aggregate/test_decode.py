"""Lockstep decoding (``aggregate.decode``) and its torch source: ``TopLogprobs``, the
``Aggregator``'s private-step cap, gates and large-epsilon limits, empirical DP audits of one
step (hand-built worst-case neighbouring pairs for expmech and vote, each with a mutant at twice
the epsilon, and a document added to a tiny random Llama end to end), ``generate`` over a fake source, and ``TorchSource``
against a plain full forward.

Audits: ``N`` i.i.d. steps under each neighbour (fixed seeds), Clopper-Pearson intervals at
confidence 1e-6 a side. If the step is eps-DP, ln(lower CP of P_D(x) / upper CP of P_D'(x))
<= ln(P_D(x) / P_D'(x)) <= eps except with probability <= 2e-6 per comparison; a lower bound
above eps refutes the claim.
"""

import asyncio
import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from vllm_dp_plugin.aggregate import decode
from vllm_dp_plugin.aggregate.decode import Aggregator, Step, TopLogprobs, generate
from vllm_dp_plugin.aggregate.torch_source import TorchSource
from vllm_dp_plugin.privacy.aggregation import AggregationParams

hf_logging.set_verbosity_error()

ALPHA = 1e-6  # one-sided Clopper-Pearson error
VOCAB = 64


def cp_lower(hits: int, n: int, alpha: float = ALPHA) -> float:
    return 0.0 if hits == 0 else float(stats.beta.ppf(alpha, hits, n - hits + 1))


def cp_upper(hits: int, n: int, alpha: float = ALPHA) -> float:
    return 1.0 if hits == n else float(stats.beta.ppf(1 - alpha, hits + 1, n - hits))


def log_ratio_lower(hits_d: int, hits_d2: int, n: int) -> float:
    """Lower confidence bound of ln(P_D / P_D') from ``hits`` out of ``n`` under each."""
    low = cp_lower(hits_d, n)
    return -math.inf if low == 0.0 else math.log(low) - math.log(cp_upper(hits_d2, n))


def params(mechanism="expmech", members=4, eps_select=1.0, eps_gate=0.0, max_private_tokens=10**9,
           delta=1e-6, **fields) -> AggregationParams:
    return AggregationParams(mechanism, members, eps_select, eps_gate, max_private_tokens, delta, **fields)


def tops(pairs: dict[int, float]) -> TopLogprobs:
    return TopLogprobs.of(pairs)


def llama(seed: int = 0, init: float = 0.5) -> LlamaForCausalLM:
    """A tiny random Llama; weights at std 0.5 (not HF's 0.02) so that next-token distributions
    are peaked and depend on the context (at 0.02 they are uniform to within ~0.05 nats)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, initializer_range=init,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


# --- TopLogprobs --------------------------------------------------------------------------------


def test_top_logprobs_of_sorts_and_lookup_floors():
    dist = TopLogprobs.of({3: -2.0, 7: -0.5, 1: -1.0, 9: -4.0})
    np.testing.assert_array_equal(dist.ids, [7, 1, 3, 9])
    np.testing.assert_array_equal(dist.logprobs, [-0.5, -1.0, -2.0, -4.0])
    assert dist.ids.dtype == np.int64 and dist.logprobs.dtype == np.float64
    assert dist.top == 7
    # listed tokens get their own; unlisted ones the smallest listed (-4)
    np.testing.assert_array_equal(dist.lookup(np.array([1, 42, 9, 7, 0])), [-1.0, -4.0, -4.0, -0.5, -4.0])


# --- the Aggregator -----------------------------------------------------------------------------

PUBLIC = tops({10: -1.0, 11: -1.2, 12: -2.6, 13: -3.1, 14: -4.0})


@pytest.mark.parametrize("mechanism", ["vote", "expmech"])
def test_private_steps_are_capped(mechanism):
    p = params(mechanism, members=3, max_private_tokens=3)
    agg = Aggregator(p, np.random.default_rng(0))
    members = [tops({11: -0.1, 10: -3.0}), tops({12: -0.2, 10: -2.0}), tops({10: -0.3})]
    steps = [agg.step(PUBLIC, members) for _ in range(8)]
    assert [s.private for s in steps] == [True] * 3 + [False] * 5
    assert all(s.token in {10, 11, 12, 13, 14} for s in steps[:3])
    assert steps[3:] == [Step(10, False)] * 5  # the public top token, for free
    assert agg.private_steps == 3


def test_wrong_member_count_is_refused():
    agg = Aggregator(params(members=3), np.random.default_rng(0))
    with pytest.raises(ValueError, match="expected 3 member"):
        agg.step(PUBLIC, [PUBLIC, PUBLIC])


def test_confident_public_token_is_free():
    agg = Aggregator(params("vote", members=2, confidence=0.5), np.random.default_rng(0))
    confident = tops({4: math.log(0.6), 5: math.log(0.3)})
    members = [tops({5: -0.01}), tops({5: -0.01})]
    assert [agg.step(confident, members) for _ in range(20)] == [Step(4, False)] * 20
    assert agg.private_steps == 0
    assert agg.step(PUBLIC, members).private  # below the confidence: a private step


def test_gate_with_agreeing_members_is_public():
    """k = 8, threshold 4 members, eps_gate = 50: members agreeing with the public token make
    the gate's query 0, so a yes needs Lap(4/50) - Lap(2/50) >= 4, probability ~ e^-50 a step;
    members all on another candidate make it 8: a no needs the same deviation."""
    p = params("vote", members=8, eps_select=1e6, eps_gate=50.0, max_private_tokens=10**6)
    agg = Aggregator(p, np.random.default_rng(1))
    agree = [tops({10: -0.1, 12: -3.0})] * 8
    assert [agg.step(PUBLIC, agree) for _ in range(300)] == [Step(10, False)] * 300
    assert agg.private_steps == 0
    disagree = [tops({12: -0.1, 10: -3.0})] * 8
    assert [agg.step(PUBLIC, disagree) for _ in range(300)] == [Step(12, True)] * 300


def test_huge_eps_vote_returns_the_plurality():
    """eps = 1e6, no gate: one vote is worth 5e5 nats, the public prior (a few nats) cannot
    outweigh it, so the mechanism is report-max: the plurality (13, three votes) wins over the
    public top 10 and over 11 (two votes)."""
    agg = Aggregator(params("vote", members=5, eps_select=1e6), np.random.default_rng(2))
    members = [tops({t: -0.1, 10: -5.0}) for t in (13, 11, 13, 11, 13)]
    assert {agg.step(PUBLIC, members) for _ in range(50)} == {Step(13, True)}
    # a vote outside the candidates counts for none: 99 x3 loses to 11 x2
    members = [tops({t: -0.1}) for t in (99, 11, 99, 11, 99)]
    assert {agg.step(PUBLIC, members) for _ in range(50)} == {Step(11, True)}


def test_huge_eps_expmech_returns_argmax_of_clipped_mixture():
    """eps = 1e6, no gate: expmech tends to greedy decoding of public log-probs plus the
    members' mean clipped difference. Built so that the answer differs from the public top
    (10), from the unclipped mean's argmax (12), and uses member B's floor for token 13."""
    clip = 0.5
    public_lp = {10: -1.0, 11: -1.2, 12: -2.6, 13: -3.1, 14: -4.0}
    a = {10: -1.3, 11: -0.3, 12: -0.1, 13: -3.1, 14: -4.0}  # diffs -0.3, +0.9, +2.5, 0, 0
    b = {10: -1.2, 11: -0.9, 12: -0.1}  # diffs -0.2, +0.3, +2.5; 13, 14 -> floor -1.2
    cand = np.array(list(public_lp))
    pub = np.array(list(public_lp.values()))
    own = np.array([[a[t] for t in cand], [b.get(t, min(b.values())) for t in cand]])
    diffs = own - pub
    expected = int(cand[np.argmax(pub + np.clip(diffs, -clip, clip).mean(axis=0))])
    assert expected == 11
    assert int(cand[np.argmax(pub + diffs.mean(axis=0))]) == 12
    agg = Aggregator(params("expmech", members=2, eps_select=1e6, clip=clip), np.random.default_rng(3))
    assert {agg.step(tops(public_lp), [tops(a), tops(b)]) for _ in range(50)} == {Step(11, True)}


# --- empirical audit: the worst-case neighbouring pair for expmech -------------------------------

K_AUDIT, MEMBERS_AUDIT, CLIP_AUDIT, EPS_AUDIT, N_AUDIT = 8, 4, 1.0, 1.0, 20_000
AUDIT_IDS = np.arange(20, 20 + K_AUDIT)
TARGET = int(AUDIT_IDS[3])  # candidate a (not the public top: nothing special about it)


def worst_case_pair() -> tuple[TopLogprobs, list[TopLogprobs], list[TopLogprobs]]:
    """Public: uniform over 8 candidates. Member 0 under D: +3C on a, -3C on every other
    candidate relative to the public log-probs (clipped to +-C: beyond the clip, to check the
    clip bounds it); under D': the reverse. Members 1..3: the public log-probs (difference 0)."""
    lp = np.full(K_AUDIT, -math.log(K_AUDIT))
    public = TopLogprobs(AUDIT_IDS.copy(), lp.copy())
    up = np.where(AUDIT_IDS == TARGET, 3 * CLIP_AUDIT, -3 * CLIP_AUDIT)
    member0 = {True: TopLogprobs.of(dict(zip(AUDIT_IDS.tolist(), (lp + up).tolist()))),
               False: TopLogprobs.of(dict(zip(AUDIT_IDS.tolist(), (lp - up).tolist())))}
    rest = [TopLogprobs(AUDIT_IDS.copy(), lp.copy()) for _ in range(MEMBERS_AUDIT - 1)]
    return public, [member0[True], *rest], [member0[False], *rest]


def draw(public: TopLogprobs, members: list[TopLogprobs], p: AggregationParams, n: int,
         seed: int) -> dict[int, int]:
    """token -> count over ``n`` independent private steps (no gate: steps share no state)."""
    agg = Aggregator(p, np.random.default_rng(seed))
    counts: dict[int, int] = {}
    for _ in range(n):
        step = agg.step(public, members)
        assert step.private
        counts[step.token] = counts.get(step.token, 0) + 1
    return counts


def audit_worst_case() -> tuple[int, int]:
    public, d, d2 = worst_case_pair()
    p = params("expmech", members=MEMBERS_AUDIT, eps_select=EPS_AUDIT, clip=CLIP_AUDIT,
               candidates=K_AUDIT)
    return (draw(public, d, p, N_AUDIT, 100).get(TARGET, 0),
            draw(public, d2, p, N_AUDIT, 200).get(TARGET, 0))


def test_expmech_audit_worst_case_pair_and_half_noise_mutant(monkeypatch):
    """Sensitivity 2C/k = 1/2; scores differ from the public ones by +-C/k = +-1/4, so the
    logits eps u / (2 sensitivity) put a at +eps/4 and the others at -eps/4 under D, the
    reverse under D': a's logit gap to the others is +eps/2 vs -eps/2. Exactly:
        P_D(a) = e^(eps/2) / (e^(eps/2) + 7) = 0.1906,  P_D'(a) = 1 / (1 + 7 e^(eps/2)) = 0.0797,
        ln ratio = eps + ln((e^(-eps/2) + 7) / (e^(eps/2) + 7)) = 0.872   (-> eps as K grows).
    At n = 20000 the two CP bounds cost ~0.06 + ~0.11, so the honest lower bound is ~0.69:
    below eps (the DP claim) yet above 1/2 (the pair is near worst case: the audit is tight).
    Mutant: logits doubled (= Gumbel noise at half scale, i.e. 2 eps spent while eps is claimed):
        P_D(a) = e / (e + 7) = 0.280,  P_D'(a) = 1 / (1 + 7 e) = 0.0499,  ln ratio = 1.72,
    lower bound ~1.72 - 0.05 - 0.14 ~ 1.53 > eps = 1: caught."""
    honest_d, honest_d2 = audit_worst_case()
    p_d = math.exp(EPS_AUDIT / 2) / (math.exp(EPS_AUDIT / 2) + K_AUDIT - 1)
    p_d2 = 1 / (1 + (K_AUDIT - 1) * math.exp(EPS_AUDIT / 2))
    # the exact law is inside both intervals (the step is the mechanism it claims)
    assert cp_lower(honest_d, N_AUDIT) <= p_d <= cp_upper(honest_d, N_AUDIT)
    assert cp_lower(honest_d2, N_AUDIT) <= p_d2 <= cp_upper(honest_d2, N_AUDIT)
    honest = log_ratio_lower(honest_d, honest_d2, N_AUDIT)
    assert 0.5 < honest <= EPS_AUDIT

    original = decode.exponential_mechanism

    def doubled(scores, sensitivity, epsilon, rng, base=None):
        return original(scores, sensitivity, 2 * epsilon, rng, None if base is None else 2 * np.asarray(base))

    monkeypatch.setattr(decode, "exponential_mechanism", doubled)
    mutant = log_ratio_lower(*audit_worst_case(), N_AUDIT)
    assert mutant > EPS_AUDIT


# --- empirical audit: the worst-case neighbouring pair for vote ----------------------------------

VOTE_A, VOTE_B, PRIOR_A = 30, 31, 0.05


def vote_pair(seed_d: int, seed_d2: int, eps: float = EPS_AUDIT) -> tuple[int, int]:
    """How often ``vote`` (k = 2, no gate) picks A in ``N_AUDIT`` steps under D (member 0 votes
    A, member 1 B) and under D' (member 0's document removed: it votes B too)."""
    public = tops({VOTE_A: math.log(PRIOR_A), VOTE_B: math.log(1 - PRIOR_A)})
    a, b = tops({VOTE_A: -0.1, VOTE_B: -3.0}), tops({VOTE_B: -0.1, VOTE_A: -3.0})
    p = params("vote", members=2, eps_select=eps)
    return (draw(public, [a, b], p, N_AUDIT, seed_d).get(VOTE_A, 0),
            draw(public, [b, b], p, N_AUDIT, seed_d2).get(VOTE_A, 0))


def test_vote_law_and_audit_worst_case_pair_and_double_eps_mutant(monkeypatch):
    """``vote`` samples ``P(t) ~ p_pub(t) exp(eps n_t / 2)``. Public prior pi = 0.05 on A. Under D
    the votes tie (1, 1), so P_D(A) = pi = 0.05 exactly; under D' A has 0 votes and B 2:
        P_D'(A) = pi / (pi + (1 - pi) e^eps) = 0.0190,   ln ratio = ln(pi + (1 - pi) e^eps) = 0.968
    (-> eps as pi -> 0: the pair is near worst case for eps = 1). At n = 20000 the CP bounds
    cost ~0.15 (1000 hits) + ~0.25 (380 hits): honest lower bound ~0.57 <= eps.
    Mutant: the selection at 2 eps (the public prior unchanged): P_D(A) = 0.05 still, P_D'(A) =
    pi / (pi + (1 - pi) e^(2 eps)) = 0.00707, ln ratio 1.956; its bounds cost ~0.15 + ~0.45 (141
    hits), lower bound ~1.35 > eps: caught. The law check catches it too: 0.00707 lies far
    outside the honest D' interval."""
    honest_d, honest_d2 = vote_pair(500, 600)
    p_d, p_d2 = PRIOR_A, PRIOR_A / (PRIOR_A + (1 - PRIOR_A) * math.exp(EPS_AUDIT))
    assert cp_lower(honest_d, N_AUDIT) <= p_d <= cp_upper(honest_d, N_AUDIT)
    assert cp_lower(honest_d2, N_AUDIT) <= p_d2 <= cp_upper(honest_d2, N_AUDIT)
    doubled_d2 = PRIOR_A / (PRIOR_A + (1 - PRIOR_A) * math.exp(2 * EPS_AUDIT))
    assert not cp_lower(honest_d2, N_AUDIT) <= doubled_d2 <= cp_upper(honest_d2, N_AUDIT)
    assert 0.5 < log_ratio_lower(honest_d, honest_d2, N_AUDIT) <= EPS_AUDIT

    original = decode.exponential_mechanism

    def double_eps(scores, sensitivity, epsilon, rng, base=None):
        return original(scores, sensitivity, 2 * epsilon, rng, base)

    monkeypatch.setattr(decode, "exponential_mechanism", double_eps)
    mutant_d, mutant_d2 = vote_pair(500, 600)
    assert cp_lower(mutant_d2, N_AUDIT) <= doubled_d2 <= cp_upper(mutant_d2, N_AUDIT)  # it is the 2 eps law
    assert log_ratio_lower(mutant_d, mutant_d2, N_AUDIT) > EPS_AUDIT


# --- empirical audit: a document added on a tiny random Llama, end to end ------------------------

N_LLAMA = 15_000


def document_pair() -> tuple[list[TopLogprobs], list[TopLogprobs]]:
    """[public, member 0..3] next-token TopLogprobs under D (member 0 holds an extra document)
    and D' (without it), each through its own TorchSource. Documents are token-id strings;
    member i's prompt is its documents, then the query; the public prompt is the query."""
    model = llama()
    g = np.random.default_rng(1)
    docs = [g.integers(3, VOCAB, 6).tolist() for _ in range(6)]
    query = [5, 9, 11]
    extra = docs[5]
    parts_d = [[docs[0], extra], [docs[1]], [docs[2]], [docs[3], docs[4]]]
    parts_d2 = [[docs[0]], *parts_d[1:]]

    def prompts(parts):
        return [query] + [[t for doc in part for t in doc] + query for part in parts]

    d = asyncio.run(TorchSource(model, top_n=16)(prompts(parts_d)))
    d2 = asyncio.run(TorchSource(model, top_n=16)(prompts(parts_d2)))
    return d, d2


@pytest.fixture(scope="module")
def llama_pair():
    return document_pair()


@pytest.mark.parametrize("mechanism", ["vote", "expmech"])
def test_document_audit_on_tiny_llama(llama_pair, mechanism):
    """One step's chosen-token law under D and D' (the public sequence is the same in both:
    it sees no document). For every token seen >= 30 times under either, the CP lower bound
    of the log ratio, both directions, is <= eps_select. Not vacuous: the document moves the
    law (chi-square of the 2 x K table; exact ln ratios for this pair reach ~0.65 for vote,
    member 0's greedy token moves, and ~0.3 for expmech)."""
    d, d2 = llama_pair
    eps = 1.0
    assert np.array_equal(d[0].ids, d2[0].ids) and np.array_equal(d[0].logprobs, d2[0].logprobs)
    p = params(mechanism, members=4, eps_select=eps, clip=1.0, candidates=8)
    counts_d = draw(d[0], d[1:], p, N_LLAMA, 300)
    counts_d2 = draw(d2[0], d2[1:], p, N_LLAMA, 400)
    tokens = sorted(set(counts_d) | set(counts_d2))
    assert set(tokens) <= set(d[0].ids[:8].tolist())
    table = np.array([[counts_d.get(t, 0) for t in tokens], [counts_d2.get(t, 0) for t in tokens]])
    assert stats.chi2_contingency(table).pvalue < 1e-6
    checked = 0
    for t in tokens:
        a, b = counts_d.get(t, 0), counts_d2.get(t, 0)
        if max(a, b) < 30:
            continue
        checked += 1
        assert log_ratio_lower(a, b, N_LLAMA) <= eps, (t, a, b)
        assert log_ratio_lower(b, a, N_LLAMA) <= eps, (t, a, b)
    assert checked >= 4


# --- the gate's negative answers ----------------------------------------------------------------


def test_gate_no_answers_are_charged():
    """A query whose gate answered no (one public step) is charged ``Aggregator.settlement()``: the
    open gate instance's eps_gate, since its output law depends on the documents (a regression:
    it was charged 0). k = 2, threshold 1 member,
    eps_gate = 4 (noises Lap(1/2) threshold, Lap(1) query). D: both members agree with the
    public token (query 0); D': one member votes for another candidate (query 1):
        P_D(no)  = 1 - P(Lap(1) - Lap(1/2) >= 1) = 1 - ((4/3) e^-1 - (1/3) e^-2) / 2 = 0.777,
        P_D'(no) = P(Lap(1) < Lap(1/2)) = 1/2,   ln ratio = 0.44 > 0 = the charge.
    (AboveThreshold's no answers are paid by the instance's next yes; the last instance of a
    query, unfinished, is never paid for.)"""
    p = params("vote", members=2, eps_select=1.0, eps_gate=4.0, max_private_tokens=1)
    public = tops({5: -0.5, 6: -1.5})
    agree = [tops({5: -0.1}), tops({5: -0.1})]
    one_moved = [tops({5: -0.1}), tops({6: -0.1})]
    n = 10_000  # the bounds cost ~0.1 of the 0.44

    def public_and_free(members, seed):
        rng = np.random.default_rng(seed)
        hits = 0
        for _ in range(n):
            agg = Aggregator(p, rng)  # a fresh query: its own gate
            step = agg.step(public, members)
            hits += not step.private
        return hits, agg.settlement().epsilon

    hits_d, charge = public_and_free(agree, 7)
    hits_d2, _ = public_and_free(one_moved, 8)
    assert charge == pytest.approx(4.0)  # the open instance's eps_gate
    assert 0.2 < log_ratio_lower(hits_d, hits_d2, n) <= charge  # the no answers do leak


# --- generate over a fake source ----------------------------------------------------------------


class ScriptedSource:
    """Every sequence's top token at call i is ``script[i]``; records copies of the prompts."""

    def __init__(self, script):
        self.script, self.seen = list(script), []

    async def __call__(self, prompts):
        self.seen.append([list(p) for p in prompts])
        token = self.script[len(self.seen) - 1]
        return [tops({token: -0.1, 63: -3.0}) for _ in prompts]


def run_generate(source, public, members, max_tokens, stop_ids=(), max_private_tokens=10**6):
    agg = Aggregator(params("vote", members=len(members), eps_select=1e6,
                            max_private_tokens=max_private_tokens), np.random.default_rng(0))

    async def collect():
        return [step async for step in generate(source, public, members, agg, max_tokens, stop_ids)]

    return asyncio.run(collect())


PUBLIC_PROMPT, MEMBER_PROMPTS = [1, 4], [[1, 30, 31, 4], [1, 40, 4]]


def test_generate_stops_at_a_stop_token_and_yields_it():
    source = ScriptedSource([5, 6, 2, 7])
    steps = run_generate(source, PUBLIC_PROMPT, MEMBER_PROMPTS, max_tokens=10, stop_ids=[2])
    assert [s.token for s in steps] == [5, 6, 2]
    assert len(source.seen) == 3
    # every sequence got every chosen token appended, the stop token excepted
    originals = [PUBLIC_PROMPT, *MEMBER_PROMPTS]
    for call, appended in enumerate([[], [5], [5, 6]]):
        assert source.seen[call] == [p + appended for p in originals]
    assert PUBLIC_PROMPT == [1, 4] and MEMBER_PROMPTS == [[1, 30, 31, 4], [1, 40, 4]]  # not mutated


def test_generate_respects_max_tokens_and_the_private_cap():
    source = ScriptedSource([5, 6, 7, 8])
    steps = run_generate(source, PUBLIC_PROMPT, MEMBER_PROMPTS, max_tokens=3, stop_ids=[2],
                         max_private_tokens=2)
    assert steps == [Step(5, True), Step(6, True), Step(7, False)]
    assert len(source.seen) == 3
    assert source.seen[2][1] == MEMBER_PROMPTS[0] + [5, 6]
    assert run_generate(ScriptedSource([5]), PUBLIC_PROMPT, MEMBER_PROMPTS, max_tokens=0) == []


# --- TorchSource against a plain forward --------------------------------------------------------


class Recording:
    """The model, recording each call's input width (prefill: the padded length; cached: 1)."""

    def __init__(self, model):
        self.model, self.widths = model, []

    def __call__(self, **kwargs):
        self.widths.append(kwargs["input_ids"].shape[1])
        return self.model(**kwargs)


def reference(model, prompt: list[int], top_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-N (ids, log-probs) of the next token: one unpadded full forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    values, ids = torch.log_softmax(logits, dim=-1).topk(top_n)
    return ids.numpy(), values.numpy()


def test_torch_source_matches_full_forward_with_left_padding_and_cache():
    model, top_n = llama(seed=3), 10
    recording = Recording(model)
    source = TorchSource(recording, top_n=top_n, pad_id=0)
    prompts = [[1, 7, 8], [1, 20, 21, 22, 23, 24, 25], [1, 33, 34, 35, 36]]  # padded to 7
    widths = [7, 1, 1]
    for call, token in enumerate([None, 17, 42]):
        if token is not None:
            prompts = [p + [token] for p in prompts]
        out = asyncio.run(source(prompts))
        assert recording.widths[-1] == widths[call]
        assert len(out) == len(prompts)
        for got, prompt in zip(out, prompts):
            ids, values = reference(model, prompt, top_n)
            np.testing.assert_array_equal(got.ids, ids)
            np.testing.assert_allclose(got.logprobs, values, rtol=0, atol=1e-4)
            assert got.ids.dtype == np.int64
    # a prompt list that does not extend the last one is prefilled afresh
    fresh = [[1, 9], [1, 9, 10, 11]]
    out = asyncio.run(source(fresh))
    assert recording.widths[-1] == 4
    for got, prompt in zip(out, fresh):
        ids, values = reference(model, prompt, top_n)
        np.testing.assert_array_equal(got.ids, ids)
        np.testing.assert_allclose(got.logprobs, values, rtol=0, atol=1e-4)
