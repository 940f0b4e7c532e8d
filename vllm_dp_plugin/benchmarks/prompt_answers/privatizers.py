"""The privatizers of ``vllm-dp bench prompt-answers`` (``PRIVATIZERS``): the reference, no question,
every token mechanism through the service's own path, and paraphrase; their seeds and eps."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_dp_plugin.benchmarks.prompt_answers.questions import Question
from vllm_dp_plugin.benchmarks.prompt_answers.settings import Settings
from vllm_dp_plugin.privacy.trlaplace import paper_effective_dim
from vllm_dp_plugin.prompt.mechanisms import MECHANISMS

REFERENCE = "reference"
NO_QUESTION = "no_question"  # the user text removed: the eps -> 0 end (what the prompt alone gives)
METRIC_DP = ("mahalanobis", "cmp")
NEEDS_DIAMETER = ("gaussian_analytic", "expmech", "cmp")  # the table's exact l2 diameter
MAHALANOBIS_LAMBDA = 0.5  # what the service's token_mechanism uses (its default)


@dataclass(frozen=True)
class Privatized:
    """One privatized question: the ids of its user text (any length) and the receipt
    (``PromptReceipt.to_json()``, None for the reference row) plus ``info`` (calibration facts
    of the row: service epsilon, effective dim, ...)."""

    ids: tuple[int, ...]
    receipt: dict | None = None
    info: dict = field(default_factory=dict)


class Bench:
    """What a row's privatizer may use: the tokenizer, the settings, the plugin's
    ``PromptPrivacy`` service of the model (built on first use), the loaded engine ``llm`` and
    ``generate`` (greedy completions of token prompts)."""

    def __init__(self, settings: Settings, tokenizer, log: Callable[[str], None] = print) -> None:
        self.settings, self.tokenizer, self.log = settings, tokenizer, log
        self.llm = None  # set by run() once the engine is up
        self._service = None
        self.table_info: dict = {}
        self.timing: dict[str, float] = {}

    @property
    def service(self):
        if self._service is None:
            from vllm_dp_plugin.config import PromptPrivacyConfig
            from vllm_dp_plugin.serving.prompt_table import build_prompt_privacy

            start = time.perf_counter()
            cfg = PromptPrivacyConfig(delta=self.settings.delta, cache_history=False)
            self._service, info = build_prompt_privacy(self.settings.model, self.tokenizer, cfg, None)
            self.timing["table_s"] = time.perf_counter() - start
            table = self._service.table
            self.table_info = {"describe": info.describe(), "vocab_size": info.vocab_size, "dim": info.dim,
                               "candidates": info.candidates, "special": info.special,
                               "clip_norm": info.clip_norm, "ln_V": math.log(info.vocab_size),
                               "sensitivity_l1": table.sensitivity_l1, "sensitivity_linf": table.sensitivity_linf,
                               "search_device": str(self._service.device)}
            self.log(f"prompt privacy table: {info.describe()} ({self.timing['table_s']:.0f} s)")
        return self._service

    def diameter(self, name: str) -> float:
        """The table's diameter in the metric of ``name`` (``mahalanobis``: Sigma_0.5; otherwise
        l2), computed once per table (logged; minutes on 2 cores for 49k rows)."""
        from vllm_dp_plugin.prompt.mechanisms import metric_geometry

        table = self.service.table
        key = "mahalanobis_diameter" if name == "mahalanobis" else "sensitivity_l2"
        if key not in self.table_info:
            self.log(f"computing the table's {key} (once per table: {table.vocab_size}^2 x {table.dim}) ...")
            start = time.perf_counter()
            if name == "mahalanobis":
                self.table_info[key] = metric_geometry(table, MAHALANOBIS_LAMBDA)[1]
            else:
                self.table_info[key] = table.sensitivity_l2
            self.timing[f"{key}_s"] = time.perf_counter() - start
            self.log(f"  {key} = {self.table_info[key]:.6g} ({self.timing[f'{key}_s']:.0f} s)")
        return self.table_info[key]

    def outputs(self, prompts: Sequence[Sequence[int]], params) -> list:
        """vLLM's ``RequestOutput`` of every token-id prompt under ``params`` (``SamplingParams``),
        in one ``generate`` call, in order."""
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | None = None) -> list[str]:
        """Greedy completions (text) of token-id prompts, in one ``generate`` call."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens or self.settings.max_tokens)
        return [o.outputs[0].text for o in self.outputs(prompts, params)]


