"""Fixtures for the three levels.

- unit: nothing real; pytest-mock at the systemd and database boundaries.
- integration: a throwaway PostgreSQL, started once per session; each test gets a fresh database
  cloned from a migrated template.
- system: additionally a real systemd, booted once per session in a throwaway container; each test
  gets a clean unitvisor host inside it.
- package: the .deb, checked by Debian's and systemd's tools, down to a clean-room install.
- vm: the .deb installed in a real cgroup-v2 Debian 13 guest under qemu, for what needs a real kernel
  (tests/vm/conftest.py).

Where a level cannot run here (not root, no systemd-nspawn), its tests are skipped with the reason;
under CI (CI=true) that is a failure instead, because a skipped system test is a test that did not run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from supervisor import store
from tests.harness import postgres as postgres_mod
from tests.harness import testbed as testbed_mod
from tests.harness.host import REPO, Host
from tests.harness.postgres import Postgres

LEVELS = ("unit", "integration", "system", "package", "vm")
TEMPLATE_DB = "unitvisor_template"


def pytest_configure(config: pytest.Config) -> None:
    # A SIGTERM (a CI timeout, a killed terminal) becomes KeyboardInterrupt, so that the fixtures'
    # teardown still powers off the test bed, unmounts it and stops PostgreSQL.
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        if parts and parts[0] in ("integration", "system", "package", "vm"):
            item.add_marker(getattr(pytest.mark, parts[0]))


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"required in CI but unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    postgres_mod.cleanup_stale()
    try:
        pg = Postgres()
    except RuntimeError as exc:
        _unavailable(str(exc))
    try:
        pg.init()
        pg.start()
        with store.connect(pg.dsn) as conn:
            conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
        with store.connect(pg.dsn_for(TEMPLATE_DB)) as conn:
            store.migrate(conn)
        yield pg
    finally:
        pg.stop()


@contextlib.contextmanager
def throwaway_database(postgres: Postgres, template: str = "template1") -> Iterator[str]:
    """A new database (a copy of `template`) for one test, dropped afterwards; yields its DSN."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    # Without the daemon's statement_timeout (store.SESSION_SETTINGS, 15 s): CREATE DATABASE waits for a
    # checkpoint, which on a machine under heavy load took longer than that and failed a test's setup.
    with store.connect(postgres.dsn) as conn:
        conn.execute("SET statement_timeout = 0")
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    try:
        yield postgres.dsn_for(name)
    finally:
        with store.connect(postgres.dsn) as conn:
            conn.execute("SET statement_timeout = 0")
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def dsn(postgres: Postgres) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    with throwaway_database(postgres, TEMPLATE_DB) as new_dsn:
        yield new_dsn


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    with store.connect(dsn) as connection:
        yield connection


@pytest.fixture(scope="session")
def testbed() -> Iterator[testbed_mod.Testbed]:
    reason = testbed_mod.available()
    if reason:
        _unavailable(reason)
    testbed_mod.cleanup_stale()
    with testbed_mod.Testbed("uv-host-1", binds=[REPO]) as tb:
        yield tb


@pytest.fixture
def host(testbed: testbed_mod.Testbed, dsn: str) -> Iterator[Host]:
    h = Host(testbed, dsn)
    h.reset()
    h.configure()
    try:
        yield h
    finally:
        h.reset()
