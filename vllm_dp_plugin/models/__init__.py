"""Real model weights that pip can install, converted locally into servable Hugging Face
directories (``vllm-dp import-model NAME DIR``); no model hub needed. Pure torch/transformers,
no vLLM import.

``IMPORTERS`` maps each public name to ``"module:function"``; the function has the signature
``import_model(out_dir: Path, *, force: bool = False) -> Path`` and raises ``ModelImportError``
(naming the missing package and the pip command) when its source package is not installed.
"""

from __future__ import annotations

import importlib
from pathlib import Path


class ModelImportError(RuntimeError):
    """A real model cannot be imported (its pip package is missing or its files are not the
    expected format); the message says how to fix it."""


IMPORTERS = {
    "smollm2-135m-instruct": "vllm_dp_plugin.models.smollm2:import_smollm2",
    "whisper-tiny-en": "vllm_dp_plugin.models.whisper_ct2:import_whisper_tiny_en",
}


def import_model(name: str, out_dir: str | Path, *, force: bool = False) -> Path:
    """Convert the real model ``name`` (a key of ``IMPORTERS``) into ``out_dir``; returns it."""
    if name not in IMPORTERS:
        raise ModelImportError(f"unknown model {name!r}; known: {sorted(IMPORTERS)}")
    module, function = IMPORTERS[name].split(":")
    return getattr(importlib.import_module(module), function)(Path(out_dir), force=force)
