"""Prompt privatization per request: options, segments, history cache, receipts. No vLLM import.

The serving adapter (``serving/renderer.py``) and ``vllm-dp privatize`` share this module:

* **Options.** A request may pick the mechanism and the per-token epsilon (``vllm_xargs``
  ``{"dp_mechanism": "laplace", "dp_epsilon": 5}``, or ``prompt_request(...)`` around ``LLM``
  calls) when the deployment allows it; ``resolve_options`` validates them against the
  ``dp_privacy.prompt`` section and raises ``PromptOptionError`` (a ``ValueError``: HTTP 400)
  with the option's name.
* **Segments** (trlaplace spec 6.2.5). A prompt is a sequence of ``Segment`` s, each tokenised on
  its own: template pieces (system prompt, assistant turns, role markers) pass through, user
  segments are private. ``split_rendered`` locates user content in a chat template rendered
  with sentinels; ``splice`` concatenates the pieces and returns the exact private mask;
  ``truncate_segments`` applies vLLM's prompt truncation before privatizing. For completions,
  ``added_mask`` makes the tokenizer's added specials public and every text token private.
* **History cache** (spec 6.2.7). A user segment is privatized once per *namespace*: its
  privatized ids are stored under the deployment's keyed MAC (``NoiseKey.mac``) of the namespace,
  the mechanism, epsilon, delta, mode, the segment's own ids and its position (message index and
  the conversation up to and including that message; for completions the whole prompt and the
  run's start), so a later turn of the same conversation, or a retried request, reuses them
  instead of drawing (and spending) again. Bounded LRU. The namespace is the request's
  ``dp_session`` (a client-chosen secret of at least ``MIN_SESSION_CHARS`` characters) together
  with its credential (``Authorization`` / ``x-api-key`` header). Without a ``dp_session`` nothing
  is cached or reused: a shared namespace would be a membership oracle (a client replaying a
  guessed text would see ``tokens_reused > 0`` and a faster reply), and the server cannot tell
  whether an API key belongs to one client or is shared by all of them.
* **Receipts** (spec 6.2.9). ``PromptReceipt`` states the per-token guarantee, how many tokens
  were privatized in this prompt, how many of them were noised now (the budget this request
  spent) versus reused from the cache, and the composition (basic, advanced and the smaller)
  over both counts. It contains no text, no ids and nothing about the noise seed.
* ``PromptPrivacy`` puts it together: cached privatizers per (mechanism, epsilon, delta), one
  generator per request for the tokens not in the cache, its whole mt19937 state drawn from
  256 bits of OS entropy (``keyed_noise.fresh_generator``; ``manual_seed`` would keep 32 bits).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.nearest_reference import fast_topk_torch, select_within_bound
from ..kernels.types import FastPass, SelectPass
from ..privacy.accountant import Budget
from ..privacy.keyed_noise import fresh_generator, seeded_generator
from .mechanisms import MECHANISMS, token_mechanism
from .privatizer import PrivacyReceipt, TokenPrivatizer, candidate_index
from .table import EmbeddingTable

OPTION_PREFIX = "dp_"
OPTION_MECHANISM = "dp_mechanism"
OPTION_EPSILON = "dp_epsilon"
OPTION_SESSION = "dp_session"
OPTION_CONTEXT = "dp_context"  # which private context (attention.contexts): serving.context.select_context
OPTIONS = (OPTION_MECHANISM, OPTION_EPSILON, OPTION_SESSION, OPTION_CONTEXT)
OVERRIDES = (OPTION_MECHANISM, OPTION_EPSILON)  # need allow_request_override
MIN_SESSION_CHARS = 22  # a secret: 22 characters of secrets.token_urlsafe are 132 bits
MAX_SESSION_CHARS = 256
CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")  # what identifies the client, if anything
PRIVATIZER_CACHE = 8  # (mechanism, epsilon, delta) privatizers kept per process


class PromptOptionError(ValueError):
    """A per-request prompt-privacy option that cannot be honoured (the message names it)."""


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class PromptOptions:
    """What one request is privatized with. ``session``: the client's secret history-cache
    namespace (None: nothing is cached or reused); ``credential``: the client's credential
    (``PromptRequest.credential``), part of the namespace, so two clients that pick the same
    session never share. Both SECRET: never logged (not in ``repr``)."""

    mechanism: str
    epsilon: float
    delta: float
    mode: str = "tokens"
    session: str | None = field(default=None, repr=False)
    credential: bytes = field(default=b"", repr=False)


def option_overrides(xargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``dp_*`` entries of a request's ``vllm_xargs`` (everything else is not ours)."""
    if not isinstance(xargs, Mapping):
        return {}
    return {k: v for k, v in xargs.items() if isinstance(k, str) and k.startswith(OPTION_PREFIX)}


