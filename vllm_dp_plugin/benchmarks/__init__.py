"""The benchmark suites a user runs against their own model and deployment (``vllm-dp bench SUITE``,
results in ``benchmarks/results/``): ``context`` (does my collection still answer, does it leak?),
``serve``, ``prompt_answers``, ``canary``, ``ledger``, ``load``, ``faults``, ``fuzz``.

Each is a module or a package (``add_cli_args(parser)``, ``build_parser()``, ``main(args)``) over
``lib`` and the package proper, never another suite. The research and reproduction suites live in
the repository's top-level ``benchmarks/`` (``python -m benchmarks.SUITE``) over the same ``lib``.
"""
