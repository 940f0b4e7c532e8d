"""Progress bars (tqdm, on stderr) and progress lines."""

from __future__ import annotations

import sys
from collections.abc import Callable


class Progress:
    """One tqdm bar per part; silent when disabled or tqdm is missing."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def bar(self, total: int, desc: str):
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover
            return _NullBar()
        return tqdm(total=total, desc=desc, disable=not self.enabled, dynamic_ncols=True, leave=True)


class _NullBar:
    def update(self, *_):
        pass

    def set_postfix_str(self, *_):
        pass

    def close(self):
        pass


def logger(enabled: bool, stream=None) -> Callable[[str], None]:
    """``log(message)``: one flushed line on ``stream`` (stdout by default) when ``enabled``."""

    def log(message: str) -> None:
        if enabled:
            print(message, file=stream or sys.stdout, flush=True)

    return log
