"""DP aggregation of next-token choices over disjoint members (sample-and-aggregate), per query.

A query (one request) is answered by ``k`` members that each see a disjoint part of a document
collection, plus one public sequence that sees none. The unit is one document (add/remove): it
belongs to exactly one member, so it can change that member's next-token distribution
arbitrarily and no other member's. Every statement below is per query, for that unit; it covers
a document's presence (which documents exist, and their number up to one) as well as its text.
Replacing a document (remove + add) can move two members: every score coordinate and the gate's
query by twice their sensitivity, as if each per-step epsilon doubled (a pure statement: 2 eps).

Each private step is one exponential mechanism (McSherry & Talwar 2007) over a public candidate
set (the public sequence's top tokens: data-independent), with a score whose every coordinate a
document moves by at most ``sensitivity``; sampling ``P(t) ~ exp(eps * u(t) / (2 * sensitivity))`` is
eps-DP and eps-bounded-range, hence eps^2/8-zCDP (Cesar & Rogers 2021):

* ``vote`` (DPVoteRAG, Koga et al. 2024): ``u(t)`` = the number of members whose greedy token
  is ``t``; a document moves one member's vote: sensitivity 1 (report-noisy-max with Gumbel
  noise). The logits also get ``log p_pub(t)`` (public): tokens the public model finds
  implausible do not win on noise, and the candidates' noise mass stays below 1 however many
  there are (their public probabilities sum to at most 1), so the candidates can be the whole
  vocabulary (the default): a voted token the public model would never rank high can still win.
* ``expmech`` (InvisibleInk, Vinod et al. 2025; Sarus DP-RAG): ``u(t) = log p_pub(t) +`` the
  members' mean of ``clip(log p_i(t) - log p_pub(t), -C, C)``, i.e. the public log-probabilities
  moved towards the members' by at most C nats (the public part is data-independent); a
  document moves one member's term by at most ``2C``: sensitivity ``2C / k``. Sampling is then
  at temperature ``2 sensitivity / eps``: as eps grows it tends to greedy decoding of the clipped
  mixture (with a large C, of the members' mean log-probabilities).

The gate (public-token fallback) decides whether a step spends: ``svt`` is the sparse vector
technique (AboveThreshold, Dwork & Roth Alg. 1, restarted after each positive answer, as
DPSparseVoteRAG): the query is the largest number of members agreeing on one greedy token other
than the public one (sensitivity 1: one member's vote moves), the threshold ``threshold x k``
members; a negative answer emits the public
token for free; each positive answer is ``eps_gate``-DP (threshold noise Lap(2/eps_gate), query
noise Lap(4/eps_gate)) and is followed by a private step; an instance still open when the query
ends (it answered only no since the last yes) costs eps_gate as well. ``none``: every step is
private.
Before either, a free public gate: where the public sequence's own top token has probability at
least ``confidence``, that token is emitted without looking at the members (a function of public
quantities: the conversation and the tokens released so far). Every query admits at most
``max_private_tokens`` private steps (public); afterwards the public token is emitted, for free.

Accounting (dp-accounting's RDP accountant on zCDP events; the minimum with basic composition
of the pure epsilons, both valid): ``n`` private steps spend
``n x (ZCDp(eps_select^2 / 8) + ZCDp(eps_gate^2 / 2))``, reported at the query's delta. A query
reserves its worst case (every private step taken) in the ledger before it runs and settles
``AggregationParams.settlement``, which is at most the reservation in epsilon and in delta by
construction: where the worst case is the pure statement, the pure basic epsilon of the steps
taken (pure mechanisms chosen adaptively compose by basic composition as a filter: Rogers,
Roth, Ullman & Vadhan 2016); where it is the RDP statement, the worst case itself (the RDP
statement of the steps a query happened to take is an after-the-fact figure: summing those over
queries is an odometer, not a filter).
Noise is drawn in float64 (Gumbel-max for the exponential mechanism); see ``mechanisms`` for
what floating point does to pure-DP statements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from .accountant import Budget
from .partition_selection import ThresholdRelease
from .validation import check_count, check_delta, check_epsilon, check_positive

AGGREGATION_MECHANISMS = ("vote", "expmech")  # token by token (AggregationParams)
ANSWER = "answer"  # once per answer (AnswerParams)
GATES = ("svt", "none")
UNIT = ("one document of the collection (add/remove: its text and its presence, hence the number of documents up "
        "to one; a replacement is two such changes), per query")


def exponential_mechanism(scores: np.ndarray, sensitivity: float, epsilon: float, rng: np.random.Generator,
                          base: np.ndarray | None = None) -> int:
    """Index sampled with probability ``~ exp(epsilon * scores / (2 * sensitivity) + base)``
    (Gumbel-max, float64). ``scores: [K]``; ``base: [K]``, public (data-independent)."""
    logits = exponential_logits(scores, sensitivity, epsilon, base)
    return int(np.argmax(logits + rng.gumbel(size=logits.shape)))


def exponential_logits(scores: np.ndarray, sensitivity: float, epsilon: float,
                       base: np.ndarray | None = None) -> np.ndarray:
    """The exponential mechanism's unnormalised log-probabilities (float64, ``[K]``)."""
    logits = np.asarray(scores, dtype=np.float64) * (epsilon / (2.0 * sensitivity))
    return logits if base is None else logits + np.asarray(base, dtype=np.float64)


