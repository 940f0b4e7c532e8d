"""Keyed noise: the same secret key + context + stream always yields the same noise.

A deployment's noise for a private context is drawn once. Deriving the generator seed from a
secret key and the context's hash means that a restart, an evicted-and-recomputed prefix or a
second tensor-parallel rank reproduces exactly the same release instead of drawing (and spending
budget on) a fresh one.

* The key is 32 random bytes in a file created with mode 0600 on first use (directory 0700).
  It is never logged or printed; ``repr`` shows only the path.
* seed = first 8 bytes of HMAC-SHA256(key, "vllm-dp/v1" | len-prefixed context id | stream).
* The seed drives a ``torch.Generator`` on a given device. CPU and CUDA generators produce
  different streams from the same seed: moving a deployment between CPU and GPU draws new noise,
  i.e. spends the budget again.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import torch

KEY_BYTES = 32
KEY_FILE_ENV = "VLLM_DP_KEY_FILE"
_DOMAIN = b"vllm-dp/v1"


def default_key_path() -> Path:
    """``$VLLM_DP_KEY_FILE`` if set, else ``~/.config/vllm-dp/noise.key``."""
    env = os.environ.get(KEY_FILE_ENV)
    return Path(env) if env else Path.home() / ".config" / "vllm-dp" / "noise.key"


def context_id(data: bytes | str | Iterable[int]) -> str:
    """SHA-256 hex digest identifying a private context (raw bytes, text, or token ids)."""
    if isinstance(data, str):
        payload = data.encode("utf-8")
    elif isinstance(data, bytes):
        payload = data
    else:
        payload = b"ids:" + ",".join(str(int(t)) for t in data).encode("ascii")
    return hashlib.sha256(payload).hexdigest()


class NoiseKey:
    """A secret key file and the seeds/generators derived from it."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_key_path()
        self._key = _load_or_create(self.path)

    def __repr__(self) -> str:
        return f"NoiseKey(path={str(self.path)!r})"

    def seed(self, context: str, stream: str) -> int:
        """64-bit seed for (context id, stream name); deterministic given the key."""
        message = _DOMAIN
        for part in (context, stream):
            encoded = part.encode("utf-8")
            message += len(encoded).to_bytes(8, "big") + encoded
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big")

    def generator(
        self, context: str, stream: str, device: torch.device | str = "cpu"
    ) -> torch.Generator:
        """A fresh ``torch.Generator`` on ``device`` seeded with ``seed(context, stream)``."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed(context, stream))
        return gen


def _load_or_create(path: Path) -> bytes:
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it first: use theirs
        return _read_key(path)
    with os.fdopen(fd, "wb") as handle:
        handle.write(os.urandom(KEY_BYTES))
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise PermissionError(
            f"noise key file {path} is accessible by group/others (mode {mode:o}); "
            f"run: chmod 600 {path}"
        )
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise ValueError(f"noise key file {path} must hold exactly {KEY_BYTES} bytes")
    return key
