"""DP aggregation at the output, served by vLLM (``dp_privacy.aggregate``).

The API server answers ``/v1/chat/completions`` and ``/v1/completions`` itself for the document
collections: each request is ``k`` member sequences (member i: its documents as the system turn,
then the conversation) and one public sequence (the conversation alone), decoded in lockstep as
one-token sub-requests to the engine (the pattern of vLLM's own beam search): each step asks the
engine for every sequence's next-token log-probabilities at once (the public sequence's whole
distribution for ``vote``; the members' greedy tokens) (one batch; the prefix
cache keeps each member's documents prefilled across steps and requests), then
``aggregate.Aggregator`` chooses the token. Why not an in-engine logits processor: vLLM's v1
logits processors see one batch row per request and no guarantee that all ``k + 1`` rows of a
query are in the same step (chunked prefill and preemption split them), so lockstep would need
scheduler changes; the sub-request loop gets lockstep from ``asyncio.gather``.

What leaves: the chosen tokens (text), how many steps spent budget and the receipt; usage counts
the public prompt and the output only. The documents, the members' distributions and prompts,
and the members' token counts never reach a response or a log: a member's length is checked
against a public bound (``max_member_tokens``) at start-up, a request against that bound before
anything is reserved, and an engine error inside a query becomes one fixed, text-free error
(``QUERY_FAILED``) and one fixed log line. The engine's prefix cache cannot be probed: member
sub-requests carry a secret per-deployment ``cache_salt`` (keyed), the public sequence and any
empty member (whose prompt is the client's conversation alone) a fresh random one per query, so no
client-chosen sequence shares a cached block with a member that holds documents.
Under ``mechanism: answer`` (``_AnswerQuery``) every member decodes exactly ``answer_tokens``
tokens in one batch (EOS ignored: no member's answer length shows in the reply's time), one
partition selection releases the agreed answer phrase, and the reply states it and stops, or says
that the documents gave no answer it can share (then, with ``on_empty: public``, the public
model's answer to the conversation alone, marked as general knowledge). With ``answer_member:
extract`` no member decodes: each reads its own documents by rule (``extract_key``, every clause
read, off the event loop), so the reply's time depends on the collection's size, not on which
document answers.
Budget: a query reserves its worst case in the persistent ledger before any member is computed
(HTTP 429 with the remaining budget when it does not fit) and settles what it spent when it ends
(the worst case if it fails).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from fastapi.responses import JSONResponse, StreamingResponse

from ..aggregate.answer import answer_key, can_answer, extract_key, focus
from ..aggregate.decode import Aggregator, TopLogprobs, generate
from ..aggregate.documents import load_collection, member_texts
from ..aggregate.reply import FROM_DOCUMENTS, GENERAL_KNOWLEDGE, NOT_FROM_DOCUMENTS
from ..config import AggregateClient, AggregatePrivacyConfig, ConfigError
from ..plan import aggregation_params
from ..privacy.accountant import Budget
from ..privacy.aggregation import ANSWER, UNIT
from ..privacy.answer_releases import AnswerReleases, ReleasedAnswer
from ..privacy.document_ledger import DocumentLedger
from ..privacy.keyed_noise import ForeignEntries, NoiseKey
from ..privacy.ledger_migration import open_ledger
from ..privacy.ledger_store import LedgerStore, LedgerUnavailable
from ..privacy.query_ledger import BudgetExhausted, QueryLedger
from ..reports import aggregate_statuses, aggregate_view
from .echo import printable

logger = logging.getLogger("vllm.dp_privacy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
# the one error (and log line) of a query that fails after its reservation: an engine error's text
# (a prompt length, a traceback) may depend on the members' documents
QUERY_FAILED = "the DP aggregation query failed; its reserved budget is spent"
LEDGER_DOWN = ("the budget ledger cannot be written (see the server's log): nothing is answered until it can; "
               "a query already reserved counts in full")
# mechanism answer: a member's system turn (public text around its documents)
ANSWER_SYSTEM = "Document: {documents}\n\n{instruction}"
OPTION_EPSILON = "dp_epsilon"
OPTIONS = ("dp_context", OPTION_EPSILON)
RECEIPT_HEADER = "x-dp-receipt"
PER_DOCUMENT_CHARGE = ("epsilon and delta to each document whose member voted (with aggregate.answer_batch: "
                       "ran), within its own lifetime cap (aggregate.per_document_epsilon); how many did is not "
                       "stated")
RECEIPT_FIELD = "dp_receipt"
# request fields this mode cannot honour (400 naming the field): they would expose the members'
# aggregate before noise, or ask for several samples or forced tokens
REFUSED = {
    "logprobs": "logprobs of generated tokens would expose the members' aggregate before noise",
    "top_logprobs": "top_logprobs would expose the members' aggregate before noise",
    "n": "one answer per request",
    "best_of": "one answer per request",
    "logit_bias": "logit_bias is not applied by DP aggregation",
    "stop": "stop strings are not supported by DP aggregation; stop tokens (EOS) are",
    "suffix": "suffix is not supported by DP aggregation",
    "tools": "tools are not supported by DP aggregation",
}
FIRST_TOKEN_DEFAULTS = {"n": 1, "best_of": 1}


@dataclass(frozen=True)
class ServedCollection:
    """A collection's members as the engine sees them: each member's system-turn token ids, and
    (``mechanism: answer``, its span check) its documents."""

    name: str
    member_prefixes: tuple[tuple[int, ...], ...]  # SECRET: private documents
    member_documents: tuple[tuple[str, ...], ...] = ()  # SECRET
    # mechanism answer with answer_vocabulary document: the tokens each member may decode (None: any)
    member_vocabularies: tuple[frozenset[int] | None, ...] = ()  # SECRET
    # mechanism answer, one member per document: each member's document id (the per-document
    # ledger's row) and a keyed hash of every document (released answers are reused within it)
    member_ids: tuple[str, ...] = ()
    version: str = ""  # SECRET: enters only keyed labels


def cut(tokenizer, fact: str, limit: int) -> str:
    """The released ``fact`` cut to its first ``limit`` tokens (``answer_tokens``: the public
    bound on what a reply states)."""
    ids = tokenizer.encode(fact, add_special_tokens=False)
    return tokenizer.decode(ids[:limit]) if len(ids) > limit else fact


def document_vocabulary(tokenizer, documents: Sequence[str], stop_ids: tuple[int, ...]) -> frozenset[int]:
    """The token ids a member may decode (``aggregate.answer_vocabulary: document``): those of
    its documents' text, of each of their words alone (with and without a leading space,
    capitalised or not: how an answer starts), of the abstention NONE, a line break and the end
    tokens. A function of the member's own documents and the public tokenizer."""
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    ids = {*stop_ids, *encode("\n"), *encode("NONE"), *encode(" NONE")}
    for text in documents:
        ids.update(encode(text))
        for word in set(re.findall(r"\S+", text)):
            for form in {word, word.lower(), word[:1].upper() + word[1:]}:
                ids.update(encode(form))
                ids.update(encode(" " + form))
    return frozenset(ids)


