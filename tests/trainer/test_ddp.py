"""DP training under torch.distributed (gloo, 2 processes): every rank holds the plain model and
trains on its shard of the same Poisson draw; the engine all-reduces the clipped sums and rank 0
adds the noise, so 2 DP-Adam steps give every rank the parameters of the single-process run with
the same seeds (float32; the sums only differ in addition order, ~1e-7 relative). Secure mode:
rank 0 releases the reduced sum on the grid and broadcasts it."""

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from vllm_dp_plugin.trainer.engine import DPConfig, DPEngine, causal_lm_per_sample_loss
from vllm_dp_plugin.trainer.sampling import PoissonSampler, shard_for_rank, virtual_batches

VOCAB, DIM, TOKENS, SAMPLES, STEPS, WORLD = 20, 8, 5, 16, 2, 2
CONFIGS = {secure: DPConfig(noise_multiplier=1.0, expected_batch_size=8, seed=13, secure_mode=secure)
           for secure in (False, True)}


class TinyLM(nn.Module):
    """Tied input/output embedding with padding, learned positions, LayerNorm, a Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.positions = nn.Embedding(TOKENS, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.tokens.weight

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        x = self.norm(self.tokens(ids) + self.positions(positions))
        return self.out(torch.tanh(self.hidden(x)))


def dataset() -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (SAMPLES, TOKENS), generator=torch.Generator().manual_seed(1))
    ids[::3, :2] = 0  # left padding
    return ids


def train(rank: int, world_size: int, config: DPConfig) -> dict[str, torch.Tensor]:
    """2 DP-Adam steps on this rank's shards (virtual batches of 2); the final parameters and
    (``grad/`` + name) the last step's gradients."""
    model, data = TinyLM(), dataset()
    engine = DPEngine(model, config)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for batch in PoissonSampler(SAMPLES, 0.5, STEPS, seed=5):
        for part in virtual_batches(shard_for_rank(batch, rank, world_size), 2):
            ids = data[part]
            engine.backward(causal_lm_per_sample_loss(model(ids), ids.masked_fill(ids == 0, -100)))
        engine.finish_step()
        optimizer.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return params | {f"grad/{name}": p.grad.clone() for name, p in model.named_parameters()}


def worker(rank: int, init_file: str, out_dir: str, config: DPConfig) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.save(train(rank, WORLD, config), Path(out_dir) / f"rank{rank}.pt")
        wrapped = nn.parallel.DistributedDataParallel(TinyLM())
        try:
            DPEngine(wrapped, config)
        except TypeError:
            pass
        else:
            raise AssertionError("a DistributedDataParallel wrapper must be refused")
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process():
    single = train(rank=0, world_size=1, config=CONFIGS[False])
    ranks = run_ranks(CONFIGS[False])
    untrained = dict(TinyLM().named_parameters())
    for name, want in single.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # every rank got the same grad
        torch.testing.assert_close(ranks[0][name], want, rtol=1e-6, atol=1e-6, msg=name)
        if not name.startswith("grad/"):
            assert not torch.allclose(want, untrained[name]), name  # the steps moved every parameter


def test_secure_mode_releases_the_reduced_sum_once():
    """Every rank gets rank 0's grid release of the all-reduced sum: the same grads, on the grid
    (multiples of gamma / B), at most one grid step from the single-process run's (its sum differs
    in addition order only, ~1e-7 relative, far below a step: round() can move by one)."""
    config = CONFIGS[True]
    single, ranks = train(rank=0, world_size=1, config=config), run_ranks(config)
    step = DPEngine(TinyLM(), config).secure_release.grid / config.expected_batch_size
    for name in (name for name in single if name.startswith("grad/")):
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.equal(ranks[0][name] / step, torch.round(ranks[0][name] / step)), name
        assert (ranks[0][name] - single[name]).abs().max() <= step, name


def run_ranks(config: DPConfig) -> list[dict[str, torch.Tensor]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(str(Path(tmp) / "init"), tmp, config), nprocs=WORLD, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]
