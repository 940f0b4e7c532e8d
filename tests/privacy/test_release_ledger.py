"""The release ledger, in SQLite and PostgreSQL (``ledger_location``): one entry per release,
refusal of a release under other noise, keyed entries only, safe under concurrent registration."""

import multiprocessing

import pytest

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.keyed_noise import ForeignEntries, NoiseKey
from vllm_dp_plugin.privacy.release_ledger import ReleaseLedger, ReleaseRefused

UNIT = "one private K/V row of one attention layer"


def test_restart_is_idempotent_and_a_new_release_is_refused(tmp_path, ledger_location):
    ledger = ReleaseLedger(NoiseKey(tmp_path / "noise.key"), ledger_location)
    first = ledger.register("ids-digest", "release-a", Budget(2.0, 1e-6), UNIT, allow_rerelease=False)
    again = ReleaseLedger(NoiseKey(tmp_path / "noise.key"), ledger_location).register(
        "ids-digest", "release-a", Budget(2.0, 1e-6), UNIT, allow_rerelease=False)
    assert len(first.releases) == len(again.releases) == 1
    with pytest.raises(ReleaseRefused, match="already released 1 time"):
        ledger.register("ids-digest", "release-b", Budget(2.0, 1e-6), UNIT, allow_rerelease=False)
    assert len(ledger.history("ids-digest").releases) == 1  # nothing half-applied
    both = ledger.register("ids-digest", "release-b", Budget(3.0, 1e-6), UNIT, allow_rerelease=True)
    assert both.total == Budget(5.0, 2e-6)
    assert ledger.register("other-context", "release-b", Budget(1.0, 0.0), UNIT, allow_rerelease=False).total.epsilon == 1.0


def test_entries_hold_keyed_labels_only(tmp_path):
    key, path = NoiseKey(tmp_path / "noise.key"), tmp_path / "ledger.sqlite"
    ledger = ReleaseLedger(key, path)
    ledger.register("secret-subject", "secret-release", Budget(1.0, 0.0), UNIT, allow_rerelease=False)
    ledger.store.close()
    assert b"secret" not in path.read_bytes()
    (entry,) = ReleaseLedger(key, path).history("secret-subject").releases
    assert entry.subject == key.label("ledger/subject", "secret-subject")
    assert entry.release == key.label("ledger/release", "secret-subject", "secret-release")


def test_entries_under_another_key_are_counted_not_matched(tmp_path, ledger_location):
    """A new key (e.g. a deleted key file) cannot recognise earlier releases: the history says
    how many entries it could not match instead of claiming a first release, and a release under
    the new key is refused unless re-releases are allowed (before: registered as a first release)."""
    key_path, path = tmp_path / "noise.key", ledger_location
    ReleaseLedger(NoiseKey(key_path), path).register("s", "r", Budget(1.0, 0.0), UNIT, allow_rerelease=False)
    key_path.unlink()  # lost: the next start creates a new key
    new = ReleaseLedger(NoiseKey(key_path), path)
    history = new.history("s")
    assert history.releases == () and history.foreign == 1
    assert history.to_json()["entries_under_other_keys"] == 1
    with pytest.raises(ForeignEntries) as info:
        new.register("s", "r", Budget(1.0, 0.0), UNIT, allow_rerelease=False)
    message = str(info.value)
    assert f"release ledger {new.location} holds 1 entries written under another noise key than {key_path}" in message
    assert "release it again under new noise" in message and "`attention.allow_rerelease: true`" in message
    assert new.history("s").releases == ()  # nothing written
    again = new.register("s", "r", Budget(1.0, 0.0), UNIT, allow_rerelease=True)
    assert len(again.releases) == 1 and again.foreign == 1


def _register(key_path, location, release, queue):
    ledger = ReleaseLedger(NoiseKey(key_path), location)
    try:
        ledger.register("s", release, Budget(1.0, 0.0), UNIT, allow_rerelease=False)
        queue.put("ok")
    except ReleaseRefused:
        queue.put("refused")


def test_concurrent_workers_record_one_release(tmp_path, ledger_location):
    """Tensor-parallel workers registering the same release at once leave one entry; racing
    releases of one subject under other noise: exactly one wins."""
    key_path = tmp_path / "noise.key"
    NoiseKey(key_path)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_register, args=(key_path, ledger_location, "same", queue)) for _ in range(4)]
    procs += [ctx.Process(target=_register, args=(key_path, ledger_location, f"other-{i}", queue)) for i in range(3)]
    for proc in procs:
        proc.start()
    outcomes = sorted(queue.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert len(ReleaseLedger(NoiseKey(key_path), ledger_location).history("s").releases) == 1
    assert outcomes.count("ok") in (1, 4) and outcomes.count("refused") == 7 - outcomes.count("ok")
