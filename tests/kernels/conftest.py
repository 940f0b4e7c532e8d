"""Where the Triton kernel tests run.

* Natively on CUDA tensors, when torch sees a CUDA device.
* Under triton's CPU interpreter on CPU tensors: ``TRITON_INTERPRET=1`` must be set before triton
  is first imported (its standard library is decorated at import time), so each kernel test
  file has a launcher test that re-runs the file in a fresh pytest process with it set
  (``interpreter_run``); the kernel tests themselves skip in the parent process on a machine
  without CUDA.

``KERNEL_TEST_DEVICE=cuda`` (set by ``benchmarks/gpu/kernels.sh``) asks for the native run alone:
a kernel test fails instead of skipping when CUDA or triton is missing, and the launchers skip
(the interpreter run is the CPU machines' job), so a passing run proves the kernels ran on the GPU.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def cuda_asked() -> bool:
    return os.environ.get("KERNEL_TEST_DEVICE") == "cuda"


@pytest.fixture
def kernel_device() -> str:
    """Where a kernel test launches: ``"cpu"`` under the interpreter, ``"cuda"`` natively; skips
    otherwise (fails when ``KERNEL_TEST_DEVICE=cuda`` asked for the native run)."""
    if cuda_asked():
        assert not interpreting(), "KERNEL_TEST_DEVICE=cuda with TRITON_INTERPRET=1: unset one"
        assert torch.cuda.is_available(), "KERNEL_TEST_DEVICE=cuda but torch sees no CUDA device"
        import triton  # noqa: F401 - an ImportError fails the test: the native run was asked for

        return "cuda"
    pytest.importorskip("triton")
    if interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("runs in the TRITON_INTERPRET=1 subprocess of this file's interpreter launcher")


@pytest.fixture
def interpreter_run():
    """``run(path) -> (passed, skipped, output tail)``: the tests of ``path`` in a fresh pytest
    process under ``TRITON_INTERPRET=1``. Skips inside that process, where the native CUDA run
    was asked for, and without triton."""
    pytest.importorskip("triton")
    if interpreting():
        pytest.skip("this process is the interpreter run")
    if cuda_asked():
        pytest.skip("KERNEL_TEST_DEVICE=cuda: the native run only")

    def run(path: str | Path) -> tuple[int, int, str]:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(path)]
        proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        tail = proc.stdout[-4000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, tail
        summary = proc.stdout.strip().splitlines()[-1]
        counts = {kind: int(m.group(1)) if (m := re.search(rf"(\d+) {kind}", summary)) else 0
                  for kind in ("passed", "skipped")}
        return counts["passed"], counts["skipped"], tail

    return run
