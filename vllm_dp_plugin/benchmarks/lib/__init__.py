"""What every benchmark suite shares (those of ``vllm-dp bench`` and the repository's research suites,
``benchmarks/``, whose ``benchmarks.lib`` adds timing, peak memory and the scenario generator);
suites import from here, never from one another.

* ``environment``: the device label of result file names, the machine/software description of a
  result, load average and free memory;
* ``report``: markdown tables and number formatting, JSON (numpy/torch/paths), CSV and PNG writers;
* ``cli``: the options suites share (``--out`` with ``DEFAULT_OUT``, ``--quick``, ``--device``,
  ``--date``), comma-list parsers, and ``parse`` for ``main(args)``: a Namespace or an argv list;
* ``progress``: progress bars and log lines;
* ``vllm``: starting ``vllm serve`` / ``vllm-dp serve`` and running ``vllm bench serve`` against it.
"""
