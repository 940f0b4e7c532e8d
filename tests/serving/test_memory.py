"""The KV cache of every engine the project starts is sized in bytes (``serving.memory``): the
formula, the override, ``vllm-dp serve``'s default on CPU, no fraction hard-coded elsewhere, and an
engine that starts on a small NUMA node where a fraction of it does not."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dp_plugin.serving import launch, memory
from vllm_dp_plugin.serving.memory import (
    KV_BYTES_ENV,
    kv_cache_args,
    kv_cache_bytes,
    kv_shape,
    parse_bytes,
)

REPO = Path(__file__).resolve().parents[2]
NODE_GIB = 2  # what vLLM-CPU's memory probe reports for node 0 in the small-node engine test
MIB = 1 << 20


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(KV_BYTES_ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A config-only Llama directory (no weights): 6 layers, 4 KV heads of 96 dims, 2048 positions."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama")
    LlamaConfig(hidden_size=768, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=6,
                intermediate_size=64, vocab_size=128, max_position_embeddings=2048).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from transformers import WhisperConfig

    path = tmp_path_factory.mktemp("whisper")
    WhisperConfig(d_model=256, decoder_attention_heads=4, decoder_layers=3, encoder_layers=1,
                  max_source_positions=1500, max_target_positions=448).save_pretrained(path)
    return str(path)


def expected(layers, heads, dim, tokens, dtype_bytes=4):
    return max(64 * MIB, math.ceil(1.25 * tokens * 2 * layers * heads * dim * dtype_bytes / MIB) * MIB)


def test_bytes_are_sequences_of_tokens_of_kv_rows(llama):
    shape = kv_shape(llama)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.max_positions) == (6, 4, 96, 2048)
    assert kv_cache_bytes(llama, 2048, sequences=8) == expected(6, 4, 96, 8 * 2048)
    assert kv_cache_bytes(llama, None, sequences=8) == expected(6, 4, 96, 8 * 2048)  # the model's own maximum
    assert kv_cache_bytes(llama, 1024, sequences=8, dtype="bfloat16") == expected(6, 4, 96, 8 * 1024, 2)
    # shorter sequences, but never less than one of max_model_len (vLLM refuses to start otherwise)
    assert kv_cache_bytes(llama, 2048, sequences=16, tokens=300) == expected(6, 4, 96, 16 * 300)
    assert kv_cache_bytes(llama, 2048, sequences=2, tokens=300) == expected(6, 4, 96, 2048)
    assert kv_cache_args(llama, 1024, 8) == {"kv_cache_memory_bytes": expected(6, 4, 96, 8 * 1024)}
    assert kv_cache_bytes(llama, 16, sequences=1) == 64 * MIB  # the floor
    with pytest.raises(ValueError, match="dtype 'int3'"):
        kv_cache_bytes(llama, 1024, dtype="int3")


def test_encoder_decoder_caches_self_and_cross_attention_of_every_encoder_frame(whisper):
    shape = kv_shape(whisper)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.min_tokens, shape.max_positions) == (6, 4, 64, 1500, 448)
    assert kv_cache_bytes(whisper, 448, sequences=4) == expected(6, 4, 64, 4 * 1500)


@pytest.mark.parametrize("text,value", [("123456789", 123456789), ("512MiB", 512 * MIB), ("2 GiB", 2 << 30),
                                        ("1.5GB", 1_500_000_000), ("2048kib", 2 << 20)])
def test_override_in_bytes_wins_everywhere(llama, monkeypatch, text, value):
    assert parse_bytes(text) == value
    monkeypatch.setenv(KV_BYTES_ENV, text)
    assert kv_cache_bytes(llama, 2048, sequences=64) == value


@pytest.mark.parametrize("text", ["0", "-5", "2 GiBs", "lots", "0.25", "512"])
def test_a_bad_override_is_refused_naming_the_variable(llama, monkeypatch, text):
    monkeypatch.setenv(KV_BYTES_ENV, text)
    with pytest.raises(ValueError, match=f"{KV_BYTES_ENV}=.*expected bytes"):
        kv_cache_bytes(llama, 2048)


def test_vllm_dp_serve_sizes_the_cache_on_cpu_only_when_nothing_else_does(llama, monkeypatch):
    monkeypatch.setattr(launch, "_on_cuda", lambda: False)
    four = str(expected(6, 4, 96, memory.DEFAULT_SEQUENCES * 1000))
    assert launch.sized_kv_cache([llama, "--max-model-len", "1k"]) == [llama, "--max-model-len", "1k",
                                                                        "--kv-cache-memory-bytes", four]
    assert launch.sized_kv_cache(["--model", llama, "--max-model-len=1000", "--dtype", "float32"])[-1] == four
    assert launch.sized_kv_cache([llama])[-1] == str(expected(6, 4, 96, memory.DEFAULT_SEQUENCES * 2048))
    for given in (["--gpu-memory-utilization", "0.5"], ["--kv-cache-memory-bytes=123456789"]):
        assert launch.sized_kv_cache([llama, *given]) == [llama, *given]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert launch.sized_kv_cache([llama]) == [llama]
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.setattr(launch, "_on_cuda", lambda: True)
    assert launch.sized_kv_cache([llama]) == [llama]


FRACTION = re.compile(r"gpu[-_]memory[-_]utilization[\"']?\s*[=:,]?\s*[\"']?[0-9.]+|VLLM_CPU_KVCACHE_SPACE\s*[=:]")


def test_no_engine_sizes_its_cache_as_a_fraction_of_memory():
    """Every engine the project starts (tests, benchmarks, make serve, examples, scripts) gets its KV
    cache from serving.memory; a hard-coded fraction of node 0 breaks on the next machine."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    code = [p for p in tracked if p.endswith((".py", ".sh", ".yaml", ".yml", ".toml", ".json")) or p == "Makefile"]
    assert len(code) > 100
    found = [f"{p}: {m.group(0)}" for p in code if not p.startswith("benchmarks/results/")
             for m in FRACTION.finditer((REPO / p).read_text(errors="replace")) if p != "tests/serving/test_memory.py"]
    assert found == []
    assert FRACTION.search('"gpu_memory_utilization": 0.15') and FRACTION.search("--gpu-memory-utilization 0.25")


def small_node_engine(model: str, llm: dict) -> tuple[dict, str]:
    """(the script's result, its output: vLLM logs the engine core's root cause there)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", KV_BYTES_ENV)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("small_node_engine.py")),
                           json.dumps({"model": model, "llm": llm})],
                          env={**env, "VLLM_PLUGINS": "", "SMALL_NODE_GIB": str(NODE_GIB)},
                          capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, (proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout + proc.stderr


@pytest.mark.vllm
def test_an_engine_sized_in_bytes_starts_on_a_small_node_where_a_fraction_does_not(tmp_path):
    from vllm_dp_plugin.demo import make_demo_llama

    model = str(make_demo_llama(tmp_path / "llama"))
    engine = {"dtype": "float32", "max_model_len": 1024, "block_size": 32, "enforce_eager": True, "seed": 0}
    fraction, log = small_node_engine(model, {**engine, "gpu_memory_utilization": 0.15})
    assert "error" in fraction and "Available memory on node 0 (" in log, log[-3000:]  # the failure
    assert f"/{float(NODE_GIB)} GiB)" in log  # on the patched node
    sized, log = small_node_engine(model, {**engine, **kv_cache_args(model, 1024)})
    assert len(sized.get("token_ids", [])) == 4, (sized, log[-3000:])
