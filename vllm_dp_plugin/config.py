"""The one typed configuration: ``--additional-config '{"dp_privacy": {...}}'`` or a YAML file.

Parsed and validated once (``DPPrivacyConfig.from_dict``); every error names the offending key.
Sections not given are ``None`` (that feature is off). No vLLM import.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .privacy.accountant import COMPOSITIONS, Budget
from .privacy.budget import MECHANISM_KINDS
from .privacy.validation import check_count, check_delta, check_epsilon

CONFIG_KEY = "dp_privacy"


class ConfigError(ValueError):
    """A ``dp_privacy`` configuration that cannot be used; the message says which key and why."""


@dataclass(frozen=True)
class AttentionPrivacyConfig:
    """DP attention over the private context: total budget for the whole model.

    The budget is split over ``num_layers x num_kv_heads x releases_per_head`` releases; the
    guarantee's unit is one private K/V row of one layer. ``num_layers``/``num_kv_heads`` are
    read from the served model when omitted.
    """

    epsilon: float
    delta: float
    mode: str = "state"
    mechanism: str = "gaussian"
    composition: str = "pld"
    num_layers: int | None = None
    num_kv_heads: int | None = None
    releases_per_head: int = 1

    def __post_init__(self) -> None:
        _check(check_epsilon, self.epsilon, "attention.epsilon")
        _check(check_delta, self.delta, "attention.delta")
        _choice(self.mode, ("state", "tree"), "attention.mode")
        _choice(self.mechanism, MECHANISM_KINDS, "attention.mechanism")
        _choice(self.composition, COMPOSITIONS, "attention.composition")
        for name in ("num_layers", "num_kv_heads", "releases_per_head"):
            value = getattr(self, name)
            if value is not None:
                _check(check_count, value, f"attention.{name}")

    @property
    def total(self) -> Budget:
        return Budget(self.epsilon, self.delta)

    def releases(self) -> int:
        """Number of composed releases; needs the model shape."""
        if self.num_layers is None or self.num_kv_heads is None:
            raise ConfigError(
                "attention.num_layers and attention.num_kv_heads are needed to account the budget "
                "(they are read from the model when serving)"
            )
        return self.num_layers * self.num_kv_heads * self.releases_per_head


@dataclass(frozen=True)
class DPPrivacyConfig:
    """Top-level ``dp_privacy`` section."""

    key_file: str | None = None
    attention: AttentionPrivacyConfig | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DPPrivacyConfig:
        """Validate a ``dp_privacy`` mapping; raises ``ConfigError`` naming the bad key."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{CONFIG_KEY} must be a mapping, got {type(raw).__name__}")
        _no_unknown_keys(raw, cls, CONFIG_KEY)
        sections = {"attention": AttentionPrivacyConfig}
        parsed: dict[str, Any] = {"key_file": raw.get("key_file")}
        for name, section_cls in sections.items():
            if raw.get(name) is not None:
                parsed[name] = _build(section_cls, raw[name], f"{CONFIG_KEY}.{name}")
        return cls(**parsed)

    @classmethod
    def from_file(cls, path: str | Path) -> DPPrivacyConfig:
        """Load YAML or JSON; the file may hold the section itself or ``{dp_privacy: {...}}``."""
        import yaml

        text = Path(path).read_text()
        raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        if isinstance(raw, dict) and CONFIG_KEY in raw:
            raw = raw[CONFIG_KEY]
        return cls.from_dict(raw or {})

    @property
    def enabled(self) -> bool:
        return self.attention is not None


def _build(section_cls: type, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    _no_unknown_keys(raw, section_cls, where)
    missing = [
        f.name
        for f in dataclasses.fields(section_cls)
        if f.default is dataclasses.MISSING and f.name not in raw
    ]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}")
    try:
        return section_cls(**raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _no_unknown_keys(raw: dict, section_cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(section_cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys are {sorted(known)}")


def _check(check, value, name: str) -> None:
    try:
        check(value, name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _choice(value: str, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
