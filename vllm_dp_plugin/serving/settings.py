"""The served ``dp_privacy`` configuration, read once per process from vLLM's config.

Every process (API server, engine core, workers) sees ``--additional-config`` through
``VllmConfig.additional_config``; this module turns it into the typed ``DPPrivacyConfig`` (parsed
and validated once per process: ``config.parse_section``) plus what the model contributes (its
attention shape, the private contexts' tokens). ``budget_statement`` is the privacy statement
from public inputs only: ``GET /v1/dp/budget`` returns it (with each context's keyed label and
ledger) and ``vllm-dp account`` prints it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import (
    CONFIG_KEY,
    ConfigError,
    DPPrivacyConfig,
    config_from_json,
    parse_section,
    section_json,
)
from ..plan import (
    UNIT,
    ContextPlan,
    ModelShape,
    check_model,
    context_reports,
    release_rules,
)
from ..privacy.keyed_noise import NoiseKey
from ..privacy.release_ledger import ReleaseLedger
from ..prompt.paraphrase import PARAPHRASE
from .context import (
    ContextIdentity,
    PrivateContext,
    check_prefix_free,
    context_tokens,
    file_digest,
    weights_digest,
)

TOKENIZER_MODE = "dp_private"
PLUGIN_NAME = "dp_privacy"  # entry-point name in every vLLM plugin group we use


def dp_config(vllm_config) -> DPPrivacyConfig:
    """The validated ``dp_privacy`` section (an empty config, i.e. DP off, when absent), parsed
    once per process and section (every call after the first returns the same object)."""
    return parse_section(_raw_section(vllm_config))


def private_prompts(cfg: DPPrivacyConfig) -> bool:
    """Whether private prompts may run through the engine, where its counters, stats log and
    prefix cache see them: DP aggregation's members (documents) or paraphrase rewrites (the user's
    raw text), which a request can choose (``vllm_xargs.dp_mechanism``) unless
    ``prompt.allow_request_override`` is off."""
    prompt = cfg.prompt
    paraphrase = prompt is not None and (prompt.mechanism == PARAPHRASE or prompt.allow_request_override)
    return cfg.aggregate is not None or paraphrase


def raw_config_json(vllm_config) -> str:
    """The raw section as JSON, in the order given (the first of ``attention.contexts`` is the
    default context): what identifies the configuration (cache keys)."""
    return section_json(_raw_section(vllm_config))


def _raw_section(vllm_config):
    return (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)


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
    shape = ModelShape.of(vllm_config)
    check_model(att, shape)
    if not shape.is_encoder_decoder:
        key = att.context_key()
        if model_config.tokenizer_mode != TOKENIZER_MODE:
            raise ConfigError(
                f"{key} needs --tokenizer-mode {TOKENIZER_MODE} (the renderer that places the "
                "context at positions [0, P) of every request)"
            )
        if getattr(model_config, "enable_prompt_embeds", False):
            raise ConfigError(f"{key} cannot be combined with --enable-prompt-embeds")
        check_engine_options(vllm_config)


# Optional ``VllmConfig`` sections a private context may be served with. Every other optional
# section must stay unset: speculative decoding (n-gram/suffix lookup reads [0, P); its bursts and
# metrics publish the matches), KV events (block events carry the context's ids), KV and encoder
# cache transfer, weight transfer, LoRA (adapters change K/V after the release), and whatever
# section a later vLLM adds, until someone checks that it neither reads nor publishes private
# positions. An allowlist: new features are refused by default.
ALLOWED_OPTIONAL_SECTIONS = ("model_config", "quant_config", "reasoning_config")


def check_engine_options(vllm_config, key: str | None = None) -> None:
    """Refuse engine features that read or publish private positions (private contexts or
    document collections served); errors name ``key`` (default: the attention contexts' key)."""
    key = key or dp_config(vllm_config).attention.context_key()
    for field in dataclasses.fields(type(vllm_config)):
        if field.default is not None or field.name in ALLOWED_OPTIONAL_SECTIONS:
            continue
        section = getattr(vllm_config, field.name, None)
        if field.name == "kv_events_config" and section is not None and not section.enable_kv_cache_events:
            continue
        if section is not None:
            raise ConfigError(
                f"{key}: the engine option `{field.name}` is set, and it is not "
                f"on the allowlist of features that keep private positions private "
                f"({', '.join(ALLOWED_OPTIONAL_SECTIONS[1:])}); serve without it"
            )
    if getattr(getattr(vllm_config, "aux_output_config", None), "enabled", False):
        raise ConfigError(
            f"{key}: returning routed experts (--enable-return-routed-experts) "
            "publishes per-token routing of private positions"
        )
    runner = getattr(vllm_config.model_config, "runner_type", "generate")
    if runner != "generate":
        raise ConfigError(
            f"{key} needs the generate runner, got --runner {runner}: pooling "
            "returns hidden states at private positions"
        )


def release_ledger(vllm_config) -> ReleaseLedger:
    cfg = dp_config(vllm_config)
    key = NoiseKey(cfg.key_file)
    return ReleaseLedger(key, cfg.ledger_store(key))


@dataclass(frozen=True)
class ServedModel:
    """What besides the token ids the exact K/V state of a private context depends on."""

    model: str
    revision: str | None
    tokenizer: str
    max_model_len: int
    dtype: str
    kv_cache_dtype: str
    device: str

    @staticmethod
    def of(vllm_config) -> ServedModel:
        model_config = vllm_config.model_config
        return ServedModel(
            model_config.model, getattr(model_config, "revision", None), model_config.tokenizer,
            model_config.max_model_len, str(model_config.dtype), str(vllm_config.cache_config.cache_dtype),
            str(vllm_config.device_config.device_type),
        )


def release_inputs(cfg: DPPrivacyConfig, served: ServedModel) -> dict:
    """Everything besides the token ids that the exact K/V state and its release depend on
    (``ContextIdentity.release``): weights, dtypes, device type, the resolved release parameters
    (the calibration's contents, not its path; no file names)."""
    attention = dataclasses.asdict(cfg.attention)
    for name in ("private_context", "contexts", "allow_rerelease"):  # the ids stand for the files; no effect
        attention.pop(name)
    if attention["calibration"] is not None:
        attention["calibration"] = file_digest(attention["calibration"])
    rules = release_rules(cfg.attention)
    if rules is not None:  # planned under other rules than the same configuration used to be
        attention["rules"] = rules
    return {
        "weights": weights_digest(served.model, served.revision),
        "dtype": served.dtype,
        "kv_cache_dtype": served.kv_cache_dtype,
        "device": served.device,
        "attention": attention,
    }


def encoder_release_inputs(vllm_config) -> bytes:
    """``release_inputs`` as canonical JSON, for encoder-output releases (Whisper): their noise is
    keyed by these and the encoder output, so two deployments with other parameters (eps, mode,
    calibration, weights) never draw the same noise at different scales for the same audio (two
    such releases would cancel their noise)."""
    served = ServedModel.of(vllm_config)
    return json.dumps(release_inputs(dp_config(vllm_config), served), sort_keys=True).encode()


def configures_private_contexts(vllm_config) -> bool:
    """Operator-given private contexts are configured (a decoder-only model), as opposed to none
    or Whisper's per-request encoder outputs."""
    att = dp_config(vllm_config).attention
    enc_dec = bool(getattr(vllm_config.model_config, "is_encoder_decoder", False))
    return att is not None and att.serves_context and not enc_dec


def serves_private_contexts(vllm_config) -> bool:
    """Requests carry a private context: one is configured and not every context is out of
    regime (``contexts_out_of_regime``)."""
    return configures_private_contexts(vllm_config) and not contexts_out_of_regime(vllm_config)


def contexts_out_of_regime(vllm_config) -> bool:
    """The public gate closed every layer of every configured private context: no release could
    carry private information, so none is made and the contexts are not served at all (the
    renderer prepends nothing, the layers attend exactly over the request alone): answers are
    exactly the model's without the context, and nothing is spent. Public: plans only."""
    if not configures_private_contexts(vllm_config):
        return False
    return not any(any(context_plan(vllm_config, "self_attention", c.private_length, public_head=c.head).open_layers)
                   for c in private_contexts(vllm_config))


def private_contexts(vllm_config) -> tuple[PrivateContext, ...]:
    """The decoder-only private contexts of this deployment, in order (the first is the default):
    names, ids and identities (cached per process and configuration)."""
    return _private_contexts(raw_config_json(vllm_config), ServedModel.of(vllm_config))


@functools.lru_cache(maxsize=4)
def _private_contexts(raw_json: str, served: ServedModel) -> tuple[PrivateContext, ...]:
    cfg = config_from_json(raw_json)
    att, key = cfg.attention, NoiseKey(cfg.key_file)
    inputs = release_inputs(cfg, served)
    contexts = []
    for name, path in att.context_files().items():
        where = att.context_key(name)
        tokens = context_tokens(path, served.tokenizer, where, att.public_head, att.document_tokens_or_none)
        ids = tokens.ids
        if len(ids) >= served.max_model_len:
            raise ConfigError(
                f"{where} has {len(ids)} tokens but max_model_len is {served.max_model_len}: no room "
                "for the public prompt"
            )
        contexts.append(PrivateContext(name, ids, ContextIdentity.of(ids, inputs, key), tokens.bos, tokens.head,
                                       tokens.end, tokens.slot))
    check_prefix_free(contexts, att.context_key())
    if len({c.head > 0 for c in contexts}) > 1:
        raise ConfigError(
            f"attention.public_head: contexts {[c.name for c in contexts if c.head == 0]} have no public head "
            "while the others do; write every context as a system turn or set public_head to a number"
        )
    return tuple(contexts)


def context_plan(vllm_config, kind: str, context_len: int, scale: float | None = None,
                 public_head: int = 0) -> ContextPlan:
    """The public plan of one private span of ``context_len`` rows (after ``public_head`` public
    tokens) for ``kind`` layers; ``scale``: the served layer's softmax scale (default: the
    model's, ``ModelShape.scale``)."""
    return ContextPlan.of(dp_config(vllm_config).attention, ModelShape.of(vllm_config), kind, context_len, scale,
                          public_head)


def register_release(vllm_config) -> None:
    """Record this deployment's release of each private context in the release ledger (workers,
    at start-up); refuses a second release under other noise unless ``allow_rerelease``."""
    att = dp_config(vllm_config).attention
    ledger = release_ledger(vllm_config)
    for context in private_contexts(vllm_config):
        spent = context_plan(vllm_config, "self_attention", context.private_length, public_head=context.head).spent()
        if spent.epsilon == 0:
            continue  # the gate closed every layer: nothing is released
        try:
            ledger.register(context.identity.subject, context.identity.release, spent, UNIT,
                            allow_rerelease=att.allow_rerelease)
        except RuntimeError as exc:
            raise ConfigError(f"{att.context_key(context.name)}: {exc}") from None


CONTEXT_SCOPE = (
    "per private context: each context is its own protected dataset with its own release, and "
    "its entry's budget covers that context alone, whatever the number of contexts served"
)


def budget_statement(cfg: DPPrivacyConfig, shape: ModelShape | None, lengths: Mapping[str, tuple[int, int]]) -> dict:
    """The privacy statement of a deployment from public inputs only (pure): the configuration,
    the model's ``shape`` (None: DP attention off) and the private contexts' token counts
    (``lengths``, name -> (public head tokens, private rows), in order). DP attention: one ``ContextPlan.report()`` per
    private context (``plan.context_reports``); prompt privatization: ``prompt_payload``.
    ``GET /v1/dp/budget`` answers it with each context's keyed label and ledger added
    (``budget_payload``); ``vllm-dp account`` prints it."""
    payload: dict = {"enabled": cfg.attention is not None, "contexts": []}
    if cfg.attention is not None:
        payload["contexts"] = context_reports(cfg.attention, shape, lengths)
        if not shape.is_encoder_decoder:
            payload["scope"] = CONTEXT_SCOPE
    if cfg.prompt is not None:
        payload["prompt"] = prompt_payload(cfg.prompt)
    return payload


def budget_payload(vllm_config) -> dict:
    """What ``GET /v1/dp/budget`` answers: ``budget_statement`` of the served model and contexts,
    each decoder-only context with its keyed label (``context``) and release ``ledger``."""
    cfg = dp_config(vllm_config)
    if cfg.attention is None:
        return budget_statement(cfg, None, {})
    shape = ModelShape.of(vllm_config)
    contexts = () if shape.is_encoder_decoder else private_contexts(vllm_config)
    payload = budget_statement(cfg, shape, {c.name: (c.head, c.private_length) for c in contexts})
    ledger = release_ledger(vllm_config) if contexts else None
    for report, context in zip(payload["contexts"], contexts, strict=False):
        report["context"] = f"private_context {context.identity.label}"
        report["ledger"] = ledger.history(context.identity.subject).to_json()
    return payload


def prompt_payload(prompt_cfg) -> dict:
    """What ``GET /v1/dp/budget`` says about prompt privatization (``dp_privacy.prompt``): the
    server's per-token defaults, what requests may change and which requests share the history
    cache. Spending is per request (receipts)."""
    from ..prompt.session import MAX_SESSION_CHARS, MIN_SESSION_CHARS

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
        "history_namespace": (
            "privatized user messages are reused only by requests with the same vllm_xargs.dp_session "
            f"(a secret of {MIN_SESSION_CHARS} to {MAX_SESSION_CHARS} characters) and the same "
            "Authorization / x-api-key credential; without a dp_session every request is noised afresh"
            if prompt_cfg.cache_history
            else "none: every request is noised afresh"
        ),
        "receipts": "per request: header x-dp-prompt-receipts and field dp_prompt_receipts",
        "paraphrase": {  # mechanism paraphrase (the default or a request's dp_mechanism)
            "unit": "one user message (any two messages, its length included)",
            "epsilon": "per output token of the rewrite (dp_epsilon / prompt.epsilon)",
            "width": prompt_cfg.paraphrase_width,
            "max_tokens": prompt_cfg.paraphrase_max_tokens,
            "template": prompt_cfg.paraphrase_template,
        },
    }
