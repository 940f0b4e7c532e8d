"""The paraphrase mechanism inside vLLM (demo model): the engine samples exactly the exponential
mechanism, touches no other request, honours the cap, is greedy at eps -> inf and refuses
parameters that would change the law."""

import pytest
import torch

from tests.prompt.test_mechanisms import chi_square_pvalue
from tests.serving.engines import run_engine
from vllm_dp_plugin.prompt.paraphrase import ParaphraseMechanism

PROMPT = [5, 9, 14, 200, 31]
DRAWS = 3000
EPS, WIDTH = 20.0, 0.5  # the demo model: 16 tokens above 1%, the floor ~2000 tokens share ~10%
PVALUE = 1e-4

pytestmark = pytest.mark.vllm  # every test reads the engine's results


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from vllm_dp_plugin.demo import make_demo_llama

    return str(make_demo_llama(tmp_path_factory.mktemp("demo") / "llama"))


@pytest.fixture(scope="module")
def results(demo_model):
    rewrite = [{"ids": PROMPT, "max_tokens": 1, "rewrite": {"epsilon": EPS, "width": WIDTH, "seed": 0},
                "repeat": DRAWS}]
    greedy = [{"ids": [7, 8, 9 + i], "max_tokens": 6} for i in range(4)]
    capped = [{"ids": [11, 12], "max_tokens": 5, "rewrite": {"epsilon": 1.0, "width": 5.0, "seed": s}}
              for s in range(16)]
    steps = [
        {"requests": rewrite},
        {"requests": greedy},
        {"requests": greedy[:2] + capped + greedy[2:]},  # the same greedy requests beside rewrites
        {"requests": [{**capped[0], "top_k": 5}]},
        {"requests": [{**g, "rewrite": {"epsilon": 1e12, "width": WIDTH, "seed": 0}} for g in greedy]},
        {"verify_paraphrase": True},
    ]
    return run_engine({"model": demo_model, "steps": steps},
                      vllm_plugins="dp_privacy")  # the general plugin installs the processor check


def exact_law(demo_model, eps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    return ParaphraseMechanism(eps, WIDTH).probabilities(logits[None])[0].numpy()


def test_vllm_samples_the_exponential_mechanism(results, demo_model):
    picks = [ids[0] for ids in results[0]["token_ids"]]
    probs = exact_law(demo_model, EPS)
    assert (probs > 0.01).sum() >= 5 and probs.max() < 0.5  # a law worth testing
    assert chi_square_pvalue(picks, probs) > PVALUE
    assert chi_square_pvalue(picks, exact_law(demo_model, EPS * 1.3)) < PVALUE  # power


def test_other_requests_in_the_batch_are_untouched_and_the_cap_holds(results):
    alone, mixed = results[1]["token_ids"], results[2]["token_ids"]
    assert mixed[:2] + mixed[-2:] == alone
    lengths = [len(ids) for ids in mixed[2:-2]]
    assert max(lengths) <= 5 and 5 in lengths


def test_parameters_that_change_the_law_are_refused(results):
    assert "top_k" in results[3]["error"]


def test_infinite_epsilon_is_greedy_in_vllm(results):
    assert results[4]["token_ids"] == results[1]["token_ids"]


def test_rewrites_run_only_where_every_worker_runs_the_processor(results):
    from vllm_dp_plugin.serving.paraphrase import ParaphraseLogits, check_processors

    assert results[5] == {"verified": True}  # this engine's worker reports it
    name = f"{ParaphraseLogits.__module__}.{ParaphraseLogits.__qualname__}"
    check_processors([[name], ["x.Other", name]])
    for reports in ([], [["x.Other"]], [[name], []]):  # a stale entry point list: fail closed
        with pytest.raises(ValueError, match="would not be DP"):
            check_processors(reports)
