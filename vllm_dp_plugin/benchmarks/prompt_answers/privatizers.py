"""The privatizers of ``vllm-dp bench prompt-answers`` (``PRIVATIZERS``): the reference, no question,
every token mechanism through the service's own path, and paraphrase; their seeds and eps."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_dp_plugin.privacy.trlaplace import paper_effective_dim
from vllm_dp_plugin.prompt.mechanisms import MECHANISMS

from .questions import Question
from .settings import Settings

REFERENCE = "reference"
NO_QUESTION = "no_question"  # the user text removed: the eps -> 0 end (what the prompt alone gives)
BASELINES = (REFERENCE, NO_QUESTION)  # rows without eps, run once each
METRIC_DP = ("mahalanobis", "cmp")
NEEDS_DIAMETER = ("gaussian_analytic", "expmech", "cmp")  # the table's exact l2 diameter
MAHALANOBIS_LAMBDA = 0.5  # what the service's token_mechanism uses (its default)


@dataclass(frozen=True)
class Privatized:
    """One privatized question: its user text's ids (any length), the receipt (``PromptReceipt.to_json()``,
    None for the baselines) and ``info``: the row's calibration (service epsilon, effective dim, ...)."""

    ids: tuple[int, ...]
    receipt: dict | None = None
    info: dict = field(default_factory=dict)


