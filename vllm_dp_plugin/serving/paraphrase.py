"""The ``paraphrase`` mechanism inside vLLM: the rewrite is one extra generation of the served
engine, sampled by vLLM's own sampler with the mechanism's scores set by a logits processor.

``ParaphraseLogits`` (entry point ``vllm.logits_processors``: every engine has it; it touches
only requests that carry ``extra_args[PARAMS_KEY] = {"width": w, "epsilon": eps}``) replaces such
a request's logits ``l`` by the exponential mechanism's scores ``clip(l - max l, -w, 0) * eps / (2 w)``
(it is declared not argmax-invariant, so vLLM applies it in step 5 of ``Sampler``, before
penalties and temperature). Sampled at temperature 1 with nothing else touching the logits
(``check_rewrite_params``: no top-k/p, min-p, penalties, biases, bad words, structured outputs,
watermarking; no logprobs, which would return the raw logits), vLLM draws exactly the law of
``prompt.paraphrase.ParaphraseMechanism`` (in float32). The temperature is not used for the
scaling because vLLM accepts only temperatures in [0.01, 2] as sampling temperatures.

``paraphrase(llm, texts, mechanism, key=...)``: the rewrites of ``texts`` with one ``LLM``
(``vllm.LLM``) and their receipts; the noise of each rewrite is keyed (``rewrite_seed``).

Fail closed: an engine that lacks the processor would sample the raw logits at temperature 1
(no DP at all), e.g. when an entry-point list is stale or shadowed (a stale ``*.egg-info`` in the
working directory did exactly that), so rewrites run only on an engine whose every worker
reports ``ParaphraseLogits`` among the processors applied before temperature
(``LOGITS_REPORT``, a worker method the general plugin installs; ``check_processors``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from ..prompt.paraphrase import (
    DEFAULT_TEMPLATE,
    STOP,
    ParaphraseMechanism,
    rewrite_prompt,
    rewrite_seed,
)
from ..prompt.privatizer import PrivacyReceipt

PARAMS_KEY = "dp_paraphrase"
LOGITS_REPORT = "dp_privacy_logits_processors"  # the worker method's name
MAX_SCALE = 1e30  # float32-safe eps / (2 w): the top score stays 0 (never 0 * inf), the rest ~ -inf
NEUTRAL = {  # every SamplingParams field that would change the sampled law, and its neutral value
    "n": 1, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "min_tokens": 0, "logit_bias": None, "allowed_token_ids": None,
    "bad_words": None, "structured_outputs": None, "watermarking": None, "logprobs": None,
    "prompt_logprobs": None, "logprob_token_ids": None, "thinking_token_budget": None,
}


def rewrite_settings(params: SamplingParams) -> tuple[float, float] | None:
    """``(w, eps)`` of a rewrite request, None for every other request."""
    found = (params.extra_args or {}).get(PARAMS_KEY)
    return None if found is None else (found.get("width"), found.get("epsilon"))


def check_rewrite_params(params: SamplingParams) -> None:
    """ValueError naming the field unless a rewrite request samples exactly the exponential
    mechanism: finite ``w > 0`` and ``eps > 0``, temperature 1, top-k off and every ``NEUTRAL``
    field at its neutral value (empty counts as None). Other requests pass."""
    found = (params.extra_args or {}).get(PARAMS_KEY)
    if found is None:
        return
    if not isinstance(found, dict) or set(found) != {"width", "epsilon"}:
        raise ValueError(f"extra_args.{PARAMS_KEY} must be {{'width': w, 'epsilon': eps}}, got {found!r}")
    for name, value in found.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"extra_args.{PARAMS_KEY}.{name} must be a finite number > 0, got {value!r}")
    if params.temperature != 1.0:
        raise ValueError(f"a paraphrase rewrite samples its scores at temperature 1, got {params.temperature}")
    if params.top_k not in (0, -1):
        raise ValueError(f"a paraphrase rewrite cannot use top_k (got {params.top_k}): it changes the DP law")
    for name, neutral in NEUTRAL.items():
        value = getattr(params, name, neutral)
        if value != neutral and not (neutral is None and not value):
            raise ValueError(f"a paraphrase rewrite cannot set {name} (got {value!r}): it changes the DP law "
                             "or returns the raw logits")


class ParaphraseLogits(LogitsProcessor):
    """Scores of rewrite requests: their rows of ``logits [B, V]`` become
    ``max(l - max l, -w) * eps / (2 w)``; other rows are untouched (no work when none)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.settings: dict[int, tuple[float, float]] = {}  # batch index -> (w, eps)
        self.rows = torch.empty(0, dtype=torch.int64)
        self.floors = torch.empty(0, 1)  # [m, 1] -w
        self.scales = torch.empty(0, 1)  # [m, 1] eps / (2 w)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        check_rewrite_params(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it is, but vLLM applies argmax-invariant processors AFTER temperature

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.settings, batch_update, lambda params, _, __: rewrite_settings(params)):
            index = sorted(self.settings)
            widths = [float(self.settings[i][0]) for i in index]
            self.rows = torch.tensor(index, dtype=torch.int64, device=self.device)
            self.floors = torch.tensor([[-w] for w in widths], device=self.device)
            self.scales = torch.tensor([[min(self.settings[i][1] / (2.0 * w), MAX_SCALE)]
                                        for i, w in zip(index, widths, strict=True)], device=self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.settings:
            return logits
        rows = logits[self.rows]  # [m, V]
        shifted = rows - rows.max(dim=-1, keepdim=True).values
        clipped = torch.maximum(shifted, self.floors.to(shifted.dtype))
        logits[self.rows] = clipped * self.scales.to(shifted.dtype)
        return logits


def logits_report(worker) -> list[str]:
    """(Runs in a worker.) ``module.qualname`` of the logits processors its sampler applies before
    temperature."""
    processors = worker.model_runner.input_batch.logitsprocs.non_argmax_invariant
    return [f"{type(p).__module__}.{type(p).__qualname__}" for p in processors]


def check_processors(reports) -> None:
    """ValueError unless every worker's report (``logits_report``) holds ``ParaphraseLogits``."""
    name = f"{ParaphraseLogits.__module__}.{ParaphraseLogits.__qualname__}"
    if not reports or any(name not in report for report in reports):
        raise ValueError(
            "paraphrase: the engine's sampler does not run vllm_dp_plugin's ParaphraseLogits (entry point "
            "vllm.logits_processors; reinstall the package, and look for a stale vllm_dp_plugin.egg-info "
            "in the working directory), so rewrites would not be DP: refused"
        )


def verify_llm(llm) -> None:
    """``check_processors`` on a ``vllm.LLM`` (once per engine); needs the dp_privacy general
    plugin loaded (``VLLM_PLUGINS`` unset or naming it), which installs the worker method."""
    if getattr(llm, "_dp_paraphrase_verified", False):
        return
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "dp_privacy" not in plugins.split(","):
        raise ValueError(f"paraphrase: VLLM_PLUGINS={plugins!r} leaves out the dp_privacy plugin, which installs "
                         "the workers' check of the logits processor: refused")
    try:
        reports = llm.collective_rpc(LOGITS_REPORT)
    except Exception as exc:  # noqa: BLE001 - the worker method is missing: the plugin is not loaded
        raise ValueError(f"paraphrase: cannot check the engine's logits processors ({exc}); load the "
                         "dp_privacy plugin (VLLM_PLUGINS unset or naming dp_privacy)") from None
    check_processors(reports)
    llm._dp_paraphrase_verified = True


def rewrite_params(mechanism: ParaphraseMechanism, seed: int | None, stop: str | None = STOP) -> SamplingParams:
    """The sampling parameters of one rewrite (``seed``: the keyed ``rewrite_seed``), stopped at
    ``stop`` (a function of the released tokens only) or the cap."""
    settings = {"width": float(mechanism.width), "epsilon": float(mechanism.epsilon)}
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=mechanism.max_tokens, seed=seed,
                            stop=None if stop is None else [stop], extra_args={PARAMS_KEY: settings},
                            skip_special_tokens=True)
    check_rewrite_params(params)
    return params


