"""The real models through `vllm-dp serve` (one server each): SmolLM2-135M-Instruct with the
bundled private context (`make serve`'s configuration), Whisper tiny.en transcribing espeak-ng
speech. The conversions are reused from `.models/` when complete (`make real-models`)."""

import json
import shutil
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.serving.engines import vllm_dp_server
from vllm_dp_plugin.models import ModelImportError, import_model

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager"]
SENTENCES = ["The weather today is cold and windy with a chance of rain.",
             "Please send the report to the finance team before Friday."]


def real_model(name: str) -> Path:
    try:
        return import_model(name, REPO / ".models" / name)
    except ModelImportError as exc:
        pytest.skip(str(exc))  # only without the weight packages (make install brings them)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())


@pytest.mark.vllm
def test_smollm2_serves_the_bundled_private_context(tmp_path):
    """The DP attention example on SmolLM2 (`DP_CONFIG=examples/serve-smollm2.yaml make serve`):
    the public gate finds no (layer, KV head) whose
    release could carry information at eps = 8 (the public bounds' kernel error is unbounded),
    so nothing is released or spent, the context is not served at all (requests are answered
    exactly as without it) and the start-up log and the budget say so."""
    model = real_model("smollm2-135m-instruct")
    section = yaml.safe_load((REPO / "examples/serve-smollm2.yaml").read_text())["dp_privacy"]
    section["attention"]["private_context"] = str(REPO / "examples" / section["attention"]["private_context"])
    section["attention"]["calibration"] = str(REPO / ".models/smollm2-135m-instruct-calibration.json")  # public text
    section |= {"key_file": str(tmp_path / "noise.key")}
    config = tmp_path / "dp.yaml"
    config.write_text(yaml.safe_dump({"dp_privacy": section}))
    log = tmp_path / "serve.log"
    with vllm_dp_server([str(model), "--dp-config", str(config), "--max-model-len", "2048", *FLAGS], log,
                        timeout=900) as base:  # a first run calibrates (about 2 min)
        chat = post(base + "/v1/chat/completions", {
            "model": str(model), "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "When does the Seattle warehouse close?"}]})
        assert chat["choices"][0]["message"]["content"].strip()
        assert chat["usage"]["prompt_tokens"] < 60  # the template's default system turn + the question: no context
        public = post(base + "/v1/chat/completions", {
            "model": str(model), "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert "Paris" in public["choices"][0]["message"]["content"]  # garbage before the gate
        with urllib.request.urlopen(base + "/v1/dp/budget") as reply:
            budget = json.loads(reply.read())
    (context,) = budget["contexts"]
    assert (context["layers"], context["kv_heads"], context["public_head_tokens"]) == (30, 3, 3)
    assert context["releases"] == 0 and context["spent"] == {"epsilon": 0.0, "delta": 0.0}
    assert context["regime"].startswith("out of regime")
    text = log.read_text()
    assert "out of regime" in text and "no private context is served" in text  # the start-up log says it plainly
    assert "Laura Callahan" not in text and "dairy" not in text  # no private text in the log


@pytest.mark.vllm
def test_whisper_tiny_en_transcribes_speech_through_the_server(tmp_path):
    """Whisper tiny.en served by `vllm-dp serve` (plugin loaded, no DP section) transcribes
    espeak-ng speech through /v1/audio/transcriptions (the plugin drops the language and task
    tokens vLLM puts in the prompt, which English-only checkpoints never saw) with a word error
    rate <= 0.25 (tiny.en on espeak's voice: 0.097 over three
    sentences, the same words in transformers and vLLM)."""
    from vllm_dp_plugin.models.speech import synthesize, word_error_rate

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng; make install does it as root)")
    model = real_model("whisper-tiny-en")
    clips = [tmp_path / f"clip{i}.wav" for i in range(len(SENTENCES))]
    for text, clip in zip(SENTENCES, clips, strict=True):
        synthesize(text, clip)
    import requests

    flags = ["--max-model-len", "448", "--limit-mm-per-prompt", '{"audio": 1}', *FLAGS]
    with vllm_dp_server([str(model), *flags], tmp_path / "serve.log", timeout=900) as base:
        heard = [requests.post(base + "/v1/audio/transcriptions", timeout=300,
                               files={"file": (clip.name, clip.read_bytes(), "audio/wav")},
                               # language given: vLLM's language detection asserts on an .en model
                               data={"model": str(model), "language": "en", "temperature": "0"}).json()["text"]
                 for clip in clips]
    assert word_error_rate(SENTENCES, heard) <= 0.25, heard
