"""The norm-rule registry: lookup by module type, a clear error for an unsupported type, and
every registered rule against brute-force per-sample gradients (``torch.func``, float64, 1e-10
relative) on a tiny module of its type: each parameter's norms and clipped sum, and the
reference forward the engine checks modules against."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from vllm_dp_plugin.trainer.norm_rules import (
    InputGrams,
    NormRule,
    find_rule,
    register_norm_rule,
    registered_rules,
    rule_for,
)

BATCH, DIM, OUT, VOCAB = 4, 6, 5, 11


class TinyRMSNorm(nn.Module):
    """Duck-typed like Llama's: matched by class name, ``variance_epsilon``."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def conv1d():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    return pytorch_utils.Conv1D(OUT, DIM)


class NarrowLinear(nn.Linear):
    """A subclass: found through its MRO."""


CASES = {
    "linear": lambda: nn.Linear(DIM, OUT),
    "linear_no_bias": lambda: nn.Linear(DIM, OUT, bias=False),
    "linear_subclass": lambda: NarrowLinear(DIM, OUT),
    "conv1d": conv1d,
    "embedding": lambda: nn.Embedding(VOCAB, DIM),
    "embedding_padding": lambda: nn.Embedding(VOCAB, DIM, padding_idx=0),
    "layernorm": lambda: nn.LayerNorm(DIM),
    "layernorm_no_bias": lambda: nn.LayerNorm(DIM, bias=False),
    "rmsnorm": lambda: nn.RMSNorm(DIM, eps=1e-6),
    "rmsnorm_default_eps": lambda: nn.RMSNorm(DIM),
    "rmsnorm_duck_typed": lambda: TinyRMSNorm(DIM),
}


def build(case: str) -> nn.Module:
    torch.manual_seed(0)
    module = CASES[case]().double()
    with torch.no_grad():  # non-trivial affine parameters (norm layers start at 1 and 0)
        for p in module.parameters():
            p.add_(torch.randn_like(p))
    return module


def inputs(rule: NormRule, module: nn.Module, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(tokens)
    if rule.lookup:
        ids = torch.randint(0, VOCAB, (BATCH, tokens), generator=g)
        ids[:, 0] = ids[:, -1]  # a repeated id in every sample (the same-id mask)
        ids[0, 1] = 0  # padding_idx, where set
        return ids
    return torch.randn(BATCH, tokens, DIM, generator=g, dtype=torch.float64)


def test_every_registered_rule_has_a_brute_force_case():
    covered = {find_rule(build(case)).name for case in CASES}
    assert covered == {rule.name for rule in registered_rules()}


@pytest.mark.parametrize("tokens", [2, 9])  # linear: ghost Grams (2 T^2 <= d_in d_out) and not
@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_equals_brute_force_per_sample_gradients(case, tokens):
    module = build(case)
    rule = rule_for(module)
    x = inputs(rule, module, tokens)
    torch.testing.assert_close(rule.reference(module, x), module(x), rtol=1e-12, atol=1e-12)
    target = torch.randn(module(x).shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss_one(params, x_b, t_b):  # a per-sample loss that is not linear in the output
        return (torch.tanh(functional_call(module, params, (x_b[None],))) * t_b[None]).sum()

    params = {name: p.detach() for name, p in module.named_parameters()}
    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, target)
    y = module(x).detach().requires_grad_(True)
    (g,) = torch.autograd.grad((torch.tanh(y) * target).sum(), y)  # at the module output
    c = torch.rand(BATCH, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    checked = set()
    for role in rule.roles:
        if getattr(module, role.attr) is None:
            continue
        truth = per_sample[role.attr]
        torch.testing.assert_close(
            role.sq_norms(module, x, g, InputGrams()), truth.pow(2).flatten(1).sum(1), rtol=1e-10, atol=0
        )
        torch.testing.assert_close(
            role.clipped_sum(module, x, g, c), torch.einsum("b,b...->...", c, truth), rtol=1e-10, atol=1e-12
        )
        checked.add(role.attr)
    assert checked == set(params), f"{case}: parameters without a role: {set(params) - checked}"


def test_unsupported_module_type_is_named():
    conv = nn.Conv2d(1, 1, 1)
    assert find_rule(conv) is None
    with pytest.raises(ValueError, match=r"no per-sample norm rule for module type Conv2d .*supported: .*Linear"):
        rule_for(conv)


def test_a_type_gets_one_rule():
    with pytest.raises(ValueError, match="Linear already has a norm rule"):
        register_norm_rule(nn.Linear)(type("Other", (NormRule,), {"name": "Other", "roles": ()}))
    assert [rule.name for rule in registered_rules()].count("Other") == 0


def test_input_grams_are_shared_by_value_identity_only():
    """One Gram per storage/offset/shape/strides/version: a view of the same values shares it; an
    in-place write (new version), an equal copy or another dtype gets its own."""
    x = torch.randn(BATCH, 3, DIM, dtype=torch.float64)
    grams = InputGrams()
    first = grams.of(x, torch.float64)
    assert grams.of(x.view(BATCH, 3, DIM), torch.float64) is first
    assert grams.of(x.clone(), torch.float64) is not first
    assert grams.of(x, torch.float32).dtype == torch.float32
    x.mul_(2)
    torch.testing.assert_close(grams.of(x, torch.float64), 4 * first, rtol=1e-15, atol=0)
