"""Public calibration of DP attention bounds (``vllm-dp calibrate``).

DP attention over a private context needs, per attention layer, clipping bounds and a public key
centre (``HeadMapping``). They must come from PUBLIC inputs only: this module runs a
Hugging Face model over public text (Python's bundled pydoc pages by default) or synthetic public
audio (Whisper), captures every attention layer's inputs exactly as the attention kernel sees them
(queries and keys after RoPE), and calls ``HeadMapping.calibrate`` on them.

Capture works through transformers' attention dispatch: a function registered under
``CAPTURE_IMPL`` with ``transformers.AttentionInterface`` records ``(q, k, v)`` and delegates to the
"sdpa" implementation, so the model's outputs are unchanged.

Kinds: ``"self_attention"`` (causal-LM layers, Whisper decoder self-attention) and
``"cross_attention"`` (Whisper decoder cross-attention; keys/values from the encoder). Encoder
self-attention is not calibrated. Layers are indexed by the decoder layer index.

The file format (``Calibration``, ``"vllm-dp-calibration/1"``) lives beside ``HeadMapping`` in
``attention.calibration_file``; this module writes it.
This module imports torch and transformers, never vllm.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .attention.calibration_file import KINDS, Calibration
from .attention.mapping import HeadMapping

CAPTURE_IMPL = "vllm_dp_capture"
CALIBRATE_EXAMPLE = ("vllm-dp calibrate .models/smollm2-135m-instruct "
                     "--out .models/smollm2-135m-instruct-calibration.json")  # `vllm-dp calibrate --help`'s example
DEFAULT_SOURCE = "pydoc_data.topics (English help text bundled with CPython)"
SAMPLE_RATE = 16_000

Captured = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]


# --------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------


class _Recorder:
    """Per-(kind, layer) lists of ``[H, n, d]`` chunks and the layer's logit scale beta."""

    def __init__(self, names: Mapping[int, str]) -> None:
        self.names = names
        self.chunks: dict[tuple[str, int], list[tuple[torch.Tensor, ...]]] = {}
        self.betas: dict[tuple[str, int], float] = {}

    def record(self, module: torch.nn.Module, q, k, v, scaling: float | None) -> None:
        """Store one kernel call: q ``[B, H_q, m, d]``, k/v ``[B, H_kv, n, d]`` (batch-first)."""
        kind = _kind(self.names.get(id(module), ""))
        if kind is None:
            return
        kernel_scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
        beta = float(getattr(module, "scaling", kernel_scale))
        # beta * <q', k> must equal the kernel's logit kernel_scale * <q, k>. Llama: q' = q.
        # Whisper pre-scales q and passes scaling=1.0; vLLM passes raw q with scale=beta.
        q = q * (kernel_scale / beta)
        key = (kind, int(module.layer_idx))
        self.betas[key] = beta
        self.chunks.setdefault(key, []).append(tuple(_heads_first(x) for x in (q, k, v)))

    def result(self) -> Captured:
        """Concatenate chunks over tokens: ``{kind: {layer: (q, k, v)}}``."""
        out: Captured = {kind: {} for kind in KINDS}
        for (kind, layer), chunks in sorted(self.chunks.items()):
            q, k, v = (torch.cat(parts, dim=1) for parts in zip(*chunks))
            out[kind][layer] = (q, k, v)
        return out


_ACTIVE: _Recorder | None = None


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, n, d]`` -> ``[H, B*n, d]`` float32 on CPU (batch rows laid end to end)."""
    batch, heads, n, dim = x.shape
    return x.detach().to("cpu", torch.float32).transpose(0, 1).reshape(heads, batch * n, dim)


def _kind(name: str) -> str | None:
    """Kind of an attention module from its qualified name; None for encoder self-attention."""
    parts = name.split(".")
    if any(p in ("encoder_attn", "cross_attn", "crossattention") for p in parts):
        return "cross_attention"
    if "encoder" in parts:
        return None
    return "self_attention"


def _capture_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention function: record the kernel's inputs, then run transformers' "sdpa"."""
    from transformers import AttentionInterface

    if _ACTIVE is not None:
        _ACTIVE.record(module, query, key, value, scaling)
    sdpa = AttentionInterface._global_mapping["sdpa"]
    return sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def _register() -> None:
    """Register ``CAPTURE_IMPL`` (attention + sdpa-style mask) with transformers, idempotently."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(CAPTURE_IMPL, _capture_forward)
    AttentionMaskInterface.register(CAPTURE_IMPL, sdpa_mask)


@contextmanager
def _capturing(model: torch.nn.Module) -> Iterator[_Recorder]:
    """Switch ``model`` to the capture attention (eval mode) and restore it afterwards."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("capture_attention is not re-entrant")
    _register()
    previous, training = model.config._attn_implementation, model.training
    recorder = _Recorder({id(m): name for name, m in model.named_modules()})
    model.set_attn_implementation(CAPTURE_IMPL)
    if model.config._attn_implementation != CAPTURE_IMPL:
        raise ValueError(f"{type(model).__name__} does not accept a custom attention function")
    model.eval()
    _ACTIVE = recorder
    try:
        yield recorder
    finally:
        _ACTIVE = None
        model.set_attn_implementation(previous)
        model.train(training)