def member_text(tokenizer, ids: list[int], stop_ids: tuple[int, ...]) -> str:
    """A member's answer as it ends: its tokens before the first stop token (EOS), decoded,
    up to the first line break (what a request stopping at EOS and at "\n" returned)."""
    cut = next((i for i, t in enumerate(ids) if t in stop_ids), len(ids))
    return tokenizer.decode(ids[:cut], skip_special_tokens=True).split("\n", 1)[0]


def check_batch_invariance(cfg: AggregatePrivacyConfig) -> None:
    """Refuse to serve DP aggregation on an engine that is not batch-invariant (ConfigError
    naming the setting): a query's members decode in one batch, and where one more sequence in
    the batch can change another's greedy tokens, one document could move several members'
    votes. The CPU engine (float32) is measured to be invariant
    (``tests/serving/test_batch_invariance.py``); elsewhere vLLM is only with
    ``VLLM_BATCH_INVARIANT=1``, or the operator states the risk (``aggregate.allow_batch_variance``)."""
    from vllm import envs
    from vllm.platforms import current_platform

    if cfg.reads_members:
        return  # no member decodes: nothing shares a batch with the documents
    if current_platform.is_cpu() or envs.VLLM_BATCH_INVARIANT or cfg.allow_batch_variance:
        return
    raise ConfigError(f"dp_privacy.aggregate on {current_platform.device_name}: set VLLM_BATCH_INVARIANT=1 (a "
                      "query's members decode in one batch; without it one document can change other members' "
                      "answers), or aggregate.allow_batch_variance: true to serve with that risk stated")


def member_bound(cfg: AggregatePrivacyConfig, max_model_len: int) -> int:
    """The public bound on one member's system turn (tokens): ``max_member_tokens``, default
    half of ``max_model_len``; ConfigError when it leaves no room for an answer."""
    bound = cfg.max_member_tokens or max_model_len // 2
    if bound + cfg.max_tokens >= max_model_len:
        raise ConfigError(f"aggregate.max_member_tokens={bound} + aggregate.max_tokens={cfg.max_tokens} leave no "
                          f"room for a question in max_model_len={max_model_len}")
    return bound


def chat_prefix_ids(tokenizer, system: str) -> list[int]:
    """The chat template's rendering of a system turn holding ``system`` (token ids; a BOS the
    template writes is in the text)."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False,
                                         add_generation_prompt=False)
    return tokenizer.encode(text, add_special_tokens=False)


def load_collections(cfg: AggregatePrivacyConfig, tokenizer, key: NoiseKey, bound: int | None = None,
                     stop_ids: tuple[int, ...] = ()) -> tuple[ServedCollection, ...]:
    """Every configured collection loaded, checked and partitioned (ConfigError naming the key;
    ``bound``: the public bound on a member's system turn, see ``member_bound``; ``stop_ids``:
    the model's end tokens, which a member's restricted vocabulary keeps)."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    out = []
    for name, source in cfg.collection_sources().items():
        try:
            collection = load_collection(name, source, count, cfg.max_document_tokens)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if cfg.mechanism == ANSWER and cfg.answer_members is None:  # one member per document
            parts = tuple((doc,) for doc in collection.documents)
        else:
            members = cfg.answer_members if cfg.mechanism == ANSWER else cfg.members
            parts = collection.partition(members, lambda doc_id, n=name: key.mac("aggregate/member", n, doc_id))
        texts = member_texts(parts)
        if cfg.mechanism == ANSWER:
            texts = [ANSWER_SYSTEM.format(documents=text, instruction=cfg.answer_instruction) for text in texts]
        prefixes = tuple(tuple(chat_prefix_ids(tokenizer, text)) if part else ()
                         for part, text in zip(parts, texts, strict=True))
        if bound is not None and any(len(p) > bound for p in prefixes):  # the operator's start-up error
            raise ConfigError(f"aggregate.contexts.{name}: a member's documents exceed aggregate.max_member_tokens="
                              f"{bound} tokens; raise the bound (or max_model_len) or add members")
        documents = tuple(tuple(d.text for d in part) for part in parts)
        restricted = cfg.mechanism == ANSWER and cfg.answer_vocabulary == "document"
        vocabularies = tuple(document_vocabulary(tokenizer, docs, stop_ids) if restricted and docs else None
                             for docs in documents)
        ids = tuple(part[0].id for part in parts) if cfg.mechanism == ANSWER and cfg.answer_members is None else ()
        version = key.mac("aggregate/version", json.dumps(sorted((d.id, d.text) for d in collection.documents),
                                                          ensure_ascii=False)).hex()
        out.append(ServedCollection(name, prefixes, documents, vocabularies, ids, version))
    return tuple(out)


