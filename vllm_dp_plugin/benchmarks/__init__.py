"""The benchmark suites a user runs against their own model and deployment (``vllm-dp bench SUITE``;
results go to ``benchmarks/results/``): ``context`` (does my collection still answer, does it
leak?), ``serve``, ``prompt_answers``, ``canary``, ``ledger``, ``load``, ``faults``, ``fuzz``,
``workload``.

Each suite is a module, or a package split along its seams (``context``, ``prompt_answers``,
``load``, ``faults``, ``fuzz``; ``python -m`` runs them too), with ``add_cli_args(parser)``,
``build_parser()`` and ``main(args)`` (a package's in its ``__init__``), and imports only
``lib`` (device label, report writers, common options, vLLM servers) and the package proper, never
another suite. The research and reproduction suites (DP attention, Whisper, DPFormer, prompt
speed, training step time) live in the repository's top-level ``benchmarks/``
(``python -m benchmarks.SUITE``) over this same ``lib``.
"""
