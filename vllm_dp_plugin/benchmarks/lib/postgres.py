"""A throwaway PostgreSQL server for tests and benchmarks: ``initdb`` into a temporary directory,
``pg_ctl start`` listening on a unix socket only (no TCP port), stopped when the block ends.
Debian's ``postgresql`` package provides the binaries (the Makefile installs it where apt
exists); as root the server runs as the ``postgres`` user, which PostgreSQL requires."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 60


def postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl`` (PATH first, then Debian's layout)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


def unavailable_reason() -> str | None:
    """Why a temporary server cannot start here (None: it can)."""
    if postgres_bin() is None:
        return "PostgreSQL's initdb/pg_ctl are not installed (Debian: apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a `postgres` user to run the server as"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'vllm-dp-plugin[postgres]')"
    return None


@contextmanager
def temporary_postgres(database: str = "vllm_dp") -> Iterator[str]:
    """A running server's URL (``postgresql:///DB?host=SOCKET_DIR&user=...``) until the block ends."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    binaries = postgres_bin()
    root = Path(tempfile.mkdtemp(prefix="vllm-dp-pg-"))
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    as_user: list[str] = []
    user = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        entry = pwd.getpwnam("postgres")
        os.chown(root, entry.pw_uid, entry.pw_gid)
        os.chown(sockets, entry.pw_uid, entry.pw_gid)
        as_user, user = ["runuser", "-u", "postgres", "--"], "postgres"

    def run(*args: str) -> None:
        subprocess.run([*as_user, *args], check=True, capture_output=True, text=True, timeout=START_TIMEOUT_S)

    try:
        run(str(binaries / "initdb"), "-D", str(data), "-A", "trust", "-U", user, "--no-sync")
        run(str(binaries / "pg_ctl"), "-D", str(data), "-w", "-t", str(START_TIMEOUT_S), "-l", str(root / "log"),
            "-o", f"-c listen_addresses='' -c unix_socket_directories='{sockets}' -c fsync=on", "start")
        try:
            run(str(binaries / "createdb"), "-h", str(sockets), "-U", user, database)
            yield f"postgresql:///{database}?host={sockets}&user={user}"
        finally:
            run(str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
