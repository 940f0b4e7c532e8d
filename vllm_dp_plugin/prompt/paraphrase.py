"""The ``paraphrase`` mechanism: the served model rewrites the user's text under DP.

DP-Prompt (Utpala et al. 2023; DP-MLM, Meisenbacher et al. 2024, is the masked-LM variant): the
model is asked to rewrite the text, and every output token is drawn by the exponential mechanism
whose utility is the model's next-token logit, clipped. Here the clipping is relative to the
step's largest logit, ``u_y = clip(l_y - max_y' l_y', -w, 0)``, so ``u`` lies in ``[-w, 0]`` for
EVERY input: its sensitivity is ``w`` over any two inputs, whatever they are. Sampling
``Pr[y] ~ exp(eps u_y / (2 w))``, i.e. softmax of the clipped logits at temperature
``T = 2 w / eps``, is then eps-DP for the whole input text (any two texts, not only neighbours),
per output token. Later steps condition on earlier outputs (public once released): adaptive
composition over at most ``max_tokens`` output tokens, a public cap, gives
``(max_tokens * eps, 0)``-DP (basic) or advanced composition, whichever is smaller; the length
of the output, stopped by a sampled end-of-sequence token, is part of the DP output, so the
length of the user's text is protected too (unlike the word-level mechanisms).

Why ``eps`` per output token must be large: the ``V`` tokens clipped to ``-w`` keep a total
weight ``V e^{-eps/2}`` against ``1`` for the top token, so below ``eps ~ 2 ln V`` (~22 for a
49k vocabulary) most output tokens are noise whatever ``w``; ``w`` sets how sharply the tokens
within ``w`` of the top are told apart (smaller: closer to greedy copying).

``ParaphraseMechanism`` is the pure math (reference sampler for the tests and the statement);
``serving.paraphrase`` runs it inside vLLM's sampler (a logits processor) so the rewrite is one
extra generation of the same engine. No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..privacy.validation import check_count, check_delta, check_epsilon, check_positive
from .mechanisms import TokenGuarantee
from .privatizer import PrivacyReceipt, make_receipt

PARAPHRASE = "paraphrase"
DEFAULT_WIDTH = 5.0  # w, in logits (nats): tokens more than w below the top share the floor
DEFAULT_MAX_TOKENS = 32  # public cap on the rewrite's length
# DP-Prompt's completion prompt (not the chat template: an instruct model asked to rewrite in a
# chat answers the question instead); the rewrite is its first line.
DEFAULT_TEMPLATE = "Question: {text}\nParaphrase of the question:"
STOP = "\n"


@dataclass(frozen=True)
class ParaphraseMechanism:
    """One output token per step, eps-DP over any two user texts; see the module docstring.

    ``epsilon``: per output token. ``width``: w, the clipping range of the utilities (logits
    below the step's top minus w are raised to it). ``max_tokens``: the public cap L on the
    rewrite's length. ``advanced_slack``: delta' of advanced composition in receipts."""

    epsilon: float
    width: float = DEFAULT_WIDTH
    max_tokens: int = DEFAULT_MAX_TOKENS
    advanced_slack: float = 1e-6

    def __post_init__(self) -> None:
        check_epsilon(self.epsilon)
        check_positive(self.width, "width")
        check_count(self.max_tokens, "max_tokens")
        check_delta(self.advanced_slack, "advanced_slack")

    @property
    def temperature(self) -> float:
        """``T = 2 w / eps``: the sampling temperature of the clipped logits (0 at eps = inf)."""
        return 2.0 * self.width / self.epsilon

    def utility(self, logits: torch.Tensor) -> torch.Tensor:
        """``clip(l - max l, -w, 0)`` per row of ``logits [n, V]`` (same dtype)."""
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        return shifted.clamp(min=-self.width)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The exponential mechanism's exact law ``[n, V]`` float64 for ``logits [n, V]``."""
        scaled = self.utility(logits.to(torch.float64)) * (self.epsilon / (2.0 * self.width))
        return torch.softmax(scaled, dim=-1)

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One token per row of ``logits [n, V]``: ``[n]`` int64, by Gumbel-max in float64
        (fresh noise from ``generator``)."""
        scaled = self.utility(logits.to(torch.float64)) * (self.epsilon / (2.0 * self.width))
        uniform = torch.rand(scaled.shape, generator=generator, dtype=torch.float64, device=generator.device)
        return (scaled - torch.log(-torch.log(uniform)).to(scaled.device)).argmax(dim=-1)

    @cached_property
    def guarantee(self) -> TokenGuarantee:
        """The per-output-token statement (unit: the whole user text)."""
        return TokenGuarantee.pure(
            PARAPHRASE,
            self.epsilon,
            f"{PARAPHRASE}: ({self.epsilon:.6g}, 0)-DP per output token over ANY two user texts "
            f"(exponential mechanism on the served model's logits clipped to {self.width:g} below "
            f"the top, temperature {self.temperature:.4g}); at most {self.max_tokens} output tokens",
        )

    def receipt(self) -> PrivacyReceipt:
        """The whole rewrite: composition over the cap ``max_tokens`` (the guarantee holds
        whatever length the sampled rewrite has)."""
        return make_receipt(self.guarantee, self.max_tokens, self.advanced_slack)




def rewrite_prompt(text: str, template: str = DEFAULT_TEMPLATE) -> str:
    """The text the model continues: the public ``template`` with the user's text (the only
    private input) in place of ``{text}``; the rewrite ends at the first ``STOP``."""
    if template.count("{text}") != 1:
        raise ValueError(f"the paraphrase template must contain {{text}} exactly once, got {template!r}")
    head, tail = template.split("{text}")
    return head + text + tail


def rewrite_seed(key, mechanism: ParaphraseMechanism, template: str, text: str) -> int:
    """The sampler seed of one rewrite: 63 bits of ``key.mac`` (a ``privacy.keyed_noise.NoiseKey``)
    over the release's inputs, so the same text under the same settings gets the same noise and
    nobody without the key can predict it. The rewrite itself can still differ between two
    requests where the engine's float32 logits differ (batch composition, prefix-cache hits: the
    same noise then mostly, not always, picks the same tokens), so every rewrite is charged as a
    new release."""
    mac = key.mac(PARAPHRASE, repr((mechanism.epsilon, mechanism.width, mechanism.max_tokens)), template, text)
    return int.from_bytes(mac[:8], "big") >> 1
