"""DP engine on tiny Hugging Face GPT-2 (tied, Conv1D, LayerNorm, learned positions) and Llama
(RMSNorm, GQA, tied and untied) models with left padding, attention masks and -100 labels.

Per-sample norms and clipped sums are compared with brute-force per-sample gradients from
``torch.func.grad`` in float64: the two differ only by float64 rounding over a few
hundred operations (~1e-13 measured), so 1e-9 relative leaves room and still catches any
missing term (a dropped cross term or bias changes norms by > 1e-2). Noise is checked with KS
tests at fixed seeds.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.func import functional_call, grad
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from vllm_dp_plugin.trainer.engine import (
    DPConfig,
    DPEngine,
    causal_lm_per_sample_loss,
    warmup_linear_decay,
    warmup_linear_decay_scheduler,
)

hf_logging.set_verbosity_error()  # tiny configs: bos/eos ids outside the vocabulary warnings

VOCAB, BATCH, TOKENS, RTOL = 50, 4, 6, 1e-9
# LlamaRMSNorm normalises in float32 even in a float64 model, so autograd's gradient of its
# weight carries float32 rounding (measured 4e-8 relative) while the engine's formula is float64.
FLOAT32_RTOL = 1e-6
COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def gpt2(seed: int = 0, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **COMMON
    )
    return GPT2LMHeadModel(config).to(dtype)


def llama(seed: int = 0, tied: bool = True, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, tie_word_embeddings=tied, **COMMON,
    )
    return LlamaForCausalLM(config).to(dtype)


def llama_lora(seed: int = 0) -> nn.Module:
    """The tied Llama with peft LoRA adapters on q/v/up/down (r = 3, the only trainable
    parameters); lora_B random (peft starts it at 0, which would zero lora_A's gradients)."""
    from vllm_dp_plugin.trainer.lora import LoraSpec, apply_lora

    model = apply_lora(llama(seed), LoraSpec(r=3, alpha=6.0, target_modules=("q_proj", "v_proj", "up_proj", "down_proj")))
    torch.manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.3)
    return model


MODELS = {
    "gpt2": gpt2,
    "llama_tied": lambda: llama(tied=True),
    "llama_untied": lambda: llama(tied=False),
    "llama_lora": llama_lora,
}


