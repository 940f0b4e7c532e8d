"""Loading a model whose weights may not be there (an architecture carried to a GPU box without
its weights): what the training and batching research suites time."""

from __future__ import annotations

from pathlib import Path

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def has_weights(model: str | Path) -> bool:
    """Whether the directory ``model`` holds weights (else only its architecture, ``config.json``)."""
    return any(next(Path(model).glob(pattern), None) is not None for pattern in WEIGHT_FILES)


def load_causal_lm(model: str | Path, *, dtype, seed: int = 0):
    """``model``'s Hugging Face causal LM in ``dtype``: its pretrained weights, or, for a directory
    holding only a ``config.json`` (an architecture carried where its weights cannot go), random
    weights drawn under ``torch.manual_seed(seed)``: step and generation times do not depend on
    the weights' values."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if has_weights(model):
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=dtype)
