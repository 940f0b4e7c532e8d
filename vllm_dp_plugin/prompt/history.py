"""History cache: a user segment is privatized once per *namespace* (privatizing it again on
every turn would hand out repeated samples of the same tokens, each spending budget).

Its privatized ids are stored under the deployment's keyed MAC (``NoiseKey.mac``) of the
namespace, the mechanism, epsilon, delta, mode, the segment's own ids and its position (message
index and the conversation up to and including that message; for completions the whole prompt
and the run's start), so a later turn of the same conversation, or a retried request, reuses
them instead of drawing (and spending) again. Bounded LRU. The namespace is the request's
``dp_session`` (a client-chosen secret of at least ``MIN_SESSION_CHARS`` characters) together
with its credential (``Authorization`` / ``x-api-key`` header). Without a ``dp_session`` nothing
is cached or reused: a shared namespace would be a membership oracle (a client replaying a
guessed text would see ``tokens_reused > 0`` and a faster reply), and the server cannot tell
whether an API key belongs to one client or is shared by all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ..lru import LRU
from .options import PromptOptions
from .segments import canonical


class HistoryCache:
    """LRU of privatized segments keyed by ``mac`` (``NoiseKey.mac``: an HMAC with the
    deployment's secret key) of the request's namespace (session and credential), its options,
    a canonical description of the segment's position and the segment's own ids.

    Keys never hold text (only MAC outputs); values are privatized ids (or noisy embeddings),
    which are releases. Thread-safe.
    """

    def __init__(self, capacity: int, mac: Callable[..., bytes]):
        self._items: LRU[bytes, Any] = LRU(capacity)  # ValueError unless capacity >= 1
        self.capacity = capacity
        self._mac = mac

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
        """The privatized segment stored under ``key`` (now the most recently used), or None."""
        return self._items.get(key)

    def put(self, key: bytes, value: Any) -> None:
        self._items.put(key, value)

    def __len__(self) -> int:
        return len(self._items)
