"""Start ``vllm.LLM`` on a NUMA node 0 that reports ``$SMALL_NODE_GIB`` GiB (the VMs where vLLM-CPU
sees 7-11 of 24 GiB, smaller still) and greedily generate a few tokens; prints one ``RESULT
{json}`` line: ``{"token_ids": [...]}`` or ``{"error": message}``.

Argument: a JSON job ``{"model", "llm": {LLM kwargs}}``. vLLM-CPU's memory probe is patched at
import time, in this process and in the engine's spawned processes (spawn runs this module's top
level again), before vLLM's workers bind it."""

import json
import os
import sys

from vllm.utils import cpu_resource_utils

_probe = cpu_resource_utils.get_memory_node_info


def small_node(node_id: int = 0) -> cpu_resource_utils.MemoryNodeInfo:
    real = _probe(node_id)
    total = int(float(os.environ["SMALL_NODE_GIB"]) * (1 << 30))
    return cpu_resource_utils.MemoryNodeInfo(total_memory=total, available_memory=min(real.available_memory, total))


for module in list(sys.modules.values()):  # modules that already bound the probe by name
    if getattr(module, "get_memory_node_info", None) is _probe:
        module.get_memory_node_info = small_node


def main(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=job["model"], **job["llm"])
    except Exception as exc:  # noqa: BLE001 - the test reads vLLM's start-up error
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=4))
    return {"token_ids": list(out[0].outputs[0].token_ids)}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
