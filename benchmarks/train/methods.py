"""The training steps ``python -m benchmarks.train`` times (``METHODS``): non-private, ours (``DPEngine``), Opacus
ghost clipping (tied, untied, LoRA), ``vmap`` per-sample gradients."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.lib.measure import free_bytes
from benchmarks.train.spec import (
    Batch,
    BenchSpec,
    ModelSize,
    _adam,
    _autocast,
    _per_sample_loss,
    _trainable,
)
from vllm_dp_plugin.trainer.engine import DPConfig, DPEngine, causal_lm_per_sample_loss

NAIVE_COPIES = 3  # per-sample gradients, their clipped/squared temporaries, vmap's own buffers


@dataclass(frozen=True)
class Method:
    """One way of taking a training step. ``build(model, batch, spec)`` returns the step
    function, which returns the per-sample gradient norms ``[B]`` when the method has them; a
    ``row`` dict set on the step function (e.g. the Opacus mode that ran) is merged into the
    method's result row. ``lora``: the model is wrapped by ``apply_lora`` first (``--model``
    only); ``baseline``: the row its ratios are against."""

    label: str
    tied: bool
    build: Callable[[nn.Module, Batch, BenchSpec], Callable[[], torch.Tensor | None]]
    skip_reason: Callable[[ModelSize, int, torch.device], str] | None = None  # (size, parameters, device)
    lora: bool = False
    baseline: str = "non_private"


def non_private_step(model: nn.Module, batch: Batch, spec: BenchSpec):
    optimizer = _adam(model, spec)

    def step() -> None:
        _per_sample_loss(model, batch, spec).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def ours_step(model: nn.Module, batch: Batch, spec: BenchSpec):
    engine = DPEngine(model, DPConfig(
        noise_multiplier=spec.noise_multiplier, expected_batch_size=spec.size.batch,
        clip_norm=spec.clip_norm, clipping="flat", seed=spec.seed,
    ))
    optimizer = _adam(model, spec)

    def step() -> torch.Tensor:
        norms = engine.backward(_per_sample_loss(model, batch, spec))
        engine.finish_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norms

    return step


def _opacus(model: nn.Module, batch: Batch, spec: BenchSpec, mode: str):
    """``(step, wrapped module)`` of Opacus' public API in ``grad_sample_mode`` ``mode``; its data
    loader is built (``make_private`` needs one) but the fixed batch is fed directly, without
    Poisson sampling, as for the other methods. Ghost mode takes its criterion wrapper (the loss
    per sequence via ``shape``); hooks mode the mean of the per-sequence losses."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(batch.ids.cpu()), batch_size=spec.size.batch)
    noise = torch.Generator(device=batch.ids.device).manual_seed(spec.seed)
    private = PrivacyEngine().make_private(
        module=model, optimizer=_adam(model, spec), data_loader=loader, criterion=nn.CrossEntropyLoss(),
        noise_multiplier=spec.noise_multiplier, max_grad_norm=spec.clip_norm, grad_sample_mode=mode,
        poisson_sampling=False, noise_generator=noise,
    )
    if mode == "ghost":
        wrapped, optimizer, criterion, _ = private
        labels = batch.shifted_labels().flatten()

        def loss_of(logits: torch.Tensor) -> torch.Tensor:
            return criterion(logits.flatten(0, 1).float(), labels, shape=logits.shape)
    else:
        wrapped, optimizer, _ = private

        def loss_of(logits: torch.Tensor) -> torch.Tensor:
            return causal_lm_per_sample_loss(logits, batch.ids).mean()

    def step() -> None:
        with _autocast(spec):
            loss = loss_of(wrapped(**batch.inputs()).logits)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, wrapped


def opacus_ghost_step(model: nn.Module, batch: Batch, spec: BenchSpec):
    """Opacus' ghost clipping (``make_private(grad_sample_mode="ghost")``)."""
    return _opacus(model, batch, spec, "ghost")[0]