def make_batch(seed: int = 0, batch: int = BATCH) -> dict:
    """Left-padded ids with repeats (ids < 8 so tokens recur), attention mask, position ids
    [B, T] (per-sample, as the engine needs), labels -100 on pads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 8, (batch, TOKENS), generator=g)
    mask = torch.ones(batch, TOKENS, dtype=torch.long)
    mask[0, :2] = 0
    mask[2 % batch, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
        "labels": ids.masked_fill(mask == 0, -100),
    }


def losses(model: nn.Module, batch: dict) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return causal_lm_per_sample_loss(model(**inputs).logits, batch["labels"])


def brute_force_grads(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """name -> [B, *shape] per-sample gradients of the trainable parameters: ``torch.func.grad``
    of each sample's loss alone (a batch of one; a loop, since the sdpa masks of Hugging Face
    models branch on data, which vmap refuses; eager attention gives NaN on left-padded rows)."""
    trainable = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}

    def one(params, sample):
        return losses(_Functional(model, {**params, **frozen}), sample)[0]

    per_sample = [grad(one)(trainable, {k: v[i : i + 1] for k, v in batch.items()}) for i in range(len(batch["labels"]))]
    return {name: torch.stack([g[name] for g in per_sample]) for name in trainable}


class _Functional:
    """Calls ``model`` with ``params`` substituted (tied weights substituted in every use)."""

    def __init__(self, model, params):
        self.model, self.params = model, params

    def __call__(self, **inputs):
        return functional_call(self.model, self.params, (), inputs)


def sample_norms(per_sample: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()


def clipped_mean(per_sample, norms, config: DPConfig) -> dict[str, torch.Tensor]:
    if config.clipping == "automatic":
        factors = config.clip_norm / (norms + config.gamma)
    else:
        factors = (config.clip_norm / norms).clamp(max=1.0)
    return {k: torch.einsum("b,b...->...", factors, g) / config.expected_batch_size for k, g in per_sample.items()}


def engine_step(model, config, batches) -> torch.Tensor:
    """One DP step over ``batches`` (virtual batches); returns the per-sample norms."""
    engine = DPEngine(model, config)
    norms = [engine.backward(losses(model, b)) for b in batches]
    engine.finish_step()
    engine.detach()
    return torch.cat(norms)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("clipping", ["automatic", "flat"])
def test_norms_and_clipped_sums_equal_brute_force(name, clipping):
    model, batch = MODELS[name](), make_batch()
    truth = brute_force_grads(model, batch)
    clip = sample_norms(truth).median().item()  # flat clipping: some samples clipped, some not
    config = DPConfig(noise_multiplier=0.0, expected_batch_size=7, clip_norm=clip, clipping=clipping)
    norms = engine_step(model, config, [batch])
    torch.testing.assert_close(norms, sample_norms(truth), rtol=RTOL, atol=0)
    want = clipped_mean(truth, sample_norms(truth), config)
    assert want.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for param_name, param in model.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, param_name  # frozen (LoRA's base): never written
            continue
        rtol = FLOAT32_RTOL if param_name.endswith("norm.weight") and name.startswith("llama") else RTOL
        scale = want[param_name].abs().max().item()  # near-zero entries: error relative to the largest
        torch.testing.assert_close(param.grad, want[param_name], rtol=rtol, atol=rtol * scale, msg=param_name)


def test_frozen_parameters_are_skipped():
    model, batch = gpt2(), make_batch()
    for param in model.transformer.wte.parameters():
        param.requires_grad_(False)
    truth = brute_force_grads(model, batch)
    norms = engine_step(model, DPConfig(noise_multiplier=0.0, expected_batch_size=BATCH), [batch])
    torch.testing.assert_close(norms, sample_norms(truth), rtol=RTOL, atol=0)
    assert model.transformer.wte.weight.grad is None


@pytest.mark.parametrize(("tied", "shared", "alone"), [(True, 8, 14), (False, 9, 15)])
def test_layers_reading_one_input_share_its_gram(monkeypatch, tied, shared, alone):
    """Llama's q/k/v read one normed hidden state and gate/up another: 4 input Grams per layer
    instead of 7 (+ the untied head's), counted at ``base.gram`` (only ``InputGrams`` calls it
    there), with the same norms as when every layer computes its own."""
    from vllm_dp_plugin.trainer.norm_rules import base

    computed = []
    counted_gram = base.gram
    monkeypatch.setattr(base, "gram", lambda x: computed.append(x.shape) or counted_gram(x))
    config = DPConfig(noise_multiplier=0.0, expected_batch_size=BATCH)
    norms = engine_step(llama(tied=tied), config, [make_batch()])
    assert len(computed) == shared
    computed.clear()
    monkeypatch.setattr(base.InputGrams, "of", lambda self, x, dtype: base.gram(x.to(dtype)))
    torch.testing.assert_close(norms, engine_step(llama(tied=tied), config, [make_batch()]), rtol=1e-12, atol=0)
    assert len(computed) == alone


def test_small_per_sample_gradients_are_computed_once(monkeypatch):
    """RMSNorm weights' per-sample gradients ``[B, d]`` serve both the norms and the clipped sum:
    one computation per RMSNorm (2 layers x 2 + the final one), not one for each."""
    from vllm_dp_plugin.trainer.norm_rules import rmsnorm

    calls = []
    counted = rmsnorm.rmsnorm_grads
    monkeypatch.setattr(rmsnorm, "rmsnorm_grads", lambda *a: calls.append(1) or counted(*a))
    engine_step(llama(), DPConfig(noise_multiplier=0.0, expected_batch_size=BATCH), [make_batch()])
    assert len(calls) == 5


def test_virtual_batches_equal_one_batch():
    """Two half batches accumulate into the same noisy step as the full batch (same seed: the
    noise is drawn once per step, not per virtual batch)."""
    batch = make_batch()
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    config = DPConfig(noise_multiplier=1.0, expected_batch_size=BATCH, seed=3)
    whole, split = llama(), llama()
    torch.testing.assert_close(engine_step(whole, config, [batch]), engine_step(split, config, halves), rtol=RTOL, atol=0)
    for (name, a), b in zip(whole.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=1e-15, msg=name)


# ---------- noise ----------


def noise_only_grads(model: nn.Module, config: DPConfig) -> dict[str, torch.Tensor]:
    """``p.grad`` after a step whose loss has zero gradient: the noise / B alone."""
    engine = DPEngine(model, config)
    engine.backward(losses(model, make_batch()) * 0)
    engine.finish_step()
    return {name: p.grad.double() for name, p in model.named_parameters()}


def test_noise_is_gaussian_with_std_sigma_c_over_b():
    """KS test of every coordinate of the tiny GPT-2 (~8.6k, float32) against N(0, (sigma C/B)^2);
    also the tied embedding alone: noised twice (once per use) its std would be sqrt(2) x and
    the KS statistic over its 800 coordinates would be ~0.08 (p ~ 1e-4)."""
    config = DPConfig(noise_multiplier=1.3, expected_batch_size=5, clip_norm=0.7, seed=11)
    noise = noise_only_grads(gpt2(dtype=torch.float32), config)
    scale = config.noise_multiplier * config.clip_norm / config.expected_batch_size
    everything = torch.cat([g.flatten() for g in noise.values()]) / scale
    assert stats.kstest(everything.numpy(), "norm").pvalue > 1e-3
    tied = noise["transformer.wte.weight"].flatten() / scale  # also lm_head.weight: one Parameter
    assert stats.kstest(tied.numpy(), "norm").pvalue > 1e-3


def test_noise_chunks_are_independent_gaussian_streams(monkeypatch):
    """With many small chunks (each its own keyed generator, filled on several threads) the noise
    is still N(0, (sigma C/B)^2) coordinate-wise, no two chunks repeat a stream, and the seed
    reproduces it whatever the thread scheduling."""
    from vllm_dp_plugin.trainer import engine as engine_module

    monkeypatch.setattr(engine_module, "NOISE_CHUNK", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    config = DPConfig(noise_multiplier=0.9, expected_batch_size=3, clip_norm=1.1, seed=2)
    noise = noise_only_grads(llama(dtype=torch.float32), config)
    scale = config.noise_multiplier * config.clip_norm / config.expected_batch_size
    flat = torch.cat([g.flatten() for g in noise.values()]) / scale
    assert stats.kstest(flat.numpy(), "norm").pvalue > 1e-3
    chunks = flat[: flat.numel() // 64 * 64].view(-1, 64)
    assert len(chunks) > 50 and len({tuple(c[:4].tolist()) for c in chunks}) == len(chunks)
    lag = torch.corrcoef(torch.stack([chunks[:-1].flatten(), chunks[1:].flatten()]))[0, 1]
    assert abs(float(lag)) < 4 / math.sqrt(chunks[1:].numel())  # neighbouring chunks uncorrelated
    again = noise_only_grads(llama(dtype=torch.float32), config)
    assert all(torch.equal(noise[k], again[k]) for k in noise)


def test_noise_repeats_with_the_seed_only():
    config = DPConfig(noise_multiplier=1.0, expected_batch_size=4, seed=5)
    first, again = noise_only_grads(llama(), config), noise_only_grads(llama(), config)
    other = noise_only_grads(llama(), DPConfig(noise_multiplier=1.0, expected_batch_size=4, seed=6))
    entropy = noise_only_grads(llama(), DPConfig(noise_multiplier=1.0, expected_batch_size=4))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(first[name], again[name])
    assert not torch.equal(first[name], other[name])
    assert not torch.equal(first[name], entropy[name])


def test_noise_in_bf16_model_is_cast_after_scaling():
    """bf16 parameters get bf16 grads; the norms are computed in float32."""
    model, batch = llama(dtype=torch.bfloat16), make_batch()
    engine = DPEngine(model, DPConfig(noise_multiplier=1.0, expected_batch_size=BATCH, seed=0))
    norms = engine.backward(losses(model, batch))
    engine.finish_step()
    assert norms.dtype == torch.float32 and torch.isfinite(norms).all()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


# ---------- refusals ----------


class WithConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 4, 1)

    def forward(self, x):
        return self.conv(self.proj(x).transpose(1, 2)).sum((1, 2))


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(self.proj(x)).sum((1, 2))


class GemmaLikeRMSNorm(nn.Module):
    """An RMSNorm scaling by (1 + weight): not the formula the RMSNorm norms assume."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def test_unsupported_trainable_module_is_named():
    with pytest.raises(ValueError, match=r"'conv\.weight' belongs to Conv1d"):
        DPEngine(WithConv(), DPConfig(noise_multiplier=1.0, expected_batch_size=2))
    frozen = WithConv()
    frozen.conv.requires_grad_(False)
    DPEngine(frozen, DPConfig(noise_multiplier=1.0, expected_batch_size=2)).detach()


