"""The verdicts of ``python -m benchmarks.train``: ratios to the baselines, the targets, and the per-sample
gradient norm checks against ``torch.func``."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from benchmarks.train.methods import METHODS, _error_text, naive_vmap_step, ours_step
from benchmarks.train.spec import BenchSpec, synthetic_batch
from vllm_dp_plugin.trainer.lora import apply_lora

TARGET_TIME_RATIO = 1.5  # ours <= 1.5x the non-private step time
TARGET_MEMORY_RATIO = 1.3  # ours <= 1.3x the non-private peak memory
MODEL_TARGET_TIME_RATIO = {"cpu": 1.25, "cuda": 1.2}  # --model: ours (full fine-tuning) vs non-private step time
MODEL_TARGET_MEMORY_RATIO = 1.2  # --model: ours <= 1.2x the non-private peak memory
LORA_TARGET_RATIO = 1.15  # --model: ours LoRA <= 1.15x non-private LoRA, step time and peak memory
TINY_VOCAB, TINY_BATCH, TINY_SEQ = 1024, 4, 32  # --model norm check: 2-layer Llama of the model's shape
# float32 per-sample norms, the two sides reducing in different orders: the longest reduction is a
# dot product over the vocabulary (K ~ 5e4 terms), relative rounding error ~ sqrt(K) * 6e-8 ~ 1.3e-5
# (random-walk bound; positive sums of such terms do not amplify it). Measured: <= 3e-7.
NORM_RTOL = 2e-5


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
