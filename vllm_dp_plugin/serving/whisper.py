"""vLLM's Whisper with the decoder prompt that English-only checkpoints were trained with.

vLLM's speech-to-text endpoint prompts every Whisper model with
``<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>``. English-only checkpoints
(``*.en``: vocabulary of 51,864 tokens, one fewer than the multilingual 51,865) were trained
without the language and task tokens, and given them tiny.en answers an empty transcript at
once. For those checkpoints the two tokens are dropped; multilingual models get vLLM's prompt
unchanged. Registered over ``WhisperForConditionalGeneration`` by ``plugin.install``.
"""

from __future__ import annotations

from vllm.model_executor.models.whisper import WhisperForConditionalGeneration

MULTILINGUAL_VOCAB = 51_865  # openai-whisper: a model is multilingual iff n_vocab >= 51865


def is_english_only(hf_config) -> bool:
    return getattr(hf_config, "vocab_size", MULTILINGUAL_VOCAB) < MULTILINGUAL_VOCAB


class Whisper(WhisperForConditionalGeneration):
    @classmethod
    def get_generation_prompt(cls, stt_params):
        prompt = super().get_generation_prompt(stt_params)
        if is_english_only(stt_params.model_config.hf_config):
            decoder = prompt["decoder_prompt"]
            tokens = f"<|{stt_params.language}|><|{stt_params.task_type}|>"
            decoder["prompt"] = decoder["prompt"].replace(tokens, "", 1)
        return prompt
