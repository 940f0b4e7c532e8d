"""``vllm-dp bench train``: step time and peak memory of DP training (DPFormer's efficiency claims).

One Hugging Face GPT-2 causal LM (``Conv1D`` projections, learned positions, LayerNorm, a 50257
token vocabulary whose output head is tied to the input embedding), one fixed synthetic batch
(seeded uniform token ids, every token a label), one run per method:

* ``non_private``: the mean loss, one backward, Adam;
* ``ours``: ``DPEngine`` (book-keeping: one backward w.r.t. the module outputs, ghost norms,
  Phantom Clipping for the tied embedding, clipped sums, float64 Gaussian noise), Adam;
* ``opacus_ghost``: Opacus 1.6 ghost clipping (``make_private(grad_sample_mode="ghost")``: two
  backwards, ghost norms for Linear and Embedding, per-sample gradients for the layers it has
  no norm rule for: LayerNorm by its own rule, Hugging Face Conv1D through ``torch.func``) on
  the same tied model;
* ``opacus_ghost_untied``: the same with an untied output head (``nn.Linear``), the model Opacus
  can run (a sane baseline: expect parity, not the paper's 100x, which fits a ghost-clipping
  baseline whose untied output layer is an embedding lookup of all M items);
* ``naive_vmap``: per-sample gradients ``vmap(grad(loss))``, clipped, summed, noised, Adam;
  skipped when ``B * P`` float32 per-sample gradients (x ``NAIVE_COPIES``) exceed half the free
  memory.

All DP methods clip flat (Abadi, ``min(1, C / n_i)``, as Opacus does) with noise multiplier
``--noise-multiplier`` and add the noise in every step. Step time: the median of ``--steps``
timed steps after ``--warmup`` untimed ones (the device synchronised around each step); the
batch is fixed (no Poisson sampling, which would change the work per step).

Peak memory, comparable across methods, devices and suites (``benchmarks.lib.measure.PeakMemory``):
parameters + the most the method's set-up and steps allocate above what was in use once the
model and batch existed (gradients, optimiser states, activations, per-sample state). CUDA:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the process's
resident-set high-water mark (``VmHWM``), reset through ``/proc/self/clear_refs`` (after
``malloc_trim``) before the method is built; torch's CPU allocations are invisible to
``tracemalloc``, and the profiler's memory view slows the steps it measures. Each method runs
in its own process forked from a clean server process (``multiprocessing`` forkserver that has
only imported the libraries), so one method's freed-but-cached memory, allocator state or CUDA
context never counts for the next. Without ``clear_refs`` the CPU peak falls back to
``ru_maxrss`` (not resettable: an upper bound that may include set-up peaks; the JSON says
which).

Also checks that our per-sample gradient norms equal the ``torch.func`` ones on the first batch
(same initial weights, float32: relative tolerance ``NORM_RTOL``).

A real model (``--model smollm2``: SmolLM2-135M-Instruct, ``.models/smollm2-135m-instruct``,
imported on first use; or any Hugging Face Llama directory) replaces the GPT-2 preset: its
pretrained float32 weights (tied 49,152-token embedding for SmolLM2; ``opacus_ghost_untied``
gets an untied copy of the output head), or seeded random ones for a directory holding only a
``config.json`` (``lib.scenarios.load_causal_lm``: SmolLM2's architecture carried to a GPU machine
its weights cannot reach; step time and memory do not depend on the values), a seeded batch of
uniform token ids from its vocabulary with ``position_ids [B, T]`` (default 32 x 128 on CPU,
32 x 512 on CUDA), and three LoRA rows (``peft`` adapters from ``trainer.lora``, default r 8,
alpha 16 on all 7 Llama projections; only the adapters trained, Adam on them):

* ``non_private_lora``: the mean loss, one backward, Adam;
* ``ours_lora``: ``DPEngine`` over the peft model (the adapters' ``lora_A``/``lora_B`` are plain
  ``nn.Linear``: the engine's Linear rule; the frozen base is not hooked);
* ``opacus_lora``: Opacus 1.6 ``make_private(grad_sample_mode="ghost")`` over the peft model;
  where ghost clipping refuses (at ``make_private`` or in the first step) the default hooks mode
  (per-sample gradients of the adapters) runs instead and the row's label says so.

LoRA rows compare with ``non_private_lora``, the others with ``non_private``; the targets for a
real model are tighter (``MODEL_TARGET_*``, ``LORA_TARGET_RATIO``; full fine-tuning's time bound
is 1.25x on CPU, 1.2x on CUDA). ``naive_vmap`` keeps its
memory rule (SmolLM2 at 32 x 128 needs ~48 GiB of per-sample gradients: skipped on most hosts);
the norm check then runs on a tiny random 2-layer Llama of the model's shape (vocabulary cut to
``TINY_VOCAB``), full fine-tuning (tied: Phantom Clipping) and LoRA (``lora_B`` drawn at random
so both factors have gradients), in the main process.

Writes ``train-[<model>-]<device>[-bf16]-<date>.{md,json,png}`` into ``--out`` (``<model>``:
``smollm2`` or the directory's name). Run as ``python -m vllm_dp_plugin.benchmarks.train``
(``--quick``: a toy model, seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_device_arg,
    add_out_arg,
    add_quick_arg,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import (
    default_device,
    device_label,
    environment,
    free_bytes,
    loadavg,
)
from vllm_dp_plugin.benchmarks.lib.measure import PeakMemory, timed
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import (
    pyplot,
    save_figure,
    suffixed,
    write_json,
    write_text,
)
from vllm_dp_plugin.benchmarks.lib.scenarios import has_weights, load_causal_lm, resolve_model
from vllm_dp_plugin.trainer.engine import DPConfig, DPEngine, causal_lm_per_sample_loss
from vllm_dp_plugin.trainer.lora import LoraSpec, apply_lora

TARGET_TIME_RATIO = 1.5  # ours <= 1.5x the non-private step time
TARGET_MEMORY_RATIO = 1.3  # ours <= 1.3x the non-private peak memory
MODEL_TARGET_TIME_RATIO = {"cpu": 1.25, "cuda": 1.2}  # --model: ours (full fine-tuning) vs non-private step time
MODEL_TARGET_MEMORY_RATIO = 1.2  # --model: ours <= 1.2x the non-private peak memory
LORA_TARGET_RATIO = 1.15  # --model: ours LoRA <= 1.15x non-private LoRA, step time and peak memory
MODEL_BATCH = {"cpu": (32, 128), "cuda": (32, 512)}  # --model default (batch, seq len) by device type
QUICK_MODEL_BATCH = (2, 16)  # --model with --quick
TINY_VOCAB, TINY_BATCH, TINY_SEQ = 1024, 4, 32  # --model norm check: 2-layer Llama of the model's shape
# float32 per-sample norms, the two sides reducing in different orders: the longest reduction is a
# dot product over the vocabulary (K ~ 5e4 terms), relative rounding error ~ sqrt(K) * 6e-8 ~ 1.3e-5
# (random-walk bound; positive sums of such terms do not amplify it). Measured: <= 3e-7.
NORM_RTOL = 2e-5
NAIVE_COPIES = 3  # per-sample gradients, their clipped/squared temporaries, vmap's own buffers
PRELOAD = ["vllm_dp_plugin.benchmarks.train", "transformers.models.gpt2.modeling_gpt2", "opacus"]
MODEL_PRELOAD = ["transformers.models.llama.modeling_llama", "peft"]


@dataclass(frozen=True)
class ModelSize:
    """GPT-2 shape (or a ``--model``'s, named by ``family``) and batch: ``batch`` sequences of
    ``seq_len`` tokens."""

    vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    seq_len: int
    batch: int
    family: str = "GPT-2"

    def describe(self) -> str:
        return (
            f"{self.family} vocab {self.vocab}, n_embd {self.n_embd}, {self.n_layer} layers, {self.n_head} heads; "
            f"batch {self.batch} x seq {self.seq_len}"
        )


PRESETS = {
    "toy": ModelSize(vocab=1000, n_embd=32, n_layer=1, n_head=2, seq_len=16, batch=4),
    "tiny": ModelSize(vocab=50257, n_embd=128, n_layer=2, n_head=2, seq_len=128, batch=16),
    "gpt2-small": ModelSize(vocab=50257, n_embd=768, n_layer=12, n_head=12, seq_len=512, batch=16),
}


@dataclass(frozen=True)
class BenchSpec:
    """Everything one method's run needs (picklable: it travels to the worker process)."""

    size: ModelSize
    device: str
    autocast: str  # "none" or "bf16" (forward and loss under torch.autocast)
    warmup: int
    steps: int
    seed: int
    noise_multiplier: float
    clip_norm: float
    lr: float
    model: str = ""  # a Hugging Face causal LM directory (--model) instead of the random GPT-2 preset
    lora: LoraSpec = field(default_factory=LoraSpec)  # the LoRA rows' adapters (--model only)


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


# ---------------------------------------------------------------------------------- model, data


@dataclass(frozen=True)
class Batch:
    """``ids, positions: [B, T]`` int64 on the device (positions contiguous: Opacus' embedding
    norm rule views them flat); the labels are the ids (``causal_lm_per_sample_loss`` shifts
    them). No padding, so no attention mask."""

    ids: torch.Tensor
    positions: torch.Tensor

    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "position_ids": self.positions}

    def shifted_labels(self) -> torch.Tensor:
        """``[B, T]``: position t predicts ``ids[t + 1]``; the last position has no label (-100)."""
        return F.pad(self.ids[:, 1:], (0, 1), value=-100)


