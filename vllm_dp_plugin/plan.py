"""The one path from the typed ``dp_privacy.attention`` config and a model's shape to a release.

* ``attention_params``: the one translation of the config section into ``DPAttentionParams``
  (the fields both have share names and defaults);
* ``ModelShape``: the served model's attention geometry, from vLLM's config (serving) or from the
  model's Hugging Face config (``vllm-dp account``), by the same rules;
* ``ContextPlan``: one private context over the model: the per-layer parameters and public head
  mappings (from a calibration file or explicit bounds, never from the private context), each
  (layer, KV head) release and what it spends (mode, noise calibration, ``releases_per_head``);
* ``ContextPlan.report()``: the privacy statement; ``context_reports`` gives every served
  context's. ``GET /v1/dp/budget`` returns them and ``vllm-dp account`` prints them: one statement.
* ``aggregation_params`` / ``aggregate_report``: the same for DP aggregation at the output (the
  ``aggregate`` section): one query's calibrated mechanism and a collection's statement.

Serving's workers build their releases from the same plan (``ContextPlan.layer``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .aggregate.documents import Document, load_collection
from .aggregate.facts import FactSheet, release_sheet
from .attention.accounting import composed_spend, group_mechanism, head_budget
from .attention.calibration_file import Calibration, CalibrationError
from .attention.features import taylor_degree, taylor_kernel_error
from .attention.mapping import HeadMapping
from .attention.params import DPAttentionParams
from .attention.private_context import HeadLayout, PrivateContextLayer
from .config import (
    AggregatePrivacyConfig,
    AttentionPrivacyConfig,
    ConfigError,
    FactSheetPrivacyConfig,
)
from .lru import LRU
from .privacy.accountant import Budget
from .privacy.aggregation import ANSWER, AggregationParams, AnswerParams
from .privacy.aggregation import UNIT as AGGREGATION_UNIT
from .privacy.keyed_noise import NoiseKey, context_id
from .privacy.mechanisms import Mechanism
from .privacy.partition_selection import ThresholdRelease
from .privacy.query_ledger import REL_TOLERANCE, BudgetStatus
from .privacy.release_ledger import History, ReleaseLedger

MAX_DEGREE = 64
MAX_PLANS = 64  # ContextPlan.of's cache (serving: one per context, kind and softmax scale)
UNIT = "one private K/V row of one attention layer (replace-one neighbours)"
DOCUMENT_UNIT = ("one document of at most {rows} tokens (replace-one: a document swapped for another in its slot; "
                 "documents encoded independently, so it moves its own {rows} rows of each layer only)")
NO_DOCUMENT_STATEMENT = ("none under unit row: the context is prefilled causally, so one document moves every later "
                         "row of every layer (set unit: document for a per-document guarantee)")
ENCODER_CONTEXT = "each request's encoder output (one release per request)"
ENCODER_POSITIONS = 1500  # Whisper's max_source_positions, when a config does not say
# The config fields that are DPAttentionParams fields (same name, same default, same meaning).
SHARED_FIELDS = tuple(
    f.name for f in dataclasses.fields(DPAttentionParams)
    if f.name in {g.name for g in dataclasses.fields(AttentionPrivacyConfig)}
)


def attention_params(cfg: AttentionPrivacyConfig, budget_heads: int) -> DPAttentionParams:
    """The per-layer ``DPAttentionParams`` of ``cfg``: its shared fields as they are, with the
    whole model's (eps, delta) split over ``budget_heads`` (layer, KV head) releases by
    ``composition`` (``scope="layer"``).

    The DPTree (modes ``tree``, ``reference``) spends its advanced-composition slack delta' on top
    of its head's delta; it is carved out of the configured delta: the head's tree gets half the
    delta it would get, and delta' (of which the cascade spends delta'/2) the head's whole share,
    so each head spends at most 5/6 of its share and the model at most the configured delta."""
    params = DPAttentionParams(**{name: getattr(cfg, name) for name in SHARED_FIELDS}, scope="layer")
    if params.mode == "state":
        return params
    share = head_budget(params, budget_heads).delta  # one (layer, KV head)'s delta
    tree = dataclasses.replace(params.tree, delta_prime=share)
    return dataclasses.replace(params, delta=params.delta / 2, tree=tree)


def release_rules(cfg: AttentionPrivacyConfig) -> int | None:
    """The version of the rules by which ``attention_params`` and ``ContextPlan`` turn ``cfg``
    into releases, where they differ from the first (None: releases are planned as they always
    were). Part of each release's identity (``settings.release_inputs``): a configuration planned
    under other rules draws other keyed noise, never the same noise at another scale (which two
    releases could cancel). 2: the DPTree's delta' is carved out of the budget and
    ``releases_per_head`` splits it. Bump it (and widen the condition) when a rule changes."""
    return 2 if cfg.mode != "state" or cfg.releases_per_head != 1 else None


def layer_mapping(cfg: AttentionPrivacyConfig, kind: str, layer: int, beta: float) -> HeadMapping:
    """The public head mapping of ``layer`` (``kind``: a ``calibration_file.KINDS`` entry) with
    logit scale ``beta`` (the served layer's softmax scale; a calibration made for another scale
    is refused)."""
    if cfg.bounds is not None:
        return HeadMapping(beta=beta, **cfg.bounds)
    if cfg.calibration is None:
        raise ConfigError(
            "attention: DP attention needs public bounds: set `calibration` (a file from "
            "`vllm-dp calibrate MODEL --out FILE`) or explicit `bounds`"
        )
    try:
        mapping = _calibration(cfg.calibration).mapping(kind, layer)
    except KeyError as exc:
        raise ConfigError(f"attention.calibration {cfg.calibration}: {exc.args[0]}") from None
    if abs(mapping.beta - beta) > 1e-6 * beta:
        raise ConfigError(
            f"attention.calibration {cfg.calibration}: {kind} layer {layer} was calibrated with "
            f"softmax scale {mapping.beta:.6g} but the served layer uses {beta:.6g}"
        )
    return mapping


def _finite(x: float) -> float | None:
    """JSON-safe: an unbounded (overflowing) error is reported as null."""
    return x if math.isfinite(x) else None


@functools.lru_cache(maxsize=4)
def _calibration(path: str) -> Calibration:
    try:
        return Calibration.from_file(path)
    except (OSError, CalibrationError) as exc:
        raise ConfigError(
            f"attention.calibration: cannot read {path!r} ({exc}); create it with "
            "`vllm-dp calibrate MODEL --out FILE` (`vllm-dp serve` does when it is missing)"
        ) from None


@dataclass(frozen=True)
class ModelShape:
    """Attention geometry of the served model (global, before tensor parallelism).

    ``self_layers``: decoder (self-)attention layers; ``cross_layers``: cross-attention layers
    (encoder-decoder models, else 0); ``scale``: the softmax scale (``query_pre_attn_scalar``
    replaces the head size where a model has one); ``encoder_positions``: rows of one encoder
    output (encoder-decoder models: each request's private context)."""

    self_layers: int
    cross_layers: int
    total_kv_heads: int
    total_query_heads: int
    head_dim: int
    scale: float
    is_encoder_decoder: bool
    encoder_positions: int | None = None

    @staticmethod
    def of(vllm_config) -> ModelShape:
        """From vLLM's ``VllmConfig`` (its model config's own accessors)."""
        model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
        tp = parallel.tensor_parallel_size
        head_dim = model_config.get_head_size()
        return ModelShape._of(
            model_config.hf_config, model_config.hf_text_config,
            layers=model_config.get_total_num_hidden_layers(),
            kv_heads=model_config.get_total_num_kv_heads(),
            query_heads=model_config.get_num_attention_heads(parallel) * tp,
            head_dim=head_dim,
            enc_dec=bool(getattr(model_config, "is_encoder_decoder", False)),
        )

    @staticmethod
    def from_pretrained(model: str | Path) -> ModelShape:
        """From a Hugging Face model (a directory, or a name in the local cache) without vLLM:
        the attributes vLLM's accessors read for standard attention models."""
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(str(model))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the model configuration of {str(model)!r}: {exc}") from None
        text = getattr(hf_config, "text_config", None) or hf_config
        query_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // query_heads
        kv_heads = next((getattr(text, name) for name in ("num_key_value_heads", "num_kv_heads", "n_head_kv")
                         if getattr(text, name, None) is not None), query_heads)
        return ModelShape._of(
            hf_config, text, layers=text.num_hidden_layers, kv_heads=kv_heads, query_heads=query_heads,
            head_dim=head_dim, enc_dec=bool(getattr(hf_config, "is_encoder_decoder", False)),
        )

    @staticmethod
    def _of(hf_config, text_config, *, layers, kv_heads, query_heads, head_dim, enc_dec) -> ModelShape:
        scalar = getattr(text_config, "query_pre_attn_scalar", None) or head_dim
        return ModelShape(
            self_layers=layers,
            cross_layers=layers if enc_dec else 0,
            total_kv_heads=kv_heads,
            total_query_heads=query_heads,
            head_dim=head_dim,
            scale=float(scalar) ** -0.5,
            is_encoder_decoder=enc_dec,
            encoder_positions=getattr(hf_config, "max_source_positions", ENCODER_POSITIONS) if enc_dec else None,
        )

    def layers(self, kind: str) -> int:
        """How many layers of ``kind`` see the private context."""
        return self.cross_layers if kind == "cross_attention" else self.self_layers


@dataclass(frozen=True)
class ContextPlan:
    """One private context over the model: ``layers`` attention layers of ``kind``, each with
    ``total_kv_heads`` KV heads of size ``head_dim``, a context of ``context_len`` rows."""

    cfg: AttentionPrivacyConfig
    kind: str
    layers: int
    total_kv_heads: int
    total_query_heads: int
    head_dim: int
    beta: float
    context_len: int
    public_head: int = 0

    def __post_init__(self) -> None:
        for key, given, served in (("num_layers", self.cfg.num_layers, self.layers),
                                   ("num_kv_heads", self.cfg.num_kv_heads, self.total_kv_heads)):
            if given is not None and given != served:
                raise ConfigError(
                    f"attention.{key} is {given} but the served model has {served} ({self.kind}); "
                    "leave it out (it is read from the model) or correct it"
                )
        if self.context_len > self.cfg.max_context:
            raise ConfigError(
                f"attention.max_context: a private context of {self.context_len} rows exceeds "
                f"max_context={self.cfg.max_context}"
            )

    @staticmethod
    def of(cfg: AttentionPrivacyConfig, shape: ModelShape, kind: str, context_len: int,
           scale: float | None = None, public_head: int = 0) -> ContextPlan:
        """The plan of a private span of ``context_len`` rows for ``shape``'s ``kind`` layers,
        after ``public_head`` public tokens; ``scale``: the served layer's softmax scale (default:
        the model's). One object per process and distinct arguments: planned once."""
        scale = shape.scale if scale is None else scale
        key = (json.dumps(dataclasses.asdict(cfg)), shape, kind, context_len, scale, public_head)
        plan = _PLANS.get(key)
        if plan is None:
            plan = ContextPlan(cfg, kind, shape.layers(kind), shape.total_kv_heads,
                               shape.total_query_heads, shape.head_dim, scale, context_len, public_head)
            _PLANS.put(key, plan)
        return plan

    @property
    def budget_heads(self) -> int:
        """Per-(layer, KV head) releases sharing the total budget: ``releases_per_head`` of each."""
        return self.layers * self.total_kv_heads * self.cfg.releases_per_head

    @functools.cached_property
    def params(self) -> DPAttentionParams:
        return attention_params(self.cfg, self.budget_heads)

    def layer_params(self, index: int) -> DPAttentionParams:
        """Layer ``index``'s parameters; Taylor features without an explicit ``degree`` get the
        degree rule's choice capped at ``max_features`` (the achieved kernel error is reported)."""
        params = self.params
        if params.features != "taylor" or params.degree is not None:
            return params
        mapping = layer_mapping(self.cfg, self.kind, index, self.beta)
        fits = max(p for p in range(MAX_DEGREE) if math.comb(self.head_dim + p, p) <= params.max_features)
        try:
            wanted = taylor_degree(mapping.logit_bound(self.head_dim), params.kernel_error, mapping.signed)
        except ValueError:  # out of regime (huge logit bound): the cap decides, the error is reported
            wanted = fits
        return dataclasses.replace(params, degree=min(wanted, fits))

    def kernel_error(self, index: int) -> float:
        """Guaranteed relative kernel error of layer ``index``'s Taylor map (nan for PRF)."""
        if self.params.features != "taylor":
            return math.nan
        mapping = layer_mapping(self.cfg, self.kind, index, self.beta)
        degree = self.layer_params(index).degree
        return taylor_kernel_error(mapping.logit_bound(self.head_dim), degree, mapping.signed)

    def logit_bound(self, index: int) -> float:
        """T = beta sup |<q, k>| of layer ``index`` under its public bounds (regime: T of a few)."""
        return layer_mapping(self.cfg, self.kind, index, self.beta).logit_bound(self.head_dim)

    def layer(self, index: int, heads: HeadLayout) -> PrivateContextLayer:
        """The collector/release of layer ``index`` for the heads this process holds (closed
        where the gate closes it: ``open_layers``)."""
        return self._layer(index, heads, self.open_layers[index])

    def _layer(self, index: int, heads: HeadLayout, open: bool = True) -> PrivateContextLayer:
        if not 0 <= index < self.layers:
            raise ValueError(f"layer {index} outside [0, {self.layers})")
        return PrivateContextLayer(
            self.layer_params(index),
            layer_mapping(self.cfg, self.kind, index, self.beta),
            index,
            heads,
            self.head_dim,
            self.context_len,
            self.budget_heads,
            open,
        )

    @functools.cached_property
    def _one_head(self) -> HeadLayout:
        return HeadLayout(1, self.total_query_heads // self.total_kv_heads, 0, self.total_kv_heads)

    @functools.cached_property
    def mechanisms(self) -> tuple[Mechanism, ...]:
        """Each layer's per-(KV head) release (public: bounds, parameters, context length)."""
        return tuple(self._layer(i, self._one_head).planned_mechanism() for i in range(self.layers))

    @functools.cached_property
    def relative_errors(self) -> tuple[float, ...]:
        """Each layer's public bound on a DP denominator's relative error (kernel error + noise
        over the smallest true denominator, ``DPCrossAttention.relative_error_bound``); the
        bounds are per layer, so every KV head of a layer shares its value."""
        return tuple(self._layer(i, self._one_head).relative_error_bound() for i in range(self.layers))

    @functools.cached_property
    def open_layers(self) -> tuple[bool, ...]:
        """The public gate: layer ``i``'s KV heads are released and read iff ``relative_errors[i]``
        <= ``gate`` (all of them with ``gate: false``). Closed heads answer from the public rows;
        cross-attention has none to fall back on (Whisper: all of its keys are private), so its
        layers are always open."""
        if self.cfg.gate is False or self.kind == "cross_attention":
            return (True,) * self.layers
        return tuple(e <= self.cfg.gate for e in self.relative_errors)

    def spent(self, releases_per_head: int = 1) -> Budget:
        """What ``releases_per_head`` releases of this context spend: every open layer's per-head
        release, ``total_kv_heads x releases_per_head`` times, composed with ``composition``
        (nothing when the gate closed every layer). One (the default) is what one deployment's
        release spends (the release ledger's entry). The noise is calibrated for every head, so
        a closed head only lowers what is spent."""
        count = self.total_kv_heads * releases_per_head
        released = [(m, count) for m, is_open in zip(self.mechanisms, self.open_layers, strict=True) if is_open]
        return composed_spend(released, self.params.composition) if released else Budget(0.0, 0.0)

    def memory_refusal(self) -> str | None:
        """Why a release of this context would not fit ``memory_limit_bytes`` (the tree's fp32
        path-sum table, per layer release; a fixed cap of ``DPAttentionParams``, not a
        configuration key; the first open layer over it is named), or None. Public: the plan
        alone (configuration, model shape, context length). The one check before serving, for
        decoder contexts and encoder outputs (Whisper) alike; the release itself makes it again,
        inside the engine, where it would kill the first request."""
        every = HeadLayout(self.total_kv_heads, self.total_query_heads, 0, self.total_kv_heads)
        cap = self.params.memory_limit_bytes
        for i in (i for i, is_open in enumerate(self.open_layers) if is_open):
            dp = self._layer(i, every)._dp
            need = dp.mode.planned_nbytes(dp, self.context_len)
            if need > cap:
                params, features = dp.params, dp.features.dim
                kernel = (f"Taylor degree {params.degree}, {features} features" if params.features == "taylor"
                          else f"{features} {params.features} features")
                return (
                    f"attention.mode: {self.cfg.mode} needs ~{need / 2**30:.2f} GiB for layer {i}'s release of "
                    f"{self.context_len} rows ({kernel}) > memory_limit_bytes={cap / 2**30:.2f} GiB per layer "
                    "release (fixed); use attention.mode: state or a lower attention.degree"
                )
        return None

    def check_memory(self) -> None:
        """Refuse, before any request, a release that would not fit ``memory_limit_bytes``
        (``memory_refusal``; otherwise the first request's release fails inside the engine)."""
        refusal = self.memory_refusal()
        if refusal is not None:
            raise ConfigError(refusal)

    def document_spent(self) -> Budget:
        """Unit document: what one release of the context spends per document, every open
        (layer, KV head) release stated for the document's ``document_tokens`` rows
        (``group_mechanism``) and composed with ``composition``; eps = inf when group privacy
        gives no guarantee."""
        group = [(group_mechanism(m, self.cfg.document_tokens), self.total_kv_heads)
                 for m, is_open in zip(self.mechanisms, self.open_layers, strict=True) if is_open]
        if not group:
            return Budget(0.0, 0.0)
        if any(math.isinf(m.epsilon) for m, _ in group):
            return Budget(math.inf, 1.0)
        return composed_spend(group, self.params.composition)

    def per_document(self) -> dict[str, Any] | str:
        """The per-document statement (unit document), or why there is none (unit row)."""
        if self.cfg.unit != "document":
            return NO_DOCUMENT_STATEMENT
        spent = self.document_spent()
        return {"unit": DOCUMENT_UNIT.format(rows=self.cfg.document_tokens), "rows": self.cfg.document_tokens,
                "documents": self.context_len // self.cfg.document_tokens,
                "spent": {"epsilon": spent.epsilon, "delta": spent.delta}}

    def report(self) -> dict[str, Any]:
        """JSON-ready privacy statement of one private context (the guarantee and its unit):
        ``per_release`` states every (layer, KV head) release (the largest over layers),
        ``spent`` what one release of the context spends (``releases`` of them: the open
        layers' KV heads), ``planned`` what ``releases_per_head`` releases of it spend (within
        ``budget``); ``gate``/``regime`` say which heads carry private information."""
        mechanisms, per_head = self.mechanisms, self.cfg.releases_per_head
        spent = self.spent()
        planned = spent if per_head == 1 else self.spent(per_head)
        open_layers = sum(self.open_layers)
        return {
            "mode": self.cfg.mode,
            "kind": self.kind,
            "unit": UNIT,
            "context_tokens": self.public_head + self.context_len,
            "public_head_tokens": self.public_head,
            "private_rows": self.context_len,
            "layers": self.layers,
            "kv_heads": self.total_kv_heads,
            "releases": open_layers * self.total_kv_heads,
            "releases_per_head": per_head,
            "composition": self.params.composition,
            "per_release": {
                "epsilon": max(m.epsilon for m in mechanisms),
                "delta": max(m.delta for m in mechanisms),
                "mechanism": ", ".join(dict.fromkeys(m.name for m in mechanisms)),
            },
            "spent": {"epsilon": spent.epsilon, "delta": spent.delta},
            "per_document": self.per_document(),
            "planned": {"releases": open_layers * self.total_kv_heads * per_head,
                        "epsilon": planned.epsilon, "delta": planned.delta},
            "noise_std": [math.sqrt(m.variance) for m in mechanisms],
            "logit_bound": [self.logit_bound(i) for i in range(self.layers)],
            "taylor_degree": [self.layer_params(i).degree for i in range(self.layers)],
            "kernel_error": [_finite(self.kernel_error(i)) for i in range(self.layers)],
            "gate": {"threshold": self.cfg.gate or None, "relative_error": [_finite(e) for e in self.relative_errors],
                     "open_layers": [i for i, o in enumerate(self.open_layers) if o]},
            "regime": self.regime(),
            "budget": {"epsilon": self.cfg.epsilon, "delta": self.cfg.delta},
        }

    def regime(self) -> str:
        """What the gate decided, in words (the start-up log and ``/v1/dp/budget`` say it)."""
        errors = self.relative_errors
        span = f"{min(errors):.3g} to {max(errors):.3g}"
        opened, heads = sum(self.open_layers), self.layers * self.total_kv_heads
        if self.kind == "cross_attention":
            return (f"no gate: cross-attention has no public keys to fall back on, so all {heads} (layer, KV "
                    f"head) releases are read (public relative error bounds {span})")
        if self.cfg.gate is False:
            return (f"gate off: all {heads} (layer, KV head) releases are read whatever their error (public "
                    f"relative error bounds {span}); answers may be worse than without the context")
        if opened == 0:
            return (f"out of regime: no (layer, KV head) release can carry private information at these "
                    f"settings (public relative error bounds {span} > gate {self.cfg.gate:g}), so none is "
                    "made and nothing is spent; answers are those of the model without the private context "
                    "(when every context of a deployment is out of regime, none is served at all: requests "
                    "are answered exactly as without it)")
        if opened == self.layers:
            return f"in regime: all {heads} (layer, KV head) releases carry private information (error bounds {span})"
        return (f"partly in regime: {opened * self.total_kv_heads} of {heads} (layer, KV head) releases carry "
                f"private information (layers {[i for i, o in enumerate(self.open_layers) if o]}); the others "
                f"answer from the public rows alone (error bounds {span}, gate {self.cfg.gate:g})")


_PLANS: LRU[tuple, ContextPlan] = LRU(MAX_PLANS)


def check_model(cfg: AttentionPrivacyConfig, shape: ModelShape) -> None:
    """Refuse private contexts a model cannot serve: operator-given contexts are for decoder-only
    models (an encoder-decoder model's private context is each request's encoder output), and a
    decoder-only model needs one."""
    if shape.is_encoder_decoder and cfg.serves_context:
        raise ConfigError(
            "attention.private_context and attention.contexts are for decoder-only models; in "
            "encoder-decoder models the encoder output of each request is the private context"
        )
    if not shape.is_encoder_decoder and not cfg.serves_context:
        raise ConfigError(
            "attention.private_context (a text file) or attention.contexts (named files) is "
            "required for decoder-only models"
        )


def context_reports(cfg: AttentionPrivacyConfig, shape: ModelShape,
                    lengths: Mapping[str, tuple[int, int]]) -> list[dict]:
    """The statement (``ContextPlan.report``) of every private context a model serves, in order:
    decoder-only models one per named context (``lengths``: name -> (public head tokens, private
    rows)), encoder-decoder
    models one for each request's encoder output. Pure: config, shape and lengths only."""
    check_model(cfg, shape)
    if shape.is_encoder_decoder:
        plans = {None: ContextPlan.of(cfg, shape, "cross_attention", shape.encoder_positions)}
    else:
        plans = {name: ContextPlan.of(cfg, shape, "self_attention", rows, public_head=head)
                 for name, (head, rows) in lengths.items()}
    for plan in plans.values():
        plan.check_memory()
    if shape.is_encoder_decoder:
        return [{**plans[None].report(), "context": ENCODER_CONTEXT}]
    return [{"name": name, **plan.report()} for name, plan in plans.items()]


# --------------------------------------------------------------------------- DP aggregation
AGGREGATE_NOT_PROTECTED = (
    "the configuration (members, max_document_tokens, max_member_tokens), the response's timing (a "
    "step's time depends on the members' prompt lengths), and what the public sequence (the "
    "conversation alone) would answer"
)


BATCH_INVARIANCE = ("a sequence's outputs do not depend on the rest of its engine batch (a query's members decode "
                    "together): measured on the CPU engine (float32); elsewhere VLLM_BATCH_INVARIANT=1 is required "
                    "unless aggregate.allow_batch_variance is set")
EXTRACTED = ("nothing beyond the mechanism: each member's vote is a deterministic function of its own documents "
             "and the public question (answer_member: extract, no model runs for a member)")
BATCH_VARIANCE = ("; and, with aggregate.allow_batch_variance, batch composition: on an engine that is not "
                  "batch-invariant one document can change other members' answers (several votes) at rounding level")


def aggregation_params(cfg: AggregatePrivacyConfig, epsilon: float | None = None) -> AggregationParams | AnswerParams:
    """One query's mechanism at per-query ``epsilon`` (default ``cfg.epsilon``; from
    ``cfg.min_epsilon`` to ``cfg.cap``): per-step epsilons calibrated so that its worst case fits
    (eps, ``cfg.delta``), charged at least ``cfg.min_epsilon``; ``mechanism: answer``: the
    partition selection of (eps, ``cfg.delta``). The one check of a request's ``dp_epsilon``
    (ValueError naming it and the bounds)."""
    eps = cfg.epsilon if epsilon is None else float(epsilon)
    if not cfg.min_epsilon <= eps <= cfg.cap:
        raise ValueError(f"dp_epsilon must lie in [{cfg.min_epsilon:g}, {cfg.cap:g}] (aggregate.min_epsilon, "
                         f"aggregate.max_epsilon), got {eps:g}")
    if cfg.mechanism == ANSWER:
        params = _answer_params(eps, cfg.delta, answer_l0(cfg))
        if cfg.answer_batch is not None and params.release.threshold > cfg.answer_batch:
            raise ValueError(f"aggregate.answer_batch={cfg.answer_batch} members can never reach the release "
                             f"threshold {params.release.threshold} at eps {eps:g} (l0 = 2): nothing would ever be "
                             "released; raise answer_batch or the epsilon")
        return params
    return _aggregation_params(cfg.mechanism, cfg.members, eps, cfg.delta, cfg.max_private_tokens,
                               cfg.gate_fraction, cfg.clip, cfg.threshold, cfg.choices, cfg.confidence,
                               cfg.min_epsilon)


def answer_l0(cfg: AggregatePrivacyConfig) -> int:
    """How many keys' counts one document moves under ``mechanism: answer``: 1 with a member per
    document (its vote comes or goes), 2 with ``answer_members`` (a member of several documents
    may switch its vote from one key to another when one of them is removed) or ``answer_batch``
    (a document that runs displaces another from the batch)."""
    return 1 if cfg.answer_members is None and cfg.answer_batch is None else 2


@functools.lru_cache(maxsize=256)
def _answer_params(eps: float, delta: float, l0: int) -> AnswerParams:
    return AnswerParams.calibrated(Budget(eps, delta), l0)


@functools.lru_cache(maxsize=256)
def _aggregation_params(mechanism, members, eps, delta, max_private, gate_share, clip, threshold,
                        candidates, confidence, min_charge) -> AggregationParams:
    return AggregationParams.calibrated(mechanism, members, Budget(eps, delta), max_private, gate_share,
                                        clip=clip, threshold=threshold, candidates=candidates,
                                        confidence=confidence, min_charge=min_charge)


def aggregate_report(cfg: AggregatePrivacyConfig, name: str, ledger: BudgetStatus | None,
                     clients: Mapping[str, BudgetStatus] | None = None) -> dict[str, Any]:
    """JSON-ready statement of one document collection served by DP aggregation: the unit, the
    default query's mechanism and worst case, the least a query is charged and how many queries
    the total pays for at most, the context's total budget, each client's share of it (never its
    key), and what the queries so far spent (``ledger``; per client: ``clients``, name -> status)."""
    params = aggregation_params(cfg)
    report = {
        "name": name,
        "mode": "aggregate",
        "unit": AGGREGATION_UNIT,
        "mechanism": params.mechanism,
        "per_query": {"epsilon": cfg.epsilon, "delta": cfg.delta, "max_epsilon": cfg.cap,
                      "min_epsilon": cfg.min_epsilon,
                      "worst_case": {"epsilon": params.worst_case.epsilon, "delta": params.worst_case.delta}},
        "max_queries": max_queries(cfg),
        "budget": {"epsilon": cfg.total_epsilon, "delta": cfg.total_delta},
        "reuse": REUSE if cfg.mechanism == ANSWER and cfg.reuse_answers else "off",
        "not_protected": AGGREGATE_NOT_PROTECTED + (BATCH_VARIANCE if cfg.allow_batch_variance
                                                    and not cfg.reads_members else "")
        + (REUSE_SEEN if cfg.mechanism == ANSWER and cfg.reuse_answers else ""),
        "assumes": EXTRACTED if cfg.reads_members else BATCH_INVARIANCE,
        "statement": params.statement(),
    }
    if isinstance(params, AnswerParams):
        release = params.release
        members = "one per document" if cfg.answer_members is None else f"{cfg.answer_members} by keyed hash"
        if cfg.answer_batch is not None:
            members += (f", {cfg.answer_batch} run per query (documents that can answer, in a keyed order; padded "
                        "with members that see no document)")
        report.update(members=members, member_votes=("read from its own documents by rule, no model "
                                                      "(answer_member: extract)") if cfg.reads_members else
                      "the model's answer from its own documents, read against them (answer_member: model)",
                      selection={"scale": release.scale, "threshold": release.threshold,
                                                  "keys_per_document": release.l0},
                      composition="per query: one discrete-Laplace partition selection (exact release "
                                  "probabilities); over queries: basic")
    else:
        report.update(members=params.members, gate=cfg.gate,
                      per_private_token={"eps_select": params.eps_select, "eps_gate": params.eps_gate},
                      max_private_tokens=params.max_private_tokens,
                      candidates="the whole vocabulary" if params.candidates is None else params.candidates,
                      composition="per query: RDP (zCDP events) or basic, whichever is smaller; over queries: basic")
    if cfg.per_document:  # no collection total; what documents spent is private: no ledger
        report.update(unit=AGGREGATION_UNIT.removesuffix(", per query") + PER_DOCUMENT_SCOPE,
                      budget={"per_document": {"epsilon": cfg.per_document_epsilon,
                                               "delta": cfg.per_document_delta}},
                      max_queries=None, max_answers_per_document=answers_per_document(cfg),
                      composition=PER_DOCUMENT_COMPOSITION)
        if cfg.clients:
            report["clients"] = {c.name: {"share": c.share, "budget": {"per_document": {
                "epsilon": cfg.per_document_epsilon * c.share, "delta": cfg.per_document_delta * c.share}}}
                for c in cfg.clients.values()}
        return report
    if cfg.clients:
        report["clients"] = {
            c.name: {"share": c.share, "budget": {"epsilon": cfg.total_epsilon * c.share,
                                                  "delta": cfg.total_delta * c.share}}
            for c in cfg.clients.values()}
        for client, status in (clients or {}).items():
            report["clients"][client]["ledger"] = status.to_json()
    if ledger is not None:
        report["ledger"] = ledger.to_json()
    return report


PER_DOCUMENT_SCOPE = ", over the deployment's lifetime: each document within its own cap, all clients together"
PER_DOCUMENT_COMPOSITION = (
    "per query: one discrete-Laplace partition selection, charged only to the documents whose member votes; "
    "per document over its lifetime: an individual privacy filter (basic composition under fully adaptive "
    "choice): a document whose cap a query would exceed takes no part in it, so no document ever spends "
    "more than its cap, against all clients together")
REUSE_SEEN = "; whether a question was asked before (a reused release answers sooner): other clients' questions"
REUSE = ("a question asked again of the same collection version at the same epsilon gets the earlier release, "
         "charged to nobody (post-processing)")


def answers_per_document(cfg: AggregatePrivacyConfig) -> int:
    """The most answers one document takes part in under its cap (each charges at least
    ``min_epsilon`` and ``delta``)."""
    by_eps = math.floor(cfg.per_document_epsilon / cfg.min_epsilon * (1 + 2 * REL_TOLERANCE))
    by_delta = math.floor(cfg.per_document_delta / cfg.delta * (1 + 2 * REL_TOLERANCE)) if cfg.delta else by_eps
    return min(by_eps, by_delta)


def max_queries(cfg: AggregatePrivacyConfig) -> int:
    """The most queries a collection's total pays for: each is charged at least ``min_epsilon``
    (up to the ledger's relative tolerance, and a calibration a hair below it)."""
    return math.floor(cfg.total_epsilon / cfg.min_epsilon * (1 + 2 * REL_TOLERANCE))


# --------------------------------------------------------------------------- DP fact sheet
FACT_SHEET_UNIT = ("one document of the collection (add/remove: its text and its presence; a replacement is two "
                   "such changes), for the collection's one release: every query answered from the sheet spends "
                   "nothing more")
FACT_SHEET_NOT_PROTECTED = ("the configuration (epsilon, delta, facts_per_document, max_document_tokens) and the "
                            "collection's names; the sheet itself is public once released")
FACT_SHEET_PER_DOCUMENT = ("; each release (a changed collection is released again) is charged to every document "
                           "it reads, within the document's lifetime cap shared with DP aggregation")
FACT_SHEET_VERSION = "facts/v1"  # the key extraction (aggregate.facts): a change draws a new release


def fact_sheet_release(cfg: FactSheetPrivacyConfig) -> ThresholdRelease:
    """The set union's mechanism: discrete Laplace thresholding at (epsilon, delta) with
    ``l0 = facts_per_document``."""
    return ThresholdRelease.calibrated(cfg.epsilon, cfg.delta, cfg.facts_per_document)


@dataclass(frozen=True)
class ReleasedSheet:
    """One collection's released fact sheet and its release ledger history (public)."""

    name: str
    sheet: FactSheet
    history: History


def release_fact_sheet(cfg: FactSheetPrivacyConfig, name: str, documents: Sequence[Document], key: NoiseKey,
                       ledger: ReleaseLedger) -> ReleasedSheet:
    """Release collection ``name``'s fact sheet: recorded in ``ledger`` first (``ReleaseRefused``
    when the collection was released under other noise and ``allow_rerelease`` is off), then the
    keyed set union over its documents (the same key, documents and settings give the same sheet)."""
    release = fact_sheet_release(cfg)
    texts = sorted((d.id, d.text) for d in documents)
    subject = context_id(json.dumps(texts, ensure_ascii=False))  # SECRET: enters only the MAC
    settings = context_id(json.dumps([FACT_SHEET_VERSION, release.scale, release.threshold, release.l0]))
    history = ledger.register(subject, settings, release.budget, FACT_SHEET_UNIT,
                              allow_rerelease=cfg.allow_rerelease, setting="fact_sheet.allow_rerelease")
    read = [text for _, text in texts]
    if cfg.per_document_epsilon is not None:
        read = [text for (_, text), used in zip(texts, sheet_documents(cfg, name, texts, subject + settings, key,
                                                                       ledger.store, release.budget), strict=True)
                if used]
    sheet = release_sheet(read, release, key.generator(subject + settings, "fact_sheet"))
    return ReleasedSheet(name, sheet, history)


def sheet_documents(cfg: FactSheetPrivacyConfig, name: str, texts: Sequence[tuple[str, str]], release_id: str,
                    key: NoiseKey, store, cost: Budget):
    """Which documents the sheet reads under per-document budgets: those its reservation (id: a
    keyed label of the release) made active, charged to each; the same ones after a restart."""
    from .privacy.document_ledger import DocumentLedger

    documents = DocumentLedger(key, store)
    labels = documents.labels(name, [doc_id for doc_id, _ in texts])
    rid = key.label("fact-sheet/reservation", release_id)
    active = documents.reserved(name, rid, labels)
    if active is None:  # the first release: every document with room takes part and is charged
        reservation = documents.reserve(name, labels, cost, Budget(cfg.per_document_epsilon, cfg.per_document_delta),
                                        rid=rid)
        documents.settle(reservation, reservation.active)
        active = reservation.active
    return active


def release_fact_sheets(cfg: FactSheetPrivacyConfig, key: NoiseKey, ledger: ReleaseLedger,
                        count_tokens=None) -> dict[str, ReleasedSheet]:
    """Every configured collection loaded (ConfigError naming the key; documents over
    ``max_document_tokens`` by ``count_tokens`` refused) and released (``release_fact_sheet``)."""
    out = {}
    for name, source in cfg.collection_sources().items():
        try:
            collection = load_collection(name, source, count_tokens, cfg.max_document_tokens, "fact_sheet.contexts")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        out[name] = release_fact_sheet(cfg, name, collection.documents, key, ledger)
    return out


def fact_sheet_report(cfg: FactSheetPrivacyConfig, name: str, released: ReleasedSheet | None = None) -> dict[str, Any]:
    """JSON-ready statement of one collection's fact sheet: the unit, the one release's (eps,
    delta) and mechanism, and, once released, the sheet (public: its facts with their noisy
    counts, and ``context``, the system text queries get) and the release ledger's history."""
    release = fact_sheet_release(cfg)
    budget = release.budget
    report = {
        "name": name,
        "mode": "fact_sheet",
        "unit": FACT_SHEET_UNIT,
        "release": {"epsilon": budget.epsilon, "delta": budget.delta, "scale": release.scale,
                    "threshold": release.threshold, "facts_per_document": release.l0},
        "per_query": {"epsilon": 0.0, "delta": 0.0},
        "statement": release.statement(),
        "not_protected": FACT_SHEET_NOT_PROTECTED,
    }
    if cfg.per_document_epsilon is not None:
        report["budget"] = {"per_document": {"epsilon": cfg.per_document_epsilon, "delta": cfg.per_document_delta}}
        report["unit"] = FACT_SHEET_UNIT + FACT_SHEET_PER_DOCUMENT
    if released is not None:
        report.update(facts=released.sheet.to_json(), context=released.sheet.system_text(),
                      ledger=released.history.to_json())
    return report