def resolve_options(overrides: Mapping[str, Any] | None, cfg, credential: bytes = b"") -> PromptOptions:
    """Validate a request's ``dp_*`` options against ``cfg`` (a ``PromptPrivacyConfig``);
    ``credential``: the request's (``PromptRequest.credential``).

    Unknown ``dp_*`` names, a mechanism outside ``MECHANISMS``, an epsilon that is not a finite
    number > 0 or exceeds ``max_epsilon``, a session that is not a string of
    ``MIN_SESSION_CHARS`` to ``MAX_SESSION_CHARS`` characters, and mechanism/epsilon overrides on
    a deployment with ``allow_request_override: false`` raise ``PromptOptionError`` naming the
    option. ``dp_context`` (the private context, checked by the renderer) does not change
    privatization.
    """
    overrides = dict(overrides or {})
    check_option_names(overrides, OPTIONS)
    asked = [k for k in OVERRIDES if overrides.get(k) is not None]
    if asked and not cfg.allow_request_override:
        raise PromptOptionError(
            f"vllm_xargs.{asked[0]} is not allowed: this deployment fixes the prompt privacy "
            f"mechanism and epsilon (prompt.allow_request_override is false)"
        )
    mechanism = overrides.get(OPTION_MECHANISM)
    if mechanism is None:
        mechanism = cfg.mechanism
    elif not isinstance(mechanism, str) or mechanism not in MECHANISMS:
        raise PromptOptionError(
            f"vllm_xargs.{OPTION_MECHANISM} must be one of {list(MECHANISMS)}, got {mechanism!r}"
        )
    epsilon = overrides.get(OPTION_EPSILON)
    if epsilon is None:
        epsilon = cfg.epsilon
    else:
        epsilon = _request_epsilon(epsilon, cfg.max_epsilon)
    session = overrides.get(OPTION_SESSION)
    if session is not None and (
        not isinstance(session, str) or not MIN_SESSION_CHARS <= len(session) <= MAX_SESSION_CHARS
    ):
        raise PromptOptionError(
            f"vllm_xargs.{OPTION_SESSION} must be a secret string of {MIN_SESSION_CHARS} to "
            f"{MAX_SESSION_CHARS} characters (e.g. secrets.token_urlsafe(16)): it namespaces the "
            "history cache, and whoever can guess it can test which texts were sent in it"
        )
    return PromptOptions(mechanism, float(epsilon), float(cfg.delta), cfg.mode, session, bytes(credential))


def check_option_names(overrides: Mapping[str, Any], known: Sequence[str]) -> None:
    """``PromptOptionError`` naming the ``dp_*`` options of ``overrides`` not in ``known``."""
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise PromptOptionError(
            f"unknown prompt privacy option(s) {unknown} in vllm_xargs; known options are {list(known)}"
        )


def _request_epsilon(value: Any, max_epsilon: float | None) -> float:
    name = f"vllm_xargs.{OPTION_EPSILON}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PromptOptionError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise PromptOptionError(f"{name} must be finite, got {value!r}")
    if value <= 0:
        raise PromptOptionError(f"{name} must be > 0, got {value!r}")
    if max_epsilon is not None and value > max_epsilon:
        raise PromptOptionError(
            f"{name}={value:g} exceeds this deployment's prompt.max_epsilon={max_epsilon:g}"
        )
    return value


