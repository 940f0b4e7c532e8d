"""The DP attention backend: vLLM's own backend plus the private-context path.

* CPU: ``DPCPUBackend`` replaces ``CPU_ATTN`` (the only backend the CPU platform uses).
* CUDA: ``DPTritonBackend`` is registered as ``CUSTOM`` (``--attention-backend CUSTOM`` or
  ``-ac.backend_per_kind '{"cross_attention": "CUSTOM"}'``).
Without ``dp_privacy.attention`` both are exact pass-throughs to the parent backend.

Decoder-only models (each request reads one of the private contexts, at positions [0, P_c); the
model runner announces which, from the request's own ids: ``batch_contexts``):
* ``do_kv_cache_update`` writes the cache as usual and hands the rows at positions < P_c of a
  request reading context c to c's ``PrivateContextLayer`` (and to every other context sharing
  those leading ids: the prefix cache may serve them to its requests); when all P_c rows are
  present it releases once, with noise keyed by c's identity.
* ``forward`` answers a query at position p >= P_c as merge(DP part from c's release only, exact
  part over [P_c, p]), computed from cache rows >= P_c only; queries at private positions (a
  context's own prefill) attend exactly with the parent's kernel, as they compute the private K/V
  themselves.
Encoder-decoder models (Whisper): each request's encoder K/V are released when first written
(they are not stored in the cache at all) and every cross-attention query reads only the release.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from ..attention.merge import AttentionPart, merge_parts
from ..attention.paged import BatchLayout, PublicQueries, causal_part, gather_spans
from ..attention.private_context import HeadLayout, PrivateContextLayer
from ..config import ConfigError
from ..kernels.paged_exact import fused_available, paged_exact
from ..privacy.keyed_noise import NoiseKey, context_id
from .batch_contexts import BatchContexts, announced
from .context import shared_prefix_lengths
from .settings import (
    budget_payload,
    check_prompt_serving,
    check_serving,
    context_plan,
    contexts_out_of_regime,
    dp_config,
    encoder_release_inputs,
    private_contexts,
    raw_config_json,
    register_release,
    serves_private_contexts,
)

logger = logging.getLogger("vllm.dp_privacy")  # inherits vLLM's log handler


class DPBuilderMixin:
    """Adds ``dp_layout`` (positions, CPU offsets, block table) and, with private contexts,
    ``dp_contexts`` (the context each request reads, as the model runner announced it) to the
    backend's metadata."""

    @functools.cached_property
    def _dp_enabled(self) -> bool:
        return dp_config(self.vllm_config).enabled

    @functools.cached_property
    def _dp_contexts(self) -> bool:
        return serves_private_contexts(self.vllm_config)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self._dp_enabled:
            return md  # DP off: the parent's metadata, untouched
        cm = common_attn_metadata
        num_tokens = cm.num_actual_tokens
        positions = cm.positions[:num_tokens].cpu() if cm.positions is not None else None
        seq_lens = cm.seq_lens.cpu()
        md.dp_layout = BatchLayout(cm.query_start_loc_cpu, seq_lens, positions, cm.block_table_tensor)
        md.dp_new_encoder_lens = _new_encoder_rows(cm.encoder_seq_lens_cpu, md.dp_layout)
        md.dp_contexts = announced(md.dp_layout.num_requests) if self._dp_contexts else None
        return md


def _new_encoder_rows(encoder_lens, layout: BatchLayout) -> torch.Tensor | None:
    """Cross-attention: ``[B]`` encoder rows arriving in this step per request, else None.

    ``encoder_lens`` is vLLM's ``encoder_seq_lens_cpu``: every scheduled request's encoder length,
    whether its encoder ran now or not (vLLM's cross-attention builder zeroes decoding requests
    before us; this does not rely on it). vLLM runs an encoder-decoder request's encoder in the
    request's first step only (encoder inputs are scheduled at ``num_computed_tokens == 0``;
    these models have neither chunked prefill nor prefix caching, a preempted request restarts
    from 0): the step whose first query sits at position 0.
    """
    if encoder_lens is None:
        return None
    if layout.positions is None:
        raise ValueError("vllm-dp: cross-attention metadata without positions")
    b = layout.num_requests
    starts, ends = layout.query_start[:b].long(), layout.query_start[1 : b + 1].long()
    scheduled = ends > starts
    first_step = torch.zeros(b, dtype=torch.bool)
    first_step[scheduled] = layout.positions[starts[scheduled]] == 0
    return torch.where(first_step, torch.as_tensor(encoder_lens[:b], dtype=torch.long), 0)


