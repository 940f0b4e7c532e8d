"""What only the research suites share, next to ``vllm_dp_plugin.benchmarks.lib`` (which every suite
shares):

* ``measure``: wall-clock timing of (CUDA-synchronised) calls and ``PeakMemory``, the one peak
  memory measurement of every suite;
* ``scenario_generator``: the private-context scenarios (the bundled set and held-out sets);
* ``prompt_search``, ``fast_pass``: the nearest-candidate search settings measured on a real model.
"""
