"""The fuzzer (``Fuzzer``): cases of every operation of a served API by kind (``kinds``: schemathesis'
``positive`` and ``negative`` ones; on the DP routes also client-``shaped`` ones and ``dp`` ones), each
sent with its generation bounded, judged (``checks``), counted (``Tally``). Hypothesis and schemathesis
being development dependencies, only a run imports it."""

from __future__ import annotations

import functools
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from schemathesis import GenerationMode

from vllm_dp_plugin.benchmarks.fuzz import checks
from vllm_dp_plugin.benchmarks.fuzz.checks import CHAT, CHAT_SHARE, GENERATION_CAP

DP_WEIGHT = 24  # of the other DP operations in what the chat route leaves; every other operation's: 1
DP_OPERATIONS = ("GET /v1/dp/budget", CHAT, "POST /v1/completions")  # in their order in a run
CAPPED_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens")
SAMPLES_CAP = 2  # n, best_of
EXAMPLES_KEPT = 5  # failing cases kept per operation and kind (with a curl command)
KIND_WEIGHTS = {"positive": 1, "negative": 1, "shaped": 1, "dp": 2}  # of a DP route's cases; others: 1:1
BAD_OPTION_VALUES = (None, -1, 0, 1e9, "", "x", True, [1])  # no mode accepts them: a tenth of a dp case's
KEPT_FIELDS = 2  # at most this many fields of a schemathesis positive body stay in a ``dp`` case
SESSION_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"

# shaped bodies: the optional fields both routes share (refused ones, ``vllm_xargs`` well and badly typed), text
_SMALL = st.one_of(st.none(), st.integers(-2, 40), st.booleans(), st.floats(-1, 3), st.text(max_size=4))
_XARGS = st.dictionaries(
    st.sampled_from(["dp_context", "dp_epsilon", "dp_mechanism", "dp_session", "dp_typo", "prompt_logprobs", "echo"]),
    st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=12),
              st.sampled_from(["northwind", "default", "c", "laplace", "trlap_corrected", "paraphrase"])), max_size=3)
_COMMON = {**dict.fromkeys(("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "logprobs",
                            "top_logprobs"), _SMALL),
           "stream": st.booleans(), "stream_options": st.just({"include_usage": True}),
           "stop": st.one_of(st.none(), st.text(max_size=4)), "echo": st.booleans(), "prompt_logprobs": _SMALL,
           "cache_salt": st.one_of(st.none(), st.text(max_size=8)), "vllm_xargs": _XARGS}
_TEXT = st.one_of(st.lists(st.sampled_from(["When", "does", "the", "warehouse", "close", "Seattle", "refund", "manager",
                                            "code", "alarm", "?", "dairy", "price", "October", "Who", "approves", "\n",
                                            "<|im_start|>"]), max_size=24).map(" ".join), st.text(max_size=40))
_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "user", "system", "assistant", "tool", "x"]),
    "content": st.one_of(_TEXT, st.none(), st.integers(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "x"]), "text": _TEXT}), max_size=2))})
SHAPED = {  # route -> (its own field, that field's values)
    "/v1/chat/completions": ("messages", st.one_of(st.lists(_MESSAGE, min_size=1, max_size=3),
                                                   st.lists(_MESSAGE, max_size=0), st.text(max_size=5))),
    "/v1/completions": ("prompt", st.one_of(_TEXT, st.lists(st.integers(-5, 60000), max_size=30),
                                            st.lists(_TEXT, max_size=2),
                                            st.lists(st.lists(st.integers(0, 1000), max_size=4), max_size=2),
                                            st.none()))}

# dp bodies: a client's words, its conversation (up to two earlier turns, then the user's question) or prompt
_WORDS = st.lists(st.sampled_from(["When", "is", "the", "Seattle", "warehouse", "closed", "for", "inventory", "?",
                                   "What", "dairy", "price", "increase", "Who", "approves", "refunds", "alarm", "code",
                                   "Q3", "changes", "in", "our", "company", "meeting", "on", "Friday", "depot",
                                   "manager"]), min_size=1, max_size=16).map(" ".join)
_TURN = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _WORDS})
DP_PROMPTS = {
    "/v1/chat/completions": st.tuples(st.lists(_TURN, max_size=2), _WORDS).map(
        lambda t: {"messages": [*t[0], {"role": "user", "content": t[1]}]}),
    "/v1/completions": _WORDS.map(lambda p: {"prompt": p})}