def rewrite_prompt_ids(tokenizer, text: str, template: str = DEFAULT_TEMPLATE) -> list[int]:
    """Token ids of the rewrite prompt (``rewrite_prompt``; the tokenizer's special tokens added)."""
    return tokenizer.encode(rewrite_prompt(text, template))


@dataclass(frozen=True)
class Rewrite:
    """One rewrite: its text (special tokens skipped), its output ids, and the receipt of the
    release (the composition over the cap, whatever the rewrite's length)."""

    text: str
    token_ids: list[int]
    receipt: PrivacyReceipt


def paraphrase(llm, texts: Sequence[str], mechanism: ParaphraseMechanism, *, key=None,
               template: str = DEFAULT_TEMPLATE, use_tqdm: bool = False) -> list[Rewrite]:
    """Rewrite every text of ``texts`` with ``llm`` (a ``vllm.LLM``) in one ``generate`` call.

    ``key``: a ``NoiseKey``; each rewrite's noise is seeded by ``rewrite_seed`` (same text, same
    settings, same rewrite). None: vLLM's own per-request randomness (tests, benchmarks with a
    seeded engine). Refused on an engine with speculative decoding (vLLM then skips custom logits
    processors, so the clipping would not run) and on one whose workers do not run
    ``ParaphraseLogits`` (``verify_llm``)."""
    config = llm.llm_engine.vllm_config
    if config.speculative_config is not None:
        raise ValueError("paraphrase cannot run with speculative decoding: vLLM skips logits processors there")
    verify_llm(llm)
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": rewrite_prompt_ids(tokenizer, t, template)} for t in texts]
    params = [rewrite_params(mechanism, None if key is None else rewrite_seed(key, mechanism, template, t))
              for t in texts]
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    receipt = mechanism.receipt()
    return [Rewrite(o.outputs[0].text.strip(), list(o.outputs[0].token_ids), receipt) for o in outputs]
