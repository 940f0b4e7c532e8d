"""The package list, which pyproject.toml cannot state: every package under ``vllm_dp_plugin/``
(data folders included, as pyproject's discovery would) plus the top-level ``kernels/`` (Triton and
C++ kernels with their torch references), installed as ``vllm_dp_plugin.kernels``. Everything
else is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

KERNELS = ["vllm_dp_plugin.kernels", "vllm_dp_plugin.kernels.csrc"]

setup(
    packages=[*find_namespace_packages(include=["vllm_dp_plugin", "vllm_dp_plugin.*"]), *KERNELS],
    package_dir={"vllm_dp_plugin.kernels": "kernels"},
)