def bound_body(body) -> None:
    """Bound a request's work in place: ``CAPPED_FIELDS`` and ``max_tokens`` where none is set (vLLM's
    default: all of ``max_model_len``) at ``GENERATION_CAP``, ``n``, ``best_of`` at ``SAMPLES_CAP``."""
    if not isinstance(body, dict):
        return
    for name in (*CAPPED_FIELDS, "n", "best_of"):
        most = GENERATION_CAP if name in CAPPED_FIELDS else SAMPLES_CAP
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > most:
            body[name] = most
    if not any(name in body for name in CAPPED_FIELDS):
        body["max_tokens"] = GENERATION_CAP


@dataclass
class OperationTally:
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # failure (its kind, for private text) -> cases
    examples: list[dict] = field(default_factory=list)
    unnamed: Counter = field(default_factory=Counter)  # 400/422 messages naming no field -> cases
    messages: Counter = field(default_factory=Counter)  # (status, error message) -> cases
    released_text: int = 0  # responses whose DP release holds a shingle of a document
    seconds: float = 0.0
    kinds: dict = field(default_factory=lambda: defaultdict(Counter))  # kind of case -> status -> cases
    receipts: int = 0  # responses carrying a DP receipt (dp_receipt, dp_prompt_receipts, x-dp-* header)

    def to_json(self) -> dict:
        return {"cases": self.cases, "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "kinds": {k: {str(s): n for s, n in sorted(c.items())} for k, c in sorted(self.kinds.items())},
                "receipts": self.receipts, "failures": dict(self.failures), "examples": self.examples,
                "no_field_400": sum(self.unnamed.values()), "no_field_messages": dict(self.unnamed.most_common(10)),
                "messages": [{"status": k[0], "message": k[1], "cases": v} for k, v in self.messages.most_common(12)],
                "released_text": self.released_text, "seconds": round(self.seconds, 1)}


@dataclass
class Tally:
    operations: dict[str, OperationTally] = field(default_factory=dict)
    budget_reads: int = 0
    budget_failures: Counter = field(default_factory=Counter)
    request_texts: set[str] = field(default_factory=set)

    def add(self, operation: str, kind: str, status: int, verdict: checks.Verdict, seconds: float, curl: str,
            receipt: bool) -> None:
        op = self.operations.setdefault(operation, OperationTally())
        op.cases += 1
        op.statuses[status] += 1
        op.kinds[kind][status] += 1
        op.receipts += receipt
        op.seconds += seconds
        op.released_text += bool(verdict.released_text)
        if verdict.names_field is False:
            op.unnamed[verdict.message[:160]] += 1
        if verdict.message:
            op.messages[status, verdict.message[:160]] += 1
        for failure in verdict.failures:
            label = failure.split(" '")[0].split(" in ")[0] if "private text" in failure else failure
            op.failures[label] += 1
            if op.failures[label] <= EXAMPLES_KEPT:
                op.examples.append({"kind": label, "failure": failure, "status": status,
                                    "message": verdict.message[:300], "curl": curl[:1500]})

    def summary(self) -> dict:
        ops = self.operations.values()
        statuses, failures = sum((op.statuses for op in ops), Counter()), sum((op.failures for op in ops), Counter())
        cases, chat = sum(op.cases for op in ops), self.operations.get(CHAT, OperationTally()).cases
        return {"cases": cases, "chat_cases": chat, "chat_share": chat / cases if cases else None,
                "receipts": sum(op.receipts for op in ops),
                "statuses": {str(k): v for k, v in sorted(statuses.items())},
                "failures": sum(failures.values()) + sum(self.budget_failures.values()),
                "failure_kinds": dict(failures), "no_field_400": sum(sum(op.unnamed.values()) for op in ops),
                "released_text": sum(op.released_text for op in ops),
                "budget_reads": self.budget_reads, "budget_failures": dict(self.budget_failures)}


def operation_name(operation) -> str:
    return f"{operation.method.upper()} {operation.path}"


