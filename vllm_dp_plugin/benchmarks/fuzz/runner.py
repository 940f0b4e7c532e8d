"""Schemathesis over a served API: every operation of its ``/openapi.json`` gets cases from
schemathesis' Hypothesis strategies (half that fit the schema, half that do not; the DP routes
also client-shaped ones and ``dp`` ones: a schemathesis body under a client's conversation with
the mode's DP options), the chat route ``CHAT_SHARE`` of all cases; each case is sent (over
HTTP, or in-process to an ASGI app) with its generation bounded (``bound_body``), and its
response judged by ``checks.check_response``; ``/v1/dp/budget`` is read after every case and
judged by ``checks.budget_problems``. Nothing stops at a failure: every case is counted
(``Tally``), per operation, kind of case, status and failure."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vllm_dp_plugin.benchmarks.fuzz.checks import (
    DP_FIELDS,
    DP_HEADER_PREFIX,
    Private,
    Verdict,
    budget_problems,
    check_response,
    numbers,
    request_fields,
)

BUDGET = "/v1/dp/budget"
CHAT = "POST /v1/chat/completions"
# The chat route gets this share of a run's cases (the route every DP mode answers with its DP
# path; at the weights alone it got 3-5% of them: its cases are the slow ones, and a time limit
# cut it first). The other routes a DP mode answers itself (completions) and its statement split
# the rest at this weight; every other operation weight 1.
CHAT_SHARE = 0.5
DP_WEIGHT = 24
DP_OPERATIONS = (f"GET {BUDGET}", CHAT, "POST /v1/completions")  # in their order in a run
# The kinds of case a DP route gets, and their weights in its split: schemathesis' positive and
# negative cases, client-shaped bodies (``SHAPED``) and ``dp``: a schemathesis positive body
# with a client's core laid over it (a valid-ish conversation or prompt, the DP options of the
# served mode, streaming), the kind that reaches the DP path most often. Other operations get
# the first two, evenly.
KIND_WEIGHTS = {"positive": 1, "negative": 1, "shaped": 1, "dp": 2}
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
    kinds: Counter = field(default_factory=Counter)  # (kind of case, status) -> cases
    receipts: int = 0  # responses carrying a DP receipt (dp_receipt, dp_prompt_receipts, x-dp-* header)

    def to_json(self) -> dict:
        kinds: dict[str, dict[str, int]] = {}
        for (kind, status), n in sorted(self.kinds.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            kinds.setdefault(kind, {})[str(status)] = n
        return {"cases": self.cases, "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "kinds": kinds, "receipts": self.receipts,
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

    def add(self, operation: str, status: int, verdict: Verdict, seconds: float, curl: str, kind: str = "",
            receipt: bool = False) -> None:
        op = self.operations.setdefault(operation, OperationTally())
        op.cases += 1
        op.statuses[status] += 1
        op.kinds[kind, status] += 1
        op.receipts += receipt
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
        cases = sum(op.cases for op in self.operations.values())
        chat = self.operations.get(CHAT, OperationTally()).cases
        return {"cases": cases, "chat_cases": chat, "chat_share": chat / cases if cases else None,
                "receipts": sum(op.receipts for op in self.operations.values()),
                "statuses": {str(k): v for k, v in sorted(statuses.items())},
                "failures": sum(failures.values()) + sum(self.budget_failures.values()),
                "failure_kinds": dict(failures),
                "no_field_400": sum(sum(op.unnamed.values()) for op in self.operations.values()),
                "released_text": sum(op.released_text for op in self.operations.values()),
                "budget_reads": self.budget_reads, "budget_failures": dict(self.budget_failures)}


def operation_name(operation) -> str:
    return f"{operation.method.upper()} {operation.path}"


def split_cases(names: Iterable[str], cases: int, chat_share: float = CHAT_SHARE) -> dict[str, int]:
    """Cases per operation: ``chat_share`` of them for ``CHAT`` (where served), the rest split
    at ``DP_WEIGHT`` for the other ``DP_OPERATIONS`` and 1 for the others (at least 2 each)."""
    names = list(names)
    if not 0.0 <= chat_share < 1.0:
        raise ValueError(f"chat_share must lie in [0, 1), got {chat_share!r}")
    chat = math.ceil(cases * chat_share) if CHAT in names else 0
    weights = {n: DP_WEIGHT if n in DP_OPERATIONS else 1 for n in names if n != CHAT}
    total = sum(weights.values())
    plan = {n: max(2, round((cases - chat) * w / total)) for n, w in weights.items()}
    return {**plan, CHAT: max(2, chat)} if CHAT in names else plan


def run_order(name: str) -> tuple[bool, int]:
    """An operation's place in a run: the others first (their shortfall goes to the DP
    operations), then ``DP_OPERATIONS`` in order: the statement, the chat route (first to the
    budget in DP aggregation), the completions route."""
    return name in DP_OPERATIONS, DP_OPERATIONS.index(name) if name in DP_OPERATIONS else 0


class OutOfTime(BaseException):
    """The run's time is up (a BaseException: Hypothesis stops at once, no shrinking)."""


