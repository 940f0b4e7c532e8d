"""What every benchmark suite shares; suites import from here, never from one another.

* ``measure``: wall-clock timing of (CUDA-synchronised) calls and ``PeakMemory``, the one peak
  memory measurement of every suite;
* ``environment``: the device label of result file names, the machine/software description of a
  result, load average and free memory;
* ``report``: markdown tables and number formatting, JSON (numpy/torch/paths), CSV and PNG writers;
* ``cli``: the options suites share (``--out`` with ``DEFAULT_OUT``, ``--quick``, ``--device``,
  ``--date``), comma-list parsers, and ``parse`` for ``main(args)``: a Namespace or an argv list;
* ``progress``: progress bars and log lines;
* ``vllm``: starting ``vllm serve`` / ``vllm-dp serve`` and running ``vllm bench serve`` against it.
"""
