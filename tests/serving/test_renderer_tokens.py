"""Tokenisation around prompt privatization in the renderer.

``renderer.full_and_plain``: the untruncated and the plain tokenisation of a completion text,
re-tokenising only when vLLM's ids may be truncated or the tokenizer adds special tokens, and the
private mask ``locate_plain`` derives from them (added specials public, every text token private,
a special token typed in the text included). ``added_special_tokens``: the specials a tokenizer
adds, put around a chat's privatized ids when the request asks for ``add_special_tokens``."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from vllm_dp_plugin.prompt.session import added_special_tokens, locate_plain
from vllm_dp_plugin.serving.renderer import DPRenderer, full_and_plain

VOCAB = {"<s>": 0, "</s>": 1, "[UNK]": 2, "a": 3, "b": 4, "c": 5}
TEXT = "a b <s> c a"  # a special token typed by the user: private like any text token


class Counting:
    """A tokenizer proxy that counts tokenisations."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer.encode(*args, **kwargs)


def tokenizer(template: str | None) -> Counting:
    core = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template is not None:
        core.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0), ("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    return Counting(fast)


def encode_kwargs(add: bool, max_length: int | None = None) -> dict:
    return {"truncation": max_length is not None, "max_length": max_length, "add_special_tokens": add}


def adds(tok: Counting) -> bool:
    """What the renderer passes: does the tokenizer add any special token (probed, not counted)."""
    return added_special_tokens(tok.tokenizer, frozenset({0, 1})) != ([], [])


def vllm_ids(tok: Counting, kwargs: dict) -> list[int]:
    """What vLLM's ``_tokenize_prompt`` got (not counted)."""
    return tok.tokenizer(TEXT, **kwargs)["input_ids"]


@pytest.mark.parametrize("add", [True, False])
def test_a_tokenizer_adding_nothing_is_never_called_again(add):
    tok = tokenizer(None)
    kwargs = encode_kwargs(add)
    full, plain = full_and_plain(tok, TEXT, vllm_ids(tok, kwargs), kwargs, adds(tok))
    assert tok.calls == 0 and full == plain == [3, 4, 0, 5, 3]
    assert locate_plain(full, plain, frozenset({0, 1})) == [True] * 5


def test_added_bos_and_eos_are_public_and_cost_one_plain_pass():
    tok = tokenizer("<s> $A </s>")
    kwargs = encode_kwargs(True)
    full, plain = full_and_plain(tok, TEXT, vllm_ids(tok, kwargs), kwargs, adds(tok))
    assert tok.calls == 1  # the plain pass only
    assert full == [0, 3, 4, 0, 5, 3, 1] and plain == [3, 4, 0, 5, 3]
    assert locate_plain(full, plain, frozenset({0, 1})) == [False, True, True, True, True, True, False]


def test_without_added_specials_the_plain_pass_is_the_ids():
    tok = tokenizer("<s> $A </s>")
    kwargs = encode_kwargs(False)
    full, plain = full_and_plain(tok, TEXT, vllm_ids(tok, kwargs), kwargs, adds(tok))
    assert tok.calls == 0 and full == plain == [3, 4, 0, 5, 3]


def test_ids_as_long_as_the_limit_are_re_tokenised_whole():
    tok = tokenizer("<s> $A </s>")
    kwargs = encode_kwargs(True, max_length=4)
    truncated = vllm_ids(tok, kwargs)
    assert len(truncated) == 4
    full, plain = full_and_plain(tok, TEXT, truncated, kwargs, adds(tok))
    assert full == [0, 3, 4, 0, 5, 3, 1] and plain == [3, 4, 0, 5, 3] and tok.calls == 2
    short = encode_kwargs(True, max_length=50)  # under the limit: nothing truncated, no re-tokenising
    tok.calls = 0
    assert full_and_plain(tok, TEXT, vllm_ids(tok, short), short, adds(tok))[0] == full and tok.calls == 1


@pytest.mark.parametrize(("template", "around"), [(None, ([], [])), ("<s> $A", ([0], [])), ("<s> $A </s>", ([0], [1]))])
def test_added_special_tokens_are_found_by_probing(template, around):
    assert added_special_tokens(tokenizer(template).tokenizer, frozenset({0, 1})) == around


def test_a_chat_asking_for_special_tokens_gets_them_around_the_privatized_ids():
    """Tokens and embeddings mode: public BOS/EOS rows around the (already privatized) prompt."""
    renderer = DPRenderer.__new__(DPRenderer)  # the two methods need only these attributes
    renderer._around, renderer._special = None, frozenset({0, 1})
    renderer.tokenizer = tokenizer("<s> $A </s>").tokenizer
    tokens = {"prompt_token_ids": [5, 4]}
    renderer._add_special_tokens(tokens)
    assert tokens == {"prompt_token_ids": [0, 5, 4, 1]}
    embeds = {"prompt_token_ids": [9, 9], "prompt_embeds": torch.ones(2, 3), "prompt_is_token_ids": [False, True]}
    renderer._add_special_tokens(embeds)
    assert embeds["prompt_token_ids"] == [0, 9, 9, 1] and embeds["prompt_is_token_ids"] == [True, False, True, True]
    assert embeds["prompt_embeds"].sum(1).tolist() == [0.0, 3.0, 3.0, 0.0]