def test_module_called_twice_raises():
    model = Twice()
    DPEngine(model, DPConfig(noise_multiplier=1.0, expected_batch_size=2))
    with pytest.raises(ValueError, match="'proj' .* called twice"):
        model(torch.randn(2, 3, 4))


def test_other_parameter_sharing_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="shared by 0.weight, 1.weight"):
        DPEngine(model, DPConfig(noise_multiplier=1.0, expected_batch_size=2))


def test_rmsnorm_with_another_formula_raises():
    model = nn.Sequential(nn.Linear(4, 4), GemmaLikeRMSNorm(4))
    with pytest.raises(ValueError, match="'1' .*GemmaLikeRMSNorm.* privacy bug"):
        DPEngine(model, DPConfig(noise_multiplier=1.0, expected_batch_size=2))


def test_broadcast_positions_raise():
    """GPT-2's default position ids are [1, T]: the position table's output gradient would be a
    sum over the batch, not per sample."""
    model, batch = gpt2(), make_batch()
    engine = DPEngine(model, DPConfig(noise_multiplier=1.0, expected_batch_size=BATCH))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with pytest.raises(ValueError, match="'transformer.wpe' produced batch size 1"):
        engine.backward(causal_lm_per_sample_loss(logits, batch["labels"]))


def test_gradient_checkpointing_raises():
    model = llama()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        DPEngine(model, DPConfig(noise_multiplier=1.0, expected_batch_size=2))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"noise_multiplier": -1.0, "expected_batch_size": 2},
        {"noise_multiplier": float("nan"), "expected_batch_size": 2},
        {"noise_multiplier": 1.0, "expected_batch_size": 0},
        {"noise_multiplier": 1.0, "expected_batch_size": 2, "clip_norm": 0.0},
        {"noise_multiplier": 1.0, "expected_batch_size": 2, "clipping": "per_layer"},
        {"noise_multiplier": 1.0, "expected_batch_size": 2, "gamma": -0.1},
        {"noise_multiplier": 1.0, "expected_batch_size": 2, "seed": 1.5},
        {"noise_multiplier": 1.0, "expected_batch_size": 2, "secure_mode": "yes"},
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        DPConfig(**kwargs)


