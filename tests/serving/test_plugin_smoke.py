"""The plugin is discoverable by vLLM and, loaded but not configured, changes nothing."""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("generate_greedy.py")


def test_entry_point_in_vllm_general_plugins():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("dp_privacy") == "vllm_dp_plugin:register"
    register = next(e for e in entry_points(group="vllm.general_plugins") if e.name == "dp_privacy")
    assert callable(register.load())


def test_register_is_idempotent():
    import vllm_dp_plugin

    vllm_dp_plugin.register()
    vllm_dp_plugin.register()
    assert vllm_dp_plugin._registered


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from vllm_dp_plugin.demo import make_demo_llama

    return make_demo_llama(tmp_path_factory.mktemp("demo") / "llama")


def generate(model: Path, vllm_plugins: str | None) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if vllm_plugins is not None:
        env["VLLM_PLUGINS"] = vllm_plugins
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(model)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.vllm
def test_loaded_but_unconfigured_plugin_changes_nothing(demo_model):
    with_plugin = generate(demo_model, None)  # VLLM_PLUGINS unset: every plugin loads
    without = generate(demo_model, "")  # VLLM_PLUGINS="": no plugin loads
    assert with_plugin["plugin_registered"] is True
    assert without["plugin_registered"] is False
    assert all(len(ids) == 16 for ids in with_plugin["token_ids"])
    assert with_plugin["token_ids"] == without["token_ids"]
