"""Keyed noise: determinism across restarts, separation of streams, key-file hygiene."""

import os
import stat

import pytest
import torch

from vllm_dp_plugin.privacy import LaplaceNoise, NoiseKey, context_id
from vllm_dp_plugin.privacy.keyed_noise import KEY_FILE_ENV, default_key_path


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
    assert key.seed("ab", "c") != key.seed("a", "bc")


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
