"""The clients of a trial (asyncio + httpx): concurrent request loops, some streaming, a
``/v1/dp/budget`` poller, and the fixed greedy prompts whose answers fingerprint a DP-attention
release. Every time is in seconds from the load's start."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from .checks import Outcome

# public questions about the bundled northwind collection (aggregation) and plain prompts (DP attention)
QUESTIONS = ("When is the Seattle warehouse closed?", "What is the dairy price increase?",
             "Which warehouse ships orders during inventory?", "What changes in Q3?")
PROMPTS = ("The meeting is on", "Our company sells", "The answer to the question is")
FINGERPRINT_TOKENS = 16
TIMEOUT = httpx.Timeout(300.0, connect=10.0)


def request(mode: str, text: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    """(path, body) of one load request: a chat question (aggregation) or a completion (DP attention)."""
    if mode == "aggregate":
        return "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}],
                                        "max_tokens": max_tokens, "stream": stream}
    return "/v1/completions", {"model": "m", "prompt": text, "max_tokens": max_tokens, "stream": stream}


def last_receipt(lines: Sequence[str]) -> dict | None:
    """The ``dp_receipt`` of a server-sent event stream (its last data chunk before ``[DONE]``)."""
    for line in reversed(lines):
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[len("data: "):])
            return chunk.get("dp_receipt")
    return None


@dataclass
class Load:
    """``clients`` request loops against ``base`` until ``stop()``; client i streams when i is odd.
    ``outcomes``: every request sent; ``budgets``: (time, statement) of each ``/v1/dp/budget``
    answered (aggregation)."""

    base: str
    mode: str
    clients: int
    max_tokens: int
    seed: int
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    budgets: list[tuple[float, dict]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = time.monotonic()
        self.stopped = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.start

    def stop(self) -> None:
        self.stopped.set()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=TIMEOUT) as http:
            loops = [self._client(http, i) for i in range(self.clients)]
            if self.mode == "aggregate":
                loops.append(self._poll(http))
            await asyncio.gather(*loops)

    async def _client(self, http: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        texts = QUESTIONS if self.mode == "aggregate" else PROMPTS
        while not self.stopped.is_set():
            path, body = request(self.mode, rng.choice(texts), self.max_tokens, stream=index % 2 == 1)
            body["model"] = self.model
            outcome = Outcome(self.now(), body["stream"])
            self.outcomes.append(outcome)
            try:
                await self._send(http, path, body, outcome)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                outcome.error = type(exc).__name__
                await asyncio.sleep(0.5)  # the server is down: no busy loop until stop()
            outcome.ended = self.now()

    async def _send(self, http: httpx.AsyncClient, path: str, body: dict, outcome: Outcome) -> None:
        if not body["stream"]:
            response = await http.post(path, json=body)
            outcome.status = response.status_code
            if response.status_code == 200:
                outcome.receipt = response.json().get("dp_receipt")
            return
        async with http.stream("POST", path, json=body) as response:
            outcome.status = response.status_code
            lines = [line async for line in response.aiter_lines() if line]
        if response.status_code == 200 and lines and lines[-1] == "data: [DONE]":
            outcome.receipt = last_receipt(lines)

    async def _poll(self, http: httpx.AsyncClient) -> None:
        while not self.stopped.is_set():
            try:
                sent = self.now()  # the statement is read after this: a query ending before did not settle after
                response = await http.get("/v1/dp/budget")
                if response.status_code == 200:
                    self.budgets.append((sent, response.json()))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)


async def fingerprint(base: str, model: str) -> list[dict]:
    """The greedy answers (text, token ids' log-probabilities, top 3) to ``PROMPTS``, one at a
    time (no batching: the engine's rounding does not depend on other requests)."""
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as http:
        for prompt in PROMPTS:
            response = await http.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": FINGERPRINT_TOKENS, "temperature": 0.0,
                "logprobs": 3})
            response.raise_for_status()
            choice = response.json()["choices"][0]
            out.append({"text": choice["text"], "logprobs": choice["logprobs"]})
    return out


async def probe(base: str, model: str, max_tokens: int) -> tuple[int | None, dict | None]:
    """The first aggregation query after a restart: (status, body)."""
    path, body = request("aggregate", QUESTIONS[0], max_tokens, stream=False)
    body["model"] = model
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as http:
        try:
            response = await http.post(path, json=body)
        except httpx.HTTPError:
            return None, None
        try:
            return response.status_code, response.json()
        except json.JSONDecodeError:
            return response.status_code, None
