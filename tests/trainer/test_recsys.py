"""The DPFormer recommender, the synthetic long-tailed data and the full-ranking metrics."""

import math

import pytest
import torch
import torch.nn.functional as F

from vllm_dp_plugin.trainer.metrics import (
    evaluate_ranking,
    full_ranking_metrics,
    ndcg_hit,
    target_ranks,
)
from vllm_dp_plugin.trainer.reattention import ReAttentionConfig, head_linear_variance
from vllm_dp_plugin.trainer.recsys import IGNORE, DPFormerRec
from vllm_dp_plugin.trainer.synthetic import (
    Interactions,
    SyntheticConfig,
    generate_interactions,
    item_counts,
    leave_one_out,
)

VOCAB, MAX_LEN, D = 30, 8, 16


def token_p(rare: float = 1e-3) -> torch.Tensor:
    """Half the items frequent (p = 0.5), half rare; pad 1."""
    p = torch.full((VOCAB,), 0.5, dtype=torch.float64)
    p[VOCAB // 2 :] = rare
    p[0] = 1.0
    return p


def make_model(cfg: ReAttentionConfig | None, seed: int = 0, heads: int = 2) -> DPFormerRec:
    torch.manual_seed(seed)
    return DPFormerRec(VOCAB, MAX_LEN, d=D, heads=heads, dropout=0.1, reattention=cfg).eval()


def reatt(**kw) -> ReAttentionConfig:
    return ReAttentionConfig(**{"sigma_dp": 2.0, "batch_size": 64, "token_p": token_p(), **kw})


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids ``[4, MAX_LEN]`` and next-item targets (IGNORE where the input is pad)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (4, MAX_LEN), generator=g)
    for row, pads in enumerate((0, 3, 6, MAX_LEN)):  # the last row is all padding
        ids[row, :pads] = 0
    targets = torch.randint(1, VOCAB, (4, MAX_LEN), generator=g).masked_fill(ids == 0, IGNORE)
    return ids, targets


# ---------------------------------------------------------------- model


def test_shapes_tied_weight_and_engine_modules():
    model = make_model(reatt())
    ids, targets = batch()
    assert model(ids, targets).shape == (4,)
    scores = model.last_scores(ids)
    assert scores.shape == (4, VOCAB) and torch.isneginf(scores[:, 0]).all()
    assert model.out.weight is model.item_emb.weight
    assert sum(p is model.item_emb.weight for p in model.parameters()) == 1
    assert model.reattention.emb_scale == math.sqrt(D)
    allowed = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.Dropout)
    for module in model.modules():
        assert not list(module.parameters(recurse=False)) or isinstance(module, allowed), module


def test_each_parameterised_module_is_called_once():
    model = make_model(reatt())
    calls = {}
    for name, module in model.named_modules():
        if list(module.parameters(recurse=False)):
            module.register_forward_hook(
                lambda m, i, o, name=name: calls.update({name: calls.get(name, 0) + 1})
            )
    model(*batch())
    assert calls and set(calls.values()) == {1}


def plain_forward(model: DPFormerRec, ids: torch.Tensor) -> torch.Tensor:
    """Reference: a straightforward post-LN causal Transformer on the model's own modules."""
    t = ids.shape[1]
    valid = ids != 0
    x = model.item_emb(ids) * math.sqrt(D) + model.pos_emb(torch.arange(t).expand_as(ids))
    mask = (torch.ones(t, t, dtype=torch.bool).tril() & valid[:, None, :]) | torch.eye(
        t, dtype=torch.bool
    )
    for blk in model.blocks:
        att = blk.attn
        q, k, v = (
            y.view(*y.shape[:2], att.heads, -1).transpose(1, 2)
            for y in (att.q(x), att.k(x), att.v(x))
        )
        logits = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
            ~mask[:, None], -math.inf
        )
        a = att.o((torch.softmax(logits, -1) @ v).transpose(1, 2).flatten(2))
        x = blk.ln1(x + a)
        x = blk.ln2(x + blk.ff2(torch.relu(blk.ff1(x))))
    return model.out(x).masked_fill(torch.arange(VOCAB) == 0, -math.inf)


def test_disabled_and_vanilla_are_bit_identical_to_the_plain_transformer():
    ids, _ = batch()
    reference = plain_forward(make_model(None), ids)
    for cfg in (None, reatt(enabled=False)):
        model = make_model(cfg)
        assert torch.equal(model._logits(model.hidden(ids)), reference)
    on = make_model(reatt())
    assert not torch.equal(on._logits(on.hidden(ids)), reference)  # the correction acts here
    zero_noise = make_model(reatt(sigma_dp=0.0))
    assert torch.equal(zero_noise._logits(zero_noise.hidden(ids)), reference)


