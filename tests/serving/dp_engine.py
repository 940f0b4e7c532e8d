"""Run one ``vllm.LLM`` engine through a list of steps; prints one ``RESULT {json}`` line.

A script (CPU vLLM forces spawn, hence the __main__ guard) driven by a JSON job:
``{"model", "llm": {extra LLM kwargs}, "steps": [...]}`` where a step is
``{"prompts": [str | [ids]], "max_tokens": n}`` (greedy generation; result: token ids),
``{"chat": [[messages]], "max_tokens": n}``, ``{"audio_hz": [440.0, ...], "max_tokens": n}``
(Whisper: 1 s sine clips), ``{"poison_private_kv": true}`` (overwrite, on every worker, the
cache rows the DP backend collected as private with NaN) or ``{"cross_releases": true}``
(per worker: the DP cross-attention releases each layer holds) or ``{"release_checksums": true}``
(every worker's decoder releases, merged by context and global KV head) or
``{"private_rows": true}`` (per worker: the K/V cache rows at the collected private slots) or
``{"swap_release": [into, from]}`` (every DP layer of every worker: context ``into`` answers from
context ``from``'s release) or ``{"mixed": [[context, prompt], ...], "max_tokens": n}`` (requests
of several private contexts added together, so they share every step; returns the token ids and the
number of requests with output after each engine step) or ``{"layer_report": true}`` (the
start-up layer check's worker method, per worker) or ``{"arrivals": [[after, hz, max_tokens], ...]}``
(Whisper requests joining a running engine, see ``arrivals_step``); the poison step also reports, per
worker and layer, whether the fused CPU kernel answers the exact public part. A generation step with
``"dp_options": {...}`` runs inside ``prompt_request(**options)`` (prompt privatization) and also
returns the receipts (``receipts``, ``accessor_receipts``), or ``{"error": message}``. ``{"requests": [...]}``: greedy and paraphrase-rewrite requests in one
batch (``requests_step``); ``{"verify_paraphrase": true}``: the engine runs the paraphrase
logits processor (``serving.paraphrase.verify_llm``).
"""

import json
import sys


