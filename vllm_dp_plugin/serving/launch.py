"""Hand a command line to vLLM's own CLI (``vllm serve``, ``vllm bench ...``), with our flags."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..config import CONFIG_KEY, ConfigError, parse_section, section_from_file
from .memory import DEFAULT_SEQUENCES, kv_cache_flags
from .settings import PLUGIN_NAME, TOKENIZER_MODE, private_prompts
from .vllm_compat import install_version_shim


def run_vllm_cli(argv: list[str]) -> int:
    """Run ``vllm <argv>`` in this process; returns its exit status."""
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def allow_plugin() -> None:
    """Make sure ``VLLM_PLUGINS`` (when set) names our plugin in every group, so vLLM also loads
    the opt-in endpoint plugin (budget endpoint, HTTP guard)."""
    names = [n for n in os.environ.get("VLLM_PLUGINS", "").split(",") if n]
    if PLUGIN_NAME not in names:
        os.environ["VLLM_PLUGINS"] = ",".join([*names, PLUGIN_NAME])


def resolved_config(path: str | Path) -> dict:
    """The ``dp_privacy`` section of a YAML/JSON file, validated (``ConfigError`` naming the
    key), with file paths made absolute relative to the file (so the server can run from any
    directory)."""
    raw = section_from_file(path)
    parse_section(raw)
    return raw


# ``vllm serve`` options a private context may be served with: serving, model loading, memory,
# scheduling and parallelism. Anything else (speculative decoding, LoRA, KV events/transfer,
# pooling runners, custom workers/schedulers/middleware, ``--config`` files, and every option a
# later vLLM adds) is refused until someone checks that it neither reads nor publishes private
# positions. The engine re-checks its resolved configuration (``settings.check_engine_options``).
CONTEXT_SERVE_OPTIONS = frozenset("""
    host port uds api-key allowed-origins allowed-methods allowed-headers allow-credentials
    ssl-keyfile ssl-certfile ssl-ca-certs ssl-cert-reqs ssl-ciphers enable-ssl-refresh root-path
    served-model-name disable-fastapi-docs enable-offline-docs uvicorn-log-level
    disable-uvicorn-access-log disable-access-log-for-endpoints disable-log-stats max-log-len
    enable-log-outputs enable-log-deltas enable-request-id-headers enable-server-load-tracking
    enable-force-include-usage api-server-count h11-max-header-count h11-max-incomplete-event-size
    sse-keep-alive-interval stream-interval shutdown-timeout return-tokens-as-token-ids
    chat-template chat-template-content-format default-chat-template-kwargs response-role
    enable-auto-tool-choice tool-call-parser reasoning-parser
    model tokenizer tokenizer-mode trust-remote-code revision code-revision tokenizer-revision
    dtype seed max-model-len download-dir load-format quantization generation-config
    override-generation-config hf-config-path config-format hf-token max-logprobs logprobs-mode
    use-tqdm-on-load ignore-patterns max-parallel-loading-workers
    block-size gpu-memory-utilization kv-cache-memory-bytes kv-cache-dtype enable-prefix-caching
    num-gpu-blocks-override max-num-seqs max-num-batched-tokens enable-chunked-prefill
    long-prefill-token-threshold async-scheduling scheduling-policy enforce-eager
    optimization-level performance-mode cudagraph-capture-sizes max-cudagraph-capture-size
    disable-cascade-attn disable-custom-all-reduce
    tensor-parallel-size pipeline-parallel-size distributed-executor-backend
    distributed-timeout-seconds master-addr master-port attention-backend
