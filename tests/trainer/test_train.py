"""`vllm-dp train`: config validation, records, the spent budget, export, and a resumed run equal
to an uninterrupted one (same seed: the noise generator continues, it never replays a draw)."""

import json

import pytest
import torch

from vllm_dp_plugin.trainer.train import REPORT, TrainConfig, make_records, plan_run, train

SHAPE = {"vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from vllm_dp_plugin.demo import DemoLlamaShape, make_demo_llama, public_corpus

    root = tmp_path_factory.mktemp("train")
    model = make_demo_llama(root / "llama", DemoLlamaShape(**SHAPE))
    data = root / "data.txt"
    data.write_text("\n\n".join(doc[:400] for doc in public_corpus()[:60]))
    return model, data


def config(tiny_llama, out, **overrides):
    model, data = tiny_llama
    return TrainConfig(**{"model": str(model), "output_dir": str(out), "data": str(data), "seq_len": 16,
                          "epsilon": 4.0, "epochs": 0.3, "batch_size": 32, "max_physical_batch": 16, "seed": 0,
                          "checkpoint_every": 100, **overrides})


def test_bad_options_are_refused_with_their_name(tmp_path, tiny_llama):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\noutput_dir: o\nlearning_rat: 0.1\n")
    with pytest.raises(ValueError, match="learning_rat"):
        TrainConfig.from_file(bad)
    with pytest.raises(ValueError, match="epsilon"):
        config(tiny_llama, tmp_path, epsilon=0.0)
    with pytest.raises(ValueError, match="batch_size 10000 exceeds"):
        plan_run(config(tiny_llama, tmp_path, batch_size=10000), 100)


def test_records_are_windows_with_bos_and_masked_padding(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama[0])
    docs = ["alpha beta gamma delta " * 5, "x"]
    records = make_records(docs, tokenizer, seq_len=8)
    first = [tokenizer.bos_token_id] + tokenizer.encode(docs[0], add_special_tokens=False)
    assert records.ids[0].tolist() == first[:8]
    n = len(first)
    assert len(records) == -(-n // 8) + 1  # the windows of doc 0, then "<s> x"
    last = records.mask[-1].sum()
    assert int(last) == 2 and (records.labels[-1, 2:] == -100).all()


def test_training_spends_the_target_and_exports_a_servable_directory(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    cfg = config(tiny_llama, tmp_path)
    result = train(cfg, progress=False)
    assert 0.97 * cfg.epsilon <= result["epsilon"] <= cfg.epsilon  # calibrated, never over
    assert result["delta"] == pytest.approx(1 / (2 * result["records"]))
    assert json.loads((tmp_path / REPORT).read_text()) == result
    assert json.loads((tmp_path / "model" / REPORT).read_text()) == result
    assert result["secure_mode"] is False and "secure_release" not in result
    assert not (tmp_path / "checkpoint.pt").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    start = AutoModelForCausalLM.from_pretrained(tiny_llama[0])
    assert not torch.equal(model.model.norm.weight, start.model.norm.weight)  # it trained


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, tiny_llama):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    full = train(config(tiny_llama, whole), progress=False)
    stopped = train(config(tiny_llama, parts), progress=False, stop_after=2)
    assert stopped["stopped_at"] == 2 and stopped["epsilon"] < full["epsilon"]
    assert train(config(tiny_llama, parts), progress=False) == full
    from safetensors.torch import load_file

    a, b = load_file(whole / "model" / "model.safetensors"), load_file(parts / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_of_another_config_is_refused(tmp_path, tiny_llama):
    train(config(tiny_llama, tmp_path), progress=False, stop_after=1)
    with pytest.raises(ValueError, match="different training config"):
        train(config(tiny_llama, tmp_path, learning_rate=0.5), progress=False)


def test_reattention_shares_the_budget_and_is_dropped_from_the_export(tmp_path, tiny_llama):
    cfg = config(tiny_llama, tmp_path, reattention=True, frequency_noise=30.0)
    result = train(cfg, progress=False)
    parts = result["training"], result["reattention_frequencies"]
    assert result["epsilon"] == pytest.approx(parts[0]["epsilon"] + parts[1]["epsilon"])
    assert 0.97 * cfg.epsilon <= result["epsilon"] <= cfg.epsilon  # the whole run within the budget
    assert result["delta"] == pytest.approx(1 / (2 * result["records"]))  # split in halves
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert "reattention" not in json.dumps(saved)  # served with plain attention
    with pytest.raises(ValueError, match="histogram alone"):
        plan_run(config(tiny_llama, tmp_path, reattention=True, frequency_noise=0.05), 500)


def test_a_resumed_reattention_run_reuses_its_released_frequencies(tmp_path, tiny_llama, monkeypatch):
    """Re-drawing the p_v histogram on resume would release it twice (seed None: fresh noise)."""
    from vllm_dp_plugin.trainer import train as train_module

    cfg = config(tiny_llama, tmp_path, reattention=True, frequency_noise=30.0, seed=None)
    train(cfg, progress=False, stop_after=1)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["token_p"]
    assert saved is not None and saved.shape == (2048,)

    def second_release(*args):
        raise AssertionError("the histogram was released again on resume")

    monkeypatch.setattr(train_module, "_release_frequencies", second_release)
    assert train(cfg, progress=False)["reattention"] is True


def test_secure_mode_is_validated_with_the_option_names(tmp_path, tiny_llama):
    good = tmp_path / "secure.yaml"
    good.write_text("model: m\noutput_dir: o\nsecure_mode: true\n")
    assert TrainConfig.from_file(good).secure_mode is True
    with pytest.raises(ValueError, match="secure_mode must be true or false"):
        config(tiny_llama, tmp_path, secure_mode="yes")
    with pytest.raises(ValueError, match="secure_mode: true needs accountant: rdp"):
        config(tiny_llama, tmp_path, secure_mode=True, accountant="pld")
    with pytest.raises(ValueError, match="does not cover reattention"):
        config(tiny_llama, tmp_path, secure_mode=True, reattention=True)


def test_secure_training_spends_the_target_at_integer_orders(tmp_path, tiny_llama):
    """Secure mode is calibrated and accounted with ``rdp_integer`` and records its grid release
    (whose effective noise multiplier is at least the calibrated one)."""
    cfg = config(tiny_llama, tmp_path, secure_mode=True)
    result = train(cfg, progress=False)
    assert result["secure_mode"] is True and result["accountant"] == "rdp_integer"
    assert 0.97 * cfg.epsilon <= result["epsilon"] <= cfg.epsilon
    assert result["secure_release"]["noise_multiplier"] >= result["noise_multiplier"]
    assert result["noise_multiplier"] >= plan_run(config(tiny_llama, tmp_path), result["records"]).noise_multiplier
    assert json.loads((tmp_path / REPORT).read_text()) == result


def test_lora_options_are_validated_with_their_names(tmp_path, tiny_llama):
    good = tmp_path / "lora.yaml"
    good.write_text("model: m\noutput_dir: o\nlora: {r: 4, alpha: 8, target_modules: [q_proj, v_proj]}\n")
    spec = TrainConfig.from_file(good).lora
    assert (spec.r, spec.alpha, spec.target_modules, spec.dropout) == (4, 8, ("q_proj", "v_proj"), 0.0)
    for bad, match in [({"r": 0}, "lora.r"), ({"alpha": -1}, "lora.alpha"), ({"rank": 4}, r"unknown option\(s\) \['rank'\]"),
                       ({"target_modules": "q_proj"}, "lora.target_modules"), ({"dropout": 1.0}, "lora.dropout"),
                       ([4], "lora must be a mapping")]:
        with pytest.raises(ValueError, match=match):
            config(tiny_llama, tmp_path, lora=bad)
    with pytest.raises(ValueError, match=r"lora.target_modules \['c_attn'\] match no nn.Linear"):
        train(config(tiny_llama, tmp_path, lora={"target_modules": ["c_attn"]}), progress=False)


def test_lora_run_exports_the_adapter_and_the_merged_model(tmp_path, tiny_llama):
    """Only the adapter trains (the base weights stay as they were), the report states the LoRA
    spec with the same guarantee, the adapter directory is peft's (vLLM's LoRA format) and the
    merged model equals base + adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = config(tiny_llama, tmp_path, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                 learning_rate=0.05)
    result = train(cfg, progress=False)
    assert result["private"] is True and 0.97 * cfg.epsilon <= result["epsilon"] <= cfg.epsilon
    assert result["lora"] == {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}
    adapter = tmp_path / "adapter"
    assert json.loads((adapter / REPORT).read_text()) == result == json.loads((tmp_path / REPORT).read_text())
    peft_config = json.loads((adapter / "adapter_config.json").read_text())
    assert peft_config["r"] == 4 and sorted(peft_config["target_modules"]) == ["q_proj", "v_proj"]
    weights = load_file(adapter / "adapter_model.safetensors")
    assert weights and all("lora_A" in k or "lora_B" in k for k in weights)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in weights.items())  # it trained

    start = AutoModelForCausalLM.from_pretrained(tiny_llama[0])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert torch.equal(exported.model.norm.weight, start.model.norm.weight)  # frozen base
    assert not torch.equal(exported.model.layers[0].self_attn.q_proj.weight, start.model.layers[0].self_attn.q_proj.weight)
    ids = torch.randint(3, 2000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = PeftModel.from_pretrained(start, adapter)(input_ids=ids).logits
        torch.testing.assert_close(exported(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_the_non_private_baseline_says_so(tmp_path, tiny_llama):
    result = train(config(tiny_llama, tmp_path, private=False), progress=False)
    assert result["private"] is False and result["epsilon"] is None and "NOT differentially private" in result["unit"]
    assert "noise_multiplier" not in result
    assert json.loads((tmp_path / "model" / REPORT).read_text()) == result
    with pytest.raises(ValueError, match="private: false"):
        config(tiny_llama, tmp_path, private=False, secure_mode=True)
    with pytest.raises(ValueError, match="private must be true or false"):
        config(tiny_llama, tmp_path, private="no")