def test_per_sample_loss_is_mean_nll_over_valid_positions_and_ignores_pads():
    model = make_model(reatt())
    ids, targets = batch()
    loss = model(ids, targets)
    nll = -F.log_softmax(model._logits(model.hidden(ids)), -1)
    for row in range(3):
        keep = targets[row] != IGNORE
        expected = nll[row, keep].gather(1, targets[row, keep][:, None]).mean()
        torch.testing.assert_close(loss[row], expected)
        alone = model(ids[row : row + 1], targets[row : row + 1])  # no mixing across samples
        torch.testing.assert_close(alone[0], loss[row])
    assert loss[3] == 0.0  # no valid target at all
    # pads contribute nothing: the pad row of the item table, and the positional rows a sample
    # only uses at pad positions (row 1 has 3 left pads), do not change its loss
    with torch.no_grad():
        model.item_emb.weight[0] = 7.0
        model.pos_emb.weight[:3] = -7.0
    changed = model(ids, targets)
    assert changed[1] == loss[1] and changed[0] != loss[0]


def test_causal_future_items_do_not_change_earlier_positions():
    model = make_model(reatt())
    ids, _ = batch()
    before = model._logits(model.hidden(ids))
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] % (VOCAB - 1)) + 1
    after = model._logits(model.hidden(changed))
    assert torch.equal(after[:, :5], before[:, :5])
    assert not torch.equal(after[:2, 5:], before[:2, 5:])


def test_high_variance_key_gets_less_attention():
    # query t=2 sees keys 0 and 1 computed from identical inputs: equal attention without the
    # correction; with input variances (0, 5) the keys' variances differ by the linear rule's
    # v_x terms and the probability ratio is exp(-||q_2||^2 (v_K1 - v_K0) / (2 d_h))
    model = make_model(reatt(), heads=1)
    attn = model.blocks[0].attn
    x = torch.randn(1, 3, D)
    x[0, 1] = x[0, 0]
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    probs = {}
    for name, v_x, cfg in (
        ("plain", None, None),
        ("corrected", torch.tensor([[0.0, 5.0, 0.0]]), reatt()),
    ):
        captured = {}
        hook = attn.drop.register_forward_hook(
            lambda m, i, o, captured=captured: captured.update(p=o)
        )
        _, v_out = attn(x, v_x, allowed, cfg)
        hook.remove()
        probs[name] = captured["p"][0, 0, 2].detach()
        assert v_out is None or (torch.isfinite(v_out).all() and (v_out >= 0).all())
    assert probs["plain"][0] == probs["plain"][1]
    v_key = head_linear_variance(
        torch.tensor([0.0, 5.0]), x[0, :2], attn.k.weight, reatt().block_variance(), 1
    )
    expected_ratio = torch.exp(
        -attn.q(x)[0, 2].detach().pow(2).sum() * (v_key[0, 1] - v_key[0, 0]) / (2 * D)
    )
    assert expected_ratio < 0.9
    torch.testing.assert_close(probs["corrected"][1] / probs["corrected"][0], expected_ratio)


def test_set_noise_and_gradients_are_finite_with_left_padding():
    model = make_model(reatt(sigma_dp=0.0))
    ids, targets = batch()
    model.set_noise(3.0, 32)
    assert model.reattention.sigma_dp == 3.0 and model.reattention.batch_size == 32
    assert model.reattention.emb_scale == math.sqrt(D)
    model.train()
    model(ids, targets).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.item_emb.weight.grad[0].abs().max() == 0  # pad row: no gradient
    make_model(None).set_noise(1.0, 8)  # vanilla: no-op
    with pytest.raises(ValueError, match="token_p"):
        DPFormerRec(VOCAB + 1, MAX_LEN, d=D, reattention=reatt())
    with pytest.raises(ValueError, match="max_len"):
        model.hidden(torch.ones(1, MAX_LEN + 1, dtype=torch.long))


# ---------------------------------------------------------------- synthetic data

SMALL = SyntheticConfig(num_users=600, num_items=1000, num_clusters=10, max_len=30, seed=3)


@pytest.fixture(scope="module")
def small_data() -> Interactions:
    return generate_interactions(SMALL)