class DPImplMixin:
    """The DP path around a parent impl; ``_paged_kv`` is the parent's cache layout."""

    _fused_exact = False  # the exact public part through the fused CPU kernel (else torch ops)

    def _dp_init(self) -> None:
        vllm_config = get_current_vllm_config()
        cfg = dp_config(vllm_config)
        check_prompt_serving(vllm_config, cfg)  # also without the HTTP plugin (LLM, plain vllm serve)
        self._dp_on = cfg.enabled and self.attn_type in (AttentionType.DECODER, AttentionType.ENCODER_DECODER)
        enc_dec = bool(getattr(vllm_config.model_config, "is_encoder_decoder", False))
        if enc_dec and self.attn_type == AttentionType.DECODER:
            self._dp_on = False  # Whisper's decoder self-attention is public
        if self._dp_on and not enc_dec and contexts_out_of_regime(vllm_config):
            self._dp_on = False  # no context is served: every request is public (settings)
        if not self._dp_on:
            return
        check_serving(vllm_config, cfg)
        self._check_layer_features()
        self._vllm_config = vllm_config
        self._key = NoiseKey(cfg.key_file)
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self._heads = HeadLayout.for_rank(
            vllm_config.model_config.get_total_num_kv_heads(), self.num_heads * tp, tp, rank
        )
        self._cross: dict[int, PrivateContextLayer] = {}  # enc-dec: first block -> release, last step's requests
        self._cross_plans: dict = {}  # enc-dec: encoder length -> ContextPlan
        if self.attn_type == AttentionType.ENCODER_DECODER:
            self._encoder_inputs = encoder_release_inputs(vllm_config)  # keys the noise with the audio
        _validate_once(vllm_config)
        if self.attn_type == AttentionType.DECODER:
            self._contexts = private_contexts(vllm_config)
            self._shared = shared_prefix_lengths(self._contexts)  # [C, C] leading ids in common
            self._layers: dict[int, PrivateContextLayer] = {}  # context index -> release, created on first use
            self._document_slot = self._contexts[0].slot  # unit document: tokens per document (0: unit row)
            self._private_slots = torch.empty(0, dtype=torch.long)  # cache slots of private rows, any context

    def _check_layer_features(self) -> None:
        """Refuse layer features the DP path does not implement (it would silently ignore them:
        the DP part attends to every private row with plain softmax at ``self.scale``)."""
        unsupported = {
            "a sliding window": self.sliding_window not in (None, -1, (-1, -1)),
            "logit soft-capping": bool(self.logits_soft_cap),
            "attention sinks": getattr(self, "sinks", None) is not None,
            "ALiBi": self.alibi_slopes is not None,
            f"a {self.kv_cache_dtype} KV cache": self.kv_cache_dtype not in KV_CACHE_DTYPES,
            "KV sharing across layers": getattr(self, "kv_sharing_target_layer_name", None) is not None,
        }
        found = [name for name, present in unsupported.items() if present]
        if found:
            raise ConfigError(f"dp_privacy.attention: this model's attention layers use {', '.join(found)}, "
                              "which DP attention does not implement")

    def fused_rope_kvcache_supported(self) -> bool:
        # DP on: every K/V write must go through do_kv_cache_update; DP off: the parent's answer
        return not self._dp_on and super().fused_rope_kvcache_supported()

    def fused_qk_norm_rope_kvcache_supported(self) -> bool:
        return not self._dp_on and super().fused_qk_norm_rope_kvcache_supported()

    # ------------------------------------------------------------------ decoder: private prefixes
    def _private_layer(self, layer, c: int) -> PrivateContextLayer:
        """Context ``c``'s collector/release in this layer (planned for its length)."""
        if c not in self._layers:
            index = extract_layer_index(layer.layer_name)
            context = self._contexts[c]
            plan = context_plan(self._vllm_config, "self_attention", context.private_length, self.scale, context.head)
            self._layers[c] = plan.layer(index, self._heads)
        return self._layers[c]

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self._dp_on:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self.attn_type == AttentionType.ENCODER_DECODER:
            return  # encoder K/V go into the DP release only (see forward)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        md = md[layer.layer_name] if isinstance(md, dict) else md
        lay, contexts = md.dp_layout, md.dp_contexts
        n = key.shape[0]
        rows = lay.per_step(("private_rows", n), lambda: _private_rows(lay, contexts, n))
        if rows is None:
            return  # no private row in this step (every decode step): one lookup per layer
        positions, owner, private = rows
        slots = slot_mapping[:n][private.to(slot_mapping.device)].cpu().long()
        self._private_slots = torch.unique(torch.cat([self._private_slots, slots]))
        for c, context in enumerate(self._contexts):
            # row p of owner's context is row p of c; c's release holds its rows [head_c, end_c)
            rows = (positions >= context.head) & (positions < self._shared[owner, c].clamp(max=context.private_end))
            if bool(rows.any()):
                self._collect(layer, c, positions[rows] - context.head, key[rows.to(key.device)],
                              value[rows.to(value.device)])

    def _collect(self, layer, c: int, positions, key, value) -> None:
        """Rows ``positions: [t]`` of context ``c``'s private span (position - head; ``key, value:
        [t, H_kv, d]``); releases the
        layer's part of ``c`` (noise keyed by c's identity) once all its rows are in."""
        dp = self._private_layer(layer, c)
        dp.collect(positions, key, value)
        if dp.complete:
            context = self._contexts[c]
            dp.release(self._key, context.identity.release)
            logger.info("vllm-dp: layer %d released (context %r %s)", dp.layer, context.name, context.identity.label)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if not self._dp_on or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if self.attn_type == AttentionType.ENCODER_DECODER:
            return self._cross_forward(layer, query, key, value, attn_metadata, output)
        key_cache, value_cache = self._paged_kv(kv_cache, layer)
        contexts: BatchContexts = attn_metadata.dp_contexts
        lay = attn_metadata.dp_layout
        n = lay.positions.shape[0]
        public = lay.public_queries(contexts.end)
        if not public.everything:
            # A context's own prefill (once per context with prefix caching): the parent's
            # kernel gives the exact causal attention its private queries need (unit document:
            # block attention replaces it for the documents' rows). Rows of public tokens in
            # this batch are overwritten below before anything reads them.
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if self._document_slot:
                self._document_prefill(query, lay, contexts, key_cache, value_cache, output)
        if public.count:  # DP over [head_c, end_c) merged with exact over [0, head_c) and [end_c, p]
            on = _on(public.tokens, query)
            q = query[:n][on]
            parts = [self._exact(q, public, key_cache, value_cache)]
            head = lay.per_step("public_head", lambda: _public_head(contexts, public))
            if head is not None:  # a few rows: torch ops (the fused kernel wants q_pos < end)
                rows = gather_spans(key_cache, value_cache, public.block_table, torch.zeros_like(head), head)
                parts.append(causal_part(q, public.positions, public.span, rows, self.scale))
            parts = [AttentionPart(p.out.double(), p.lse.double()) for p in parts]
            groups = lay.per_step("context_groups", lambda: ContextGroups.of(contexts.index[public.requests][public.span]))
            dp = self._dp_part(layer, q, groups)
            merged = merge_parts(*parts, *([] if dp is None else [dp]))
            rows = output[:n].view(n, self.num_heads, self.head_size)
            rows[on] = merged.out.transpose(0, 1).to(output.dtype)
        return output

    def _document_prefill(self, query, lay: BatchLayout, contexts: BatchContexts, key_cache, value_cache,
                          output) -> None:
        """Unit document: a query at a document's position ``p`` (slot ``[s, s + slot)``) attends
        exactly to the public head ``[0, head)`` and to its own document's rows ``[s, p]`` only,
        so each document's rows depend on the public head and on itself alone."""
        n = lay.positions.shape[0]
        request = lay.request_of_tokens()
        pos, head = lay.positions, contexts.head[request]
        mine = torch.nonzero((pos >= head) & (pos < contexts.end[request])).flatten()
        if mine.numel() == 0:
            return
        start = head[mine] + (pos[mine] - head[mine]) // self._document_slot * self._document_slot  # [t]
        spans, span = torch.unique(torch.stack([request[mine], start], dim=1), dim=0, return_inverse=True)
        owner = spans[:, 0]
        table = lay.block_table[owner.to(lay.block_table.device)]
        q = query[:n][_on(mine, query)]
        parts = []
        for first, last in ((spans[:, 1], torch.minimum(spans[:, 1] + self._document_slot, lay.seq_lens[owner].long())),
                            (torch.zeros_like(owner), contexts.head[owner])):
            rows = gather_spans(key_cache, value_cache, table, first, last)
            part = causal_part(q, pos[mine], span, rows, self.scale)
            parts.append(AttentionPart(part.out.double(), part.lse.double()))
        rows = output[:n].view(n, self.num_heads, self.head_size)
        rows[_on(mine, rows)] = merge_parts(*parts).out.transpose(0, 1).to(output.dtype)

    def _dp_part(self, layer, q, groups: ContextGroups) -> AttentionPart | None:
        """DP part of the public queries ``q: [m, H_q, d]`` grouped by the context their
        requests read, each answered from its own context's release only: ``out: [H_q, m, d]``,
        ``lse: [H_q, m]`` (float64); a context whose layer the gate closed contributes nothing
        (weight 0); None when every context's layer is closed."""
        dps = [self._private_layer(layer, c) for c in groups.contexts]
        if not any(dp.open for dp in dps):
            return None
        if len(dps) == 1:
            return dps[0].answer(q)
        parts = [_answer(dp, q[_on(pick, q)]) for dp, pick in zip(dps, groups.picks, strict=True)]
        out, lse = torch.cat([p.out for p in parts], dim=1), torch.cat([p.lse for p in parts], dim=1)
        return AttentionPart(out[:, _on(groups.back, out)], lse[:, _on(groups.back, lse)])

    def _exact(self, q, public: PublicQueries, key_cache, value_cache) -> AttentionPart:
        """Exact causal attention of the public queries ``q: [m, H_q, d]`` over rows [P_c, p] of
        their own requests (the fused CPU kernel, else the torch reference)."""
        if self._fused_exact:
            return paged_exact(q, public.positions, public.span, key_cache, value_cache, public.block_table,
                               public.start, public.end, self.scale)
        spans = gather_spans(key_cache, value_cache, public.block_table, public.start, public.end)
        return causal_part(q, public.positions, public.span, spans, self.scale)

    # ------------------------------------------------------------------ encoder-decoder
    def _cross_forward(self, layer, query, key, value, md, output):
        """Cross-attention answered from releases only. ``query, output: [T, H, D]``;
        ``key, value: [N, H_kv, D]``, the encoder outputs arriving in this step, or None.

        Keeps the releases of this step's requests only (memory stays bounded; a block freed by a
        finished request and reused never reads the old release): in encoder-decoder models vLLM
        schedules every running request in every step (no chunked prefill, one budget token per
        decode, max_num_seqs <= max_num_batched_tokens), so a request missing from a step has
        finished, or was preempted and re-runs its encoder (a new release, same keyed noise).
        """
        lay = md.dp_layout
        self._release_encoder_outputs(layer, key, value, md)
        queried = [r for r in range(lay.num_requests) if lay.tokens(r).stop > lay.tokens(r).start]
        blocks = {r: int(lay.block_table[r, 0]) for r in queried}
        if any(b not in self._cross for b in blocks.values()):
            raise RuntimeError(
                "vllm-dp: a decoding request has no cross-attention release (its encoder output did "
                "not arrive in its first step, or it was not scheduled in every step since)"
            )
        self._cross = {b: self._cross[b] for b in blocks.values()}
        for r, block in blocks.items():
            tokens = lay.tokens(r)
            out = self._cross[block].answer(query[tokens]).out.transpose(0, 1)
            output[tokens] = out.to(output.dtype).view(output[tokens].shape)
        return output

    def _cross_plan(self, n: int):
        """The (public) plan of an encoder output of ``n`` rows, built once per length."""
        if n not in self._cross_plans:
            self._cross_plans[n] = context_plan(self._vllm_config, "cross_attention", n, self.scale)
        return self._cross_plans[n]

    def _release_encoder_outputs(self, layer, key, value, md) -> None:
        """One keyed release per request whose encoder ran in this step, under its first block.

        ``key, value: [N, H_kv, D]`` (None if no encoder ran) are those requests' encoder outputs
        concatenated in batch order, ``N = sum(md.dp_new_encoder_lens)``: the order in which
        vLLM's cross-attention slot mapping writes them to the requests' caches (the V1 runner
        concatenates them in scheduling order, which is the order new requests enter the batch;
        the MRV2 runner sorts them by batch index)."""
        lay, new_rows = md.dp_layout, md.dp_new_encoder_lens
        if (0 if key is None else key.shape[0]) != int(new_rows.sum()):
            raise RuntimeError(
                "vllm-dp: the encoder rows of this step do not match the requests at their first "
                "step; they cannot be attributed to requests"
            )
        index = extract_layer_index(layer.layer_name)
        ends = torch.cumsum(new_rows, 0).tolist()
        for r in torch.nonzero(new_rows).flatten().tolist():
            n = int(new_rows[r])
            k, v = key[ends[r] - n : ends[r]], value[ends[r] - n : ends[r]]
            dp = self._cross_plan(n).layer(index, self._heads)
            dp.collect(torch.arange(n), k, v)
            exact = k.detach().cpu().float().numpy().tobytes() + v.detach().cpu().float().numpy().tobytes()
            ident = context_id(self._encoder_inputs + exact)
            dp.release(self._key, ident)
            self._cross[int(lay.block_table[r, 0])] = dp