# ------------------------------------------------------------------- per-request context


@dataclass
class PromptRequest:
    """One request's ``dp_*`` options (unvalidated), its client's ``credential`` (part of the
    history-cache namespace; SECRET, not in ``repr``) and the receipts of its prompts, in order.

    The HTTP layer creates one per request (``from_http``); ``LLM`` users use ``prompt_request``.
    The renderer reads it through ``current_request`` (a context variable: copied into the
    request's tasks).
    """

    overrides: dict[str, Any] = field(default_factory=dict)
    receipts: list[dict | None] = field(default_factory=list)
    credential: bytes = field(default=b"", repr=False)

    @classmethod
    def from_http(cls, overrides: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]) -> PromptRequest:
        """The request of an HTTP call with ASGI ``headers``: its credential is the values of the
        ``CREDENTIAL_HEADERS`` (empty when absent), length-prefixed, in that order."""
        found = dict.fromkeys(CREDENTIAL_HEADERS, b"")
        for name, value in headers:
            if name.lower() in found:
                found[name.lower()] = bytes(value)
        return cls(overrides, credential=b"".join(len(v).to_bytes(4, "big") + v for v in found.values()))

    def reserve(self) -> int:
        """A slot for the receipt of the next prompt (keeps prompt order under concurrency)."""
        self.receipts.append(None)
        return len(self.receipts) - 1


_CURRENT: contextvars.ContextVar[PromptRequest | None] = contextvars.ContextVar(
    "vllm_dp_prompt_request", default=None
)


def current_request() -> PromptRequest | None:
    """The ``PromptRequest`` of the request being rendered, if the caller set one."""
    return _CURRENT.get()


@contextlib.contextmanager
def prompt_request(**options: Any) -> Iterator[PromptRequest]:
    """Per-request options and receipts around ``LLM`` calls (the renderer runs in the caller's
    thread there), e.g. ``with prompt_request(dp_epsilon=5.0) as req: llm.generate(...)``; then
    ``req.receipts`` holds one receipt per prompt rendered inside the block."""
    unknown = sorted(k for k in options if not k.startswith(OPTION_PREFIX))
    if unknown:
        raise PromptOptionError(f"prompt options are named dp_*, got {unknown}")
    request = PromptRequest(dict(options))
    token = _CURRENT.set(request)
    try:
        yield request
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def bound_request(request: PromptRequest) -> Iterator[PromptRequest]:
    """Make ``request`` current for the block (the HTTP middleware's entry point)."""
    token = _CURRENT.set(request)
    try:
        yield request
    finally:
        _CURRENT.reset(token)


# ------------------------------------------------------------------------------ segments


@dataclass(frozen=True)
class Segment:
    """Token ids tokenised on their own. ``private``: user content (privatized); ``cache_key``:
    what identifies it in the history cache (None: never cached)."""

    ids: tuple[int, ...]
    private: bool
    cache_key: Any = None


def splice(segments: Sequence[Segment]) -> tuple[list[int], list[bool]]:
    """Concatenated ids and the exact private mask (True at every position of a private segment)."""
    ids: list[int] = []
    mask: list[bool] = []
    for segment in segments:
        ids.extend(segment.ids)
        mask.extend([segment.private] * len(segment.ids))
    return ids, mask


def make_sentinels(count: int, nonce: str | None = None) -> list[str]:
    """``count`` distinct markers that survive chat templates (private-use code points around
    digits: unaffected by trim/upper/lower) and that no user text contains by accident."""
    nonce = nonce if nonce is not None else str(int.from_bytes(os.urandom(6), "big"))
    return [f"\ue000{nonce}.{i}\ue001" for i in range(count)]


