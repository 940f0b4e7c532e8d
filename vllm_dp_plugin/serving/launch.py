"""Hand a command line to vLLM's own CLI (``vllm serve``, ``vllm bench ...``), with our flags."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..config import CONFIG_KEY, ConfigError, DPPrivacyConfig
from .settings import PLUGIN_NAME, TOKENIZER_MODE
from .vllm_compat import install_version_shim


def run_vllm_cli(argv: list[str]) -> int:
    """Run ``vllm <argv>`` in this process; returns its exit status."""
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def allow_plugin() -> None:
    """Make sure ``VLLM_PLUGINS`` (when set) names our plugin in every group, so vLLM also loads
    the opt-in endpoint plugin (budget endpoint, HTTP guard)."""
    names = [n for n in os.environ.get("VLLM_PLUGINS", "").split(",") if n]
    if PLUGIN_NAME not in names:
        os.environ["VLLM_PLUGINS"] = ",".join([*names, PLUGIN_NAME])


def resolved_config(path: str | Path) -> dict:
    """The ``dp_privacy`` section of a YAML/JSON file, validated, with file paths made absolute
    relative to the file (so the server can run from any directory)."""
    cfg = DPPrivacyConfig.from_file(path)  # validates; raises ConfigError naming the key
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    raw = raw.get(CONFIG_KEY, raw) if isinstance(raw, dict) else raw
    base = Path(path).resolve().parent
    if cfg.key_file is not None:
        raw["key_file"] = str(base / cfg.key_file)
    att = raw.get("attention") or {}
    for name in ("private_context", "calibration"):
        if att.get(name) is not None:
            att[name] = str(base / att[name])
    return raw


def serve_arguments(argv: list[str], dp_config: str | None) -> list[str]:
    """``vllm serve`` arguments: ``argv`` plus, for ``dp_config``, ``--additional-config``,
    ``--tokenizer-mode dp_private`` (private context or prompt privatization) and
    ``--enable-prompt-embeds`` (prompt privatization in embeddings mode). Refuses conflicting
    flags."""
    allow_plugin()
    if dp_config is None:
        return argv
    if any(a == "--additional-config" or a.startswith("--additional-config=") for a in argv):
        raise ConfigError("give either --dp-config or --additional-config, not both")
    raw = resolved_config(dp_config)
    flags = ["--additional-config", json.dumps({CONFIG_KEY: raw})]
    att, prompt = raw.get("attention") or {}, raw.get("prompt")
    needs = [why for why, on in (("a private context", att.get("private_context") is not None),
                                 ("prompt privatization", prompt is not None)) if on]
    if needs:
        modes = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--tokenizer-mode"]
        if any(m != TOKENIZER_MODE for m in modes):
            raise ConfigError(f"--tokenizer-mode {TOKENIZER_MODE} is required by {' and '.join(needs)}, got {modes}")
        if not modes:
            flags += ["--tokenizer-mode", TOKENIZER_MODE]
    if (prompt or {}).get("mode") == "embeddings" and "--enable-prompt-embeds" not in argv:
        flags.append("--enable-prompt-embeds")
    _calibrate_if_missing(argv, att)
    return [*argv, *flags]


def _calibrate_if_missing(argv: list[str], att: dict) -> None:
    """Create a missing calibration file from public text (pydoc pages) with the served model."""
    path = att.get("calibration")
    if path is None or Path(path).exists() or not argv or argv[0].startswith("-"):
        return
    from ..calibration import calibrate_model

    print(f"vllm-dp: {path} does not exist; calibrating {argv[0]} on public text", file=sys.stderr)
    calibrate_model(argv[0], path)


if __name__ == "__main__":  # `python -m vllm_dp_plugin.serving.launch ARGS` == `vllm ARGS` (shimmed)
    raise SystemExit(run_vllm_cli(sys.argv[1:]))