def _private_rows(lay: BatchLayout, contexts: BatchContexts, n: int) -> tuple[torch.Tensor, ...] | None:
    """The step's first ``n`` rows: ``positions, owner`` (the context each row's request reads)
    and the ``private`` mask of the rows inside their request's private span ``[head, end)``,
    all ``[n]``; None when no row is (every decode step)."""
    positions, request = lay.positions[:n], lay.request_of_tokens()[:n]
    private = (positions >= contexts.head[request]) & (positions < contexts.end[request])
    if not bool(private.any()):
        return None
    return positions, contexts.index[request], private


def _public_head(contexts: BatchContexts, public: PublicQueries) -> torch.Tensor | None:
    """``[R]``: the public head length of the contexts the public queries' requests read, or None
    when they have none (all > 0 or all 0: ``settings._private_contexts``)."""
    head = contexts.head[public.requests]
    return head if bool((head > 0).all()) else None


@dataclass(frozen=True)
class ContextGroups:
    """A step's public queries grouped by the context their requests read: ``contexts`` (sorted
    indices); with several, ``picks[i]: [m_i]`` the queries reading ``contexts[i]`` and ``back:
    [m]`` the permutation from the grouped order to the batch order."""

    contexts: list[int]
    picks: list[torch.Tensor]
    back: torch.Tensor | None

    @classmethod
    def of(cls, owner: torch.Tensor) -> ContextGroups:
        """Grouping of queries whose requests read the contexts ``owner: [m]``."""
        indices = torch.unique(owner).tolist()
        if len(indices) == 1:
            return cls(indices, [], None)
        picks = [torch.nonzero(owner == c).flatten() for c in indices]
        return cls(indices, picks, torch.argsort(torch.cat(picks)))


