"""Prompt privatization: replace every private token by a DP sample from the candidate set.

``TokenPrivatizer(table, mechanism).privatize(ids, private_mask, generator)``:

* positions where ``private_mask`` is False (template, system prompt, special tokens of the
  scaffolding) pass through unchanged and spend no budget;
* every masked position is privatized whatever its id (a special id typed by the user too): its
  clipped embedding is noised with fresh noise and projected onto the nearest candidate, or, for
  the exponential mechanism, a candidate is sampled directly. Outputs are always candidates.

The returned ``PrivacyReceipt`` states the per-token guarantee and its composition over the
privatized tokens of this prompt (basic and advanced; ``total`` is the smaller epsilon) computed
by the privacy core's ``PrivacyLedger``. Not protected: prompt length, positions of the
pass-through tokens, and the segment structure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.nearest_reference import fast_topk_torch, select_within_bound
from ..kernels.types import FastPass, SelectPass
from ..privacy.accountant import Budget, PrivacyLedger
from ..privacy.validation import check_count, check_delta
from .approximate import ApproximateIndex, search_index
from .mechanisms import AdditiveTokenMechanism, ExponentialMechanism, TokenGuarantee, TokenMechanism
from .nearest import CandidateIndex
from .table import EmbeddingTable

NO_GUARANTEE = Budget(math.inf, 1.0)


@dataclass(frozen=True)
class PrivacyReceipt:
    """What one privatization spent.

    ``epsilon_token`` / ``delta_token``: the per-token guarantee (true delta for reproduction
    modes); ``valid``: whether it is a proven guarantee. ``basic`` / ``advanced``: the composition
    over the ``tokens_privatized`` tokens (prompts differing in that many positions); ``total``:
    the one with the smaller epsilon. ``NO_GUARANTEE`` (eps = inf, delta = 1) when invalid.
    """

    mechanism: str
    statement: str
    epsilon_token: float
    delta_token: float
    valid: bool
    tokens_privatized: int
    basic: Budget
    advanced: Budget
    total: Budget


def compose_tokens(
    guarantee: TokenGuarantee, count: int, advanced_slack: float
) -> tuple[Budget, Budget]:
    """(basic, advanced) composition of ``count`` releases of ``guarantee`` via ``PrivacyLedger``.

    Advanced composition is evaluated at total delta ``count * delta + advanced_slack`` (the
    theorem's delta'). A composed delta >= 1 says nothing: it is reported as ``NO_GUARANTEE``.
    """
    if count == 0:
        return Budget(0.0, 0.0), Budget(0.0, 0.0)
    basic_ledger = PrivacyLedger("basic")
    basic_ledger.record(guarantee, count)
    basic = basic_ledger.spent()
    basic = NO_GUARANTEE if basic.delta >= 1.0 else basic
    target = count * guarantee.delta + advanced_slack
    if target >= 1.0 or not guarantee.valid:
        return basic, NO_GUARANTEE
    advanced = PrivacyLedger("advanced", target_delta=target)
    advanced.record(guarantee, count)
    try:
        return basic, advanced.spent()
    except OverflowError:  # k eps (e^eps - 1) overflows: the advanced bound is infinite
        return basic, Budget(math.inf, target)


def make_receipt(guarantee: TokenGuarantee, count: int, advanced_slack: float) -> PrivacyReceipt:
    """Receipt for ``count`` privatized tokens released under ``guarantee``."""
    basic, advanced = compose_tokens(guarantee, count, advanced_slack)
    return PrivacyReceipt(
        mechanism=guarantee.name,
        statement=guarantee.statement(),
        epsilon_token=guarantee.epsilon,
        delta_token=guarantee.delta,
        valid=guarantee.valid,
        tokens_privatized=count,
        basic=basic,
        advanced=advanced,
        total=advanced if advanced.epsilon < basic.epsilon else basic,
    )


def candidate_index(table: EmbeddingTable, fast_dtype: torch.dtype = torch.float32) -> CandidateIndex:
    """The nearest-candidate index over ``table``'s clipped candidate rows (public data only)."""
    return CandidateIndex.build(table.candidates, table.clipped[table.candidates], fast_dtype)


