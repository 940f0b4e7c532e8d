"""The ledger equation of a DP aggregation load run, from the HTTP API and the receipts alone
(``GET /v1/dp/budget`` before and after, whatever stores the ledger).

What ``serving.aggregate`` promises: a query reserves its worst case before it computes
(``queries`` counts reservations) and settles when it ends, at its ``settlement()`` when it
completes (the amount its receipt states) or at the worst case when it fails or is cancelled; a
reservation never settled counts in full. A refused query (429) reserves nothing. So

    spent_after - spent_before = sum(delivered receipts) + sum over the other reservations of
                                 a charge in [floor, worst case]

where "the other reservations" are those whose receipt the client did not read (a stream closed
early, a plain request given up before its answer, an error) and ``floor`` is the least a
completed query may settle at (``worst case`` where the mechanism always settles it:
``mechanism: answer``; the equation is then exact). Given-up plain requests are counted through
``queries`` (the client never saw whether they were reserved or refused). And the spent budget
never exceeds the total.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

REL_TOL = 1e-9  # float sums of many epsilons (the ledger sums exactly; receipts are summed with fsum)
ABS_TOL = 1e-12


@dataclass(frozen=True)
class LedgerSnapshot:
    """One collection's ledger as ``/v1/dp/budget`` states it."""

    spent_epsilon: float
    spent_delta: float
    total_epsilon: float
    total_delta: float
    queries: int
    worst_epsilon: float
    worst_delta: float
    mechanism: str

    @classmethod
    def from_statement(cls, statement: dict) -> LedgerSnapshot:
        """From ``/v1/dp/budget``'s JSON (``mode: aggregate``): its first collection's."""
        report = statement["contexts"][0]
        ledger, worst = report["ledger"], report["per_query"]["worst_case"]
        return cls(ledger["spent"]["epsilon"], ledger["spent"]["delta"], ledger["total"]["epsilon"],
                   ledger["total"]["delta"], ledger["queries"], worst["epsilon"], worst["delta"],
                   report["mechanism"])


@dataclass(frozen=True)
class Charge:
    """What the client knows of one request: ``reserved`` True (it saw a 200 or a 5xx), False (a
    4xx: refused before reserving), None (given up before a status: unknown); ``receipt``: the
    delivered receipt's (epsilon, delta), None if not delivered."""

    reserved: bool | None
    receipt: tuple[float, float] | None = None


@dataclass(frozen=True)
class LedgerCheck:
    """The equation's terms and verdict (``ok``; ``failures`` says which condition broke)."""

    reservations: int
    receipts: int
    undelivered: int
    unknown_reserved: int
    spent: tuple[float, float]
    receipts_sum: tuple[float, float]
    undelivered_low: tuple[float, float]
    undelivered_high: tuple[float, float]
    total: tuple[float, float]
    exact: bool
    failures: list[str]
    ok: bool


def _le(a: float, b: float) -> bool:
    return a <= b or math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def check(before: LedgerSnapshot, after: LedgerSnapshot, charges: Sequence[Charge]) -> LedgerCheck:
    """The ledger equation (module docstring) for the requests ``charges`` sent between the two
    snapshots (and nothing else spending on the collection)."""
    worst = (after.worst_epsilon, after.worst_delta)
    floor = worst if after.mechanism == "answer" else (0.0, 0.0)  # answer: one release, always at its worst case
    receipts = [c.receipt for c in charges if c.receipt is not None]
    known = sum(1 for c in charges if c.reserved and c.receipt is None)
    unknown = sum(1 for c in charges if c.reserved is None)
    reservations = after.queries - before.queries
    unknown_reserved = reservations - len(receipts) - known
    undelivered = known + unknown_reserved
    spent = (after.spent_epsilon - before.spent_epsilon, after.spent_delta - before.spent_delta)
    sums = tuple(math.fsum(r[i] for r in receipts) for i in (0, 1))
    low = tuple(sums[i] + undelivered * floor[i] for i in (0, 1))
    high = tuple(sums[i] + undelivered * worst[i] for i in (0, 1))
    failures = []
    if not 0 <= unknown_reserved <= unknown:
        failures.append(f"{reservations} reservations for {len(receipts)} receipts, {known} known undelivered and "
                        f"{unknown} given up before a status: {unknown_reserved} of those would be reserved")
    for i, name in enumerate(("epsilon", "delta")):
        if not (_le(low[i], spent[i]) and _le(spent[i], high[i])):
            failures.append(f"spent {name} {spent[i]!r} outside [{low[i]!r}, {high[i]!r}] (receipts {sums[i]!r} + "
                            f"{undelivered} undelivered at [{floor[i]!r}, {worst[i]!r}] each)")
        if any(not _le(r[i], worst[i]) for r in receipts):
            failures.append(f"a receipt states more {name} than the worst case {worst[i]!r}")
    total, spent_total = (after.total_epsilon, after.total_delta), (after.spent_epsilon, after.spent_delta)
    failures += [f"spent {name} {spent_total[i]!r} exceeds the total {total[i]!r}"
                 for i, name in enumerate(("epsilon", "delta")) if not _le(spent_total[i], total[i])]
    return LedgerCheck(reservations, len(receipts), undelivered, unknown_reserved, spent, sums, low, high, total,
                       floor == worst, failures, not failures)


def charges_of(outcomes) -> list[Charge]:
    """Each ``client.Outcome`` as a ``Charge``: reserved iff its status is 200 or 5xx."""
    return [Charge(None if o.status is None else (o.status == 200 or o.status >= 500),
                   None if o.receipt is None else (float(o.receipt["epsilon"]), float(o.receipt["delta"])))
            for o in outcomes]
