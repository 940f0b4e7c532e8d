"""What ``register()`` installs into vLLM (called in every vLLM process; idempotent)."""

from __future__ import annotations

from .settings import TOKENIZER_MODE

CPU_BACKEND = "vllm_dp_plugin.serving.backend.DPCPUBackend"
CUDA_BACKEND = "vllm_dp_plugin.serving.backend_cuda.DPTritonBackend"


def install() -> None:
    """Override ``CPU_ATTN`` (CPU ignores ``--attention-backend``), register ``CUSTOM`` (CUDA)
    and the ``dp_private`` tokenizer mode, each a pass-through until ``dp_privacy`` is set; give
    vLLM's workers the ``verify.LAYER_REPORT`` method (the endpoint plugin's start-up check
    calls it with ``collective_rpc``) and ``paraphrase.LOGITS_REPORT`` (the paraphrase
    mechanism's check that its logits processor runs); make the V1 model runner announce which private context
    each request of a step reads (``batch_contexts``; a pass-through without private contexts);
    and give English-only Whisper checkpoints their trained decoder prompt (``whisper``)."""
    from vllm import ModelRegistry
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.worker_base import WorkerBase

    from . import batch_contexts
    from .paraphrase import LOGITS_REPORT, logits_report
    from .verify import LAYER_REPORT, layer_report

    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)
    if TOKENIZER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(TOKENIZER_MODE, "vllm.tokenizers.hf", "CachedHfTokenizer")
    if not hasattr(WorkerBase, LAYER_REPORT):
        setattr(WorkerBase, LAYER_REPORT, layer_report)
    if not hasattr(WorkerBase, LOGITS_REPORT):
        setattr(WorkerBase, LOGITS_REPORT, logits_report)
    if TOKENIZER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(TOKENIZER_MODE, "vllm_dp_plugin.serving.renderer", "DPRenderer")
    batch_contexts.install()
    ModelRegistry.register_model("WhisperForConditionalGeneration", "vllm_dp_plugin.serving.whisper:Whisper")