def poison_private_rows(worker) -> int:
    """Fill every private row of the KV cache with NaN; returns the number of rows poisoned."""
    import torch

    poisoned = 0
    for module in worker.model_runner.model.modules():
        impl = getattr(module, "impl", None)
        slots = getattr(impl, "_private_slots", None)
        if slots is None:
            continue
        cache = module.kv_cache[0] if isinstance(module.kv_cache, list) else module.kv_cache
        key_cache, value_cache = impl._paged_kv(cache, module)
        block_size = key_cache.shape[2]
        for cache in (key_cache, value_cache):
            cache[slots // block_size, :, slots % block_size] = torch.nan
        poisoned += int(slots.numel())
    return poisoned


def private_rows(worker) -> dict:
    """Layer name -> the K and V cache rows at the private slots the DP backend collected, in
    slot order, as nested lists (``[slots, H_kv, d]`` each)."""
    out = {}
    for name, module in worker.model_runner.model.named_modules():
        impl = getattr(module, "impl", None)
        slots = getattr(impl, "_private_slots", None)
        if slots is None:
            continue
        cache = module.kv_cache[0] if isinstance(module.kv_cache, list) else module.kv_cache
        key_cache, value_cache = impl._paged_kv(cache, module)
        block_size = key_cache.shape[2]
        out[name] = [c[slots // block_size, :, slots % block_size].float().tolist() for c in (key_cache, value_cache)]
    return out


def fused_exact_layers(worker) -> list[bool]:
    """Per DP decoder layer: whether its exact public part runs through the fused CPU kernel."""
    return [
        module.impl._fused_exact
        for module in worker.model_runner.model.modules()
        if getattr(getattr(module, "impl", None), "_private_slots", None) is not None
    ]


def cross_releases(worker) -> dict:
    """Layer name -> number of per-request DP releases its cross-attention impl holds."""
    return {
        name: len(module.impl._cross)
        for name, module in worker.model_runner.model.named_modules()
        if hasattr(getattr(module, "impl", None), "_cross")
    }


def release_checksums(worker) -> dict:
    """"context:layer/kv_head=g" -> [sum, sum of squares] of that global KV head's released state."""
    out = {}
    for name, module in worker.model_runner.model.named_modules():
        impl = getattr(module, "impl", None)
        for c, layer in getattr(impl, "_layers", {}).items():
            if not layer.released:
                continue
            state = layer._dp._release.state  # [H_local, F, W] float64
            for g in range(state.shape[0]):
                head = layer.heads.kv_offset + g
                out[f"{impl._contexts[c].name}:{name}/kv_head={head}"] = [float(state[g].sum()), float((state[g] ** 2).sum())]
    return out


def swap_release(worker, names) -> int:
    """In every DP layer, make context ``names[0]`` answer from context ``names[1]``'s release
    (what a request routed to the wrong release would get). Returns the number of layers changed."""
    swapped = 0
    for module in worker.model_runner.model.modules():
        impl = getattr(module, "impl", None)
        if not getattr(impl, "_layers", None):
            continue
        index = {c.name: i for i, c in enumerate(impl._contexts)}
        into, source = (impl._layers[index[n]]._dp for n in names)
        into._release, into._query_path = source._release, source._query_path
        swapped += 1
    return swapped


def mixed_step(llm, step):
    """Requests of several private contexts in one batch: each ``[context, prompt]`` is rendered
    under its own ``prompt_request(dp_context=...)`` and added to the engine before it steps, so
    they are scheduled together (greedy, ``max_tokens``); steps until all finish."""
    from vllm import SamplingParams

    from vllm_dp_plugin.prompt.session import prompt_request

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8))
    for i, (name, prompt) in enumerate(step["mixed"]):
        with prompt_request(dp_context=name):
            engine.add_request(str(i), prompt, params)
    tokens, outputs = {}, []
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        outputs.append(len(step_outputs))
        for out in step_outputs:
            if out.finished:
                tokens[int(out.request_id)] = list(out.outputs[0].token_ids)
    return {"token_ids": [tokens[i] for i in range(len(step["mixed"]))], "outputs_per_step": outputs}


def whisper_prompts(frequencies):
    import numpy as np

    t = np.arange(16000, dtype=np.float64) / 16000
    decoder = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    return [
        {"encoder_prompt": {"prompt": "", "multi_modal_data": {
            "audio": ((0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32), 16000)}},
         "decoder_prompt": decoder}
        for hz in frequencies
    ]


def arrivals_step(llm, arrivals):
    """Request ``i`` (a 1 s clip at ``hz``, greedy, ``max_tokens`` ignoring EOS) joins once ``after``
    engine steps have run (None: once the engine is idle); steps until every request finished.
    Returns each request's token ids and, after every step, ``cross_releases`` per worker."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    prompts = whisper_prompts([hz for _, hz, _ in arrivals])
    tokens, held, steps, added = {}, [], 0, 0
    while added < len(arrivals) or engine.has_unfinished_requests():
        while added < len(arrivals):
            after = arrivals[added][0]
            if engine.has_unfinished_requests() and (after is None or steps < after):
                break
            params = SamplingParams(temperature=0.0, max_tokens=arrivals[added][2], ignore_eos=True)
            engine.add_request(str(added), prompts[added], params)
            added += 1
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id)] = list(out.outputs[0].token_ids)
        steps += 1
        held.append(llm.collective_rpc(cross_releases))
    return {"token_ids": [tokens[i] for i in range(len(arrivals))], "cross_releases": held}


def prompt_step(llm, step):
    from vllm_dp_plugin.prompt.session import prompt_request

    try:
        with prompt_request(**step["dp_options"]) as request:
            result = run_step(llm, {k: v for k, v in step.items() if k != "dp_options"})
    except ValueError as exc:
        return {"error": str(exc)}
    result["receipts"] = request.receipts
    result["accessor_receipts"] = [llm.renderer.prompt_receipt(i) for i in result["prompt_token_ids"]]
    return result


def requests_step(llm, requests):
    """One ``generate`` call of requests ``{"ids", "max_tokens", "rewrite": {"epsilon", "width",
    "seed"} | None, "top_k"?, "repeat"?}``: greedy, or a paraphrase rewrite (``serving.paraphrase``)
    sampled with ``seed`` (``repeat`` n: n copies with seeds ``seed .. seed + n - 1``); returns the
    output ids, or ``{"error": message}`` if vLLM refused the batch."""
    from vllm import SamplingParams

    from vllm_dp_plugin.prompt.paraphrase import ParaphraseMechanism
    from vllm_dp_plugin.serving.paraphrase import rewrite_params

    requests = [
        {**r, "rewrite": {**r["rewrite"], "seed": r["rewrite"]["seed"] + i}} if r.get("rewrite") else r
        for r in requests for i in range(r.get("repeat", 1))
    ]
    params = []
    for r in requests:
        if r.get("rewrite") is None:
            params.append(SamplingParams(temperature=0.0, max_tokens=r["max_tokens"]))
            continue
        spec = r["rewrite"]
        mech = ParaphraseMechanism(spec["epsilon"], spec["width"], r["max_tokens"])
        one = rewrite_params(mech, spec["seed"], stop=None)
        if "top_k" in r:
            one.top_k = r["top_k"]
        params.append(one)
    try:
        outputs = llm.generate([{"prompt_token_ids": r["ids"]} for r in requests], params, use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 - vLLM's validation error (a ValueError or not)
        return {"error": str(exc)}
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outputs]}


def run_step(llm, step):
    from vllm import SamplingParams

    if "dp_options" in step:
        return prompt_step(llm, step)
    if "requests" in step:
        return requests_step(llm, step["requests"])
    if step.get("verify_paraphrase"):
        from vllm_dp_plugin.serving.paraphrase import verify_llm

        verify_llm(llm)
        return {"verified": True}

    params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8))
    if step.get("poison_private_kv"):
        return {"poisoned": llm.collective_rpc(poison_private_rows),
                "fused_exact": llm.collective_rpc(fused_exact_layers)}
    if step.get("private_rows"):
        return {"private_rows": llm.collective_rpc(private_rows)}
    if step.get("layer_report"):
        return {"layer_report": llm.collective_rpc("dp_privacy_layers")}
    if "arrivals" in step:
        return arrivals_step(llm, step["arrivals"])
    if "mixed" in step:
        return mixed_step(llm, step)
    if "swap_release" in step:
        return {"swapped": llm.collective_rpc(swap_release, args=(step["swap_release"],))}
    if step.get("cross_releases"):
        return {"cross_releases": llm.collective_rpc(cross_releases)}
    if step.get("release_checksums"):
        merged = {}
        for worker in llm.collective_rpc(release_checksums):
            merged.update(worker)
        return {"release_checksums": merged}
    if "audio_hz" in step:
        outputs = llm.generate(whisper_prompts(step["audio_hz"]), params)
    elif "chat" in step:
        outputs = llm.chat(step["chat"], params)
    else:
        prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in step["prompts"]]
        outputs = llm.generate(prompts, params)
    return {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "prompt_token_ids": [list(o.prompt_token_ids) for o in outputs],
    }


def main(job: dict) -> None:
    from vllm import LLM

    from vllm_dp_plugin.serving.memory import kv_cache_args

    kwargs = {
        "model": job["model"],
        "dtype": "float32",
        "block_size": 32,
        "max_model_len": 1024,
        "enforce_eager": True,
        "seed": 0,
    }
    kwargs.update(job.get("llm", {}))
    kwargs = {**kv_cache_args(kwargs["model"], kwargs["max_model_len"]), **kwargs}
    llm = LLM(**kwargs)
    results = [run_step(llm, step) for step in job["steps"]]
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
