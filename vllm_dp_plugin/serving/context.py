"""The operator's private contexts: their tokens, identities, and how requests are laid out around them.

The renderer (API process) and the attention backend (workers) both build them with
``settings.private_contexts`` so that they agree on the names, tokens, their numbers P and the
identities without talking to each other (the start-up check compares the public labels). A
request picks one by name (``vllm_xargs.dp_context``, ``select_context``); the workers recognise
it by its ids (``batch_contexts``), which is why no context may be a prefix of another.

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
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..privacy.keyed_noise import NoiseKey, context_id
from ..prompt.session import OPTION_CONTEXT

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
    """``token_ids`` occupy positions ``[0, P)`` of every request that picks ``name`` (public);
    ``identity`` keys the noise."""

    name: str
    token_ids: tuple[int, ...]
    identity: ContextIdentity
    bos_token_id: int | None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def prepend(self, prompt_ids: list[int]) -> list[int]:
        """``private ids + prompt ids`` with the prompt's own leading BOS dropped (the private
        context already starts the sequence; ``bos_token_id`` is the BOS the tokenizer adds, None
        if it adds none). Raises if nothing public would remain: the first
        generated token would then come from a private position."""
        ids = list(prompt_ids)
        if ids and self.bos_token_id is not None and ids[0] == self.bos_token_id:
            ids = ids[1:]
        if not ids:
            raise ValueError("the prompt is empty: at least one public token must follow the private context")
        return [*self.token_ids, *ids]


def select_context(names: Sequence[str], requested) -> str:
    """The context a request reads: ``requested`` (its ``vllm_xargs.dp_context``), or the first of
    ``names`` when None. ValueError (HTTP 400) naming the option for any other value."""
    if requested is None and names:
        return names[0]
    if not isinstance(requested, str) or requested not in names:
        raise ValueError(
            f"vllm_xargs.{OPTION_CONTEXT}: unknown private context {requested!r}; known: {list(names)}"
        )
    return requested


def check_prefix_free(contexts: Sequence[PrivateContext], key: str) -> None:
    """Refuse contexts whose token ids are a prefix of another's (equal ids included): the
    workers tell a request's context by its leading ids, which must then be unambiguous."""
    for a, b in itertools.permutations(contexts, 2):
        if b.token_ids[: a.length] == a.token_ids:
            raise ConfigError(
                f"{key}: the tokens of context {a.name!r} are a prefix of {b.name!r}'s: a request "
                "could not be told apart; make each context differ from every other"
            )


@functools.lru_cache(maxsize=4)
def shared_prefix_lengths(contexts: tuple[PrivateContext, ...]) -> torch.Tensor:
    """``[C, C]``: how many leading ids contexts ``a`` and ``c`` share (``P_a`` on the diagonal).
    The K/V row at position ``p`` of a request reading ``a`` is also row ``p`` of ``c`` when ``p``
    is below that count (same ids up to ``p``, same rows), and vLLM's prefix cache may serve it to
    ``c``'s requests without recomputing it. Derived from private ids: never shown (cached)."""
    lengths = torch.tensor([c.length for c in contexts], dtype=torch.long)
    ids = torch.full((len(contexts), int(lengths.max())), -1, dtype=torch.long)  # [C, P_max]
    for i, c in enumerate(contexts):
        ids[i, : c.length] = torch.tensor(c.token_ids, dtype=torch.long)
    within = torch.arange(ids.shape[1]) < lengths[:, None]  # [C, P_max]
    rows = [((ids == row) & within & within[i]).long().cumprod(dim=-1).sum(dim=-1) for i, row in enumerate(ids)]
    return torch.stack(rows)  # row a: [C]


def tokenize_context(text: str, tokenizer) -> list[int]:
    """The context's ids: the text as the start of a sequence, i.e. the BOS the tokenizer adds
    (``added_bos``; none if it adds none) + the text's ids (special tokens written in the text,
    such as a chat template's, are parsed)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = added_bos(tokenizer)
    return ids if bos is None else [bos, *ids]


def added_bos(tokenizer) -> int | None:
    """The BOS id ``tokenizer`` puts before an encoded text, or None when it adds none. A model
    may name a ``bos_token`` it never adds (SmolLM2: ``<|im_start|>``, which opens every chat
    turn): that token is then part of the request's own text and must not be dropped."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    return bos if tokenizer.encode("a", add_special_tokens=True)[:1] == [bos] else None


def read_context(path: str, key: str) -> str:
    """The text of the context file ``path`` (configuration key ``key``, named in errors): the
    file itself, or for ``.jsonl`` its documents' ``text`` fields (one JSON object per line)
    joined by newlines."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}: no such file {path!r}")
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".jsonl":
        docs = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError:
                doc = None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise ConfigError(f'{key}: line {number} of {path!r} is not a JSON object with a "text" string')
            docs.append(doc["text"])
        text = "\n".join(docs)
    if not text.strip():
        raise ConfigError(f"{key}: {path!r} is empty")
    return text


@functools.lru_cache(maxsize=16)
def context_tokens(path: str, tokenizer_name: str, key: str) -> tuple[tuple[int, ...], int | None]:
    """(ids, BOS id) of the context file ``path`` (``read_context``) under ``tokenizer_name``'s
    HF tokenizer (cached)."""
    from transformers import AutoTokenizer

    text = read_context(path, key)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    return tuple(tokenize_context(text, tokenizer)), added_bos(tokenizer)


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
