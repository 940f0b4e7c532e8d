"""``python -m benchmarks.dpformer --quick`` (``benchmarks.dpformer``): runs end to end and writes md + json + png; the pieces the
table rests on (schedule, seed aggregation, MostPop floor, public p_v) behave as documented."""

import json
import math

import pytest
import torch

from benchmarks import dpformer
from vllm_dp_plugin.trainer.reattention import sequence_frequencies
from vllm_dp_plugin.trainer.synthetic import Interactions, generate_interactions, leave_one_out

DATE = "2026-11-23"


def test_quick_run_writes_all_methods_and_files(tmp_path):
    rc = dpformer.main(
        ["--quick", "--out", str(tmp_path), "--date", DATE, "--quiet", "--threads", "1"]
    )
    assert rc == 0
    (json_path,) = tmp_path.glob(f"dpformer-*-{DATE}.json")
    stem = json_path.with_suffix("")
    results = json.loads(json_path.read_text())
    text = stem.with_suffix(".md").read_text()
    assert stem.with_suffix(".png").stat().st_size > 0

    s = results["settings"]
    assert s["epsilons"] == [5.0, 10.0] and results["seeds_done"] == [0]
    # quick: one non-private run + 3 DP methods (vanilla, dpformer, lambda 0.01) x 2 eps
    runs = results["runs"]
    assert len(runs) == 7
    assert {(r["method"], r["epsilon"]) for r in runs} == {("non-private", None)} | {
        (m, e) for m in ("vanilla", "dpformer", "dpformer-lam0.01") for e in (5.0, 10.0)
    }
    for run in runs:
        assert 0 <= run["ndcg"] <= run["hit"] <= 100, run  # NDCG@10 <= HIT@10 per user
        assert math.isfinite(run["train_loss_tail"]), run
        # Re-Attention models are also evaluated as served (correction dropped), others are not
        assert (run["ndcg_served"] is None) == (not run["method"].startswith("dpformer")), run
    assert "| NDCG@10 with | NDCG@10 dropped |" in text
    # a smaller eps needs more noise; delta = 1/(2N)
    assert s["sigmas"]["5.0"] > s["sigmas"]["10.0"] > 0
    assert s["delta"] == pytest.approx(1 / (2 * s["users"]))
    assert {r["lam"] for r in runs if r["method"].startswith("dpformer")} == {1.0, 0.01}
    assert "| dpformer vs vanilla |" in text and "| MostPop (no eps) |" in text
    assert "eps=10 NDCG@10" in text and "tuned" in text


def test_schedule_follows_the_paper():
    """q = B/N, T = ceil(epochs/q), delta = 1/(2N) (Poisson rate, step count and fastDP's
    default delta)."""
    plan = dpformer.schedule(6040, 1024, 100.0)
    assert plan.sample_rate == pytest.approx(0.16954, abs=1e-5)
    # ML-1M (N = 6040), B = 1024, 100 epochs: q 0.1695, T 590, delta 8.28e-5
    assert plan.steps == 590 and plan.delta == pytest.approx(8.28e-5, rel=1e-3)
    with pytest.raises(ValueError, match="batch size"):
        dpformer.schedule(100, 101, 1.0)


def test_summarize_reports_mean_and_sample_std():
    runs = [
        {"method": "vanilla", "epsilon": 5.0, "ndcg": 1.0, "hit": 2.0},
        {"method": "vanilla", "epsilon": 5.0, "ndcg": 3.0, "hit": 6.0},
        {"method": "non-private", "epsilon": None, "ndcg": 4.0, "hit": 8.0},
    ]
    by_method = {r["method"]: r for r in dpformer.summarize(runs)}
    van = by_method["vanilla"]
    assert (van["seeds"], van["ndcg"], van["hit"]) == (2, 2.0, 4.0)
    assert van["ndcg_std"] == pytest.approx(math.sqrt(2.0))  # sample std (n - 1) of {1, 3}
    assert van["hit_std"] == pytest.approx(2 * math.sqrt(2.0))
    assert by_method["non-private"]["ndcg_std"] is None  # one seed: no spread


def _args(**overrides):
    args = dpformer.build_parser().parse_args(["--quick"])
    dpformer._fill_defaults(args)
    vars(args).update(overrides)
    return args


def test_public_frequencies_come_from_users_not_trained_on():
    """One generator draw of N + N_pub users: the first N are the private split, p_v is the
    sequence frequency of the other N_pub users' training inputs, not of the private ones."""
    args = _args()
    dataset = dpformer.build_dataset(args)
    assert dataset.config.num_users == args.users + args.public_users
    data = generate_interactions(dataset.config)
    split = leave_one_out(Interactions(data.items, data.lengths), args.max_len)
    assert torch.equal(dataset.split.test_ids, split.test_ids[: args.users])
    public = sequence_frequencies(split.train_ids[args.users :], dataset.config.vocab_size).token_p
    private = sequence_frequencies(dataset.split.train_ids, dataset.config.vocab_size).token_p
    assert torch.equal(dataset.token_p, public)
    assert not torch.allclose(dataset.token_p, private)


def test_most_pop_is_the_floor_of_a_popularity_ranking():
    """MostPop NDCG equals ranking every user's candidates by training counts (checked by hand)."""
    dataset = dpformer.build_dataset(_args())
    floor = dpformer.most_pop(dataset)
    counts = torch.bincount(
        dataset.split.valid_ids.flatten(), minlength=dataset.config.vocab_size
    ).double()
    counts[0] = -math.inf
    ndcg = []
    for history, target in zip(dataset.split.test_ids, dataset.split.test_target, strict=True):
        scores = counts.clone()
        scores[history[history != 0]] = -math.inf
        scores[target] = counts[target]
        rank = int((scores > scores[target]).sum() + (scores == scores[target]).sum() - 1)
        ndcg.append(1 / math.log2(rank + 2) if rank < 10 else 0.0)
    assert floor.ndcg == pytest.approx(sum(ndcg) / len(ndcg), abs=1e-12)
