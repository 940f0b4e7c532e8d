"""The DP path reads vLLM's CPU KV cache exactly as its kernels wrote it (K blocks may be stored
dimension-major): rows written by `cpu_attn_reshape_and_cache` come back by position."""

from types import SimpleNamespace

import pytest
import torch


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kv_returns_the_rows_the_kernel_wrote(dtype):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_dp_plugin.attention.paged import gather_spans
    from vllm_dp_plugin.serving.backend import DPCPUImpl, dp_attn_isa

    blocks, heads, block_size, d = 5, 2, 32, 64
    isa = dp_attn_isa(_get_attn_isa(dtype, block_size, d, "auto"))  # bf16 on AMX CPUs: amx -> vec
    kv_cache = torch.zeros(blocks, heads, block_size, 2 * d, dtype=dtype)
    key_cache, value_cache = kv_cache.view(blocks, heads, 2 * block_size, d).chunk(2, dim=2)
    n = 70
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(n, heads, d, generator=g).to(dtype), torch.randn(n, heads, d, generator=g).to(dtype)
    table = torch.tensor([3, 1, 4])
    pos = torch.arange(n)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, table[pos // block_size] * block_size
                                   + pos % block_size, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    keys, values = DPCPUImpl._paged_kv(None, kv_cache, SimpleNamespace(isa=isa))
    spans = gather_spans(keys, values, table[None], torch.tensor([10]), torch.tensor([n]))
    valid = spans.valid[0]
    assert torch.equal(spans.k[0].transpose(0, 1)[valid], k[10:])
    assert torch.equal(spans.v[0].transpose(0, 1)[valid], v[10:])
