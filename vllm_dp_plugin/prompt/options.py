"""Per-request prompt-privacy options (``vllm_xargs`` ``dp_*``) and their validation.

A request may pick the mechanism and the per-token epsilon (``vllm_xargs``
``{"dp_mechanism": "laplace", "dp_epsilon": 5}``, or ``prompt_request(...)`` around ``LLM``
calls) when the deployment allows it; ``resolve_options`` validates them against the
``dp_privacy.prompt`` section and raises ``PromptOptionError`` (a ``ValueError``: HTTP 400)
with the option's name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .mechanisms import MECHANISMS
from .paraphrase import PARAPHRASE

PROMPT_MECHANISMS = (*MECHANISMS, PARAPHRASE)
OPTION_PREFIX = "dp_"
OPTION_MECHANISM = "dp_mechanism"
OPTION_EPSILON = "dp_epsilon"
OPTION_SESSION = "dp_session"
OPTION_CONTEXT = "dp_context"  # which private context (attention.contexts): serving.context.select_context
OPTIONS = (OPTION_MECHANISM, OPTION_EPSILON, OPTION_SESSION, OPTION_CONTEXT)
OVERRIDES = (OPTION_MECHANISM, OPTION_EPSILON)  # need allow_request_override
MIN_SESSION_CHARS = 22  # a secret: 22 characters of secrets.token_urlsafe are 132 bits
MAX_SESSION_CHARS = 256


class PromptOptionError(ValueError):
    """A per-request prompt-privacy option that cannot be honoured (the message names it)."""


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
    elif not isinstance(mechanism, str) or mechanism not in PROMPT_MECHANISMS:
        raise PromptOptionError(
            f"vllm_xargs.{OPTION_MECHANISM} must be one of {list(PROMPT_MECHANISMS)}, got {mechanism!r}"
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