""".split())  # noqa: SIM905
KV_SIZING_OPTIONS = ("kv-cache-memory-bytes", "gpu-memory-utilization")  # kept as given (sized_kv_cache)
SHORT_OPTIONS = {"-tp": "tensor-parallel-size", "-pp": "pipeline-parallel-size"}
DP_BACKEND = "CUSTOM"  # the DP attention backend on CUDA (registered by the general plugin)
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # "0": vLLM's V1 model runner (serving.batch_contexts)


def option_names(argv: list[str]) -> list[str]:
    """The option names in ``argv`` (``--x=1`` and ``--no-x`` give ``x``; short aliases expanded)."""
    names = []
    for arg in argv:
        if arg in SHORT_OPTIONS:
            names.append(SHORT_OPTIONS[arg])
        elif arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            names.append(name.removeprefix("no-"))
        elif arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit():
            names.append(arg)
    return names


def option_values(argv: list[str], name: str) -> list[str]:
    """The values of ``--name V`` and ``--name=V`` in ``argv``, in order."""
    return [arg.split("=", 1)[1] if "=" in arg else argv[i + 1] for i, arg in enumerate(argv)
            if arg.startswith(name + "=") or (arg == name and i + 1 < len(argv))]


def check_context_options(argv: list[str]) -> None:
    """Refuse ``vllm serve`` options outside ``CONTEXT_SERVE_OPTIONS`` (a private context)."""
    refused = [name for name in option_names(argv) if name not in CONTEXT_SERVE_OPTIONS]
    if refused:
        raise ConfigError(
            f"option(s) {', '.join(n if n.startswith('-') else '--' + n for n in refused)} cannot be used while a private "
            "context is served: only options known to keep private positions private are allowed "
            "(vllm_dp_plugin.serving.launch.CONTEXT_SERVE_OPTIONS; SECURITY.md)"
        )


def attention_backend(argv: list[str], on_cuda: bool) -> list[str]:
    """``--attention-backend CUSTOM`` on CUDA (vLLM would pick its own backend otherwise and the
    DP path would not run); any other backend is refused. CPU ignores the flag."""
    given = option_values(argv, "--attention-backend")
    if on_cuda and any(b != DP_BACKEND for b in given):
        raise ConfigError(f"--attention-backend must be {DP_BACKEND} (the DP backend) with DP attention, got {given}")
    return ["--attention-backend", DP_BACKEND] if on_cuda and not given else []


def sized_kv_cache(argv: list[str]) -> list[str]:
    """``vllm serve`` arguments (the model first) with, on CPU, ``--kv-cache-memory-bytes`` for
    ``DEFAULT_SEQUENCES`` sequences of ``--max-model-len`` tokens (``serving.memory``), unless a
    sizing option or vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE`` is given. On CUDA vLLM's own
    fraction of the device's memory is kept (a GPU reports its memory truthfully)."""
    def last(name: str, default: str | None) -> str | None:
        return (option_values(argv, name) or [default])[-1]

    sized = any(option_values(argv, f"--{name}") for name in KV_SIZING_OPTIONS)
    model = last("--model", argv[0] if argv and not argv[0].startswith("-") else None)
    if sized or model is None or os.environ.get("VLLM_CPU_KVCACHE_SPACE") or _on_cuda():
        return argv  # (no model: vLLM names what is missing)
    from vllm.utils.argparse_utils import human_readable_int_or_auto

    length = human_readable_int_or_auto(last("--max-model-len", "auto"))
    return [*argv, *kv_cache_flags(model, None if length == -1 else length, DEFAULT_SEQUENCES, last("--dtype", "auto"))]


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def serve_arguments(argv: list[str], dp_config: str | None) -> list[str]:
    """``vllm serve`` arguments: ``argv`` plus, for ``dp_config``, ``--additional-config``,
    ``--tokenizer-mode dp_private`` (private context or prompt privatization),
    ``--enable-prompt-embeds`` (prompt privatization in embeddings mode), on CUDA with DP
    attention, ``--attention-backend CUSTOM`` and, with DP aggregation, ``--max-logprobs``. Refuses conflicting flags and, with a private
    context, options outside ``CONTEXT_SERVE_OPTIONS``; with a private context, selects vLLM's V1
    model runner unless ``VLLM_USE_V2_MODEL_RUNNER`` is set (the start-up check refuses V2)."""
    allow_plugin()
    if dp_config is None:
        return argv
    if any(a == "--additional-config" or a.startswith("--additional-config=") for a in argv):
        raise ConfigError("give either --dp-config or --additional-config, not both")
    raw = resolved_config(dp_config)
    flags = ["--additional-config", json.dumps({CONFIG_KEY: raw})]
    att, prompt = raw.get("attention") or {}, raw.get("prompt")
    parsed = parse_section(raw)  # parsed once (resolved_config): the cached object
    typed = parsed.attention
    context = typed is not None and typed.serves_context
    if parsed.aggregate is not None:  # the engine holds the documents' rows: the same option allowlist
        check_context_options(argv)
        flags += logprob_flags(argv, parsed.aggregate.choices)
    if context:
        check_context_options(argv)
        os.environ.setdefault(RUNNER_ENV, "0")  # V1: the runner that says which context a request reads
    if raw.get("attention") is not None:
        flags += attention_backend(argv, _on_cuda())
    needs = [why for why, on in (("a private context", context), ("prompt privatization", prompt is not None)) if on]
    if needs:
        modes = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--tokenizer-mode"]
        if any(m != TOKENIZER_MODE for m in modes):
            raise ConfigError(f"--tokenizer-mode {TOKENIZER_MODE} is required by {' and '.join(needs)}, got {modes}")
        if not modes:
            flags += ["--tokenizer-mode", TOKENIZER_MODE]
    if (prompt or {}).get("mode") == "embeddings" and "--enable-prompt-embeds" not in argv:
        flags.append("--enable-prompt-embeds")
    if private_prompts(parsed) and "--disable-log-stats" not in argv:  # its stats log counts their tokens
        flags.append("--disable-log-stats")
    _calibrate_if_missing(argv, att)
    return [*argv, *flags]


def logprob_flags(argv: list[str], candidates: int | None) -> list[str]:
    """``--max-logprobs`` for DP aggregation, which asks the engine for the public sequence's
    ``candidates`` top log-probabilities (None: all of them, ``-1``; vLLM's default allows 20)."""
    given = option_values(argv, "--max-logprobs")
    need = -1 if candidates is None else max(20, candidates)
    if any(int(g) != -1 and (need == -1 or int(g) < need) for g in given):
        raise ConfigError(f"--max-logprobs must be {'-1' if need == -1 else f'>= {need}'} for aggregate.candidates="
                          f"{candidates}, got {given}")
    return [] if given else ["--max-logprobs", str(need)]


def _calibrate_if_missing(argv: list[str], att: dict) -> None:
    """Create a missing calibration file from public text (pydoc pages) with the served model."""
    path = att.get("calibration")
    if path is None or Path(path).exists() or not argv or argv[0].startswith("-"):
        return
    from ..calibration import calibrate_model

    print(f"vllm-dp: {path} does not exist; calibrating {argv[0]} on public text", file=sys.stderr)
    calibrate_model(argv[0], path)


if __name__ == "__main__":  # `python -m vllm_dp_plugin.serving.launch ARGS` == `vllm ARGS` (shimmed)
    raise SystemExit(run_vllm_cli(sys.argv[1:]))
