"""Build and load the C++ CPU kernels of ``kernels/csrc`` (``torch.utils.cpp_extension``).

Each extension is compiled on first use (tens of seconds on 2 cores, then cached by torch under
``~/.cache/torch_extensions``; ``make install`` builds them all). ``load(source)`` returns the
module, or None (logged once) where it cannot be built: no compiler, no headers. Callers keep a
torch reference for that case.
"""

from __future__ import annotations

import functools
import logging
import pathlib

CSRC = pathlib.Path(__file__).with_name("csrc")
SOURCES = ("paged_exact.cpp", "nearest_select.cpp")
# OpenMP for at::parallel_for over queries (the API server's search; without -fopenmp it runs on one
# thread). libgomp.so.1 resolves to the copy torch has already loaded: one OpenMP runtime per process.
OPENMP = {"nearest_select.cpp"}
logger = logging.getLogger("vllm.dp_privacy")


@functools.cache
def load(source: str):
    """The compiled module of ``csrc/<source>`` (named ``vllm_dp_<stem>``), or None."""
    from torch.utils import cpp_extension

    try:
        openmp = ["-fopenmp"] if source in OPENMP else []
        return cpp_extension.load(
            name=f"vllm_dp_{pathlib.Path(source).stem}",
            sources=[str(CSRC / source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd", *openmp],
            extra_ldflags=openmp,
        )
    except Exception as err:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("vllm-dp: C++ CPU kernel %s unavailable (%s); using torch", source, err)
        return None


def build_all() -> dict[str, bool]:
    """Build every extension now; ``{source: built}``."""
    return {source: load(source) is not None for source in SOURCES}