def split_rendered(rendered: str, sentinels: Sequence[str]) -> list[str]:
    """Split a template rendered with ``sentinels`` (in place of the user texts, in order) into the
    ``len(sentinels) + 1`` template pieces around them; each sentinel must occur exactly once,
    in order (else the template reorders, drops or duplicates user content: ValueError)."""
    pieces, pos = [], 0
    for sentinel in sentinels:
        at = rendered.find(sentinel, pos)
        if at < 0 or rendered.count(sentinel) != 1:
            raise ValueError(
                "the chat template does not place each user text exactly once, in order: "
                "user segments cannot be located for prompt privatization"
            )
        pieces.append(rendered[pos:at])
        pos = at + len(sentinel)
    pieces.append(rendered[pos:])
    return pieces


def recover_user_texts(rendered: str, pieces: Sequence[str], texts: Sequence[str]) -> list[str]:
    """The user texts exactly as the template placed them in ``rendered`` (the real rendering),
    given its template ``pieces`` (``split_rendered``) and the raw ``texts``. Templates may strip
    user content; the placed text must be the raw text or one of its strip variants, and the
    pieces plus placed texts must rebuild ``rendered`` exactly (else ValueError)."""
    if len(pieces) != len(texts) + 1:
        raise ValueError("need one more template piece than user texts")
    placed: list[str] = []
    pos = len(pieces[0])
    if not rendered.startswith(pieces[0]):
        raise ValueError("the chat template renders differently around user content")
    for text, after in zip(texts, pieces[1:], strict=True):
        for candidate in dict.fromkeys((text, text.strip(), text.lstrip(), text.rstrip())):
            if rendered.startswith(candidate + after, pos):
                placed.append(candidate)
                pos += len(candidate) + len(after)
                break
        else:
            raise ValueError(
                "the chat template transforms user content beyond stripping whitespace: user "
                "segments cannot be located exactly for prompt privatization"
            )
    if pos != len(rendered) or "".join(_interleave(pieces, placed)) != rendered:
        raise ValueError("the chat template renders differently around user content")
    return placed


def _interleave(pieces: Sequence[str], texts: Sequence[str]) -> Iterator[str]:
    for piece, text in zip(pieces, texts, strict=False):
        yield piece
        yield text
    yield pieces[-1]


def chat_segments(
    pieces: Sequence[str],
    user_texts: Sequence[str],
    cache_keys: Sequence[Any],
    encode: Callable[[str], list[int]],
) -> list[Segment]:
    """Segment-aware tokenisation (spec 6.2.5): every template piece and every user text is
    tokenised on its own (``encode``: text -> ids without added special tokens), so no BPE merge
    crosses a template/user boundary and the private mask is exact."""
    segments = []
    for i, piece in enumerate(pieces):
        if piece:
            segments.append(Segment(tuple(encode(piece)), False))
        if i < len(user_texts):
            segments.append(Segment(tuple(encode(user_texts[i])), True, cache_keys[i]))
    return segments


TEXT_PART_TYPES = ("text", "input_text")


@dataclass(frozen=True)
class MarkedChat:
    """``messages`` with every user text replaced by a sentinel (in order), the raw ``texts`` and
    one history-cache key per text: (message index, part index, the conversation up to and
    including that message)."""

    messages: list[dict]
    sentinels: list[str]
    texts: list[str]
    cache_keys: list[dict]


