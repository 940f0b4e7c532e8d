"""Re-Attention (dpformer spec 4.2-4.4): track the DP-noise variance of every activation and
remove the key-variance bias from attention logits.

Units. DP-SGD adds ``N(0, sigma_dp^2 C^2)`` to the sum of ``B`` clipped per-sample gradients
(``C = 1``), so a parameter relevant to ``B_eff`` samples of a batch carries per-coordinate
variance ``lam * (sigma_dp / B_eff)^2`` (spec 4.2 [C]). Block weights and positions are relevant
to every sample (``B_eff = B``); item/token row ``v`` only to sequences containing ``v``
(``B_eff = max(B p_v, beff_min)``). Every propagated variance is one scalar per token (and per
head where heads differ), computed under ``torch.no_grad`` in float32 (float64 for float64
inputs), with the tensors the modules actually consumed as the means; dropout masks and
normalisation statistics are treated as constants.

The privacy of ``p_v``: the forward pass depends on it, so it must be public or released with
DP; ``dp_sequence_frequencies`` is that release (Gaussian histogram, spec 4.2 [C]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from vllm_dp_plugin.privacy.mechanisms import Mechanism, gaussian_from_noise_multiplier
from vllm_dp_plugin.privacy.validation import check_delta, check_positive

GELU_MODES = ("relu", "delta")
_SQRT_2PI = math.sqrt(2.0 * math.pi)


def _non_negative(value: float, name: str) -> float:
    out = float(value)
    if not (math.isfinite(out) and out >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return out


@dataclass(frozen=True, eq=False)
class ReAttentionConfig:
    """Noise level and knobs of Re-Attention (spec 4.5); immutable, compared by identity.

    ``sigma_dp``: DP-SGD noise multiplier (>= 0; 0 makes every variance 0, i.e. no correction).
    ``batch_size``: the (expected) logical batch size B of DP-SGD, > 0.
    ``token_p``: ``[M]`` probability that a training sequence contains token v, from public data
    or ``dp_sequence_frequencies`` (never raw private counts); values in [0, 1].
    ``lam`` scales every parameter variance; ``beff_min`` clamps ``B p_v`` from below; ``max_corr``
    caps the logit correction (kappa); ``emb_scale`` is the factor alpha applied to the raw lookup
    (sqrt(d) when embeddings are scaled); ``gelu_mode`` picks the GELU rule; ``enabled=False`` is
    the vanilla model (no correction, no variance stream).
    """

    sigma_dp: float
    batch_size: float
    token_p: torch.Tensor
    lam: float = 1.0
    beff_min: float = 1.0
    max_corr: float = math.inf
    emb_scale: float = 1.0
    gelu_mode: str = "relu"
    enabled: bool = True

    def __post_init__(self) -> None:
        _non_negative(self.sigma_dp, "sigma_dp")
        check_positive(self.batch_size, "batch_size")
        _non_negative(self.lam, "lam")
        check_positive(self.beff_min, "beff_min")
        check_positive(self.emb_scale, "emb_scale")
        if not (float(self.max_corr) > 0):  # inf allowed
            raise ValueError(f"max_corr must be > 0 (inf for no cap), got {self.max_corr!r}")
        if self.gelu_mode not in GELU_MODES:
            raise ValueError(f"gelu_mode must be one of {GELU_MODES}, got {self.gelu_mode!r}")
        _check_token_p(self.token_p)

    def with_noise(self, sigma_dp: float, batch_size: float) -> ReAttentionConfig:
        """The same knobs at another noise multiplier / batch size (validated)."""
        return replace(self, sigma_dp=sigma_dp, batch_size=batch_size)

    def block_variance(self) -> float:
        """Per-coordinate variance of a parameter every sample is relevant to:
        ``lam (sigma_dp / B)^2``."""
        return self.lam * (self.sigma_dp / self.batch_size) ** 2

    def token_variance(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids: [...]`` -> ``[...]`` float64: variance of the raw table row of each id,
        ``lam (sigma_dp / max(B p_id, beff_min))^2`` (spec 4.2, Claim 5.4)."""
        p = self.token_p.to(device=ids.device, dtype=torch.float64)[ids]
        b_eff = (self.batch_size * p).clamp_min(self.beff_min)
        return self.lam * (self.sigma_dp / b_eff) ** 2

    def input_variance(
        self, ids: torch.Tensor, valid: torch.Tensor, learned_positions: bool = True
    ) -> torch.Tensor:
        """``ids, valid: [B, T]`` -> ``[B, T]`` float32: variance of ``alpha E[id] (+ P[t])``,
        ``alpha^2 token_variance + block_variance`` (the positional term only with a learned
        positional table); 0 where ``valid`` is False (padding)."""
        positions = self.block_variance() if learned_positions else 0.0
        v = self.emb_scale**2 * self.token_variance(ids) + positions
        return (v * valid).to(torch.float32)


