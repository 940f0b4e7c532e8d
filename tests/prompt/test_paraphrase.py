"""The paraphrase mechanism's math: its law, its bound, greedy at eps -> inf, the cap, the receipt."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.prompt.test_mechanisms import chi_square_pvalue
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.prompt.paraphrase import (
    DEFAULT_TEMPLATE,
    ParaphraseMechanism,
    rewrite_prompt,
    rewrite_seed,
)

PVALUE = 1e-4
EOS = 2


@pytest.fixture(scope="module")
def tiny_lm() -> LlamaForCausalLM:
    """A 64-token Llama with spread-out logits (float64)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.5, eos_token_id=EOS)
    return LlamaForCausalLM(config).double().eval()


def next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]  # [V]


def rewrite(model, prompt: list[int], mech: ParaphraseMechanism, generator) -> list[int]:
    """Reference decoder: one exponential-mechanism draw per step, up to the cap or EOS."""
    out: list[int] = []
    while len(out) < mech.max_tokens:
        token = int(mech.sample(next_logits(model, prompt + out)[None], generator)[0])
        out.append(token)
        if token == EOS:
            break
    return out


def test_law_is_softmax_of_clipped_logits_at_temperature_2w_over_eps():
    logits = torch.tensor([[3.0, 2.5, -10.0, 0.0]])
    mech = ParaphraseMechanism(epsilon=4.0, width=2.0)
    u = torch.tensor([0.0, -0.5, -2.0, -2.0])  # clip(l - 3, -2, 0)
    expected = torch.softmax(u.double() / (2 * 2.0 / 4.0), 0)
    assert mech.temperature == 1.0
    torch.testing.assert_close(mech.probabilities(logits)[0], expected, rtol=1e-12, atol=0)


def test_one_step_sampling_law_on_a_tiny_model(tiny_lm):
    """Chi-square of 20,000 draws against the exact exponential-mechanism law of the model's
    next-token logits; the same draws reject a law at the wrong epsilon (power)."""
    logits = next_logits(tiny_lm, [5, 9, 14])
    mech = ParaphraseMechanism(epsilon=6.0, width=4.0)
    probs = mech.probabilities(logits[None])[0].numpy()
    assert probs.max() < 0.5 and (probs > 0.01).sum() >= 5  # a law worth testing
    picks = mech.sample(logits.expand(20_000, -1), torch.Generator().manual_seed(1)).numpy()
    assert chi_square_pvalue(picks, probs) > PVALUE
    wrong = ParaphraseMechanism(epsilon=6.0 * 1.3, width=4.0).probabilities(logits[None])[0].numpy()
    assert chi_square_pvalue(picks, wrong) < PVALUE


@pytest.mark.parametrize("eps,width,vocab", [(1.0, 5.0, 50_000), (8.0, 2.0, 50_000), (30.0, 5.0, 1000), (60.0, 1.0, 1000)])
def test_clipping_bound_holds_and_is_attained(eps, width, vocab):
    """For ANY two inputs the log-ratio of an output's probabilities is <= eps: random logit
    pairs stay below it; the worst pair (the output on top vs at the floor, every other token at
    the floor vs on top) reaches eps/2 + ln(V - 1 + e^{-eps/2}) - ln(1 + (V - 1) e^{-eps/2}), which
    tends to eps as V e^{-eps/2} grows."""
    mech = ParaphraseMechanism(epsilon=eps, width=width)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(64, vocab, generator=gen) * 10, torch.randn(64, vocab, generator=gen) * 10
    ratio = (mech.probabilities(a).log() - mech.probabilities(b).log()).abs().max()
    assert ratio <= eps + 1e-9
    top = torch.full((1, vocab), -1e6, dtype=torch.float64)
    top[0, 0] = 0.0
    floor = torch.zeros((1, vocab), dtype=torch.float64)
    floor[0, 0] = -1e6
    worst = float(mech.probabilities(top)[0, 0].log() - mech.probabilities(floor)[0, 0].log())
    assert worst <= eps + 1e-9
    half = math.exp(-eps / 2)
    exact = eps / 2 + math.log(vocab - 1 + half) - math.log1p((vocab - 1) * half)
    assert worst == pytest.approx(exact, rel=1e-9)
    if vocab * half > 100:
        assert worst > eps - 2 / (vocab * half)  # the bound is tight: a large vocabulary attains it


