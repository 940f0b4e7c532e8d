"""English-only Whisper checkpoints get the decoder prompt they were trained with (no language
and task tokens); multilingual ones get vLLM's prompt unchanged."""

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_dp_plugin.serving.whisper import Whisper


def _prompt(vocab_size: int, request_prompt: str = "") -> str:
    params = SimpleNamespace(audio=np.zeros(16_000, dtype=np.float32),
                             stt_config=SimpleNamespace(sample_rate=16_000), language="en",
                             task_type="transcribe", request_prompt=request_prompt,
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(vocab_size=vocab_size)))
    return Whisper.get_generation_prompt(params)["decoder_prompt"]["prompt"]


def test_english_only_checkpoints_drop_language_and_task_tokens():
    assert _prompt(51_864) == "<|startoftranscript|><|notimestamps|>"
    assert _prompt(51_864, "Hi.") == "<|prev|>Hi.<|startoftranscript|><|notimestamps|>"


def test_multilingual_checkpoints_keep_vllms_prompt():
    assert _prompt(51_865) == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
