"""The calibration file format ``"vllm-dp-calibration/1"``: public per-layer head mappings.

``vllm-dp calibrate`` (``vllm_dp_plugin.calibration``) writes it; DP attention's plan
(``plan``) reads it. One JSON document::

    {"format": "vllm-dp-calibration/1", "model": str, "source": str, "quantile": float,
     "num_tokens": int,
     "self_attention": [{"layer": int, "beta": float, "key_bound": float, "query_bound": float,
                         "value_bound": float, "key_norm": float | null,
                         "query_norm": float | null,
                         "key_center": [[float] * d] * H_kv | null}, ...],
     "cross_attention": [...same...]}

A kind the model lacks is an empty list. ``num_tokens`` counts the (decoder) query tokens run.
Kinds: ``"self_attention"`` (causal-LM layers, Whisper decoder self-attention) and
``"cross_attention"`` (Whisper decoder cross-attention); layers are indexed by the decoder layer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .mapping import HeadMapping

FORMAT = "vllm-dp-calibration/1"
KINDS = ("self_attention", "cross_attention")

_FIELDS = ("beta", "key_bound", "query_bound", "value_bound")
_OPTIONAL_FIELDS = ("key_norm", "query_norm")


class CalibrationError(ValueError):
    """A calibration file or document is malformed; the message names the file and field."""


def _same_mapping(a: HeadMapping, b: HeadMapping) -> bool:
    """Field-by-field equality (dataclass ``==`` cannot compare the key_center tensors)."""
    names = (*_FIELDS, *_OPTIONAL_FIELDS, "signed")
    if any(getattr(a, n) != getattr(b, n) for n in names):
        return False
    if a.key_center is None or b.key_center is None:
        return a.key_center is b.key_center
    return torch.equal(a.key_center.to(torch.float64), b.key_center.to(torch.float64))


@dataclass(frozen=True, eq=False)
class Calibration:
    """Public per-layer head mappings of one model: ``layers[kind][layer] -> HeadMapping``.

    ``model``: what was calibrated; ``source``: the public input used; ``quantile``: the clipping
    quantile; ``num_tokens``: (decoder) query tokens run. ``==`` compares every field exactly.
    """

    model: str
    source: str
    quantile: float
    num_tokens: int
    layers: Mapping[str, Mapping[int, HeadMapping]] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Calibration):
            return NotImplemented
        meta = ("model", "source", "quantile", "num_tokens")
        if any(getattr(self, n) != getattr(other, n) for n in meta):
            return False
        for kind in KINDS:
            mine, theirs = self.layers.get(kind, {}), other.layers.get(kind, {})
            if mine.keys() != theirs.keys():
                return False
            if not all(_same_mapping(mine[i], theirs[i]) for i in mine):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def _kind(self, kind: str) -> Mapping[int, HeadMapping]:
        if kind not in KINDS:
            raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}")
        return self.layers.get(kind, {})

    def num_layers(self, kind: str) -> int:
        """How many layers of ``kind`` are calibrated (0 if the model has none)."""
        return len(self._kind(kind))

    def mapping(self, kind: str, layer: int) -> HeadMapping:
        """The ``HeadMapping`` of ``layer`` of ``kind``; ``KeyError`` if it was not calibrated."""
        layers = self._kind(kind)
        if layer not in layers:
            raise KeyError(
                f"calibration of {self.model!r} has no {kind} layer {layer} "
                f"(calibrated layers: {sorted(layers)})"
            )
        return layers[layer]

    def to_json(self) -> dict[str, Any]:
        """The ``"vllm-dp-calibration/1"`` document (plain JSON types, exact float64 values)."""
        doc: dict[str, Any] = {
            "format": FORMAT,
            "model": self.model,
            "source": self.source,
            "quantile": self.quantile,
            "num_tokens": self.num_tokens,
        }
        for kind in KINDS:
            layers = self.layers.get(kind, {})
            doc[kind] = [_mapping_to_json(i, layers[i]) for i in sorted(layers)]
        return doc

    def to_file(self, path: str | Path) -> Path:
        """Write the JSON document to ``path`` (parents created); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_dumps(self.to_json()))
        return path

    @staticmethod
    def from_json(doc: Any, where: str = "calibration") -> Calibration:
        """Parse and validate a document; ``ValueError`` naming ``where`` and the bad field."""
        if not isinstance(doc, dict):
            raise CalibrationError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        if doc.get("format") != FORMAT:
            got = doc.get("format")
            raise CalibrationError(f"{where}: field 'format' must be {FORMAT!r}, got {got!r}")
        model = _field(doc, "model", str, where)
        source = _field(doc, "source", str, where)
        quantile = float(_field(doc, "quantile", (int, float), where))
        if not 0.0 < quantile <= 1.0:
            raise CalibrationError(f"{where}: field 'quantile' must be in (0, 1], got {quantile}")
        num_tokens = _field(doc, "num_tokens", int, where)
        layers = {kind: _layers_from_json(doc, kind, where) for kind in KINDS}
        return Calibration(model, source, quantile, num_tokens, layers)

    @staticmethod
    def from_file(path: str | Path) -> Calibration:
        """Read and validate a ``"vllm-dp-calibration/1"`` file (``ValueError`` names the file)."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{path}: not valid JSON ({exc})") from exc
        return Calibration.from_json(doc, str(path))


def _dumps(doc: Mapping[str, Any]) -> str:
    """Valid JSON with one line per top-level field and per layer entry (diff-friendly)."""
    parts = []
    for key, value in doc.items():
        if isinstance(value, list) and value:
            rows = ",\n".join(f"  {json.dumps(entry)}" for entry in value)
            parts.append(f" {json.dumps(key)}: [\n{rows}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _mapping_to_json(layer: int, m: HeadMapping) -> dict[str, Any]:
    center = None if m.key_center is None else m.key_center.to(torch.float64).tolist()
    return {
        "layer": layer,
        **{n: float(getattr(m, n)) for n in _FIELDS},
        **{n: None if getattr(m, n) is None else float(getattr(m, n)) for n in _OPTIONAL_FIELDS},
        "key_center": center,
    }


def _field(doc: Mapping[str, Any], name: str, types, where: str) -> Any:
    """``doc[name]`` if present and of ``types`` (bool is never a number here)."""
    if name not in doc:
        raise CalibrationError(f"{where}: missing field {name!r}")
    value = doc[name]
    if isinstance(value, bool) or not isinstance(value, types):
        kind = type(value).__name__
        raise CalibrationError(f"{where}: field {name!r} has the wrong type ({kind})")
    return value


def _layers_from_json(doc: Mapping[str, Any], kind: str, where: str) -> dict[int, HeadMapping]:
    entries = _field(doc, kind, list, where)
    layers: dict[int, HeadMapping] = {}
    for pos, entry in enumerate(entries):
        at = f"{where}: {kind}[{pos}]"
        if not isinstance(entry, dict):
            raise CalibrationError(f"{at}: expected an object, got {type(entry).__name__}")
        layer = _field(entry, "layer", int, at)
        if layer < 0 or layer in layers:
            raise CalibrationError(f"{at}: field 'layer' is negative or repeated ({layer})")
        layers[layer] = _mapping_from_json(entry, f"{where}: {kind} layer {layer}")
    return layers


def _mapping_from_json(entry: Mapping[str, Any], at: str) -> HeadMapping:
    values = {n: float(_field(entry, n, (int, float), at)) for n in _FIELDS}
    for n in _OPTIONAL_FIELDS:
        raw = entry.get(n)
        values[n] = None if raw is None else float(_field(entry, n, (int, float), at))
    values["key_center"] = _center_from_json(entry.get("key_center"), at)
    try:
        return HeadMapping(**values, signed=True)
    except ValueError as exc:
        raise CalibrationError(f"{at}: {exc}") from exc


def _center_from_json(raw: Any, at: str) -> torch.Tensor | None:
    """``[[d floats] x H_kv]`` -> float64 tensor ``[H_kv, d]`` (None stays None)."""
    if raw is None:
        return None
    ok = isinstance(raw, list) and raw and all(isinstance(r, list) and r for r in raw)
    if not ok or len({len(r) for r in raw}) != 1:
        raise CalibrationError(f"{at}: field 'key_center' must be a non-empty [H_kv][d] list")
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for r in raw for x in r):
        raise CalibrationError(f"{at}: field 'key_center' must contain only numbers")
    return torch.tensor(raw, dtype=torch.float64)
