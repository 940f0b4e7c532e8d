"""Schemathesis over a served API: every operation of its ``/openapi.json`` gets cases from
schemathesis' Hypothesis strategies (half that fit the schema, half that do not), each case is
sent (over HTTP, or in-process to an ASGI app) with its generation bounded (``bound_body``), and
its response judged by ``checks.check_response``; ``/v1/dp/budget`` is read after every case
and judged by ``checks.budget_problems``. Nothing stops at a failure: every case is counted
(``Tally``), per operation, status and failure."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vllm_dp_plugin.benchmarks.fuzz.checks import (
    Private,
    Verdict,
    budget_problems,
    check_response,
    numbers,
    request_fields,
)

BUDGET = "/v1/dp/budget"
# The routes a DP mode answers itself (chat, completions) and its statement get this weight in
# the split of cases over operations; every other operation weight 1.
DP_WEIGHT = 24
DP_OPERATIONS = ("POST /v1/chat/completions", "POST /v1/completions", f"GET {BUDGET}")
GENERATION_CAP = 16  # max_tokens, max_completion_tokens, min_tokens of a case
CAPPED_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens")
SAMPLES_CAP = 2  # n, best_of
EXAMPLES_KEPT = 5  # failing cases kept per operation and kind (with a curl command)


def bound_body(body, cap: int = GENERATION_CAP) -> None:
    """Bound the work of one request (in place): the token counts in ``CAPPED_FIELDS`` at
    ``cap``, ``n`` and ``best_of`` at ``SAMPLES_CAP``, and ``max_tokens`` set to ``cap`` where a
    body of an object sets no length (vLLM's default: the rest of ``max_model_len``). Values of
    the wrong type are left alone: they are what the negative cases test."""
    if not isinstance(body, dict):
        return
    for name in CAPPED_FIELDS:
        if _is_int(body.get(name)) and body[name] > cap:
            body[name] = cap
    for name in ("n", "best_of"):
        if _is_int(body.get(name)) and body[name] > SAMPLES_CAP:
            body[name] = SAMPLES_CAP
    if not any(name in body for name in CAPPED_FIELDS):
        body["max_tokens"] = cap


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def strings(body) -> list[str]:
    """Every string of a JSON value (keys excluded)."""
    if isinstance(body, str):
        return [body]
    if isinstance(body, dict):
        return [s for v in body.values() for s in strings(v)]
    if isinstance(body, list):
        return [s for v in body for s in strings(v)]
    return []


def public_numbers(body, count: Callable[[str], int] | None) -> set[int]:
    """The numbers a request makes public: those written in it, its strings' lengths in
    characters and (``count``) tokens, and the token count of a chat's messages' contents."""
    if body is None:
        return set()
    found = numbers(json.dumps(body, ensure_ascii=False)) | {len(s) for s in strings(body)}
    if count is not None:
        texts = strings(body)
        found |= {count(s) for s in texts} | {count("".join(texts))}
    return found


@dataclass
class OperationTally:
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # kind -> cases
    examples: list[dict] = field(default_factory=list)
    unnamed: Counter = field(default_factory=Counter)  # 400/422 messages naming no field -> cases
    messages: Counter = field(default_factory=Counter)  # (status, error message) -> cases
    released_text: int = 0  # responses whose DP release holds a shingle of a document
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"cases": self.cases, "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "failures": dict(self.failures), "examples": self.examples,
                "no_field_400": sum(self.unnamed.values()),
                "no_field_messages": dict(self.unnamed.most_common(10)),
                "messages": [{"status": k[0], "message": k[1], "cases": v} for k, v in self.messages.most_common(12)],
                "released_text": self.released_text, "seconds": round(self.seconds, 1)}


@dataclass
class Tally:
    operations: dict[str, OperationTally] = field(default_factory=dict)
    budget_reads: int = 0
    budget_failures: Counter = field(default_factory=Counter)
    request_texts: set[str] = field(default_factory=set)

    def add(self, operation: str, status: int, verdict: Verdict, seconds: float, curl: str) -> None:
        op = self.operations.setdefault(operation, OperationTally())
        op.cases += 1
        op.statuses[status] += 1
        op.seconds += seconds
        op.released_text += bool(verdict.released_text)
        if verdict.names_field is False:
            op.unnamed[verdict.message[:160]] += 1
        if verdict.message:
            op.messages[status, verdict.message[:160]] += 1
        for failure in verdict.failures:
            kind = failure.split(" '")[0].split(" in ")[0] if "private text" in failure else failure
            op.failures[kind] += 1
            if sum(1 for e in op.examples if e["kind"] == kind) < EXAMPLES_KEPT:
                op.examples.append({"kind": kind, "failure": failure, "status": status,
                                    "message": verdict.message[:300], "curl": curl[:1500]})

    def summary(self) -> dict:
        statuses, failures = Counter(), Counter()
        for op in self.operations.values():
            statuses.update(op.statuses)
            failures.update(op.failures)
        return {"cases": sum(op.cases for op in self.operations.values()),
                "statuses": {str(k): v for k, v in sorted(statuses.items())},
                "failures": sum(failures.values()) + sum(self.budget_failures.values()),
                "failure_kinds": dict(failures),
                "no_field_400": sum(sum(op.unnamed.values()) for op in self.operations.values()),
                "released_text": sum(op.released_text for op in self.operations.values()),
                "budget_reads": self.budget_reads, "budget_failures": dict(self.budget_failures)}


def operation_name(operation) -> str:
    return f"{operation.method.upper()} {operation.path}"


def split_cases(names: Iterable[str], cases: int) -> dict[str, int]:
    """Cases per operation: ``DP_WEIGHT`` for ``DP_OPERATIONS``, 1 for the others (at least 2)."""
    names = list(names)
    weights = {n: DP_WEIGHT if n in DP_OPERATIONS else 1 for n in names}
    total = sum(weights.values())
    return {n: max(2, round(cases * w / total)) for n, w in weights.items()}


class OutOfTime(BaseException):
    """The run's time is up (a BaseException: Hypothesis stops at once, no shrinking)."""


class Fuzzer:
    """Sends every case of a schema and judges it.

    ``send(case) -> (status, headers, text)`` sends one case (``http_sender`` or ``asgi_sender``);
    ``budget() -> statement | None`` reads ``/v1/dp/budget`` (None where it is not served);
    ``count``: the served tokenizer's token count (public numbers of a request); ``model``: the
    served model's name (shaped cases carry it); ``deadline``: a ``time.monotonic()`` after
    which no case starts, split over the operations (``run``), their counts as they are."""

    def __init__(self, schema, private: Private, send, budget, count: Callable[[str], int] | None = None,
                 model: str = "m", cap: int = GENERATION_CAP, seed: int = 0, deadline: float = float("inf"),
                 log: Callable[[str], None] = lambda _: None):
        self.schema, self.private, self.send, self.budget = schema, private, send, budget
        self.count, self.model, self.cap, self.seed, self.log = count, model, cap, seed, log
        self.deadline, self.slice_end = deadline, deadline
        self.cut: list[str] = []  # operations whose time slice ran out
        self.tally = Tally()

    def operations(self) -> list:
        found = []
        for result in self.schema.get_all_operations():
            try:
                found.append(result.ok())
            except Exception as exc:  # noqa: BLE001 - an operation schemathesis cannot read: reported
                self.log(f"fuzz: operation skipped: {exc}")
        return found

    def run(self, cases: int) -> Tally:
        """About ``cases`` cases over every operation (``split_cases``): operations whose input
        space is smaller (a GET without parameters) run fewer, their shortfall goes to the
        DP operations, run last. Before the ``deadline`` each operation gets a slice of the
        time left in proportion to its planned cases (a slow box cuts every operation alike)."""
        operations = sorted(self.operations(), key=lambda o: (operation_name(o) in DP_OPERATIONS,
                                                              operation_name(o) != f"GET {BUDGET}"))
        plan = split_cases(map(operation_name, operations), cases)
        left = cases
        for i, operation in enumerate(operations):
            name = operation_name(operation)
            # the DP operations, last, share what is left evenly
            share = plan[name] if name not in DP_OPERATIONS else max(2, round(left / (len(operations) - i)))
            planned = sum(plan[operation_name(o)] for o in operations[i:])
            now = time.monotonic()
            self.slice_end = min(self.deadline, now + (self.deadline - now) * plan[name] / planned)
            before = self.tally.operations.get(name, OperationTally()).cases
            try:
                self._run_operation(operation, share)
            except OutOfTime:
                self.cut.append(name)
            done = self.tally.operations.get(name, OperationTally()).cases - before
            left -= done
            self.log(f"fuzz: {name}: {done} cases{' (out of time)' if name in self.cut else ''}")
        return self.tally

    def _run_operation(self, operation, n: int) -> None:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed
        from hypothesis.errors import HypothesisException
        from schemathesis import GenerationMode

        strategies = {mode.value: operation.as_strategy(generation_mode=mode)
                      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)}
        if operation.path in SHAPED:
            strategies["shaped"] = SHAPED[operation.path](self.model).flatmap(lambda b: operation.as_strategy(body=b))
        for k, (kind, strategy) in enumerate(strategies.items()):
            count = n // len(strategies) + (k < n % len(strategies))

            @hypothesis_seed(self.seed + k)
            @settings(max_examples=max(count, 1), deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
            @given(strategy)
            def test(case):
                self.one(case)

            try:
                test()
            except HypothesisException as exc:  # no case of this kind (nothing to negate)
                self.log(f"fuzz: {operation_name(operation)} {kind}: {type(exc).__name__}")

    def one(self, case) -> None:
        """Send one case, judge its response and the budget statement after it."""
        if time.monotonic() > self.slice_end:
            raise OutOfTime
        name = operation_name(case.operation)
        bound_body(case.body, self.cap)
        body = case.body if isinstance(case.body, (dict, list, str)) else None
        self.tally.request_texts.update(strings(body))
        start = time.perf_counter()
        try:
            status, headers, text = self.send(case)
        except Exception as exc:  # noqa: BLE001 - no response at all (timeout, dropped connection, app error)
            status, headers, text = 0, {}, ""
            verdict = Verdict(failures=[f"no response: {type(exc).__name__}"])
        else:
            fields = request_fields(body) | _schema_fields(case.operation)
            verdict = check_response(self.private, status, headers, text,
                                     public_numbers(body, self.count), fields)
        self.tally.add(name, status, verdict, time.perf_counter() - start, _curl(case))
        statement = self.budget()
        if statement is not None:
            self.tally.budget_reads += 1
            for problem in budget_problems(self.private, statement):
                self.tally.budget_failures[problem] += 1


def _options():
    """``vllm_xargs``: the DP options, well and badly typed, and unknown ``dp_*`` names."""
    from hypothesis import strategies as st

    value = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=12),
                      st.sampled_from(["northwind", "default", "c", "laplace", "trlap_corrected", "paraphrase"]))
    names = st.sampled_from(["dp_context", "dp_epsilon", "dp_mechanism", "dp_session", "dp_typo", "prompt_logprobs",
                             "echo"])
    return st.dictionaries(names, value, max_size=3)