class Fuzzer:
    """Sends every case of a schema and judges it.

    ``send(case) -> (status, headers, text)`` sends one case (``http_sender`` or ``asgi_sender``);
    ``budget() -> statement | None`` reads ``/v1/dp/budget`` (None where it is not served);
    ``count``: the served tokenizer's token count (public numbers of a request); ``model``: the
    served model's name (shaped cases carry it); ``deadline``: a ``time.monotonic()`` after
    which no case starts, split over the operations (``run``), their counts as they are;
    ``chat_share``: the share of the cases the chat route gets (``split_cases``); ``options``:
    the served mode's ``vllm_xargs`` DP options and values a client would send (``dp`` cases)."""

    def __init__(self, schema, private: Private, send, budget, count: Callable[[str], int] | None = None,
                 model: str = "m", cap: int = GENERATION_CAP, seed: int = 0, deadline: float = float("inf"),
                 log: Callable[[str], None] = lambda _: None, chat_share: float = CHAT_SHARE,
                 options: Mapping[str, Sequence] | None = None):
        self.schema, self.private, self.send, self.budget = schema, private, send, budget
        self.count, self.model, self.cap, self.seed, self.log = count, model, cap, seed, log
        self.chat_share = chat_share
        self.options = dict(DEFAULT_OPTIONS if options is None else options)
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
        DP operations, run last (``run_order``), which share what is left in proportion to
        their plan (so the chat route gets at least its share). Before the ``deadline`` each
        operation gets a slice of the time left in proportion to its planned cases."""
        operations = sorted(self.operations(), key=lambda o: run_order(operation_name(o)))
        plan = split_cases(map(operation_name, operations), cases, self.chat_share)
        left = cases
        for i, operation in enumerate(operations):
            name = operation_name(operation)
            planned = sum(plan[operation_name(o)] for o in operations[i:])
            share = plan[name] if name not in DP_OPERATIONS else max(2, round(left * plan[name] / planned))
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
        from schemathesis import GenerationMode

        strategies = {mode.value: operation.as_strategy(generation_mode=mode)
                      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)}
        if operation.path in SHAPED:
            strategies["shaped"] = SHAPED[operation.path](self.model).flatmap(lambda b: operation.as_strategy(body=b))
            strategies["dp"] = dp_cases(strategies["positive"], DP_CORES[operation.path](self.model, self.options))
        counts = kind_counts(list(strategies), n)
        for k, (kind, strategy) in enumerate(strategies.items()):
            self._run_kind(operation, kind, strategy, counts[kind], self.seed + k)

    def _run_kind(self, operation, kind: str, strategy, count: int, seed: int) -> None:
        """``count`` cases of one ``kind`` drawn from ``strategy`` (Hypothesis seeded with ``seed``)."""
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed
        from hypothesis.errors import HypothesisException

        @hypothesis_seed(seed)
        @settings(max_examples=max(count, 1), deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
        @given(strategy)
        def test(case):
            self.one(case, kind)

        try:
            test()
        except HypothesisException as exc:  # no case of this kind (nothing to negate)
            self.log(f"fuzz: {operation_name(operation)} {kind}: {type(exc).__name__}")

    def one(self, case, kind: str = "") -> None:
        """Send one case (of ``kind``), judge its response and the budget statement after it."""
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
        self.tally.add(name, status, verdict, time.perf_counter() - start, _curl(case), kind,
                       has_receipt(headers, text))
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

# The DP options a client sends when the served mode does not say (``Fuzzer(options=...)``;
# ``modes.Mode.options`` states each mode's).
DEFAULT_OPTIONS = {"dp_context": ("c", "default"), "dp_epsilon": (0.5, 1.0, 4.0)}
# Values of the DP options no mode accepts (wrong types, out of range, unknown names): a tenth
# of the options a ``dp`` case sends.
BAD_OPTION_VALUES = (None, -1, 0, 1e9, "", "x", True, [1])
KEPT_FIELDS = 2  # at most this many fields of a schemathesis positive body stay in a ``dp`` case
SESSION_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"


def kind_counts(kinds: Sequence[str], n: int) -> dict[str, int]:
    """``n`` cases split over ``kinds`` at ``KIND_WEIGHTS`` (1 for a kind not there), the
    remainder to the first ones."""
    weights = [KIND_WEIGHTS.get(k, 1) for k in kinds]
    total = sum(weights)
    counts = [n * w // total for w in weights]
    for i in range(n - sum(counts)):
        counts[i % len(counts)] += 1
    return dict(zip(kinds, counts, strict=True))


def _dp_options(options: Mapping[str, Sequence]):
    """``vllm_xargs`` as a client of the served mode sends it: each DP option present or not,
    nine in ten of its values from the mode's accepted ones, the rest ``BAD_OPTION_VALUES``;
    now and then an option no mode knows (``dp_typo``)."""
    from hypothesis import strategies as st

    def value(accepted: Sequence):
        return st.integers(0, 9).flatmap(lambda i: st.sampled_from(list(accepted) if i else BAD_OPTION_VALUES))

    names = {name: value(accepted) for name, accepted in options.items() if accepted}
    if "dp_session" in options:  # a history cache secret: 22 to 256 characters
        names["dp_session"] = st.one_of(st.text(SESSION_ALPHABET, min_size=22, max_size=32),
                                        st.text(SESSION_ALPHABET, max_size=4))
    rare = st.integers(0, 19).flatmap(lambda i: st.just({}) if i else st.just({"dp_typo": 1}))
    return st.tuples(st.fixed_dictionaries({}, optional=names), rare).map(lambda t: {**t[0], **t[1]})


def _words(min_size: int = 1):
    from hypothesis import strategies as st

    words = st.sampled_from(["When", "is", "the", "Seattle", "warehouse", "closed", "for", "inventory", "?", "What",
                             "dairy", "price", "increase", "Who", "approves", "refunds", "alarm", "code", "Q3",
                             "changes", "in", "our", "company", "meeting", "on", "Friday", "depot", "manager"])
    return st.lists(words, min_size=min_size, max_size=16).map(" ".join)


def _dp_core(model: str, options: Mapping[str, Sequence], prompt):
    """What a client of a DP mode sends: the served model (now and then another), ``prompt``
    (the route's own field: messages or a prompt), a short generation, streaming or not,
    sampling, the mode's DP options in ``vllm_xargs`` (nine in ten)."""
    from hypothesis import strategies as st

    return st.tuples(st.fixed_dictionaries(
        {"model": st.integers(0, 19).map(lambda i: model if i else "other-model"),
         "max_tokens": st.integers(1, GENERATION_CAP), "stream": st.booleans()},
        optional={"temperature": st.floats(0.0, 1.5), "seed": st.integers(0, 2**31 - 1),
                  "stream_options": st.just({"include_usage": True})}),
        prompt, st.integers(0, 9).flatmap(lambda i: _dp_options(options) if i else st.just(None))).map(
        lambda t: {**t[0], **t[1], **({} if t[2] is None else {"vllm_xargs": t[2]})})


def _dp_chat(model: str, options: Mapping[str, Sequence]):
    """A ``dp`` chat core: up to two earlier turns (system, user or assistant), then the user's
    question."""
    from hypothesis import strategies as st

    turn = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _words()})
    messages = st.tuples(st.lists(turn, max_size=2), _words()).map(
        lambda t: {"messages": [*t[0], {"role": "user", "content": t[1]}]})
    return _dp_core(model, options, messages)


