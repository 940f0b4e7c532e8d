"""DP-SGD / DP-Adam engine (as in DPFormer and fastDP): per-sample clipping without per-sample
gradients ("book-keeping", one backward) and Gaussian noise, for models built from supported
module types.

Per training step, for each physical (virtual) batch: run the model forward (the engine's hooks
capture each supported module's detached input and its output's gradient edge), compute a per-sample loss
``[b]``, call ``engine.backward(loss)``; then call ``engine.finish_step()`` once and any torch
optimizer's ``step()`` (SGD = DP-SGD, Adam/AdamW = DP-Adam: post-processing of the noisy grad).

``backward`` takes ONE ``torch.autograd.grad`` of ``sum_i L_i`` w.r.t. the captured outputs (no
parameter gradients), sums per-sample squared norms over all trainable parameters (the rule of
each module's type in ``norm_rules``; a weight tied between an ``nn.Embedding`` and an output
``nn.Linear`` by Phantom Clipping), clips (AUTO-S ``C / (n_i + gamma)`` or Abadi
``min(1, C / n_i)``) and adds the clipped sum into a private float32-or-wider accumulator.
``finish_step`` adds ``N(0, (sigma C)^2)`` noise once per parameter, divides by the expected
batch size B and writes ``p.grad``.

Floating point: that float release ``clipped sum + fl(sigma C xi)`` is not DP as computed (its
low-order bits depend on the clipped sum: Mironov 2012; Jin et al. 2022 for Opacus), and every
gradient, optimizer state and exported weight is computed from it. ``secure_mode`` releases the
whole noisy clipped sum (all parameters, one vector of d coordinates) as
``privacy.noise.GridGaussian`` instead: snapped to a power-of-two grid plus exact discrete
Gaussian noise, so everything after it is post-processing of an integer vector. Its noise std is
at most about (1 + 1/1024) sigma C; it must be accounted with ``accounting``'s ``rdp_integer``. The
residual assumption of both modes: the computed clipped sums of neighbouring batches differ by at
most C (true in exact arithmetic; float32 rounding of the norms and sums can exceed it by a
relative O(batch x 1e-7), not accounted).

Supported trainable modules (one ``norm_rules`` module each, looked up by module type):
``nn.Linear``, Hugging Face ``Conv1D`` (GPT-2), ``nn.Embedding`` (``padding_idx`` rows get no
gradient), ``nn.LayerNorm`` (last dim), RMSNorm (``torch.nn.RMSNorm`` and classes named
``*RMSNorm`` with ``weight`` and ``variance_epsilon``/``eps``, e.g. Llama's).
Every hooked module's forward is checked once against the formula its norms assume. Each hooked
module must be called at most once per forward, with the batch as its inputs' first dimension.
Not detected (the caller's responsibility): a parameter used outside its module's forward (e.g.
``F.linear(h, embedding.weight)`` instead of a tied ``nn.Linear``) would have that use missing
from its norm; the trainable parameters are fixed when the engine is built.

Distributed (DDP-style data parallelism): give every rank the plain, unwrapped model with equal
initial parameters, the same ``DPConfig`` (B = the global expected batch size) and its shard of
the same Poisson draw (``sampling.shard_for_rank``). ``finish_step`` all-reduces the clipped sums
itself; the noise is drawn on rank 0 only and added before the reduction (secure mode: rank 0
releases the reduced sum and broadcasts it), so every rank ends with the same ``.grad``.
``DistributedDataParallel`` wrappers are refused: their reducer would all-reduce parameter
gradients that the engine never produces (it replaces that reducer).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from vllm_dp_plugin.privacy.keyed_noise import SEED_BYTES, fresh_generator, seeded_generator
from vllm_dp_plugin.privacy.noise import GridGaussian
from vllm_dp_plugin.privacy.validation import check_count, check_positive

from .norm_rules import (
    InputGrams,
    NormRule,
    ParamRole,
    find_rule,
    norm_dtype,
    sq_norms_of,
    supported_names,
    weighted_sum,
)
from .norm_rules.embedding import tied_embedding_sq_norms

Clipping = Literal["automatic", "flat"]
NOISE_CHUNK = 1 << 20  # float64 noise is drawn in chunks of this many coordinates (8 MiB each)
GRID_CHUNK = 1 << 18  # secure mode: coordinates per exact sampler call (~120 MiB working memory)


@dataclass(frozen=True, kw_only=True)
class DPConfig:
    """DP-SGD hyperparameters.

    ``noise_multiplier`` sigma: the noise std is ``sigma * clip_norm`` per coordinate of the
    clipped sum (0 disables noise: no privacy, for tests). ``expected_batch_size`` B = q N, the
    fixed divisor of the noisy sum (never the realised Poisson batch size). ``clipping``:
    ``"automatic"`` (AUTO-S, factor ``C / (n_i + gamma)``) or ``"flat"`` (Abadi,
    ``min(1, C / n_i)``); both bound each sample's contribution by C. ``seed``: ``None`` seeds
    the noise from OS entropy; an int makes it reproducible (tests) and must then stay secret.
    ``secure_mode``: release the noisy clipped sum as a ``GridGaussian`` (no floating-point leak;
    account it with ``rdp_integer``) instead of adding float Gaussian noise.
    """

    noise_multiplier: float
    expected_batch_size: int
    clip_norm: float = 1.0
    clipping: Clipping = "automatic"
    gamma: float = 0.01
    seed: int | None = None
    secure_mode: bool = False

    def __post_init__(self) -> None:
        if self.noise_multiplier != 0:
            try:
                check_positive(self.noise_multiplier, "noise_multiplier")
            except ValueError:
                raise ValueError(
                    f"noise_multiplier must be finite and >= 0 (0: no noise), got {self.noise_multiplier!r}"
                ) from None
        check_count(self.expected_batch_size, "expected_batch_size")
        check_positive(self.clip_norm, "clip_norm")
        if self.clipping not in ("automatic", "flat"):
            raise ValueError(f"clipping must be 'automatic' or 'flat', got {self.clipping!r}")
        check_positive(self.gamma, "gamma")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        if not isinstance(self.secure_mode, bool):
            raise ValueError(f"secure_mode must be True or False, got {self.secure_mode!r}")  # noqa: TRY004


# Formula probe tolerance (relative and absolute): it must reject a different formula, not
# rounding. float32 for parameters of float32 or wider (Hugging Face RMSNorms compute in float32
# even in a float64 model), bf16/fp16 otherwise.
_PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-5}
_PROBE_TOLERANCE_LOW_PRECISION = 2e-2


# ---------- what the engine hooks, and the checks that make its norms exact ----------


@dataclass
class _Call:
    """One call of a hooked module in the current forward: detached input, the output's gradient
    edge (not the output: holding every output until the backward ends would keep ~one more
    activation per layer alive), the output's batch size."""

    module: nn.Module
    rule: NormRule
    x: torch.Tensor
    y: GradientEdge
    batch: int


