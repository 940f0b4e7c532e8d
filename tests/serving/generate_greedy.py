"""Greedy generation through ``vllm.LLM``; prints one ``RESULT {json}`` line.

Run as a script (CPU vLLM forces spawn, hence the __main__ guard). The JSON holds the generated
token ids and whether ``vllm_dp_plugin.register`` ran in this (the LLM) process.
"""

import json
import sys

PROMPTS = ["The quick brown fox", "def main():", "Differential privacy is"]


def main(model: str) -> None:
    from vllm import LLM, SamplingParams

    import vllm_dp_plugin
    from vllm_dp_plugin.serving.memory import kv_cache_args

    llm = LLM(
        model=model,
        dtype="float32",
        block_size=32,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        **kv_cache_args(model, 1024),
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "plugin_registered": vllm_dp_plugin._registered,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
