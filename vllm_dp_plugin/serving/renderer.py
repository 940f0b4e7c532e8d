"""``--tokenizer-mode dp_private``: vLLM's HF renderer plus the private context.

Every rendered request (chat, completion, token-id prompt; ``LLM``, the OpenAI server and
``vllm bench``) becomes ``private context ids + the request's own ids``: the context occupies
positions [0, P), which is how the attention backend recognises it. Users never send or see
it. Prompt embeddings are refused while a private context is configured (they could not be
prefixed and would bypass the layout).
"""

from __future__ import annotations

import logging
import os

from vllm.renderers.hf import HfRenderer

from ..config import ConfigError
from .settings import PLUGIN_NAME, dp_config, private_context

logger = logging.getLogger("vllm.dp_privacy")  # inherits vLLM's log handler


class DPRenderer(HfRenderer):
    """Prepends the deployment's private context to every decoder prompt."""

    def __init__(self, config, tokenizer) -> None:
        super().__init__(config, tokenizer)
        cfg = dp_config(config)
        self._context = None
        if cfg.attention is not None and cfg.attention.private_context is not None:
            self._context = private_context(config)
            require_http_guard()
            logger.info(
                "vllm-dp: private context %s... (%d tokens) is prepended to every request",
                self._context.context_id[:12],
                self._context.length,
            )

    def process_for_engine(self, prompt, arrival_time, **kwargs):
        return self._with_context(super().process_for_engine(prompt, arrival_time, **kwargs))

    async def process_for_engine_async(self, prompt, arrival_time, **kwargs):
        return self._with_context(await super().process_for_engine_async(prompt, arrival_time, **kwargs))

    def _with_context(self, engine_input):
        if self._context is None:
            return engine_input
        if engine_input.get("type") != "token":
            raise ValueError(
                f"{engine_input.get('type')!r} prompts are not accepted while a private context is "
                "configured: send text, messages or token ids"
            )
        engine_input["prompt_token_ids"] = self._context.prepend(engine_input["prompt_token_ids"])
        engine_input.pop("prompt_token_offsets", None)  # char offsets of the public text only
        return engine_input


def require_http_guard() -> None:
    """Refuse to serve a private context unless the HTTP guard (endpoint plugin) can load.

    vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them; without the guard the
    OpenAI server would honour echo/prompt_logprobs/return_token_ids and reveal the context.
    """
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None or PLUGIN_NAME not in allowed.split(","):
        raise ConfigError(
            "a private context is configured but VLLM_PLUGINS does not name "
            f"{PLUGIN_NAME!r}, so vLLM would not load the HTTP guard that refuses echo, "
            f"prompt_logprobs and return_token_ids: export VLLM_PLUGINS={PLUGIN_NAME} "
            "(`vllm-dp serve` does this)"
        )
