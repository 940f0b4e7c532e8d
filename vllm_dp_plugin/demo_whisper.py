"""Tiny local Whisper: random weights, real locally trained tokenizer. No hub access.

``make_demo_whisper(dir)`` writes everything ``vllm.LLM`` needs to serve an encoder-decoder
speech model offline: a byte-level BPE ``WhisperTokenizer`` trained on ``public_corpus()`` with
Whisper's special tokens (laid out in Whisper's order, so ``<|xx|>`` language ids are
contiguous after ``<|startoftranscript|>`` as ``WhisperTokenizer.prefix_tokens`` assumes), a
``WhisperFeatureExtractor`` (80 mel bins, 16 kHz, 30 s chunks -> 3000 frames -> 1500 encoder
positions), a generation config and a random-weight ``WhisperForConditionalGeneration``
(float32 safetensors). Head size 32, one of the sizes vLLM's CPU attention supports.
Deterministic: same arguments, same files.

Serving it (CPU): see ``tests/serving/whisper_generate.py``; the prompt is an explicit
encoder/decoder prompt with the audio on the encoder side and
``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`` as the decoder prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SAMPLING_RATE = 16000
TASKS = ("translate", "transcribe")


@dataclass(frozen=True)
class DemoWhisperShape:
    """Model geometry: d_model 128 over 4 heads gives head_dim 32 (CPU attention constraint)."""

    bpe_vocab_size: int = 1024
    d_model: int = 128
    encoder_layers: int = 2
    decoder_layers: int = 2
    attention_heads: int = 4
    ffn_dim: int = 256
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    max_target_positions: int = 448
    # Far above Whisper's 0.02: with 0.02 the residual stream is dominated by the (tied) token
    # embedding and greedy decoding repeats one token whatever the audio. 0.5 gives varied,
    # audio-dependent tokens with clear top-1/top-2 logit gaps (robust greedy comparisons).
    init_std: float = 0.5


def whisper_special_tokens() -> list[str]:
    """Whisper's special tokens in Whisper's id order (timestamp tokens omitted)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *(f"<|{code}|>" for code in LANGUAGES),
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
    ]


def train_whisper_tokenizer(bpe_vocab_size: int):
    """Byte-level BPE on ``public_corpus()`` wrapped as ``WhisperTokenizer`` + special tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizer

    from vllm_dp_plugin.demo import public_corpus

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(public_corpus(), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]

    specials = whisper_special_tokens()
    # eos/bos/unk = <|endoftext|> gets the first id after the BPE vocab, as in Whisper.
    tokenizer = WhisperTokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    ids = tokenizer.convert_tokens_to_ids(specials)
    first = len(model["vocab"])
    assert ids == list(range(first, first + len(specials))), "special tokens must be contiguous"
    return tokenizer


def make_demo_whisper(
    out_dir: str | Path, seed: int = 0, shape: DemoWhisperShape = DemoWhisperShape()
) -> Path:
    """Write tokenizer, feature extractor, generation config and random Whisper; return dir."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_whisper_tokenizer(shape.bpe_vocab_size)
    feature_extractor = WhisperFeatureExtractor(
        feature_size=shape.num_mel_bins,
        sampling_rate=SAMPLING_RATE,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
    )
    # tokenizer.json + tokenizer_config.json + processor_config.json (transformers 5 nests the
    # feature extractor there); preprocessor_config.json too, for loaders that look for it.
    WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(out)
    feature_extractor.save_pretrained(out)

    tok = tokenizer.convert_tokens_to_ids
    eot = tok("<|endoftext|>")
    sot = tok("<|startoftranscript|>")
    no_timestamps = tok("<|notimestamps|>")
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        d_model=shape.d_model,
        encoder_layers=shape.encoder_layers,
        decoder_layers=shape.decoder_layers,
        encoder_attention_heads=shape.attention_heads,
        decoder_attention_heads=shape.attention_heads,
        encoder_ffn_dim=shape.ffn_dim,
        decoder_ffn_dim=shape.ffn_dim,
        num_mel_bins=shape.num_mel_bins,
        max_source_positions=shape.max_source_positions,
        max_target_positions=shape.max_target_positions,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=sot,
        # No token suppression: vLLM ignores these, so HF generate() stays comparable.
        begin_suppress_tokens=None,
        suppress_tokens=None,
        tie_word_embeddings=True,
        init_std=shape.init_std,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=sot,
        no_timestamps_token_id=no_timestamps,
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": tok(f"<|{code}|>") for code in LANGUAGES},
        task_to_id={task: tok(f"<|{task}|>") for task in TASKS},
    )
    model.save_pretrained(out, safe_serialization=True)
    return out