# ---------- loss and schedule ----------


def test_causal_lm_loss_is_the_per_sample_mean_over_valid_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([[-100, 1, 2, 3], [4, -100, -100, -100]])
    got = causal_lm_per_sample_loss(logits, labels)
    first = -sum(logits[0, t].log_softmax(-1)[labels[0, t + 1]] for t in range(3)) / 3
    assert got[0].item() == pytest.approx(first.item(), rel=1e-12)
    assert got[1].item() == 0.0  # no valid next-token label


def test_warmup_linear_decay():
    assert [warmup_linear_decay(t, 10, 0.2) for t in (1, 2, 3, 6, 10)] == pytest.approx([0.5, 1.0, 0.875, 0.5, 0.0])
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = warmup_linear_decay_scheduler(optimizer, 10, 0.2)
    lrs = []
    for _ in range(3):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1.0, 2.0, 1.75])
    with pytest.raises(ValueError):
        warmup_linear_decay(1, 10, 1.0)


def test_norm_is_exact_not_an_upper_bound():
    """Guard for the tolerance argument above: the clipped norms are not all equal to C, so the
    brute-force comparison exercises the clip factors (AUTO-S maps n to n C / (n + gamma))."""
    model, batch = gpt2(), make_batch()
    norms = sample_norms(brute_force_grads(model, batch))
    assert norms.min() > 0 and not math.isclose(norms.min().item(), norms.max().item(), rel_tol=1e-3)


# ---------- floating point: secure mode; the noise generator's state ----------

SPREAD = 1 << 16  # coordinates of one released vector: i.i.d. draws of one coordinate's release
SHIFT = 2.0**-8  # a record x = SHIFT * ones has norm SHIFT * 2^8 = 1 = C: clipped sum SHIFT or 0
LEAK_MULTIPLIER, LEAK_DELTA = 3.0, 1e-3  # per coordinate: noise std = 3 x the shift


def one_record_release(record: bool, secure_mode: bool, seed: int) -> torch.Tensor:
    """``p.grad: [SPREAD]`` of a Linear(SPREAD -> 1) after one flat-clipped step (B = 1) on the
    record ``SHIFT * ones`` or ``zeros`` (neighbours): every coordinate's clipped sum is exactly
    SHIFT or 0 in float32, and the noise multiplier makes its noise std 3 x SHIFT."""
    model = nn.Linear(SPREAD, 1, bias=False)
    config = DPConfig(noise_multiplier=LEAK_MULTIPLIER * SHIFT, expected_batch_size=1, clip_norm=1.0,
                      clipping="flat", seed=seed, secure_mode=secure_mode)
    engine = DPEngine(model, config)
    x = torch.full((1, 1, SPREAD), SHIFT if record else 0.0)
    engine.backward(model(x).sum((1, 2)))
    engine.finish_step()
    return model.weight.grad.view(-1)