def test_synthetic_is_deterministic_long_tailed_and_without_repeats(small_data):
    again = generate_interactions(SMALL)
    assert torch.equal(again.items, small_data.items) and torch.equal(
        again.lengths, small_data.lengths
    )
    other = generate_interactions(SyntheticConfig(**{**SMALL.__dict__, "seed": 4}))
    assert not torch.equal(other.items, small_data.items)
    lengths = small_data.lengths
    assert lengths.min() >= SMALL.min_len and lengths.max() <= SMALL.max_len
    assert (
        abs(lengths.double().mean() - SMALL.mean_len) < 2.0
    )  # capped geometric, ~1.5 below the uncapped mean
    counts = item_counts(small_data.items, SMALL.vocab_size)[1:].sort(descending=True).values
    assert (
        counts[: SMALL.num_items // 10].sum() > 0.5 * counts.sum()
    )  # top 10% of items: most interactions
    for row, n in zip(small_data.items, lengths, strict=True):
        assert len(set(row[:n].tolist())) == n and (row[n:] == 0).all()


def test_leave_one_out_windows_by_hand():
    items = torch.tensor([[1, 2, 3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 0, 0, 0, 0]])
    split = leave_one_out(Interactions(items, torch.tensor([6, 4])), max_len=3)
    assert split.train_ids.tolist() == [[1, 2, 3], [0, 0, 7]]
    assert split.train_targets.tolist() == [[2, 3, 4], [IGNORE, IGNORE, 8]]
    assert split.valid_ids.tolist() == [[2, 3, 4], [0, 7, 8]] and split.valid_target.tolist() == [
        5,
        9,
    ]
    assert split.test_ids.tolist() == [[3, 4, 5], [7, 8, 9]] and split.test_target.tolist() == [
        6,
        10,
    ]
    with pytest.raises(ValueError, match="3 items"):
        leave_one_out(Interactions(items, torch.tensor([6, 2])), max_len=3)


def test_sequence_structure_beats_popularity(small_data):
    # a first-order transition count model (from training pairs only) beats MostPop on the test
    # item: the data has learnable structure beyond popularity
    split = leave_one_out(small_data, 20)
    vocab = SMALL.vocab_size
    pairs = (split.train_ids * vocab + split.train_targets.clamp_min(0))[
        split.train_targets != IGNORE
    ]
    transitions = torch.bincount(pairs, minlength=vocab * vocab).view(vocab, vocab).double()
    popularity = item_counts(split.train_ids, vocab).double()
    most_pop = full_ranking_metrics(
        popularity.expand(len(split.test_target), -1), split.test_target, split.test_ids
    )
    markov = full_ranking_metrics(
        transitions[split.test_ids[:, -1]] + 1e-3 * popularity, split.test_target, split.test_ids
    )
    assert markov.ndcg > 1.5 * most_pop.ndcg and markov.hit > most_pop.hit


def test_synthetic_config_validation():
    for bad in ({"min_len": 2}, {"stickiness": 1.0}, {"mean_len": 100.0}, {"num_users": 0}):
        with pytest.raises(ValueError):
            SyntheticConfig(**bad)


# ---------------------------------------------------------------- metrics


def test_hand_made_ranking():
    # items 1..5; pad 0 scored highest must not count; user 0 target 3 has 2 items above -> r = 2;
    # user 1 target 5 is last of 5 -> r = 4; user 2 target 1 ties with item 2 -> pessimistic r = 1
    scores = torch.tensor([[9.0, 5, 4, 3, 2, 1], [9.0, 5, 4, 3, 2, 1], [9.0, 1, 1, 0, 0, 0]])
    targets = torch.tensor([3, 5, 1])
    assert target_ranks(scores, targets).tolist() == [2, 4, 1]
    m = full_ranking_metrics(scores, targets, k=3)
    assert m.hit == pytest.approx(2 / 3)
    assert m.ndcg == pytest.approx((1 / math.log2(4) + 1 / math.log2(3)) / 3)
    # excluding history: user 0 has seen items 1 and 3 (its own target is never excluded) -> r = 1
    history = torch.tensor([[0, 1, 3], [0, 0, 0], [0, 0, 0]])
    assert target_ranks(scores, targets, history).tolist() == [1, 4, 1]
    ndcg, hit = ndcg_hit(torch.tensor([0, 9, 10]), k=10)
    torch.testing.assert_close(
        ndcg, torch.tensor([1.0, 1 / math.log2(11), 0.0], dtype=torch.float64)
    )
    assert hit.tolist() == [1.0, 1.0, 0.0]


def test_perfect_and_constant_scorers_and_bad_input():
    targets = torch.tensor([4, 1, 7, 2])
    perfect = F.one_hot(targets, 9).double()
    m = evaluate_ranking(
        lambda ids: perfect[ids[:, 0]],
        torch.arange(4)[:, None],
        targets,
        batch_size=3,
        exclude_history=False,
    )
    assert (m.ndcg, m.hit, m.users) == (1.0, 1.0, 4)
    constant = full_ranking_metrics(torch.zeros(4, 9), targets, k=7)  # 8 candidates, all tied
    assert constant.hit == 0.0  # ties are pessimistic: rank 7
    with pytest.raises(ValueError, match="NaN"):
        full_ranking_metrics(torch.full((4, 9), math.nan), targets)
    with pytest.raises(ValueError, match="pad"):
        target_ranks(perfect, torch.tensor([4, 0, 7, 2]))