class EngineSource:
    """``decode.Source`` factory over a vLLM engine client: one-token sub-requests; the first
    prompt (the public sequence) returns its top ``public_top`` log-probabilities (-1: all), the
    members their top ``member_top``. Cache salts (``salts``): ``member_salt`` (secret, per
    deployment: the documents' prefill is reused across queries) for the members that hold
    documents; a fresh random one per query for the public sequence and for an empty member,
    whose prompt is the client's conversation alone."""

    def __init__(self, engine_client, public_top: int, member_top: int, member_salt: str):
        from vllm import SamplingParams

        self.engine, self.member_salt = engine_client, member_salt
        self.params = [SamplingParams(max_tokens=1, temperature=0.0, logprobs=n, detokenize=False,
                                      flat_logprobs=True) for n in (public_top, member_top)]

    def salts(self, collection: ServedCollection, query_salt: str) -> list[str]:
        """Each member's cache salt: the secret ``member_salt`` where the member holds documents
        (its prompt starts with them), ``query_salt`` (fresh per query) where it is empty. Under
        the secret salt an empty member would cache the client's own sequence beside the
        members' documents: a conversation starting with a guessed ``Document: <text>`` turn
        would then hit a member's cached blocks, and its timing tell the guess."""
        return [self.member_salt if prefix else query_salt for prefix in collection.member_prefixes]

    def for_query(self, collection: ServedCollection):
        """The ``decode.Source`` of one query over ``collection`` (its own fresh salt for the
        public sequence and the empty members)."""
        public = os.urandom(16).hex()
        return functools.partial(self.ask, [public, *self.salts(collection, public)])

    async def _output(self, ids: list[int], salt: str, params, request_id: str):
        """The engine's final ``CompletionOutput`` for the prompt ``ids`` under cache ``salt``."""
        from vllm.inputs.engine import tokens_input

        final = None
        async for out in self.engine.generate(tokens_input(ids, cache_salt=salt), params, request_id):
            final = out
        return final.outputs[0]

    async def ask(self, salts: list[str], prompts: list[list[int]]) -> list[TopLogprobs]:
        """The next-token log-probabilities of each of ``prompts`` (the public sequence first,
        then the members) under its cache salt (``salts``, in the same order)."""
        batch = uuid.uuid4().hex

        async def one(i: int, ids: list[int]) -> TopLogprobs:
            output = await self._output(ids, salts[i], self.params[min(i, 1)], f"dpagg-{batch}-{i}")
            flat = output.logprobs  # FlatLogprobs: position 0's entries
            start, end = flat.start_indices[0], flat.end_indices[0]
            return TopLogprobs.sorted(np.asarray(flat.token_ids[start:end]), np.asarray(flat.logprobs[start:end]))

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    async def member_answers(self, prompts: list[list[int]], salts: list[str],
                             vocabularies: Sequence[frozenset[int] | None], max_tokens: int) -> list[list[int]]:
        """Each member's greedy token ids, exactly ``max_tokens`` of them, all in one batch, each
        under its salt (``AggregateService.member_batch``: the secret one where the prompt holds
        documents, a fresh one per query where it does not) (``mechanism: answer``).
        No member stops early: EOS is ignored and
        there are no stop strings (``member_text`` cuts the answer afterwards), so every member
        decodes the same public number of steps and the reply's time does not tell how long
        any member's answer was (a question such as "if your document mentions X, repeat it"
        would otherwise time a matching document)."""
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                                 allowed_token_ids=None if vocab is None else sorted(vocab)) for vocab in vocabularies]
        batch = uuid.uuid4().hex
        outputs = await asyncio.gather(*(self._output(ids, salt, p, f"dpans-{batch}-{i}")
                                         for i, (ids, salt, p) in enumerate(zip(prompts, salts, params, strict=True))))
        return [list(o.token_ids) for o in outputs]

    async def public_answer(self, prompt: list[int], max_tokens: int, sampling: dict):
        """The answer to a public prompt (the conversation, with the released fact or without):
        yields its cumulative ``CompletionOutput``; a fresh cache salt."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        params = SamplingParams(max_tokens=max_tokens, **sampling)
        async for out in self.engine.generate(tokens_input(prompt, cache_salt=os.urandom(16).hex()), params,
                                              f"dpans-{uuid.uuid4().hex}"):
            yield out.outputs[0]


@dataclass(frozen=True)
class MemberBatch:
    """The member requests of one query: ``run``, the members (indices) whose answers vote, then
    padding; each prompt's cache salt and allowed tokens. SECRET: which members run."""

    run: list[int]
    prompts: list[list[int]]
    salts: list[str]
    vocabularies: list[frozenset[int] | None]