@dataclass
class _Use:
    """One use of a trainable parameter in the current forward, batch-first ``[B, T, ...]``;
    ``per_sample [B, *shape]``: its per-sample gradients where the role has small ones, computed
    once for both the norms and the clipped sum."""

    module: nn.Module
    role: ParamRole
    x: torch.Tensor
    g: torch.Tensor
    per_sample: torch.Tensor | None = None

    def sq_norms(self, grams: InputGrams) -> torch.Tensor:
        if self.per_sample is not None:
            return sq_norms_of(self.per_sample)
        return self.role.sq_norms(self.module, self.x, self.g, grams)

    def clipped_sum(self, c: torch.Tensor) -> torch.Tensor:
        if self.per_sample is not None:
            return weighted_sum(self.per_sample, c)
        return self.role.clipped_sum(self.module, self.x, self.g, c)


def _supported_modules(model: nn.Module) -> dict[nn.Module, NormRule]:
    """Modules owning a trainable parameter, with their norm rule; ValueError naming any trainable
    parameter of an unsupported module type, any option that breaks the norms, and any
    parameter shared other than one ``nn.Embedding`` weight tied to one ``nn.Linear`` weight."""
    owners: dict[nn.Parameter, list[tuple[str, nn.Module]]] = {}
    found: dict[nn.Module, NormRule] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            full = f"{name}.{attr}" if name else attr
            rule = find_rule(module)
            if rule is None or attr not in rule.attrs:
                raise ValueError(
                    f"trainable parameter {full!r} belongs to {type(module).__name__}, which the DP "
                    f"engine does not support (supported: {', '.join(supported_names())}); "
                    "freeze it or rebuild the module from supported types"
                )
            rule.check_options(name, module)
            owners.setdefault(param, []).append((full, module))
            found[module] = rule
    for users in owners.values():
        _check_sharing(users)
    return found