def disagreement(member_tops: np.ndarray, public_top: int) -> float:
    """The SVT gate's query: the most members agreeing on one greedy token other than
    ``public_top`` (``member_tops: [k]``); one member's vote moves it by at most 1."""
    tops = np.asarray(member_tops)
    others = tops[tops != public_top]
    return float(np.unique(others, return_counts=True)[1].max()) if others.size else 0.0


def vote_counts(member_tops: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """``[K]`` counts: how many members' greedy token (``member_tops: [k]``) is each candidate
    (``candidates: [K]``); a vote outside the candidates counts for none."""
    return (np.asarray(member_tops)[:, None] == np.asarray(candidates)[None, :]).sum(axis=0).astype(np.float64)


def clipped_mixture(member_logprobs: np.ndarray, public_logprobs: np.ndarray, clip: float) -> np.ndarray:
    """``[K]``: ``log p_pub`` plus the members' mean of ``clip(log p_i - log p_pub, -clip, clip)``
    (``member_logprobs: [k, K]``, ``public_logprobs: [K]``)."""
    public = np.asarray(public_logprobs, dtype=np.float64)
    diff = np.asarray(member_logprobs, dtype=np.float64) - public[None, :]
    return public + np.clip(diff, -clip, clip).mean(axis=0)


@dataclass(frozen=True)
class AggregationParams:
    """One query's mechanism: ``members`` k, per private step ``eps_select`` (exponential
    mechanism) and ``eps_gate`` (SVT positive answer; 0 without a gate), at most
    ``max_private_tokens`` private steps, statement at ``delta``. ``clip``: expmech's C;
    ``confidence``: the free public gate (1: off);
    ``threshold``: the SVT threshold, a fraction of the members; ``candidates``: how many of the
    public sequence's top tokens the mechanism chooses among (None: all it lists);
    ``min_charge``: the least epsilon a query settles, whatever it spent (a public minimum that
    bounds how many queries a total pays for; never above the worst case)."""

    mechanism: str
    members: int
    eps_select: float
    eps_gate: float
    max_private_tokens: int
    delta: float
    clip: float = 1.0
    confidence: float = 1.0
    threshold: float = 0.5
    candidates: int | None = None
    min_charge: float = 0.0

    def __post_init__(self) -> None:
        if self.mechanism not in AGGREGATION_MECHANISMS:
            raise ValueError(f"mechanism must be one of {AGGREGATION_MECHANISMS}, got {self.mechanism!r}")
        check_count(self.members, "members")
        check_count(self.max_private_tokens, "max_private_tokens")
        if self.candidates is not None:
            check_count(self.candidates, "candidates")
        check_epsilon(self.eps_select, "eps_select")
        if self.eps_gate != 0:
            check_epsilon(self.eps_gate, "eps_gate")
        check_delta(self.delta, "delta")
        if self.min_charge != 0:
            check_epsilon(self.min_charge, "min_charge")
        check_positive(self.clip, "clip")
        if not 0.0 < self.confidence <= 1.0:
            raise ValueError(f"confidence must lie in (0, 1], got {self.confidence!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1] (a fraction of the members), got {self.threshold!r}")

    @property
    def gated(self) -> bool:
        return self.eps_gate > 0

    @property
    def sensitivity(self) -> float:
        """How far one document moves any coordinate of the selection score."""
        return 1.0 if self.mechanism == "vote" else 2.0 * self.clip / self.members

    def events(self, private_steps: int, open_gate: bool = False) -> dp_event.DpEvent:
        """What a query released, as one dp-accounting event: ``private_steps`` private steps
        (each a gate instance that answered yes, and a selection) and, when ``open_gate``, one
        more gate instance whose answers so far were all no (its answers depend on the members:
        it costs eps_gate like a finished one)."""
        select, gate = dp_event.ZCDpEvent(self.eps_select ** 2 / 8.0), dp_event.ZCDpEvent(self.eps_gate ** 2 / 2.0)
        step = dp_event.ComposedDpEvent([select, gate] if self.gated else [select])
        events = [dp_event.SelfComposedDpEvent(step, private_steps)]
        if open_gate and self.gated:
            events.append(gate)
        return dp_event.ComposedDpEvent(events)

    def spent(self, private_steps: int, open_gate: bool = False) -> Budget:
        """(eps, delta) of a query that made ``private_steps`` private steps and left a gate
        instance open (``open_gate``, see ``events``): the RDP accountant on zCDP events, or
        basic composition of the pure epsilons where that is smaller."""
        open_gate = open_gate and self.gated
        basic = self._basic(private_steps, open_gate)
        if basic == 0.0:
            return Budget(0.0, 0.0)
        accountant = rdp_privacy_accountant.RdpAccountant()
        accountant.compose(self.events(private_steps, open_gate))
        rdp = float(accountant.get_epsilon(self.delta))
        return Budget(basic, 0.0) if basic <= rdp else Budget(rdp, self.delta)

    def _basic(self, private_steps: int, open_gate: bool) -> float:
        """Basic composition of the pure epsilons of ``private_steps`` steps and an open gate."""
        open_gate = open_gate and self.gated
        return private_steps * (self.eps_select + self.eps_gate) + (self.eps_gate if open_gate else 0.0)

    @property
    def worst_case(self) -> Budget:
        """What a query may spend at most: every allowed private step taken (an open gate
        instance means fewer steps, and the gate is not asked once the cap is reached)."""
        return self.spent(self.max_private_tokens)

    def settlement(self, private_steps: int, open_gate: bool = False) -> Budget:
        """What a query that made ``private_steps`` private steps and left a gate instance open
        (``open_gate``) settles in the ledger, having reserved ``worst_case``: at most the
        reservation in epsilon and in delta, by construction. Where the worst case is the pure
        statement (delta 0), the pure basic epsilon of the steps taken (at least ``min_charge``,
        at most the worst case), delta 0; where it is the RDP statement, the worst case itself
        (see the module's Accounting). Raises
        ``ValueError`` for a state no query reaches (more steps than the cap, or a gate left open
        at the cap: the gate is not asked there)."""
        room = self.max_private_tokens - (1 if open_gate and self.gated else 0)
        if not 0 <= private_steps <= room:
            raise ValueError(f"no query makes {private_steps} private steps with open_gate={open_gate} "
                             f"(at most {self.max_private_tokens}, the gate is not asked at the cap)")
        worst = self.worst_case
        if worst.delta > 0.0:
            return worst
        return Budget(min(worst.epsilon, max(self.min_charge, self._basic(private_steps, open_gate))), 0.0)

    @classmethod
    def calibrated(cls, mechanism: str, members: int, budget: Budget, max_private_tokens: int,
                   gate_share: float, **fields) -> AggregationParams:
        """The largest per-step epsilons, in ratio ``gate_share : 1 - gate_share`` (gate :
        select; 0 = no gate), whose worst case fits ``budget`` (bisection on the accountant)."""
        check_epsilon(budget.epsilon, "epsilon")
        if not 0.0 <= gate_share < 1.0:
            raise ValueError(f"gate_share must lie in [0, 1), got {gate_share!r}")

        def make(total_step: float) -> AggregationParams:
            return cls(mechanism, members, total_step * (1.0 - gate_share), total_step * gate_share,
                       max_private_tokens, budget.delta, **fields)

        low, high = 0.0, budget.epsilon  # one private step can never be given more than the budget
        for _ in range(60):
            mid = 0.5 * (low + high)
            low, high = (mid, high) if make(mid).worst_case.epsilon <= budget.epsilon else (low, mid)
        if low == 0.0:
            raise ValueError(f"epsilon {budget.epsilon:g} cannot pay for one private step")
        return make(low)

    def statement(self) -> str:
        per = f"eps_select={self.eps_select:.4g}" + (f", eps_gate={self.eps_gate:.4g}" if self.gated else "")
        least = f" (charged at least eps={self.min_charge:.4g})" if self.min_charge else ""
        return (f"{self.mechanism} over {self.members} members ({per} per private token, at most "
                f"{self.max_private_tokens} private tokens): at most {self.worst_case} per query{least}; "
                f"unit: {UNIT}")


class SparseVector:
    """AboveThreshold with restarts (Dwork & Roth Alg. 1 per positive answer): each positive
    answer is ``epsilon``-DP for sensitivity-1 queries; negative answers are free."""

    def __init__(self, threshold: float, epsilon: float, rng: np.random.Generator):
        check_epsilon(epsilon, "eps_gate")
        self.threshold, self.epsilon, self.rng = float(threshold), float(epsilon), rng
        self._noisy_threshold = self._draw_threshold()

    def _draw_threshold(self) -> float:
        return self.threshold + self.rng.laplace(0.0, 2.0 / self.epsilon)

    def above(self, query: float) -> bool:
        """Whether the noisy ``query`` exceeds the noisy threshold (a new threshold after a yes)."""
        if float(query) + self.rng.laplace(0.0, 4.0 / self.epsilon) >= self._noisy_threshold:
            self._noisy_threshold = self._draw_threshold()
            return True
        return False


@dataclass(frozen=True)
class AnswerParams:
    """Answer-level aggregation (``mechanism: answer``): each member answers the question and
    votes for one key (``aggregate.answer``), and one DP partition selection over the votes
    (``release``: discrete Laplace noise and a threshold) releases the keys enough members agree
    on. With one member per document, adding or removing a document adds or removes one vote:
    one key's count moves by 1 (l0 = 1). With members of several documents (``answer_members``)
    removing one document can switch its member's vote from key A to key B: two counts move
    (l0 = 2), and the release is calibrated for that (scale 2 / eps, delta for two keys). A
    replacement is two such changes (2 eps, 2 delta). One release per query, whatever it finds:
    it settles its whole (eps, delta)."""

    release: ThresholdRelease
    mechanism: str = ANSWER

    @classmethod
    def calibrated(cls, budget: Budget, l0: int = 1) -> AnswerParams:
        """The release of ``budget`` for votes that one document moves on ``l0`` keys."""
        return cls(ThresholdRelease.calibrated(budget.epsilon, budget.delta, l0))

    @property
    def worst_case(self) -> Budget:
        return self.release.budget

    def statement(self) -> str:
        votes = ("one vote per document" if self.release.l0 == 1 else
                 f"one vote per member of several documents (one document moves {self.release.l0} keys' counts)")
        return f"answer: {votes}, {self.release.statement()}; at most {self.worst_case} per query; unit: {UNIT}"