def build_model(size: ModelSize, tied: bool, seed: int, device: torch.device) -> nn.Module:
    """A randomly initialised (seeded: equal weights in every worker) GPT-2 LM in train mode,
    dropout off (so every method computes the same function)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=size.vocab, n_positions=size.seq_len, n_embd=size.n_embd, n_layer=size.n_layer,
        n_head=size.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=tied, use_cache=False, bos_token_id=size.vocab - 1, eos_token_id=size.vocab - 1,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(device).train()


def load_model(path: str, tied: bool, seed: int, device: torch.device) -> nn.Module:
    """A Hugging Face causal LM directory's pretrained weights (random ones drawn from ``seed``
    for a config-only directory), float32, in train mode (no KV cache). ``tied=False`` gives a
    tied output head its own copy of the embedding (the same function, an untied model); an
    untied model is returned as it is either way."""
    model = load_causal_lm(path, dtype=torch.float32, seed=seed)
    model.config.use_cache = False
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not tied and head is not None and head.weight is embedding.weight:
        model.config.tie_word_embeddings = False  # keeps later tie_weights() calls from re-tying
        head.weight = nn.Parameter(head.weight.detach().clone())
    return model.to(device).train()


def make_model(spec: BenchSpec, method: Method, device: torch.device) -> nn.Module:
    """The method's model: the preset's random GPT-2 or ``spec.model``'s weights, wrapped by
    ``apply_lora(spec.lora)`` for a LoRA method (fresh adapters, ``lora_B = 0``, base frozen)."""
    if spec.model:
        model = load_model(spec.model, method.tied, spec.seed, device)
    else:
        model = build_model(spec.size, method.tied, spec.seed, device)
    if method.lora:
        torch.manual_seed(spec.seed)  # the adapters' initialisation
        model = apply_lora(model, spec.lora).to(device)
    return model


def synthetic_batch(size: ModelSize, seed: int, device: torch.device) -> Batch:
    """Seeded uniform token ids ``[B, T]``, positions ``0..T-1`` per row, no padding."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq_len), generator=gen)
    positions = torch.arange(size.seq_len).repeat(size.batch, 1)
    return Batch(ids.to(device), positions.to(device))


