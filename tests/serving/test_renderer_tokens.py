"""Tokenisation and lengths around prompt privatization in the renderer (no engine).

Completions: the private mask of a text prompt is taken on the tokenizer's own ids (``added_mask``:
the specials it adds public, every text token private), so it survives the tokenizer's truncation
(which cuts the text and re-adds BOS/EOS: ``truncate_prompt_tokens=-1`` on a long prompt) and
vLLM's own truncation after it (``truncated_mask``). Chats: vLLM's character bound, token limit and
truncation are applied before privatizing (``_privatize_chat``). ``added_special_tokens``: the
specials a tokenizer adds, put around a chat's privatized ids when the request asks for
``add_special_tokens``."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from vllm.renderers.params import TokenizeParams
from vllm.tokenizers.hf import get_cached_tokenizer

from vllm_dp_plugin.config import PromptPrivacyConfig
from vllm_dp_plugin.lru import LRU
from vllm_dp_plugin.prompt.session import (
    PromptPrivacy,
    added_mask,
    added_special_tokens,
    mark_user_texts,
)
from vllm_dp_plugin.prompt.table import EmbeddingTable
from vllm_dp_plugin.serving.renderer import DPRenderer

VOCAB = {"<s>": 0, "</s>": 1, "[UNK]": 2, "a": 3, "b": 4, "c": 5}
TEXT = "a b <s> c a"  # a special token typed by the user: private like any text token
TEXT_IDS = [3, 4, 0, 5, 3]
CANDIDATES = (3, 4, 5)


def tokenizer(template: str | None, side: str = "right"):
    core = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template is not None:
        core.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0), ("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    fast.truncation_side = side
    return get_cached_tokenizer(fast)  # as vLLM holds it (max_chars_per_token)


def renderer(template: str | None = None, side: str = "right") -> DPRenderer:
    """A ``DPRenderer`` with only what the completion and chat paths read: the tokenizer, its
    special ids and a service over a random table of the toy vocabulary (laplace at eps = 1e6:
    the ids survive, the receipts count what was privatized)."""
    r = DPRenderer.__new__(DPRenderer)
    r.tokenizer, r._special, r._around, r._recent = tokenizer(template, side), frozenset({0, 1, 2}), None, LRU(8)
    table = EmbeddingTable.build(torch.randn(len(VOCAB), 4, generator=torch.Generator().manual_seed(0)), len(VOCAB), [0, 1, 2])
    r._prompt = PromptPrivacy(table, PromptPrivacyConfig(mechanism="laplace", epsilon=1e6, cache_history=False))
    return r


def complete(r: DPRenderer, params: TokenizeParams):
    """vLLM's completion path for ``TEXT``: tokenise, validate/truncate, then the engine input."""
    prompt = r._tokenize_prompt({"prompt": TEXT}, params)
    prompt = params.apply_post_tokenization(r.tokenizer, prompt)
    receipt = r._privatize_cmpl(prompt, params, asynchronous=False)
    return prompt["prompt_token_ids"], receipt


@pytest.mark.parametrize(("template", "around"), [(None, ([], [])), ("<s> $A", ([0], [])), ("<s> $A </s>", ([0], [1]))])
def test_added_special_tokens_are_found_by_probing(template, around):
    assert added_special_tokens(tokenizer(template), frozenset({0, 1})) == around


def test_added_mask_makes_the_added_specials_public_and_every_text_token_private():
    assert added_mask([0, *TEXT_IDS, 1], ([0], [1])) == [False, True, True, True, True, True, False]
    assert added_mask([0, 0, 1], ([0], [1])) == [False, True, False]  # a typed <s> stays private
    assert added_mask(TEXT_IDS, ([], [])) == [True] * 5
    for ids in ([3, 4, 1], [0, 3, 4], [0]):
        with pytest.raises(ValueError, match="added special tokens are not around it"):
            added_mask(ids, ([0], [1]))


@pytest.mark.parametrize(
    ("template", "side", "expected"),
    [
        ("<s> $A </s>", "right", [0, 3, 4, 1]),  # the tokenizer cuts the text and re-adds BOS and EOS
        ("<s> $A", "left", [0, 0, 5, 3]),  # keeps the end of the text, BOS re-added in front
        ("<s> $A", "right", [0, 3, 4, 0]),
        (None, "left", [4, 0, 5, 3]),  # nothing added: a plain suffix ("<s>" typed by the user)
    ],
)
def test_truncate_prompt_tokens_minus_one_survives_the_tokenizers_truncation(template, side, expected):
    """Prompt truncation (``truncate_prompt_tokens``): -1 truncates to max_model_len - 1 in the tokenizer; with added specials the
    result is not a slice of the untruncated ids, which the mask used to require."""
    r = renderer(template, side)
    params = TokenizeParams(max_total_tokens=5, max_output_tokens=1, truncate_prompt_tokens=-1, add_special_tokens=True)
    ids, receipt = complete(r, params)
    prefix, suffix = r._added_specials()
    private = range(len(prefix), 4 - len(suffix))
    assert receipt.tokens_privatized == len(private)  # the re-added specials are public, the rest private
    assert [t for i, t in enumerate(ids) if i not in private] == [t for i, t in enumerate(expected) if i not in private]
    # private ids are candidates: the user's own at eps = 1e6, the nearest candidate for a typed <s>
    assert all(ids[i] == expected[i] if expected[i] in CANDIDATES else ids[i] in CANDIDATES for i in private)


