"""The registry of ``DPCrossAttention``'s release modes (``RELEASE_MODES``): name -> mode.

Each mode satisfies the protocol of ``base`` (``ReleaseMode``); a new mode is one module with
such a class plus one entry here (and its name in ``params.MODES``, which validates
``DPAttentionParams.mode``).
"""

from __future__ import annotations

from .base import ReleaseMode
from .reference import ReferenceMode
from .state import StateMode
from .tree import TreeMode

RELEASE_MODES: dict[str, ReleaseMode] = {
    "state": StateMode(),
    "tree": TreeMode(),
    "reference": ReferenceMode(),
}


def release_mode(name: str) -> ReleaseMode:
    """The registered mode called ``name``."""
    try:
        return RELEASE_MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; registered: {tuple(RELEASE_MODES)}") from None
