"""Public calibration of DP attention bounds: capture, bounds, file format, Whisper."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

from vllm_dp_plugin.attention.calibration_file import FORMAT, Calibration, CalibrationError
from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.calibration import (
    _capturing,
    calibrate_model,
    capture_attention,
    fold_queries,
    main,
    token_chunks,
)
from vllm_dp_plugin.demo import make_demo_llama, public_corpus

MAX_TOKENS, SEQ_LEN = 192, 64


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_demo_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def llama_cal(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "llama.json"
    return calibrate_model(llama_dir, out, max_tokens=MAX_TOKENS, seq_len=SEQ_LEN), out


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def test_captured_keys_and_queries_are_post_rope(llama):
    model, tokenizer = llama
    ids = token_chunks(tokenizer, public_corpus(), 32, 32)[0]  # [1, 32]
    q, k, v = capture_attention(model, [{"input_ids": ids}])["self_attention"][0]
    cfg, layer = model.config, model.model.layers[0]
    d, n = cfg.head_dim, ids.shape[1]
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(ids))[0]  # [n, hidden]
        heads = lambda t: t.view(n, -1, d).transpose(0, 1)  # [H, n, d]
        attn = layer.self_attn
        pre_q, pre_k, ref_v = (heads(p(x)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        # RoPE by hand: angle(pos, i) = pos * theta^(-2i/d), halves rotated together.
        theta = cfg.rope_parameters["rope_theta"]
        inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        rope = lambda t: t * cos + _rotate_half(t) * sin
    assert k.shape == (cfg.num_key_value_heads, n, d) and q.shape == (cfg.num_attention_heads, n, d)
    assert torch.allclose(k, rope(pre_k), atol=1e-5)
    assert torch.allclose(q, rope(pre_q), atol=1e-5)
    assert torch.allclose(v, ref_v, atol=1e-6)
    assert not torch.allclose(k, pre_k, atol=1e-3)  # the check would catch pre-RoPE keys
    assert model.config._attn_implementation == "sdpa"  # restored after capture


def test_capture_leaves_outputs_unchanged(llama):
    model, tokenizer = llama
    ids = token_chunks(tokenizer, public_corpus(), 16, 16)[0]
    with torch.no_grad():
        before = model(ids).logits
    with _capturing(model), torch.no_grad():
        during = model(ids).logits
    assert torch.allclose(before, during, atol=1e-6)


def test_fold_queries_groups_query_heads_on_their_kv_head():
    q = torch.arange(4.0)[:, None, None].expand(4, 3, 2)  # head h filled with h
    folded = fold_queries(q, 2)
    assert folded.shape == (2, 6, 2)
    assert (folded[0] < 2).all() and (folded[1] >= 2).all()  # h // (4 // 2)
    with pytest.raises(ValueError, match="multiple"):
        fold_queries(torch.zeros(3, 1, 2), 2)


def test_bounds_equal_head_mapping_calibrate_on_captured_tensors(llama, llama_cal):
    model, tokenizer = llama
    cal, _ = llama_cal
    chunks = token_chunks(tokenizer, public_corpus(), MAX_TOKENS, SEQ_LEN)
    captured = capture_attention(model, [{"input_ids": c} for c in chunks])
    assert cal.num_tokens == MAX_TOKENS == sum(c.shape[1] for c in chunks)
    assert cal.num_layers("self_attention") == model.config.num_hidden_layers
    assert cal.num_layers("cross_attention") == 0
    for layer, (q, k, v) in captured["self_attention"].items():
        beta = model.model.layers[layer].self_attn.scaling
        ref = HeadMapping.calibrate(k, fold_queries(q, k.shape[0]), v, beta, cal.quantile)
        got = cal.mapping("self_attention", layer)
        for name in ("beta", "key_bound", "query_bound", "value_bound", "key_norm", "query_norm"):
            assert getattr(got, name) == pytest.approx(getattr(ref, name), rel=1e-9), name
        assert got.key_center.shape == (model.config.num_key_value_heads, model.config.head_dim)
        assert torch.allclose(got.key_center, ref.key_center, atol=1e-12)


def test_json_round_trip(llama_cal, tmp_path):
    cal, path = llama_cal
    loaded = Calibration.from_file(path)
    assert loaded == cal
    again = Calibration.from_file(loaded.to_file(tmp_path / "again.json"))
    assert again == cal and again.to_json() == cal.to_json()
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["cross_attention"] == []
    assert [e["layer"] for e in doc["self_attention"]] == [0, 1]


def _write(tmp_path, doc):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    return path


def test_bad_files_raise_clear_errors(llama_cal, tmp_path):
    cal, path = llama_cal
    doc = json.loads(path.read_text())
    bad = _write(tmp_path, {**doc, "format": "vllm-dp-calibration/0"})
    with pytest.raises(CalibrationError, match=r"bad\.json.*'format'"):
        Calibration.from_file(bad)
    entry = {k: v for k, v in doc["self_attention"][0].items() if k != "key_bound"}
    bad = _write(tmp_path, {**doc, "self_attention": [entry]})
    with pytest.raises(ValueError, match=r"bad\.json.*self_attention.*'key_bound'"):
        Calibration.from_file(bad)
    entry = {**doc["self_attention"][0], "value_bound": -1.0}
    with pytest.raises(ValueError, match=r"bad\.json.*layer 0.*value_bound"):
        Calibration.from_file(_write(tmp_path, {**doc, "self_attention": [entry]}))
    entry = {**doc["self_attention"][0], "key_center": [[0.0, 1.0], [2.0]]}
    with pytest.raises(ValueError, match=r"bad\.json.*key_center"):
        Calibration.from_file(_write(tmp_path, {**doc, "self_attention": [entry]}))
    with pytest.raises(ValueError, match=r"bad\.json.*missing field 'num_tokens'"):
        Calibration.from_file(_write(tmp_path, {k: v for k, v in doc.items() if k != "num_tokens"}))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"junk\.json.*not valid JSON"):
        Calibration.from_file(tmp_path / "junk.json")
    with pytest.raises(KeyError, match="no self_attention layer 7"):
        cal.mapping("self_attention", 7)
    with pytest.raises(KeyError, match="no cross_attention layer 0"):
        cal.mapping("cross_attention", 0)
    with pytest.raises(ValueError, match="unknown attention kind"):
        cal.mapping("encoder", 0)


def test_cli_prints_a_summary(llama_dir, tmp_path, capsys):
    text = tmp_path / "public.txt"
    text.write_text(public_corpus()[1])
    out = tmp_path / "cli.json"
    assert main([str(llama_dir), "--out", str(out), "--text", str(text), "--max-tokens", "64"]) == 0
    printed = capsys.readouterr().out
    assert "self_attention  layer   1" in printed and "T=" in printed
    cal = Calibration.from_file(out)
    assert cal.num_tokens == 64 and "public.txt" in cal.source


# --------------------------------------------------------------------------------------------
# Whisper
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    config = WhisperConfig(
        vocab_size=100,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=64,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("whisper")
    WhisperForConditionalGeneration(config).save_pretrained(out)
    return out


def test_whisper_yields_self_and_cross_attention(whisper_dir, tmp_path):
    cal = calibrate_model(whisper_dir, tmp_path / "w.json", seq_len=8)
    assert cal.num_layers("self_attention") == cal.num_layers("cross_attention") == 2
    assert cal.num_tokens == 8 and "log-mel" in cal.source
    for kind in ("self_attention", "cross_attention"):
        for layer in range(2):
            m = cal.mapping(kind, layer)
            assert m.key_center.shape == (4, 16) and m.beta == pytest.approx(16**-0.5)
    assert Calibration.from_file(tmp_path / "w.json") == cal


def test_whisper_cross_attention_capture_reproduces_the_attention_weights(whisper_dir):
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32)
    feats = torch.rand(1, 80, 3000, generator=torch.Generator().manual_seed(1)) * 2 - 1
    ids = torch.tensor([[1, 5, 6, 7]])
    captured = capture_attention(model, [{"input_features": feats, "decoder_input_ids": ids}])
    q, k, v = captured["cross_attention"][1]
    assert k.shape == v.shape == (4, 1500, 16)  # n = encoder frames
    assert q.shape == (4, 4, 16)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(input_features=feats, decoder_input_ids=ids, output_attentions=True)
    beta = model.model.decoder.layers[1].encoder_attn.scaling
    weights = torch.softmax(beta * q @ k.transpose(1, 2), dim=-1)  # q is unscaled, like vLLM's
    assert torch.allclose(weights, out.cross_attentions[1][0], atol=1e-5)


def test_whisper_with_feature_extractor_uses_public_audio(whisper_dir, tmp_path):
    WhisperFeatureExtractor(feature_size=80).save_pretrained(whisper_dir)
    try:
        cal = calibrate_model(whisper_dir, tmp_path / "w.json", seq_len=4)
    finally:
        (whisper_dir / "preprocessor_config.json").unlink()
    assert "audio" in cal.source and cal.num_tokens == 2 * 4  # two public clips
    with pytest.raises(ValueError, match="texts"):
        calibrate_model(whisper_dir, tmp_path / "x.json", texts=["private?"])
