"""How many shared facts a DP fact sheet can carry at all, whatever reads it: for each fact
stated by 10 or 20 documents of a scenario file, how many documents give it a sheet key among
their first ``m`` (``aggregate.facts.fact_keys``, a key holding every not very common word of an
accepted answer), against the threshold of the sheet's set union at (eps, delta) with ``l0 = m``
(``ThresholdRelease.calibrated``). A fact under the threshold is on the sheet with probability
at most delta, so no reader (model or rule) can answer it from the sheet. Also the same count
with an ideal key (every document that states the answer, anywhere, counts) under ``l0 = m``
where a document gives its first ``m`` facts of ``facts`` (the scenario's sentences).

    PYTHONPATH=. python benchmarks/profiles/fact_sheet_ceiling.py --scenarios FILE [--eps 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def answer_words(answer: str) -> set[str]:
    from vllm_dp_plugin.aggregate.answer import STOP_ZIPF, THOUSANDS, has_digit, words, zipf

    return {w for w in words(THOUSANDS.sub("", answer)) if zipf(w) < STOP_ZIPF or has_digit(w)}


def main() -> None:
    from vllm_dp_plugin.aggregate.answer import SENTENCE, THOUSANDS, words
    from vllm_dp_plugin.aggregate.facts import fact_keys
    from vllm_dp_plugin.privacy.partition_selection import ThresholdRelease

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", type=Path, required=True)
    p.add_argument("--eps", type=float, default=4.0)
    p.add_argument("--delta", type=float, default=1e-6)
    p.add_argument("--max-keys", type=int, default=4, help="report m = 1 .. this")
    args = p.parse_args()
    scenarios = [json.loads(line) for line in args.scenarios.read_text().splitlines() if line.strip()]
    print(f"| keys per document m | threshold (eps {args.eps:g}) | support 10 over it: sheet keys / ideal keys "
          f"| support 20 over it: sheet keys / ideal keys |")
    print("|---|---|---|---|")
    for m in range(1, args.max_keys + 1):
        threshold = ThresholdRelease.calibrated(args.eps, args.delta, m).threshold
        over = {10: [0, 0, 0], 20: [0, 0, 0]}
        for s in scenarios:
            keys = [[set(words(k)) for k in fact_keys(d, m)] for d in s["documents"]]
            first = [[set(words(THOUSANDS.sub("", x))) for x in SENTENCE.split(d)][:m] for d in s["documents"]]
            for q in s["questions"]:
                if q["kind"] != "shared" or q.get("support") not in over:
                    continue
                wanted = [w for w in map(answer_words, q["answers"]) if w]

                def gives(units: list[set[str]], wanted=wanted) -> bool:
                    return any(w <= u for u in units for w in wanted)

                row = over[q["support"]]
                row[0] += sum(map(gives, keys)) >= threshold
                row[1] += sum(map(gives, first)) >= threshold
                row[2] += 1
        print(f"| {m} | {threshold} | {over[10][0]} / {over[10][1]} of {over[10][2]} "
              f"| {over[20][0]} / {over[20][1]} of {over[20][2]} |")


if __name__ == "__main__":
    main()
