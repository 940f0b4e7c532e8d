"""The release ledger: one entry per release, refusal of a release under other noise, keyed
entries only, safe under concurrent registration."""

import json
import multiprocessing
import os
import stat

import pytest

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.keyed_noise import ForeignEntries, NoiseKey
from vllm_dp_plugin.privacy.release_ledger import ReleaseLedger, ReleaseRefused

UNIT = "one private K/V row of one attention layer"


def test_restart_is_idempotent_and_a_new_release_is_refused(tmp_path):
    ledger = ReleaseLedger(NoiseKey(tmp_path / "noise.key"))
    first = ledger.register("ids-digest", "release-a", Budget(2.0, 1e-6), UNIT, allow_rerelease=False)
    again = ReleaseLedger(NoiseKey(tmp_path / "noise.key")).register(
        "ids-digest", "release-a", Budget(2.0, 1e-6), UNIT, allow_rerelease=False)
    assert len(first.releases) == len(again.releases) == 1
    with pytest.raises(ReleaseRefused, match="already released 1 time"):
        ledger.register("ids-digest", "release-b", Budget(2.0, 1e-6), UNIT, allow_rerelease=False)
    assert len(ledger.history("ids-digest").releases) == 1  # nothing half-applied
    both = ledger.register("ids-digest", "release-b", Budget(3.0, 1e-6), UNIT, allow_rerelease=True)
    assert both.total == Budget(5.0, 2e-6)
    assert ledger.register("other-context", "release-b", Budget(1.0, 0.0), UNIT, allow_rerelease=False).total.epsilon == 1.0


def test_entries_hold_keyed_labels_only_and_the_file_is_private(tmp_path):
    key = NoiseKey(tmp_path / "noise.key")
    ledger = ReleaseLedger(key)
    ledger.register("secret-subject", "secret-release", Budget(1.0, 0.0), UNIT, allow_rerelease=False)
    text = ledger.path.read_text()
    assert "secret" not in text
    entry = json.loads(text)
    assert entry["subject"] == key.label("ledger/subject", "secret-subject")
    assert stat.S_IMODE(os.stat(ledger.path).st_mode) == 0o600


def test_entries_under_another_key_are_counted_not_matched(tmp_path):
    """A new key (e.g. a deleted key file) cannot recognise earlier releases: the history says
    how many entries it could not match instead of claiming a first release, and a release under
    the new key is refused unless re-releases are allowed (before: registered as a first release)."""
    key_path, path = tmp_path / "noise.key", tmp_path / "releases.jsonl"
    ReleaseLedger(NoiseKey(key_path), path).register("s", "r", Budget(1.0, 0.0), UNIT, allow_rerelease=False)
    key_path.unlink()  # lost: the next start creates a new key
    new = ReleaseLedger(NoiseKey(key_path), path)
    history = new.history("s")
    assert history.releases == () and history.foreign == 1
    assert history.to_json()["entries_under_other_keys"] == 1
    size = path.stat().st_size
    with pytest.raises(ForeignEntries) as info:
        new.register("s", "r", Budget(1.0, 0.0), UNIT, allow_rerelease=False)
    message = str(info.value)
    assert f"release ledger {path} holds 1 entries written under another noise key than {key_path}" in message
    assert "release it again under new noise" in message and "`attention.allow_rerelease: true`" in message
    assert path.stat().st_size == size  # nothing written
    again = new.register("s", "r", Budget(1.0, 0.0), UNIT, allow_rerelease=True)
    assert len(again.releases) == 1 and again.foreign == 1


def test_corrupt_ledger_is_a_clear_error(tmp_path):
    ledger = ReleaseLedger(NoiseKey(tmp_path / "noise.key"))
    ledger.path.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is corrupt"):
        ledger.history("s")


def _register(key_path, release, queue):
    ledger = ReleaseLedger(NoiseKey(key_path))
    try:
        ledger.register("s", release, Budget(1.0, 0.0), UNIT, allow_rerelease=False)
        queue.put("ok")
    except ReleaseRefused:
        queue.put("refused")


def test_concurrent_workers_record_one_release(tmp_path):
    """Tensor-parallel workers registering the same release at once leave one entry; racing
    releases of one subject under other noise: exactly one wins."""
    key_path = tmp_path / "noise.key"
    NoiseKey(key_path)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_register, args=(key_path, "same", queue)) for _ in range(4)]
    procs += [ctx.Process(target=_register, args=(key_path, f"other-{i}", queue)) for i in range(3)]
    for proc in procs:
        proc.start()
    outcomes = sorted(queue.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    lines = (tmp_path / "releases.jsonl").read_text().splitlines()
    assert len(lines) == 1
    assert outcomes.count("ok") in (1, 4) and outcomes.count("refused") == 7 - outcomes.count("ok")
