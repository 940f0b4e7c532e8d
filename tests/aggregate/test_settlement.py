"""What a query settles (``AggregationParams.settlement``, ``Aggregator.settlement``): within its
reservation (the worst case) in epsilon and in delta in every state a query can end in, exactly
the pure basic epsilon of the steps taken where the worst case is pure, exactly the worst case
where it is the RDP statement; the ledger accepts every settlement. Every query is charged at least
`aggregate.min_epsilon`, so a total pays for a bounded number of queries (the minimum charge)."""

import numpy as np
import pytest

from vllm_dp_plugin.aggregate.decode import Aggregator, TopLogprobs
from vllm_dp_plugin.config import DPPrivacyConfig
from vllm_dp_plugin.plan import aggregation_params, max_queries
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.aggregation import AggregationParams
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.query_ledger import BudgetExhausted, QueryLedger

TOTAL = Budget(200.0, 1e-4)


def _config(**fields):
    return DPPrivacyConfig.from_dict({"aggregate": {"contexts": {"docs": "d.jsonl"}, **fields}}).aggregate


def test_an_open_gate_at_a_tiny_epsilon_settles_within_its_reservation(tmp_path):
    """The issue's case: dp_epsilon 1e-5 reserves (1e-5, 0) (basic composition is the smaller
    worst case); a query whose gate answered no was settled at the accountant's (0, 1e-6) (its
    KL bound), more delta than reserved: ``settle`` refused it after the compute. (The operator
    allows such a small query: the default minimum is 1: the minimum charge.)"""
    params = aggregation_params(_config(min_epsilon=1e-6), 1e-5)
    worst = params.worst_case
    assert worst.delta == 0.0 and 1e-5 * (1 - 1e-9) <= worst.epsilon <= 1e-5
    assert params.spent(0, open_gate=True) == Budget(0.0, 1e-6)  # the statement that was settled
    aggregator = Aggregator(params, np.random.default_rng(0))
    public = TopLogprobs.of({5: -0.7, 6: -1.0})
    step = aggregator.step(public, [TopLogprobs.of({5: -0.1})] * params.members)
    assert not step.private and aggregator.gate_open and aggregator.private_steps == 0  # seed 0: a no
    assert aggregator.settlement() == Budget(params.eps_gate, 0.0)
    ledger = QueryLedger(NoiseKey(tmp_path / "k"), tmp_path / "q.jsonl")
    reservation = ledger.reserve("docs", TOTAL, worst)
    status = ledger.settle(reservation, aggregator.settlement())
    assert status.spent == Budget(params.eps_gate, 0.0)
    assert params.eps_gate == pytest.approx(1e-5 / 8, rel=1e-9)  # half of one of 4 steps


PURE = AggregationParams("vote", 8, 1.0, 1.0, 4, 1e-6)  # worst case: basic 8 < RDP
RDP = AggregationParams("expmech", 8, 0.75, 0.25, 64, 1e-5)  # worst case: RDP < basic 64
UNGATED = AggregationParams("vote", 8, 2.0, 0.0, 3, 1e-6)  # worst case: basic 6 < RDP


@pytest.mark.parametrize("params", [PURE, RDP, UNGATED], ids=["pure", "rdp", "ungated"])
def test_every_reachable_state_settles_exactly_and_within_the_reservation(params, tmp_path):
    worst = params.worst_case
    pure = worst.delta == 0.0
    assert pure == (params is not RDP)  # the grid covers both branches
    ledger = QueryLedger(NoiseKey(tmp_path / "k"), tmp_path / "q.jsonl")
    for steps in range(params.max_private_tokens + 1):
        for open_gate in (False, True):
            if open_gate and params.gated and steps == params.max_private_tokens:
                with pytest.raises(ValueError, match="gate is not asked at the cap"):
                    params.settlement(steps, open_gate)
                continue
            settled = params.settlement(steps, open_gate)
            charged = open_gate and params.gated
            if pure:
                assert settled == Budget(steps * (params.eps_select + params.eps_gate)
                                         + (params.eps_gate if charged else 0.0), 0.0)
            else:
                assert settled == worst  # never the realized RDP statement
            # within the reservation, and never below the statement of the steps taken
            assert settled.epsilon <= worst.epsilon and settled.delta <= worst.delta
            assert settled.epsilon >= params.spent(steps, open_gate).epsilon
            ledger.settle(ledger.reserve("docs", Budget(1e6, 0.5), worst), settled)
    with pytest.raises(ValueError, match="no query makes"):
        params.settlement(params.max_private_tokens + 1)
    with pytest.raises(ValueError, match="no query makes"):
        params.settlement(-1)


# --- the minimum charge (aggregate.min_epsilon) ---------------------------------------------------
def test_every_query_is_charged_at_least_the_minimum_and_never_more_than_its_reservation():
    cfg = _config()  # epsilon 8: min_epsilon 1
    assert cfg.min_epsilon == 1.0
    for eps in (1.0, 2.0, 8.0):
        params = aggregation_params(cfg, eps)
        worst = params.worst_case
        assert params.min_charge == 1.0
        for steps in range(params.max_private_tokens):
            for open_gate in (False, True):
                basic = steps * (params.eps_select + params.eps_gate) + (params.eps_gate if open_gate else 0.0)
                expected = min(worst.epsilon, max(1.0, basic))
                assert params.settlement(steps, open_gate) == Budget(expected, 0.0)
        assert params.settlement(0) == Budget(min(1.0, worst.epsilon), 0.0)  # nothing spent: the minimum
        assert 1.0 * (1 - 1e-12) <= params.settlement(0).epsilon <= 1.0
    # the RDP branch settles its worst case, above the minimum anyway
    rdp = aggregation_params(_config(max_private_tokens=64, mechanism="expmech", gate="none"), 8.0)
    assert rdp.worst_case.delta > 0 and rdp.settlement(0) == rdp.worst_case


def test_a_collections_total_pays_for_at_most_total_over_min_epsilon_queries(tmp_path):
    """Before: a query at dp_epsilon 1e-9 was accepted and one that spent nothing settled 0, so
    a collection's total paid for any number of probes."""
    cfg = _config(total_epsilon=16.0)
    assert max_queries(cfg) == 16
    with pytest.raises(ValueError, match=r"dp_epsilon must lie in \[1, 8\] \(aggregate.min_epsilon"):
        aggregation_params(cfg, 0.999)
    params = aggregation_params(cfg, cfg.min_epsilon)
    ledger = QueryLedger(NoiseKey(tmp_path / "k"), tmp_path / "q.jsonl")
    total = Budget(cfg.total_epsilon, cfg.total_delta)
    answered = 0
    while True:
        try:
            reservation = ledger.reserve("docs", total, params.worst_case)
        except BudgetExhausted:
            break
        ledger.settle(reservation, params.settlement(0))  # a query whose every token was public
        answered += 1
    assert answered == 16