def split_cases(names: Sequence[str], cases: int, chat_share: float = CHAT_SHARE) -> dict[str, int]:
    """Cases per operation: ``chat_share`` for ``CHAT``, the rest at ``DP_WEIGHT`` for the other DP ones, else 1."""
    if not 0.0 <= chat_share < 1.0:
        raise ValueError(f"chat_share must lie in [0, 1), got {chat_share!r}")
    chat = math.ceil(cases * chat_share) if CHAT in names else 0
    weights = {n: DP_WEIGHT if n in DP_OPERATIONS else 1 for n in names if n != CHAT}
    plan = {n: max(2, round((cases - chat) * w / sum(weights.values()))) for n, w in weights.items()}
    return {**plan, CHAT: max(2, chat)} if CHAT in names else plan


def run_order(name: str) -> tuple[bool, int]:
    """An operation's place in a run: the others, then ``DP_OPERATIONS`` (which share their shortfall)."""
    return name in DP_OPERATIONS, DP_OPERATIONS.index(name) if name in DP_OPERATIONS else 0


class OutOfTime(BaseException):
    """The run's time is up (a BaseException: Hypothesis stops at once, no shrinking)."""


def kind_counts(kinds: Sequence[str], n: int) -> dict[str, int]:
    """``n`` cases split over ``kinds`` at ``KIND_WEIGHTS`` (1 for others), the remainder to the first ones."""
    weights = [KIND_WEIGHTS.get(k, 1) for k in kinds]
    counts = [n * w // sum(weights) for w in weights]
    return {k: c + (i < n - sum(counts)) for i, (k, c) in enumerate(zip(kinds, counts, strict=True))}


def kinds(operation, model: str, options: Mapping[str, Sequence]) -> dict:
    """``operation``'s strategies by kind of case (``options``: the served mode's, ``dp_options``)."""
    strategies = {mode.value: operation.as_strategy(generation_mode=mode)
                  for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)}
    if operation.path in SHAPED:
        key, values = SHAPED[operation.path]
        common = st.fixed_dictionaries({"model": st.sampled_from([model, model, "other-model"])}, optional=_COMMON)
        body = st.tuples(common, values).map(lambda t: {**t[0], key: t[1]})
        strategies["shaped"] = body.flatmap(lambda b: operation.as_strategy(body=b))
        strategies["dp"] = dp_cases(strategies["positive"], dp_core(model, options, DP_PROMPTS[operation.path]))
    return strategies


