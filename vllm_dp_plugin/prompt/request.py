"""The current request's prompt-privacy context: its ``dp_*`` options, credential and
receipts, carried to the renderer in a context variable (``current_request``)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .options import OPTION_PREFIX, PromptOptionError

CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")  # what identifies the client, if anything


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
