"""The served ``dp_privacy`` configuration, read once per process from vLLM's config.

Every process (API server, engine core, workers) sees ``--additional-config`` through
``VllmConfig.additional_config``; this module turns it into the typed ``DPPrivacyConfig`` plus
what the model contributes (its attention shape, the private context's tokens).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..attention.plan import ContextPlan
from ..config import CONFIG_KEY, ConfigError, DPPrivacyConfig
from .context import PrivateContext, load_private_context

TOKENIZER_MODE = "dp_private"
PLUGIN_NAME = "dp_privacy"  # entry-point name in every vLLM plugin group we use


def dp_config(vllm_config) -> DPPrivacyConfig:
    """The validated ``dp_privacy`` section (an empty config, i.e. DP off, when absent)."""
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    return DPPrivacyConfig.from_dict(raw or {})


def raw_config_json(vllm_config) -> str:
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY) or {}
    return json.dumps(raw, sort_keys=True)


@dataclass(frozen=True)
class ModelShape:
    """Attention geometry of the served model (global, before tensor parallelism)."""

    self_layers: int
    cross_layers: int
    total_kv_heads: int
    total_query_heads: int
    head_dim: int
    is_encoder_decoder: bool

    @staticmethod
    def of(vllm_config) -> ModelShape:
        model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
        tp = parallel.tensor_parallel_size
        enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
        layers = model_config.get_total_num_hidden_layers()
        return ModelShape(
            self_layers=layers,
            cross_layers=layers if enc_dec else 0,
            total_kv_heads=model_config.get_total_num_kv_heads(),
            total_query_heads=model_config.get_num_attention_heads(parallel) * tp,
            head_dim=model_config.get_head_size(),
            is_encoder_decoder=enc_dec,
        )


def check_rust_frontend() -> None:
    if os.environ.get("VLLM_USE_RUST_FRONTEND", "0").lower() in ("1", "true"):
        raise ConfigError(
            "dp_privacy: the Rust frontend (VLLM_USE_RUST_FRONTEND=1) bypasses the dp_private "
            "renderer (private context, prompt privatization); unset it"
        )


def check_prompt_serving(vllm_config, cfg: DPPrivacyConfig) -> None:
    """Refuse a ``prompt`` section that the served engine would not apply (no dp_private
    renderer: prompts would reach the engine unprivatized). Called by the attention backend in
    every engine (``LLM`` and ``vllm serve`` alike) and by the HTTP endpoint plugin."""
    if cfg.prompt is None:
        return
    check_rust_frontend()
    if vllm_config.model_config.tokenizer_mode != TOKENIZER_MODE:
        raise ConfigError(
            f"dp_privacy.prompt needs --tokenizer-mode {TOKENIZER_MODE} (the renderer that "
            "privatizes prompts); without it prompts would reach the engine unprivatized"
        )


def check_serving(vllm_config, cfg: DPPrivacyConfig) -> None:
    """Refuse DP-attention configurations that would serve without the promised privacy."""
    check_rust_frontend()
    att = cfg.attention
    model_config = vllm_config.model_config
    enc_dec = bool(getattr(model_config, "is_encoder_decoder", False))
    if enc_dec and att.private_context is not None:
        raise ConfigError(
            "attention.private_context is for decoder-only models; in encoder-decoder models the "
            "encoder output of each request is the private context"
        )
    if not enc_dec:
        if att.private_context is None:
            raise ConfigError("attention.private_context (a text file) is required for decoder-only models")
        if model_config.tokenizer_mode != TOKENIZER_MODE:
            raise ConfigError(
                f"attention.private_context needs --tokenizer-mode {TOKENIZER_MODE} (the renderer "
                "that places the context at positions [0, P) of every request)"
            )
        if getattr(model_config, "enable_prompt_embeds", False):
            raise ConfigError("attention.private_context cannot be combined with --enable-prompt-embeds")


def private_context(vllm_config) -> PrivateContext:
    """The decoder-only private context of this deployment (tokenized, cached per process)."""
    cfg = dp_config(vllm_config)
    model_config = vllm_config.model_config
    context = load_private_context(
        cfg.attention.private_context, model_config.tokenizer, model_config.model, raw_config_json(vllm_config)
    )
    if context.length >= model_config.max_model_len:
        raise ConfigError(
            f"attention.private_context has {context.length} tokens but max_model_len is "
            f"{model_config.max_model_len}: no room for the public prompt"
        )
    return context


def context_plan(vllm_config, kind: str, context_len: int) -> ContextPlan:
    """The public plan of one private context of ``context_len`` rows for ``kind`` layers."""
    cfg = dp_config(vllm_config).attention
    shape = ModelShape.of(vllm_config)
    layers = shape.cross_layers if kind == "cross_attention" else shape.self_layers
    return ContextPlan(
        cfg,
        kind,
        layers,
        shape.total_kv_heads,
        shape.total_query_heads,
        shape.head_dim,
        shape.head_dim**-0.5,
        context_len,
    )


def budget_payload(vllm_config) -> dict:
    """What ``GET /v1/dp/budget`` answers: DP off, or the statement per private context."""
    cfg = dp_config(vllm_config)
    if cfg.attention is None:
        return {"enabled": False, "contexts": []}
    shape = ModelShape.of(vllm_config)
    if shape.is_encoder_decoder:
        frames = getattr(vllm_config.model_config.hf_config, "max_source_positions", 1500)
        report = context_plan(vllm_config, "cross_attention", frames).report()
        report["context"] = "each request's encoder output (one release per request)"
    else:
        context = private_context(vllm_config)
        report = context_plan(vllm_config, "self_attention", context.length).report()
        report["context"] = f"private_context {context.context_id[:12]}"
    return {"enabled": True, "contexts": [report]}


def prompt_payload(prompt_cfg) -> dict:
    """What ``GET /v1/dp/budget`` says about prompt privatization (``dp_privacy.prompt``): the
    server's per-token defaults and what requests may change. Spending is per request (receipts)."""
    return {
        "enabled": True,
        "unit": "one token of user-authored prompt content (replace-one, any token <-> any token)",
        "mechanism": prompt_cfg.mechanism,
        "epsilon_token": prompt_cfg.epsilon,
        "delta_token": prompt_cfg.delta,
        "mode": prompt_cfg.mode,
        "allow_request_override": prompt_cfg.allow_request_override,
        "max_epsilon": prompt_cfg.max_epsilon,
        "cache_history": prompt_cfg.cache_history,
        "receipts": "per request: header x-dp-prompt-receipts and field dp_prompt_receipts",
    }
