"""The one typed configuration: ``--additional-config '{"dp_privacy": {...}}'`` or a YAML file.

Parsed and validated once (``DPPrivacyConfig.from_dict``; ``parse_section`` caches it per process
and distinct section, so every caller shares one object); every error names the offending key.
Sections not given are ``None`` (that feature is off). No vLLM import.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .attention.params import FEATURES, STATE_MECHANISMS
from .privacy.accountant import COMPOSITIONS
from .privacy.aggregation import AGGREGATION_MECHANISMS, ANSWER, GATES
from .privacy.ledger_store import is_postgres
from .privacy.query_ledger import Quota
from .privacy.validation import check_count, check_delta, check_epsilon, check_positive
from .prompt.options import PROMPT_MECHANISMS
from .prompt.paraphrase import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPLATE,
    DEFAULT_WIDTH,
    PARAPHRASE,
    rewrite_prompt,
)

# answer-level aggregation: what every member is told after its document (public), and what
# answers when no fact is released
ANSWER_INSTRUCTION = ("Answer the user's question with a short phrase copied from the document above. If the "
                      "document does not answer it, answer NONE.")
ON_EMPTY = ("public", "refuse")
ANSWER_VOCABULARIES = ("document", "any")  # what a member of mechanism answer may decode
ANSWER_MEMBERS = ("model", "extract")  # how a member of mechanism answer votes: the model answers, or it reads
CONFIG_KEY = "dp_privacy"


class ConfigError(ValueError):
    """A ``dp_privacy`` configuration that cannot be used; the message says which key and why."""


SERVED_MODES = ("state", "tree")  # attention.params.MODES less the oracle ("reference")
MAX_CURVE_EPSILON = 100.0  # pld/rdp discretise the privacy loss; beyond this they blow up
BOUND_KEYS = ("key_bound", "query_bound", "value_bound", "key_norm", "query_norm")
CONTEXT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # names are public: /v1/dp/budget, logs
CONTEXT_SUFFIXES = (".txt", ".jsonl")  # a text, or documents ({"text": ...} per line)
DEFAULT_CONTEXT = "default"  # the name of the one context of ``private_context``


@dataclass(frozen=True)
class AttentionPrivacyConfig:
    """DP attention over the private context: total budget for the whole model.

    ``epsilon``/``delta`` cover every release of one private context: ``layers x KV heads x
    releases_per_head`` per-(layer, KV head) releases composed with ``composition``; one
    deployment's release of a context makes ``layers x KV heads`` of them, so
    ``releases_per_head`` > 1 keeps room for that many releases (e.g. under ``allow_rerelease``).
    The guarantee's unit is one private K/V row of one layer (replace-one). The model's shape
    is read from the served model; ``num_layers``/``num_kv_heads``, when given, must match it.

    ``mode``: ``state`` (noisy kernelised state; ``mechanism`` is its noise) or ``tree`` (DPTree).
    ``features``/``degree``/``kernel_error``/``max_features``/``num_random_features``/``mechanism``/
    ``composition``/``max_context``: the ``attention.params.DPAttentionParams`` fields of the same
    names and defaults (``plan.attention_params`` is the one translation).
    Bounds come from public data only: ``calibration`` (a file from ``vllm-dp calibrate``) or
    explicit ``bounds`` (``key_bound``, ``query_bound``, ``value_bound`` and optional
    ``key_norm``/``query_norm``), exactly one of the two when serving.
    ``private_context``: text file whose tokens occupy positions [0, P) of every request of a
    decoder-only model (needs ``--tokenizer-mode dp_private``); its name is ``default``.
    ``contexts``: several named private contexts instead, each its own protected dataset with its
    own release and the whole ``epsilon``/``delta``: a mapping name -> file, or a directory whose
    ``*.txt`` / ``*.jsonl`` files are the contexts, named by their stem (sorted). A request picks
    one with ``vllm_xargs.dp_context``; the default is the first. Names match ``CONTEXT_NAME`` and
    are public (``/v1/dp/budget``). A ``.jsonl`` file holds documents, ``{"text": ...}`` per line,
    joined by newlines. Encoder-decoder models (Whisper) treat each request's encoder output as the
    private context instead.
    ``allow_rerelease``: serve a private context the release ledger has seen released under other
    noise (another key, weights or parameters): the budget is spent again and the report composes
    every release. Off: such a start is refused, and so is any start while the ledger holds
    entries written under another key (a lost or replaced key file: they cannot be matched to a
    context, and may record its releases).
    ``public_head``: how many leading tokens of each private context are public, exact and never
    released (real models put much of their attention on their first tokens: attention sinks).
    ``auto`` (default): the tokenizer's BOS and the chat template's system header
    (``<|im_start|>system\\n``) when the context starts with them, else none; an integer N: the
    first N tokens (the operator declares them public; 0: every token private, the paper's setting).
    ``gate``: a (layer, KV head) release is made and read only where its public relative error
    bound (kernel error + noise std over the smallest true denominator, ``ContextPlan.relative_error``)
    is at most this; elsewhere that head answers from the public rows alone and spends nothing.
    ``false``: every head released and read, whatever its error (paper-literal).
    ``unit``: ``row`` (the guarantee covers one K/V row of one layer; the context is prefilled
    causally, so one document moves every later row) or ``document``: each context file is a
    ``.jsonl`` of documents, laid out by the server as the chat template's system turn with one
    slot of ``document_tokens`` tokens per document (padded with newlines; longer documents are
    refused), and each document is encoded independently (its rows attend to the public head and
    to itself only), so one document moves only its own rows: the statement is then also given
    per document (group privacy over its ``document_tokens`` rows, composed over the releases).
    """

    epsilon: float
    delta: float
    mode: str = "state"
    mechanism: str = "gaussian"
    composition: str = "pld"
    features: str = "taylor"
    degree: int | None = None
    kernel_error: float = 0.01
    max_features: int = 20_000
    num_random_features: int = 256
    calibration: str | None = None
    bounds: dict[str, float] | None = None
    private_context: str | None = None
    contexts: dict[str, str] | str | None = None
    max_context: int = 32_768
    num_layers: int | None = None
    num_kv_heads: int | None = None
    releases_per_head: int = 1
    allow_rerelease: bool = False
    public_head: str | int = "auto"
    gate: float | bool = 0.5
    unit: str = "row"
    document_tokens: int = 64

    def __post_init__(self) -> None:
        _check_field(self, "epsilon", check_epsilon, "attention.epsilon")
        if self.public_head != "auto" and (
            isinstance(self.public_head, bool) or not isinstance(self.public_head, int) or self.public_head < 0
        ):
            raise ConfigError(f"attention.public_head must be auto or an integer >= 0, got {self.public_head!r}")
        if self.gate is True or (self.gate is not False and not (
            isinstance(self.gate, (int, float)) and math.isfinite(self.gate) and self.gate > 0
        )):
            raise ConfigError(f"attention.gate must be a positive relative error or false, got {self.gate!r}")
        _choice(self.unit, ("row", "document"), "attention.unit")
        _check(check_count, self.document_tokens, "attention.document_tokens")
        if self.unit == "document" and self.public_head != "auto":
            raise ConfigError("attention.public_head: unit document lays the context out itself (its public head is "
                              "the chat template's system header); leave public_head at auto")
        _check_field(self, "delta", check_delta, "attention.delta")
        _choice(self.mode, SERVED_MODES, "attention.mode")
        _choice(self.mechanism, STATE_MECHANISMS, "attention.mechanism")
        _choice(self.composition, COMPOSITIONS, "attention.composition")
        _choice(self.features, FEATURES, "attention.features")
        if self.composition == "rdp" and (self.mode != "state" or self.mechanism != "gaussian"):
            raise ConfigError(
                "attention.composition rdp accounts the Gaussian state only (mode state, mechanism "
                "gaussian); use pld, advanced or basic"
            )
        if self.degree is not None and (not isinstance(self.degree, int) or self.degree < 0):
            raise ConfigError(f"attention.degree must be an integer >= 0, got {self.degree!r}")
        _check_field(self, "kernel_error", check_positive, "attention.kernel_error")
        for name in ("num_layers", "num_kv_heads", "releases_per_head", "max_features",
                     "num_random_features", "max_context"):
            value = getattr(self, name)
            if value is not None:
                _check(check_count, value, f"attention.{name}")
        if self.composition in ("pld", "rdp") and self.epsilon > MAX_CURVE_EPSILON:
            raise ConfigError(
                f"attention.epsilon={self.epsilon:g} is beyond what {self.composition} accounting "
                f"handles (<= {MAX_CURVE_EPSILON:g}); use composition basic or advanced"
            )
        if not isinstance(self.allow_rerelease, bool):
            raise ConfigError(f"attention.allow_rerelease must be true or false, got {self.allow_rerelease!r}")
        if self.calibration is not None and self.bounds is not None:
            raise ConfigError("attention: give either `calibration` or `bounds`, not both")
        if self.bounds is not None:
            _check_bounds(self.bounds)
        if self.contexts is not None:
            if self.private_context is not None:
                raise ConfigError("attention: give either `private_context` or `contexts`, not both")
            _check_contexts(self.contexts)

    @property
    def serves_context(self) -> bool:
        """Operator-given private contexts are configured (decoder-only serving)."""
        return self.private_context is not None or self.contexts is not None

    def context_files(self) -> dict[str, str]:
        """The private contexts, name -> file, in order (the first is the default). Lists the
        ``contexts`` directory (ConfigError when it holds none, or a stem is no valid name)."""
        if self.private_context is not None:
            return {DEFAULT_CONTEXT: self.private_context}
        if not isinstance(self.contexts, str):
            return dict(self.contexts or {})
        folder = Path(self.contexts)
        files = sorted((p for p in folder.glob("*") if p.suffix in CONTEXT_SUFFIXES and p.is_file()),
                       key=lambda p: (p.stem, p.suffix))
        if not files:
            raise ConfigError(f"attention.contexts: no .txt or .jsonl files in {self.contexts!r}")
        found = {p.stem: str(p) for p in files}
        if len(found) < len(files):
            raise ConfigError(f"attention.contexts: two files in {self.contexts!r} share a name (stem)")
        for name in found:
            _check_context_name(name)
        return found

    @property
    def document_tokens_or_none(self) -> int | None:
        """``document_tokens`` under unit document, None under unit row."""
        return self.document_tokens if self.unit == "document" else None

    def context_key(self, name: str | None = None) -> str:
        """The configuration key of the private contexts, or of context ``name`` (what errors name)."""
        if self.contexts is None:
            return "attention.private_context"
        return "attention.contexts" if name is None else f"attention.contexts.{name}"


def _check_bounds(bounds: Any) -> None:
    if not isinstance(bounds, dict):
        raise ConfigError(f"attention.bounds must be a mapping, got {type(bounds).__name__}")
    unknown = sorted(set(bounds) - set(BOUND_KEYS))
    if unknown:
        raise ConfigError(f"attention.bounds: unknown key(s) {unknown}; known keys are {list(BOUND_KEYS)}")
    missing = [k for k in BOUND_KEYS[:3] if k not in bounds]
    if missing:
        raise ConfigError(f"attention.bounds: missing required key(s) {missing}")
    for name, value in bounds.items():
        _check(check_positive, value, f"attention.bounds.{name}")


def _check_contexts(contexts: Any) -> None:
    if isinstance(contexts, str):
        return  # a directory, listed when served (``context_files``)
    if not isinstance(contexts, dict):
        raise ConfigError(
            f"attention.contexts must be a mapping name -> file or a directory, got {type(contexts).__name__}"
        )
    if not contexts:
        raise ConfigError("attention.contexts must name at least one private context")
    for name, path in contexts.items():
        _check_context_name(name)
        if not isinstance(path, str):
            raise ConfigError(f"attention.contexts.{name} must be a file path, got {path!r}")


def _check_context_name(name: Any, where: str = "attention.contexts", what: str = "context") -> None:
    if not isinstance(name, str) or not CONTEXT_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: {what} name {name!r} must match {CONTEXT_NAME.pattern} "
            "(names are public: /v1/dp/budget lists them)"
        )


@dataclass(frozen=True)
class AggregatePrivacyConfig:
    """DP aggregation at the output over private document collections (``privacy.aggregation``).

    Unit: one document (add/remove: its text and presence, so which documents exist and their
    number up to one; a replacement is two), per query; budgets are spent per query and recorded per
    context in the deployment's ledger (``dp_privacy.ledger``; ``budget_file``: a JSONL query
    ledger of an earlier version to import, default ``queries.jsonl`` beside the noise key).
    ``contexts``: the collections, a mapping name -> source (a JSONL file, ``{"id", "text"}``
    per line, every line with its own id, or a directory whose ``*.txt`` files are the documents) or a directory whose
    ``*.jsonl`` files are the collections, named by their stem; the first is the default, a
    request picks one with ``vllm_xargs.dp_context``. Documents over ``max_document_tokens``
    tokens are refused at start-up. ``max_member_tokens``: the public bound on one member's
    documents (its system turn, in tokens; default: half of the served ``max_model_len``); a
    collection whose member exceeds it is refused at start-up, and a request whose own tokens +
    this bound + ``max_tokens`` exceed ``max_model_len`` is refused before anything is reserved
    (so no error ever depends on a member's true length).

    Each query: ``members`` disjoint members (documents assigned by a keyed hash of their id) and
    a public sequence decoded in lockstep; ``mechanism`` ``expmech`` or ``vote`` chooses each
    private token among the public sequence's top ``candidates``; ``gate`` ``svt`` spends only
    where at least a ``threshold`` fraction of the members disagrees with the public token (noisily;
    ``gate_share`` of each private step's epsilon), ``none`` makes every step private. At most
    ``max_private_tokens`` private tokens a query; later tokens are the public sequence's, free;
    ``confidence`` < 1 also emits the public token, free, wherever the public sequence's own top
    token has at least that probability (a public rule).
    ``epsilon``/``delta``: a query's budget (``vllm_xargs.dp_epsilon`` may ask for another, from
    ``min_epsilon`` up to ``max_epsilon``); ``total_epsilon``/``total_delta``: a context's budget over
    all queries (basic composition); a query that does not fit gets HTTP 429. ``min_epsilon``
    (default ``epsilon / 8``: 1 at the defaults, the gate's charge of one private token of a
    default query) is also the least any query is charged, whatever it spent, so a collection's
    total pays for at most ``total_epsilon / min_epsilon`` queries (200 at the defaults): a probe
    of a side channel is never nearly free. ``clients``: per-credential quotas, a mapping name ->
    ``{api_key_sha256: <hex SHA-256 of the client's bearer key>, share: <fraction in (0, 1]>}``;
    each reservation must then fit both the collection's total and the client's ``share`` of it
    (shares need not sum to 1; the total still caps them all). Client names are public
    (``/v1/dp/budget`` states each share), keys are never configured, only their hashes.
    ``/v1/dp/budget`` shows a client's spending to that client only (its bearer key) and every
    client's to the operator: ``operator_key_sha256``, the hex SHA-256 of the operator's bearer key
    (its own, no client's; it answers no query).
    ``allow_foreign_ledger``: serve although the query ledger holds entries written under another
    noise key (the key file was lost or replaced: their spending cannot be read, so every
    collection's budget would restart at zero and the documents are partitioned anew). Off (the
    default): such a start, and any reservation, is refused; on: those entries are ignored and
    reported as ``entries_under_other_keys``.
    ``max_tokens``: the cap on a response's length. ``clip``: expmech's clipping bound C (nats).
    ``candidates``: the public sequence's top tokens a private step chooses among (default: the
    whole vocabulary for ``vote``, 64 for ``expmech``, whose members then return as many
    log-probabilities).

    ``mechanism: answer`` spends the budget once per answer instead: every document is its own
    member (or, with ``answer_members`` set, documents are grouped by keyed hash into that many
    members, for large collections: a public number, so the layout never depends on how many
    documents there are; ``members``, the gate and the token-level keys do not apply). Each member
    answers the question from its document under the public
    ``answer_instruction`` (greedy, ``answer_tokens`` tokens, its first line; ``answer_vocabulary``
    ``document``: decoding restricted to the tokens of the member's own documents, so it copies
    rather than composes; ``any``: unrestricted) and votes for
    one key (``aggregate.answer``: the words of its answer that its own document holds); one DP
    partition selection per query (``privacy.partition_selection``, OpenDP's exact Laplace
    threshold at the query's (epsilon, delta)) releases the keys enough members agree on, and the
    reply states the most agreed one as from the documents. Nothing released:
    ``on_empty`` ``public`` answers without the documents, marked as general knowledge, ``refuse``
    only says that the documents gave no answer. ``answer_member``: ``model`` (as above) or
    ``extract``: no model runs for a member; it reads its documents by rule
    (``aggregate.answer.extract_key``: the clauses naming the question's subject and holding most
    of what it asks, read as its answer) and votes when they agree, so a query costs no member
    decoding (``answer_tokens``, ``answer_instruction`` and ``answer_vocabulary`` then only bound
    the reply's length, or do not apply).

    ``per_document_epsilon`` / ``per_document_delta`` (``mechanism: answer``, one member per
    document): budgets per document instead of per collection. Each document has that lifetime
    cap; a query charges its (epsilon, delta) only to the documents whose member votes, and a
    document whose cap would be exceeded stops taking part (``privacy.document_ledger``: an
    individual filter per document); ``total_epsilon``/``total_delta`` then do not apply and no
    query gets 429 for the collection's budget; a client's ``share`` applies to each document's cap.
    ``answer_batch`` (``mechanism: answer``, ``answer_member: model``, one member per document):
    a query runs exactly that many members: those whose documents can answer the question
    (``aggregate.answer.can_answer``, a function of the document and the question), the first in
    a keyed order of the question and the document's id when more can, padded with members that
    see no document; the engine's work and the reply's time are the same whatever the documents.
    One document can then move two counts (its vote, and the one it displaces from the batch),
    so the release is calibrated for l0 = 2, and a document is charged when its member runs.
    ``reuse_answers`` (default on, ``mechanism: answer``): a question asked again of the same
    collection at the same epsilon gets the earlier release, charged to nobody
    (``privacy.answer_releases``).

    The members of a query (and the public sequence) run in one engine batch; the guarantee
    assumes a sequence's outputs do not depend on what else is in the batch (else one document
    could move other members' votes). The CPU engine (float32) is measured to be; elsewhere the
    server requires ``VLLM_BATCH_INVARIANT=1``, unless ``allow_batch_variance`` is set, which the
    statement then lists as not protected.
    """

    contexts: dict[str, str] | str
    mechanism: str = "vote"
    members: int = 8
    epsilon: float = 8.0
    delta: float = 1e-6
    max_epsilon: float | None = None
    min_epsilon: float | None = None
    total_epsilon: float = 200.0
    total_delta: float = 1e-4
    max_private_tokens: int = 4
    gate: str = "svt"
    gate_share: float = 0.5
    threshold: float = 0.4
    clip: float = 1.0
    confidence: float = 1.0
    candidates: int | None = None
    max_document_tokens: int = 1024
    max_member_tokens: int | None = None
    max_tokens: int = 256
    budget_file: str | None = None
    clients: dict[str, AggregateClient] | None = None
    allow_foreign_ledger: bool = False
    answer_tokens: int = 32
    answer_instruction: str = ANSWER_INSTRUCTION
    on_empty: str = "public"
    answer_members: int | None = None
    answer_vocabulary: str = "any"
    answer_member: str = "model"
    allow_batch_variance: bool = False
    operator_key_sha256: str | None = None
    per_document_epsilon: float | None = None
    per_document_delta: float | None = None
    reuse_answers: bool = True
    answer_batch: int | None = None

    def __post_init__(self) -> None:
        _choice(self.mechanism, (*AGGREGATION_MECHANISMS, ANSWER), "aggregate.mechanism")
        if self.answer_batch is not None:
            _check(check_count, self.answer_batch, "aggregate.answer_batch")
            if self.mechanism != ANSWER or self.answer_member != "model" or self.answer_members is not None:
                raise ConfigError("aggregate.answer_batch needs mechanism: answer, answer_member: model and one "
                                  "member per document (aggregate.answer_members unset)")
        if not isinstance(self.reuse_answers, bool):
            raise ConfigError(f"aggregate.reuse_answers must be true or false, got {self.reuse_answers!r}")
        if not isinstance(self.allow_batch_variance, bool):
            raise ConfigError(f"aggregate.allow_batch_variance must be true or false, got {self.allow_batch_variance!r}")
        _choice(self.on_empty, ON_EMPTY, "aggregate.on_empty")
        _choice(self.answer_vocabulary, ANSWER_VOCABULARIES, "aggregate.answer_vocabulary")
        _choice(self.answer_member, ANSWER_MEMBERS, "aggregate.answer_member")
        _check(check_count, self.answer_tokens, "aggregate.answer_tokens")
        if self.answer_members is not None:
            _check(check_count, self.answer_members, "aggregate.answer_members")
        if not isinstance(self.answer_instruction, str) or not self.answer_instruction.strip():
            raise ConfigError(f"aggregate.answer_instruction must be a non-empty text, got {self.answer_instruction!r}")
        _choice(self.gate, GATES, "aggregate.gate")
        for name in ("epsilon", "total_epsilon"):
            _check_field(self, name, check_epsilon, f"aggregate.{name}")
        for name in ("delta", "total_delta"):
            _check_field(self, name, check_delta, f"aggregate.{name}")
        _check_field(self, "clip", check_positive, "aggregate.clip")
        _check_field(self, "confidence", check_positive, "aggregate.confidence")
        if self.confidence > 1.0:
            raise ConfigError(f"aggregate.confidence must lie in (0, 1] (1: off), got {self.confidence!r}")
        for name in ("members", "max_private_tokens", "max_document_tokens", "max_tokens"):
            _check(check_count, getattr(self, name), f"aggregate.{name}")
        if self.max_member_tokens is not None:
            _check(check_count, self.max_member_tokens, "aggregate.max_member_tokens")
        if self.candidates is not None:
            _check(check_count, self.candidates, "aggregate.candidates")
        if self.max_epsilon is not None:
            _check_field(self, "max_epsilon", check_epsilon, "aggregate.max_epsilon")
        if self.epsilon > self.cap:
            raise ConfigError(f"aggregate.epsilon={self.epsilon:g} exceeds aggregate.max_epsilon={self.cap:g}")
        if self.cap > self.total_epsilon:
            raise ConfigError(f"aggregate.total_epsilon={self.total_epsilon:g} cannot pay for one query of "
                              f"epsilon {self.cap:g}")
        if self.delta > self.total_delta:
            raise ConfigError(f"aggregate.total_delta={self.total_delta:g} is below one query's delta {self.delta:g}")
        if self.min_epsilon is None:
            object.__setattr__(self, "min_epsilon", self.epsilon * DEFAULT_MIN_EPSILON_FRACTION)
        _check_field(self, "min_epsilon", check_epsilon, "aggregate.min_epsilon")
        if self.min_epsilon > self.epsilon:
            raise ConfigError(f"aggregate.min_epsilon={self.min_epsilon:g} exceeds aggregate.epsilon={self.epsilon:g}")
        object.__setattr__(self, "clients", _aggregate_clients(self.clients, self.total_epsilon, self.min_epsilon))
        if self.operator_key_sha256 is not None:
            object.__setattr__(self, "operator_key_sha256", _operator_key(self.operator_key_sha256, self.clients))
        for name in ("gate_share", "threshold"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"aggregate.{name} must lie in [0, 1), got {value!r}")
        if self.gate == "svt" and self.gate_share == 0.0:
            raise ConfigError("aggregate.gate_share must be > 0 with gate svt (the gate spends budget)")
        if self.budget_file is not None and not isinstance(self.budget_file, str):
            raise ConfigError(f"aggregate.budget_file must be a file path, got {self.budget_file!r}")
        if not isinstance(self.allow_foreign_ledger, bool):
            raise ConfigError(f"aggregate.allow_foreign_ledger must be true or false, got {self.allow_foreign_ledger!r}")
        _check_collections(self.contexts, "aggregate.contexts")
        self._check_per_document()

    def _check_per_document(self) -> None:
        if self.per_document_epsilon is None:
            if self.per_document_delta is not None:
                raise ConfigError("aggregate.per_document_delta is set without aggregate.per_document_epsilon")
            return
        if self.mechanism != ANSWER or self.answer_members is not None:
            raise ConfigError("aggregate.per_document_epsilon needs mechanism: answer with one member per document "
                              "(aggregate.answer_members unset): a document is charged when its own member votes")
        _check_field(self, "per_document_epsilon", check_epsilon, "aggregate.per_document_epsilon")
        if self.per_document_delta is None:
            object.__setattr__(self, "per_document_delta", self.total_delta)
        _check_field(self, "per_document_delta", check_delta, "aggregate.per_document_delta")
        if self.cap > self.per_document_epsilon:
            raise ConfigError(f"aggregate.per_document_epsilon={self.per_document_epsilon:g} cannot pay for one "
                              f"query of epsilon {self.cap:g}")
        if self.delta > self.per_document_delta:
            raise ConfigError(f"aggregate.per_document_delta={self.per_document_delta:g} is below one query's "
                              f"delta {self.delta:g}")

    @property
    def per_document(self) -> bool:
        """Whether budgets are per document (``per_document_epsilon``): a query charges only the
        documents whose member votes, each up to its cap; the collection has no total."""
        return self.per_document_epsilon is not None

    @property
    def reads_members(self) -> bool:
        """Whether a query's members read their documents by rule (``mechanism: answer`` with
        ``answer_member: extract``): no member decodes, nothing private enters an engine batch."""
        return self.mechanism == ANSWER and self.answer_member == "extract"

    @property
    def cap(self) -> float:
        """The largest per-query epsilon a request may ask for."""
        return self.epsilon if self.max_epsilon is None else self.max_epsilon

    def client_for_key(self, api_key: str) -> AggregateClient | None:
        """The configured client whose ``api_key_sha256`` is the SHA-256 of ``api_key`` (a
        request's bearer key), or None (compared in constant time)."""
        digest = hashlib.sha256(api_key.encode("utf-8")).hexdigest()
        found = None
        for client in self.clients.values():
            if hmac.compare_digest(client.api_key_sha256, digest):
                found = client
        return found

    def is_operator_key(self, api_key: str) -> bool:
        """Whether ``api_key`` (a request's bearer key) is the operator's (``operator_key_sha256``;
        compared in constant time on the hash)."""
        digest = hashlib.sha256(api_key.encode("utf-8")).hexdigest()
        return self.operator_key_sha256 is not None and hmac.compare_digest(self.operator_key_sha256, digest)

    @property
    def choices(self) -> int | None:
        """The candidates a private step chooses among (None: the whole vocabulary)."""
        if self.candidates is None and self.mechanism == "expmech":
            return EXPMECH_CANDIDATES
        return self.candidates

    @property
    def gate_fraction(self) -> float:
        """The share of each private step's epsilon the gate spends (0 without one)."""
        return self.gate_share if self.gate == "svt" else 0.0

    def collection_sources(self) -> dict[str, str]:
        """name -> source, in order (the first is the default)."""
        return collection_sources(self.contexts, "aggregate.contexts")


def collection_sources(contexts: dict[str, str] | str, where: str) -> dict[str, str]:
    """name -> source of a ``contexts`` setting (a mapping, or a directory of ``*.jsonl``
    collections named by their stem), in order."""
    if isinstance(contexts, dict):
        return dict(contexts)
    files = sorted(Path(contexts).glob("*.jsonl"))
    if not files:
        raise ConfigError(f"{where}: no .jsonl collections in {contexts!r}")
    for p in files:
        _check_context_name(p.stem, where)
    return {p.stem: str(p) for p in files}


def _check_collections(contexts: Any, where: str) -> None:
    if isinstance(contexts, dict):
        if not contexts:
            raise ConfigError(f"{where} must name at least one document collection")
        for name, path in contexts.items():
            _check_context_name(name, where)
            if not isinstance(path, str):
                raise ConfigError(f"{where}.{name} must be a file or directory path, got {path!r}")
    elif not isinstance(contexts, str):
        raise ConfigError(f"{where} must be a mapping name -> JSONL file or directory, or a "
                          f"directory of .jsonl collections, got {type(contexts).__name__}")


@dataclass(frozen=True)
class FactSheetPrivacyConfig:
    """A DP fact sheet per document collection, released once (``dp_privacy.fact_sheet``).

    Unit: one document (add/remove), for the whole collection and every query ever answered from
    it. At start-up each collection's documents give their fact keys (``aggregate.facts``: each
    sentence's two rarest phrases, at most ``facts_per_document`` keys a document) and one DP set
    union (discrete Laplace thresholding, ``l0 = facts_per_document``, at (``epsilon``,
    ``delta``), noise keyed by the deployment's secret key so a restart reproduces the sheet)
    releases the keys many documents give. The release is recorded in the release ledger (a
    second release of a collection under other noise is refused unless ``allow_rerelease``).
    Queries then get the sheet as a plain system context and spend nothing.
    ``per_document_epsilon`` / ``per_document_delta`` (default: 100 x ``delta``): each document's
    lifetime cap in the per-document ledger the aggregation uses (``privacy.document_ledger``):
    every release charges each document it reads, so the release of a changed collection (a new
    subject) is charged to the documents already released, and a document without room for it is
    left out of it; a restart reproduces the sheet from its recorded reservation. ``contexts`` as in
    ``aggregate``; a request picks one with ``vllm_xargs.dp_context``; documents over
    ``max_document_tokens`` tokens are refused at start-up.
    """

    contexts: dict[str, str] | str
    epsilon: float = 4.0
    delta: float = 1e-6
    facts_per_document: int = 2
    max_document_tokens: int = 1024
    allow_rerelease: bool = False
    per_document_epsilon: float | None = None
    per_document_delta: float | None = None

    def __post_init__(self) -> None:
        _check_collections(self.contexts, "fact_sheet.contexts")
        _check_field(self, "epsilon", check_epsilon, "fact_sheet.epsilon")
        _check_field(self, "delta", check_delta, "fact_sheet.delta")
        if self.per_document_epsilon is None and self.per_document_delta is not None:
            raise ConfigError("fact_sheet.per_document_delta is set without fact_sheet.per_document_epsilon")
        if self.per_document_epsilon is not None:
            _check_field(self, "per_document_epsilon", check_epsilon, "fact_sheet.per_document_epsilon")
            if self.per_document_delta is None:
                object.__setattr__(self, "per_document_delta", 100 * self.delta)
            _check_field(self, "per_document_delta", check_delta, "fact_sheet.per_document_delta")
            if self.epsilon > self.per_document_epsilon or self.delta > self.per_document_delta:
                raise ConfigError(f"fact_sheet.per_document_epsilon={self.per_document_epsilon:g} / "
                                  f"per_document_delta={self.per_document_delta:g} cannot pay for one release of "
                                  f"({self.epsilon:g}, {self.delta:g})")
        for name in ("facts_per_document", "max_document_tokens"):
            _check(check_count, getattr(self, name), f"fact_sheet.{name}")
        if not isinstance(self.allow_rerelease, bool):
            raise ConfigError(f"fact_sheet.allow_rerelease must be true or false, got {self.allow_rerelease!r}")

    def collection_sources(self) -> dict[str, str]:
        """name -> source, in order (the first is the default)."""
        return collection_sources(self.contexts, "fact_sheet.contexts")


EXPMECH_CANDIDATES = 64  # expmech's default: every member returns this many log-probabilities a step
DEFAULT_MIN_EPSILON_FRACTION = 1 / 8  # aggregate.min_epsilon's default, of aggregate.epsilon
CLIENT_KEYS = ("api_key_sha256", "share")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class AggregateClient:
    """One client of DP aggregation (``aggregate.clients.<name>``): the hex SHA-256 of its bearer
    key and its ``share`` of every collection's total (its ``quota`` in the query ledger)."""

    name: str
    api_key_sha256: str
    share: float

    @property
    def quota(self) -> Quota:
        return Quota(self.name, self.share)


def _aggregate_clients(raw: Any, total_epsilon: float, min_epsilon: float) -> dict[str, AggregateClient]:
    """``aggregate.clients`` validated (ConfigError naming the key): name -> client, in order."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("aggregate.clients must be a non-empty mapping name -> {api_key_sha256, share}")
    clients: dict[str, AggregateClient] = {}
    for name, fields in raw.items():
        where = f"aggregate.clients.{name}"
        _check_context_name(name, "aggregate.clients", "client")
        if not isinstance(fields, dict) or set(fields) != set(CLIENT_KEYS):
            raise ConfigError(f"{where} must be a mapping with exactly the keys {list(CLIENT_KEYS)}, got {fields!r}")
        digest, share = _key_digest(fields["api_key_sha256"], f"{where}.api_key_sha256", "the client's"), fields["share"]
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
            raise ConfigError(f"{where}.share must lie in (0, 1] (a fraction of each collection's total), "
                              f"got {share!r}")
        if share * total_epsilon < min_epsilon:
            raise ConfigError(f"{where}.share={share:g} of aggregate.total_epsilon={total_epsilon:g} cannot pay for "
                              f"one query of aggregate.min_epsilon={min_epsilon:g}")
        if any(c.api_key_sha256 == digest for c in clients.values()):
            raise ConfigError(f"{where}.api_key_sha256 is another client's too: a key must name one client")
        clients[name] = AggregateClient(name, digest, float(share))
    return clients


def _operator_key(raw: Any, clients: dict[str, AggregateClient]) -> str:
    """``aggregate.operator_key_sha256`` validated: a digest that is no client's (the operator's
    key shows every client's spending; a client holding it would see the others')."""
    digest = _key_digest(raw, "aggregate.operator_key_sha256", "the operator's")
    for client in clients.values():
        if client.api_key_sha256 == digest:
            raise ConfigError(f"aggregate.operator_key_sha256 is the key of client {client.name!r} too: the "
                              "operator's key must be its own")
    return digest


def _key_digest(raw: Any, key: str, whose: str) -> str:
    """``raw``, the configuration ``key``, as a lower-case SHA-256 hex digest (ConfigError naming
    ``key`` otherwise): keys are never configured, only their hashes."""
    if not isinstance(raw, str) or not SHA256_HEX.fullmatch(raw.lower()):
        raise ConfigError(f"{key} must be the 64 hex digits of the SHA-256 of {whose} bearer key (e.g. "
                          "`printf %s KEY | sha256sum`)")
    return raw.lower()
PROMPT_MODES = ("tokens", "embeddings")
FAST_DTYPES = ("auto", "float32", "bfloat16", "int8")  # prompt.fast_dtype (prompt/nearest.py)
SEARCH_DEVICES = ("auto", "cpu", "cuda")
SEARCHES = ("exact", "hnsw", "ivf")  # prompt.search: nearest-candidate search (prompt/approximate.py)


@dataclass(frozen=True)
class PromptPrivacyConfig:
    """Prompt privatization: token-level DP on the user-authored part of every prompt.

    Each user token (chat ``user`` messages, completion prompts) is replaced by a DP sample from
    the served model's candidate vocabulary; system prompt, assistant turns, template tokens and
    the private context pass through. ``epsilon``/``delta`` are PER TOKEN (``mahalanobis``/``cmp``:
    the metric epsilon per unit distance); receipts compose them over the tokens of a prompt.

    ``mechanism``: one of ``prompt.MECHANISMS``. ``effective_dim``: Remark 1's dummy dimension,
    used by ``trlap_paper`` only. ``center``/``clip_quantile``: the embedding table's centring and
    clip norm (a quantile of the centred row norms). ``topk``/``fast_dtype``: nearest-candidate
    search (speed only: ``float32`` and ``int8`` are certified, the same answers as float64 brute
    force; ``auto``: ``int8`` on CPU where torch's int8 GEMM is exact, ``float32`` otherwise); ``search_device``: where that search runs (``auto``: the API
    server's CUDA device when it has one, else CPU). ``search``: ``exact`` (default: the certified
    int8 or fp32 search, as ``fast_dtype`` says), or an approximate faiss-cpu index over the candidate rows built once at
    start-up, ``hnsw`` (HNSW, M 32, efSearch 128) or ``ivf`` (IVF-Flat, nlist ~ 4 sqrt(K),
    nprobe 32), whose best 8 (at most ``topk``) are re-ranked exactly; approximate search runs on CPU and is
    post-processing of the noisy vector, so it moves utility and speed, never privacy (``expmech``
    always samples over exact distances). Measured on SmolLM2-135M (``benchmarks.lib.prompt_search``), neither keeps token
    preservation within 1 pp of exact search (DP noise puts the queries far from every row, where
    graph and partition indexes lose recall), so ``exact`` stays the default. ``allow_request_override``: requests may pick mechanism and
    epsilon (``vllm_xargs``: ``dp_mechanism``, ``dp_epsilon``), capped by ``max_epsilon`` when set.
    ``cache_history``/``cache_size``: reuse the privatized ids of earlier user turns of the same
    conversation and of retried requests (LRU of ``cache_size`` segments) instead of re-noising.
    ``mode``: ``tokens`` (privatized ids go to the engine) or ``embeddings`` (noisy embeddings
    through vLLM's ``prompt_embeds``; needs ``--enable-prompt-embeds``).

    ``mechanism: paraphrase`` (``prompt.paraphrase``, chat requests of the OpenAI server): the
    served engine rewrites each user message first, ``epsilon`` per OUTPUT token over any two
    messages, at most ``paraphrase_max_tokens`` tokens per message (a public cap; the receipt
    composes over it), utilities clipped to ``paraphrase_width`` below the top logit, prompt
    ``paraphrase_template`` (``{text}`` = the message); a chat with more than
    ``paraphrase_max_messages`` user texts, or one longer than ``paraphrase_max_input_tokens``
    tokens, is refused before anything is rewritten (each rewrite is an engine request that sees
    the raw text).
    """

    mechanism: str = "trlap_corrected"
    epsilon: float = 10.0
    delta: float = 1e-6
    effective_dim: int | None = None
    center: bool = True
    clip_quantile: float = 0.5
    topk: int = 32
    fast_dtype: str = "auto"
    search_device: str = "auto"
    search: str = "exact"
    allow_request_override: bool = True
    max_epsilon: float | None = None
    cache_history: bool = True
    cache_size: int = 4096
    mode: str = "tokens"
    paraphrase_width: float = DEFAULT_WIDTH
    paraphrase_max_tokens: int = DEFAULT_MAX_TOKENS
    paraphrase_template: str = DEFAULT_TEMPLATE
    paraphrase_max_messages: int = 8
    paraphrase_max_input_tokens: int = 1024

    def __post_init__(self) -> None:
        _choice(self.mechanism, PROMPT_MECHANISMS, "prompt.mechanism")
        _check_field(self, "paraphrase_width", check_positive, "prompt.paraphrase_width")
        for name in ("paraphrase_max_tokens", "paraphrase_max_messages", "paraphrase_max_input_tokens"):
            _check(check_count, getattr(self, name), f"prompt.{name}")
        try:
            rewrite_prompt("", self.paraphrase_template)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"prompt.paraphrase_template: {exc}") from None
        if self.mechanism == PARAPHRASE and self.mode != "tokens":
            raise ConfigError("prompt.mechanism paraphrase rewrites text: it needs prompt.mode tokens")
        _check_field(self, "epsilon", check_epsilon, "prompt.epsilon")
        _check_field(self, "delta", check_delta, "prompt.delta")
        if self.effective_dim is not None:
            _check(check_count, self.effective_dim, "prompt.effective_dim")
        for name in ("center", "allow_request_override", "cache_history"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"prompt.{name} must be true or false, got {getattr(self, name)!r}")
        _check_field(self, "clip_quantile", check_positive, "prompt.clip_quantile")
        if not self.clip_quantile <= 1.0:
            raise ConfigError(f"prompt.clip_quantile must lie in (0, 1], got {self.clip_quantile!r}")
        _check(check_count, self.topk, "prompt.topk")
        _check(check_count, self.cache_size, "prompt.cache_size")
        _choice(self.fast_dtype, FAST_DTYPES, "prompt.fast_dtype")
        _choice(self.search_device, SEARCH_DEVICES, "prompt.search_device")
        _choice(self.search, SEARCHES, "prompt.search")
        _choice(self.mode, PROMPT_MODES, "prompt.mode")
        if self.max_epsilon is not None:
            _check_field(self, "max_epsilon", check_epsilon, "prompt.max_epsilon")
            if self.epsilon > self.max_epsilon:
                raise ConfigError(
                    f"prompt.epsilon={self.epsilon:g} exceeds prompt.max_epsilon={self.max_epsilon:g}"
                )


@dataclass(frozen=True)
class DPPrivacyConfig:
    """Top-level ``dp_privacy`` section.

    ``enabled`` means DP attention (the ``attention`` section: the attention backend's switch);
    ``prompt_enabled`` means prompt privatization (the ``prompt`` section: the renderer's);
    ``aggregate`` is DP aggregation at the output (the API server answers chat and completions
    itself); ``fact_sheet`` a DP fact sheet released once per collection and served as a plain
    context. ``attention``, ``aggregate`` and ``fact_sheet`` exclude each other.
    ``key_file``: the secret noise key (default ``$VLLM_DP_KEY_FILE`` or
    ``~/.config/vllm-dp/noise.key``); ``ledger``: where every budget record lives (releases and
    queries): a SQLite file (default ``ledger.sqlite`` beside the key) or a PostgreSQL URL
    (``postgresql://user@host/db``, shared by every server of one collection); ``ledger_file``: a
    JSONL release ledger of an earlier version, imported into ``ledger`` at the first start
    (default ``releases.jsonl`` beside the key). Keep the key and the ledger for the life of the
    deployment: a new key draws new noise, i.e. releases the private context again.
    """

    key_file: str | None = None
    ledger: str | None = None
    ledger_file: str | None = None
    attention: AttentionPrivacyConfig | None = None
    prompt: PromptPrivacyConfig | None = None
    aggregate: AggregatePrivacyConfig | None = None
    fact_sheet: FactSheetPrivacyConfig | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DPPrivacyConfig:
        """Validate a ``dp_privacy`` mapping; raises ``ConfigError`` naming the bad key."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{CONFIG_KEY} must be a mapping, got {type(raw).__name__}")
        _no_unknown_keys(raw, cls, CONFIG_KEY)
        sections = {"attention": AttentionPrivacyConfig, "prompt": PromptPrivacyConfig,
                    "aggregate": AggregatePrivacyConfig, "fact_sheet": FactSheetPrivacyConfig}
        parsed: dict[str, Any] = {name: raw.get(name) for name in ("key_file", "ledger", "ledger_file")}
        for name, value in parsed.items():
            if value is not None and (not isinstance(value, str) or not value):
                what = "a SQLite file path or a postgresql:// URL" if name == "ledger" else "a file path"
                raise ConfigError(f"{CONFIG_KEY}.{name} must be {what}, got {value!r}")
        for name, section_cls in sections.items():
            if raw.get(name) is not None:
                parsed[name] = _build(section_cls, raw[name], f"{CONFIG_KEY}.{name}")
        given = [name for name in ("attention", "aggregate", "fact_sheet") if parsed.get(name) is not None]
        if len(given) > 1:
            raise ConfigError(f"{CONFIG_KEY}: give one private-context section of `attention` (DP attention), "
                              f"`aggregate` (DP aggregation at the output) and `fact_sheet` (a DP fact sheet), "
                              f"not {' and '.join(given)}")
        if parsed.get("fact_sheet") is not None and parsed.get("prompt") is not None:
            raise ConfigError(f"{CONFIG_KEY}: `fact_sheet` cannot be combined with `prompt` yet (its requests are "
                              "rewritten before the prompt renderer)")
        if parsed.get("aggregate") is not None and parsed.get("prompt") is not None:
            raise ConfigError(f"{CONFIG_KEY}: `aggregate` cannot be combined with `prompt` yet (its requests "
                              "do not pass through the prompt renderer)")
        return cls(**parsed)

    @classmethod
    def from_file(cls, path: str | Path) -> DPPrivacyConfig:
        """Load YAML or JSON; the file may hold the section itself or ``{dp_privacy: {...}}``.
        Relative file paths in it stay as written (``section_from_file`` resolves them)."""
        return cls.from_dict(_read_section(path))

    def ledger_store(self, key):
        """The deployment's ledger store (``ledger``) for noise key ``key``, with the JSONL
        ledgers of earlier versions (``ledger_file``, ``aggregate.budget_file``) imported.
        Raises ``ConfigError`` naming the key when it cannot be opened or imported."""
        from .privacy.ledger_migration import LedgerMigrationError, open_ledger
        from .privacy.ledger_store import LedgerUnavailable

        budget_file = self.aggregate.budget_file if self.aggregate is not None else None
        try:
            return open_ledger(self.ledger, key, budget_file, self.ledger_file)
        except (LedgerUnavailable, LedgerMigrationError) as exc:
            raise ConfigError(f"{CONFIG_KEY}.ledger: {exc}") from None

    @property
    def enabled(self) -> bool:
        """DP attention is on (the attention backend stays a pass-through otherwise)."""
        return self.attention is not None

    @property
    def prompt_enabled(self) -> bool:
        """Prompt privatization is on (the ``prompt`` section is present)."""
        return self.prompt is not None


def section_json(raw: Any) -> str:
    """The raw ``dp_privacy`` section (None: absent) as JSON text, in the order given (the first
    of ``attention.contexts`` is the default context): what identifies a configuration."""
    try:
        return json.dumps({} if raw is None else raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{CONFIG_KEY} must hold plain JSON values (mappings, lists, strings, "
                          f"numbers, booleans, null): {exc}") from None


def parse_section(raw: Any) -> DPPrivacyConfig:
    """``DPPrivacyConfig.from_dict(raw)``, parsed and validated once per process and distinct
    section (cached by ``section_json``): every caller gets the same typed object."""
    return config_from_json(section_json(raw))


@functools.lru_cache(maxsize=8)
def config_from_json(text: str) -> DPPrivacyConfig:
    """The typed configuration of a ``section_json`` text (cached; errors are not)."""
    return DPPrivacyConfig.from_dict(json.loads(text))


def section_from_file(path: str | Path) -> Any:
    """The raw ``dp_privacy`` section of a YAML/JSON file with its file paths made absolute
    relative to the file (a server or ``vllm-dp account`` can then run from anywhere); parse it
    with ``parse_section``."""
    raw = _read_section(path)
    base = Path(path).resolve().parent
    if not isinstance(raw, dict):
        return raw
    for name in ("key_file", "ledger", "ledger_file"):
        if isinstance(raw.get(name), str) and not (name == "ledger" and is_postgres(raw[name])):
            raw[name] = str(base / raw[name])
    for section in ("aggregate", "fact_sheet"):
        agg = raw.get(section)
        if not isinstance(agg, dict):
            continue
        for name in ("contexts", "budget_file"):
            if isinstance(agg.get(name), str):
                agg[name] = str(base / agg[name])
        if isinstance(agg.get("contexts"), dict):
            agg["contexts"] = {n: str(base / f) if isinstance(f, str) else f for n, f in agg["contexts"].items()}
    att = raw.get("attention")
    if not isinstance(att, dict):
        return raw
    for name in ("private_context", "calibration", "contexts"):
        if isinstance(att.get(name), str):
            att[name] = str(base / att[name])
    if isinstance(att.get("contexts"), dict):
        att["contexts"] = {
            name: str(base / file) if isinstance(file, str) else file for name, file in att["contexts"].items()
        }
    return raw


def _read_section(path: str | Path) -> Any:
    import yaml

    text = Path(path).read_text()
    raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if isinstance(raw, dict) and CONFIG_KEY in raw:
        raw = raw[CONFIG_KEY]
    return raw or {}


def _build(section_cls: type, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    _no_unknown_keys(raw, section_cls, where)
    missing = [
        f.name
        for f in dataclasses.fields(section_cls)
        if f.default is dataclasses.MISSING and f.name not in raw
    ]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}")
    try:
        return section_cls(**raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _no_unknown_keys(raw: dict, section_cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(section_cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys are {sorted(known)}")


def _check(check, value, name: str):
    try:
        return check(value, name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_field(config, field: str, check, name: str) -> None:
    """Check a number field and store it as the float the check returns: YAML reads ``1e-6``
    (no dot) as the string "1e-6", which must not reach the accountant as a string."""
    object.__setattr__(config, field, _check(check, getattr(config, field), name))


def _choice(value: str, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