def _check_token_p(token_p: torch.Tensor) -> None:
    if (
        not isinstance(token_p, torch.Tensor)
        or token_p.dim() != 1
        or not token_p.is_floating_point()
    ):
        raise ValueError("token_p must be a 1-D floating tensor [M] of sequence frequencies")
    if not bool(torch.isfinite(token_p).all()) or bool((token_p < 0).any() | (token_p > 1).any()):
        raise ValueError("token_p must hold probabilities in [0, 1]")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """float32, or float64 for float64 input: variances are never computed in half precision."""
    return x if x.dtype == torch.float64 else x.float()


@torch.no_grad()
def head_linear_variance(
    v_in: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    s2: float,
    heads: int,
    bias: bool = True,
) -> torch.Tensor:
    """Linear rule (Eq. 5.5 corrected, Lemma D.1) per output head.

    ``v_in: [..., T]`` input variance per token, ``x: [..., T, d_in]`` the actual input,
    ``weight: [d_out, d_in]`` (torch layout; ``d_out = heads * d_h``), ``s2`` the weight (and bias)
    noise variance. Returns ``[..., heads, T]``: mean over the head's outputs j of
    ``Var y_j = d_in v_in s2 + v_in ||W[j]||^2 + s2 ||x||^2 (+ s2 for the bias)``."""
    d_out, d_in = weight.shape
    if d_out % heads:
        raise ValueError(f"d_out={d_out} is not divisible by heads={heads}")
    w_sq = _wide(weight).view(heads, d_out // heads, d_in).pow(2).sum((1, 2)) / (d_out // heads)
    v_in = _wide(v_in)
    base = d_in * v_in * s2 + s2 * _wide(x).pow(2).sum(-1) + (s2 if bias else 0.0)
    return base.unsqueeze(-2) + v_in.unsqueeze(-2) * w_sq[:, None]


@torch.no_grad()
def linear_variance(
    v_in: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, s2: float, bias: bool = True
) -> torch.Tensor:
    """Linear rule averaged over all outputs: ``v_in: [..., T]``, ``x: [..., T, d_in]``,
    ``weight: [d_out, d_in]`` -> ``[..., T]`` (``head_linear_variance`` with one head)."""
    return head_linear_variance(v_in, x, weight, s2, 1, bias).squeeze(-2)


def _normal_pdf_cdf(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.exp(-0.5 * a * a) / _SQRT_2PI, 0.5 * (1.0 + torch.erf(a / math.sqrt(2.0)))


@torch.no_grad()
def relu_variance(mu: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact ``Var[ReLU(X)]`` for ``X_j ~ N(mu_j, v)`` (Clark / Lemma D.2; Eq. 5.6 corrected:
    ``E[Y^2] - E[Y]^2``, not ``- mu^2``), averaged over coordinates.

    ``mu: [..., D]`` pre-activations, ``v: [...]`` their scalar variance -> ``[...]``."""
    mu = _wide(mu)
    s = _wide(v).clamp_min(1e-30).sqrt().unsqueeze(-1)
    pdf, cdf = _normal_pdf_cdf(mu / s)
    m1 = mu * cdf + s * pdf
    m2 = (mu * mu + s * s) * cdf + mu * s * pdf
    return (m2 - m1 * m1).clamp_min(0.0).mean(-1)


def _gelu_slope(mu: torch.Tensor) -> torch.Tensor:
    """d/dx of the exact GELU ``x Phi(x)``: ``Phi(x) + x phi(x)``."""
    pdf, cdf = _normal_pdf_cdf(mu)
    return cdf + mu * pdf


@torch.no_grad()
def gelu_variance(mu: torch.Tensor, v: torch.Tensor, mode: str = "relu") -> torch.Tensor:
    """``Var[GELU(X)]``, ``mu: [..., D]``, ``v: [...]`` -> ``[...]``.

    ``'relu'``: the ReLU formula (Remark D.3; overestimates by ~36% at small v);
    ``'delta'``: ``GELU'(mu)^2 v`` (first order; accurate for small v, exact-erf GELU)."""
    if mode == "relu":
        return relu_variance(mu, v)
    if mode == "delta":
        return (_gelu_slope(_wide(mu)).pow(2).mean(-1)) * _wide(v)
    raise ValueError(f"gelu mode must be one of {GELU_MODES}, got {mode!r}")


def _normalised_variance(
    v_in: torch.Tensor, weight: torch.Tensor | None, statistic: torch.Tensor, eps: float
) -> torch.Tensor:
    gain = 1.0 if weight is None else _wide(weight).pow(2).mean()
    return _wide(v_in) * gain / (statistic + eps)


@torch.no_grad()
def layernorm_variance(
    v_in: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    s2: float,
) -> torch.Tensor:
    """LayerNorm ``gamma x_hat + beta`` with frozen statistics: ``v_in: [..., T]``,
    ``x: [..., T, d]`` its actual input -> ``[..., T]``:
    ``v_in mean(gamma^2) / (Var_emp(x) + eps) + s2 (gamma noise, x_hat^2 ~ 1) + s2 (beta noise)``.
    Freezing the statistics ignores the removed mean/scale directions (relative error ~2/d)."""
    out = _normalised_variance(v_in, weight, _wide(x).var(-1, unbiased=False), eps)
    return out + s2 * ((weight is not None) + (bias is not None))


@torch.no_grad()
def rmsnorm_variance(
    v_in: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, s2: float
) -> torch.Tensor:
    """RMSNorm ``gamma x / rms(x)`` with frozen statistics: ``v_in: [..., T]``,
    ``x: [..., T, d]`` -> ``[..., T]``: ``v_in mean(gamma^2) / (mean(x^2) + eps) + s2``."""
    out = _normalised_variance(v_in, weight, _wide(x).pow(2).mean(-1), eps)
    return out + (s2 if weight is not None else 0.0)


@torch.no_grad()
def residual_variance(*branches: torch.Tensor) -> torch.Tensor:
    """Variance of a sum of independent branches (same shape ``[..., T]``): the sum."""
    return torch.stack(torch.broadcast_tensors(*branches)).sum(0)


@torch.no_grad()
def attention_output_variance(probs: torch.Tensor, v_value: torch.Tensor) -> torch.Tensor:
    """``o_t = sum_j S_tj V_j`` with the (corrected, possibly dropped-out) probabilities ``S``
    held constant: ``probs: [B, H, T, S]``, ``v_value: [B, H, S]`` -> ``[B, H, T]``,
    ``sum_j S_tj^2 v_j``."""
    return (_wide(probs).pow(2) @ _wide(v_value).unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def swiglu_variance(
    gate: torch.Tensor, v_gate: torch.Tensor, up: torch.Tensor, v_up: torch.Tensor
) -> torch.Tensor:
    """``u = SiLU(gate) * up`` (spec 4.3 table): delta-method ``Var SiLU(g) = SiLU'(g)^2 v_g``,
    then Lemma D.1 for the product of independent factors, averaged over coordinates:
    ``Var = v_s up^2 + v_up SiLU(g)^2 + v_s v_up``.
    ``gate, up: [..., D]`` pre-activation means, ``v_gate, v_up: [...]`` -> ``[...]``."""
    gate, up = _wide(gate), _wide(up)
    v_gate, v_up = _wide(v_gate).unsqueeze(-1), _wide(v_up).unsqueeze(-1)
    sig = torch.sigmoid(gate)
    v_act = (sig * (1.0 + gate * (1.0 - sig))).pow(2) * v_gate
    act = gate * sig
    return (v_act * up * up + v_up * act * act + v_act * v_up).mean(-1)


@torch.no_grad()
def logit_correction(
    q: torch.Tensor, v_key: torch.Tensor, max_corr: float = math.inf
) -> torch.Tensor:
    """Spec 4.4: the logit ``<q_t, K_j>/sqrt(d_h)`` with ``K_j ~ N(k_j, v_j I)`` inflates
    ``E[exp]`` by ``exp(||q_t||^2 v_j / (2 d_h))``; returns ``min(||q_t||^2 v_j / (2 d_h), kappa)``
    to subtract from the logits before the (renormalising) softmax.

    ``q: [B, H, T, d_h]`` queries, ``v_key: [B, H, S]`` key variances -> ``[B, H, T, S]``
    (float32 or float64). Only key variance is corrected (query noise ignored, as in the paper)."""
    q_sq = _wide(q).pow(2).sum(-1)
    return (q_sq.unsqueeze(-1) * _wide(v_key).unsqueeze(-2) / (2 * q.shape[-1])).clamp(max=max_corr)


@dataclass(frozen=True, eq=False)
class TokenFrequencies:
    """``token_p: [M]`` float64 sequence frequencies (``token_p[pad] = 1``), and the Gaussian
    ``mechanism`` that released them (None: exact counts, only valid for public data)."""

    token_p: torch.Tensor
    mechanism: Mechanism | None


def distinct_counts(sequences: torch.Tensor, num_tokens: int, pad_id: int = 0) -> torch.Tensor:
    """``sequences: [N, L]`` int ids (padded with ``pad_id``) -> ``[num_tokens]`` int64: the number
    of sequences containing each id (each sequence counts an id once; pad not counted)."""
    if sequences.dim() != 2:
        raise ValueError(f"sequences must be [N, L] token ids, got shape {tuple(sequences.shape)}")
    if sequences.numel() and (sequences.min() < 0 or sequences.max() >= num_tokens):
        raise ValueError(f"token ids must lie in [0, {num_tokens})")
    rows = torch.arange(sequences.shape[0], device=sequences.device)[:, None]
    pairs = torch.unique((rows * num_tokens + sequences)[sequences != pad_id])
    return torch.bincount(pairs % num_tokens, minlength=num_tokens)


def sequence_frequencies(
    sequences: torch.Tensor, num_tokens: int, pad_id: int = 0
) -> TokenFrequencies:
    """Exact ``p_v = #sequences containing v / N`` for ``sequences: [N, L]``. Not DP: use it on
    public data only (a forward pass using private exact counts makes the model non-DP)."""
    return _frequencies(
        distinct_counts(sequences, num_tokens, pad_id).double(), sequences, pad_id, None
    )


def dp_sequence_frequencies(
    sequences: torch.Tensor,
    num_tokens: int,
    sigma: float,
    generator: torch.Generator,
    delta: float,
    pad_id: int = 0,
) -> TokenFrequencies:
    """Gaussian-histogram release of ``p_v`` (spec 4.2 [C]).

    ``sequences: [N, L]`` are the users' truncated training inputs (one row per user), so a user
    contributes at most ``L`` distinct ids and the count vector has L2 sensitivity ``sqrt(L)`` for
    adding/removing a user (the neighbouring relation of Poisson-sampled DP-SGD). ``sigma`` is the
    noise multiplier: each count gets float64 ``N(0, (sigma sqrt(L))^2)`` noise from ``generator``.
    ``p = clamp((count + noise) / N, 0, 1)`` treats N as public (as ``q = B/N`` does). The returned
    mechanism states the exact (epsilon, delta) at ``delta`` (analytic Gaussian, dp-accounting);
    compose it with the training run's guarantee."""
    check_positive(sigma, "sigma")
    check_delta(delta)
    mechanism = gaussian_from_noise_multiplier(
        math.sqrt(sequences.shape[1]), sigma, delta, name="token frequency histogram"
    )
    counts = distinct_counts(sequences, num_tokens, pad_id).double()
    noisy = counts + mechanism.sample((num_tokens,), generator).to(counts.device)
    return _frequencies(noisy, sequences, pad_id, mechanism)


def _frequencies(
    counts: torch.Tensor, sequences: torch.Tensor, pad_id: int, mechanism: Mechanism | None
) -> TokenFrequencies:
    if sequences.shape[0] == 0:
        raise ValueError("need at least one sequence to estimate token frequencies")
    p = (counts / sequences.shape[0]).clamp(0.0, 1.0)
    p[pad_id] = 1.0
    return TokenFrequencies(p, mechanism)


__all__ = [
    "GELU_MODES",
    "ReAttentionConfig",
    "TokenFrequencies",
    "attention_output_variance",
    "distinct_counts",
    "dp_sequence_frequencies",
    "gelu_variance",
    "head_linear_variance",
    "layernorm_variance",
    "linear_variance",
    "logit_correction",
    "relu_variance",
    "residual_variance",
    "rmsnorm_variance",
    "sequence_frequencies",
    "swiglu_variance",
]