def unique_parameter_count(model: nn.Module) -> int:
    """Trainable scalars, a tied weight counted once."""
    return sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad)


def _autocast(spec: BenchSpec):
    if spec.autocast == "bf16":
        return torch.autocast(torch.device(spec.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by name, a tied weight once (LoRA: the adapters only)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _adam(model: nn.Module, spec: BenchSpec) -> torch.optim.Adam:
    return torch.optim.Adam(_trainable(model).values(), lr=spec.lr)


def _per_sample_loss(model: nn.Module, batch: Batch, spec: BenchSpec) -> torch.Tensor:
    """``[B]`` mean next-token cross-entropy per sequence (float32 or wider)."""
    with _autocast(spec):
        logits = model(**batch.inputs()).logits
        return causal_lm_per_sample_loss(logits, batch.ids)


# ---------------------------------------------------------------------------------- methods


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


# ---------------------------------------------------------------------------------- measurement


def _error_text(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"error: {type(err).__name__}: {first}"[:300]


def measure_method(name: str, spec: BenchSpec) -> dict:
    """Build the model and method ``name``, run ``spec.warmup`` + ``spec.steps`` steps and return
    ``{"status": "ok", "step_s", "times_s", "peak_bytes", ...}``, or ``{"status": reason}`` for a
    method that is skipped or raises (the error text is kept, not hidden)."""
    method, device = METHODS[name], torch.device(spec.device)
    model = make_model(spec, method, device)
    batch = synthetic_batch(spec.size, spec.seed, device)
    params = unique_parameter_count(model)
    param_bytes = sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))
    base = {"method": name, "parameters": params}
    if method.skip_reason and (reason := method.skip_reason(spec.size, params, device)):
        return {**base, "status": reason}
    memory = PeakMemory(device).start()
    times, first_norms, step = [], None, None
    try:
        step = method.build(model, batch, spec)
        for i in range(spec.warmup + spec.steps):
            seconds, norms = timed(step, device)
            if i >= spec.warmup:
                times.append(seconds)
            if i == 0 and norms is not None:
                first_norms = norms.detach().double().cpu().tolist()
    except Exception as err:  # noqa: BLE001 - reported in the table: the point is to show what fails
        return {**base, **getattr(step, "row", {}), "status": _error_text(err)}
    memory.stop()
    return {
        **base,
        **getattr(step, "row", {}),
        "status": "ok",
        "step_s": statistics.median(times),
        "times_s": times,
        "peak_bytes": param_bytes + memory.peak,
        "param_bytes": param_bytes,
        "memory_measure": memory.measure,
        "first_norms": first_norms,
    }


def _worker(name: str, spec: BenchSpec, conn) -> None:
    try:
        conn.send(measure_method(name, spec))
    except BaseException as err:  # noqa: BLE001 - e.g. MemoryError during set-up
        conn.send({"method": name, "status": _error_text(err)})
    finally:
        conn.close()


def run_isolated(name: str, spec: BenchSpec, timeout: float) -> dict:
    """``measure_method`` in a fresh process forked from the forkserver (see the docstring);
    a worker that dies (e.g. killed for memory) or exceeds ``timeout`` seconds is an error row."""
    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(name, spec, send), daemon=True)
    proc.start()
    send.close()
    answered = receive.poll(timeout)
    try:
        result = receive.recv() if answered else None
    except EOFError:  # the worker died before sending
        result = None
    if result is None and proc.is_alive():
        proc.kill()
    proc.join()
    if result is None:
        why = (f"worker died without a result (exit code {proc.exitcode}; out of memory?)" if answered
               else f"no result within {timeout:.0f} s")
        result = {"method": name, "status": f"error: {why}"}
    return {"label": METHODS[name].label, "tied": METHODS[name].tied, "lora": METHODS[name].lora, **result}


