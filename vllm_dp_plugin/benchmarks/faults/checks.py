"""What a fault trial checks, from the HTTP API alone (no ledger file: its storage may change).

DP aggregation (``serving/aggregate.py``): a query reserves its worst case in the ledger
(fsync-ed) before anything private is computed, settles what it spent before its response is
written, and the receipt (``dp_receipt`` / ``x-dp-receipt``; a stream's last chunk) states the
settled amount. A stream's HTTP 200 is sent only after the reservation; an engine failure inside
a query answers 500 after settling the worst case; a 429 records nothing. So, for one trial's
requests, with ``S0`` the collection's spent budget before the load (``GET /v1/dp/budget``, no
query running), ``S1`` the spent budget after the kill and the restart (before any new query),
``A`` the answered queries (receipt received), ``R`` those reserved but unanswered (a stream's
200 without its last chunk, or a 500), ``N`` those with no response (killed before the headers:
reserved or not), ``w`` the worst case of a query and ``m`` the least charge of a reserved one,
the code promises, per coordinate (epsilon and delta):

    S0 + sum_A receipt + |R| m  <=  S1  <=  S0 + sum_A receipt + (|R| + |N|) w

and ``|A| + |R| <= queries1 - queries0 <= |A| + |R| + |N|`` (one reservation per query that got
past ``reserve``); also ``S1 >=`` the spent seen by the last ``/v1/dp/budget`` answered before the
kill, and ``S1 >= total - remaining`` of every receipt (it states the budget left after its own
settlement), each less what the queries that had not ended when it was read may still give back
by settling below their reservation (``refundable``: ``w - receipt`` for an answered one, ``w - m``
for any other): spending is not monotone, a settlement returns the unused part of a reservation.
Sums are exact (``math.fsum``), compared with the ledger's relative tolerance.

DP attention: the release is one keyed draw, so after a restart the statement
(``/v1/dp/budget``) and the greedy answers with their log-probabilities to fixed prompts (a
deterministic function of the released noisy state and the public prompts) equal the ones before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.query_ledger import REL_TOLERANCE

ANSWERED, RESERVED, REFUSED, NO_RESPONSE, REJECTED = "answered", "reserved", "refused", "no_response", "rejected"


@dataclass
class Outcome:
    """One request of the load: when it was sent and ended (seconds from the load's start), the
    HTTP status (None: no response headers), the receipt (None: none received) and, for a stream,
    whether any content arrived."""

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
        if self.status in (200, 500):
            return RESERVED
        return REFUSED if self.status == 429 else REJECTED

    def in_flight(self, at: float) -> bool:
        return self.sent <= at and (self.ended is None or self.ended > at)


@dataclass(frozen=True)
class Ledger:
    """A collection's ledger as ``/v1/dp/budget`` states it."""

    spent: Budget
    queries: int
    total: Budget

    @classmethod
    def from_statement(cls, statement: dict, context: str) -> Ledger:
        report = next(c for c in statement["contexts"] if c["name"] == context)
        ledger = report["ledger"]
        return cls(_budget(ledger["spent"]), int(ledger["queries"]), _budget(ledger["total"]))


@dataclass(frozen=True)
class Bounds:
    """The spent budget and reservation count a trial's requests allow after the restart."""

    low: Budget
    high: Budget
    queries_low: int
    queries_high: int


def bounds(before: Ledger, outcomes: Sequence[Outcome], worst: Budget, least: Budget) -> Bounds:
    """``S0 + sum_A receipt + |R| m`` and ``S0 + sum_A receipt + (|R| + |N|) w`` (module doc), and
    the count of reservations between ``|A| + |R|`` and ``|A| + |R| + |N|``."""
    kinds = [o.kind for o in outcomes]
    receipts = [o.receipt for o in outcomes if o.kind == ANSWERED]
    reserved, unknown = kinds.count(RESERVED), kinds.count(NO_RESPONSE)

    def summed(name: str, extra: float, count: int) -> float:
        return math.fsum([getattr(before.spent, name), *(float(r[name]) for r in receipts), *[extra] * count])

    low = Budget(summed("epsilon", least.epsilon, reserved), summed("delta", least.delta, reserved))
    high = Budget(summed("epsilon", worst.epsilon, reserved + unknown),
                  summed("delta", worst.delta, reserved + unknown))
    answered = len(receipts)
    return Bounds(low, high, before.queries + answered + reserved, before.queries + answered + reserved + unknown)


def refundable(outcomes: Sequence[Outcome], since: float, worst: Budget, least: Budget,
               but: Outcome | None = None) -> Budget:
    """What the queries that had not ended at ``since`` (``but`` aside) may still give back by
    settling below their reservation: ``w - receipt`` if answered, else ``w - m``."""
    late = [o for o in outcomes if o is not but and o.kind not in (REFUSED, REJECTED)  # these reserved nothing
            and (o.ended is None or o.ended >= since)]

    def summed(name: str) -> float:
        return math.fsum(getattr(worst, name) - (float(o.receipt[name]) if o.kind == ANSWERED else getattr(least, name))
                         for o in late)

    return Budget(summed("epsilon"), summed("delta"))


def receipt_floor(outcomes: Sequence[Outcome], total: Budget, worst: Budget, least: Budget) -> Budget:
    """The most any receipt says was spent when it was written (``total - remaining``), less what
    the queries still running since its request was sent may give back (``refundable``)."""
    floors = []
    for o in outcomes:
        if o.kind == ANSWERED:
            back = refundable(outcomes, o.sent, worst, least, but=o)
            floors.append(Budget(total.epsilon - o.receipt["remaining"]["epsilon"] - back.epsilon,
                                 total.delta - o.receipt["remaining"]["delta"] - back.delta))
    return Budget(max((f.epsilon for f in floors), default=0.0), max((f.delta for f in floors), default=0.0))


def accounting(before: Ledger, after: Ledger, last_seen: tuple[float, Ledger] | None, outcomes: Sequence[Outcome],
               worst: Budget, least: Budget) -> dict[str, bool]:
    """The aggregation checks of one trial (module doc), each by name; ``last_seen``: the last
    statement read before the kill, with when its request was sent."""
    b = bounds(before, outcomes, worst, least)
    if last_seen is None:
        seen = before.spent
    else:
        back = refundable(outcomes, last_seen[0], worst, least)
        seen = Budget(last_seen[1].spent.epsilon - back.epsilon, last_seen[1].spent.delta - back.delta)
    floor = receipt_floor(outcomes, after.total, worst, least)
    return {
        "receipts_covered": _at_least(after.spent, b.low),
        "last_budget_kept": _at_least(after.spent, seen),
        "receipt_remaining_kept": _at_least(after.spent, floor),
        "no_extra_charge": _at_least(b.high, after.spent),
        "one_reservation_per_query": b.queries_low <= after.queries <= b.queries_high,
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
    """DP attention after a restart: the same statement and the same fingerprint (``load.fingerprint``)."""
    return {"same_statement": reference["statement"] == after["statement"],
            "same_answers": reference["answers"] == after["answers"]}


def _budget(raw: dict) -> Budget:
    return Budget(float(raw["epsilon"]), float(raw["delta"]))


def _at_least(value: Budget, floor: Budget) -> bool:
    return all(v >= f or math.isclose(v, f, rel_tol=REL_TOLERANCE, abs_tol=1e-12)
               for v, f in ((value.epsilon, floor.epsilon), (value.delta, floor.delta)))
