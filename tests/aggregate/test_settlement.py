"""What a query settles (``AggregationParams.settlement``, ``Aggregator.settlement``): within its
reservation (the worst case) in epsilon and in delta in every state a query can end in, exactly
the pure basic epsilon of the steps taken where the worst case is pure, exactly the worst case
where it is the RDP statement; the ledger accepts every settlement (issue 31, item 6)."""

import numpy as np
import pytest

from vllm_dp_plugin.aggregate.decode import Aggregator, TopLogprobs
from vllm_dp_plugin.config import DPPrivacyConfig
from vllm_dp_plugin.plan import aggregation_params
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.aggregation import AggregationParams
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.query_ledger import QueryLedger

TOTAL = Budget(200.0, 1e-4)


def _defaults():
    return DPPrivacyConfig.from_dict({"aggregate": {"contexts": {"docs": "d.jsonl"}}}).aggregate


def test_an_open_gate_at_a_tiny_epsilon_settles_within_its_reservation(tmp_path):
    """The issue's case: dp_epsilon 1e-5 reserves (1e-5, 0) (basic composition is the smaller
    worst case); a query whose gate answered no was settled at the accountant's (0, 1e-6) (its
    KL bound), more delta than reserved: ``settle`` refused it after the compute."""
    params = aggregation_params(_defaults(), 1e-5)
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