class RequestError(Exception):
    def __init__(self, status: int, message: str, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra or {}


STATEMENT_MAX_AGE = 1.0  # seconds a shared ledger read serves /v1/dp/budget (other servers' writes)


class SharedStatement:
    """``/v1/dp/budget``'s statements of DP aggregation from one shared ledger read: every
    collection's and client's status in one store transaction (``reports.aggregate_statuses``),
    read again only once this process wrote the ledger (``QueryLedger.writes``: a reservation or
    a settlement; the statement is then exact) or ``max_age`` seconds passed (another server's
    writes on a shared store); concurrent callers of a stale read wait for the one read in
    flight, and each view (``reports.aggregate_view``: which clients' ledgers) is built once per
    read. Callers of the unauthenticated route can then take the store's lock, which every
    reservation takes, at most once per second and per write of this server."""

    def __init__(self, cfg: AggregatePrivacyConfig, ledger: QueryLedger, max_age: float = STATEMENT_MAX_AGE,
                 clock=time.monotonic):
        self.cfg, self.ledger, self.max_age, self.clock = cfg, ledger, max_age, clock
        self._lock = threading.Lock()
        self._read: tuple | None = None  # (ledger writes, time, statuses, {shown: view})

    def get(self, shown: tuple[str, ...] | None) -> dict:
        """The statement with the ledgers of the clients ``shown`` (None: every client's). Raises
        ``LedgerUnavailable`` (nothing is kept then)."""
        with self._lock:
            read = self._read
            if read is None or read[0] != self.ledger.writes or self.clock() - read[1] >= self.max_age:
                writes, start = self.ledger.writes, self.clock()  # before the read: a write during it is seen next time
                read = self._read = (writes, start, aggregate_statuses(self.cfg, self.ledger), {})
            if shown not in read[3]:
                read[3][shown] = aggregate_view(self.cfg, read[2], shown)
            return read[3][shown]


def bearer_key(headers) -> str | None:
    """The key of a request's ``Authorization: Bearer <key>`` (ASGI headers), None without one."""
    auth = dict(headers).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def fresh_rng() -> np.random.Generator:
    """A generator seeded with 256 bits of OS entropy: one query's randomness."""
    return np.random.default_rng(int.from_bytes(os.urandom(32), "big"))


class AggregateService:
    """Answers chat and completion requests over the collections (built in ``init_state``)."""

    rng = staticmethod(fresh_rng)  # each query's randomness (a test may set a seeded factory)

    def __init__(self, cfg: AggregatePrivacyConfig, engine_client, tokenizer, key: NoiseKey, model_name: str,
                 stop_ids: tuple[int, ...], max_model_len: int, store: LedgerStore | None = None):
        self.cfg, self.engine, self.tokenizer, self.model_name = cfg, engine_client, tokenizer, model_name
        self.max_model_len = max_model_len
        self.member_bound = member_bound(cfg, max_model_len)
        try:  # the default query must be able to release something (answer_batch against its threshold)
            aggregation_params(cfg)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.stop_ids = stop_ids
        self.collections = {c.name: c for c in load_collections(cfg, tokenizer, key, self.member_bound, stop_ids)}
        # the deployment's store (dp_privacy.ledger); default: beside the key, earlier JSONL imported
        self.ledger = QueryLedger(key, store or open_ledger(None, key, cfg.budget_file),
                                  allow_foreign=cfg.allow_foreign_ledger)
        try:
            foreign = self.ledger.check_key()  # a lost key must not silently reset every budget
        except ForeignEntries as exc:
            raise ConfigError(str(exc)) from None
        if foreign:
            logger.warning("vllm-dp: the query ledger holds %d entries under another key (allowed by "
                           "aggregate.allow_foreign_ledger)", foreign)
        self.total = Budget(cfg.total_epsilon, cfg.total_delta)
        choices = -1 if cfg.choices is None else cfg.choices
        self.source = EngineSource(engine_client, choices, 1 if cfg.mechanism == "vote" else choices,
                                   key.mac("aggregate/cache-salt", "members").hex())
        self.key = key
        self.statements = SharedStatement(cfg, self.ledger)
        store = self.ledger.store
        self.documents = DocumentLedger(key, store) if cfg.per_document else None
        self.document_labels = {name: self.documents.labels(name, c.member_ids) for name, c in
                                self.collections.items()} if self.documents else {}
        self.releases = AnswerReleases(key, store) if cfg.mechanism == ANSWER and cfg.reuse_answers else None
        self.release_settings = json.dumps([cfg.answer_member, cfg.answer_instruction, cfg.answer_tokens,
                                            cfg.answer_vocabulary, cfg.delta])

    @property
    def document_cap(self) -> Budget:
        return Budget(self.cfg.per_document_epsilon, self.cfg.per_document_delta)

    def _reuse_label(self, collection: ServedCollection, eps: float, question: str, public: list[int]) -> str:
        """The keyed label under which this query's release is kept for reuse: the collection's
        version, the settings, epsilon and what the members see of the request (the question
        itself for members that read by rule, ``focus``: "Quick question: X?" and "X?" share one
        release; the whole rendered request for members that answer)."""
        seen = focus(question) if self.cfg.reads_members else json.dumps(public)  # all the members see
        return self.releases.label(collection.name, collection.version, self.release_settings, eps, seen)

    def statement(self, shown: tuple[str, ...] | None = None) -> dict:
        """``/v1/dp/budget``'s statement (``reports.aggregate_statement``, which ``vllm-dp account``
        prints) with the ledgers of the clients ``shown`` (None: every client's, the operator's
        view; ``()``: none, the public view), from the shared ledger read (``SharedStatement``)."""
        return self.statements.get(shown)

    def viewer(self, headers=()) -> tuple[str, ...] | None:
        """Which clients' ledgers a ``/v1/dp/budget`` request may see (``statement``'s ``shown``):
        every client's (None) with the operator's bearer key (``aggregate.operator_key_sha256``),
        its own with a client's, none without a key or without configured clients (nothing per
        client to show: any ``Authorization`` is ignored, e.g. vLLM's own ``--api-key``). A key
        that is neither gets 401, as on the query routes: a mistyped key is told so rather than
        shown less. A client's spending is not derived from the documents but from what the
        client asked: its own and the operator's to see, not the other clients'."""
        token = bearer_key(headers) if self.cfg.clients else None
        if token is None:
            return ()
        if self.cfg.is_operator_key(token):
            return None
        client = self.cfg.client_for_key(token)
        if client is None:
            raise RequestError(401, "the bearer key names no client (aggregate.clients) and is not the operator's "
                                    "(aggregate.operator_key_sha256); without a key /v1/dp/budget is the public "
                                    "statement")
        return (client.name,)

    def member_keys(self, answers: list[list[int]], documents: Sequence[tuple[str, ...]],
                    question: str) -> list[str | None]:
        """Each member's vote (None: it abstains): its answer (``member_text``) read against its
        own ``documents`` and the public question (``aggregate.answer``)."""
        public = (self.cfg.answer_instruction,)
        return [answer_key(member_text(self.tokenizer, ids, self.stop_ids), docs, question, public)
                for ids, docs in zip(answers, documents, strict=True)]

    def member_batch(self, collection: ServedCollection, members: list[list[int]], public: list[int],
                     question: str, active: Sequence[bool]) -> MemberBatch:
        """The members a query runs (``mechanism: answer``, members that answer): every one; with
        ``answer_batch`` K, exactly K prompts: the members that are active and whose documents
        can answer (``can_answer``), the first K in a keyed order of the question and the
        document's id, then members that see no document (the public sequence, a fresh salt).
        Every member is checked (no early exit), so the time does not tell how many can answer."""
        fresh = os.urandom(16).hex()
        salts = self.source.salts(collection, fresh)
        vocabularies = collection.member_vocabularies or (None,) * len(members)
        k = self.cfg.answer_batch
        if k is None:
            return MemberBatch(list(range(len(members))), members, salts, list(vocabularies))
        able = [i for i, (docs, on) in enumerate(zip(collection.member_documents, active, strict=True))
                if can_answer(docs, question) and on]
        run = sorted(able, key=lambda i: self.key.mac("aggregate/batch", question, collection.member_ids[i]))[:k]
        pad = k - len(run)
        return MemberBatch(run, [members[i] for i in run] + [list(public)] * pad,
                           [salts[i] for i in run] + [fresh] * pad, [vocabularies[i] for i in run] + [None] * pad)

    @staticmethod
    def extracted_keys(collection: ServedCollection, question: str) -> list[str | None]:
        """Each member's vote under ``answer_member: extract``: its own documents read against the
        public question (``aggregate.answer.extract_key``); every member is read."""
        return [extract_key(docs, question) for docs in collection.member_documents]


    # ------------------------------------------------------------------ requests
    def _options(self, body: dict) -> tuple[ServedCollection, float]:
        xargs = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
        unknown = sorted(k for k in xargs if k.startswith("dp_") and k not in OPTIONS)
        if unknown:
            raise RequestError(400, f"unknown option(s) {unknown} in vllm_xargs; known: {list(OPTIONS)}")
        name = xargs.get("dp_context", next(iter(self.collections)))
        if name not in self.collections:
            raise RequestError(400, f"vllm_xargs.dp_context={name!r} names no served collection; known: "
                                    f"{list(self.collections)}")
        eps = xargs.get(OPTION_EPSILON, self.cfg.epsilon)
        try:
            eps = float(eps)
            aggregation_params(self.cfg, eps)
        except (TypeError, ValueError) as exc:
            raise RequestError(400, f"vllm_xargs.{OPTION_EPSILON}: {exc}") from None
        return self.collections[name], eps

    def _check_fields(self, body: dict) -> None:
        for field, why in REFUSED.items():
            value = body.get(field)
            if value is None or value is False or value == FIRST_TOKEN_DEFAULTS.get(field, object()):
                continue
            raise RequestError(400, f"`{field}` is not allowed with DP aggregation: {why}")

    def _max_tokens(self, body: dict) -> int:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        asked = body.get(name)
        if asked is None:
            return self.cfg.max_tokens
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
            raise RequestError(400, f"`{name}` must be a positive integer, got {asked!r}")
        return min(asked, self.cfg.max_tokens)

    def _public_ids(self, path: str, body: dict) -> list[int]:
        if path == "/v1/chat/completions":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(400, "`messages` must be a non-empty list")
            return self.tokenizer.encode(self._render(messages), add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            if not ids:  # the engine refuses an empty prompt: a failed query (500)
                raise RequestError(400, "`prompt` must not be empty")
            return ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)  # the engine's own refusal would be a failed query (500)
            if not all(0 <= t < vocab for t in prompt):
                raise RequestError(400, f"`prompt` token ids must be in [0, {vocab})")
            return list(prompt)
        raise RequestError(400, "`prompt` must be one string or one list of token ids")

    def _render(self, messages: list, system: bool = False) -> str:
        """The chat template's rendering of the client's ``messages`` (generation prompt on;
        ``system``: after an empty system turn); 400 naming ``messages`` when the template
        cannot render them (its error is about the client's own messages and the public template,
        and may quote them: escaped and cut, ``printable``)."""
        turns = [{"role": "system", "content": ""}, *messages] if system else messages
        try:
            return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja2, TypeError, KeyError: any is the messages' fault
            raise RequestError(400, f"`messages` cannot be rendered by the chat template: {printable(str(exc))}") from None

    def _suffix_ids(self, path: str, body: dict, public: list[int]) -> list[int]:
        """What follows a member's system turn: the conversation (chat: the template over
        [system, *messages] after the system turn) or the prompt without a leading BOS
        (completions). Computed from the request alone."""
        if path == "/v1/chat/completions":
            return self._conversation_ids(body["messages"])
        bos = self.tokenizer.bos_token_id
        return public[1:] if public and bos is not None and public[0] == bos else list(public)

    def _check_room(self, public: list[int], suffix: list[int], max_tokens: int) -> None:
        """Refuse (400, public numbers only) a request that would not fit ``max_model_len``
        after the longest member allowed (``member_bound``): no length error may come from a
        member's true length."""
        generated = max(max_tokens, self.cfg.answer_tokens if self.cfg.mechanism == ANSWER else 0)
        need = max(len(public), self.member_bound + len(suffix)) + generated
        if need > self.max_model_len:
            raise RequestError(400, f"the request is too long for DP aggregation: {len(suffix)} tokens after a member's "
                                    f"documents (public bound aggregate.max_member_tokens={self.member_bound}) plus "
                                    f"max_tokens={max_tokens} exceed max_model_len={self.max_model_len}")

    def _question(self, path: str, body: dict, public: list[int]) -> str:
        """The question the members answer (public): the last user message's text, or the
        completion prompt's (its last user turn when the prompt is a chat template rendering)."""
        if path != "/v1/chat/completions":
            text = self.tokenizer.decode(public, skip_special_tokens=False)
            marker, end = self._user_turn
            if marker and end and text.endswith(end) and marker in text:
                return text[text.rfind(marker) + len(marker):-len(end)]
            return self.tokenizer.decode(public, skip_special_tokens=True)
        content = next((m.get("content") for m in reversed(body["messages"])
                        if isinstance(m, dict) and m.get("role") == "user"), "")
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(part["text"] for part in content if isinstance(part, dict)
                               and isinstance(part.get("text"), str))
        return content if isinstance(content, str) else ""

    @functools.cached_property
    def _user_turn(self) -> tuple[str, str]:
        """The chat template's text before and after a last user message (with the generation
        prompt): how a completion prompt rendered from a conversation shows its question."""
        sentinel, system = "\x00question\x00", [{"role": "system", "content": "s"}]
        alone = self.tokenizer.apply_chat_template(system, tokenize=False)
        both = self.tokenizer.apply_chat_template([*system, {"role": "user", "content": sentinel}], tokenize=False,
                                                  add_generation_prompt=True)
        if not both.startswith(alone) or sentinel not in both:
            return "", ""
        marker, _, end = both[len(alone):].partition(sentinel)
        return marker, end

    @staticmethod
    def _member_ids(collection: ServedCollection, public: list[int], suffix: list[int]) -> list[list[int]]:
        """Member i: its documents' system turn, then ``suffix``; an empty member sees the public
        sequence (under a fresh salt: ``EngineSource.salts``)."""
        return [[*prefix, *suffix] if prefix else list(public) for prefix in collection.member_prefixes]

    def _conversation_ids(self, messages: list[dict]) -> list[int]:
        """The template's rendering of ``messages`` after a system turn (ids), generation prompt on."""
        alone = self.tokenizer.apply_chat_template([{"role": "system", "content": ""}], tokenize=False)
        both = self._render(messages, system=True)
        if not both.startswith(alone):
            raise RequestError(400, "`messages`: the chat template renders a system turn differently when they follow")
        return self.tokenizer.encode(both[len(alone):], add_special_tokens=False)

    def _client(self, headers) -> AggregateClient | None:
        """The configured client whose key the request's ``Authorization: Bearer`` carries (401
        when clients are configured and it carries none of theirs); None without clients."""
        if not self.cfg.clients:
            return None
        token = bearer_key(headers)
        client = None if token is None else self.cfg.client_for_key(token)
        if client is None:
            raise RequestError(401, "DP aggregation answers configured clients only (aggregate.clients): send one's "
                                    "key as Authorization: Bearer <key>")
        return client

    async def handle(self, path: str, body: dict, headers=()):
        """The answer to one request (``headers``: the ASGI scope's, for the client's key)."""
        try:
            client = self._client(headers)
            self._check_fields(body)
            collection, eps = self._options(body)
            max_tokens = self._max_tokens(body)
            public = self._public_ids(path, body)
            suffix = self._suffix_ids(path, body, public)
            self._check_room(public, suffix, max_tokens)
            members = self._member_ids(collection, public, suffix)
            params = aggregation_params(self.cfg, eps)
            answer = {"question": self._question(path, body, public),
                      "sampling": _sampling(body)} if self.cfg.mechanism == ANSWER else None
            quota = None if client is None else client.quota
            try:  # a ledger transaction waits for the disk or the database: off the event loop
                if answer is not None and self.releases is not None:
                    answer["reuse"] = self._reuse_label(collection, eps, answer["question"], public)
                    answer["reused"] = await asyncio.to_thread(self.releases.get, answer["reuse"])
                if answer is not None and answer.get("reused") is not None:
                    reservation = None  # post-processing of an earlier release: nothing to reserve
                elif self.documents is not None:
                    reservation = await asyncio.to_thread(
                        self.documents.reserve, collection.name, self.document_labels[collection.name],
                        params.worst_case, self.document_cap, quota)
                else:
                    reservation = await asyncio.to_thread(self.ledger.reserve, collection.name, self.total,
                                                          params.worst_case, quota)
            except LedgerUnavailable as exc:  # disk full, read-only, database down: nothing reserved
                logger.error("vllm-dp: %s", exc)
                raise RequestError(503, LEDGER_DOWN) from None
            except BudgetExhausted as exc:  # its text names the ledger file: the client gets the numbers
                whose = "" if exc.quota is None else f" of client {exc.quota.client!r}"
                raise RequestError(429, f"query budget{whose} on context {exc.context!r} exhausted: requested "
                                        f"{exc.requested}, remaining {exc.remaining} of {exc.total}",
                                   {"remaining": _budget_json(exc.remaining)}) from None
        except RequestError as exc:
            return _error(exc)
        args = (self, path, collection.name, params, reservation, public, members, max_tokens)
        query = _TokenQuery(*args) if answer is None else _AnswerQuery(*args, **answer)
        if body.get("stream"):
            return StreamingResponse(query.stream(), media_type="text/event-stream")
        return await query.respond()


class _Query:
    """One request's answer in OpenAI's shape: ``_pieces`` (a subclass's) yields its text, the
    ledger is settled when it ends (``settlement``; the reservation's worst case on failure)."""

    def __init__(self, service: AggregateService, path: str, name: str, params, reservation, public: list[int],
                 members: list[list[int]], max_tokens: int):
        self.service, self.path, self.name = service, path, name
        self.params, self.reservation = params, reservation
        self.public, self.members, self.max_tokens = public, members, max_tokens
        self.chat = path == "/v1/chat/completions"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.text = ""
        self.finish = "length"

    async def steps(self):
        """Yield each new piece of text; settles the ledger when done (worst case on failure)."""
        done = False
        try:
            async for piece in self._pieces():
                yield piece
            done = True
        finally:
            self.status = await asyncio.to_thread(self._settle, done)

    def _settle(self, done: bool):
        """Settle the reservation: what the query spent, or (``done`` false: it failed) all of it;
        the budget's status after it (None where there is none to state)."""
        return self.service.ledger.settle(self.reservation, self.settlement() if done else self.reservation.amount)

    def receipt(self) -> dict:
        spent = self.settlement()
        receipt = {"context": self.name, "mechanism": self.params.mechanism, "epsilon": spent.epsilon,
                   "delta": spent.delta, "tokens": len(self.tokens), **self._receipt(),
                   "requested_epsilon": self.params.worst_case.epsilon, "unit": UNIT}
        if self.status is not None:
            receipt["remaining"] = _budget_json(self.status.remaining)
        return receipt

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.public), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.public) + len(self.tokens)}

    async def respond(self) -> JSONResponse:
        try:
            async for _ in self.steps():
                pass
        except LedgerUnavailable as exc:  # not settled: the reservation counts in full, nothing leaves
            logger.error("vllm-dp: %s", exc)
            return _error(RequestError(503, LEDGER_DOWN))
        except Exception:  # noqa: BLE001 - the engine's error text may depend on the documents
            logger.error("vllm-dp: %s", QUERY_FAILED)
            return _error(RequestError(500, QUERY_FAILED))
        text = self.text
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": self.finish}
                  if self.chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish})
        receipt = self.receipt()
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.service.model_name, "choices": [choice],
                "usage": self.usage(), RECEIPT_FIELD: receipt}
        return JSONResponse(body, headers={RECEIPT_HEADER: json.dumps(receipt, separators=(",", ":"))})

    async def stream(self):
        kind = "chat.completion.chunk" if self.chat else "text_completion"

        def chunk(piece: str | None, finish: str | None, role: bool = False, **extra) -> str:
            if self.chat:
                delta = {"role": "assistant"} if role else {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            data = {"id": self.id, "object": kind, "created": self.created, "model": self.service.model_name,
                    "choices": [choice], **extra}
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

        if self.chat:
            yield chunk(None, None, role=True)
        try:
            async for piece in self.steps():
                if piece:
                    yield chunk(piece, None)
        except LedgerUnavailable as exc:  # the tokens sent are covered: the reservation counts in full
            logger.error("vllm-dp: %s", exc)
            error = {"message": LEDGER_DOWN, "type": "ServiceUnavailable", "code": 503}
            yield f"data: {json.dumps({'error': error}, separators=(',', ':'))}\n\n"
        except Exception:  # noqa: BLE001 - the engine's error text may depend on the documents
            logger.error("vllm-dp: %s", QUERY_FAILED)
            error = {"message": QUERY_FAILED, "type": "InternalServerError", "code": 500}
            yield f"data: {json.dumps({'error': error}, separators=(',', ':'))}\n\n"
        else:
            yield chunk(None, self.finish, usage=self.usage(), **{RECEIPT_FIELD: self.receipt()})
        yield "data: [DONE]\n\n"


class _TokenQuery(_Query):
    """``vote`` / ``expmech``: lockstep decoding, one DP choice per private token."""

    def __init__(self, *args):
        super().__init__(*args)
        self.aggregator = Aggregator(self.params, self.service.rng())

    async def _pieces(self):
        collection = self.service.collections[self.name]
        async for step in generate(self.service.source.for_query(collection), self.public, self.members, self.aggregator,
                                   self.max_tokens, self.service.stop_ids):
            if step.token in self.service.stop_ids:
                self.finish = "stop"
                break
            shown = self.text
            self.tokens.append(step.token)
            self.text = self.service.tokenizer.decode(self.tokens, skip_special_tokens=True)
            yield self.text[len(shown):]

    def settlement(self) -> Budget:
        return self.aggregator.settlement()

    def _receipt(self) -> dict:
        return {"private_tokens": self.aggregator.private_steps}


class _AnswerQuery(_Query):
    """``answer``: every member answers (one batch), votes for its key (``aggregate.answer``);
    one partition selection releases the agreed keys. The reply states the most agreed one as
    coming from the documents and stops (it adds nothing the release does not carry); with
    nothing released it says the documents gave no answer it can share, then (``on_empty:
    public``) gives the public model's answer to the conversation, marked as general knowledge."""

    def __init__(self, *args, question: str, sampling: dict, reuse: str | None = None,
                 reused: ReleasedAnswer | None = None):
        super().__init__(*args)
        self.question, self.sampling = question, sampling
        self.reuse, self.reused = reuse, reused
        self.fact: str | None = None
        self.count: int | None = None
        self.charged: np.ndarray | None = None  # SECRET: per-document budgets, the documents that voted

    async def _release(self) -> None:
        """The query's DP release: every member's vote, of the documents still active (per-document
        budgets: the reservation's), counted; one partition selection; kept for reuse."""
        service, cfg = self.service, self.service.cfg
        collection = service.collections[self.name]
        # the keys' CPU time depends on the answers (or the documents): off the event loop; every
        # member is read, active or not, so the time does not tell how many are
        active = self.reservation.active if service.documents is not None else np.ones(len(self.members), bool)
        took_part = None  # answer_batch: the members that ran (a document that runs is charged)
        if cfg.reads_members:
            keys = await asyncio.to_thread(service.extracted_keys, collection, self.question)
        else:
            batch = await asyncio.to_thread(service.member_batch, collection, self.members, self.public,
                                            self.question, active)
            answers = await service.source.member_answers(batch.prompts, batch.salts, batch.vocabularies,
                                                          cfg.answer_tokens)
            ran = await asyncio.to_thread(service.member_keys, answers[:len(batch.run)],
                                          [collection.member_documents[i] for i in batch.run], self.question)
            keys = [None] * len(self.members)
            for i, key in zip(batch.run, ran, strict=True):
                keys[i] = key
            if cfg.answer_batch is not None:
                took_part = np.isin(np.arange(len(self.members)), batch.run)
        if service.documents is not None:
            self.charged = (np.array([k is not None for k in keys]) if took_part is None else took_part) & active
            keys = [k if c else None for k, c in zip(keys, self.charged, strict=True)]
        released = self.params.release.release(dict(Counter(filter(None, keys))))
        self.fact = max(released, key=lambda k: (released[k], k)) if released else None
        self.count = released.get(self.fact)  # its noisy count (part of the release)
        if service.releases is not None:
            spent = self.params.worst_case
            await asyncio.to_thread(service.releases.put, self.reuse,
                                    ReleasedAnswer(self.fact, self.count, spent.epsilon, spent.delta))

    async def _pieces(self):
        service, cfg = self.service, self.service.cfg
        if self.reused is None:
            await self._release()
        else:  # post-processing of the earlier release of the same question
            self.fact, self.count = self.reused.fact, self.reused.noisy_count
        if self.fact is not None:
            self.text = FROM_DOCUMENTS.format(fact=cut(service.tokenizer, self.fact, cfg.answer_tokens))
        elif cfg.on_empty == "refuse":
            self.text = NOT_FROM_DOCUMENTS
        if self.text:
            self.tokens, self.finish = service.tokenizer.encode(self.text, add_special_tokens=False), "stop"
            yield self.text
            return
        self.text = start = f"{NOT_FROM_DOCUMENTS} {GENERAL_KNOWLEDGE} "
        marker = service.tokenizer.encode(start, add_special_tokens=False)
        self.tokens = list(marker)
        yield start
        async for output in service.source.public_answer(self.public, self.max_tokens, self.sampling):
            shown, self.text = self.text, start + output.text.lstrip()
            self.tokens, self.finish = [*marker, *output.token_ids], output.finish_reason or self.finish
            yield self.text[len(shown):]

    def _settle(self, done: bool):
        if self.reused is not None:
            return None
        if self.service.documents is None:
            return super()._settle(done)
        charged = self.charged if done and self.charged is not None else self.reservation.active
        self.service.documents.settle(self.reservation, charged)
        return None  # what documents spent is private: no status

    def settlement(self) -> Budget:
        """What the query charged: its (epsilon, delta), once (to the collection, or to each
        document whose member voted); nothing when it reused an earlier release."""
        return Budget(0.0, 0.0) if self.reused is not None else self.params.worst_case

    def _receipt(self) -> dict:
        receipt = {"released": self.fact is not None, "fact": self.fact, "noisy_count": self.count,
                   "reused": self.reused is not None}
        if self.service.documents is not None:
            receipt["charged"] = PER_DOCUMENT_CHARGE
        return receipt


def _sampling(body: dict) -> dict:
    """The request's sampling settings for the public answer of ``mechanism: answer`` (400 for
    a bad value): ``temperature`` (default 1), ``top_p`` (default 1), ``seed``."""
    out = {}
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 1e-9, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise RequestError(400, f"`{name}` must be a number in [{low:g}, {high:g}], got {value!r}")
        out[name] = float(value)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise RequestError(400, f"`seed` must be an integer, got {seed!r}")
        out["seed"] = seed
    return out


def _budget_json(b: Budget) -> dict:
    return {"epsilon": b.epsilon, "delta": b.delta}


def _error(exc: RequestError) -> JSONResponse:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 429: "RateLimitError", 500: "InternalServerError"}
    return JSONResponse({"error": {"message": exc.message, "type": kinds.get(exc.status, "Error"),
                                   "code": exc.status, **exc.extra}}, status_code=exc.status)
