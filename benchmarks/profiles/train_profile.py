"""Phase profile of one training step on SmolLM2-135M (B 32 x T 128, float32, 2 threads): the
bench's ``ours`` (DPEngine) or ``non_private`` step, its pieces wrapped with wall-clock timers
(``time.perf_counter``; nothing else changes). Usage: PYTHONPATH=<tree> python <this> ours|non_private <out.json>.
One warm-up step, then one timed step."""
import collections
import json
import os
import sys
import time

import torch

torch.set_num_threads(2)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import vllm_dp_plugin.trainer.engine as E
import vllm_dp_plugin.trainer.norm_rules.base as BASE
import vllm_dp_plugin.trainer.norm_rules.embedding as EM
import vllm_dp_plugin.trainer.norm_rules.linear as L
import vllm_dp_plugin.trainer.norm_rules.rmsnorm as R
from benchmarks.train import _model_size
from benchmarks.train import spec as S
from benchmarks.train.methods import METHODS
from vllm_dp_plugin.benchmarks.lib.scenarios import resolve_model

acc, cnt = collections.defaultdict(float), collections.Counter()


def wrap(owner, name, key):
    """Time every call of ``owner.name`` (skipped where this code version has no such name)."""
    f = getattr(owner, name, None)
    if f is None:
        return

    def timed(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        acc[key] += time.perf_counter() - t
        cnt[key] += 1
        return r

    setattr(owner, name, timed)


wrap(E.DPEngine, "_gradients", "autograd.grad w.r.t. the hooked outputs (+ per-sample grads of small params, after)")
wrap(E.DPEngine, "_sq_norms", "per-sample squared norms, all")
wrap(L, "linear_sq_norms", "  linear ghost norms (210 layers)")
wrap(L, "gram", "    Grams in linear.py (before: a and g; after: g only)")
wrap(BASE, "gram", "    input Grams via InputGrams (after)")
wrap(E, "tied_embedding_sq_norms", "  tied embedding, Phantom Clipping")
wrap(R, "rmsnorm_sq_norms", "  RMSNorm weights (61): norms (before)")
wrap(R, "rmsnorm_grads", "RMSNorm per-sample grads (61, after; once for norms and sum)")
wrap(L, "outer_sum", "clipped sums, linear weights (211, tied head incl.)")
wrap(EM, "lookup_clipped_sum", "clipped sum, embedding lookup")
wrap(E.DPEngine, "backward", "engine.backward, all")
wrap(E.DPEngine, "_add_noise", "noise, float64 keyed chunks (134.5M)")
wrap(E.DPEngine, "finish_step", "engine.finish_step, all")

which, out_path = sys.argv[1], sys.argv[2]
_, path = resolve_model("smollm2")
size = _model_size(path, 32, 128)
spec = S.BenchSpec(size=size, device="cpu", autocast="none", warmup=1, steps=1, seed=0,
                   noise_multiplier=1.0, clip_norm=1.0, lr=1e-4, model=path)
model = S.make_model(spec, METHODS[which], torch.device("cpu"))
batch = S.synthetic_batch(size, 0, torch.device("cpu"))
step = METHODS[which].build(model, batch, spec)
marks = {}
model.register_forward_pre_hook(lambda m, a, k: marks.__setitem__("fw", time.perf_counter()), with_kwargs=True)
model.register_forward_hook(
    lambda m, a, k, o: acc.__setitem__("forward", acc["forward"] + time.perf_counter() - marks["fw"]), with_kwargs=True
)
register_optimizer_step_pre_hook(lambda o, a, k: marks.__setitem__("opt", time.perf_counter()))
register_optimizer_step_post_hook(lambda o, a, k: acc.__setitem__("Adam step", acc["Adam step"] + time.perf_counter() - marks["opt"]))
t = time.perf_counter()
step()
warm = time.perf_counter() - t
acc.clear()
cnt.clear()
load = os.getloadavg()
t = time.perf_counter()
step()
total = time.perf_counter() - t
out = {"which": which, "code": E.__file__, "warmup_s": warm, "step_s": total, "phases_s": dict(acc), "calls": dict(cnt),
       "loadavg_before": load, "loadavg_after": os.getloadavg()}
with open(out_path, "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps(out, indent=1))