def test_infinite_epsilon_reproduces_greedy_decoding(tiny_lm):
    prompt = [7, 11, 3]
    mech = ParaphraseMechanism(epsilon=1e15, width=5.0, max_tokens=12)
    greedy: list[int] = []
    while len(greedy) < 12 and (not greedy or greedy[-1] != EOS):
        greedy.append(int(next_logits(tiny_lm, prompt + greedy).argmax()))
    for seed in range(3):
        assert rewrite(tiny_lm, prompt, mech, torch.Generator().manual_seed(seed)) == greedy
    noisy = ParaphraseMechanism(epsilon=2.0, width=5.0, max_tokens=12)
    assert any(rewrite(tiny_lm, prompt, noisy, torch.Generator().manual_seed(s)) != greedy for s in range(3))


@pytest.mark.parametrize("cap", [1, 4, 9])
def test_rewrite_never_exceeds_its_public_cap(tiny_lm, cap):
    mech = ParaphraseMechanism(epsilon=1.0, width=5.0, max_tokens=cap)  # near-uniform: EOS is rare
    lengths = [len(rewrite(tiny_lm, [4, 4], mech, torch.Generator().manual_seed(s))) for s in range(8)]
    assert max(lengths) <= cap and cap in lengths


def test_receipt_composes_over_the_cap():
    mech = ParaphraseMechanism(epsilon=3.0, width=5.0, max_tokens=20)
    receipt = mech.receipt()
    assert receipt.tokens_privatized == 20 and receipt.basic.epsilon == pytest.approx(60.0)
    assert receipt.basic.delta == 0.0 and receipt.total.epsilon <= 60.0
    small = ParaphraseMechanism(epsilon=0.1, width=5.0, max_tokens=1000).receipt()
    assert small.total is small.advanced and small.advanced.epsilon < 100.0  # advanced wins for many small steps
    assert "ANY two user texts" in mech.guarantee.statement()


@pytest.mark.parametrize("kwargs,name", [({"epsilon": 0.0}, "eps"), ({"epsilon": 1.0, "width": -1.0}, "width"),
                                         ({"epsilon": 1.0, "max_tokens": 0}, "max_tokens")])
def test_bad_settings_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ParaphraseMechanism(**kwargs)


def test_prompt_and_keyed_seed(tmp_path):
    assert rewrite_prompt("Where is it?", "Q: {text}\nA:") == "Q: Where is it?\nA:"
    assert "Where is it?" in rewrite_prompt("Where is it?", DEFAULT_TEMPLATE)
    with pytest.raises(ValueError, match="exactly once"):
        rewrite_prompt("x", "no placeholder")
    key, other = NoiseKey(tmp_path / "a.key"), NoiseKey(tmp_path / "b.key")
    mech = ParaphraseMechanism(epsilon=30.0)
    seed = rewrite_seed(key, mech, DEFAULT_TEMPLATE, "hello")
    assert seed == rewrite_seed(NoiseKey(tmp_path / "a.key"), mech, DEFAULT_TEMPLATE, "hello")  # restart: same
    assert 0 <= seed < 2**63
    assert len({seed, rewrite_seed(other, mech, DEFAULT_TEMPLATE, "hello"),
                rewrite_seed(key, mech, DEFAULT_TEMPLATE, "hello!"),
                rewrite_seed(key, ParaphraseMechanism(epsilon=31.0), DEFAULT_TEMPLATE, "hello")}) == 4