@pytest.mark.parametrize("secure_mode", [False, True])
def test_low_order_bits_separate_neighbours_only_without_secure_mode(secure_mode):
    """The audit's distinguisher on the engine's release, per coordinate (each coordinate is a
    Gaussian release of sensitivity SHIFT with noise multiplier >= 3, i.e. (eps, 1e-3)-DP): the
    float release puts ~9% of its zero-record coordinates off the multiples of ulp(SHIFT)/2,
    where the one-record release never is (excess > 0 refutes DP); the secure release stays
    within e^eps and the derived sampling slack on every output set."""
    from tests.privacy.distinguisher import MIRONOV, events, excess, rdp_epsilon

    without, with_record = one_record_release(False, secure_mode, 1), one_record_release(True, secure_mode, 2)
    found = excess(without, with_record, events(SHIFT, torch.float32), rdp_epsilon(LEAK_MULTIPLIER, LEAK_DELTA),
                   LEAK_DELTA)
    if secure_mode:
        assert max(found.values()) <= 0, found
    else:
        assert found[MIRONOV] > 0, found


def test_secure_release_is_on_the_grid_with_the_calibrated_noise():
    """Secure mode on the tiny GPT-2 (~8.6k float32 coordinates): every grad is (grid step / B) x
    an integer, the noise alone is N(0, noise_std^2) (KS), and one seed repeats the release."""
    config = DPConfig(noise_multiplier=1.3, expected_batch_size=4, clip_norm=0.7, seed=11, secure_mode=True)
    noise = noise_only_grads(gpt2(dtype=torch.float32), config)
    release = DPEngine(gpt2(dtype=torch.float32), config).secure_release
    assert release.noise_multiplier >= config.noise_multiplier
    everything = torch.cat([g.flatten() for g in noise.values()]) * config.expected_batch_size
    steps = everything / release.grid
    assert torch.equal(steps, torch.round(steps))
    assert stats.kstest((everything / release.noise_std).numpy(), "norm").pvalue > 1e-3
    again = noise_only_grads(gpt2(dtype=torch.float32), config)
    assert all(torch.equal(noise[name], again[name]) for name in noise)


def test_secure_release_resumes_from_the_noise_state():
    """A checkpointed generator state continues the secure noise stream: the second step of a
    run equals a fresh engine's step after ``set_noise_state``."""
    config = DPConfig(noise_multiplier=1.0, expected_batch_size=4, seed=3, secure_mode=True)
    model, batch = llama(), make_batch()
    engine = DPEngine(model, config)
    engine.backward(losses(model, batch) * 0)
    engine.finish_step()
    state = engine.noise_state()
    engine.backward(losses(model, batch) * 0)
    engine.finish_step()
    second = {name: p.grad.clone() for name, p in model.named_parameters()}
    resumed = llama()
    other = DPEngine(resumed, config)
    other.set_noise_state(state)
    other.backward(losses(resumed, batch) * 0)
    other.finish_step()
    assert all(torch.equal(p.grad, second[name]) for name, p in resumed.named_parameters())


def _is_a_32_bit_seed_state(state: torch.Tensor) -> bool:
    """Whether a CPU generator state's mt19937 words follow init_with_uint32's recurrence, i.e.
    come from ``manual_seed`` (which keeps 32 bits of any seed) before any draw."""
    words = np.frombuffer(state.numpy().tobytes()[24 : 24 + 8 * 624], dtype="<u8")
    prev = words[:-1]
    follow = (np.uint64(1812433253) * (prev ^ (prev >> np.uint64(30))) + np.arange(1, 624, dtype=np.uint64))
    return bool((follow & np.uint64(0xFFFFFFFF) == words[1:]).all())


@pytest.mark.parametrize("seed", [None, 5])
def test_noise_generator_is_not_a_32_bit_seed(seed):
    """With 2^32 possible noise streams an attacker holding the released weights could try them
    all: the engine's generator state must not come from ``manual_seed`` (the check recognises
    any manual_seed state), and seeds differing above bit 32 draw different noise."""
    assert _is_a_32_bit_seed_state(torch.Generator().manual_seed(2**40 + 7).get_state())
    engine = DPEngine(llama(), DPConfig(noise_multiplier=1.0, expected_batch_size=4, seed=seed))
    assert not _is_a_32_bit_seed_state(engine.noise_state())
    if seed is not None:
        name = "model.layers.0.mlp.up_proj.weight"
        low = noise_only_grads(llama(), DPConfig(noise_multiplier=1.0, expected_batch_size=4, seed=seed))
        high = noise_only_grads(llama(), DPConfig(noise_multiplier=1.0, expected_batch_size=4, seed=seed + 2**32))
        assert not torch.equal(low[name], high[name])
