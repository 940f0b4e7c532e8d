"""``--tokenizer-mode dp_private``: vLLM's HF renderer plus the private context and prompt privatization.

Private contexts (``dp_privacy.attention.private_context`` or ``contexts``): every rendered
request (chat, completion, token-id prompt; ``LLM``, the OpenAI server and ``vllm bench``)
becomes ``private context ids + the request's own ids``, for the context the request names in
``dp_context`` (``vllm_xargs``, or ``prompt_request`` around ``LLM`` calls; the first context by
default; an unknown name is a ValueError): the context occupies positions [0, P), which is how
the attention backend recognises it, and which one it is. Users never send or see it. Prompt
embeddings are refused while a private context is configured (they could not be prefixed and
would bypass the layout).

Prompt privatization (``dp_privacy.prompt``): the user-authored tokens of every request are
replaced by DP samples before anything downstream (scheduler, prefix cache, engine, logs) sees
them; the logic lives in ``prompt`` (``prompt.session``; one pure segmentation step per prompt,
``prompt.segments.segment_chat`` / ``segment_completion``), this class only wires it into vLLM:

* chat (``render_messages[_async]``): the template is rendered twice, with the user texts and
  with sentinels in their place, which locates the user segments exactly; template pieces and
  user texts are tokenised separately and spliced (no BPE merge crosses a template/user
  boundary, so the private mask is exact). System prompt, assistant turns and template tokens
  pass through.
* completions (``process_for_engine[_async]``): a text prompt is private except the special
  tokens the tokenizer adds (mask from ``_tokenize_prompt``, carried across truncation); in a
  token-id prompt every non-special id is private (special ids are the client's template).
* lengths: vLLM checks and truncates (``truncate_prompt_tokens``) a chat only after rendering,
  which is where it is privatized; the renderer applies the request's limits first (the same
  character bound, token limit and truncation as vLLM, ``_privatize_chat``), so only tokens that
  reach the engine are noised and an over-long chat costs no privatization.
* options come from ``prompt.session.current_request()`` (set by the HTTP layer from
  ``vllm_xargs``, or by ``prompt_request`` around ``LLM`` calls); receipts go back the same way,
  to the log (one line per prompt, no text, no ids) and to ``prompt_receipt(prompt_token_ids)``.
* ``mode: embeddings`` sends noisy embeddings at the private positions through vLLM's mixed
  ``prompt_embeds`` path (``prompt_is_token_ids``), needs ``--enable-prompt-embeds``.

The privatized ids go to the engine directly (no detokenise/retokenise); the raw prompt text
and its character offsets are dropped from the engine input.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from vllm.renderers.hf import HfRenderer

from ..config import ConfigError
from ..lru import LRU
from ..privacy.keyed_noise import NoiseKey
from ..prompt.paraphrase import PARAPHRASE, rewrite_seed
from ..prompt.segments import replace_user_texts, splice
from ..prompt.session import (
    OPTION_CONTEXT,
    PrivatizedPrompt,
    PromptReceipt,
    added_mask,
    added_special_tokens,
    current_request,
    mark_user_texts,
    segment_chat,
    segment_completion,
)
from .context import select_context
from .prompt_table import build_prompt_privacy, receipt_log_line, special_token_ids
from .settings import PLUGIN_NAME, contexts_out_of_regime, dp_config, private_contexts

logger = logging.getLogger("vllm.dp_privacy")  # inherits vLLM's log handler

RECEIPT_MARK = "_dp_receipt"  # chat prompts privatized by render_messages carry their receipt
FULL_MARK = "_dp_full"  # text completions: (the tokenizer's ids, their private mask) from _tokenize_prompt
RECENT_RECEIPTS = 1024
_CHAT_TOK_PARAMS: contextvars.ContextVar = contextvars.ContextVar("vllm_dp_chat_tok_params", default=None)
# set only around the engine calls of paraphrase rewrites (``_rewrite``): their prompt is the
# mechanism's private input, so it is neither privatized again nor given the private context
_REWRITING: contextvars.ContextVar[bool] = contextvars.ContextVar("vllm_dp_rewriting", default=False)


class DPRenderer(HfRenderer):
    """Prepends the private context each request picks and privatizes user tokens."""

    def __init__(self, config, tokenizer) -> None:
        super().__init__(config, tokenizer)
        cfg = dp_config(config)
        self._contexts = {}  # name -> PrivateContext, the first is the default
        self._served = False  # whether requests carry their context (not when every one is out of regime)
        if cfg.attention is not None and cfg.attention.serves_context:
            self._contexts = {c.name: c for c in private_contexts(config)}
            self._served = not contexts_out_of_regime(config)
            require_http_guard("a private context is configured")
            for i, context in enumerate(self._contexts.values()):
                logger.info(
                    "vllm-dp: private context %r %s (%d tokens) is %s%s", context.name, context.identity.label,
                    context.length, "prepended to the requests that pick it" if self._served else
                    "NOT served: the public gate closed every layer of every context (out of regime, see "
                    "/v1/dp/budget), so requests are answered without it", " (the default)" if i == 0 else "",
                )
        self._prompt = None
        self._engine = None  # the API server's engine client (attach_engine): paraphrase rewrites
        self._rewrite_refusal: str | None = None
        self._around: tuple[list[int], list[int]] | None = None  # added special ids, found lazily
        self._recent: LRU[str, dict] = LRU(RECENT_RECEIPTS)
        if cfg.prompt is not None:
            self._start_prompt_privacy(config, cfg)

    # ------------------------------------------------------------------ set-up

    def _start_prompt_privacy(self, config, cfg) -> None:
        p, model_config = cfg.prompt, config.model_config
        if getattr(model_config, "is_encoder_decoder", False):
            raise ConfigError("dp_privacy.prompt: prompt privatization is for decoder-only models")
        if p.mode == "embeddings":
            if self._contexts:
                raise ConfigError(
                    "dp_privacy.prompt.mode embeddings cannot be combined with "
                    f"{cfg.attention.context_key()}: prompt embeddings cannot be placed after the "
                    "private context (use mode: tokens)"
                )
            if not getattr(model_config, "enable_prompt_embeds", False):
                raise ConfigError("dp_privacy.prompt.mode embeddings needs --enable-prompt-embeds")
        require_http_guard("prompt privatization is configured")
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(  # without vLLM's additions (embeds placeholder)
            model_config.tokenizer,
            revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code,
        )
        placeholder = 0
        if p.mode == "embeddings":
            from vllm.renderers.chat_utils import PROMPT_EMBEDS_PLACEHOLDER_TOKEN

            placeholder = self.tokenizer.convert_tokens_to_ids(PROMPT_EMBEDS_PLACEHOLDER_TOKEN)
        self._prompt, info = build_prompt_privacy(
            model_config.model,
            hf_tokenizer,
            p,
            cfg.key_file,
            placeholder_id=placeholder,
            embed_dtype=model_config.dtype,
        )
        self._special = frozenset(special_token_ids(hf_tokenizer))
        self._key = NoiseKey(cfg.key_file)  # seeds of paraphrase rewrites (rewrite_seed)
        logger.info(
            "vllm-dp: prompt privatization on (%s, eps=%g, delta=%g per token, mode %s, history "
            "cache %s, request overrides %s, nearest-candidate search %s): %s",
            p.mechanism, p.epsilon, p.delta, p.mode,
            f"{p.cache_size} segments" if p.cache_history else "off",
            "allowed" if p.allow_request_override else "refused",
            self._prompt.search, info.describe(),
        )

    # ------------------------------------------------------------------ chat

    def render_chat(self, conversations, chat_params, tok_params=None, **kwargs):
        with _bound(_CHAT_TOK_PARAMS, tok_params):
            return super().render_chat(conversations, chat_params, tok_params, **kwargs)

    async def render_chat_async(self, conversations, chat_params, tok_params=None, **kwargs):
        with _bound(_CHAT_TOK_PARAMS, tok_params):  # copied into the tasks rendering each chat
            return await super().render_chat_async(conversations, chat_params, tok_params, **kwargs)

    def render_messages(self, messages, params):
        if self._prompt is None:
            return super().render_messages(messages, params)
        request, slot, options = self._begin()
        if options.mechanism == PARAPHRASE:
            raise ValueError(
                "prompt mechanism paraphrase runs in the OpenAI server (chat completions); with "
                "vllm.LLM rewrite the texts with vllm_dp_plugin.serving.paraphrase.paraphrase first"
            )
        marked = mark_user_texts(messages)
        text_params = _text_params(params)
        conversation, real = super().render_messages(messages, text_params)
        _, template = super().render_messages(marked.messages, text_params)
        done = self._privatize_chat(marked, real, template, options, self._chat_tok_params())
        return conversation, self._chat_prompt(done, request, slot)

    async def render_messages_async(self, messages, params):
        if self._prompt is None:
            return await super().render_messages_async(messages, params)
        request, slot, options = self._begin()
        if options.mechanism == PARAPHRASE:
            return await self._paraphrase_chat(messages, params, options, request, slot)
        marked = mark_user_texts(messages)
        text_params = _text_params(params)
        conversation, real = await super().render_messages_async(messages, text_params)
        _, template = await super().render_messages_async(marked.messages, text_params)
        done = await self._offload(self._privatize_chat, marked, real, template, options, self._chat_tok_params())
        return conversation, self._chat_prompt(done, request, slot)

    async def _paraphrase_chat(self, messages, params, options, request, slot):
        """``paraphrase``: every user text is rewritten by the served engine (``_rewrite``); the
        chat with the rewrites is rendered and tokenised as the token path does, and every token
        of it is public from then on (the rewrites are the DP release)."""
        mechanism = self._prompt.paraphraser(options)
        marked = mark_user_texts(messages)
        self._check_paraphrase_input(marked.texts)
        rewrites = list(await asyncio.gather(*(self._rewrite(text, mechanism) for text in marked.texts)))
        text_params = _text_params(params)
        conversation, real = await super().render_messages_async(replace_user_texts(marked, rewrites), text_params)
        _, template = await super().render_messages_async(marked.messages, text_params)
        tok_params = self._chat_tok_params()
        segments = segment_chat(dataclasses.replace(marked, texts=rewrites), real["prompt"], template["prompt"],
                                self._encode, truncation=lambda count: tok_params._truncation_slice(self.tokenizer, count),
                                max_tokens=tok_params.max_input_tokens)
        ids, _ = splice(segments)
        receipt = self._prompt.paraphrase_receipt(mechanism, len(rewrites))
        self._record(receipt, request, slot)
        return conversation, {"prompt_token_ids": ids, RECEIPT_MARK: receipt}

    def _check_paraphrase_input(self, texts) -> None:
        """Refuse, before any rewrite runs, a chat with more user texts than
        ``prompt.paraphrase_max_messages`` or a text longer than ``paraphrase_max_input_tokens``
        (every rewrite is an engine request over the raw text). ValueError naming the key."""
        cfg = self._prompt.cfg
        if len(texts) > cfg.paraphrase_max_messages:
            raise ValueError(f"paraphrase rewrites at most prompt.paraphrase_max_messages={cfg.paraphrase_max_messages} "
                             f"user messages a request, this chat has {len(texts)}")
        longest = max((len(self._encode(t)) for t in texts), default=0)
        if longest > cfg.paraphrase_max_input_tokens:
            raise ValueError(f"paraphrase rewrites user messages of at most prompt.paraphrase_max_input_tokens="
                             f"{cfg.paraphrase_max_input_tokens} tokens, this chat has one of {longest}")

    async def _rewrite(self, text: str, mechanism) -> str:
        """One rewrite of ``text`` by the served engine (``serving.paraphrase``), keyed noise."""
        from .paraphrase import rewrite_params, rewrite_prompt_ids

        if self._engine is None:
            raise ValueError("prompt mechanism paraphrase needs the OpenAI server's engine (vllm serve)")
        if self._rewrite_refusal is not None:
            raise ValueError(self._rewrite_refusal)
        if self._engine.vllm_config.speculative_config is not None:  # vLLM skips logits processors there
            raise ValueError("prompt mechanism paraphrase cannot run with speculative decoding")
        template = self._prompt.cfg.paraphrase_template
        params = rewrite_params(mechanism, rewrite_seed(self._key, mechanism, template, text))
        final = None
        token = _REWRITING.set(True)
        try:
            # a fresh cache salt: no other request (a guess of this text) can hit its cached blocks
            prompt = {"prompt_token_ids": rewrite_prompt_ids(self.tokenizer, text, template),
                      "cache_salt": os.urandom(16).hex()}
            async for output in self._engine.generate(prompt, params, f"dp-rewrite-{os.urandom(8).hex()}"):
                final = output
        finally:
            _REWRITING.reset(token)
        return final.outputs[0].text.strip()

    def attach_engine(self, engine_client, refusal: str | None = None) -> None:
        """The API server's engine client, which paraphrase rewrites run on (``http.init_state``);
        ``refusal``: why they cannot (its workers lack the mechanism's logits processor)."""
        self._engine, self._rewrite_refusal = engine_client, refusal

    def _chat_tok_params(self):
        """The ``TokenizeParams`` vLLM will check and truncate this chat with (``render_chat``)."""
        return _CHAT_TOK_PARAMS.get() or self.default_chat_tok_params

    def _privatize_chat(self, marked, real, template, options, tok_params) -> PrivatizedPrompt:
        """Locate, tokenise and privatize the user texts of a rendered chat, within ``tok_params``'
        limits: a chat vLLM would refuse is refused before privatizing (vLLM's character bound,
        then its token limit), and with ``truncate_prompt_tokens`` only the tokens vLLM keeps are
        privatized (its own truncation of them is then a no-op)."""
        for rendered in (real, template):
            if "prompt" not in rendered or rendered.get("multi_modal_data"):
                raise ValueError("prompt privatization supports text-only chats")
        limit, truncates = tok_params.max_input_tokens, tok_params.truncate_prompt_tokens is not None
        if limit is not None and not truncates:
            check_text_length(real["prompt"], limit, self.tokenizer.max_chars_per_token)
        segments = segment_chat(  # locate, tokenise, truncate (vLLM's truncate_prompt_tokens)
            marked,
            real["prompt"],
            template["prompt"],
            self._encode,
            truncation=lambda count: tok_params._truncation_slice(self.tokenizer, count),
            max_tokens=limit,
        )
        return self._prompt.privatize(segments, options)

    def _chat_prompt(self, done: PrivatizedPrompt, request, slot) -> dict:
        self._record(done.receipt, request, slot)
        prompt = self._engine_prompt(done)
        prompt[RECEIPT_MARK] = done.receipt
        return prompt

    # ------------------------------------------------------------------ completions

    def _tokenize_prompt(self, prompt, params):
        out = super()._tokenize_prompt(prompt, params)
        if self._prompt is not None:  # the tokenizer may have truncated the text (and re-added its specials)
            ids = list(out["prompt_token_ids"])
            out[FULL_MARK] = (ids, added_mask(ids, self._added_specials() if params.add_special_tokens else ([], [])))
        return out

    def process_for_engine(self, prompt, arrival_time, **kwargs):
        receipt = self._privatize_cmpl(prompt, kwargs.get("tok_params"), asynchronous=False)
        return self._finish(super().process_for_engine(prompt, arrival_time, **kwargs), receipt)

    async def process_for_engine_async(self, prompt, arrival_time, **kwargs):
        receipt = self._privatize_cmpl(prompt, kwargs.get("tok_params"), asynchronous=True)
        if isinstance(receipt, functools.partial):  # the privatization itself, off the event loop
            receipt = await self._offload(receipt)
        engine_input = await super().process_for_engine_async(prompt, arrival_time, **kwargs)
        return self._finish(engine_input, receipt)

    def _privatize_cmpl(self, prompt, tok_params, *, asynchronous: bool):
        """Completions: replace the private ids of ``prompt`` in place (the receipt, or with
        ``asynchronous`` a partial computing it). Chat prompts come privatized already."""
        if self._prompt is None or _REWRITING.get():
            return None
        if RECEIPT_MARK in prompt:
            if getattr(tok_params, "add_special_tokens", False):
                self._add_special_tokens(prompt)
            return prompt.pop(RECEIPT_MARK)
        if "encoder_prompt" in prompt or prompt.get("multi_modal_data"):
            raise ValueError("prompt privatization supports text and token-id prompts only")
        if "prompt_embeds" in prompt:
            raise ValueError(
                "prompt embeddings sent by the client would bypass prompt privatization: send "
                "text, messages or token ids"
            )
        ids = list(prompt["prompt_token_ids"])
        full = prompt.pop(FULL_MARK, None)
        side = getattr(tok_params, "truncation_side", None) or getattr(self.tokenizer, "truncation_side", None)
        segments = segment_completion(ids, self._special, full, side)
        prompt.pop("prompt", None)  # the raw text must not travel on
        prompt.pop("prompt_token_offsets", None)
        detokenize = bool(getattr(tok_params, "needs_detokenization", False))  # echo
        request, slot, options = self._begin()
        if options.mechanism == PARAPHRASE:
            raise ValueError("prompt mechanism paraphrase rewrites chat messages: use /v1/chat/completions")
        job = functools.partial(self._complete_cmpl, prompt, segments, options, request, slot, detokenize)
        return job if asynchronous else job()

    def _add_special_tokens(self, prompt) -> None:
        """A chat request with ``add_special_tokens``: the tokenizer's added special ids (public)
        around the privatized ids, as vLLM's tokenisation of the rendered chat would place them."""
        prefix, suffix = self._added_specials()
        if not prefix and not suffix:
            return
        prompt["prompt_token_ids"] = [*prefix, *prompt["prompt_token_ids"], *suffix]
        if "prompt_embeds" in prompt:
            embeds = prompt["prompt_embeds"]  # [n, d]
            prompt["prompt_embeds"] = torch.cat(
                [embeds.new_zeros(len(prefix), embeds.shape[1]), embeds, embeds.new_zeros(len(suffix), embeds.shape[1])]
            )
            flags = prompt["prompt_is_token_ids"]
            prompt["prompt_is_token_ids"] = [True] * len(prefix) + list(flags) + [True] * len(suffix)

    def _added_specials(self) -> tuple[list[int], list[int]]:
        """(prefix, suffix) the tokenizer adds with ``add_special_tokens`` (probed once)."""
        if self._around is None:
            self._around = added_special_tokens(self.tokenizer, self._special)
        return self._around

    def _complete_cmpl(self, prompt, segments, options, request, slot, detokenize) -> PromptReceipt:
        done = self._prompt.privatize(segments, options)
        self._record(done.receipt, request, slot)
        prompt.update(self._engine_prompt(done))
        if detokenize:  # the text of what the engine got, never the user's
            prompt["prompt"] = self.tokenizer.decode(done.ids)
        return done.receipt

    # ------------------------------------------------------------------ shared

    def _begin(self):
        """(request, receipt slot, validated options) for the prompt being rendered."""
        request = current_request()
        if request is None:
            return None, None, self._prompt.options()
        return request, request.reserve(), self._prompt.options(request.overrides, request.credential)

    def _engine_prompt(self, done: PrivatizedPrompt) -> dict:
        if done.embeds is None:
            return {"prompt_token_ids": done.ids}
        return {
            "prompt_token_ids": done.ids,
            "prompt_embeds": done.embeds,
            "prompt_is_token_ids": [not private for private in done.mask],
        }

    def _record(self, receipt: PromptReceipt, request, slot) -> None:
        if request is not None:
            request.receipts[slot] = receipt.to_json()
        logger.info("vllm-dp: prompt privatized %s", receipt_log_line(receipt))

    def _finish(self, engine_input, receipt):
        if _REWRITING.get():  # a rewrite's prompt: no private context
            return engine_input
        engine_input = self._with_context(engine_input)
        if receipt is not None:
            ids = engine_input.get("prompt_token_ids")
            if ids is not None:
                self._recent.put(_ids_key(ids), receipt.to_json())
        return engine_input

    def prompt_receipt(self, prompt_token_ids) -> dict | None:
        """The receipt of the latest prompt the engine received as ``prompt_token_ids`` (e.g. a
        ``RequestOutput.prompt_token_ids`` of ``LLM``); None if unknown (or evicted)."""
        return self._recent.peek(_ids_key(prompt_token_ids))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @functools.cached_property
    def _privatizer(self) -> ThreadPoolExecutor:
        """The one worker privatization runs on (the history cache and receipts in order). Not
        vLLM's render pool (one worker by default): queued there, privatization held back the
        chat-template renders, which vLLM fails with a 500 after VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT
        (30 s; measured at 64 concurrent clients on 2 cores); queued here, it only waits."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-dp-privatize")

    async def _offload(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._privatizer, functools.partial(fn, *args))

    def _with_context(self, engine_input):
        if not self._contexts:
            return engine_input
        if engine_input.get("type") != "token":
            raise ValueError(
                f"{engine_input.get('type')!r} prompts are not accepted while a private context is "
                "configured: send text, messages or token ids"
            )
        request = current_request()
        asked = None if request is None else request.overrides.get(OPTION_CONTEXT)
        context = self._contexts[select_context(tuple(self._contexts), asked)]
        if not self._served:
            return engine_input
        engine_input["prompt_token_ids"] = context.prepend(engine_input["prompt_token_ids"])
        engine_input.pop("prompt_token_offsets", None)  # char offsets of the public text only
        return engine_input


def check_text_length(text: str, max_input_tokens: int, max_chars_per_token: int) -> None:
    """vLLM's check of a prompt text without truncation, before it is tokenised: more than
    ``max_input_tokens * max_chars_per_token`` characters (the tokenizer's longest token; both
    public) cannot fit in ``max_input_tokens`` tokens. ValueError naming max_model_len."""
    limit = max_input_tokens * max_chars_per_token
    if len(text) > limit:
        raise ValueError(
            f"This model's maximum context length (max_model_len) is {max_input_tokens} tokens, but "
            f"the chat has {len(text)} characters, more than {limit} (the bound for {max_input_tokens} "
            "tokens): shorten the messages or set truncate_prompt_tokens"
        )


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def _text_params(params):
    """The chat params with ``tokenize=False``: the user segments are located in the text."""
    return dataclasses.replace(params, chat_template_kwargs={**params.chat_template_kwargs, "tokenize": False})


def _ids_key(ids) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode("ascii")).hexdigest()


def require_http_guard(why: str) -> None:
    """Refuse to serve unless the HTTP guard (endpoint plugin) can load.

    vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them; without the guard the
    OpenAI server would honour echo/prompt_logprobs/return_token_ids and reveal the private
    context, ignore per-request prompt privacy options and return no receipts.
    """
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None or PLUGIN_NAME not in allowed.split(","):
        raise ConfigError(
            f"{why} but VLLM_PLUGINS does not name {PLUGIN_NAME!r}, so vLLM would not load the "
            "HTTP guard (refuses echo, prompt_logprobs, return_token_ids with a private context; "
            "validates prompt privacy options and returns receipts): export "
            f"VLLM_PLUGINS={PLUGIN_NAME} (`vllm-dp serve` does this)"
        )