def _common(model: str):
    """The fields chat and completions share: lengths, sampling, streaming, refused fields, options."""
    from hypothesis import strategies as st

    small = st.one_of(st.none(), st.integers(-2, 40), st.booleans(), st.floats(-1, 3), st.text(max_size=4))
    return st.fixed_dictionaries({"model": st.sampled_from([model, model, "other-model"])}, optional={
        "max_tokens": small, "max_completion_tokens": small, "temperature": small, "top_p": small, "seed": small,
        "n": small, "logprobs": small, "top_logprobs": small, "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}), "stop": st.one_of(st.none(), st.text(max_size=4)),
        "echo": st.booleans(), "prompt_logprobs": small, "cache_salt": st.one_of(st.none(), st.text(max_size=8)),
        "vllm_xargs": _options()})


def _text():
    from hypothesis import strategies as st

    words = st.sampled_from(["When", "does", "the", "warehouse", "close", "Seattle", "refund", "manager", "code",
                             "alarm", "?", "dairy", "price", "October", "Who", "approves", "\n", "<|im_start|>"])
    return st.one_of(st.lists(words, max_size=24).map(" ".join), st.text(max_size=40))


def _chat(model: str):
    from hypothesis import strategies as st

    content = st.one_of(_text(), st.none(), st.integers(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "x"]), "text": _text()}), max_size=2))
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "system", "assistant", "tool", "x"]),
                                     "content": content})
    messages = st.one_of(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=0), st.text(max_size=5))
    return st.tuples(_common(model), messages).map(lambda t: {**t[0], "messages": t[1]})