def mark_user_texts(messages: Sequence[Any], nonce: str | None = None) -> MarkedChat:
    """Find the user-authored text of a chat: the content of every ``user`` message (a string, or
    its text parts). Other roles are template. Non-text user content (images, audio, embeddings)
    cannot be privatized token by token: ValueError."""
    plain = [_as_dict(m) for m in messages]
    located: list[tuple[int, int | None, str]] = []  # (message, part or None, text)
    for i, message in enumerate(plain):
        if message.get("role") != "user" or message.get("content") is None:
            continue
        content = message["content"]
        if isinstance(content, str):
            located.append((i, None, content))
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")  # noqa: TRY004
        for j, part in enumerate(content):
            if isinstance(part, str):
                located.append((i, j, part))
            elif isinstance(part, Mapping) and part.get("type") in TEXT_PART_TYPES:
                located.append((i, j, str(part.get("text", ""))))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"messages[{i}].content[{j}] is a {kind!r} part: prompt privatization "
                    "supports text user content only"
                )
    sentinels = make_sentinels(len(located), nonce)
    for text in (t for _, _, t in located):
        if any(s in text for s in sentinels):
            raise ValueError("user text collides with a privatization sentinel; retry the request")
    marked = [dict(m) for m in plain]
    for (i, j, _), sentinel in zip(located, sentinels, strict=True):
        if j is None:
            marked[i]["content"] = sentinel
        else:
            parts = list(marked[i]["content"])
            part = parts[j]
            parts[j] = sentinel if isinstance(part, str) else {**part, "text": sentinel}
            marked[i]["content"] = parts
    keys = [
        {"kind": "chat", "message": i, "part": j, "conversation": plain[: i + 1]}
        for i, j, _ in located
    ]
    return MarkedChat(marked, sentinels, [t for _, _, t in located], keys)


def _as_dict(message: Any) -> dict:
    if isinstance(message, Mapping):
        return dict(message)
    if hasattr(message, "model_dump"):
        return message.model_dump(exclude_none=True)
    raise ValueError(f"chat messages must be mappings, got {type(message).__name__}")


def runs(mask: Sequence[bool]) -> list[tuple[int, int, bool]]:
    """Maximal runs ``(start, stop, private)`` of equal mask values."""
    out: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, bool(mask[start])))
            start = i
    return out


def token_segments(ids: Sequence[int], mask: Sequence[bool], cache_material: Any = None) -> list[Segment]:
    """Segments of a token prompt with a known private ``mask`` (completions). Private runs get
    the cache key ``(cache_material, run start)`` when ``cache_material`` is given."""
    if len(ids) != len(mask):
        raise ValueError("ids and mask differ in length")
    return [
        Segment(
            tuple(int(t) for t in ids[a:b]),
            private,
            {"kind": "completion", "input": cache_material, "start": a}
            if private and cache_material is not None
            else None,
        )
        for a, b, private in runs(mask)
    ]


def locate_plain(full: Sequence[int], plain: Sequence[int], special_ids: frozenset[int]) -> list[bool]:
    """Private mask over ``full`` (a text tokenised WITH the tokenizer's added special tokens):
    True at the tokens of ``plain`` (the same text tokenised without them). The added tokens must
    all be special ids; among several placements the first is taken. ValueError if none fits."""
    full, plain = list(full), list(plain)
    n, m = len(full), len(plain)
    for start in range(n - m + 1):
        if full[start : start + m] != plain:
            continue
        added = full[:start] + full[start + m :]
        if all(t in special_ids for t in added):
            return [False] * start + [True] * m + [False] * (n - start - m)
    raise ValueError("cannot align the prompt's tokens with its text: the tokenizer adds non-special tokens")


def added_special_tokens(tokenizer, special_ids: frozenset[int]) -> tuple[list[int], list[int]]:
    """(prefix, suffix): the special ids an HF ``tokenizer`` adds around any single text when
    ``add_special_tokens=True`` (e.g. ``([bos], [])`` for Llama, ``([], [])`` for most chat
    models), found by tokenising a probe text both ways. ValueError if it adds non-special ids."""
    probe = "a"
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    mask = locate_plain(full, tokenizer.encode(probe, add_special_tokens=False), special_ids)
    start, stop = mask.index(True), len(mask) - mask[::-1].index(True)
    return full[:start], full[stop:]


def added_mask(ids: Sequence[int], around: tuple[Sequence[int], Sequence[int]]) -> list[bool]:
    """Private mask over ``ids``: a text tokenised with the tokenizer's added special tokens
    ``around`` = (prefix, suffix) (``added_special_tokens``; ``([], [])`` when none are added),
    possibly truncated by the tokenizer, which cuts the text's tokens and re-adds prefix and
    suffix. The added ids are public, every other id (the text) is private. ValueError if
    ``ids`` does not start with the prefix and end with the suffix."""
    prefix, suffix = list(around[0]), list(around[1])
    inner = len(ids) - len(prefix) - len(suffix)
    if inner < 0 or list(ids[: len(prefix)]) != prefix or list(ids[len(ids) - len(suffix) :]) != suffix:
        raise ValueError("cannot align the prompt's tokens with its text: the tokenizer's added special tokens are not around it")
    return [False] * len(prefix) + [True] * inner + [False] * len(suffix)


