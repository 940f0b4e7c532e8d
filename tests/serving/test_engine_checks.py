"""Start-up checks on real ``VllmConfig`` objects (built by vLLM's ``EngineArgs``, no engine):
engine features refused with a private context, what identifies a release (and keys its noise),
the release ledger, the budget's public label, and the layer check across workers."""

import json
import shutil

import pytest

pytest.importorskip("vllm")

from vllm_dp_plugin.config import ConfigError
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey, context_id
from vllm_dp_plugin.serving import settings
from vllm_dp_plugin.serving.verify import check_layers

from .engines import dp_section


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from vllm_dp_plugin.demo import make_demo_llama

    return make_demo_llama(tmp_path_factory.mktemp("demo") / "llama")


def vllm_config(model, section=None, **engine):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = {"model": str(model), "dtype": "float32", "max_model_len": 1024, "block_size": 32,
              "enforce_eager": True, "tokenizer_mode": "dp_private"}
    if section is not None:
        kwargs["additional_config"] = {"dp_privacy": section}
    return EngineArgs(**kwargs, **engine).create_engine_config()


@pytest.mark.parametrize(
    "engine,match",
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
         "speculative_config"),
        ({"kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"}}, "kv_events_config"),
        ({"enable_lora": True}, "lora_config"),
        ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}}, "kv_transfer_config"),
        ({"runner": "pooling", "convert": "embed"}, "pooling returns hidden states"),
    ],
)
def test_engine_features_that_read_private_positions_are_refused(demo_model, tmp_path, engine, match):
    config = vllm_config(demo_model, dp_section(tmp_path, 2.0), **engine)
    with pytest.raises(ConfigError, match=match):
        settings.check_serving(config, settings.dp_config(config))


def test_plain_engine_and_disabled_kv_events_pass(demo_model, tmp_path):
    section = dp_section(tmp_path, 2.0)
    settings.check_serving(vllm_config(demo_model, section), settings.dp_config(vllm_config(demo_model, section)))
    config = vllm_config(demo_model, section, kv_events_config={"enable_kv_cache_events": False})
    settings.check_engine_options(config)


def test_routed_experts_are_refused(demo_model, tmp_path):
    config = vllm_config(demo_model, dp_section(tmp_path, 2.0))
    config.aux_output_config.enable_return_routed_experts = True
    with pytest.raises(ConfigError, match="routed experts"):
        settings.check_engine_options(config)


def identity(model, section):
    (context,) = settings.private_contexts(vllm_config(model, section))
    return context.identity


