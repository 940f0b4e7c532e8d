"""Batch invariance: DP aggregation's public sequence runs in the same engine batches as the
members, and all members of a ``mechanism: answer`` query decode in one batch; vLLM is not
batch-invariant in general, and where it is not, one more document in the batch could flip other
members' greedy answers (one document would move several votes: l0 > 1). On the CPU engine
(float32) the public next-token log-probabilities are bit-identical alone and beside either of two
neighbouring collections' members, and every member's answer is the same token for token with and
without one more document's member in the batch (measured; off the CPU the server requires
``VLLM_BATCH_INVARIANT=1``, SECURITY.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.test_serve_real import real_model


@pytest.mark.vllm
def test_the_public_distribution_does_not_move_with_the_members_batch():
    model = real_model("smollm2-135m-instruct")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("public_logprobs_engine.py")), str(model)],
                          env={**env, "VLLM_PLUGINS": ""}, capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert len(got["alone"]) >= 20
    assert got["A"] == got["alone"] and got["B"] == got["alone"]  # exact: same tokens, same floats
    shared = got["answers_B"]
    assert len(shared) == len(got["answers_A"]) - 1 and all(len(t) == 16 for t in shared.values())
    assert {d: got["answers_A"][d] for d in shared} == shared  # the other members' answers, token for token