def _dp_completion(model: str, options: Mapping[str, Sequence]):
    return _dp_core(model, options, _words().map(lambda p: {"prompt": p}))


DP_CORES = {"/v1/chat/completions": _dp_chat, "/v1/completions": _dp_completion}


def dp_cases(positive, core):
    """``dp`` cases: each a schemathesis positive case of the route whose body keeps at most
    ``KEPT_FIELDS`` of its fields (drawn) under a client's ``core`` (``DP_CORES``)."""
    from hypothesis import strategies as st

    def overlay(case):
        body = case.body if isinstance(case.body, dict) else {}
        keys = sorted(body, key=str)
        kept = st.lists(st.sampled_from(keys), max_size=KEPT_FIELDS, unique=True) if keys else st.just([])

        def build(drawn):
            chosen, client = drawn
            case.body = {**{k: body[k] for k in chosen}, **client}
            return case

        return st.tuples(kept, core).map(build)

    return positive.flatmap(overlay)


def has_receipt(headers: Mapping[str, str], text: str) -> bool:
    """Whether a response carries a DP receipt (``DP_FIELDS`` in its body or an ``x-dp-*`` header)."""
    return any(k.startswith(DP_HEADER_PREFIX) for k in headers) or any(f'"{f}"' in text for f in DP_FIELDS)


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
