"""`vllm-dp serve --dp-config`: one YAML file becomes vLLM's flags, or a clear error."""

import json

import pytest
import yaml

from vllm_dp_plugin.cli import main
from vllm_dp_plugin.config import ConfigError
from vllm_dp_plugin.serving.launch import allow_plugin, serve_arguments
from vllm_dp_plugin.serving.settings import PLUGIN_NAME, TOKENIZER_MODE

SECTION = {
    "key_file": "noise.key",
    "attention": {"epsilon": 4.0, "delta": 1e-6, "private_context": "context.txt",
                  "bounds": {"key_bound": 1.0, "query_bound": 1.0, "value_bound": 1.0}},
}


@pytest.fixture
def dp_yaml(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": SECTION}))
    return path


def test_config_becomes_additional_config_and_tokenizer_mode_with_absolute_paths(dp_yaml, tmp_path):
    args = serve_arguments(["MODEL", "--port", "9"], str(dp_yaml))
    assert args[:3] == ["MODEL", "--port", "9"]
    raw = json.loads(args[args.index("--additional-config") + 1])["dp_privacy"]
    assert raw["key_file"] == str(tmp_path / "noise.key")
    assert raw["attention"]["private_context"] == str(tmp_path / "context.txt")
    assert args[args.index("--tokenizer-mode") + 1] == TOKENIZER_MODE


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--additional-config", "{}"], "not both"),
        (["--tokenizer-mode", "hf"], "dp_private is required by a private context"),
    ],
)
def test_conflicting_flags_are_refused(dp_yaml, extra, match):
    with pytest.raises(ConfigError, match=match):
        serve_arguments(["MODEL", *extra], str(dp_yaml))


@pytest.mark.parametrize("mode,embeds", [("tokens", False), ("embeddings", True)])
def test_prompt_only_config_gets_the_renderer(tmp_path, mode, embeds):
    path = tmp_path / "prompt.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": {"prompt": {"epsilon": 10.0, "mode": mode}}}))
    args = serve_arguments(["MODEL"], str(path))
    assert args[args.index("--tokenizer-mode") + 1] == TOKENIZER_MODE
    assert ("--enable-prompt-embeds" in args) == embeds
    with pytest.raises(ConfigError, match="required by prompt privatization"):
        serve_arguments(["MODEL", "--tokenizer-mode", "auto"], str(path))


def test_plugin_allowlist(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    allow_plugin()
    import os

    assert os.environ["VLLM_PLUGINS"] == f"other,{PLUGIN_NAME}"
    allow_plugin()
    assert os.environ["VLLM_PLUGINS"] == f"other,{PLUGIN_NAME}"


def test_bad_config_is_a_clear_startup_error_before_vllm_starts(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"dp_privacy": {"attention": {"epsilon": 0, "delta": 1e-6}}}))
    assert main(["serve", "MODEL", "--dp-config", str(bad)]) == 2
    assert "attention.epsilon must be > 0" in capsys.readouterr().err


def test_bundled_serve_config_is_valid_and_its_context_exists():
    from vllm_dp_plugin.serving.launch import resolved_config

    raw = resolved_config("examples/serve-dp.yaml")
    assert raw["attention"]["private_context"].endswith("examples/private_context.txt")
    with open(raw["attention"]["private_context"]) as handle:
        assert handle.read().strip()


@pytest.mark.parametrize(
    "extra,option",
    [
        (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
        (["--kv-events-config={}"], "--kv-events-config"),
        (["--enable-lora"], "--enable-lora"),
        (["--runner", "pooling"], "--runner"),
        (["--config", "more-options.yaml"], "--config"),
        (["--enable-return-routed-experts"], "--enable-return-routed-experts"),
        (["-O3"], "-O3"),
    ],
)
def test_options_outside_the_allowlist_are_refused_with_a_private_context(dp_yaml, monkeypatch, extra, option):
    monkeypatch.setattr("vllm_dp_plugin.serving.launch._on_cuda", lambda: False)
    with pytest.raises(ConfigError, match=f"option\\(s\\) {option} cannot be used while a private context"):
        serve_arguments(["MODEL", *extra], str(dp_yaml))


def test_allowlisted_options_pass_and_prompt_only_is_not_restricted(dp_yaml, tmp_path, monkeypatch):
    monkeypatch.setattr("vllm_dp_plugin.serving.launch._on_cuda", lambda: False)
    argv = ["MODEL", "--max-model-len", "4096", "--no-enable-prefix-caching", "-tp", "2", "--port=9"]
    assert serve_arguments(argv, str(dp_yaml))[: len(argv)] == argv
    path = tmp_path / "prompt.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": {"prompt": {"epsilon": 10.0}}}))
    serve_arguments(["MODEL", "--speculative-config", "{}"], str(path))  # prompt-only: no private positions


def test_cuda_gets_the_dp_backend_and_refuses_another(dp_yaml, monkeypatch):
    monkeypatch.setattr("vllm_dp_plugin.serving.launch._on_cuda", lambda: True)
    args = serve_arguments(["MODEL"], str(dp_yaml))
    assert args[args.index("--attention-backend") + 1] == "CUSTOM"
    assert serve_arguments(["MODEL", "--attention-backend", "CUSTOM"], str(dp_yaml)).count("--attention-backend") == 1
    with pytest.raises(ConfigError, match="must be CUSTOM"):
        serve_arguments(["MODEL", "--attention-backend=FLASH_ATTN"], str(dp_yaml))
    monkeypatch.setattr("vllm_dp_plugin.serving.launch._on_cuda", lambda: False)
    assert "--attention-backend" not in serve_arguments(["MODEL"], str(dp_yaml))  # CPU ignores it


def test_aggregate_serving_raises_max_logprobs_and_keeps_the_allowlist(tmp_path):
    from vllm_dp_plugin.serving.launch import logprob_flags

    assert logprob_flags([], None) == ["--max-logprobs", "-1"]  # vote reads the whole public distribution
    assert logprob_flags([], 64) == ["--max-logprobs", "64"]
    assert logprob_flags(["--max-logprobs", "-1"], 64) == []
    with pytest.raises(ConfigError, match="max-logprobs"):
        logprob_flags(["--max-logprobs=100"], None)
    config = tmp_path / "dp.yaml"
    config.write_text(yaml.safe_dump({"dp_privacy": {"aggregate": {"contexts": {"d": "d.jsonl"}}}}))
    argv = serve_arguments(["model"], str(config))
    assert argv[argv.index("--max-logprobs") + 1] == "-1" and "--tokenizer-mode" not in argv
    with pytest.raises(ConfigError, match="speculative-config"):
        serve_arguments(["model", "--speculative-config", "{}"], str(config))
