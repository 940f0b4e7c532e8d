"""Greedy generation through ``vllm.LLM`` with and without LoRA adapters; prints one
``RESULT {json}`` line.

A script (CPU vLLM forces spawn, hence the __main__ guard) driven by a JSON job
``{"prompts": [str], "max_tokens": n, "engines": [{"model", "llm": {extra LLM kwargs},
"adapters": [null | {"name", "id", "path"}, ...]}, ...]}``: the engines start one after the other
in this process (one import of vLLM for all of them; each is shut down before the next starts),
and each generates greedily (``ignore_eos``: every output has ``max_tokens`` ids) for every entry
of its ``adapters`` (null: the model without an adapter; otherwise the request carries
``LoRARequest(name, id, path)``). Result: per engine, per adapter entry, per prompt, the token ids.
"""

import gc
import json
import sys


def run_engine(engine: dict, prompts: list[str], max_tokens: int) -> list[list[list[int]]]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_dp_plugin.serving.memory import kv_cache_args

    kwargs = {
        "model": engine["model"],
        "dtype": "float32",
        "block_size": 32,
        "max_model_len": 256,
        "enforce_eager": True,
        "seed": 0,
        **kv_cache_args(engine["model"], 256),
        **engine.get("llm", {}),
    }
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = []
    for adapter in engine.get("adapters", [None]):
        request = None if adapter is None else LoRARequest(adapter["name"], adapter["id"], adapter["path"])
        outputs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in outputs])
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return results


def main(job: dict) -> None:
    results = [run_engine(engine, job["prompts"], job.get("max_tokens", 16)) for engine in job["engines"]]
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