def _completion(model: str):
    from hypothesis import strategies as st

    prompt = st.one_of(_text(), st.lists(st.integers(-5, 60000), max_size=30), st.lists(_text(), max_size=2),
                       st.lists(st.lists(st.integers(0, 1000), max_size=4), max_size=2), st.none())
    return st.tuples(_common(model), prompt).map(lambda t: {**t[0], "prompt": t[1]})


# Bodies shaped like a client's chat and completion requests (valid often enough to reach the
# DP paths: aggregation's members, the renderer, the budget), the third kind of case beside
# schemathesis' positive and negative ones on these routes.
SHAPED = {"/v1/chat/completions": _chat, "/v1/completions": _completion}


def _schema_fields(operation) -> set[str]:
    """Every property name in an operation's request body schema (nested and bundled ones too)."""
    names: set[str] = set()
    stack = [body.definition for body in operation.body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                names |= set(node["properties"])
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return names


def _curl(case) -> str:
    try:
        return case.as_curl_command()
    except Exception:  # noqa: BLE001
        return ""


def http_sender(base_url: str, timeout: float):
    """``send`` over HTTP to ``base_url`` (one session; ``timeout`` seconds a request)."""
    import requests

    session = requests.Session()

    def send(case) -> tuple[int, dict, str]:
        response = case.call(base_url=base_url, session=session, timeout=timeout)
        return response.status_code, _headers(response.headers), response.content.decode("utf-8", "replace")

    return send


def asgi_sender():
    """``send`` in-process to the schema's ASGI app."""

    def send(case) -> tuple[int, dict, str]:
        response = case.call()
        return response.status_code, _headers(response.headers), response.content.decode("utf-8", "replace")

    return send


def _headers(headers) -> dict[str, str]:
    return {k.lower(): ", ".join(v) if isinstance(v, list) else str(v) for k, v in dict(headers).items()}