def _answer(dp: PrivateContextLayer, q: torch.Tensor) -> AttentionPart:
    """``dp``'s answer to ``q: [m, H_q, d]``, or a part of weight zero when its gate is closed."""
    if dp.open:
        return dp.answer(q)
    heads, m, d = q.shape[1], q.shape[0], q.shape[2]
    return AttentionPart(q.new_zeros(heads, m, d, dtype=torch.float64),
                         torch.full((heads, m), -math.inf, dtype=torch.float64, device=q.device))


def _on(index, tensor: torch.Tensor):
    """``index`` (a CPU mask / index tensor, or a slice) usable on ``tensor``'s device."""
    return index if isinstance(index, slice) else index.to(tensor.device)


_VALIDATED: set[str] = set()
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")  # unquantised


def _validate_once(vllm_config) -> None:
    """Plan and account the configured releases at start-up (bad bounds, calibration or budget
    fail here, before any request), once per process; records each decoder-only context's
    release in the release ledger (refusing one under other noise); logs the privacy statement,
    one line per context."""
    ident = raw_config_json(vllm_config)
    if ident in _VALIDATED:
        return
    if serves_private_contexts(vllm_config):
        register_release(vllm_config)
    payload = budget_payload(vllm_config)
    for ctx in payload["contexts"]:
        logger.info("vllm-dp: DP attention on: %s", ctx)
        in_regime = ctx["regime"].startswith(("in regime", "partly"))
        (logger.info if in_regime else logger.warning)(
            "vllm-dp: %s: %s (logit bounds %s, kernel errors %s, public head %s tokens)", ctx.get("name", ctx["kind"]),
            ctx["regime"], [round(t, 1) for t in ctx["logit_bound"]], ctx["kernel_error"],
            ctx.get("public_head_tokens"))
    _VALIDATED.add(ident)


