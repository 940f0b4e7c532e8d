"""What a fault trial checks, from the HTTP API alone (never a ledger file: its storage may change).

DP aggregation (``serving/aggregate.py``): a query reserves its worst case in the ledger (fsync-ed)
before anything private is computed and settles what it spent before its response is written; its
receipt (``dp_receipt`` / ``x-dp-receipt``; a stream's last chunk) states the settled amount. A
stream's 200 comes only after the reservation, an engine failure inside a query answers 500 after
settling the worst case, a 429 records nothing. So, with ``S0`` / ``S1`` the collection's spent
budget before the load / after the kill and the restart (``GET /v1/dp/budget``, no query running),
``A`` the answered queries (receipt received), ``R`` those reserved but unanswered (a stream's 200
without its last chunk, or a 500), ``N`` those with no response (reserved or not), ``w`` a query's
worst case and ``m`` the least charge of a reserved one, the code promises, in epsilon and delta:

    S0 + sum_A receipt + |R| m  <=  S1  <=  S0 + sum_A receipt + (|R| + |N|) w

and ``|A| + |R| <= queries1 - queries0 <= |A| + |R| + |N|`` (one reservation per query past
``reserve``); ``S1`` is also at least the spent of the last ``/v1/dp/budget`` answered before the
kill and ``total - remaining`` of every receipt, each less what the queries unfinished when it was
read may still give back by settling below their reservation (``refundable``: ``w - receipt`` if
answered, else ``w - m``): spending is not monotone. Sums are exact (``math.fsum``), compared with
the ledger's relative tolerance.

DP attention: the release is one keyed draw, so after a restart the statement and the greedy
answers with their log-probabilities to fixed prompts equal the ones before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.query_ledger import REL_TOLERANCE

ANSWERED, RESERVED, REFUSED, NO_RESPONSE, REJECTED = "answered", "reserved", "refused", "no_response", "rejected"
KINDS = (ANSWERED, RESERVED, REFUSED, NO_RESPONSE, REJECTED)


@dataclass
class Outcome:
    """One request of the load: when it was sent and ended (seconds from the load's start),
    whether it streamed, the HTTP status (None: no response headers), the receipt (None: none
    received) and the client error's type ("" when none)."""

    sent: float
    stream: bool
    ended: float | None = None
    status: int | None = None
    receipt: dict | None = None
    error: str = ""

    @property
    def kind(self) -> str:
        """``ANSWERED``, ``RESERVED`` (200 without a receipt, or 500: past ``reserve``),
        ``REFUSED`` (429), ``NO_RESPONSE`` or ``REJECTED`` (any other status: refused before
        ``reserve``, e.g. 400)."""
        if self.receipt is not None:
            return ANSWERED
        if self.status is None:
            return NO_RESPONSE
        return {200: RESERVED, 500: RESERVED, 429: REFUSED}.get(self.status, REJECTED)

    def in_flight(self, at: float) -> bool:
        """Sent by ``at`` and not ended then."""
        return self.sent <= at and (self.ended is None or self.ended > at)


@dataclass(frozen=True)
class Ledger:
    """A collection's ledger as ``/v1/dp/budget`` states it."""

    spent: Budget
    queries: int
    total: Budget

    @classmethod
    def from_statement(cls, statement: dict, context: str) -> Ledger:
        ledger = next(c for c in statement["contexts"] if c["name"] == context)["ledger"]
        return cls(budget(ledger["spent"]), int(ledger["queries"]), budget(ledger["total"]))


def bounds(before: Ledger, outcomes: Sequence[Outcome], worst: Budget, least: Budget) -> tuple[Ledger, Ledger]:
    """The least and the most ledger a trial's requests allow after the restart (module doc):
    spent ``S0 + sum_A receipt + |R| m`` / ``+ (|R| + |N|) w``, queries ``+ |A| + |R|`` / ``+ |N|``."""
    kinds = [o.kind for o in outcomes]
    receipts = [budget(o.receipt) for o in outcomes if o.kind == ANSWERED]
    reserved, unknown = kinds.count(RESERVED), kinds.count(NO_RESPONSE)
    queries = before.queries + len(receipts) + reserved
    return (Ledger(_fsum(before.spent, *receipts, *[least] * reserved), queries, before.total),
            Ledger(_fsum(before.spent, *receipts, *[worst] * (reserved + unknown)), queries + unknown, before.total))


def refundable(outcomes: Sequence[Outcome], since: float, worst: Budget, least: Budget,
               but: Outcome | None = None) -> Budget:
    """What the queries that had not ended at ``since`` (``but`` aside) may still give back by
    settling below their reservation: ``w - receipt`` if answered, else ``w - m``."""
    late = [o for o in outcomes if o is not but and o.kind not in (REFUSED, REJECTED)  # these reserved nothing
            and (o.ended is None or o.ended >= since)]
    return _fsum(*(_minus(worst, budget(o.receipt) if o.kind == ANSWERED else least) for o in late))


def receipt_floor(outcomes: Sequence[Outcome], total: Budget, worst: Budget, least: Budget) -> Budget:
    """The most any receipt says was spent when it was written (``total - remaining``), less what
    the queries still running since its request was sent may give back (``refundable``)."""
    floors = [_minus(_minus(total, budget(o.receipt["remaining"])), refundable(outcomes, o.sent, worst, least, o))
              for o in outcomes if o.kind == ANSWERED]
    return Budget(max((f.epsilon for f in floors), default=0.0), max((f.delta for f in floors), default=0.0))


def accounting(before: Ledger, after: Ledger, last_seen: tuple[float, Ledger] | None, outcomes: Sequence[Outcome],
               worst: Budget, least: Budget) -> dict[str, bool]:
    """The aggregation checks of one trial (module doc), each by name; ``last_seen``: the last
    statement read before the kill, with when its request was sent."""
    low, high = bounds(before, outcomes, worst, least)
    seen = _minus(last_seen[1].spent, refundable(outcomes, last_seen[0], worst, least)) if last_seen else before.spent
    return {
        "receipts_covered": _at_least(after.spent, low.spent),
        "last_budget_kept": _at_least(after.spent, seen),
        "receipt_remaining_kept": _at_least(after.spent, receipt_floor(outcomes, after.total, worst, least)),
        "no_extra_charge": _at_least(high.spent, after.spent),
        "one_reservation_per_query": low.queries <= after.queries <= high.queries,
        "expected_statuses": all(o.kind != REJECTED for o in outcomes),
    }


def probe_ok(status: int | None, body: dict | None) -> bool:
    """The first query after a restart: answered with its receipt, or a proper 429."""
    if status == 200:
        return isinstance(body, dict) and isinstance(body.get("dp_receipt"), dict)
    if status == 429:
        return isinstance(body, dict) and body.get("error", {}).get("type") == "RateLimitError"
    return False


def same_release(reference: dict, after: dict) -> dict[str, bool]:
    """DP attention after a restart: the same statement and the same fingerprint (``trials.fingerprint``)."""
    return {"same_statement": reference["statement"] == after["statement"],
            "same_answers": reference["answers"] == after["answers"]}


def budget(raw: dict) -> Budget:
    """``{"epsilon": .., "delta": ..}`` (a statement's or a receipt's) as a ``Budget``."""
    return Budget(float(raw["epsilon"]), float(raw["delta"]))


def _fsum(*budgets: Budget) -> Budget:
    return Budget(math.fsum(b.epsilon for b in budgets), math.fsum(b.delta for b in budgets))


def _minus(a: Budget, b: Budget) -> Budget:
    return Budget(a.epsilon - b.epsilon, a.delta - b.delta)


def _at_least(value: Budget, floor: Budget) -> bool:
    return all(v >= f or math.isclose(v, f, rel_tol=REL_TOLERANCE, abs_tol=1e-12)
               for v, f in ((value.epsilon, floor.epsilon), (value.delta, floor.delta)))