@pytest.mark.parametrize(("side", "expected", "private"), [("left", [5, 3, 1], 2), ("right", [0, 3, 4], 2)])
def test_vllms_own_truncation_after_tokenising_keeps_the_mask(side, expected, private):
    r = renderer("<s> $A </s>")
    params = TokenizeParams(max_total_tokens=20, max_output_tokens=1, truncate_prompt_tokens=3,
                            truncation_side=side, add_special_tokens=True)
    ids, receipt = complete(r, params)
    assert ids == expected and receipt.tokens_privatized == private


def test_without_added_specials_every_completion_token_is_private():
    params = TokenizeParams(max_total_tokens=20, max_output_tokens=1, add_special_tokens=False)
    ids, receipt = complete(renderer("<s> $A </s>"), params)
    assert ids[:2] + ids[3:] == [3, 4, 5, 3] and ids[2] in CANDIDATES  # the typed <s> too
    assert receipt.tokens_privatized == 5


# ----------------------------------------------------------------------------- chat lengths


def chat(r: DPRenderer, words: int, params: TokenizeParams):
    """``_privatize_chat`` of a one-message chat of ``words`` words, rendered as ``<s> text``."""
    text = " ".join(["a", "b", "c"] * words)[: 2 * words - 1]
    marked = mark_user_texts([{"role": "user", "content": text}], nonce="1")
    real, template = {"prompt": f"<s> {text}"}, {"prompt": f"<s> {marked.sentinels[0]}"}
    return r._privatize_chat(marked, real, template, r._prompt.options(), params)


def refuse_privatizing(r: DPRenderer, monkeypatch) -> None:
    def privatize(*args, **kwargs):
        raise AssertionError("privatized a chat that vLLM refuses")

    monkeypatch.setattr(r._prompt, "privatize", privatize)


def test_a_chat_too_long_in_characters_is_refused_before_tokenising_or_privatizing(monkeypatch):
    """Lengths checked before privatizing: a chat vLLM refuses for its length must not be privatized first."""
    r = renderer()
    refuse_privatizing(r, monkeypatch)
    monkeypatch.setattr(r, "_encode", lambda text: pytest.fail("tokenised a chat that vLLM refuses"))
    params = TokenizeParams(max_total_tokens=4, max_output_tokens=1)
    with pytest.raises(ValueError, match=r"max_model_len\) is 4 tokens, but the chat has 23 characters, more than 20"):
        chat(r, 10, params)  # "<s> " + 19 characters > 4 tokens * 5 characters


def test_a_chat_too_long_in_tokens_is_refused_before_privatizing(monkeypatch):
    r = renderer()
    refuse_privatizing(r, monkeypatch)
    params = TokenizeParams(max_total_tokens=8, max_output_tokens=1)
    with pytest.raises(ValueError, match=r"max_model_len\) is 8 tokens, but the chat has 11 input tokens"):
        chat(r, 10, params)  # 23 characters <= 40, but 1 + 10 tokens > 8


@pytest.mark.parametrize(("truncate", "side", "kept"), [(-1, "left", 7), (-1, "right", 7), (3, "left", 3)])
def test_a_truncated_chat_privatizes_only_the_tokens_vllm_keeps(truncate, side, kept):
    r = renderer()
    params = TokenizeParams(max_total_tokens=8, max_output_tokens=1, truncate_prompt_tokens=truncate, truncation_side=side)
    done = chat(r, 10, params)  # [<s>, 10 words]
    full = [0, *[3, 4, 5] * 3, 3]
    assert done.ids == (full[-kept:] if side == "left" else full[:kept])
    assert done.receipt.tokens_privatized == (kept if side == "left" else kept - 1)  # <s> is template
    assert params.apply_post_tokenization(r.tokenizer, {"prompt_token_ids": list(done.ids)})["prompt_token_ids"] == done.ids


def test_a_chat_within_the_limits_is_privatized_whole():
    done = chat(renderer(), 3, TokenizeParams(max_total_tokens=8, max_output_tokens=1))
    assert done.ids == [0, 3, 4, 5] and done.mask == [False, True, True, True]


def test_a_chat_asking_for_special_tokens_gets_them_around_the_privatized_ids():
    """Tokens and embeddings mode: public BOS/EOS rows around the (already privatized) prompt."""
    renderer_ = DPRenderer.__new__(DPRenderer)  # the two methods need only these attributes
    renderer_._around, renderer_._special = None, frozenset({0, 1})
    renderer_.tokenizer = tokenizer("<s> $A </s>")
    tokens = {"prompt_token_ids": [5, 4]}
    renderer_._add_special_tokens(tokens)
    assert tokens == {"prompt_token_ids": [0, 5, 4, 1]}
    embeds = {"prompt_token_ids": [9, 9], "prompt_embeds": torch.ones(2, 3), "prompt_is_token_ids": [False, True]}
    renderer_._add_special_tokens(embeds)
    assert embeds["prompt_token_ids"] == [0, 9, 9, 1] and embeds["prompt_is_token_ids"] == [True, False, True, True]
    assert embeds["prompt_embeds"].sum(1).tolist() == [0.0, 3.0, 3.0, 0.0]


def test_privatization_does_not_queue_behind_the_template_renders():
    """Privatization runs on its own worker: with vLLM's render pool busy (its one worker held,
    as by the renders of many concurrent chats), an offloaded privatization still finishes (on
    the render pool it waited, and vLLM timed the renders queued behind it out with a 500)."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    r = renderer()
    r._executor, release = ThreadPoolExecutor(max_workers=1), threading.Event()
    r._executor.submit(release.wait, 10)
    try:
        assert asyncio.run(asyncio.wait_for(r._offload(lambda x: x + 1, 1), 2.0)) == 2
    finally:
        release.set()
        r._executor.shutdown()
    assert r._privatizer is not r._executor