def _check_unpadded(batch: Mapping[str, Any]) -> None:
    """Padding would leak pad-token activations into the bounds: refuse masked batches."""
    for name in ("attention_mask", "decoder_attention_mask"):
        mask = batch.get(name)
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError(f"batches must be unpadded, but {name} has zeros")


def _run(model: torch.nn.Module, batches: Iterable[Mapping[str, Any]]) -> _Recorder:
    """Forward every batch (``model(**batch, use_cache=False)``) under capture; no grad."""
    with _capturing(model) as recorder, torch.no_grad():
        for batch in batches:
            _check_unpadded(batch)
            model(**batch, use_cache=False)
    if not recorder.chunks:
        raise ValueError("no attention layer was captured (empty batches?)")
    return recorder


def capture_attention(model: torch.nn.Module, batches: Iterable[Mapping[str, Any]]) -> Captured:
    """Every attention layer's kernel inputs over all tokens of all ``batches``.

    ``batches``: model keyword arguments (e.g. ``{"input_ids": [B, n]}``), unpadded.
    Returns ``{kind: {layer: (q [H_q, N_q, d], k [H_kv, N_kv, d], v [H_kv, N_kv, d_v])}}``
    (float32, CPU), kinds as in ``KINDS`` (a kind the model lacks maps to ``{}``). Queries and
    keys are post-RoPE, exactly what the kernel multiplies; queries are expressed relative to the
    module's ``scaling`` (beta), so ``beta * <q, k>`` is the kernel's logit (this undoes
    Whisper's pre-scaled queries). The model's attention implementation is restored afterwards.
    """
    return _run(model, batches).result()


def fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """GQA fold: q ``[H_q, n, d]`` -> ``[H_kv, G*n, d]``, query head h on KV head h // G."""
    heads, n, dim = q.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    return q.reshape(kv_heads, (heads // kv_heads) * n, dim)


# --------------------------------------------------------------------------------------------
# Calibration from a model
# --------------------------------------------------------------------------------------------


def calibrate_captured(
    captured: Captured, betas: Mapping[tuple[str, int], float], quantile: float
) -> dict[str, dict[int, HeadMapping]]:
    """``HeadMapping.calibrate`` per layer, queries GQA-folded onto their KV heads."""
    layers: dict[str, dict[int, HeadMapping]] = {kind: {} for kind in KINDS}
    for kind in KINDS:
        for layer, (q, k, v) in captured.get(kind, {}).items():
            folded = fold_queries(q, k.shape[0])
            beta = betas[(kind, layer)]
            try:
                layers[kind][layer] = HeadMapping.calibrate(k, folded, v, beta, quantile)
            except ValueError as exc:
                raise ValueError(f"{kind} layer {layer}: {exc} (too few public tokens?)") from exc
    return layers


def calibrate(
    model: torch.nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    quantile: float = 0.999,
    model_name: str = "",
    source: str = "",
) -> Calibration:
    """Calibrate an in-memory model on public ``batches`` (see ``capture_attention``).

    ``num_tokens`` is the number of query tokens of decoder self-attention (causal LM tokens).
    """
    recorder = _run(model, batches)
    captured = recorder.result()
    layers = calibrate_captured(captured, recorder.betas, quantile)
    self_layers = captured["self_attention"]
    num_tokens = self_layers[min(self_layers)][0].shape[1] if self_layers else 0
    return Calibration(model_name or type(model).__name__, source, quantile, num_tokens, layers)


def token_chunks(
    tokenizer, texts: Iterable[str], max_tokens: int, seq_len: int
) -> list[torch.Tensor]:
    """Public token sequences ``[1, <= seq_len]`` totalling at most ``max_tokens`` tokens.

    Texts are tokenized without special tokens and joined by EOS (if any) into one stream; each
    sequence starts with BOS (if the tokenizer has one) followed by the next stream tokens.
    """
    if max_tokens < 1 or seq_len < 2:
        raise ValueError(f"need max_tokens >= 1 and seq_len >= 2, got {max_tokens}, {seq_len}")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    body = seq_len - (bos is not None)
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
        stream += [] if eos is None else [eos]
        if len(stream) >= max_tokens:
            break
    chunks, used = [], 0
    for start in range(0, len(stream), body):
        ids = ([] if bos is None else [bos]) + stream[start : start + body]
        ids = ids[: max_tokens - used]
        if len(ids) < 2:
            break
        chunks.append(torch.tensor([ids]))
        used += len(ids)
    if not chunks:
        raise ValueError("the public text yields no token sequence of length >= 2")
    return chunks


def public_audio(seconds: float = 4.0) -> list[torch.Tensor]:
    """Deterministic public audio at 16 kHz: a log sine sweep 100 Hz -> 4 kHz, and white noise.

    Returns two float32 waveforms of ``seconds * 16000`` samples, amplitude <= 0.5.
    """
    n = int(seconds * SAMPLE_RATE)
    t = torch.arange(n, dtype=torch.float64) / SAMPLE_RATE
    f0, f1 = 100.0, 4000.0
    k = math.log(f1 / f0) / seconds
    sweep = 0.5 * torch.sin(2 * math.pi * f0 * (torch.exp(k * t) - 1) / k)
    gen = torch.Generator().manual_seed(0)
    noise = 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
    return [sweep.float(), noise.clamp(-0.5, 0.5).float()]


def whisper_features(model_dir: Path, config) -> tuple[torch.Tensor, str]:
    """Public encoder input ``[B, num_mel_bins, 2 * max_source_positions]`` and its description.

    With a ``preprocessor_config.json``: ``public_audio()`` through ``WhisperFeatureExtractor``
    (B = 2). Otherwise: uniform [-1, 1] "log-mel" features from seed 0 (B = 1).
    """
    frames = 2 * config.max_source_positions
    if (model_dir / "preprocessor_config.json").exists():
        from transformers import WhisperFeatureExtractor

        extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
        audio = [a.numpy() for a in public_audio()]
        out = extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt")
        feats = out["input_features"][..., :frames]
        return feats.float(), "synthetic public audio (4 s log sine sweep, 4 s white noise, seed 0)"
    gen = torch.Generator().manual_seed(0)
    feats = torch.rand(1, config.num_mel_bins, frames, generator=gen) * 2 - 1
    return feats, "synthetic public log-mel features (uniform [-1, 1], seed 0)"


def whisper_decoder_ids(model_dir: Path, config, length: int) -> torch.Tensor:
    """``[1, length]``: decoder_start_token_id, then ``length - 1`` public tokens.

    Those are the first pydoc page tokenized by the tokenizer saved in ``model_dir`` when it has
    one that yields enough tokens, else token ids drawn uniformly from seed 0. (transformers 5's
    ``AutoTokenizer`` returns an *empty* Whisper tokenizer for a directory without tokenizer
    files, hence the length check.)
    """
    rest = length - 1
    ids: list[int] = []
    if any((model_dir / name).exists() for name in ("tokenizer.json", "vocab.json")):
        from transformers import AutoTokenizer

        from .demo import public_corpus

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ids = tokenizer(public_corpus()[0], add_special_tokens=False)["input_ids"][:rest]
    if len(ids) < rest:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (rest,), generator=gen).tolist()
    return torch.tensor([[config.decoder_start_token_id, *ids]])


def _calibrate_whisper(model_dir: Path, config, seq_len: int, quantile: float, texts):
    from tqdm import tqdm
    from transformers import WhisperForConditionalGeneration

    if texts is not None:
        raise ValueError("Whisper is calibrated on synthetic public audio; texts are not used")
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    features, source = whisper_features(model_dir, config)
    length = max(2, min(seq_len, config.max_target_positions))
    ids = whisper_decoder_ids(model_dir, config, length).expand(features.shape[0], -1)
    batches = [
        {"input_features": f[None], "decoder_input_ids": i[None]} for f, i in zip(features, ids)
    ]
    bar = tqdm(batches, desc="calibrating", unit="clip")
    return calibrate(model, bar, quantile=quantile, model_name=str(model_dir), source=source)


def _calibrate_causal(model_dir: Path, texts, max_tokens, seq_len, quantile, source):
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .demo import public_corpus

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if texts is None:
        texts, source = public_corpus(), source or DEFAULT_SOURCE
    chunks = token_chunks(tokenizer, texts, max_tokens, seq_len)
    batches = [{"input_ids": ids} for ids in chunks]
    bar = tqdm(batches, desc="calibrating", unit="seq")
    source = source or f"caller-supplied public text ({len(texts)} documents)"
    return calibrate(model, bar, quantile=quantile, model_name=str(model_dir), source=source)


def calibrate_model(
    model_dir: str | Path,
    out_path: str | Path,
    texts: Sequence[str] | None = None,
    max_tokens: int = 4096,
    quantile: float = 0.999,
    seq_len: int = 256,
    source: str | None = None,
) -> Calibration:
    """Calibrate the model saved in ``model_dir`` on public input; write ``out_path``; return it.

    Causal LMs: ``texts`` (default ``demo.public_corpus()``) cut into sequences of ``seq_len``
    tokens, ``max_tokens`` in all. Whisper (``model_type == "whisper"``): synthetic public audio
    (see ``whisper_features``) and ``min(seq_len, max_target_positions)`` decoder tokens; ``texts``
    must be None. ``source`` describes caller-supplied texts in the file.
    """
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type == "whisper":
        result = _calibrate_whisper(model_dir, config, seq_len, quantile, texts)
    else:
        result = _calibrate_causal(model_dir, texts, max_tokens, seq_len, quantile, source)
    result.to_file(out_path)
    return result


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def summary(cal: Calibration) -> str:
    """One line per layer: bounds and the implied logit bound T = beta * key_norm * query_norm."""
    lines = [
        f"model {cal.model}: {cal.num_tokens} public tokens, quantile {cal.quantile}",
        f"source: {cal.source}",
    ]
    for kind in KINDS:
        for layer in sorted(cal.layers.get(kind, {})):
            m = cal.mapping(kind, layer)
            norms = m.key_norm is not None and m.query_norm is not None
            t = m.beta * m.key_norm * m.query_norm if norms else math.inf
            lines.append(
                f"{kind:15s} layer {layer:3d}: beta={m.beta:.4g} R_k={m.key_bound:.4g} "
                f"R_q={m.query_bound:.4g} R_v={m.value_bound:.4g} |k|<={_num(m.key_norm)} "
                f"|q|<={_num(m.query_norm)} T={t:.4g}"
            )
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:.4g}"