# ---------------------------------------------------------------------------------- verdicts


def _rows_by_method(rows: list[dict]) -> dict[str, dict]:
    return {r["method"]: r for r in rows}


def add_ratios(rows: list[dict]) -> None:
    """``time_ratio`` and ``memory_ratio`` vs the row's baseline (``non_private``; LoRA rows:
    ``non_private_lora``), where both ran."""
    by = _rows_by_method(rows)
    for row in rows:
        base = by.get(METHODS[row["method"]].baseline, {})
        if row["status"] == "ok" and base.get("status") == "ok":
            row["time_ratio"] = row["step_s"] / base["step_s"]
            row["memory_ratio"] = row["peak_bytes"] / base["peak_bytes"]


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def targets(rows: list[dict], real_model: bool = False, device_type: str = "cpu") -> list[dict]:
    """The task's targets as ``{"target", "measured", "result"}`` (result PASS, FAIL or n/a):
    the GPT-2 presets' bounds, or (``real_model``, ``--model``) the tighter full fine-tuning
    bounds (time: ``device_type``'s) plus LoRA's."""
    by = _rows_by_method(rows)
    bounds = [("ours", "ours", "non-private", TARGET_TIME_RATIO, TARGET_MEMORY_RATIO)]
    faster = [
        ("ours", "opacus_ghost", "ours (tied) faster than Opacus ghost clipping, tied embeddings"),
        ("ours", "opacus_ghost_untied", "ours (tied) faster than Opacus ghost clipping, untied head (its only runnable model)"),
    ]
    if real_model:
        bounds = [
            ("ours", "ours", "non-private", MODEL_TARGET_TIME_RATIO[device_type], MODEL_TARGET_MEMORY_RATIO),
            ("ours_lora", "ours LoRA", "non-private LoRA", LORA_TARGET_RATIO, LORA_TARGET_RATIO),
        ]
        faster.append(("ours_lora", "opacus_lora", "ours LoRA faster than Opacus LoRA"))
    out = []
    for name, who, baseline, time_bound, memory_bound in bounds:
        row = by.get(name, {})
        for key, bound, what in (("time_ratio", time_bound, "step time"), ("memory_ratio", memory_bound, "peak memory")):
            target = f"{who} {what} <= {bound}x {baseline}"
            if key in row:
                out.append({"target": target, "measured": f"{row[key]:.2f}x", "result": _verdict(row[key] <= bound)})
            else:
                out.append({"target": target, "measured": "not measured", "result": "n/a"})
    for name, other_name, target in faster:
        ours, other = by.get(name, {}), by.get(other_name, {})
        if ours.get("status") == "ok" and other.get("status") == "ok":
            ratio = other["step_s"] / ours["step_s"]
            mode = f" ({other['opacus_mode']} mode)" if "opacus_mode" in other else ""
            out.append({"target": target, "measured": f"Opacus{mode} {ratio:.2f}x our step time",
                        "result": _verdict(ratio > 1)})
        else:
            failed = ours if ours.get("status") != "ok" else other
            out.append({"target": target, "measured": failed.get("status", "not run"), "result": "n/a"})
    return out


