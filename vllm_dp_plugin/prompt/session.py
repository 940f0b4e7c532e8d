"""Prompt privatization per request: ``PromptPrivacy``, the session object. No vLLM import.

The serving adapter (``serving/renderer.py``) and ``vllm-dp privatize`` share it, and the
modules it is built from (all re-exported here):

* ``options``: a request's ``dp_*`` options (mechanism, per-token epsilon, session) validated
  against the ``dp_privacy.prompt`` section (``resolve_options``, ``PromptOptionError``).
* ``request``: the current request's options, credential and receipts (``PromptRequest``,
  ``current_request``, ``prompt_request`` around ``LLM`` calls).
* ``segments``: a prompt as ``Segment`` s tokenised on their own, user segments
  private; one pure step per prompt (``segment_chat``, ``segment_completion``), ``splice``
  for the exact private mask.
* ``history``: ``HistoryCache``, privatized segments reused within a
  ``dp_session`` namespace (never without one: a shared namespace is a membership oracle).
* ``receipts``: ``PromptReceipt``, what privatizing one prompt spent.

``PromptPrivacy`` puts it together: cached privatizers per (mechanism, epsilon, delta), one
generator per request for the tokens not in the cache, its whole mt19937 state drawn from
256 bits of OS entropy (``keyed_noise.fresh_generator``; ``manual_seed`` would keep 32 bits).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.nearest_reference import fast_topk_torch, select_within_bound
from ..kernels.types import FastPass, SelectPass
from ..lru import LRU
from ..privacy.keyed_noise import fresh_generator, seeded_generator
from .approximate import describe_search, search_index
from .history import HistoryCache
from .mechanisms import token_mechanism
from .nearest import row_code_max
from .options import (
    MAX_SESSION_CHARS,
    MIN_SESSION_CHARS,
    OPTION_CONTEXT,
    OPTION_EPSILON,
    OPTION_MECHANISM,
    OPTION_PREFIX,
    OPTION_SESSION,
    OPTIONS,
    OVERRIDES,
    PromptOptionError,
    PromptOptions,
    check_option_names,
    option_overrides,
    resolve_options,
)
from .paraphrase import PARAPHRASE, ParaphraseMechanism
from .privatizer import TokenPrivatizer, candidate_index, make_receipt
from .receipts import PromptReceipt
from .request import (
    CREDENTIAL_HEADERS,
    PromptRequest,
    bound_request,
    current_request,
    prompt_request,
)
from .segments import (
    TEXT_PART_TYPES,
    MarkedChat,
    Segment,
    added_mask,
    added_special_tokens,
    canonical,
    chat_segments,
    locate_plain,
    make_sentinels,
    mark_user_texts,
    recover_user_texts,
    runs,
    segment_chat,
    segment_completion,
    splice,
    split_rendered,
    token_segments,
    truncate_segments,
    truncated_mask,
)
from .table import EmbeddingTable

__all__ = [
    "CREDENTIAL_HEADERS",
    "MAX_SESSION_CHARS",
    "MIN_SESSION_CHARS",
    "OPTIONS",
    "OPTION_CONTEXT",
    "OPTION_EPSILON",
    "OPTION_MECHANISM",
    "OPTION_PREFIX",
    "OPTION_SESSION",
    "OVERRIDES",
    "PRIVATIZER_CACHE",
    "TEXT_PART_TYPES",
    "HistoryCache",
    "MarkedChat",
    "PrivatizedPrompt",
    "PromptOptionError",
    "PromptOptions",
    "PromptPrivacy",
    "PromptReceipt",
    "PromptRequest",
    "Segment",
    "added_mask",
    "added_special_tokens",
    "bound_request",
    "canonical",
    "chat_segments",
    "check_option_names",
    "current_request",
    "locate_plain",
    "make_sentinels",
    "mark_user_texts",
    "option_overrides",
    "prompt_request",
    "recover_user_texts",
    "resolve_options",
    "runs",
    "segment_chat",
    "segment_completion",
    "splice",
    "split_rendered",
    "token_segments",
    "truncate_segments",
    "truncated_mask",
]

PRIVATIZER_CACHE = 8  # (mechanism, epsilon, delta) privatizers kept per process


@dataclass(frozen=True)
class PrivatizedPrompt:
    """The engine's view of one privatized prompt. ``ids``: pass-through ids with private
    positions replaced (tokens mode) or set to ``placeholder_id`` (embeddings mode);
    ``mask``: the private positions; ``embeds``: ``[n, d]`` noisy rows at private positions,
    zeros elsewhere (embeddings mode only)."""

    ids: list[int]
    mask: list[bool]
    embeds: torch.Tensor | None
    receipt: PromptReceipt


def fast_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype of ``prompt.fast_dtype`` ``name`` for a search on ``device``: ``auto`` is
    int8 on CPU where torch's int8 GEMM is exact (``nearest.row_code_max``; several times the
    fp32 GEMM's speed) and float32 elsewhere; int8 runs on
    CPU only (ValueError)."""
    if name == "auto":
        name = "int8" if device.type == "cpu" and row_code_max() else "float32"
    if name == "int8" and device.type != "cpu":
        raise ValueError(f"prompt.fast_dtype int8 runs on CPU only, the search device is {device}")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[name]