def opacus_lora_step(model: nn.Module, batch: Batch, spec: BenchSpec):
    """Opacus over the peft model (only the adapters trainable): ghost clipping; where ghost
    refuses, at ``make_private`` or in the first step, its hooks are removed and the default
    hooks mode (per-sample gradients of the adapters) runs instead (built inside that first
    step: with ``--warmup 0`` the first timed step includes it). ``step.row`` says which ran."""
    state: dict = {"first": True}

    def fall_back(err: Exception, wrapped=None) -> None:
        if wrapped is not None:
            wrapped.remove_hooks()
            wrapped._close()  # Opacus' own clean-up of its per-parameter attributes
        model.zero_grad(set_to_none=True)
        state["step"] = _opacus(model, batch, spec, "hooks")[0]
        step.row = {"label": "Opacus 1.6 hooks mode (ghost clipping refused), LoRA", "opacus_mode": "hooks",
                    "ghost_refusal": _error_text(err).removeprefix("error: ")}

    def step() -> None:
        first, state["first"] = state["first"], False
        if "step" not in state:
            fall_back(state["refusal"])
        try:
            state["step"]()
        except Exception as err:
            if not first or step.row["opacus_mode"] != "ghost":
                raise
            fall_back(err, state["wrapped"])
            state["step"]()

    step.row = {"opacus_mode": "ghost"}
    try:
        state["step"], state["wrapped"] = _opacus(model, batch, spec, "ghost")
    except Exception as err:  # noqa: BLE001 - hooks mode instead, said in the row
        state["refusal"] = err
    return step


def naive_vmap_step(model: nn.Module, batch: Batch, spec: BenchSpec):
    """Per-sample gradients of every trainable parameter (``torch.func.vmap(grad)``; the tied weight is one
    entry, its two uses summed by ``functional_call``), flat clipping, float64 noise, Adam. Each
    sample runs alone with the model's default positions ``0..T-1`` (equal to the batch's): given
    ``position_ids``, Hugging Face probes them for packed sequences with data-dependent control
    flow, which ``vmap`` refuses."""
    from torch.func import functional_call, grad, vmap

    params = _trainable(model)  # a tied weight appears once; LoRA: the adapters (the base is a constant)
    optimizer = _adam(model, spec)
    noise = torch.Generator(device=batch.ids.device).manual_seed(spec.seed)

    def sample_loss(values: dict, ids: torch.Tensor) -> torch.Tensor:
        with _autocast(spec):
            logits = functional_call(model, values, (ids[None],)).logits
            return causal_lm_per_sample_loss(logits, ids[None])[0]

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0))

    def step() -> torch.Tensor:
        grads = per_sample_grads({n: p.detach() for n, p in params.items()}, batch.ids)
        norms = sum(g.flatten(1).pow(2).sum(1, dtype=torch.float64) for g in grads.values()).sqrt()
        factors = (spec.clip_norm / norms).clamp(max=1.0).float()
        for name, param in params.items():
            total = torch.einsum("b,b...->...", factors, grads[name].float())
            draw = torch.randn(total.shape, dtype=torch.float64, generator=noise, device=total.device)
            total += (spec.noise_multiplier * spec.clip_norm * draw).float()
            param.grad = (total / spec.size.batch).to(param.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norms

    return step


def naive_skip_reason(size: ModelSize, params: int, device: torch.device) -> str:
    """Non-empty when the per-sample gradients would not fit comfortably."""
    need, free = NAIVE_COPIES * size.batch * params * 4, free_bytes(device)
    if need <= free / 2:
        return ""
    return (
        f"skipped: per-sample gradients need ~{need / 2**30:.1f} GiB ({NAIVE_COPIES} x B x P x 4 bytes), "
        f"more than half of the {free / 2**30:.1f} GiB free"
    )


METHODS = {
    "non_private": Method("non-private (mean loss, Adam)", tied=True, build=non_private_step),
    "ours": Method("ours: DPEngine, Phantom Clipping", tied=True, build=ours_step),
    "opacus_ghost": Method("Opacus 1.6 ghost clipping (tied)", tied=True, build=opacus_ghost_step),
    "opacus_ghost_untied": Method("Opacus 1.6 ghost clipping (untied head)", tied=False, build=opacus_ghost_step),
    "naive_vmap": Method(
        "naive per-sample grads (torch.func vmap)", tied=True, build=naive_vmap_step, skip_reason=naive_skip_reason
    ),
    # --model only (LoRA targets a Llama's nn.Linear projections; GPT-2's are Conv1D)
    "non_private_lora": Method(
        "non-private LoRA (mean loss, Adam)", tied=True, build=non_private_step, lora=True, baseline="non_private_lora"
    ),
    "ours_lora": Method("ours LoRA: DPEngine over peft", tied=True, build=ours_step, lora=True, baseline="non_private_lora"),
    "opacus_lora": Method(
        "Opacus 1.6 ghost clipping, LoRA", tied=True, build=opacus_lora_step, lora=True, baseline="non_private_lora"
    ),
}
PRESET_METHODS = [name for name, m in METHODS.items() if not m.lora]  # the default without --model




def _error_text(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"error: {type(err).__name__}: {first}"[:300]
