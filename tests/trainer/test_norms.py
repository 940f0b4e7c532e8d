"""Per-sample squared gradient norms (ghost norms, Phantom Clipping) against brute-force
per-sample gradients from ``torch.func`` (float64, 1e-10 relative; the issue asks 1e-6)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from vllm_dp_plugin.trainer.norm_rules import (
    bias_sq_norms,
    layernorm_sq_norms,
    linear_sq_norms,
    lookup_sq_norms,
    rmsnorm_sq_norms,
    tied_embedding_sq_norms,
)

PAD = 0
VOCAB, DIM, TOKENS, BATCH = 11, 6, 7, 5


class TinyTied(torch.nn.Module):
    """Tied input/output embedding (padding_idx, sqrt(d) scaling), learned positions, a
    parameter-free causal mixing (so pad positions receive gradient, as under attention),
    LayerNorm, RMSNorm, a Linear with bias and a ReLU: every layer type the norms cover."""

    def __init__(self, seed: int, tied: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        rand = lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64))
        self.E, self.P = rand(VOCAB, DIM), rand(TOKENS, DIM)
        self.ln_w, self.ln_b, self.rms_w = rand(DIM), rand(DIM), rand(DIM)
        self.W, self.b = rand(DIM, DIM), rand(DIM)
        self.out = None if tied else rand(VOCAB, DIM)
        self.tied = tied

    def forward(self, ids, targets, keep=None):
        e = F.embedding(ids, self.E, padding_idx=PAD)  # raw lookup output: the hook point
        x = e * math.sqrt(DIM) + self.P[: ids.shape[-1]]
        x = x + x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]  # causal mixing: pad rows matter
        ln_in = x
        x = F.layer_norm(x, (DIM,), self.ln_w, self.ln_b, eps=1e-5)
        rms_in = x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.rms_w
        a = x
        h = torch.relu(F.linear(a, self.W, self.b))
        z = h @ (self.E if self.tied else self.out).T  # tied output branch
        loss = F.cross_entropy(z.reshape(-1, VOCAB), targets.reshape(-1), reduction="none", ignore_index=PAD)
        loss = loss.reshape(targets.shape).sum(-1)  # per sample
        if keep is not None:
            keep.update(e=e, ln_in=ln_in, rms_in=rms_in, a=a, y=h, z=z)
        return loss


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 5, (BATCH, TOKENS), generator=g)  # few ids: many repeats
    ids[0, -2:] = PAD
    ids[1, 0] = PAD
    targets = torch.randint(1, VOCAB, (BATCH, TOKENS), generator=g)
    targets[ids == PAD] = PAD
    return ids, targets


def per_sample_sq_norms(model, ids, targets) -> dict:
    """name -> [B] squared norms of brute-force per-sample gradients."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, i, t):
        return functional_call(model, p, (i[None], t[None]))[0]

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, ids, targets)
    return {k: v.pow(2).flatten(1).sum(1) for k, v in grads.items()}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tied", [True, False])
def test_embedding_norms_equal_brute_force(seed, tied):
    model = TinyTied(seed, tied)
    ids, targets = batch(seed)
    truth = per_sample_sq_norms(model, ids, targets)
    keep = {}
    loss = model(ids, targets, keep)
    h = torch.relu(F.linear(keep["a"], model.W, model.b)).detach()
    g_e, g_z = torch.autograd.grad(loss.sum(), [keep["e"], keep["z"]])
    if tied:
        got = tied_embedding_sq_norms(ids, g_e, h, g_z, PAD)
    else:
        got = lookup_sq_norms(ids, g_e, PAD)
        torch.testing.assert_close(linear_sq_norms(h, g_z), truth["out"], rtol=1e-10, atol=0)
    torch.testing.assert_close(got, truth["E"], rtol=1e-10, atol=0)
    if tied:  # the paper's printed Eq. 4.1 (first term squared) is wrong: it must not pass
        t_in = lookup_sq_norms(ids, g_e, PAD)
        assert not torch.allclose(got - t_in + t_in.pow(2), truth["E"], rtol=1e-3)


@pytest.mark.parametrize("ghost", [True, False])
def test_linear_and_bias_norms_equal_brute_force(ghost):
    """Both branches of the mixed rule (ghost Grams when 2 T^2 <= d_in d_out)."""
    g = torch.Generator().manual_seed(3)
    tokens = 2 if ghost else 9  # 2*4 <= 36 < 2*81
    w = torch.randn(DIM, DIM, generator=g, dtype=torch.float64)
    b = torch.randn(DIM, generator=g, dtype=torch.float64)
    a = torch.randn(BATCH, tokens, DIM, generator=g, dtype=torch.float64)
    target = torch.randn(BATCH, tokens, DIM, generator=g, dtype=torch.float64)

    def loss_one(params, x, t):
        return (torch.tanh(F.linear(x, params["w"], params["b"])) - t).pow(2).sum()

    per = vmap(grad(loss_one), in_dims=(None, 0, 0))({"w": w, "b": b}, a, target)
    y = F.linear(a, w, b).requires_grad_(True)
    g_y = torch.autograd.grad((torch.tanh(y) - target).pow(2).sum(), y)[0]
    torch.testing.assert_close(linear_sq_norms(a, g_y), per["w"].pow(2).sum((1, 2)), rtol=1e-10, atol=0)
    torch.testing.assert_close(bias_sq_norms(g_y), per["b"].pow(2).sum(1), rtol=1e-10, atol=0)


def test_norm_layer_norms_equal_brute_force():
    model = TinyTied(5)
    ids, targets = batch(5)
    truth = per_sample_sq_norms(model, ids, targets)
    keep = {}
    model(ids, targets, keep)
    # gradients at the outputs of the LayerNorm and RMSNorm ops
    ln_out = F.layer_norm(keep["ln_in"].detach(), (DIM,), model.ln_w, model.ln_b, eps=1e-5)
    loss = _rest_after_layernorm(model, ln_out, targets)
    (g_ln,) = torch.autograd.grad(loss.sum(), [ln_out])
    got = layernorm_sq_norms(keep["ln_in"].detach(), g_ln, eps=1e-5)
    torch.testing.assert_close(got, truth["ln_w"] + truth["ln_b"], rtol=1e-10, atol=0)
    rms_in = keep["rms_in"].detach()
    rms_out = rms_in * torch.rsqrt(rms_in.pow(2).mean(-1, keepdim=True) + 1e-6) * model.rms_w
    (g_rms,) = torch.autograd.grad(_rest_after_rmsnorm(model, rms_out, targets).sum(), [rms_out])
    torch.testing.assert_close(rmsnorm_sq_norms(rms_in, g_rms, eps=1e-6), truth["rms_w"], rtol=1e-10, atol=0)


def _rest_after_rmsnorm(model, x, targets):
    z = torch.relu(F.linear(x, model.W, model.b)) @ model.E.T
    loss = F.cross_entropy(z.reshape(-1, VOCAB), targets.reshape(-1), reduction="none", ignore_index=PAD)
    return loss.reshape(targets.shape).sum(-1)


def _rest_after_layernorm(model, x, targets):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * model.rms_w
    return _rest_after_rmsnorm(model, x, targets)


def test_bf16_inputs_are_normed_in_float32():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(2, 3, 4, generator=g).to(torch.bfloat16)
    grad_out = torch.randn(2, 3, 5, generator=g).to(torch.bfloat16)
    got = linear_sq_norms(a, grad_out)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, linear_sq_norms(a.float(), grad_out.float()))