class PromptPrivacy:
    """Privatizes the private segments of prompts over one ``EmbeddingTable``.

    ``cfg``: the ``PromptPrivacyConfig`` (topk, fast_dtype, search, effective_dim, delta, mode).
    ``search`` (``exact`` when the config has none): the exact index, or an approximate faiss
    index over the same candidate rows built here once (``approximate.search_index``; it
    searches on CPU whatever ``device``).
    ``cache``: the history cache, used by requests with a session (None: every request is
    noised afresh).
    ``placeholder_id``: the id put at private positions in embeddings mode.
    ``device``: where the nearest-candidate search runs (the index is copied there; noise is
    drawn on CPU in float64 either way). ``fast_pass``/``select``: that search's passes
    (``TokenPrivatizer``; e.g. Triton on CUDA, the fused CPU ``kernels.nearest_select``), speed only.
    """

    def __init__(
        self,
        table: EmbeddingTable,
        cfg,
        cache: HistoryCache | None = None,
        *,
        placeholder_id: int = 0,
        embed_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        fast_pass: FastPass = fast_topk_torch,
        select: SelectPass = select_within_bound,
    ) -> None:
        self.table = table
        self._search = {"fast_pass": fast_pass, "select": select}
        self.cfg = cfg
        self.cache = cache
        self.placeholder_id = placeholder_id
        self.embed_dtype = embed_dtype or table.embeddings.dtype
        self._privatizers: LRU[tuple, TokenPrivatizer] = LRU(PRIVATIZER_CACHE)
        self.device = torch.device(device)
        exact = candidate_index(table, fast_dtype(cfg.fast_dtype, self.device))
        # one index, shared by every privatizer
        self._index = search_index(exact, getattr(cfg, "search", "exact")).to(self.device)

    @property
    def search(self) -> str:
        """The nearest-candidate search, for the start-up log (``approximate.describe_search``)."""
        return describe_search(self._index)

    def options(self, overrides: Mapping[str, Any] | None = None, credential: bytes = b"") -> PromptOptions:
        return resolve_options(overrides, self.cfg, credential)

    def paraphraser(self, options: PromptOptions) -> ParaphraseMechanism:
        """The ``paraphrase`` mechanism at ``options.epsilon`` per output token, with the config's
        width and cap (``paraphrase_width``, ``paraphrase_max_tokens``)."""
        return ParaphraseMechanism(options.epsilon, self.cfg.paraphrase_width, self.cfg.paraphrase_max_tokens)

    @staticmethod
    def paraphrase_receipt(mechanism: ParaphraseMechanism, texts: int) -> PromptReceipt:
        """The receipt of ``texts`` rewrites of one prompt: the composition over ``texts *
        max_tokens`` released output tokens (``tokens_privatized`` counts those, whatever the
        rewrites' lengths); every rewrite is a new release (its keyed seed makes a repeated text
        give the same rewrite, so a repeat reveals nothing new, but it is counted again)."""
        count = texts * mechanism.max_tokens
        whole = make_receipt(mechanism.guarantee, count, mechanism.advanced_slack)
        return PromptReceipt(mode="tokens", mechanism=PARAPHRASE, valid=True, statement=whole.statement,
                             epsilon_token=mechanism.epsilon, delta_token=0.0, tokens_privatized=count,
                             tokens_new=count, tokens_reused=0, prompt=whole, spent=whole)

    def privatizer(self, options: PromptOptions) -> TokenPrivatizer:
        """The calibrated privatizer of (mechanism, epsilon, delta), built once and cached (LRU)."""
        key = (options.mechanism, options.epsilon, options.delta)
        found = self._privatizers.get(key)
        if found is not None:
            return found
        with warnings.catch_warnings():  # reproduction modes warn; their receipts say so
            warnings.simplefilter("ignore")
            mechanism = token_mechanism(
                options.mechanism,
                self.table,
                options.epsilon,
                options.delta,
                effective_dim=self.cfg.effective_dim if options.mechanism == "trlap_paper" else None,
            )
        built = TokenPrivatizer(self.table, mechanism, topk=self.cfg.topk, index=self._index, **self._search)
        self._privatizers.put(key, built)  # built outside the LRU's lock: a race builds twice, one stays
        return built

    def privatize(
        self,
        segments: Sequence[Segment],
        options: PromptOptions,
        *,
        seed: bytes | None = None,
    ) -> PrivatizedPrompt:
        """Privatize every private segment (within a session, cached ones are reused); pass the
        others through.

        ``seed``: >= 16 bytes seeding the noise of the segments not in the cache, for tests and
        reproducibility only (whoever knows it can re-derive the noise); default: a generator
        whose whole state comes from fresh OS entropy (``fresh_generator``).
        """
        privatizer = self.privatizer(options)
        embeddings = options.mode == "embeddings"
        cache = self.cache if options.session is not None else None
        outputs: list[Any] = [None] * len(segments)
        fresh: list[int] = []
        keys: dict[int, bytes] = {}
        reused = 0
        for i, segment in enumerate(segments):
            if not segment.private or not segment.ids:
                continue
            if cache is not None and segment.cache_key is not None:
                keys[i] = cache.key(options, segment.cache_key, segment.ids)
                cached = cache.get(keys[i])
                if cached is not None:
                    outputs[i] = cached
                    reused += len(segment.ids)
                    continue
            fresh.append(i)
        if fresh:
            generator = fresh_generator() if seed is None else seeded_generator(seed)
            ids = torch.tensor([t for i in fresh for t in segments[i].ids], dtype=torch.int64)
            everything = torch.ones_like(ids, dtype=torch.bool)
            if embeddings:
                noisy, _ = privatizer.privatize_embeddings(ids, everything, generator)
                parts = noisy.to(self.embed_dtype).split([len(segments[i].ids) for i in fresh])
            else:
                out, _ = privatizer.privatize(ids, everything, generator)
                parts = [tuple(p.tolist()) for p in out.split([len(segments[i].ids) for i in fresh])]
            for i, part in zip(fresh, parts, strict=True):
                outputs[i] = part
                if i in keys:
                    cache.put(keys[i], part)
        new = sum(len(segments[i].ids) for i in fresh)
        ids, mask = splice(segments)
        embeds = torch.zeros(len(ids), self.table.dim, dtype=self.embed_dtype) if embeddings else None
        pos = 0
        for segment, output in zip(segments, outputs, strict=True):
            n = len(segment.ids)
            if output is not None:
                if len(output) != n:  # the raw ids around it would shift into the engine's input
                    raise RuntimeError(f"a privatized segment of {len(output)} tokens cannot replace {n} tokens")
                if embeddings:
                    embeds[pos : pos + n] = output
                    ids[pos : pos + n] = [self.placeholder_id] * n
                else:
                    ids[pos : pos + n] = output
            pos += n
        receipt = self.receipt(privatizer, options, new, reused)
        return PrivatizedPrompt(ids, mask, embeds, receipt)

    @staticmethod
    def receipt(privatizer: TokenPrivatizer, options: PromptOptions, new: int, reused: int) -> PromptReceipt:
        whole = privatizer.receipt(new + reused)
        return PromptReceipt(
            mode=options.mode,
            mechanism=whole.mechanism,
            valid=whole.valid,
            statement=whole.statement,
            epsilon_token=whole.epsilon_token,
            delta_token=whole.delta_token,
            tokens_privatized=new + reused,
            tokens_new=new,
            tokens_reused=reused,
            prompt=whole,
            spent=privatizer.receipt(new),
        )