def draw(strategy, n: int, seed: int, each: Callable) -> str | None:
    """``each(case)`` for ``n`` (at least 1) seeded cases of ``strategy``; the error's name if there are none."""

    @hypothesis_seed(seed)
    @settings(max_examples=max(n, 1), deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(strategy)
    def test(case):
        each(case)

    try:
        test()
    except HypothesisException as exc:
        return type(exc).__name__
    return None


def dp_options(options: Mapping[str, Sequence]):
    """``vllm_xargs`` as a client of the served mode sends it: each DP option present or not, nine
    in ten of its values accepted ones, the rest ``BAD_OPTION_VALUES``; now and then ``dp_typo``."""

    def value(accepted: Sequence):
        return st.integers(0, 9).flatmap(lambda i: st.sampled_from(list(accepted) if i else BAD_OPTION_VALUES))

    names = {name: value(accepted) for name, accepted in options.items() if accepted}
    if "dp_session" in options:  # a history cache secret: 22 to 256 characters
        names["dp_session"] = st.one_of(st.text(SESSION_ALPHABET, min_size=22, max_size=32),
                                        st.text(SESSION_ALPHABET, max_size=4))
    rare = st.integers(0, 19).flatmap(lambda i: st.just({}) if i else st.just({"dp_typo": 1}))
    return st.tuples(st.fixed_dictionaries({}, optional=names), rare).map(lambda t: {**t[0], **t[1]})


def dp_core(model: str, options: Mapping[str, Sequence], prompt):
    """A DP client's body: the served model (one in 20: another), ``prompt``, a short generation, ``dp_options``."""
    return st.tuples(st.fixed_dictionaries(
        {"model": st.integers(0, 19).map(lambda i: model if i else "other-model"),
         "max_tokens": st.integers(1, GENERATION_CAP), "stream": st.booleans()},
        optional={"temperature": st.floats(0.0, 1.5), "seed": st.integers(0, 2**31 - 1),
                  "stream_options": st.just({"include_usage": True})}),
        prompt, st.integers(0, 9).flatmap(lambda i: dp_options(options) if i else st.just(None))).map(
        lambda t: {**t[0], **t[1], **({} if t[2] is None else {"vllm_xargs": t[2]})})


def dp_cases(positive, core):
    """``dp`` cases: schemathesis positive ones keeping ``KEPT_FIELDS`` of their fields under a client's ``core``."""

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


class Fuzzer:
    """Sends every case of a ``schema`` by ``case.call(**call)`` (no ``call``: to its ASGI app) and judges it,
    reads ``budget()`` after it (OSError: not served), starts none after ``minutes``; ``options``: ``dp_options``."""

    def __init__(self, schema, private: checks.Private, call: Mapping, budget, count: Callable[[str], int] | None,
                 options: Mapping[str, Sequence], model: str = "m", seed: int = 0, minutes: float | None = None,
                 log: Callable[[str], None] = lambda _: None, chat_share: float = CHAT_SHARE):
        self.schema, self.private, self.call, self.budget, self.count = schema, private, call, budget, count
        self.options, self.model, self.seed, self.log, self.chat_share = options, model, seed, log, chat_share
        self.deadline = self.slice_end = time.monotonic() + (float("inf") if minutes is None else 60 * minutes)
        self.cut, self.tally = [], Tally()  # cut: the operations whose time slice ran out

    def run(self, cases: int) -> Tally:
        """About ``cases`` cases (``split_cases``, ``run_order``), each operation given its share of the time left."""
        operations = []
        for result in self.schema.get_all_operations():
            try:
                operations.append(result.ok())
            except Exception as exc:  # noqa: BLE001 - an operation schemathesis cannot read: reported
                self.log(f"fuzz: operation skipped: {exc}")
        operations.sort(key=lambda o: run_order(operation_name(o)))
        plan, left = split_cases([operation_name(o) for o in operations], cases, self.chat_share), cases
        for i, operation in enumerate(operations):
            name = operation_name(operation)
            planned = sum(plan[operation_name(o)] for o in operations[i:])
            share = plan[name] if name not in DP_OPERATIONS else max(2, round(left * plan[name] / planned))
            now = time.monotonic()
            self.slice_end = min(self.deadline, now + (self.deadline - now) * plan[name] / planned)
            strategies = kinds(operation, self.model, self.options)
            counts = kind_counts(list(strategies), share)
            try:
                for k, (kind, strategy) in enumerate(strategies.items()):
                    if stopped := draw(strategy, counts[kind], self.seed + k, functools.partial(self.one, kind=kind)):
                        self.log(f"fuzz: {name} {kind}: {stopped}")
            except OutOfTime:
                self.cut.append(name)
            done = self.tally.operations.get(name, OperationTally()).cases  # an operation's name is unique
            left -= done
            self.log(f"fuzz: {name}: {done} cases{' (out of time)' if name in self.cut else ''}")
        return self.tally

    def one(self, case, kind: str) -> None:
        """Send one case (of ``kind``), judge its response and the budget statement after it."""
        if time.monotonic() > self.slice_end:
            raise OutOfTime
        bound_body(case.body)
        body = case.body if isinstance(case.body, (dict, list, str)) else None
        self.tally.request_texts.update(checks.strings(body))
        start = time.perf_counter()
        try:
            response = case.call(**self.call)
        except Exception as exc:  # noqa: BLE001 - no response at all (timeout, dropped connection, app error)
            status, headers, text = 0, {}, ""
            verdict = checks.Verdict(failures=[f"no response: {type(exc).__name__}"])
        else:
            status, text = response.status_code, response.content.decode("utf-8", "replace")
            headers = {k.lower(): ", ".join(v) if isinstance(v, list) else str(v)
                       for k, v in dict(response.headers).items()}
            properties = {name for node in checks.nodes([b.definition for b in case.operation.body])
                          if isinstance(node, dict) and isinstance(node.get("properties"), dict)
                          for name in node["properties"]}  # of the request body's schema, nested ones too
            verdict = checks.check_response(self.private, status, headers, text, body, self.count, properties)
        seconds = time.perf_counter() - start
        try:
            curl = case.as_curl_command()
        except Exception:  # noqa: BLE001 - a body curl cannot carry
            curl = ""
        self.tally.add(operation_name(case.operation), kind, status, verdict, seconds, curl,
                       checks.has_receipt(headers, text))
        try:
            statement = self.budget()
        except OSError:  # not served
            return
        self.tally.budget_reads += 1
        self.tally.budget_failures.update(checks.budget_problems(self.private, statement))