Privatizer = Callable[[Bench, "float | None", Sequence[Question]], list[Privatized]]


def reference(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
    """The un-privatized question."""
    return [Privatized(q.user_ids) for q in questions]


def noise_seed(seed: int, mechanism: str, eps: float, question: str) -> bytes:
    """32 bytes seeding one question's noise (reproducible per (mechanism, eps, question))."""
    return hashlib.sha256(f"vllm-dp/bench-prompt-answers|{seed}|{mechanism}|{eps:g}|{question}".encode()).digest()


def metric_epsilon(eps: float, diameter: float) -> float:
    """Metric epsilon whose converted per-token guarantee ``eps_m * Delta`` is ``eps``."""
    return eps / diameter


def service_epsilon(bench: Bench, mechanism: str, eps: float) -> float:
    """The ``dp_epsilon`` a request sends so that ``mechanism`` guarantees per-token ``eps``."""
    if mechanism in METRIC_DP:
        return metric_epsilon(eps, bench.diameter(mechanism))
    if mechanism in NEEDS_DIAMETER:
        bench.diameter(mechanism)  # computed (and logged) once, before the first row needs it
    return eps


@contextlib.contextmanager
def configured(service, **changes):
    """``service.cfg`` with ``changes`` while the block runs (``trlap_paper``'s ``effective_dim``
    is a deployment setting, not a request option)."""
    saved = service.cfg
    service.cfg = dataclasses.replace(saved, **changes)
    try:
        yield service
    finally:
        service.cfg = saved


def token_privatizer(mechanism: str) -> Privatizer:
    """Per-token privatization by the plugin's service with ``mechanism`` at per-token ``eps``."""

    def privatize(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
        service = bench.service
        request_eps = service_epsilon(bench, mechanism, eps)
        changes, info = {}, {"service_epsilon": request_eps}
        if mechanism == "trlap_paper":
            changes["effective_dim"] = info["effective_dim"] = paper_effective_dim(eps, service.table.dim)
        options = service.options({"dp_mechanism": mechanism, "dp_epsilon": request_eps})
        out = []
        with configured(service, **changes), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reproduction modes warn; their receipts say so
            for q in questions:
                done = service.privatize(list(q.segments), options,
                                         seed=noise_seed(bench.settings.seed, mechanism, eps, q.key))
                ids = tuple(t for t, private in zip(done.ids, done.mask, strict=True) if private)
                out.append(Privatized(ids, done.receipt.to_json(), info))
        return out

    return privatize


class BenchKey:
    """A ``NoiseKey`` stand-in for the rewrites' seeds: reproducible per (bench seed, inputs)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

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
    from vllm_dp_plugin.config import PromptPrivacyConfig
    from vllm_dp_plugin.prompt.paraphrase import ParaphraseMechanism
    from vllm_dp_plugin.prompt.session import PromptPrivacy
    from vllm_dp_plugin.serving.paraphrase import paraphrase as rewrite

    cfg = PromptPrivacyConfig()
    mechanism = ParaphraseMechanism(eps, cfg.paraphrase_width, cfg.paraphrase_max_tokens)
    rewrites = rewrite(bench.llm, [q.text for q in questions], mechanism, key=BenchKey(bench.settings.seed),
                       template=cfg.paraphrase_template)
    receipt = PromptPrivacy.paraphrase_receipt(mechanism, 1).to_json()
    info = {"width": mechanism.width, "max_tokens": mechanism.max_tokens}
    return [Privatized(tuple(bench.tokenizer.encode(r.text, add_special_tokens=False)), receipt,
                       {**info, "rewrite": r.text}) for r in rewrites]


def no_question(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
    """The user text removed (an empty user turn): what any mechanism tends to as eps -> 0, whose
    output no longer depends on the question; the shared-question floor the documents give alone."""
    return [Privatized(()) for _ in questions]


# name -> privatizer of a row; a new mechanism (e.g. one that needs ``bench.llm``) is one entry
PRIVATIZERS: dict[str, Privatizer] = {REFERENCE: reference, NO_QUESTION: no_question,
                                      **{m: token_privatizer(m) for m in MECHANISMS}, "paraphrase": paraphrase}
