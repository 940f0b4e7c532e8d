"""The secret sharer test: rank and exposure on hand-checked cases, the digit-tree scores equal
to scoring every candidate sequence in full, and the canaries' tokenization."""

import math
from pathlib import Path

import pytest
import torch

from vllm_dp_plugin.trainer.canary import (
    Canary,
    canary_ids,
    exposure,
    insert_canaries,
    make_canaries,
    rank_of,
    secret_nll,
)

SMOLLM2 = Path(__file__).resolve().parents[2] / ".models" / "smollm2-135m-instruct"


def test_rank_and_exposure_on_a_hand_checked_case():
    nll = torch.tensor([3.0, 1.0, 2.0, 0.5])  # candidate 2 (nll 2.0) is beaten by 1.0 and 0.5
    assert rank_of(nll, 2) == 3
    assert exposure(3, 4) == pytest.approx(2 - math.log2(3))  # 0.415 bits
    assert rank_of(nll, 3) == 1 and exposure(1, 4) == 2.0  # the best candidate: log2(4) bits
    assert rank_of(nll, 0) == 4 and exposure(4, 4) == 0.0
    assert rank_of(torch.tensor([1.0, 1.0, 1.0]), 1) == 1  # ties do not push the secret down
    with pytest.raises(ValueError, match="rank"):
        exposure(0, 4)


def test_exposure_of_a_random_rank_is_log2e_bits_on_average():
    """Chance level: E[log2 C - log2 U{1..C}] -> log2(e) bits (Stirling), 1.44."""
    c = 10_000
    mean = sum(exposure(r, c) for r in range(1, c + 1)) / c
    assert mean == pytest.approx(math.log2(math.e), abs=2e-3)


def test_canaries_are_reproducible_and_inserted_as_separate_documents():
    canaries = make_canaries([1, 4], per_level=2, digits=4, seed=3)
    assert [c.repetitions for c in canaries] == [1, 1, 4, 4]
    assert canaries == make_canaries([1, 4], per_level=2, digits=4, seed=3)
    assert all(len(c.secret) == 4 and c.secret.isdigit() for c in canaries)
    assert len({c.prefix for c in canaries}) == 4
    docs = insert_canaries(["a", "b"], canaries, seed=0)
    assert sorted(docs) == sorted(["a", "b"] + [c.text for c in canaries for _ in range(c.repetitions)])


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).double().eval()


def test_digit_tree_scores_equal_full_sequence_scores():
    model = _tiny_llama()
    context, digit_ids = [1, 7, 9, 4], list(range(20, 30))
    nll = secret_nll(model, context, digit_ids, digits=3)
    assert nll.shape == (1000,) and nll.dtype == torch.float64
    for secret in (0, 7, 42, 305, 999):
        ids = context + [digit_ids[int(d)] for d in f"{secret:03d}"]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
        want = -sum(logp[len(context) - 1 + i, ids[len(context) + i]] for i in range(3))
        assert float(nll[secret]) == pytest.approx(float(want), rel=1e-9, abs=1e-9)


@pytest.mark.skipif(not SMOLLM2.exists(), reason="no .models/smollm2-135m-instruct (make real-models)")
def test_smollm2_tokenizes_each_digit_of_a_canary_alone():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    canary = Canary("Alice Moreau's PIN is", "4827", 1)
    context, digit_ids = canary_ids(tokenizer, canary)
    assert context[0] == tokenizer.bos_token_id and len(set(digit_ids)) == 10
    assert tokenizer.decode(digit_ids) == "0123456789"
    full = [tokenizer.bos_token_id] + tokenizer.encode(canary.text, add_special_tokens=False)
    assert full[: len(context) + 4] == context + [digit_ids[int(d)] for d in "4827"]
