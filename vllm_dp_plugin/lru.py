"""``LRU``: the one bounded least-recently-used map of the plugin (the history cache's
privatized segments, ``PromptPrivacy``'s privatizers, the renderer's recent receipts)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``capacity`` entries; ``put`` evicts the least recently used one (``put`` and
    ``get`` count as uses, ``peek`` and ``in`` do not). Thread-safe: every operation holds one
    lock (a value is never built under it: build, then ``put``)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key`` (now the most recently used), or ``default``."""
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key`` without counting it as a use, or ``default``."""
        with self._lock:
            return self._items.get(key, default)

    def put(self, key: K, value: V) -> None:
        """Store ``value`` under ``key`` as the most recently used; evict beyond ``capacity``."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def __repr__(self) -> str:  # sizes only: keys and values may be secret
        return f"LRU({len(self)}/{self.capacity})"