class Bench:
    """What a row's privatizer may use: the settings, the tokenizer, the plugin's ``PromptPrivacy``
    service of the model (its table built first), the table's diameters and the loaded engine ``llm``."""

    def __init__(self, settings: Settings, tokenizer, log: Callable[[str], None] = print) -> None:
        from vllm_dp_plugin.config import PromptPrivacyConfig
        from vllm_dp_plugin.serving.prompt_table import build_prompt_privacy

        self.settings, self.tokenizer, self.log = settings, tokenizer, log
        self.llm = None  # set by run() once the engine is up
        start = time.perf_counter()
        cfg = PromptPrivacyConfig(delta=settings.delta, cache_history=False)
        self.service, info = build_prompt_privacy(settings.model, tokenizer, cfg, None)
        self.timing: dict[str, float] = {"table_s": time.perf_counter() - start}
        table = self.service.table
        self.table_info: dict = {
            "describe": info.describe(), "vocab_size": info.vocab_size, "dim": info.dim,
            "candidates": info.candidates, "special": info.special, "clip_norm": info.clip_norm,
            "ln_V": math.log(info.vocab_size), "sensitivity_l1": table.sensitivity_l1,
            "sensitivity_linf": table.sensitivity_linf, "search_device": str(self.service.device)}
        log(f"prompt privacy table: {info.describe()} ({self.timing['table_s']:.0f} s)")

    def diameter(self, name: str) -> float:
        """The table's diameter in the metric of ``name`` (``mahalanobis``: Sigma_0.5; otherwise
        l2), computed once per table (logged; minutes on 2 cores for 49k rows)."""
        from vllm_dp_plugin.prompt.mechanisms import metric_geometry

        table = self.service.table
        key = "mahalanobis_diameter" if name == "mahalanobis" else "sensitivity_l2"
        if key not in self.table_info:
            self.log(f"computing the table's {key} (once per table: {table.vocab_size}^2 x {table.dim}) ...")
            start = time.perf_counter()
            self.table_info[key] = (metric_geometry(table, MAHALANOBIS_LAMBDA)[1] if name == "mahalanobis"
                                    else table.sensitivity_l2)
            self.timing[f"{key}_s"] = time.perf_counter() - start
            self.log(f"  {key} = {self.table_info[key]:.6g} ({self.timing[f'{key}_s']:.0f} s)")
        return self.table_info[key]

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """Greedy completions (text) of token-id prompts, in one ``generate`` call."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=self.settings.max_tokens)
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        return [o.outputs[0].text for o in self.llm.generate(inputs, params, use_tqdm=False)]


# A row's privatizer: (bench, per-token eps or None, questions) -> one Privatized per question.
Privatizer = Callable[[Bench, "float | None", Sequence[Question]], list[Privatized]]


def reference(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
    """The un-privatized question."""
    return [Privatized(q.user_ids) for q in questions]


def no_question(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
    """The user text removed (an empty user turn): the eps -> 0 end, what the documents give alone."""
    return [Privatized(()) for _ in questions]


def service_epsilon(bench: Bench, mechanism: str, eps: float) -> float:
    """The ``dp_epsilon`` a request sends so that ``mechanism`` guarantees per-token ``eps``: the
    metric epsilon ``eps / Delta`` for metric DP (its converted guarantee ``eps_m * Delta`` is eps)."""
    if mechanism in METRIC_DP:
        return eps / bench.diameter(mechanism)
    if mechanism in NEEDS_DIAMETER:
        bench.diameter(mechanism)  # computed (and logged) once, before the first row needs it
    return eps


def token_privatizer(mechanism: str) -> Privatizer:
    """Per-token privatization by the plugin's service with ``mechanism`` at per-token ``eps``:
    one ``privatize`` call per question, its noise seeded per (mechanism, eps, question)."""

    def privatize(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
        service, request_eps = bench.service, service_epsilon(bench, mechanism, eps)
        info, saved, out = {"service_epsilon": request_eps}, service.cfg, []
        options = service.options({"dp_mechanism": mechanism, "dp_epsilon": request_eps})
        if mechanism == "trlap_paper":  # its effective_dim is a deployment setting, not a request option
            info["effective_dim"] = paper_effective_dim(eps, service.table.dim)
            service.cfg = dataclasses.replace(saved, effective_dim=info["effective_dim"])
        try:
            for q in questions:  # 32 bytes of seed, reproducible per (mechanism, eps, question)
                seed = f"vllm-dp/bench-prompt-answers|{bench.settings.seed}|{mechanism}|{eps:g}|{q.key}"
                done = service.privatize(list(q.segments), options, seed=hashlib.sha256(seed.encode()).digest())
                ids = tuple(t for t, private in zip(done.ids, done.mask, strict=True) if private)
                out.append(Privatized(ids, done.receipt.to_json(), info))
        finally:
            service.cfg = saved
        return out

    return privatize


@dataclass(frozen=True)
class BenchKey:
    """A ``NoiseKey`` stand-in for the rewrites' seeds: reproducible per (bench seed, inputs)."""

    seed: int

    def mac(self, *parts: str | bytes) -> bytes:
        digest = hashlib.sha256(f"vllm-dp/bench-prompt-answers-paraphrase|{self.seed}".encode())
        for part in parts:
            data = part.encode() if isinstance(part, str) else bytes(part)
            digest.update(len(data).to_bytes(8, "big") + data)
        return digest.digest()


def paraphrase(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
    """The served model rewrites each question (``serving.paraphrase``: one extra generation of
    the same engine, eps per OUTPUT token, the server's default width, cap and template); the
    rewrite's tokens replace the question. The receipt composes over the cap."""
    from vllm_dp_plugin.serving.paraphrase import paraphrase as rewrite

    service = bench.service
    mechanism = service.paraphraser(service.options({"dp_mechanism": "paraphrase", "dp_epsilon": eps}))
    rewrites = rewrite(bench.llm, [q.text for q in questions], mechanism, key=BenchKey(bench.settings.seed),
                       template=service.cfg.paraphrase_template)
    receipt = service.paraphrase_receipt(mechanism, 1).to_json()
    info = {"width": mechanism.width, "max_tokens": mechanism.max_tokens}
    return [Privatized(tuple(bench.tokenizer.encode(r.text, add_special_tokens=False)), receipt,
                       {**info, "rewrite": r.text}) for r in rewrites]


# name -> privatizer of a row; a new mechanism (e.g. one that rewrites with ``bench.llm``) is one entry
PRIVATIZERS: dict[str, Privatizer] = {REFERENCE: reference, NO_QUESTION: no_question,
                                      **{m: token_privatizer(m) for m in MECHANISMS}, "paraphrase": paraphrase}
