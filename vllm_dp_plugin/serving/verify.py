"""Start-up proof that the DP path is the one serving: every worker's every attention layer.

The checks of the DP attention backend live in its impl, so they never run when the impl is not
the one vLLM picked (CUDA without ``--attention-backend CUSTOM``, a layer type the plugin does not
wrap: Mamba/hybrid, linear attention, MLA). The API server would then prepend the private context
and claim DP in ``/v1/dp/budget`` while the engine attends to it exactly. So once the engine is
up, the endpoint plugin asks every worker (``collective_rpc(LAYER_REPORT)``, a method the general
plugin installs on vLLM's worker class) what each layer of its forward context is, and refuses to
serve unless every layer that sees private rows is a DP impl that is on, holds the renderer's
contexts (the same public labels, in the same order) and uses the softmax scale the budget was
planned with, and, with private contexts, unless the worker's model runner tells the layers which
context each request reads (``batch_contexts``: vLLM's V1 runner).
"""

from __future__ import annotations

import math

from ..config import ConfigError

LAYER_REPORT = "dp_privacy_layers"  # the worker method's name
CROSS_ATTENTION = "encoder_decoder"  # vLLM's AttentionType.ENCODER_DECODER


def layer_report(worker) -> list[dict]:
    """(Runs in a worker.) One entry per layer of the worker's forward context: its class, whether
    its impl is a DP impl and on, its attention type, its private contexts' public labels, its
    softmax scale, and whether the worker's model runner routes requests to their contexts.
    Nothing private: labels are keyed."""
    from .backend import DPImplMixin
    from .batch_contexts import runner_announces

    routes = runner_announces(worker.model_runner)
    out = []
    for name, layer in worker.vllm_config.compilation_config.static_forward_context.items():
        impl = getattr(layer, "impl", None)
        contexts = getattr(impl, "_contexts", None)
        attn_type = getattr(impl, "attn_type", getattr(layer, "attn_type", None))
        out.append({
            "name": name,
            "layer": type(layer).__name__,
            "impl": type(impl).__name__,
            "dp": isinstance(impl, DPImplMixin),
            "on": bool(getattr(impl, "_dp_on", False)),
            "attn_type": str(getattr(attn_type, "value", attn_type)),
            "labels": None if contexts is None else [c.identity.label for c in contexts],
            "routes_contexts": routes,
            "scale": getattr(impl, "scale", None),
        })
    return out


def check_layers(reports: list[list[dict]], *, layers: int, labels: list[str] | None, scale: float) -> None:
    """Refuse to serve unless, across the workers' ``reports``, the ``layers`` layers that see
    private rows are all DP impls that are on and use ``scale``. With private contexts
    (``labels`` given, decoder-only) that is every layer of the forward context, whatever its
    type; each must hold exactly ``labels`` and its worker must route requests to their contexts;
    without (Whisper) the cross-attention layers."""
    covered = set()
    for worker, layers_of_worker in enumerate(reports):
        for entry in layers_of_worker:
            where = f"worker {worker} layer {entry['name']} ({entry['layer']}/{entry['impl']})"
            if labels is None and entry["attn_type"] != CROSS_ATTENTION:
                continue  # encoder-decoder: only cross-attention reads the encoder output
            if not (entry["dp"] and entry["on"]):
                raise ConfigError(
                    f"dp_privacy.attention: {where} is not served by the DP attention backend, so "
                    "it would attend to the private rows exactly. On CUDA pass --attention-backend "
                    "CUSTOM (`vllm-dp serve` adds it); models with layers the plugin does not wrap "
                    "(Mamba/hybrid, linear attention, MLA) cannot serve a private context"
                )
            if labels is not None and entry["labels"] != list(labels):
                raise ConfigError(
                    f"dp_privacy.attention: {where} holds private contexts {entry['labels']} but the "
                    f"renderer prepends {list(labels)}: they read different context files or tokenizers"
                )
            if labels is not None and not entry["routes_contexts"]:
                raise ConfigError(
                    f"dp_privacy.attention: worker {worker}'s model runner does not tell the DP layers "
                    "which private context each request reads (only vLLM's V1 model runner does): "
                    "set VLLM_USE_V2_MODEL_RUNNER=0"
                )
            if entry["scale"] is None or not math.isclose(entry["scale"], scale, rel_tol=1e-6):
                raise ConfigError(
                    f"dp_privacy.attention: {where} uses softmax scale {entry['scale']} but the "
                    f"budget was planned with {scale}"
                )
            covered.add(entry["name"])
    if len(covered) != layers:
        raise ConfigError(
            f"dp_privacy.attention: the workers report {len(covered)} DP layers of the model's "
            f"{layers}: refusing to serve a private context that some layer may see exactly"
        )
