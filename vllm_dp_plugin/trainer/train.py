"""``vllm-dp train --config train.yaml``: DP fine-tuning of a Hugging Face causal LM whose output
directory ``vllm-dp serve`` serves directly.

The privacy unit is one training record: a window of at most ``seq_len`` tokens cut from one
document (a document longer than that spans several records; protecting whole documents needs
group privacy, i.e. a budget scaled by records per document). Steps sample records by Poisson
sampling at ``q = batch_size / N`` for ``ceil(epochs / q)`` steps; the noise multiplier is the
smallest meeting (epsilon, delta) under the configured accountant; every step (an empty batch
included) adds noise once. The training loss in the progress bar is computed on private records
and is not privatised: it is for the operator, not for release. The released artefact is the
model directory (weights, tokenizer) and ``dp_training.json`` (the guarantee).

``secure_mode: true`` releases each step's noisy clipped sum on a grid with exact discrete
Gaussian noise (``engine``: the float release leaks through its low-order bits into every
weight), accounted with Renyi DP at integer orders (``rdp_integer``); it needs
``accountant: rdp`` and no Re-Attention (whose token-frequency histogram is a float release).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..privacy.mechanisms import Mechanism, gaussian_from_noise_multiplier
from ..privacy.noise import GridGaussian
from ..privacy.validation import check_count, check_delta, check_epsilon, check_positive
from .accounting import TrainingAccountant, noise_multiplier_for
from .engine import (
    DPConfig,
    DPEngine,
    causal_lm_per_sample_loss,
    noise_generator,
    warmup_linear_decay_scheduler,
)
from .lora import LoraSpec, apply_lora, merged, save_adapter
from .reattention import (
    ReAttentionConfig,
    apply_reattention,
    dp_sequence_frequencies,
    remove_reattention,
)
from .sampling import PoissonSampler, virtual_batches

CHECKPOINT = "checkpoint.pt"
ADAPTER = "adapter"
REPORT = "dp_training.json"
PUBLIC_CORPUS = "pydoc_data.topics"


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``model``: a Hugging Face model directory (``vllm-dp make-demo-model``
    builds the tiny demo Llama); ``data``: ``pydoc_data.topics`` (public text bundled with
    Python, for demos) or a UTF-8 text file whose blank-line-separated paragraphs are documents."""

    model: str
    output_dir: str
    data: str = PUBLIC_CORPUS
    seq_len: int = 64
    epsilon: float = 8.0
    delta: float | None = None  # default 1 / (2 N), N = number of records (fastDP's default)
    epochs: float = 1.0
    batch_size: int = 64  # expected logical batch B = q N
    max_physical_batch: int = 32  # records per forward (memory), accumulated into one step
    optimizer: Literal["adam", "sgd"] = "adam"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.2
    clip_norm: float = 1.0
    clipping: Literal["automatic", "flat"] = "automatic"
    accountant: Literal["rdp", "pld"] = "rdp"
    seed: int | None = None  # None: sampling and noise from OS entropy (deployment)
    reattention: bool = False  # DPFormer Re-Attention while training (dropped when served)
    reattention_lambda: float = 1.0  # lambda: scales every parameter variance (1 = literal)
    frequency_noise: float = 20.0  # noise multiplier of the DP histogram of p_v (Re-Attention only)
    checkpoint_every: int = 50  # steps
    secure_mode: bool = False  # grid + discrete Gaussian release of each step (module docstring)
    lora: LoraSpec | None = None  # {r, alpha, target_modules, dropout}: DP LoRA instead of full fine-tuning
    private: bool = True  # false: the NON-private baseline (same sampler and schedule, no clipping or noise)

    def __post_init__(self) -> None:
        if self.lora is not None:
            object.__setattr__(self, "lora", LoraSpec.parse(self.lora))
        if not isinstance(self.private, bool):
            raise ValueError(f"private must be true or false, got {self.private!r}")  # noqa: TRY004
        if not self.private and (self.secure_mode or self.reattention):
            raise ValueError("private: false (the non-private baseline) excludes secure_mode and reattention")
        check_epsilon(self.epsilon, "epsilon")
        if self.delta is not None:
            check_delta(self.delta, "delta")
        check_positive(self.epochs, "epochs")
        check_positive(self.learning_rate, "learning_rate")
        check_positive(self.frequency_noise, "frequency_noise")
        for name in ("seq_len", "batch_size", "max_physical_batch", "checkpoint_every"):
            check_count(getattr(self, name), name)
        if self.seq_len < 2:
            raise ValueError("seq_len must be >= 2 (a record needs a next token to predict)")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if not isinstance(self.secure_mode, bool):
            raise ValueError(f"secure_mode must be true or false, got {self.secure_mode!r}")  # noqa: TRY004
        if self.secure_mode and self.accountant != "rdp":
            raise ValueError(
                "secure_mode: true needs accountant: rdp (its discrete Gaussian is accounted at integer "
                f"Renyi orders; the continuous Gaussian's PLD does not bound it), got {self.accountant!r}"
            )
        if self.secure_mode and self.reattention:
            raise ValueError(
                "secure_mode: true does not cover reattention: true (its token-frequency histogram is a "
                "float Gaussian release that training uses); set one of them to false"
            )

    @staticmethod
    def from_file(path: str | os.PathLike) -> TrainConfig:
        """Parse a YAML (or JSON) file; unknown keys are an error naming them."""
        import yaml

        raw = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown training option(s) {unknown}; known: {sorted(known)}")
        return TrainConfig(**raw)


