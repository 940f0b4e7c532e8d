"""DP LoRA: low-rank adapters (``peft``) trained by the same DP engine as full fine-tuning.

``peft`` wraps each targeted ``nn.Linear`` as ``base(x) + scaling * lora_B(lora_A(dropout(x)))``
with plain ``nn.Linear`` factors ``lora_A [r, d_in]`` and ``lora_B [d_out, r]`` and freezes every
other weight, so the engine's ``Linear`` rule gives the factors' per-sample norms (ghost norm or
per-sample gradient, whichever is smaller) and clipped sums; frozen modules are not hooked. The
guarantee is the same as full fine-tuning's (one training record); only the adapter is trained,
so the base model is public.

Export: the adapter as ``peft`` writes it (``adapter_config.json`` + ``adapter_model.safetensors``,
what ``vllm serve --enable-lora --lora-modules name=DIR`` loads) and the merged full model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from torch import nn

from ..privacy.validation import check_count

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """``lora: {r, alpha, target_modules, dropout}`` of a training config: rank r, scaling
    ``alpha / r``, the names (last component) of the ``nn.Linear`` modules to adapt (default:
    every attention and MLP projection of a Llama; embeddings and the output layer are not
    adaptable: vLLM serves adapters of projections), dropout before ``lora_A``."""

    r: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = LLAMA_PROJECTIONS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_count(self.r, "lora.r")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 < self.alpha < float("inf"):
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        targets = self.target_modules
        if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"lora.target_modules must be a non-empty list of module names, got {targets!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must lie in [0, 1), got {self.dropout!r}")

    @staticmethod
    def parse(raw: object) -> LoraSpec:
        """From the ``lora`` mapping of a config file; unknown keys are an error naming them."""
        if isinstance(raw, LoraSpec):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(  # noqa: TRY004  (a config error, like every other key's)
                f"lora must be a mapping like {{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}, got {raw!r}"
            )
        known = {f.name for f in fields(LoraSpec)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"lora: unknown option(s) {unknown}; known: {sorted(known)}")
        values = dict(raw)
        if "target_modules" in values and isinstance(values["target_modules"], list):
            values["target_modules"] = tuple(values["target_modules"])
        return LoraSpec(**values)

    def report(self) -> dict:
        """The spec as JSON values (``dp_training.json``)."""
        return {"r": self.r, "alpha": self.alpha, "target_modules": list(self.target_modules), "dropout": self.dropout}

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=list(self.target_modules),
                          lora_dropout=self.dropout, bias="none", task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """``model`` wrapped by ``peft`` with fresh adapters (``lora_B = 0``: the wrapped model starts
    equal to ``model``); only the adapters are trainable. Every target must name at least one
    ``nn.Linear`` (ValueError naming the missing ones)."""
    from peft import get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    missing = [t for t in spec.target_modules if t not in names]
    if missing:
        raise ValueError(f"lora.target_modules {missing} match no nn.Linear of the model; its linear layers: {sorted(names)}")
    return get_peft_model(model, spec.peft_config())


def save_adapter(model: nn.Module, directory: Path) -> None:
    """The trained adapter as ``peft`` writes it (vLLM's LoRA format)."""
    model.save_pretrained(directory, safe_serialization=True)


def merged(model: nn.Module) -> nn.Module:
    """The base model with the adapter folded into its weights (``W + scaling B A``), unwrapped."""
    return model.merge_and_unload()
