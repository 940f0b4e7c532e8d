"""What every importer shares: convert once into a directory, never leave it half written.

``convert_once`` writes the model into a temporary sibling of ``out_dir`` and renames it into
place, with a ``vllm_dp_import.json`` marker naming the source (package, version, file and its
SHA-256); a later call with the same marker and all ``required`` files present does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from . import ModelImportError

MARKER = "vllm_dp_import.json"


def convert_once(out_dir: Path, marker: dict, convert: Callable[[Path], None], required: Sequence[str],
                 *, force: bool, name: str) -> Path:
    """``convert(staging_dir)`` into ``out_dir`` unless it already holds ``marker`` and every
    ``required`` file (or ``force``). Refuses (ModelImportError) a non-empty ``out_dir`` that is
    not a conversion unless ``force``. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    if not force and read_marker(out_dir, required) == marker:
        return out_dir
    foreign = out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists()
    if foreign and not force:
        raise ModelImportError(f"{out_dir} exists and is not a model conversion; "
                               "choose another directory or pass force=True (--force)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        convert(staging)
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        for path in staging.iterdir():
            path.chmod(0o644)  # save_pretrained writes the safetensors file owner-only
        staging.chmod(0o755)
        _replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(name, f"{marker['source']} {marker['version']} converted into {out_dir}")
    return out_dir


def read_marker(out_dir: Path, required: Sequence[str]) -> dict | None:
    """The conversion marker in ``out_dir`` if it and every ``required`` file are there, else None."""
    try:
        marker = json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if all((Path(out_dir) / f).is_file() for f in required) else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def log(name: str, message: str) -> None:
    print(f"import-model {name}: {message}", file=sys.stderr, flush=True)


def _replace_dir(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``, first moving an existing ``target`` aside and deleting it."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old)