class DPCPUBuilder(DPBuilderMixin, CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        isa = dp_attn_isa(self.isa)
        if self._dp_enabled and isa != self.isa:
            self.isa = isa
            self._set_isa_to_layers(self.layer_names)


def dp_attn_isa(isa: str) -> str:
    """The CPU attention ISA with DP on: vLLM's choice, except ``amx`` (bf16 caches on AMX CPUs),
    which stores K blocks in VNNI tiles (16 rows x pairs of dimensions) that the DP path cannot
    view as rows without copying the cache: the ``vec`` kernels write and read K row- or
    dimension-major instead (the private prefill runs on them; decode reads go through the DP path)."""
    return "vec" if isa == "amx" else isa


class DPCPUImpl(DPImplMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dp_init()
        self._fused_exact = self._dp_on and fused_available()  # builds the kernel once per machine

    def _paged_kv(self, kv_cache: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """``[nb, H, bs, d]`` views of K and V. The CPU cache is ``[nb, H, bs, 2d]`` viewed as
        ``[nb, H, 2 bs, d]``: a K block then a V block per head; V rows are row-major, and the
        ISA kernels may store each K block dimension-major (``[d, bs]``): probed once."""
        num_blocks, heads, block_size, _ = kv_cache.shape
        key, value = kv_cache.view(num_blocks, heads, block_size * 2, -1).chunk(2, dim=2)
        d = key.shape[-1]
        if _key_layout(layer.isa, kv_cache.dtype, block_size, d) == "dim_major":
            key = key.reshape(num_blocks, heads, d, block_size).transpose(2, 3)
        return key, value


@functools.cache
def _key_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """How ``cpu_attn_reshape_and_cache`` lays out a K block for ``isa``: write known rows into a
    scratch cache and see which reading returns them ("rows" or "dim_major")."""
    from vllm import _custom_ops as ops

    cache = torch.zeros(2, 1, block_size * 2, head_dim, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    rows = torch.arange(block_size * head_dim, dtype=torch.float32).view(block_size, 1, head_dim).to(dtype)
    slots = torch.arange(block_size, 2 * block_size)
    ops.cpu_attn_reshape_and_cache(
        rows, rows, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    block = key_cache[1, 0]  # [bs, d] of memory
    if torch.equal(block, rows[:, 0]):
        return "rows"
    if torch.equal(block.reshape(head_dim, block_size).t(), rows[:, 0]):
        return "dim_major"
    raise NotImplementedError(f"unknown CPU K-cache layout for ISA {isa!r}: the DP path cannot read it")


class DPCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with the DP path (pass-through when ``dp_privacy.attention`` is absent)."""

    @staticmethod
    def get_impl_cls():
        return DPCPUImpl

    @staticmethod
    def get_builder_cls():
        return DPCPUBuilder