def _check_sharing(users: list[tuple[str, nn.Module]]) -> None:
    """One owner, or an ``nn.Embedding`` and an ``nn.Linear`` sharing ``weight`` (tied)."""
    if len(users) == 1:
        return
    types = sorted(type(module).__name__ for _, module in users)
    modules = [module for _, module in users]
    tied = len(users) == 2 and any(isinstance(m, nn.Embedding) for m in modules) and any(
        isinstance(m, nn.Linear) for m in modules
    )
    if not tied:
        names = ", ".join(name for name, _ in users)
        raise ValueError(
            f"parameter shared by {names} ({', '.join(types)}): only an nn.Embedding weight tied "
            "to an output nn.Linear weight is supported"
        )


def _check_formula(name: str, module: nn.Module, rule: NormRule) -> None:
    """The module's forward must equal ``rule.reference`` on a probe input: a module that
    computes something else (e.g. an RMSNorm with ``(1 + weight)``) would get wrong norms."""
    weight = next(module.parameters())
    tolerance = _PROBE_TOLERANCE.get(weight.dtype, _PROBE_TOLERANCE_LOW_PRECISION)
    with torch.no_grad():
        probe = rule.probe(module)
        got, want = module(probe).double(), rule.reference(module, probe).double()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tolerance, atol=tolerance):
        raise ValueError(
            f"module {name!r} ({type(module).__name__}) does not compute the {rule.name} formula the "
            "DP engine's per-sample norms assume; its norms would be wrong (a privacy bug)"
        )


def _batch_first(t: torch.Tensor, lookup: bool) -> torch.Tensor:
    """``[B, ...]`` ids -> ``[B, T]``; ``[B, ..., d]`` features -> ``[B, T, d]``."""
    return t.reshape(t.shape[0], -1) if lookup else t.reshape(t.shape[0], -1, t.shape[-1])


def _param_sq_norms(uses: list[_Use], grams: InputGrams) -> torch.Tensor:
    """Per-sample squared norm ``[B]`` of one parameter's total gradient over its uses: one use,
    or the tied lookup + output pair (Phantom Clipping, cross term included). ``grams``: the
    backward's input Grams, shared between layers reading the same input."""
    if len(uses) == 1:
        return uses[0].sq_norms(grams)
    lookup = next(u for u in uses if isinstance(u.module, nn.Embedding))
    output = next(u for u in uses if u is not lookup)
    return tied_embedding_sq_norms(lookup.x, lookup.g, output.x, output.g, lookup.module.padding_idx)


# ---------- the engine ----------