def norm_check(rows: list[dict], autocast: str) -> dict:
    """Our first-batch per-sample norms vs ``torch.func``'s (max relative difference); a verdict
    only in float32 (under bf16 autocast the two round differently)."""
    by = _rows_by_method(rows)
    ours, naive = by.get("ours", {}).get("first_norms"), by.get("naive_vmap", {}).get("first_norms")
    if not ours or not naive:
        return {"result": "n/a", "text": "not checked: the ours or naive_vmap run has no norms"}
    rel = max(abs(a - b) / b for a, b in zip(ours, naive, strict=True))
    result = "n/a" if autocast != "none" else _verdict(rel <= NORM_RTOL)
    return {
        "result": result,
        "max_rel_diff": rel,
        "text": f"max |n_ours - n_func| / n_func over the {len(ours)} samples of the first batch: {rel:.2e} "
        + (f"(float32 tolerance {NORM_RTOL:g})" if autocast == "none" else "(no verdict under bf16 autocast)"),
    }


def tiny_llama_norm_check(spec: BenchSpec) -> dict:
    """``--model``: our first-batch per-sample norms vs ``torch.func``'s on a random 2-layer model
    of ``spec.model``'s configuration (vocabulary cut to ``TINY_VOCAB``; batch ``TINY_BATCH`` x
    ``TINY_SEQ``; float32 without autocast), full fine-tuning (a tied model: Phantom Clipping) and
    LoRA (``spec.lora``, ``lora_B`` drawn at random: at its zero start ``lora_A`` would have no
    gradient to check). Each side gets its own copy of the same seeded weights; a run that raises
    is reported (result n/a), not hidden."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(spec.device)
    config = AutoConfig.from_pretrained(spec.model, num_hidden_layers=2, use_cache=False)
    config.vocab_size = min(config.vocab_size, TINY_VOCAB)
    if (getattr(config, "pad_token_id", None) or 0) >= config.vocab_size:
        config.pad_token_id = None
    size = dataclasses.replace(spec.size, vocab=config.vocab_size, n_layer=2,
                               batch=min(spec.size.batch, TINY_BATCH), seq_len=min(spec.size.seq_len, TINY_SEQ))
    tiny = dataclasses.replace(spec, size=size, autocast="none")
    batch = synthetic_batch(size, spec.seed, device)

    def model(lora: bool) -> nn.Module:
        torch.manual_seed(spec.seed)
        built = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
        if lora:
            built = apply_lora(built, spec.lora).to(device)
            draw = torch.Generator().manual_seed(spec.seed + 2)
            with torch.no_grad():
                for name, p in built.named_parameters():
                    if "lora_B" in name:
                        p.copy_(0.02 * torch.randn(p.shape, generator=draw))
        return built

    shape = (f"{config.model_type} (hidden {config.hidden_size}, vocab {config.vocab_size}, "
             f"{'tied' if getattr(config, 'tie_word_embeddings', False) else 'untied'}); batch {size.batch} x {size.seq_len}")
    diffs = {}
    try:
        for kind in ("full", "lora"):
            ours = ours_step(model(kind == "lora"), batch, tiny)().double().cpu()
            func = naive_vmap_step(model(kind == "lora"), batch, tiny)().double().cpu()
            diffs[kind] = float(((ours - func).abs() / func).max())
    except Exception as err:  # noqa: BLE001 - reported: the check did not run
        return {"result": "n/a", "text": f"not checked on a random 2-layer {shape}: {_error_text(err)}"}
    worst = max(diffs.values())
    return {
        "result": _verdict(worst <= NORM_RTOL),
        "max_rel_diff": worst,
        **{f"max_rel_diff_{kind}": d for kind, d in diffs.items()},
        "text": f"random 2-layer {shape}: max |n_ours - n_func| / n_func: full fine-tuning {diffs['full']:.2e}, LoRA {diffs['lora']:.2e} "
        f"(float32 tolerance {NORM_RTOL:g})",
    }


# ---------------------------------------------------------------------------------- output


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _ratio(row: dict, key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def _setup_text(meta: dict) -> str:
    env = meta["env"]
    gpu = f", GPU {env['gpu']} (CUDA {env['cuda']})" if "gpu" in env else ""
    params = f"{meta['parameters']:,}" if meta["parameters"] else "?"
    if meta.get("model_path"):
        weights = (f"Pretrained weights from `{meta['model_path']}`" if not meta.get("random_weights") else
                   f"Random weights (seed {meta['seed']}) of `{meta['model_path']}`'s architecture (its config.json "
                   "alone: the times do not depend on the values)")
        data = f"{weights}, float32; a fixed batch of seeded uniform token ids from its vocabulary, `position_ids [B, T]`"
    else:
        data = "Random weights; synthetic seeded batch, fixed"
    lora = ""
    if meta.get("lora_parameters"):
        spec = meta["lora"]
        lora = (f" LoRA rows: `peft` adapters r = {spec['r']}, alpha = {spec['alpha']:g} on "
                f"{', '.join(spec['target_modules'])} ({meta['lora_parameters']:,} trainable parameters, the base "
                "frozen); their ratios are against non-private LoRA.")
    return (
        f"torch {env['torch']}, transformers {env['transformers']}, opacus {env['opacus']}"
        + (f", peft {env['peft']}" if env.get("peft") else "")
        + f", python {env['python']}, {env['torch_threads']} threads{gpu}.\n\n"
        f"Model: {meta['model']} ({params} parameters, the tied weight once). {data}; "
        f"DP methods: flat clipping C = {meta['clip_norm']}, noise multiplier {meta['noise_multiplier']}, Adam. "
        f"Step time: median of {meta['steps']} steps after {meta['warmup']} warm-up steps. Peak memory: "
        "parameters + the most the steps allocate above the level before the first step "
        f"({meta['memory_measure']}); each method in its own process.{lora}"
    )


def render_markdown(results: dict) -> str:
    meta, rows = results["meta"], results["methods"]
    autocast = " (bf16 autocast)" if meta["autocast"] == "bf16" else ""
    model = f", {meta['model_name']}" if meta.get("model_name") else ""
    lines = [
        f"# DP training step{model}: {meta['device']}{autocast} ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        _setup_text(meta),
        "",
        "| method | step time (ms) | min-max (ms) | peak memory (MiB) | vs non-private: time | memory | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] == "ok":
            lines.append(
                f"| {r['label']} | {r['step_s'] * 1e3:,.0f} | {min(r['times_s']) * 1e3:,.0f}-"
                f"{max(r['times_s']) * 1e3:,.0f} | {_mib(r['peak_bytes'])} | {_ratio(r, 'time_ratio')} | "
                f"{_ratio(r, 'memory_ratio')} | ok |"
            )
        else:
            lines.append(f"| {r['label']} | - | - | - | - | - | {r['status'].replace('|', '/')} |")
    lines += ["", "## Targets", "", "| target | measured | result |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured'].replace('|', '/')} | {t['result']} |" for t in results["targets"]]
    check = results["norm_check"]
    lines += ["", f"Per-sample norm check (ours vs torch.func, first batch): **{check['result']}**: {check['text']}."]
    if "tiny_norm_check" in results:
        tiny = results["tiny_norm_check"]
        lines += ["", f"Per-sample norm check on a tiny Llama (ours vs torch.func): **{tiny['result']}**: {tiny['text']}."]
    lines += [
        "",
        f"Total wall time {meta['wall_s']:.0f} s; host load average (1/5/15 min) at start "
        + f"{meta['loadavg_start']}, at end {meta['loadavg_end']} (a shared box: compare rows of one run).",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Step time and peak memory bars per method (methods that did not run are labelled)."""
    plt = pyplot()
    rows = results["methods"]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, scale, unit in ((axes[0], "step_s", 1e3, "step time (ms)"), (axes[1], "peak_bytes", 2**-20, "peak memory (MiB)")):
        values = [r[key] * scale if r["status"] == "ok" else 0.0 for r in rows]
        colors = ["tab:gray" if n.startswith("non_private") else "tab:blue" for n in names]
        bars = ax.bar(range(len(rows)), values, color=colors)
        for bar, row in zip(bars, rows, strict=True):
            if row["status"] != "ok":
                text = "skipped" if row["status"].startswith("skipped") else "failed"
                ax.text(bar.get_x() + bar.get_width() / 2, 0, text, ha="center", va="bottom", rotation=90, fontsize=8)
        ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(unit)
    fig.suptitle(f"DP training step, {results['meta']['model']} ({results['meta']['device']})", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


# ---------------------------------------------------------------------------------- main


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    add_device_arg(p, default_device(), "cpu or cuda[:i]")
    add_out_arg(p)
    add_quick_arg(p, "toy model, 1 + 2 steps (seconds; for tests); with --model: batch 2 x 16")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: gpt2-small on CUDA, tiny on CPU)")
    p.add_argument(
        "--model", default="",
        help="a real model instead of a preset: 'smollm2' (SmolLM2-135M-Instruct, .models/smollm2-135m-instruct, "
        "imported on first use) or a Hugging Face Llama directory; pretrained float32 weights, adds the LoRA rows "
        f"(default batch {MODEL_BATCH['cpu'][0]} x {MODEL_BATCH['cpu'][1]} on CPU, "
        f"{MODEL_BATCH['cuda'][0]} x {MODEL_BATCH['cuda'][1]} on CUDA)",
    )
    p.add_argument("--batch", type=int, help="override the preset's (or --model's default) batch size")
    p.add_argument("--seq-len", type=int, help="override the preset's (or --model's default) sequence length")
    p.add_argument("--autocast", choices=("none", "bf16"), default="none", help="forward + loss under bf16 autocast")
    p.add_argument(
        "--methods",
        help=f"comma list of {', '.join(METHODS)} (default: all; without --model those without LoRA)",
    )
    p.add_argument("--lora-r", type=int, default=LoraSpec.r, help=f"LoRA rank (default {LoraSpec.r})")
    p.add_argument("--lora-alpha", type=float, default=LoraSpec.alpha, help=f"LoRA alpha (default {LoraSpec.alpha:g})")
    p.add_argument("--warmup", type=int, help="untimed steps (default 1 on CPU, 3 on CUDA)")
    p.add_argument("--steps", type=int, help="timed steps (default 5 on CPU, 10 on CUDA; quick 2)")
    p.add_argument("--noise-multiplier", type=float, default=1.0, help="DP noise multiplier (default 1)")
    p.add_argument("--clip-norm", type=float, default=1.0, help="per-sample clipping norm C (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=0, help="weights, data and noise seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per method before it is an error row")
    add_date_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def build_parser(prog: str = "vllm-dp bench train") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog,
        description="DP training step time and peak memory: non-private, ours, Opacus ghost clipping, torch.func; "
        "with --model (e.g. smollm2) full and LoRA fine-tuning of a real model.",
    ))


