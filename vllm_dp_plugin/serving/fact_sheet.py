"""DP fact sheets served as plain contexts (``dp_privacy.fact_sheet``).

At start-up every collection is loaded (documents over ``max_document_tokens`` refused) and its
fact sheet released once (``plan.release_fact_sheets``: keyed noise, recorded in the release
ledger). From then on nothing private is used: a chat request gets the sheet's facts that share a
not very common word with its last user turn (``FactSheet.about``: public text against public
text; none, no sheet) as its system turn (before the client's own system text, if any), a
completion request before its prompt, and vLLM answers it as any other request (streaming, logprobs and the rest work as usual). Queries
spend nothing; ``/v1/dp/budget`` states the one release and shows the sheet.
"""

from __future__ import annotations

import logging

from ..config import FactSheetPrivacyConfig
from ..plan import ReleasedSheet
from ..reports import fact_sheet_statement
from .echo import printable

logger = logging.getLogger("vllm.dp_privacy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
OPTION_CONTEXT = "dp_context"


class FactSheetError(ValueError):
    """A request the fact sheet cannot be given to (HTTP 400; the message names the field)."""


class FactSheetService:
    """The released sheets and the request rewrite that serves them."""

    def __init__(self, cfg: FactSheetPrivacyConfig, released: dict[str, ReleasedSheet]):
        self.cfg, self.released = cfg, released
        self.sheets = {name: r.sheet for name, r in released.items()}
        self.statement = fact_sheet_statement(cfg, released)

    def rewrite(self, path: str, body: dict) -> dict:
        """``body`` with the chosen collection's sheet as its context (``vllm_xargs.dp_context``
        picks one; the first by default). Raises ``FactSheetError``."""
        xargs = dict(body.get("vllm_xargs") or {}) if isinstance(body.get("vllm_xargs"), dict) else {}
        name = xargs.pop(OPTION_CONTEXT, None)
        unknown = sorted(k for k in xargs if k.startswith("dp_"))
        if unknown:
            raise FactSheetError(f"vllm_xargs.{printable(unknown[0])} is not an option of the fact sheet (only "
                                 f"{OPTION_CONTEXT})")  # the client's key: escaped
        name = next(iter(self.sheets)) if name is None else name
        if name not in self.sheets:
            raise FactSheetError(f"vllm_xargs.{OPTION_CONTEXT}={name!r} names no collection; served: "
                                 f"{', '.join(sorted(self.sheets))}")
        body = {**body, "vllm_xargs": xargs} if "vllm_xargs" in body else dict(body)
        chat = path.endswith("/chat/completions")
        asked = question(body.get("messages")) if chat else prompt_text(body.get("prompt"))
        text = self.sheets[name].about(asked).system_text()
        if text is None:  # no released fact shares a word with the question: the request as asked
            return body
        if chat:
            return {**body, "messages": with_system(body.get("messages"), text)}
        return {**body, "prompt": with_prefix(body.get("prompt"), text)}


def question(messages) -> str:
    """The last user turn's text (what the sheet's facts are matched against)."""
    if not isinstance(messages, list) or not messages:
        raise FactSheetError("messages must be a non-empty list")
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return " ".join(prompt)
    raise FactSheetError("prompt must be text or a list of texts (token ids cannot be given the fact sheet)")


def with_system(messages: list, text: str) -> list:
    """``messages`` (checked by ``question``) with ``text`` first in the system turn (the
    client's system text after it)."""
    first = messages[0]
    if isinstance(first, dict) and first.get("role") in ("system", "developer"):
        content = first.get("content")
        if isinstance(content, str):
            return [{**first, "content": f"{text}\n\n{content}"}, *messages[1:]]
        if isinstance(content, list):
            return [{**first, "content": [{"type": "text", "text": text}, *content]}, *messages[1:]]
        raise FactSheetError("messages[0].content must be text or a list of parts")
    return [{"role": "system", "content": text}, *messages]


def with_prefix(prompt: str | list[str], text: str) -> str | list[str]:
    """A completion ``prompt`` (checked by ``prompt_text``) with ``text`` before it."""
    return f"{text}\n\n{prompt}" if isinstance(prompt, str) else [f"{text}\n\n{p}" for p in prompt]
