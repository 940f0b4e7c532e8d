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
    """``token_ids`` occupy positions ``[0, P)`` of every request that picks ``name`` (P is
    public); ``identity`` keys the noise. The first ``head`` of them are the public head (the
    chat template's system header, ``public_head``): exact and public, never released; the
    private span, the rows the DP release holds, is ``[head, private_end)``; unit document:
    document ``i`` holds rows ``[head + i slot, head + (i + 1) slot)``."""

    name: str
    token_ids: tuple[int, ...]
    identity: ContextIdentity
    bos_token_id: int | None
    head: int = 0
    end: int | None = None  # None: P (unit row); unit document: the end of the documents' slots
    slot: int = 0  # unit document: tokens per document slot (0: unit row)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def private_end(self) -> int:
        """The end of the private span ``[head, private_end)``; the rows after it are public
        queries (unit document: the system turn's closing tokens)."""
        return self.length if self.end is None else self.end

    @property
    def private_length(self) -> int:
        """Rows of the private span: what the release holds and the plan counts."""
        return self.private_end - self.head

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


def public_head_ids(tokenizer) -> tuple[int, ...]:
    """The ids every system turn starts with, from the tokenizer alone (public): the BOS it adds
    and the chat template's text before a system message's content (ChatML:
    ``<|im_start|>system\\n``); only the BOS when there is no chat template."""
    bos = added_bos(tokenizer)
    before, _ = system_turn(tokenizer)
    return tuple(([] if bos is None else [bos]) + tokenizer.encode(before, add_special_tokens=False))


def system_turn(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after a system message's content (without the BOS
    the tokenizer adds); ("", "") without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    marker = "\x00vllm-dp-system-content\x00"
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": marker}], tokenize=False)
    if marker not in rendered:
        return "", ""
    before, after = rendered.split(marker, 1)
    if added_bos(tokenizer) is not None and tokenizer.bos_token and before.startswith(tokenizer.bos_token):
        before = before[len(tokenizer.bos_token):]
    return before, after


@dataclass(frozen=True)
class DocumentLayout:
    """A context of documents laid out for ``unit: document``: ``ids`` = public head, one slot of
    ``slot`` ids per document (its text and a newline, padded with newlines), then the system
    turn's closing ids; the private span is ``[head, end)``, ``end = head + documents x slot``."""

    ids: tuple[int, ...]
    head: int
    end: int
    slot: int


def document_layout(documents: Sequence[str], tokenizer, slot: int, key: str) -> DocumentLayout:
    """``documents`` as the chat template's system turn, one slot of ``slot`` tokens each.
    ConfigError naming ``key`` and the document's line when one does not fit its slot."""
    head = public_head_ids(tokenizer)
    _, after = system_turn(tokenizer)
    if not head:
        raise ConfigError(f"{key}: unit document needs a tokenizer with a chat template or a BOS (a public head)")
    newline = tokenizer.encode("\n", add_special_tokens=False)
    if len(newline) != 1:
        raise ConfigError(f"{key}: unit document pads with newlines, which this tokenizer does not encode as one id")
    ids = list(head)
    for line, text in enumerate(documents, 1):
        doc = tokenizer.encode(text, add_special_tokens=False) + newline
        if len(doc) > slot:
            raise ConfigError(f"{key}: document {line} has {len(doc)} tokens (with its newline); "
                              f"attention.document_tokens is {slot}")
        ids += doc + newline * (slot - len(doc))
    end = len(ids)
    ids += tokenizer.encode(after, add_special_tokens=False)
    return DocumentLayout(tuple(ids), len(head), end, slot)


def head_length(ids: Sequence[int], setting: str | int, header: Sequence[int], key: str) -> int:
    """How many leading ``ids`` of a context are its public head under ``attention.public_head``
    = ``setting``: ``"auto"``: ``header`` (``public_head_ids``) when the context starts with it,
    else nothing; an integer N: the first N tokens, which the operator declares public."""
    if setting == "auto":
        return len(header) if tuple(ids[: len(header)]) == tuple(header) else 0
    if setting >= len(ids):
        raise ConfigError(f"{key}: public_head={setting} leaves no private token of its {len(ids)}")
    return int(setting)


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
    file itself, or for ``.jsonl`` its documents (``read_documents``) joined by newlines."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}: no such file {path!r}")
    text = "\n".join(read_documents(path, key)) if file.suffix == ".jsonl" else file.read_text(encoding="utf-8")
    if not text.strip():
        raise ConfigError(f"{key}: {path!r} is empty")
    return text


def read_documents(path: str, key: str) -> list[str]:
    """The ``text`` fields of the ``.jsonl`` file ``path``, one JSON object per line."""
    file = Path(path)
    if file.suffix != ".jsonl" or not file.is_file():
        raise ConfigError(f"{key}: {path!r} is not a .jsonl file of documents")
    docs = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
            raise ConfigError(f'{key}: line {number} of {path!r} is not a JSON object with a "text" string')
        docs.append(doc["text"])
    if not docs:
        raise ConfigError(f"{key}: {path!r} is empty")
    return docs


@dataclass(frozen=True)
class ContextTokens:
    """A context file under a tokenizer: ``ids``, the BOS the tokenizer adds (or None), the
    public ``head`` length, the private span's ``end`` (None: all of ``ids``) and the document
    ``slot`` (0: unit row)."""

    ids: tuple[int, ...]
    bos: int | None
    head: int
    end: int | None = None
    slot: int = 0


@functools.lru_cache(maxsize=16)
def context_tokens(path: str, tokenizer_name: str, key: str, public_head: str | int = 0,
                   document_tokens: int | None = None) -> ContextTokens:
    """The context file ``path`` under ``tokenizer_name``'s HF tokenizer (cached): unit row
    (``document_tokens`` None) its text (``read_context``) with the public head ``head_length``
    finds under ``public_head``; unit document its documents (``read_documents``) laid out by
    ``document_layout`` in slots of ``document_tokens``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    if document_tokens is not None:
        layout = document_layout(read_documents(path, key), tokenizer, document_tokens, key)
        return ContextTokens(layout.ids, added_bos(tokenizer), layout.head, layout.end, layout.slot)
    ids = tuple(tokenize_context(read_context(path, key), tokenizer))
    return ContextTokens(ids, added_bos(tokenizer), head_length(ids, public_head, public_head_ids(tokenizer), key))


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
