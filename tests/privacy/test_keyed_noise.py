"""Keyed noise: determinism across restarts, separation of streams, key-file hygiene, seeds
that use the generator's whole state, labels nobody can compute without the key."""

import hashlib
import multiprocessing
import os
import stat

import pytest
import torch
from scipy import stats

from vllm_dp_plugin.privacy import LaplaceNoise, NoiseKey, context_id, keyed_noise
from vllm_dp_plugin.privacy.keyed_noise import (
    KEY_FILE_ENV,
    default_key_path,
    fresh_generator,
    seeded_generator,
)


def noise(key, ctx, stream):
    return LaplaceNoise(1.0).sample((64,), key.generator(ctx, stream))


def test_same_key_context_stream_same_noise_after_restart(tmp_path):
    path = tmp_path / "keys" / "noise.key"
    first = noise(NoiseKey(path), "ctx", "layer0/head1")
    restarted = noise(NoiseKey(path), "ctx", "layer0/head1")  # a new process reads the file
    assert torch.equal(first, restarted)


def test_streams_contexts_and_keys_separate(tmp_path):
    key = NoiseKey(tmp_path / "a.key")
    base = noise(key, "ctx", "s")
    assert not torch.equal(base, noise(key, "ctx", "t"))
    assert not torch.equal(base, noise(key, "ctx2", "s"))
    assert not torch.equal(base, noise(NoiseKey(tmp_path / "b.key"), "ctx", "s"))
    # length-prefixing: ("ab", "c") and ("a", "bc") are different streams
    assert key.mac("ab", "c") != key.mac("a", "bc")
    assert not torch.equal(noise(key, "ab", "c"), noise(key, "a", "bc"))


def test_key_file_created_private(tmp_path):
    path = tmp_path / "new" / "noise.key"
    NoiseKey(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert len(path.read_bytes()) == 32


def test_world_readable_key_is_refused(tmp_path):
    path = tmp_path / "noise.key"
    NoiseKey(path)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        NoiseKey(path)


def test_truncated_key_is_refused(tmp_path):
    path = tmp_path / "noise.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(ValueError, match="32 bytes"):
        NoiseKey(path)


def test_repr_never_shows_the_key(tmp_path):
    key = NoiseKey(tmp_path / "noise.key")
    secret = (tmp_path / "noise.key").read_bytes()
    assert secret.hex() not in repr(key) and str(secret) not in repr(key)


def test_default_path_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "k"))
    assert default_key_path() == tmp_path / "k"


def test_context_id_is_stable_and_content_addressed():
    assert context_id([1, 2, 3]) == context_id((1, 2, 3))
    assert context_id([1, 2, 3]) != context_id([1, 2, 4])
    assert context_id("abc") == context_id(b"abc")
    assert len(context_id("abc")) == 64


def test_manual_seed_keeps_32_bits_and_seeded_generator_keeps_them_all():
    """Why ``seeded_generator`` exists: torch's CPU ``manual_seed`` keeps 32 bits, so seeds that
    differ above bit 32 give one stream (2^32 streams: searchable). Seeds that differ in any byte,
    the last included, must give different streams."""
    low, high = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5 + (1 << 40))
    assert torch.equal(torch.randn(8, generator=low), torch.randn(8, generator=high))
    base = bytes(32)
    for index in (0, 8, 31):
        other = bytearray(base)
        other[index] ^= 1
        assert not torch.equal(torch.randn(8, generator=seeded_generator(base)),
                               torch.randn(8, generator=seeded_generator(bytes(other))))
    assert torch.equal(torch.randn(8, generator=seeded_generator(base)), torch.randn(8, generator=seeded_generator(base)))
    assert seeded_generator(base).initial_seed() == 0  # nothing of the seed is readable back
    with pytest.raises(ValueError, match="at least 16 bytes"):
        seeded_generator(bytes(8))


def test_keyed_generators_are_not_manual_seed_streams(tmp_path):
    """A keyed stream is none of the 2^32 ``manual_seed`` streams (checked against the seed
    its first output would come from if it were: the MAC's low 32 bits and its first 8 bytes)."""
    key = NoiseKey(tmp_path / "k")
    mac = key.mac("noise", "ctx", "s")
    drawn = torch.randn(4, generator=key.generator("ctx", "s"))
    for seed in (int.from_bytes(mac[:8], "big"), int.from_bytes(mac[:4], "little")):
        assert not torch.equal(drawn, torch.randn(4, generator=torch.Generator().manual_seed(seed)))


def test_seeded_generator_draws_are_uniform_and_normal():
    """KS tests over 20 seeds (fixed): the combined p-values are uniform at the 1e-3 level."""
    normal = [stats.kstest(torch.randn(4000, generator=seeded_generator(hashlib.sha256(bytes([i])).digest()),
                                       dtype=torch.float64).numpy(), "norm").pvalue for i in range(20)]
    uniform = [stats.kstest(torch.rand(4000, generator=seeded_generator(hashlib.sha256(bytes([i, 1])).digest()),
                                       dtype=torch.float64).numpy(), "uniform").pvalue for i in range(20)]
    assert stats.kstest(normal, "uniform").pvalue > 1e-3
    assert stats.kstest(uniform, "uniform").pvalue > 1e-3


def test_fresh_generator_reads_32_bytes_of_os_entropy(monkeypatch):
    asked = []

    def urandom(n):
        asked.append(n)
        return bytes(n)

    monkeypatch.setattr(keyed_noise.os, "urandom", urandom)
    assert torch.equal(torch.randn(4, generator=fresh_generator()), torch.randn(4, generator=seeded_generator(bytes(32))))
    assert asked == [32]


def test_labels_need_the_key(tmp_path):
    a, b = NoiseKey(tmp_path / "a"), NoiseKey(tmp_path / "b")
    assert a.label("context", "x") == NoiseKey(a.path).label("context", "x")
    assert a.label("context", "x") != b.label("context", "x")
    assert a.label("context", "x") != a.label("context", "y")
    assert context_id("x")[:16] != a.label("context", "x")


def _load(path, queue):
    try:
        queue.put(NoiseKey(path)._key)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put(repr(exc))


def test_concurrent_first_start_agrees_on_one_full_key(tmp_path, monkeypatch):
    """Key creation is write-then-link: processes racing at first start all read the same
    32-byte key, never an empty or partial file (slow entropy widens the window in which a
    create-then-write scheme exposes an empty key file)."""
    import time

    real = os.urandom
    monkeypatch.setattr(keyed_noise.os, "urandom", lambda n: (time.sleep(0.3), real(n))[1])
    path = tmp_path / "race" / "noise.key"
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load, args=(path, queue)) for _ in range(6)]
    for proc in procs:
        proc.start()
    keys = [queue.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert sorted(os.listdir(path.parent)) == ["noise.key"]  # no temporary files left behind
