"""Result files: markdown tables and numbers, JSON, CSV and PNG.

A suite's result files share one stem (``<suite>-<device label>-<date>``) and differ in suffix:
``suffixed(stem, ".json")``. Writers create the parent directory.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path


def suffixed(stem: Path, suffix: str) -> Path:
    """``stem`` + ``suffix`` (``.md``, ``-speed.csv``): appended, never replacing a dotted part
    of the name as ``Path.with_suffix`` would."""
    stem = Path(stem)
    return stem.with_name(stem.name + suffix)


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it (as a result file states it)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def fmt(x, digits: int = 3) -> str:
    """A number for a table: ``digits`` significant digits, scientific outside [1e-3, 1e4);
    integers as they are, None and NaN as ``n/a``, strings unchanged."""
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if _is_int(x):
        return str(x)
    x = float(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}g}"
    return f"{x:.{max(digits - 1, 1)}e}"


def _is_int(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, np.integer)


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table; cells that are not strings go through ``fmt``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def json_default(x):
    """``json.dump``'s ``default``: numpy scalars and arrays, torch tensors and paths as plain
    values; anything else as its ``str``."""
    if isinstance(x, Path):
        return str(x)
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)


def write_json(path: Path, data, *, indent: int = 1, newline: bool = False) -> Path:
    """``data`` as JSON (``json_default`` for what json cannot write), ``newline``: end the
    file with one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=json_default) + ("\n" if newline else ""))
    return path


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def write_text(path: Path, text: str) -> Path:
    """A markdown (or any text) file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path



def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG and close it (layout is the caller's: ``tight_layout`` etc.)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