def truncate_segments(segments: Sequence[Segment], keep: slice) -> list[Segment]:
    """The segments of ``splice(segments)[0][keep]`` (a contiguous slice: vLLM's truncation of the
    prompt, applied before privatizing so that only kept tokens are noised). A segment cut at an
    end keeps its privacy and cache key (cache keys include the segment's ids, so a cut segment
    never reuses its whole one's release)."""
    start, stop, step = keep.indices(sum(len(s.ids) for s in segments))
    if step != 1:
        raise ValueError("prompt truncation keeps a contiguous range of tokens")
    kept, pos = [], 0
    for segment in segments:
        a, b = max(start, pos), min(stop, pos + len(segment.ids))
        if a < b:
            kept.append(Segment(segment.ids[a - pos : b - pos], segment.private, segment.cache_key))
        pos += len(segment.ids)
    return kept


def truncated_mask(
    full: Sequence[int], mask: Sequence[bool], final: Sequence[int], side: str | None = None
) -> list[bool]:
    """``mask`` (over ``full``) carried over to ``final``: ``full`` itself or a left/right
    truncation of it (``truncate_prompt_tokens``); ``side`` breaks ties. ValueError otherwise."""
    full, mask, final = list(full), list(mask), list(final)
    if final == full:
        return mask
    n = len(final)
    left = n <= len(full) and full[len(full) - n :] == final
    right = n <= len(full) and full[:n] == final
    if left and (not right or side == "left" or mask[len(full) - n :] == mask[:n]):
        return mask[len(full) - n :]
    if right:
        return mask[:n]
    raise ValueError("the prompt's tokens changed after tokenisation: cannot place the private mask")


def canonical(value: Any) -> Any:
    """JSON-ready, deterministic form of chat messages (dicts, lists, pydantic models, scalars)."""
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if hasattr(value, "model_dump"):
        return canonical(value.model_dump(exclude_none=True))
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(type(value).__name__)


# ------------------------------------------------------------------------- history cache