def test_release_identity_follows_what_the_state_depends_on_not_paths(demo_model, tmp_path):
    """Re-training into the same directory or changing a bound gives another release (new
    noise); the same weights and context under other paths give the same release."""
    section = dp_section(tmp_path, 2.0)
    base = identity(demo_model, section)
    moved_model = shutil.copytree(demo_model, tmp_path / "moved" / "llama")
    moved_context = tmp_path / "moved" / "context.txt"
    shutil.copy(section["attention"]["private_context"], moved_context)
    moved = {**section, "attention": {**section["attention"], "private_context": str(moved_context)}}
    assert identity(moved_model, moved) == base  # a moved checkout: same release, same noise
    retrained = shutil.copytree(demo_model, tmp_path / "retrained")
    weights = next(retrained.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    other = identity(retrained, section)
    assert other.release != base.release and other.subject == base.subject
    bound = {**section, "attention": {**section["attention"],
                                      "bounds": {**section["attention"]["bounds"], "value_bound": 2.5}}}
    assert identity(demo_model, bound).release != base.release


def test_budget_label_is_keyed_not_a_hash_of_the_context(demo_model, tmp_path):
    """The label /v1/dp/budget shows: stable under one key, different under another key (an
    unkeyed hash of model, config and ids would be the same for everybody, hence testable
    against guesses), and unrelated to the secret digests."""
    section = dp_section(tmp_path, 2.0)
    config = vllm_config(demo_model, section)
    label = settings.budget_payload(config)["contexts"][0]["context"]
    assert label == settings.budget_payload(vllm_config(demo_model, section))["contexts"][0]["context"]
    other_key = {**section, "key_file": str(tmp_path / "other.key")}
    assert settings.budget_payload(vllm_config(demo_model, other_key))["contexts"][0]["context"] != label
    (context,) = settings.private_contexts(config)
    ident = context.identity
    assert ident.subject[:16] not in label and ident.release[:16] not in label
    ids = context.token_ids
    assert context_id(ids)[:12] not in label


def test_ledger_refuses_a_second_release_under_other_noise(demo_model, tmp_path):
    section = dp_section(tmp_path, 2.0)
    settings.register_release(vllm_config(demo_model, section))
    settings.register_release(vllm_config(demo_model, section))  # a restart: same release
    louder = dp_section(tmp_path, 4.0)
    with pytest.raises(ConfigError, match="already released 1 time"):
        settings.register_release(vllm_config(demo_model, louder))
    allowed = {**louder, "attention": {**louder["attention"], "allow_rerelease": True}}
    settings.register_release(vllm_config(demo_model, allowed))
    ledger = settings.budget_payload(vllm_config(demo_model, allowed))["contexts"][0]["ledger"]
    assert ledger["releases_of_this_context"] == 2
    assert ledger["total_spent"]["epsilon"] == pytest.approx(2.0 + 4.0, rel=1e-6)
    text = "".join(p.read_bytes().decode("latin-1") for p in tmp_path.glob("ledger.sqlite*"))
    assert "Bluebird" not in text and json.dumps(list(settings.private_contexts(
        vllm_config(demo_model, section))[0].token_ids[:4]))[1:-1] not in text


def test_softmax_scale_follows_a_query_pre_attention_scalar(demo_model, tmp_path):
    config = vllm_config(demo_model, dp_section(tmp_path, 2.0))
    shape = settings.ModelShape.of(config)
    assert shape.scale == pytest.approx(shape.head_dim ** -0.5)
    config.model_config.hf_text_config.query_pre_attn_scalar = 256
    assert settings.ModelShape.of(config).scale == pytest.approx(256 ** -0.5)


def report(n, *, dp=True, on=True, labels=("L",), scale=0.125, attn_type="decoder", layer="Attention"):
    return [{"name": f"model.layers.{i}.self_attn.attn", "layer": layer, "impl": "DPCPUImpl", "dp": dp,
             "on": on, "attn_type": attn_type, "labels": None if labels is None else list(labels),
             "routes_contexts": True, "scale": scale} for i in range(n)]


def test_layer_check_passes_when_every_layer_is_a_dp_impl_on_the_same_context():
    check_layers([report(2), report(2)], layers=2, labels=["L"], scale=0.125)  # two TP ranks


@pytest.mark.parametrize(
    "reports,match",
    [
        ([report(2, dp=False)], "not served by the DP attention backend"),  # CUDA without CUSTOM
        ([report(2, on=False)], "not served by the DP attention backend"),
        ([report(1) + report(1, dp=False, layer="MambaMixer2", attn_type="None")], "not served"),
        ([report(2, labels=("M",))], "different context files"),
        ([report(2, scale=0.0625)], "softmax scale"),
        ([report(1)], "1 DP layers of the model's 2"),
    ],
)
def test_layer_check_refuses_to_serve(reports, match):
    with pytest.raises(ConfigError, match=match):
        check_layers(reports, layers=2, labels=["L"], scale=0.125)


def test_whisper_layer_check_looks_at_cross_attention_only():
    cross = report(2, attn_type="encoder_decoder", labels=None)
    public = report(2, dp=False, attn_type="encoder", labels=None)
    check_layers([cross + public], layers=2, labels=None, scale=0.125)
    with pytest.raises(ConfigError, match="not served"):
        check_layers([report(2, dp=False, attn_type="encoder_decoder") + public], layers=2, labels=None, scale=0.125)


def test_init_state_refuses_an_engine_whose_layers_are_not_dp(demo_model, tmp_path):
    """The endpoint plugin's start-up: a worker answering with a non-DP layer stops the server
    before any request (today's code never asked)."""
    import asyncio
    from types import SimpleNamespace

    from vllm_dp_plugin.serving.http import DPPrivacyEndpoints

    config = vllm_config(demo_model, dp_section(tmp_path, 2.0))
    labels = [c.identity.label for c in settings.private_contexts(config)]
    scale = settings.ModelShape.of(config).scale

    class Engine:
        vllm_config = config

        def __init__(self, layers):
            self.layers = layers

        async def collective_rpc(self, method):
            assert method == "dp_privacy_layers"
            return [self.layers]

    args = SimpleNamespace(enable_log_requests=False)
    state = SimpleNamespace()
    asyncio.run(DPPrivacyEndpoints().init_state(Engine(report(2, labels=labels, scale=scale)), state, args))
    assert state.dp_guard and "/v1/completions" in state.dp_routes and state.dp_contexts == ("default",)
    with pytest.raises(ConfigError, match="not served by the DP attention backend"):
        asyncio.run(DPPrivacyEndpoints().init_state(
            Engine(report(2, dp=False, labels=labels, scale=scale)), SimpleNamespace(), args))


def test_request_logging_at_debug_is_refused(monkeypatch):
    import logging
    from types import SimpleNamespace

    from vllm_dp_plugin.serving.http import check_request_logging

    monkeypatch.setattr(logging.getLogger("vllm"), "level", logging.DEBUG)
    with pytest.raises(ConfigError, match="enable-log-requests"):
        check_request_logging(SimpleNamespace(enable_log_requests=True))
    check_request_logging(SimpleNamespace(enable_log_requests=False))


def test_noise_key_file_is_part_of_no_identity(demo_model, tmp_path):
    """The key is an HMAC key, not an input: the same context under two keys has one subject."""
    section = dp_section(tmp_path, 2.0)
    other = {**section, "key_file": str(tmp_path / "k2")}
    NoiseKey(tmp_path / "k2")
    assert identity(demo_model, section).subject == identity(demo_model, other).subject


PLAIN_LAYER = {"sliding_window": -1, "logits_soft_cap": 0, "sinks": None, "alibi_slopes": None,
               "kv_cache_dtype": "auto", "kv_sharing_target_layer_name": None}


@pytest.mark.parametrize(
    "feature,match",
    [
        ({"sliding_window": 4096}, "a sliding window"),
        ({"sliding_window": (4095, 0)}, "a sliding window"),  # Triton's form
        ({"logits_soft_cap": 30.0}, "soft-capping"),
        ({"sinks": object()}, "attention sinks"),
        ({"alibi_slopes": [0.5]}, "ALiBi"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "fp8_e4m3 KV cache"),
        ({"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}, "KV sharing"),
    ],
)
def test_layer_features_the_dp_path_ignores_are_refused(feature, match):
    from types import SimpleNamespace

    from vllm_dp_plugin.serving.backend import DPImplMixin

    DPImplMixin._check_layer_features(SimpleNamespace(**PLAIN_LAYER))
    DPImplMixin._check_layer_features(SimpleNamespace(**{**PLAIN_LAYER, "sliding_window": (-1, -1)}))
    with pytest.raises(ConfigError, match=match):
        DPImplMixin._check_layer_features(SimpleNamespace(**{**PLAIN_LAYER, **feature}))
