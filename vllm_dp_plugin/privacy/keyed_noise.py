"""Keyed noise: the same secret key + context + stream always yields the same noise.

A deployment's noise for a private context is drawn once. Deriving the generator from a secret
key and the context's semantic digest means that a restart, an evicted-and-recomputed prefix or a
second tensor-parallel rank reproduces exactly the same release instead of drawing (and spending
budget on) a fresh one.

* The key is 32 random bytes in a file created with mode 0600 on first use (directory 0700),
  written to a temporary file and linked into place, so a concurrent first start never reads a
  partial key. It is never logged or printed; ``repr`` shows only the path.
* ``NoiseKey.mac(*parts)`` = HMAC-SHA256(key, "vllm-dp/v2" | length-prefixed parts): the one keyed
  function behind noise seeds, public labels (``label``), history-cache keys and ledger entries.
  Without the key nobody can evaluate it, so a label derived from private data is not a guessing
  oracle (an unkeyed hash of a context is: enumerate candidate texts offline and compare).
* Generators are seeded with the whole 256-bit MAC (``seeded_generator``), not ``manual_seed``:
  torch's CPU ``manual_seed`` keeps only 32 bits (mt19937 ``init_with_uint32``), so a 64-bit seed
  gives 2^32 possible noise streams, few enough to search. CPU and CUDA generators produce
  different streams from the same seed: moving a deployment between CPU and GPU draws new noise,
  i.e. spends the budget again (the release ledger records it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

KEY_BYTES = 32
SEED_BYTES = 32  # fresh seeds (os.urandom); keyed seeds are the 32-byte MAC
MIN_SEED_BYTES = 16
KEY_FILE_ENV = "VLLM_DP_KEY_FILE"
LABEL_HEX = 16  # public labels: 64 bits of the MAC
_DOMAIN = b"vllm-dp/v2"
_MT_WORDS = 624  # mt19937 state, 32-bit words
_CPU_STATE_WORDS_AT = 24  # torch's CPU generator state: seed u64, left i32, seeded i32, next u64, state u64[624]


def default_key_path() -> Path:
    """``$VLLM_DP_KEY_FILE`` if set, else ``~/.config/vllm-dp/noise.key``."""
    env = os.environ.get(KEY_FILE_ENV)
    return Path(env) if env else Path.home() / ".config" / "vllm-dp" / "noise.key"


def context_id(data: bytes | str | Iterable[int]) -> str:
    """SHA-256 hex digest of a private context's semantic inputs (raw bytes, text, or token ids).

    SECRET: it is a function of private data that anyone can evaluate, so it only ever enters
    ``NoiseKey.mac``; what may be shown is ``NoiseKey.label(context_id)``."""
    if isinstance(data, str):
        payload = data.encode("utf-8")
    elif isinstance(data, bytes):
        payload = data
    else:
        payload = b"ids:" + ",".join(str(int(t)) for t in data).encode("ascii")
    return hashlib.sha256(payload).hexdigest()


def seeded_generator(seed: bytes, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` whose whole state is derived from ``seed`` (>= 16 bytes).

    CPU: the 624 mt19937 words are SHAKE-256(``seed``) (19,937 bits of state instead of the 32
    that ``manual_seed`` keeps). CUDA (Philox): 64-bit key and 58-bit offset (x4), 122 bits, the
    most its state holds."""
    if len(seed) < MIN_SEED_BYTES:
        raise ValueError(f"a noise seed needs at least {MIN_SEED_BYTES} bytes, got {len(seed)}")
    device = torch.device(device)
    gen = torch.Generator(device=device)
    if device.type == "cuda":
        words = hashlib.shake_256(b"vllm-dp/philox|" + seed).digest(16)
        key, offset = int.from_bytes(words[:8], "little"), int.from_bytes(words[8:], "little") >> 6
        gen.set_state(torch.tensor(np.array([key, offset * 4], dtype="<u8").view(np.uint8)))
        return gen
    if device.type != "cpu":
        raise ValueError(f"keyed noise generators exist for cpu and cuda, not {device.type!r}")
    state = torch.zeros(gen.get_state().numel(), dtype=torch.uint8)
    raw = state.numpy()
    raw[8:12] = np.frombuffer((1).to_bytes(4, "little"), np.uint8)  # left = 1: twist before the first draw
    raw[12:16] = np.frombuffer((1).to_bytes(4, "little"), np.uint8)  # seeded
    words = np.frombuffer(hashlib.shake_256(b"vllm-dp/mt19937|" + seed).digest(4 * _MT_WORDS), "<u4")
    end = _CPU_STATE_WORDS_AT + 8 * _MT_WORDS
    raw[_CPU_STATE_WORDS_AT:end] = words.astype("<u8").view(np.uint8)
    gen.set_state(state)
    return gen


def fresh_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``SEED_BYTES`` of OS entropy (one-off noise, never reproduced)."""
    return seeded_generator(os.urandom(SEED_BYTES), device)


class ForeignEntries(RuntimeError):
    """A ledger (``what``, at ``path``) holds ``count`` entries written under another key than
    ``key``: its key file was lost or replaced after they were written, so they cannot be matched
    to anything (``consequence``). Refused unless the operator sets ``allow``."""

    def __init__(self, what: str, path: Path, count: int, key: NoiseKey, consequence: str, allow: str):
        self.count = count
        super().__init__(
            f"{what} {path} holds {count} entries written under another noise key than {key.path}: that "
            f"key file was lost or replaced after they were written, so {consequence}. Restore the key "
            f"file that wrote them; or, to accept this, set `{allow}: true` (keep it while the ledger holds "
            "those entries: they are ignored and reported as entries_under_other_keys)"
        )


class NoiseKey:
    """A secret key file and what is derived from it: MACs, public labels, noise generators."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_key_path()
        self._key = _load_or_create(self.path)

    def __repr__(self) -> str:
        return f"NoiseKey(path={str(self.path)!r})"

    def mac(self, *parts: str | bytes) -> bytes:
        """HMAC-SHA256 of the length-prefixed ``parts`` under this key (32 bytes)."""
        message = _DOMAIN
        for part in parts:
            encoded = part.encode("utf-8") if isinstance(part, str) else bytes(part)
            message += len(encoded).to_bytes(8, "big") + encoded
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def label(self, *parts: str | bytes) -> str:
        """A public name for secret ``parts`` (e.g. a context id): 64 bits of ``mac``, which
        nobody without the key can compute from candidate inputs."""
        return self.mac("label", *parts).hex()[:LABEL_HEX]

    def generator(self, context: str, stream: str, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator on ``device`` seeded with ``mac("noise", context, stream)`` (256 bits)."""
        return seeded_generator(self.mac("noise", context, stream), device)


def _load_or_create(path: Path) -> bytes:
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".noise-key-")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(KEY_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if another process linked its key first
        except FileExistsError:
            pass  # use theirs
    finally:
        os.unlink(tmp)
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
