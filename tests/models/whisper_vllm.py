"""Serve an imported Whisper tiny.en directory with ``vllm.LLM`` (stock vLLM, no plugin) and
transcribe espeak-ng speech; prints one ``RESULT {json}`` line (transcriptions, WER, timings).

A script, not a test module (CPU vLLM forces spawn, hence the __main__ guard; an engine start
takes about a minute on 2 cores):

    .venv/bin/vllm-dp import-model whisper-tiny-en /tmp/whisper-tiny-en
    VLLM_PLUGINS= .venv/bin/python tests/models/whisper_vllm.py /tmp/whisper-tiny-en

Two prompt forms are run on the same audio: the explicit encoder/decoder prompt that
``tests/serving/dp_engine.py`` uses (decoder ``<|startoftranscript|><|notimestamps|>``, as
tiny.en has no language or task tokens) and the implicit one (text prompt
``<|startoftranscript|>`` with the audio, vLLM builds the encoder side).
"""

import json
import os
import sys
import time

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please send the report to the finance team before Friday.",
    "The weather today is cold and windy with a chance of rain.",
]
DECODER_PROMPT = "<|startoftranscript|><|notimestamps|>"


def main(model: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_dp_plugin.models.speech import synthesize, word_error_rate
    from vllm_dp_plugin.serving.memory import kv_cache_args

    audios = [(synthesize(text), 16000) for text in SENTENCES]
    started = time.monotonic()
    llm = LLM(model=model, dtype="float32", max_model_len=448, enforce_eager=True,
              limit_mm_per_prompt={"audio": 1}, seed=0, **kv_cache_args(model, 448))
    load_s = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=64)
    forms = {
        "explicit": [{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": audio}},
                      "decoder_prompt": DECODER_PROMPT} for audio in audios],
        "implicit": [{"prompt": "<|startoftranscript|>", "multi_modal_data": {"audio": audio}}
                     for audio in audios],
    }
    result = {"load_s": round(load_s, 1), "references": SENTENCES}
    for form, prompts in forms.items():
        started = time.monotonic()
        outputs = llm.generate(prompts, params)
        texts = [output.outputs[0].text for output in outputs]
        result[form] = {"texts": texts, "wer": word_error_rate(SENTENCES, texts),
                        "token_ids": [list(output.outputs[0].token_ids) for output in outputs],
                        "generate_s": round(time.monotonic() - started, 1)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_PLUGINS", "")
    main(sys.argv[1])