def build_parser() -> argparse.ArgumentParser:
    from .benchmarks.lib.cli import ExampleHelpFormatter, example

    parser = argparse.ArgumentParser(
        prog="vllm-dp calibrate",
        description="Public calibration of DP attention bounds (never run on private text).",
        epilog=example(CALIBRATE_EXAMPLE), formatter_class=ExampleHelpFormatter,
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="local Hugging Face model directory")
    parser.add_argument("--out", required=True, metavar="FILE", help="calibration JSON to write")
    parser.add_argument(
        "--text", metavar="FILE", help="PUBLIC UTF-8 text to calibrate on (default: pydoc pages)"
    )
    parser.add_argument("--max-tokens", type=int, default=4096, metavar="N")
    parser.add_argument("--seq-len", type=int, default=256, metavar="N")
    parser.add_argument("--quantile", type=float, default=0.999, metavar="Q")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``vllm-dp calibrate MODEL_DIR --out FILE [--text FILE] [--max-tokens N] [--quantile Q]``."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    texts = source = None
    if args.text is not None:
        texts, source = [Path(args.text).read_text(encoding="utf-8")], f"file {args.text}"
    cal = calibrate_model(
        args.model_dir, args.out, texts, args.max_tokens, args.quantile, args.seq_len, source
    )
    print(summary(cal))
    print(f"calibration written to {args.out}")
    return 0