class DPEngine:
    """Per-sample clipping and noise for ``model``; see the module docstring for the protocol."""

    def __init__(self, model: nn.Module, config: DPConfig):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise TypeError(
                "pass the unwrapped model: the DP engine all-reduces the clipped sums itself, "
                "DistributedDataParallel's reducer would reduce gradients it never produces"
            )
        if getattr(model, "is_gradient_checkpointing", False):
            raise ValueError("gradient checkpointing is not supported by the DP engine: disable it")
        self.config = config
        self._modules = _supported_modules(model)
        self._names = {module: name for name, module in model.named_modules(remove_duplicate=False)}
        for module, rule in self._modules.items():
            _check_formula(self._names[module], module, rule)
        self._params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
        if not self._params:
            raise ValueError("the model has no trainable parameter")
        self._sums: dict[nn.Parameter, torch.Tensor] = {}
        self._calls: list[_Call] = []
        self._in_backward = False
        self._generator = noise_generator(config.seed, "dp-sgd noise", self._params[0].device)
        dim = sum(p.numel() for p in self._params)
        self.secure_release = (  # secure mode: the release of the whole clipped sum
            GridGaussian.calibrate(config.clip_norm, config.noise_multiplier, dim)
            if config.secure_mode and config.noise_multiplier > 0
            else None
        )
        self._handles = [model.register_forward_pre_hook(self._start_forward)]
        self._handles += [m.register_forward_hook(self._capture, with_kwargs=True) for m in self._modules]

    def backward(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """Clip this (virtual) batch and add its clipped sum to the step's accumulator.

        ``per_sample_loss: [b]`` from the latest forward of the model (grad enabled). Returns the
        per-sample gradient norms ``[b]`` over all trainable parameters (float32 or wider)."""
        calls, self._calls = self._calls, []
        if per_sample_loss.dim() != 1:
            raise ValueError(f"per_sample_loss must have shape [b], got {tuple(per_sample_loss.shape)}")
        if not per_sample_loss.requires_grad:
            raise RuntimeError("per_sample_loss has no graph: run the forward with grad enabled before backward")
        uses = self._gradients(calls, per_sample_loss)
        sq_norms = self._sq_norms(uses, per_sample_loss)
        sample_norms = sq_norms.clamp_min(0).sqrt()
        factors = self._clip_factors(sample_norms)
        for param, param_uses in uses.items():
            for use in param_uses:
                total = use.clipped_sum(factors)
                self._sums[param] = total if param not in self._sums else self._sums[param] + total
        return sample_norms

    def finish_step(self) -> None:
        """Write ``p.grad = (clipped sum + sigma C N(0, I)) / B`` for every trainable parameter
        (noise once per parameter, a tied weight included; parameters no sample reached get
        noise only; secure mode: ``p.grad = secure_release(clipped sums) / B``), all-reducing
        the clipped sums under torch.distributed; then start a new step."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        noisy_rank = not distributed or dist.get_rank() == 0
        totals = [self._take_sum(param) for param in self._params]
        if self.secure_release is None:
            if noisy_rank:
                self._add_noise(totals)
            if distributed:
                for total in totals:
                    dist.all_reduce(total)
        else:  # the grid release needs the whole sum: reduce, release on rank 0, broadcast
            if distributed:
                for total in totals:
                    dist.all_reduce(total)
            if noisy_rank:
                self._release_on_grid(totals)
            if distributed:
                for total in totals:
                    dist.broadcast(total, src=0)
        for param, total in zip(self._params, totals, strict=True):  # in place: no second copy of the sums
            total.div_(self.config.expected_batch_size)
            param.grad = total if total.dtype == param.dtype else total.to(param.dtype)

    def noise_state(self) -> torch.Tensor:
        """The noise generator's state (for checkpoints; as secret as the data: with it the noise
        of every later step is known)."""
        return self._generator.get_state()

    def set_noise_state(self, state: torch.Tensor) -> None:
        """Continue the noise stream of a checkpoint, so a resumed seeded run never replays a draw."""
        self._generator.set_state(state)

    def detach(self) -> None:
        """Remove the engine's hooks; the model is then a plain model again."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._calls, self._sums = [], [], {}

    # ---- hooks ----

    def _start_forward(self, module: nn.Module, args: tuple) -> None:
        self._calls = []

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        if self._in_backward:
            raise RuntimeError(
                f"module {self._names[module]!r} ran during the DP backward (gradient checkpointing "
                "recomputation?): not supported, disable checkpointing"
            )
        if not torch.is_grad_enabled():
            return  # evaluation forward: nothing to clip
        if any(call.module is module for call in self._calls):
            raise ValueError(
                f"module {self._names[module]!r} ({type(module).__name__}) was called twice in one "
                "forward: its parameters would be shared between uses, which the DP engine does not "
                "support"
            )
        x = args[0] if args else next(iter(kwargs.values()))
        self._calls.append(_Call(module, self._modules[module], x.detach(), get_gradient_edge(output), output.shape[0]))

    # ---- per-sample norms and clipping ----

    def _gradients(self, calls: list[_Call], loss: torch.Tensor) -> dict[nn.Parameter, list[_Use]]:
        """One ``autograd.grad`` of ``sum_i L_i`` w.r.t. every captured output; the uses of each
        trainable parameter, batch-first. Outputs the loss does not depend on are dropped."""
        batch = loss.shape[0]
        for call in calls:
            if call.batch != batch:
                raise ValueError(
                    f"module {self._names[call.module]!r} produced batch size {call.batch} but the "
                    f"loss has {batch}: hooked modules must see per-sample inputs, batch first (pass "
                    "Hugging Face models position_ids of shape [B, T])"
                )
        self._in_backward = True
        try:
            grads = torch.autograd.grad(loss.sum(), [call.y for call in calls], allow_unused=True)
        finally:
            self._in_backward = False
        uses: dict[nn.Parameter, list[_Use]] = {}
        for call, g in zip(calls, grads, strict=True):
            if g is None:
                continue
            x, g = _batch_first(call.x, call.rule.lookup), _batch_first(g, lookup=False)
            for role in call.rule.roles:
                param = getattr(call.module, role.attr)
                if param is not None and param.requires_grad:
                    per_sample = None if role.per_sample is None else role.per_sample(call.module, x, g)
                    uses.setdefault(param, []).append(_Use(call.module, role, x, g, per_sample))
        return uses

    def _sq_norms(self, uses: dict[nn.Parameter, list[_Use]], loss: torch.Tensor) -> torch.Tensor:
        """``[b]``: sum over trainable parameters of the per-sample squared gradient norms (each
        distinct layer input's Gram computed once: ``InputGrams``)."""
        start = torch.zeros(loss.shape[0], dtype=norm_dtype(loss), device=loss.device)
        grams = InputGrams()
        return sum((_param_sq_norms(param_uses, grams) for param_uses in uses.values()), start)

    def _clip_factors(self, sample_norms: torch.Tensor) -> torch.Tensor:
        """``[b]`` factors with ``c_i n_i <= C``: AUTO-S ``C / (n_i + gamma)`` or ``min(1, C / n_i)``."""
        clip = self.config.clip_norm
        if self.config.clipping == "automatic":
            return clip / (sample_norms + self.config.gamma)
        return (clip / sample_norms).clamp(max=1.0)

    # ---- noise ----

    def _take_sum(self, param: nn.Parameter) -> torch.Tensor:
        """The step's clipped sum of ``param`` (zeros if no sample reached it), removed from the
        accumulator."""
        total = self._sums.pop(param, None)
        if total is None:
            return torch.zeros(param.shape, dtype=_accumulator_dtype(param), device=param.device)
        return total

    def _add_noise(self, totals: list[torch.Tensor]) -> None:
        """``total += sigma C xi``, ``xi ~ N(0, I)`` drawn in float64 and scaled before the cast.

        On CPU torch's float64 normal sampler is serial (~60 ns a coordinate: 2.3 s for a 135M
        parameter model), so the coordinates are cut into ``NOISE_CHUNK`` pieces, each drawn
        from its own generator seeded with ``SEED_BYTES`` secret bytes of the engine's generator,
        on ``torch.get_num_threads()`` threads. Same law, reproducible for a seeded engine."""
        std = self.config.noise_multiplier * self.config.clip_norm
        if std == 0:
            return
        chunks = [chunk for total in totals for chunk in total.view(-1).split(NOISE_CHUNK)]
        if self._generator.device.type != "cpu":
            for chunk in chunks:
                _add_gaussian(chunk, std, self._generator)
            return
        seeds = torch.randint(0, 256, (len(chunks), SEED_BYTES), dtype=torch.uint8, generator=self._generator)

        def fill(chunk: torch.Tensor, seed: torch.Tensor) -> None:
            _add_gaussian(chunk, std, seeded_generator(seed.numpy().tobytes()))

        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            list(pool.map(fill, chunks, seeds))

    def _release_on_grid(self, totals: list[torch.Tensor]) -> None:
        """Overwrite the parameters' clipped sums with ``secure_release`` of their concatenation
        (one vector of d coordinates, released in chunks of ``GRID_CHUNK``)."""
        flat = torch.cat([total.reshape(-1).to(torch.float64) for total in totals])
        for chunk in flat.split(GRID_CHUNK):
            chunk.copy_(self.secure_release.release(chunk, self._generator))
        for total, part in zip(totals, flat.split([t.numel() for t in totals]), strict=True):
            total.copy_(part.view(total.shape))


