"""Re-Attention (DPFormer): track the DP-noise variance of every activation and
remove the key-variance bias from attention logits.

Units. DP-SGD adds ``N(0, sigma_dp^2 C^2)`` to the sum of ``B`` clipped per-sample gradients
(``C = 1``), so a parameter relevant to ``B_eff`` samples of a batch carries per-coordinate
variance ``lam * (sigma_dp / B_eff)^2`` (the paper's effective error ``sigma_dp / B_eff`` read
as a per-coordinate std, scaled by the calibration knob ``lam``; lam = 1 is literal). Block
weights and positions are relevant to every sample (``B_eff = B``); item/token row ``v`` only to
sequences containing ``v`` (``B_eff = max(B p_v, beff_min)``). Every propagated variance is one
scalar per token (and per head where heads differ), computed under ``torch.no_grad`` in float32
(float64 for float64 inputs), with the tensors the modules actually consumed as the means;
dropout masks and normalisation statistics are treated as constants.

The privacy of ``p_v``: the forward pass depends on it, so it must be public or released with
DP (the paper assumes it public); ``dp_sequence_frequencies`` is that release (Gaussian
histogram).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace

import torch
from torch import nn

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
    """Noise level and knobs of Re-Attention; immutable, compared by identity.

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
        ``lam (sigma_dp / max(B p_id, beff_min))^2`` (Claim 5.4, with B_eff clamped so that a
        rare token's B p_v < 1 cannot push it beyond sigma_dp / beff_min)."""
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
    """``u = SiLU(gate) * up`` (SwiGLU; not in the paper): delta-method
    ``Var SiLU(g) = SiLU'(g)^2 v_g``, then Lemma D.1 for the product of independent factors,
    averaged over coordinates: ``Var = v_s up^2 + v_up SiLU(g)^2 + v_s v_up``.
    ``gate, up: [..., D]`` pre-activation means, ``v_gate, v_up: [...]`` -> ``[...]``."""
    gate, up = _wide(gate), _wide(up)
    v_gate, v_up = _wide(v_gate).unsqueeze(-1), _wide(v_up).unsqueeze(-1)
    sig = torch.sigmoid(gate)
    v_act = (sig * (1.0 + gate * (1.0 - sig))).pow(2) * v_gate
    act = gate * sig
    return (v_act * up * up + v_up * act * act + v_act * v_up).mean(-1)


@torch.no_grad()
def logit_correction(
    q: torch.Tensor, v_key: torch.Tensor, max_corr: float = math.inf, scaling: float | None = None
) -> torch.Tensor:
    """Re-Attention's correction in logit space (restoring the 1/sqrt(d_h) the paper omits):
    the logit ``c <q_t, K_j>`` (``c = scaling``, default ``1/sqrt(d_h)``) with
    ``K_j ~ N(k_j, v_j I)`` inflates ``E[exp]`` by ``exp(c^2 ||q_t||^2 v_j / 2)``; returns
    ``min(c^2 ||q_t||^2 v_j / 2, kappa)`` (``||q_t||^2 v_j / (2 d_h)`` by default) to subtract from
    the logits before the (renormalising) softmax.

    ``q: [B, H, T, d_h]`` queries, ``v_key: [B, H, S]`` key variances -> ``[B, H, T, S]``
    (float32 or float64). Only key variance is corrected (query noise ignored, as in the paper)."""
    c_sq = 1.0 / q.shape[-1] if scaling is None else scaling * scaling
    q_sq = _wide(q).pow(2).sum(-1)
    return (q_sq.unsqueeze(-1) * _wide(v_key).unsqueeze(-2) * (c_sq / 2)).clamp(max=max_corr)


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
    """Gaussian-histogram release of ``p_v`` (the paper assumes p_v public; computing it from
    private data without DP would make the trained model non-DP).

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


# ---------------------------------------------------------------- Hugging Face models

REATTENTION_IMPLEMENTATION = "dp_reattention"
_PATCH_ATTR, _STREAM_ATTR = "_dp_reattention_patch", "_dp_reattention_stream"


def _rms_eps(module: nn.Module, x: torch.Tensor) -> float:
    """Epsilon of Llama's RMSNorm (``variance_epsilon``) or ``torch.nn.RMSNorm`` (``eps``, None =
    the dtype's machine epsilon)."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return torch.finfo(x.dtype).eps if eps is None else eps


def _torch_layout(module: nn.Module) -> torch.Tensor:
    """Weight ``[d_out, d_in]`` of an ``nn.Linear`` or a Hugging Face ``Conv1D`` (stored
    ``[d_in, d_out]``)."""
    return module.weight.T if type(module).__name__ == "Conv1D" else module.weight


class _VarianceStream:
    """Scalar-per-token variances of one forward pass of a patched model, written by forward hooks
    in call order: ``residual`` is the residual stream, ``block_in`` the latest norm's output,
    ``key``/``value`` ``[B, H_kv, T]`` of the latest attention layer, ``context`` ``[B, T]`` its
    head-concatenated output, ``mlp_in`` the pre-activations (output, variance) of the latest MLP."""

    def __init__(self, cfg: ReAttentionConfig, act: str):
        self.cfg, self.act, self.active = cfg, act, False
        self.residual = self.block_in = self.key = self.value = self.context = None
        self.mlp_in: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, module: nn.Module, args: tuple) -> None:
        """Model pre-forward hook: forget the previous pass, track this one."""
        self.residual, self.active = None, True

    def stop(self, module: nn.Module, args: tuple, out: object) -> None:
        """Model forward hook (also on exceptions): later standalone module calls (e.g. the DP
        engine's formula probes) are not tracked."""
        self.active = False

    def only_in_forward(self, hook):
        """``hook`` run only inside a forward pass of the patched model."""

        def guarded(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if self.active:
                hook(module, args, out)

        return guarded

    def _linear(self, module: nn.Module, v_in: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Linear rule through ``module`` (``nn.Linear`` or ``Conv1D``) with actual input ``x``."""
        weight, bias = _torch_layout(module), module.bias is not None
        return linear_variance(v_in, x, weight, self.cfg.block_variance(), bias)

    def embedding(self, learned_positions: bool):
        """Hook on the token lookup: the residual stream starts at ``cfg.input_variance``."""

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            ids = args[0]
            self.residual = self.cfg.input_variance(
                ids, torch.ones_like(ids, dtype=torch.bool), learned_positions
            )

        return hook

    def _stream(self) -> torch.Tensor:
        if self.residual is None:
            raise ValueError(
                "Re-Attention needs input_ids (the embedding lookup), not inputs_embeds"
            )
        return self.residual

    def norm(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        s2 = self.cfg.block_variance()
        if isinstance(module, nn.LayerNorm):
            self.block_in = layernorm_variance(
                self._stream(), args[0], module.weight, module.bias, module.eps, s2
            )
        else:
            self.block_in = rmsnorm_variance(
                self._stream(), args[0], module.weight, _rms_eps(module, args[0]), s2
            )

    def projection(self, slot: str, heads: int, rows: slice = slice(None)):
        """Hook storing the per-head variance of ``rows`` of a projection's outputs as ``slot``."""

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            weight = _torch_layout(module)[rows]
            bias = module.bias is not None
            v = head_linear_variance(
                self.block_in, args[0], weight, self.cfg.block_variance(), heads, bias
            )
            setattr(self, slot, v)

        return hook

    def mlp_input(self, name: str):
        """Hook keeping an MLP input projection's output (pre-activation) and its variance."""

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            self.mlp_in[name] = (out, self._linear(module, self.block_in, args[0]))

        return hook

    def _activation(self) -> torch.Tensor:
        if self.act == "swiglu":
            return swiglu_variance(*self.mlp_in["gate"], *self.mlp_in["up"])
        return gelu_variance(*self.mlp_in["fc"], self.cfg.gelu_mode)

    def residual_branch(self, source: str):
        """Hook of a layer whose output is added to the residual stream; its input variance is the
        attention context (``source='attention'``) or the MLP activation (``'mlp'``)."""

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            v_in = self.context if source == "attention" else self._activation()
            self.residual = residual_variance(self._stream(), self._linear(module, v_in, args[0]))

        return hook


Plan = tuple[list[tuple[nn.Module, object]], list[nn.Module]]


def _llama_hooks(model: nn.Module, stream: _VarianceStream) -> Plan:
    """(module, forward hook) pairs in call order, and the attention modules."""
    plan = [(model.model.embed_tokens, stream.embedding(learned_positions=False))]
    kv_heads = model.config.num_key_value_heads
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        plan += [
            (layer.input_layernorm, stream.norm),
            (attn.k_proj, stream.projection("key", kv_heads)),
            (attn.v_proj, stream.projection("value", kv_heads)),
            (attn.o_proj, stream.residual_branch("attention")),
            (layer.post_attention_layernorm, stream.norm),
            (mlp.gate_proj, stream.mlp_input("gate")),
            (mlp.up_proj, stream.mlp_input("up")),
            (mlp.down_proj, stream.residual_branch("mlp")),
        ]
    return plan, [layer.self_attn for layer in model.model.layers]


def _gpt2_hooks(model: nn.Module, stream: _VarianceStream) -> Plan:
    """As ``_llama_hooks``; ``c_attn`` is the fused QKV projection (rows q | k | v)."""
    plan = [(model.transformer.wte, stream.embedding(learned_positions=True))]
    d, heads = model.config.n_embd, model.config.n_head
    for block in model.transformer.h:
        plan += [
            (block.ln_1, stream.norm),
            (block.attn.c_attn, stream.projection("key", heads, slice(d, 2 * d))),
            (block.attn.c_attn, stream.projection("value", heads, slice(2 * d, 3 * d))),
            (block.attn.c_proj, stream.residual_branch("attention")),
            (block.ln_2, stream.norm),
            (block.mlp.c_fc, stream.mlp_input("fc")),
            (block.mlp.c_proj, stream.residual_branch("mlp")),
        ]
    return plan, [block.attn for block in model.transformer.h]


_ARCHITECTURES = {"llama": (_llama_hooks, "swiglu"), "gpt2": (_gpt2_hooks, "gelu")}


@torch.no_grad()
def _per_query_head(v: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, H_kv, S]`` -> ``[B, H, S]``: each KV head's variance for its query heads (GQA), in
    the order of Hugging Face's ``repeat_kv``."""
    return v.repeat_interleave(heads // v.shape[1], dim=1)


def reattention_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Hugging Face attention function (registered as ``"dp_reattention"``): the model's own
    eager attention with the Re-Attention correction added to its additive mask, so a zero
    correction gives exactly the eager result. ``query: [B, H, T, d_h]``, ``key, value:
    [B, H_kv, S, d_h]``; records the context variance for the output projection's hook."""
    stream = getattr(module, _STREAM_ATTR)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    if key.shape[-2] != stream.key.shape[-1]:
        raise ValueError(
            "Re-Attention does not support a KV cache: run the model with use_cache=False"
        )
    heads = query.shape[1]
    corr = logit_correction(query, _per_query_head(stream.key, heads), stream.cfg.max_corr, scaling)
    if attention_mask is None:
        mask = -corr
    else:  # masked entries stay at the dtype's minimum (no -inf rows)
        mask = (attention_mask - corr).clamp_min(torch.finfo(attention_mask.dtype).min)
    out, probs = eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    v_ctx = attention_output_variance(probs, _per_query_head(stream.value, heads))
    stream.context = v_ctx.mean(1)
    return out, probs


@dataclass
class ReAttentionPatch:
    """What ``apply_reattention`` changed on a model, so that ``remove_reattention`` undoes it;
    ``stream`` holds the latest forward's variances (diagnostics; None when disabled)."""

    previous_implementation: str | None
    handles: list = field(default_factory=list)
    attention_modules: list = field(default_factory=list)
    stream: _VarianceStream | None = None


def apply_reattention(model: nn.Module, cfg: ReAttentionConfig) -> ReAttentionPatch:
    """Add Re-Attention to a Hugging Face ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` in place.

    The variance of every activation is propagated with this module's rules by forward hooks
    (embedding: ``cfg.input_variance``, plus the positional table for GPT-2; norms; K/V
    projections per KV head; attention output ``sum_j S^2 v_V``; output projection; MLP: SwiGLU
    rule (Llama) or ``cfg.gelu_mode`` (GPT-2); residual sums), and every self-attention layer
    subtracts ``min(scaling^2 ||q||^2 v_K / 2, kappa)`` from its logits (post-RoPE keys: the
    isotropic variance is rotation invariant; GQA: per KV head, each query head with its own
    ``||q||^2``). ``cfg.enabled=False`` changes nothing.

    Approximations (besides those of the rules themselves): padding (``attention_mask``) is not
    used for the input variance (pad keys are masked anyway); dropout masks are constants (the
    variance uses the dropped-out probabilities); GPT-2's tanh GELU uses the ReLU formula or the
    exact-GELU delta method; the final norm and the LM head are not tracked (they do not feed any
    attention). The patched attention is the model file's eager attention (equal to the unpatched
    output bit for bit only if the model ran eager attention). Needs ``input_ids`` and no KV cache (``use_cache=False``; a cached step raises).
    The variance stream runs under ``no_grad`` and calls no module, so the DP engine's per-module
    hooks and gradients are unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if hasattr(model, _PATCH_ATTR):
        raise ValueError("Re-Attention is already applied to this model")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"Re-Attention supports {sorted(_ARCHITECTURES)} models, got {model_type!r}"
        )
    planner, act = _ARCHITECTURES[model_type]
    if act == "swiglu" and model.config.hidden_act != "silu":
        raise ValueError(
            f"the SwiGLU rule needs hidden_act='silu', got {model.config.hidden_act!r}"
        )
    patch = ReAttentionPatch(model.config._attn_implementation)
    setattr(model, _PATCH_ATTR, patch)
    if not cfg.enabled:
        return patch
    AttentionInterface.register(REATTENTION_IMPLEMENTATION, reattention_attention_forward)
    AttentionMaskInterface.register(REATTENTION_IMPLEMENTATION, eager_mask)
    patch.stream = stream = _VarianceStream(cfg, act)
    hooks, patch.attention_modules = planner(model, stream)
    patch.handles = [
        model.register_forward_pre_hook(stream.start),
        model.register_forward_hook(stream.stop, always_call=True),
    ]
    patch.handles += [
        module.register_forward_hook(stream.only_in_forward(hook)) for module, hook in hooks
    ]
    for module in patch.attention_modules:
        setattr(module, _STREAM_ATTR, stream)
    model.config._attn_implementation = REATTENTION_IMPLEMENTATION
    return patch


def remove_reattention(model: nn.Module) -> None:
    """Undo ``apply_reattention``: hooks removed, the previous attention implementation back."""
    patch = getattr(model, _PATCH_ATTR, None)
    if patch is None:
        raise ValueError("Re-Attention is not applied to this model")
    for handle in patch.handles:
        handle.remove()
    for module in patch.attention_modules:
        delattr(module, _STREAM_ATTR)
    model.config._attn_implementation = patch.previous_implementation
    delattr(model, _PATCH_ATTR)


__all__ = [
    "GELU_MODES",
    "REATTENTION_IMPLEMENTATION",
    "ReAttentionConfig",
    "ReAttentionPatch",
    "TokenFrequencies",
    "apply_reattention",
    "attention_output_variance",
    "distinct_counts",
    "dp_sequence_frequencies",
    "gelu_variance",
    "head_linear_variance",
    "layernorm_variance",
    "linear_variance",
    "logit_correction",
    "reattention_attention_forward",
    "relu_variance",
    "remove_reattention",
    "residual_variance",
    "rmsnorm_variance",
    "sequence_frequencies",
    "swiglu_variance",
]
