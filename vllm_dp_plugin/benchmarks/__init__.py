"""Runnable benchmark suites (``vllm-dp bench SUITE``; results go to ``benchmarks/results/``).

Each suite is a module, or a package split along its seams (``attention``, ``attention_real``,
``context``, ``prompt``, ``prompt_answers``, ``train``; ``python -m`` runs them too), with
``add_cli_args(parser)`` and ``main(args)`` (a package's in its ``__init__``), and imports only
``benchmarks.lib`` (timing, peak memory, device label, report writers, common options) and the
package proper, never another suite.
"""
