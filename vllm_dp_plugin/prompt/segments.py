"""Segments: a prompt is a sequence of ``Segment`` s, each tokenised on its own: template pieces
(system prompt, assistant turns, role markers) pass through, user segments are private. The
privacy unit is the token, so a word split into k pieces costs k epsilon.

The renderer's one pure step per prompt is ``segment_chat`` (a chat rendered with the user
texts and with sentinels in their place: locate, tokenise, truncate) or ``segment_completion``
(a token prompt and its private mask). Their parts: ``split_rendered`` locates user content in
a chat template rendered with sentinels; ``splice`` concatenates the pieces and returns the exact
private mask; ``truncate_segments`` applies vLLM's prompt truncation before privatizing. For
completions, ``added_mask`` makes the tokenizer's added specials public and every text token
private.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


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
    """Segment-aware tokenisation: every template piece and every user text is tokenised on its
    own (``encode``: text -> ids without added special tokens), so no BPE merge crosses a
    template/user boundary and the private mask is exact."""
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


def replace_user_texts(marked: MarkedChat, texts: Sequence[str]) -> list[dict]:
    """``marked.messages`` with its sentinels replaced by ``texts`` (in order): the chat with new
    user texts (e.g. their rewrites), everything else as it was."""
    if len(texts) != len(marked.sentinels):
        raise ValueError(f"{len(texts)} texts for {len(marked.sentinels)} user texts")
    into = dict(zip(marked.sentinels, texts, strict=True))
    out = []
    for message in marked.messages:
        content = message.get("content")
        if isinstance(content, str) and content in into:
            message = {**message, "content": into[content]}
        elif isinstance(content, list):
            message = {**message, "content": [
                into.get(part, part) if isinstance(part, str)
                else {**part, "text": into[part["text"]]} if isinstance(part, Mapping) and part.get("text") in into
                else part
                for part in content
            ]}
        out.append(message)
    return out


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


# ------------------------------------------------------------- one segmentation step per prompt


def segment_chat(
    marked: MarkedChat,
    rendered: str,
    template: str,
    encode: Callable[[str], list[int]],
    *,
    truncation: Callable[[int], slice | None] | None = None,
    max_tokens: int | None = None,
) -> list[Segment]:
    """The segments of a chat, in prompt order: what to privatize (``private``) and how the
    pieces splice back (``splice``: the engine prompt's ids and exact private mask). Pure.

    ``marked``: ``mark_user_texts`` of the chat; ``rendered``: its template rendered with the user
    texts, ``template``: with ``marked.sentinels`` in their place; ``encode``: text -> ids
    without added special tokens (every template piece and user text is tokenised on its own).
    ``truncation(count)``: the contiguous slice of the ``count`` tokens the engine keeps
    (vLLM's ``truncate_prompt_tokens``; None: no truncation), applied before privatizing so only
    kept tokens are noised. Without truncation, more than ``max_tokens`` tokens is a ValueError
    naming max_model_len (refused before anything is privatized). ValueError also when the
    template reorders, drops, duplicates or transforms user content.
    """
    pieces = split_rendered(template, marked.sentinels)
    texts = recover_user_texts(rendered, pieces, marked.texts)
    segments = chat_segments(pieces, texts, marked.cache_keys, encode)
    count = sum(len(segment.ids) for segment in segments)
    keep = None if truncation is None else truncation(count)
    if keep is not None:
        return truncate_segments(segments, keep)
    if max_tokens is not None and count > max_tokens:
        raise ValueError(
            f"This model's maximum context length (max_model_len) is {max_tokens} tokens, but the "
            f"chat has {count} input tokens: shorten the messages or set truncate_prompt_tokens"
        )
    return segments


def segment_completion(
    ids: Sequence[int],
    special_ids: frozenset[int],
    tokenized: tuple[Sequence[int], Sequence[bool]] | None = None,
    side: str | None = None,
) -> list[Segment]:
    """The segments of a completion's token prompt ``ids``, in order (``splice`` rebuilds
    ``ids`` and its private mask), cached per run under the whole prompt (``token_segments``).
    Pure.

    ``tokenized``: (the tokenizer's ids of a text prompt, their private mask: ``added_mask``),
    carried over to ``ids`` (a left/right truncation of them; ``side`` breaks ties:
    ``truncated_mask``). Without it (a token-id prompt) every id outside ``special_ids`` is
    private (special ids are the client's template)."""
    if tokenized is not None:
        mask = truncated_mask(tokenized[0], tokenized[1], ids, side)
    else:
        mask = [t not in special_ids for t in ids]
    return token_segments(ids, mask, ids)
