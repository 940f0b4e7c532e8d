"""What one method's run of ``python -m benchmarks.train`` needs: the model's size (``ModelSize``, ``PRESETS``),
the run's ``BenchSpec``, the model (GPT-2 preset or a ``--model`` directory) and its synthetic batch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.lib.models import load_causal_lm
from vllm_dp_plugin.trainer.engine import causal_lm_per_sample_loss
from vllm_dp_plugin.trainer.lora import LoraSpec, apply_lora


@dataclass(frozen=True)
class ModelSize:
    """GPT-2 shape (or a ``--model``'s, named by ``family``) and batch: ``batch`` sequences of
    ``seq_len`` tokens."""

    vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    seq_len: int
    batch: int
    family: str = "GPT-2"

    def describe(self) -> str:
        return (
            f"{self.family} vocab {self.vocab}, n_embd {self.n_embd}, {self.n_layer} layers, {self.n_head} heads; "
            f"batch {self.batch} x seq {self.seq_len}"
        )


PRESETS = {
    "toy": ModelSize(vocab=1000, n_embd=32, n_layer=1, n_head=2, seq_len=16, batch=4),
    "tiny": ModelSize(vocab=50257, n_embd=128, n_layer=2, n_head=2, seq_len=128, batch=16),
    "gpt2-small": ModelSize(vocab=50257, n_embd=768, n_layer=12, n_head=12, seq_len=512, batch=16),
}


@dataclass(frozen=True)
class BenchSpec:
    """Everything one method's run needs (picklable: it travels to the worker process)."""

    size: ModelSize
    device: str
    autocast: str  # "none" or "bf16" (forward and loss under torch.autocast)
    warmup: int
    steps: int
    seed: int
    noise_multiplier: float
    clip_norm: float
    lr: float
    model: str = ""  # a Hugging Face causal LM directory (--model) instead of the random GPT-2 preset
    lora: LoraSpec = field(default_factory=LoraSpec)  # the LoRA rows' adapters (--model only)


@dataclass(frozen=True)
class Batch:
    """``ids, positions: [B, T]`` int64 on the device (positions contiguous: Opacus' embedding
    norm rule views them flat); the labels are the ids (``causal_lm_per_sample_loss`` shifts
    them). No padding, so no attention mask."""

    ids: torch.Tensor
    positions: torch.Tensor

    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "position_ids": self.positions}

    def shifted_labels(self) -> torch.Tensor:
        """``[B, T]``: position t predicts ``ids[t + 1]``; the last position has no label (-100)."""
        return F.pad(self.ids[:, 1:], (0, 1), value=-100)


def build_model(size: ModelSize, tied: bool, seed: int, device: torch.device) -> nn.Module:
    """A randomly initialised (seeded: equal weights in every worker) GPT-2 LM in train mode,
    dropout off (so every method computes the same function)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=size.vocab, n_positions=size.seq_len, n_embd=size.n_embd, n_layer=size.n_layer,
        n_head=size.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=tied, use_cache=False, bos_token_id=size.vocab - 1, eos_token_id=size.vocab - 1,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(device).train()


def load_model(path: str, tied: bool, seed: int, device: torch.device) -> nn.Module:
    """A Hugging Face causal LM directory's pretrained weights (random ones drawn from ``seed``
    for a config-only directory), float32, in train mode (no KV cache). ``tied=False`` gives a
    tied output head its own copy of the embedding (the same function, an untied model); an
    untied model is returned as it is either way."""
    model = load_causal_lm(path, dtype=torch.float32, seed=seed)
    model.config.use_cache = False
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not tied and head is not None and head.weight is embedding.weight:
        model.config.tie_word_embeddings = False  # keeps later tie_weights() calls from re-tying
        head.weight = nn.Parameter(head.weight.detach().clone())
    return model.to(device).train()


class ModelChoice(Protocol):
    """What ``make_model`` reads of a method (``methods.Method``)."""

    tied: bool
    lora: bool


def make_model(spec: BenchSpec, method: ModelChoice, device: torch.device) -> nn.Module:
    """The method's model: the preset's random GPT-2 or ``spec.model``'s weights, wrapped by
    ``apply_lora(spec.lora)`` for a LoRA method (fresh adapters, ``lora_B = 0``, base frozen)."""
    if spec.model:
        model = load_model(spec.model, method.tied, spec.seed, device)
    else:
        model = build_model(spec.size, method.tied, spec.seed, device)
    if method.lora:
        torch.manual_seed(spec.seed)  # the adapters' initialisation
        model = apply_lora(model, spec.lora).to(device)
    return model


def synthetic_batch(size: ModelSize, seed: int, device: torch.device) -> Batch:
    """Seeded uniform token ids ``[B, T]``, positions ``0..T-1`` per row, no padding."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq_len), generator=gen)
    positions = torch.arange(size.seq_len).repeat(size.batch, 1)
    return Batch(ids.to(device), positions.to(device))


def unique_parameter_count(model: nn.Module) -> int:
    """Trainable scalars, a tied weight counted once."""
    return sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad)


def _autocast(spec: BenchSpec):
    if spec.autocast == "bf16":
        return torch.autocast(torch.device(spec.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by name, a tied weight once (LoRA: the adapters only)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _adam(model: nn.Module, spec: BenchSpec) -> torch.optim.Adam:
    return torch.optim.Adam(_trainable(model).values(), lr=spec.lr)


def _per_sample_loss(model: nn.Module, batch: Batch, spec: BenchSpec) -> torch.Tensor:
    """``[B]`` mean next-token cross-entropy per sequence (float32 or wider)."""
    with _autocast(spec):
        logits = model(**batch.inputs()).logits
        return causal_lm_per_sample_loss(logits, batch.ids)