@dataclass(frozen=True)
class Records:
    """``ids, labels: [N, seq_len]`` (labels -100 on padding), ``mask: [N, seq_len]``."""

    ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Model inputs of records ``index``; ``position_ids [b, T]`` keep every hooked module
        batch-first (the DP engine's requirement)."""
        ids = self.ids[index]
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return {"input_ids": ids, "attention_mask": self.mask[index], "position_ids": positions}


def documents(source: str) -> list[str]:
    """The documents of ``source`` (see ``TrainConfig``)."""
    if source == PUBLIC_CORPUS:
        from ..demo import public_corpus

        return public_corpus()
    text = Path(source).read_text(encoding="utf-8")
    return [doc.strip() for doc in text.split("\n\n") if doc.strip()]


def make_records(docs: list[str], tokenizer, seq_len: int) -> Records:
    """Each document as ``[bos] + tokens`` cut into windows of ``seq_len``; windows of fewer than
    2 tokens are dropped (nothing to predict); the rest are right-padded."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    windows = []
    for doc in docs:
        ids = bos + tokenizer.encode(doc, add_special_tokens=False)
        windows += [ids[i : i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i : i + seq_len]) >= 2]
    if not windows:
        raise ValueError("the training data has no record of >= 2 tokens")
    ids = torch.full((len(windows), seq_len), pad, dtype=torch.long)
    mask = torch.zeros((len(windows), seq_len), dtype=torch.long)
    for r, window in enumerate(windows):
        ids[r, : len(window)] = torch.tensor(window)
        mask[r, : len(window)] = 1
    return Records(ids, ids.masked_fill(mask == 0, -100), mask)


@dataclass(frozen=True)
class Plan:
    """What the run will spend: ``sample_rate`` q, ``steps``, ``noise_multiplier`` sigma and
    ``delta`` of DP-SGD under ``accountant`` (``rdp_integer`` in secure mode), and with
    Re-Attention the ``frequencies`` histogram's mechanism."""

    records: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    accountant: str
    frequencies: Mechanism | None = None


def plan_run(config: TrainConfig, records: int) -> Plan:
    """q = B / N, steps = ceil(epochs / q), sigma from the accountant. The budget (epsilon,
    delta) is the whole run's: with Re-Attention the p_v histogram takes its epsilon at delta / 2
    first and DP-SGD gets the rest (basic composition)."""
    if config.batch_size > records:
        raise ValueError(f"batch_size {config.batch_size} exceeds the {records} training records")
    rate = config.batch_size / records
    steps = math.ceil(config.epochs / rate)
    delta = config.delta if config.delta is not None else 1.0 / (2 * records)
    histogram = None
    if config.reattention:
        delta /= 2
        histogram = gaussian_from_noise_multiplier(math.sqrt(config.seq_len), config.frequency_noise, delta,
                                                   name="token frequency histogram")
        if histogram.epsilon >= config.epsilon:
            raise ValueError(f"the p_v histogram alone spends epsilon {histogram.epsilon:.3g} >= {config.epsilon}: "
                             "raise frequency_noise or epsilon")
    epsilon = config.epsilon - (histogram.epsilon if histogram else 0.0)
    accountant = "rdp_integer" if config.secure_mode else config.accountant
    if not config.private:
        return Plan(records, rate, steps, 0.0, delta, "none (not private)")
    sigma = noise_multiplier_for(epsilon, delta, rate, steps, accountant=accountant)
    return Plan(records, rate, steps, sigma, delta, accountant, histogram)


def train(config: TrainConfig, progress: bool = True, stop_after: int | None = None) -> dict:
    """Run (or resume from ``output_dir/checkpoint.pt``) ``config``; at the end export the model
    and return the privacy report (also written to ``output_dir/dp_training.json``).
    ``stop_after``: train at most that many steps in this call, then checkpoint and return
    ``{"stopped_at": step, "epsilon": spent so far}`` (a later call resumes)."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order RDP warnings

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
    model.config.use_cache = False
    data = make_records(documents(config.data), tokenizer, config.seq_len)
    plan = plan_run(config, len(data))
    if config.lora is not None:
        model = apply_lora(model, config.lora)

    engine = DPEngine(model, DPConfig(
        clip_norm=config.clip_norm, noise_multiplier=plan.noise_multiplier,
        expected_batch_size=config.batch_size, clipping=config.clipping, seed=config.seed,
        secure_mode=config.secure_mode,
    )) if config.private else None
    state = _checkpoint(out / CHECKPOINT, config)
    token_p = None
    if config.reattention:  # released once: a resumed run reuses the checkpoint's release
        token_p = state["token_p"] if state else _release_frequencies(config, plan, data, model)
        apply_reattention(model, ReAttentionConfig(sigma_dp=plan.noise_multiplier, batch_size=config.batch_size,
                                                   token_p=token_p, lam=config.reattention_lambda))
    optimizer = _optimizer(config, model)
    scheduler = warmup_linear_decay_scheduler(optimizer, plan.steps, config.warmup_frac)
    accountant = (TrainingAccountant(plan.noise_multiplier, plan.sample_rate, plan.delta, accountant=plan.accountant)
                  if config.private else None)
    sampler = PoissonSampler(len(data), plan.sample_rate, plan.steps, seed=config.seed)
    start = _restore(state, model, optimizer, scheduler, sampler, engine) if state else 0
    if start and accountant:
        accountant.step(start)

    model.train()
    bar = tqdm(total=plan.steps, initial=start, desc="DP training" if config.private else "NON-private training",
               unit="step", disable=not progress)
    spent = (lambda: accountant.epsilon()) if accountant else (lambda: math.inf)
    for step, batch in enumerate(sampler):
        if step < start:
            continue  # already trained (resume): the draw is replayed, not re-spent
        loss = _accumulate(model, engine, data, batch, config.max_physical_batch, config.batch_size)
        if engine:
            engine.finish_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if accountant:
            accountant.step()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", eps=f"{spent():.2f}", batch=len(batch))
        done = step + 1
        if done < plan.steps and (done % config.checkpoint_every == 0 or done - start == stop_after):
            _save(out / CHECKPOINT, config, model, optimizer, scheduler, sampler, engine, token_p, done)
        if done < plan.steps and done - start == stop_after:
            bar.close()
            return {"stopped_at": done, "steps": plan.steps, "epsilon": spent()}
    bar.close()
    if engine:
        engine.detach()
    if config.reattention:
        remove_reattention(model)  # served models run plain attention (docs/training.md)
    privacy = report(config, plan, accountant, engine.secure_release if engine else None)
    if config.lora is not None:
        save_adapter(model, out / ADAPTER)
        _write_report(out / ADAPTER, privacy)
        model = merged(model)
    return export(model, tokenizer, out, privacy)


def _release_frequencies(config: TrainConfig, plan: Plan, data: Records, model) -> torch.Tensor:
    """Re-Attention's token frequencies ``p_v: [V]``: the Gaussian histogram ``plan.frequencies``
    of the records (L2 sensitivity sqrt(seq_len)), released once per run."""
    ids = data.ids.masked_fill(data.mask == 0, 0)  # id 0 stands for padding here (not counted)
    released = dp_sequence_frequencies(ids, model.config.vocab_size, config.frequency_noise,
                                       noise_generator(config.seed, "token frequencies"), plan.delta, pad_id=0)
    if released.mechanism.epsilon != plan.frequencies.epsilon:
        raise RuntimeError("the p_v histogram differs from the one the plan accounted")
    return released.token_p


def _optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """DP-Adam (L2-style weight decay, as DPFormer's Adam) or DP-SGD over the trainable
    parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.learning_rate, weight_decay=config.weight_decay)


def _accumulate(model, engine: DPEngine | None, data: Records, batch: torch.Tensor, physical: int,
                expected_batch: int) -> float:
    """Forward + clipped backward of ``batch`` in physical chunks (no engine: the plain gradient of
    ``sum_i L_i / B``, the non-private baseline); mean loss (nan if empty)."""
    total, count = 0.0, 0
    for chunk in virtual_batches(batch, physical):
        inputs = data.batch(chunk)
        logits = model(**inputs).logits
        loss = causal_lm_per_sample_loss(logits, data.labels[chunk])
        if engine:
            engine.backward(loss)
        else:
            (loss.sum() / expected_batch).backward()
        total, count = total + float(loss.detach().sum()), count + len(chunk)
    return total / count if count else math.nan


def _save(path: Path, config, model, optimizer, scheduler, sampler: PoissonSampler, engine: DPEngine | None,
          token_p: torch.Tensor | None, step: int) -> None:
    """Atomic checkpoint. It holds the sampler seed and the noise generator's state, which must
    stay as secret as the data (with them, the noise of the remaining steps is predictable), and
    Re-Attention's released ``token_p`` (reused on resume, never released twice)."""
    state = {"config": dataclasses.asdict(config), "step": step, "sampler_seed": sampler.seed,
             "noise_state": engine.noise_state() if engine else None, "token_p": token_p,
             "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _checkpoint(path: Path, config: TrainConfig) -> dict | None:
    """The checkpoint at ``path`` (None if absent); it must come from the same config."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=True)
    if state["config"] != dataclasses.asdict(config):
        raise ValueError(f"{path} was written by a different training config: move it away to start over")
    return state


def _restore(state: dict, model, optimizer, scheduler, sampler: PoissonSampler, engine: DPEngine | None) -> int:
    """Load a checkpoint's training state; returns the steps already done. The noise generator
    continues where it stopped: a seeded run never reuses a noise draw."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.seed = state["sampler_seed"]
    if engine:
        engine.set_noise_state(state["noise_state"])
    return int(state["step"])


def report(config: TrainConfig, plan: Plan, accountant: TrainingAccountant | None,
           secure_release: GridGaussian | None) -> dict:
    """The privacy statement of the run, in the units the guarantee is about. With Re-Attention
    the p_v histogram is a second release on the same records: the totals add both (basic
    composition) and each part is listed. ``secure_release``: the engine's grid release in
    secure mode (its grid, integer sigma and sensitivity are recorded). ``accountant=None``: the
    non-private baseline, stated as such (epsilon null)."""
    run = {
        "records": plan.records,
        "sample_rate": plan.sample_rate,
        "steps": plan.steps,
        "optimizer": config.optimizer,
        **({} if config.lora is None else {"lora": config.lora.report()}),
    }
    if accountant is None:
        return {"private": False, "epsilon": None, "delta": None,
                "unit": "none: NOT differentially private (baseline run without clipping or noise)", **run}
    training, frequencies = accountant.epsilon(), plan.frequencies
    extra = {} if frequencies is None else {
        "training": {"epsilon": training, "delta": plan.delta},
        "reattention_frequencies": {"epsilon": frequencies.epsilon, "delta": frequencies.delta,
                                    "mechanism": frequencies.name, "noise_multiplier": config.frequency_noise},
    }
    return {
        "private": True,
        "epsilon": training + (frequencies.epsilon if frequencies else 0.0),
        "delta": plan.delta + (frequencies.delta if frequencies else 0.0),
        **extra,
        "target_epsilon": config.epsilon,
        "unit": f"one training record (a window of <= {config.seq_len} tokens of one document), "
                "add/remove neighbours under Poisson sampling",
        **run,
        "noise_multiplier": plan.noise_multiplier,
        "clip_norm": config.clip_norm,
        "clipping": config.clipping,
        "accountant": plan.accountant,
        "reattention": config.reattention,
        "secure_mode": config.secure_mode,
        **({} if secure_release is None else {"secure_release": secure_release.report()}),
    }


def _write_report(directory: Path, privacy: dict) -> None:
    (directory / REPORT).write_text(json.dumps(privacy, indent=2) + "\n")


def export(model, tokenizer, out: Path, privacy: dict) -> dict:
    """A standard Hugging Face directory ``out/model`` (safetensors + tokenizer) that
    ``vllm-dp serve`` serves as is, plus ``dp_training.json`` beside and inside it (a LoRA run
    also wrote ``out/adapter``; ``out/model`` is then the merged model)."""
    model_dir = out / "model"
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    for directory in (out, model_dir):
        _write_report(directory, privacy)
    (out / CHECKPOINT).unlink(missing_ok=True)
    return privacy
