"""Runnable benchmark suites (``vllm-dp bench SUITE``; results go to ``benchmarks/results/``).

Each suite is a module (or, for ``attention``, a package) with ``add_cli_args(parser)`` and
``main(args)``, and imports only ``benchmarks.lib`` (timing, peak memory, device label, report
writers, common options) and the package proper, never another suite.
"""