class HistoryCache:
    """LRU of privatized segments keyed by ``mac`` (``NoiseKey.mac``: an HMAC with the
    deployment's secret key) of the request's namespace (session and credential), its options,
    a canonical description of the segment's position and the segment's own ids.

    Keys never hold text (only MAC outputs); values are privatized ids (or noisy embeddings),
    which are releases. Thread-safe.
    """

    def __init__(self, capacity: int, mac: Callable[..., bytes]):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._mac = mac
        self._items: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, options: PromptOptions, material: Any, ids: Sequence[int]) -> bytes:
        """The key of a segment with ``ids`` at ``material`` (``Segment.cache_key``) privatized
        under ``options``, whose ``session`` must be set (no session, no cache)."""
        if options.session is None:
            raise ValueError("the history cache is used only within a dp_session")
        payload = json.dumps(
            {
                "v": 2,
                "mode": options.mode,
                "mechanism": options.mechanism,
                "epsilon": options.epsilon,
                "delta": options.delta,
                "input": canonical(material),
                "ids": [int(t) for t in ids],
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode("utf-8")
        return self._mac("prompt-history", options.credential, options.session, payload)

    def get(self, key: bytes) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: bytes, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


# ------------------------------------------------------------------------------ receipts


def _budget_json(budget: Budget) -> dict:
    return {"epsilon": _finite(budget.epsilon), "delta": _finite(budget.delta)}


def _finite(value: float) -> float | str:
    """Strict-JSON number: ``inf`` (no guarantee) becomes the string ``"inf"``."""
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def _composition(receipt: PrivacyReceipt) -> dict:
    return {
        "basic": _budget_json(receipt.basic),
        "advanced": _budget_json(receipt.advanced),
        "min": _budget_json(receipt.total),
    }


@dataclass(frozen=True)
class PromptReceipt:
    """What privatizing one prompt spent. ``prompt`` composes the per-token guarantee over all
    ``tokens_privatized`` private tokens of the prompt (its protection as a whole); ``spent`` over
    the ``tokens_new`` tokens noised by this request (``tokens_reused`` came from the history
    cache and were paid for by the request that first privatized them)."""

    mode: str
    mechanism: str
    valid: bool
    statement: str
    epsilon_token: float
    delta_token: float
    tokens_privatized: int
    tokens_new: int
    tokens_reused: int
    prompt: PrivacyReceipt
    spent: PrivacyReceipt

    def to_json(self) -> dict:
        """Strict-JSON dict (no text, no token ids): what responses and logs carry."""
        return {
            "mode": self.mode,
            "mechanism": self.mechanism,
            "valid": self.valid,
            "epsilon_token": _finite(self.epsilon_token),
            "delta_token": _finite(self.delta_token),
            "tokens_privatized": self.tokens_privatized,
            "tokens_new": self.tokens_new,
            "tokens_reused": self.tokens_reused,
            "prompt_total": _composition(self.prompt),
            "spent": _composition(self.spent),
            "statement": self.statement,
        }


# --------------------------------------------------------------------------- the service


@dataclass(frozen=True)
class PrivatizedPrompt:
    """The engine's view of one privatized prompt. ``ids``: pass-through ids with private
    positions replaced (tokens mode) or set to ``placeholder_id`` (embeddings mode);
    ``mask``: the private positions; ``embeds``: ``[n, d]`` noisy rows at private positions,
    zeros elsewhere (embeddings mode only)."""

    ids: list[int]
    mask: list[bool]
    embeds: torch.Tensor | None
    receipt: PromptReceipt


class PromptPrivacy:
    """Privatizes the private segments of prompts over one ``EmbeddingTable``.

    ``cfg``: the ``PromptPrivacyConfig`` (topk, fast_dtype, effective_dim, delta, mode).
    ``cache``: the history cache, used by requests with a session (None: every request is
    noised afresh).
    ``placeholder_id``: the id put at private positions in embeddings mode.
    ``device``: where the nearest-candidate search runs (the index is copied there; noise is
    drawn on CPU in float64 either way). ``fast_pass``/``select``: that search's passes
    (``TokenPrivatizer``; e.g. Triton on CUDA, the fused CPU ``kernels.nearest_select``), speed only.
    """

    def __init__(
        self,
        table: EmbeddingTable,
        cfg,
        cache: HistoryCache | None = None,
        *,
        placeholder_id: int = 0,
        embed_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        fast_pass: FastPass = fast_topk_torch,
        select: SelectPass = select_within_bound,
    ) -> None:
        self.table = table
        self._search = {"fast_pass": fast_pass, "select": select}
        self.cfg = cfg
        self.cache = cache
        self.placeholder_id = placeholder_id
        self.embed_dtype = embed_dtype or table.embeddings.dtype
        self._privatizers: OrderedDict[tuple, TokenPrivatizer] = OrderedDict()
        fast_dtype = torch.bfloat16 if cfg.fast_dtype == "bfloat16" else torch.float32
        self.device = torch.device(device)
        self._index = candidate_index(table, fast_dtype).to(self.device)  # one copy, shared by every privatizer
        self._lock = threading.Lock()

    def options(self, overrides: Mapping[str, Any] | None = None, credential: bytes = b"") -> PromptOptions:
        return resolve_options(overrides, self.cfg, credential)

    def privatizer(self, options: PromptOptions) -> TokenPrivatizer:
        """The calibrated privatizer of (mechanism, epsilon, delta), built once and cached (LRU)."""
        key = (options.mechanism, options.epsilon, options.delta)
        with self._lock:
            found = self._privatizers.get(key)
            if found is not None:
                self._privatizers.move_to_end(key)
                return found
        with warnings.catch_warnings():  # reproduction modes warn; their receipts say so
            warnings.simplefilter("ignore")
            mechanism = token_mechanism(
                options.mechanism,
                self.table,
                options.epsilon,
                options.delta,
                effective_dim=self.cfg.effective_dim if options.mechanism == "trlap_paper" else None,
            )
        built = TokenPrivatizer(self.table, mechanism, topk=self.cfg.topk, index=self._index, **self._search)
        with self._lock:
            self._privatizers[key] = built
            while len(self._privatizers) > PRIVATIZER_CACHE:
                self._privatizers.popitem(last=False)
        return built

    def privatize(
        self,
        segments: Sequence[Segment],
        options: PromptOptions,
        *,
        seed: bytes | None = None,
    ) -> PrivatizedPrompt:
        """Privatize every private segment (within a session, cached ones are reused); pass the
        others through.

        ``seed``: >= 16 bytes seeding the noise of the segments not in the cache, for tests and
        reproducibility only (whoever knows it can re-derive the noise); default: a generator
        whose whole state comes from fresh OS entropy (``fresh_generator``).
        """
        privatizer = self.privatizer(options)
        embeddings = options.mode == "embeddings"
        cache = self.cache if options.session is not None else None
        outputs: list[Any] = [None] * len(segments)
        fresh: list[int] = []
        keys: dict[int, bytes] = {}
        reused = 0
        for i, segment in enumerate(segments):
            if not segment.private or not segment.ids:
                continue
            if cache is not None and segment.cache_key is not None:
                keys[i] = cache.key(options, segment.cache_key, segment.ids)
                cached = cache.get(keys[i])
                if cached is not None:
                    outputs[i] = cached
                    reused += len(segment.ids)
                    continue
            fresh.append(i)
        if fresh:
            generator = fresh_generator() if seed is None else seeded_generator(seed)
            ids = torch.tensor([t for i in fresh for t in segments[i].ids], dtype=torch.int64)
            everything = torch.ones_like(ids, dtype=torch.bool)
            if embeddings:
                noisy, _ = privatizer.privatize_embeddings(ids, everything, generator)
                parts = noisy.to(self.embed_dtype).split([len(segments[i].ids) for i in fresh])
            else:
                out, _ = privatizer.privatize(ids, everything, generator)
                parts = [tuple(p.tolist()) for p in out.split([len(segments[i].ids) for i in fresh])]
            for i, part in zip(fresh, parts, strict=True):
                outputs[i] = part
                if i in keys:
                    cache.put(keys[i], part)
        new = sum(len(segments[i].ids) for i in fresh)
        ids, mask = splice(segments)
        embeds = torch.zeros(len(ids), self.table.dim, dtype=self.embed_dtype) if embeddings else None
        pos = 0
        for segment, output in zip(segments, outputs, strict=True):
            n = len(segment.ids)
            if output is not None:
                if len(output) != n:  # the raw ids around it would shift into the engine's input
                    raise RuntimeError(f"a privatized segment of {len(output)} tokens cannot replace {n} tokens")
                if embeddings:
                    embeds[pos : pos + n] = output
                    ids[pos : pos + n] = [self.placeholder_id] * n
                else:
                    ids[pos : pos + n] = output
            pos += n
        receipt = self.receipt(privatizer, options, new, reused)
        return PrivatizedPrompt(ids, mask, embeds, receipt)

    @staticmethod
    def receipt(privatizer: TokenPrivatizer, options: PromptOptions, new: int, reused: int) -> PromptReceipt:
        whole = privatizer.receipt(new + reused)
        return PromptReceipt(
            mode=options.mode,
            mechanism=whole.mechanism,
            valid=whole.valid,
            statement=whole.statement,
            epsilon_token=whole.epsilon_token,
            delta_token=whole.delta_token,
            tokens_privatized=new + reused,
            tokens_new=new,
            tokens_reused=reused,
            prompt=whole,
            spent=privatizer.receipt(new),
        )