def _model_size(path: str, batch: int, seq_len: int) -> ModelSize:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    tied = "tied" if getattr(config, "tie_word_embeddings", False) else "untied"
    weights = "pretrained" if has_weights(path) else "random weights"
    return ModelSize(
        vocab=config.vocab_size, n_embd=config.hidden_size, n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads, seq_len=seq_len, batch=batch,
        family=f"{Path(path).name} ({config.model_type}, {tied} embeddings, {weights})",
    )


def _spec_from_args(args: argparse.Namespace, model: str = "") -> BenchSpec:
    """Preset (or ``model``'s directory), overrides and per-device step counts; ValueError for
    bad sizes or methods."""
    cuda = torch.device(args.device).type == "cuda"
    if model:
        if args.preset:
            raise ValueError("--model and --preset exclude each other")
        batch, seq_len = QUICK_MODEL_BATCH if args.quick else MODEL_BATCH["cuda" if cuda else "cpu"]
        size = _model_size(model, batch, seq_len)
    else:
        size = PRESETS["toy" if args.quick else args.preset or ("gpt2-small" if cuda else "tiny")]
    size = dataclasses.replace(
        size,
        batch=size.batch if args.batch is None else args.batch,
        seq_len=size.seq_len if args.seq_len is None else args.seq_len,
    )
    if size.batch < 1 or size.seq_len < 2:
        raise ValueError(f"need batch >= 1 and seq-len >= 2, got {size.batch} and {size.seq_len}")
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    steps = args.steps if args.steps is not None else (2 if args.quick else 10 if cuda else 5)
    if warmup < 0 or steps < 1:
        raise ValueError(f"need --warmup >= 0 and --steps >= 1, got {warmup} and {steps}")
    return BenchSpec(
        size=size, device=args.device, autocast=args.autocast, warmup=warmup, steps=steps, seed=args.seed,
        noise_multiplier=args.noise_multiplier, clip_norm=args.clip_norm, lr=args.lr,
        model=model, lora=LoraSpec(r=args.lora_r, alpha=args.lora_alpha),
    )


