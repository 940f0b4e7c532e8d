"""``serving.prompt_table``: the served model's embedding table and the ``PromptPrivacy`` service
the renderer uses, with its nearest-candidate search on the configured device and the fused
CPU selection where it builds."""

import pytest
import torch

from vllm_dp_plugin.config import ConfigError, PromptPrivacyConfig
from vllm_dp_plugin.kernels.nearest_select import default_select
from vllm_dp_plugin.prompt.session import token_segments
from vllm_dp_plugin.serving.prompt_table import build_prompt_privacy, search_device


@pytest.mark.parametrize(("choice", "cuda", "expected"), [
    ("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cuda", True, "cuda")])
def test_search_device(monkeypatch, choice, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert search_device(choice) == torch.device(expected)


def test_cuda_search_without_a_cuda_device_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="search_device is cuda but this process sees no CUDA device"):
        search_device("cuda")


def test_service_of_the_demo_model_uses_the_default_cpu_search(tmp_path):
    from transformers import AutoTokenizer

    from vllm_dp_plugin.demo import make_demo_llama

    model = make_demo_llama(tmp_path / "llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = PromptPrivacyConfig(search_device="cpu", cache_history=False)
    service, info = build_prompt_privacy(str(model), tokenizer, cfg, None)
    privatizer = service.privatizer(service.options())
    assert service.device == torch.device("cpu") and privatizer.select is default_select("cpu")
    assert info.candidates == 2040
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    exact = service.privatize(token_segments(ids, [True] * len(ids), ids),
                              service.options({"dp_mechanism": "laplace", "dp_epsilon": 1e6}), seed=bytes(16))
    assert exact.ids == ids and exact.receipt.tokens_new == len(ids)


def test_history_cache_keys_are_macs_under_the_deployments_key(tmp_path):
    """Cache keys come from ``NoiseKey.mac``: another key file gives other keys (nobody without
    the key can compute them from candidate texts), and the same key file the same ones."""
    from transformers import AutoTokenizer

    from vllm_dp_plugin.demo import make_demo_llama
    from vllm_dp_plugin.prompt.session import PromptOptions

    model = make_demo_llama(tmp_path / "llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = PromptPrivacyConfig(search_device="cpu")
    caches = [build_prompt_privacy(str(model), tokenizer, cfg, str(tmp_path / name))[0].cache for name in ("a", "a", "b")]
    options = PromptOptions("trlap_corrected", 10.0, 1e-6, session="k3Jd9xQ2mPz8Lw4Vb7Nc1A")
    keys = [cache.key(options, {"kind": "completion", "start": 0}, (5, 6)) for cache in caches]
    assert keys[0] == keys[1] != keys[2] and len(keys[0]) == 32