class TokenPrivatizer:
    """Privatizes the masked tokens of a prompt with ``mechanism`` over ``table``'s candidates.

    ``topk``/``chunk``/``fast_dtype``/``fast_pass``/``select`` configure the nearest-candidate search
    (``nearest.CandidateIndex``); they affect utility and speed, never privacy. ``search``:
    ``exact``, or ``hnsw`` / ``ivf`` for an approximate faiss index over the same candidate rows
    with an exact re-rank of its best ``min(topk, 8)`` (``approximate.ApproximateIndex``; additive
    mechanisms only: ``expmech`` samples over exact distances). ``index``: an index of
    ``table``'s candidates to share between privatizers (built here from ``search`` when None).
    ``advanced_slack``: the delta' of advanced composition in receipts.
    """

    def __init__(
        self,
        table: EmbeddingTable,
        mechanism: TokenMechanism,
        *,
        topk: int = 32,
        chunk: int = 512,
        fast_dtype: torch.dtype = torch.float32,
        fast_pass: FastPass = fast_topk_torch,
        select: SelectPass = select_within_bound,
        advanced_slack: float = 1e-6,
        index: CandidateIndex | ApproximateIndex | None = None,
        search: str = "exact",
    ) -> None:
        if mechanism.table is not table:
            raise ValueError("the mechanism was calibrated for a different EmbeddingTable")
        self.table = table
        self.mechanism = mechanism
        self.topk = check_count(topk, "topk")
        self.chunk = check_count(chunk, "chunk")
        self.advanced_slack = check_delta(advanced_slack, "advanced_slack")
        self.fast_pass = fast_pass
        self.select = select
        if index is None:
            index = search_index(candidate_index(table, fast_dtype), search)
        self.index = index

    def privatize(
        self, ids: torch.Tensor, private_mask: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, PrivacyReceipt]:
        """``ids [n]`` int64 -> (privatized ids ``[n]`` int64, receipt).

        Unmasked positions are copied; every masked position becomes a candidate id drawn by the
        mechanism with noise from ``generator`` (same generator state -> same output).
        """
        positions = self._private_positions(ids, private_mask)
        out = ids.clone()
        if positions.numel():
            out[positions] = self._release_ids(self.table.clipped[ids[positions]], generator)
        return out, self.receipt(positions.numel())

    def privatize_embeddings(
        self, ids: torch.Tensor, private_mask: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, PrivacyReceipt]:
        """Embedding mode (vLLM ``prompt_embeds``): ``ids [n]`` -> (embeddings ``[n, d]``, receipt)
        in the model's embedding space and dtype.

        Unmasked rows are the model's own embedding rows. Masked rows are the noisy vector
        ``clip(e_w - mean) + z + mean`` for additive mechanisms, or the embedding of the sampled
        candidate for ``expmech``. Releasing floats instead of ids exposes low-order bits of the
        noise (Mironov 2012); the guarantee is the same, side channels are the caller's concern.
        """
        positions = self._private_positions(ids, private_mask)
        out = self.table.embeddings[ids].clone()  # [n, d]
        if positions.numel():
            rows = self.table.clipped[ids[positions]]
            if isinstance(self.mechanism, AdditiveTokenMechanism):
                noisy = self.mechanism.perturb(rows, generator) + self.table.mean
            else:
                noisy = self.table.embeddings[self._release_ids(rows, generator)]
            out[positions] = noisy.to(out.dtype)
        return out, self.receipt(positions.numel())

    def receipt(self, count: int) -> PrivacyReceipt:
        """Receipt for ``count`` privatized tokens under this privatizer's mechanism."""
        return make_receipt(self.mechanism.guarantee, count, self.advanced_slack)

    def _release_ids(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Candidate ids ``[m]`` for clipped rows ``[m, d]``: one fresh mechanism draw per row."""
        if isinstance(self.mechanism, ExponentialMechanism):
            return self.table.candidates[self.mechanism.select(rows, generator)]
        noisy = self.mechanism.perturb(rows, generator)  # [m, d] float64
        return self.index.nearest(noisy, self.topk, self.chunk, self.fast_pass, self.select)

    def _private_positions(self, ids: torch.Tensor, private_mask: torch.Tensor) -> torch.Tensor:
        """Validate the inputs; return the masked positions ``[m]`` int64."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError("ids must be a 1-D int64 tensor of token ids")
        if not isinstance(private_mask, torch.Tensor) or private_mask.dtype != torch.bool:
            raise ValueError("private_mask must be a bool tensor")
        if private_mask.shape != ids.shape:
            raise ValueError(
                f"private_mask shape {tuple(private_mask.shape)} != ids shape {tuple(ids.shape)}"
            )
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.table.vocab_size):
            raise ValueError(
                f"prompt token ids must lie in [0, {self.table.vocab_size}) (the input domain)"
            )
        return private_mask.nonzero().squeeze(1)