def _methods_from_args(text: str | None, real_model: bool = False) -> list[str]:
    if text is None:
        return list(METHODS) if real_model else PRESET_METHODS
    names = [m for m in text.split(",") if m]
    unknown = sorted(set(names) - set(METHODS))
    if unknown or not names:
        raise ValueError(f"unknown or no methods {unknown}; choose from {', '.join(METHODS)}")
    lora = [m for m in names if METHODS[m].lora]
    if lora and not real_model:
        raise ValueError(f"{', '.join(lora)} need --model (LoRA adapts a Llama's nn.Linear projections)")
    return names


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench train ...``)."""
    args, argv = parse(args, build_parser)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    try:
        model_name, model = resolve_model(args.model) if args.model else ("", "")
        spec, names = _spec_from_args(args, model), _methods_from_args(args.methods, bool(model))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    date = today(args.date)
    log = logger(not args.quiet)
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD + (MODEL_PRELOAD if model else []))

    load_start, start = loadavg(), time.perf_counter()
    log(f"== {spec.size.describe()} on {args.device}, autocast {spec.autocast}")
    rows = []
    for name in names:
        row = run_isolated(name, spec, args.timeout)
        rows.append(row)
        log(f"  {name}: " + (f"{row['step_s'] * 1e3:,.0f} ms/step, peak {_mib(row['peak_bytes'])} MiB"
                             if row["status"] == "ok" else row["status"]))
    add_ratios(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    results = {
        "methods": rows,
        "targets": targets(rows, real_model=bool(model), device_type=device.type),
        "norm_check": norm_check(rows, spec.autocast),
        **({"tiny_norm_check": tiny_llama_norm_check(spec)} if model else {}),
        "meta": {
            "device": device_label(device, short=device.type != "cuda"),  # cpu | nvidia-h200
            "date": date,
            "command": " ".join(["python -m vllm_dp_plugin.benchmarks.train", *(argv or [])]),
            "env": environment(device, packages=("transformers", "opacus") + (("peft",) if model else ())),
            "model": spec.size.describe(),
            "parameters": next((r["parameters"] for r in rows if "parameters" in r and r["tied"] and not r["lora"]), None),
            "lora_parameters": next((r["parameters"] for r in rows if "parameters" in r and r["lora"]), None),
            **{k: v for k, v in dataclasses.asdict(spec).items() if k not in ("size", "model")},
            "model_path": model,
            "random_weights": bool(model) and not has_weights(model),
            "model_name": model_name,
            "size": dataclasses.asdict(spec.size),
            "memory_measure": ok[0]["memory_measure"] if ok else "-",
            "wall_s": time.perf_counter() - start,
            "loadavg_start": load_start,
            "loadavg_end": loadavg(),
        },
    }
    suffix = "-bf16" if spec.autocast == "bf16" else ""
    prefix = f"train-{model_name}-" if model_name else "train-"
    stem = Path(args.out) / f"{prefix}{results['meta']['device']}{suffix}-{date}"
    write_json(suffixed(stem, ".json"), results, indent=2, newline=True)
    write_text(suffixed(stem, ".md"), render_markdown(results))
    plot(results, suffixed(stem, ".png"))
    log(f"norm check: {results['norm_check']['result']}: {results['norm_check']['text']}")
    if model:
        log(f"tiny-Llama norm check: {results['tiny_norm_check']['result']}: {results['tiny_norm_check']['text']}")
    for t in results["targets"]:
        log(f"  {t['result']}: {t['target']} ({t['measured']}; {results['meta']['device']}, autocast {spec.autocast})")
    log(f"wrote {stem}.md, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
