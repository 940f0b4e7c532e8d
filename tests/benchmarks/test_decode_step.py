"""benchmarks.decode_step: a quick run writes its table and profile, and the step it times is the DP
path (the released context's answer and the fused exact part run in every layer)."""

import json

import pytest

pytest.importorskip("vllm")


def test_quick_run_times_the_dp_path_and_writes_its_profile(tmp_path):
    from benchmarks import decode_step

    assert decode_step.main(["--quick", "--out", str(tmp_path), "--date", "2026-01-01"]) == 0
    result = json.loads((tmp_path / "decode-step-cpu-2026-01-01.json").read_text())
    assert len(result["ms_per_step"]) == 1 and result["median_ms_per_step"] > 0
    functions = result["profile"]["functions"]
    assert "query_parts" in functions and "merge_parts" in functions  # the DP answer, merged per layer
    text = (tmp_path / "decode-step-cpu-2026-01-01.md").read_text()
    assert "CPU ms per step" in text and "aten::bmm" in text


def test_the_step_answers_every_layer_from_the_release(tmp_path):
    from benchmarks import decode_step

    args = decode_step.build_parser().parse_args(["--quick", "--layers", "3"])
    args.batch, args.context, args.public = 4, 64, 8
    layer = decode_step.released_layer(args, tmp_path / "noise.key")
    answers = []
    answer = layer.answer
    layer.answer = lambda q: answers.append(q.shape) or answer(q)
    decode_step.decode_step(args, layer)()
    assert answers == [(4, 4, 32)] * 3  # [m, H_q, d] of every layer's public queries
