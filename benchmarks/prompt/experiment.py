"""``python -m benchmarks.prompt``'s measurement: every (mechanism, eps) over the sentences (``run``)."""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.lib.measure import usable_device
from benchmarks.prompt.data import (
    Batch,
    SentenceEncoder,
    english_sentences,
    load_vocabulary,
    sample_sentences,
)
from benchmarks.prompt.mechanisms import (
    bootstrap_ci,
    build_mechanism,
    hoeffding_tolerance,
    noise_seed,
)
from benchmarks.prompt.report import write_results
from benchmarks.prompt.settings import Settings
from vllm_dp_plugin.benchmarks.lib.cli import today
from vllm_dp_plugin.benchmarks.lib.environment import environment
from vllm_dp_plugin.benchmarks.lib.progress import Progress, logger
from vllm_dp_plugin.prompt import MECHANISMS, TokenPrivatizer, token_mechanism

EXAMPLE_EPS = (10.0, 100.0, 1000.0)


def run(settings: Settings) -> dict:
    """Run the suite and write the result files; returns the results dict."""
    start = time.perf_counter()
    settings.date = today(settings.date)
    usable_device(settings.device)
    unknown = set(settings.mechanisms) - set(MECHANISMS)
    if unknown:
        raise SystemExit(f"unknown mechanisms {sorted(unknown)}; use {', '.join(MECHANISMS)}")
    progress = Progress(settings.progress)
    log = logger(settings.progress, sys.stderr)
    timing: dict[str, float] = {}

    t0 = time.perf_counter()
    vocab = load_vocabulary(settings)
    table = vocab.table
    encoder = SentenceEncoder(vocab.path, settings.device, settings.batch_size)
    timing["load_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    pool = english_sentences(vocab.tokenizer, settings.min_pieces, settings.max_pieces, settings.min_alpha)
    sentences = sample_sentences(pool, settings.sentences, settings.seed)
    batch = Batch.build(vocab.tokenizer, sentences, settings.device)
    original = batch.split(batch.ids)
    reference = encoder.encode(original)  # [S, 384]
    pieces = batch.pieces
    tokens = int(pieces.sum())
    counts = Counter(batch.ids[batch.mask].tolist())
    freqs = [c / tokens for c in counts.values()]
    rng = np.random.default_rng(settings.seed)
    draws = rng.integers(0, len(sentences), (settings.bootstrap, len(sentences)))
    shift = (np.arange(len(sentences)) + 1 + rng.integers(0, len(sentences) - 1)) % len(sentences)
    unrelated = (reference * reference[torch.from_numpy(shift)]).sum(-1).double().numpy()
    timing["data_s"] = time.perf_counter() - t0

    table_info = {
        "vocab_size": table.vocab_size, "dim": table.dim, "candidates": int(table.candidates.numel()),
        "special": len(vocab.special), "clip_norm": table.clip_norm, "clip_quantile": settings.clip_quantile,
        "sensitivity_l1": table.sensitivity_l1, "sensitivity_linf": table.sensitivity_linf,
        "ln_V": math.log(table.vocab_size),
    }
    if any(m in ("expmech", "cmp") for m in settings.mechanisms):
        log("computing the exact l2 diameter Delta_2 of the 30k-row clipped table (expmech, cmp) ...")
        t0 = time.perf_counter()
        table_info["sensitivity_l2"] = table.sensitivity_l2
        timing["diameter_s"] = time.perf_counter() - t0
        log(f"  Delta_2 = {table.sensitivity_l2:.6g} ({timing['diameter_s']:.0f} s)")
    cache: dict = {}
    if "mahalanobis" in settings.mechanisms:
        log(f"computing the Mahalanobis (lambda={settings.mahalanobis_lambda:g}) diameter ...")
        t0 = time.perf_counter()
        cache["mahalanobis"] = token_mechanism(
            "mahalanobis", table, 1.0, mahalanobis_lambda=settings.mahalanobis_lambda
        )
        timing["mahalanobis_diameter_s"] = time.perf_counter() - t0
        table_info["mahalanobis_diameter"] = cache["mahalanobis"].guarantee.epsilon
        log(f"  Delta_2 (Mahalanobis metric) = {table_info['mahalanobis_diameter']:.6g} "
            f"({timing['mahalanobis_diameter_s']:.0f} s)")
    if "cmp" in settings.mechanisms:
        table_info["cmp_diameter"] = table.sensitivity_l2

    rows: list[dict] = []
    examples: dict[str, dict[str, str]] = {}
    timing.update(build_s=0.0, privatize_s=0.0, encode_s=0.0)
    jobs = [(m, e) for m in settings.mechanisms for e in settings.epsilons]
    bar = progress.bar(len(jobs), "benchmarks.prompt")
    for name, eps in jobs:
        bar.set_postfix_str(f"{name} eps={eps:g}")
        built = build_mechanism(name, table, eps, settings, cache)
        row = dict(built.info)
        timing["build_s"] += row["build_s"]
        if built.mechanism is not None:
            privatizer = TokenPrivatizer(table, built.mechanism)
            generator = torch.Generator(device=settings.device).manual_seed(noise_seed(settings.seed, name, eps))
            t0 = time.perf_counter()
            out, receipt = privatizer.privatize(batch.ids, batch.mask, generator)
            row["privatize_s"] = time.perf_counter() - t0
            timing["privatize_s"] += row["privatize_s"]
            kept = batch.per_sentence((out == batch.ids) & batch.mask)
            private = batch.split(out)
            changed = [i for i in range(len(private)) if private[i] != original[i]]
            t0 = time.perf_counter()
            cos = np.ones(len(private))
            if changed:
                emb = encoder.encode([private[i] for i in changed])
                cos[changed] = (emb * reference[changed]).sum(-1).double().numpy()
            row["encode_s"] = time.perf_counter() - t0
            timing["encode_s"] += row["encode_s"]
            row.update(
                tokens=tokens,
                kept=int(kept.sum()),
                preservation=float(kept.sum() / tokens),
                preservation_ci=bootstrap_ci(kept, pieces, draws),
                cosine=float(cos.mean()),
                cosine_ci=bootstrap_ci(cos, None, draws),
                cosine_median=float(np.median(cos)),
                sentences_unchanged=len(private) - len(changed),
                receipt_tokens=receipt.tokens_privatized,
            )
            if eps in EXAMPLE_EPS:
                examples.setdefault(name, {})[f"{eps:g}"] = vocab.tokenizer.decode(private[0][1:-1])
        rows.append(row)
        bar.update(1)
    bar.close()

    results = {
        "machine": environment(settings.device),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "data": {
            "source": "pydoc_data.topics (Python's bundled help texts)",
            "pool": len(pool),
            "sentences": len(sentences),
            "tokens": tokens,
            "distinct_pieces": len(counts),
            "pieces_per_sentence": [int(pieces.min()), float(pieces.mean()), int(pieces.max())],
            "first_sentence": sentences[0],
            "sentences_sample": sentences,
        },
        "table": table_info,
        "reference": {
            "unrelated_cosine": float(unrelated.mean()),
            "unrelated_cosine_ci": bootstrap_ci(unrelated, None, draws),
            "hoeffding_tolerance": hoeffding_tolerance(tokens),
            "piece_frequencies": sorted(freqs, reverse=True),
        },
        "rows": rows,
        "examples": examples,
        "timing": timing,
    }
    results["runtime_s"] = time.perf_counter() - start
    write_results(results, settings)
    return results