def _add_gaussian(chunk: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """``chunk += fl(std * N(0, I))``: sampled and scaled in float64 on the generator's device, cast
    to the chunk's dtype, then added (the float release the module docstring describes)."""
    noise = torch.randn(chunk.shape, dtype=torch.float64, generator=generator, device=generator.device)
    chunk.add_(noise.mul_(std).to(device=chunk.device, dtype=chunk.dtype))


def _accumulator_dtype(param: torch.Tensor) -> torch.dtype:
    return torch.promote_types(param.dtype, torch.float32)


def noise_generator(seed: int | None, stream: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose whole state is secret: ``keyed_noise.fresh_generator`` (256 bits of OS
    entropy) for ``seed=None``, else derived from SHA-256 of (``stream``, ``seed``) (reproducible,
    e.g. tests). Never ``manual_seed``: torch's CPU generator keeps 32 bits of it, so an attacker
    holding the released weights could search every noise stream."""
    if seed is None:
        return fresh_generator(device)
    return seeded_generator(hashlib.sha256(f"vllm-dp/{stream}|{seed}".encode()).digest(), device)


# ---------- losses and schedules for DP training ----------


def causal_lm_per_sample_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, shift: bool = True
) -> torch.Tensor:
    """``[B]`` mean next-token cross-entropy over each sample's valid labels (0 for a sample
    without any). ``logits: [B, T, V]``, ``labels: [B, T]`` aligned with the inputs as in Hugging
    Face (position t predicts ``labels[t + 1]``; ``shift=False`` if already aligned with the
    logits). Computed in float32 or wider; the labels are shifted, not the logits (no copy)."""
    if shift:
        labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    tokens = F.cross_entropy(
        logits.flatten(0, 1).to(norm_dtype(logits)),
        labels.flatten(),
        ignore_index=ignore_index,
        reduction="none",
    ).view(labels.shape)
    valid = (labels != ignore_index).sum(1)
    return tokens.sum(1) / valid.clamp_min(1)


def warmup_linear_decay(step: int, total: int, warmup_frac: float = 0.2) -> float:
    """Learning-rate factor of step ``step`` (1-based) of ``total`` (DPFormer's schedule, taken
    per step and decayed to 0): linear warm-up ``t / T_w`` up to ``T_w = warmup_frac * total``,
    then linear decay ``(T - t) / (T - T_w)`` to 0 at ``t = T``."""
    check_count(total, "total")
    if not 0 <= warmup_frac < 1:
        raise ValueError(f"warmup_frac must lie in [0, 1), got {warmup_frac!r}")
    warmup = warmup_frac * total
    if step <= warmup:
        return step / warmup
    return max(0.0, (total - step) / (total - warmup))


def warmup_linear_decay_scheduler(
    optimizer: torch.optim.Optimizer, total: int, warmup_frac: float = 0.2
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` applying ``warmup_linear_decay``: call ``scheduler.step()`` after each
    ``optimizer.step()``; the i-th optimizer step (0-based) uses the factor of step i + 1."""
    warmup_linear_decay(1, total, warmup_frac)  # validate now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: warmup_linear_decay(i + 1, total, warmup_frac))
