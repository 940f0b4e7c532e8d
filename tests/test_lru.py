"""The one LRU (history cache, privatizers, the renderer's recent receipts)."""

import threading

import pytest

from vllm_dp_plugin.lru import LRU


def test_put_evicts_the_least_recently_used():
    lru = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a use: b is now the oldest
    lru.put("c", 3)
    assert len(lru) == 2 and "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3
    lru.put("a", 10)  # replacing a value is a use too
    lru.put("d", 4)
    assert lru.get("c") is None and lru.get("a") == 10 and lru.get("d") == 4


def test_peek_and_in_are_not_uses():
    lru = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.peek("a") == 1 and "a" in lru
    lru.put("c", 3)
    assert lru.peek("a") is None and lru.peek("a", "gone") == "gone"
    assert lru.get("missing", 0) == 0


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        LRU(capacity)


def test_repr_shows_sizes_only():
    lru = LRU(3)
    lru.put("secret text", b"secret value")
    assert repr(lru) == "LRU(1/3)"


def test_concurrent_puts_keep_the_bound():
    lru = LRU(8)

    def work(offset):
        for i in range(2000):
            lru.put((offset, i), i)
            lru.get((offset, i - 1))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(lru) == 8
