"""The operator's private context: its tokens, its identity, and how requests are laid out around it.

The renderer (API process) and the attention backend (workers) both build it with
``settings.private_context`` so that they agree on the tokens, their number P and the identity
without talking to each other (the start-up check compares the public labels).

Identity (``ContextIdentity``), three values:
* ``subject``: digest of the token ids, what the guarantee protects (the release ledger's key);
* ``release``: digest of everything the exact K/V state and its release depend on: the ids, a
  digest of the weights, dtype, KV-cache dtype, device type and the resolved release parameters
  (calibration contents, not its path). It keys the noise: re-training into the same directory
  or changing a bound draws new noise, and the ledger sees a second release; moving the checkout
  or renaming files changes nothing;
* ``label``: the public name, ``NoiseKey.label`` of ``release``. Both digests are SECRET (an
  unkeyed hash of private data is an offline guessing oracle): only the label is shown or logged.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..privacy.keyed_noise import NoiseKey, context_id

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
WEIGHT_NAMES = ("config.json",)  # the architecture's hyper-parameters shape the K/V too


@dataclass(frozen=True)
class ContextIdentity:
    """``subject`` and ``release`` are SECRET digests; ``label`` is their public name."""

    subject: str
    release: str
    label: str

    @staticmethod
    def of(ids, release_inputs: dict, key: NoiseKey) -> ContextIdentity:
        release = context_id(json.dumps({"ids": list(ids), **release_inputs}, sort_keys=True))
        return ContextIdentity(context_id(ids), release, key.label("context", release))


@dataclass(frozen=True)
class PrivateContext:
    """``token_ids`` occupy positions ``[0, P)`` of every request; ``identity`` keys the noise."""

    token_ids: tuple[int, ...]
    identity: ContextIdentity
    bos_token_id: int | None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def prepend(self, prompt_ids: list[int]) -> list[int]:
        """``private ids + prompt ids`` with the prompt's own leading BOS dropped (the private
        context already starts the sequence). Raises if nothing public would remain: the first
        generated token would then come from a private position."""
        ids = list(prompt_ids)
        if ids and self.bos_token_id is not None and ids[0] == self.bos_token_id:
            ids = ids[1:]
        if not ids:
            raise ValueError("the prompt is empty: at least one public token must follow the private context")
        return [*self.token_ids, *ids]


def tokenize_context(text: str, tokenizer) -> list[int]:
    """The context's ids: BOS (if the tokenizer has one) + the text, no other special tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return ids if bos is None else [bos, *ids]


@functools.lru_cache(maxsize=4)
def context_tokens(path: str, tokenizer_name: str) -> tuple[tuple[int, ...], int | None]:
    """(ids, BOS id) of the text file ``path`` under ``tokenizer_name``'s HF tokenizer (cached)."""
    from transformers import AutoTokenizer

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"attention.private_context: no such file {path!r}")
    text = file.read_text(encoding="utf-8")
    if not text.strip():
        raise ConfigError(f"attention.private_context: {path!r} is empty")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    return tuple(tokenize_context(text, tokenizer)), tokenizer.bos_token_id


def file_digest(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def weights_digest(model: str, revision: str | None = None) -> str:
    """SHA-256 over the weight files and ``config.json`` of ``model`` (a directory, or a hub id
    resolved in the local cache), by relative name; cached per (path, size, mtime) of each file."""
    root = Path(model)
    if not root.is_dir():
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - any failure: we cannot name the weights
            raise ConfigError(
                f"attention.private_context: cannot find the weights of {model!r} locally to "
                f"identify the release ({exc}); serve a local model directory"
            ) from None
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in WEIGHT_NAMES)
    )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise ConfigError(f"attention.private_context: no weight files under {root}")
    stamp = tuple((str(p.relative_to(root)), str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _digest_files(stamp)


@functools.lru_cache(maxsize=8)
def _digest_files(stamp: tuple[tuple[str, str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, path, _, _ in stamp:
        digest.update(f"{name}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()
