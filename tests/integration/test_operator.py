"""Issue 24, the operator's day, in the database (sql/021_operator.sql): a host drains itself with its own
role and no other host; `retire_host` drops (or disables) the retired host's login role; a run waiting
out its retry backoff says when its next attempt is due, to whoever may see the run."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from supervisor import store, unitspec
from supervisor.outcomes import Outcome
from tests.harness.postgres import Postgres
from tests.integration.conftest import TEST_SUBMITTER, age_jobs, bind_host_role, ensure_login_role, register

DENIED = "42501"
FAILED = Outcome("exit-code", "exit:1", "exited 1")


def login(dsn: str, role: str) -> psycopg.Connection:
    return store.connect(make_conninfo(dsn, user=role))


@pytest.fixture
def h1(conn: psycopg.Connection, dsn: str, postgres: Postgres) -> Iterator[psycopg.Connection]:
    """Host h1's own session, logged in as the role bound to h1, registered; h2 registered beside it."""
    with login(dsn, bind_host_role(conn, postgres, "h1")) as session:
        register(session, "h1")
        register(conn, "h2")
        yield session


def state_of(conn: psycopg.Connection, host: str) -> str:
    return conn.execute("SELECT state FROM unitvisor.hosts WHERE id = %s", (host,)).fetchone()[0]


# -- a host drains itself -----------------------------------------------------------------------------


def test_a_host_role_drains_and_undrains_its_own_host(h1: psycopg.Connection, conn: psycopg.Connection) -> None:
    assert store.set_host_state(h1, "h1", "draining") == "active"
    assert state_of(conn, "h1") == "draining"
    assert store.set_host_state(h1, "h1", "draining") == "draining"
    assert store.set_host_state(h1, "h1", "active") == "draining"
    assert state_of(conn, "h1") == "active"


def test_a_host_role_may_not_drain_another_host(h1: psycopg.Connection, conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error) as caught:
        store.set_host_state(h1, "h2", "draining")
    assert caught.value.sqlstate == DENIED
    assert "may not act as host h2" in str(caught.value)
    assert state_of(conn, "h2") == "active"


def test_a_host_role_may_not_drain_an_unknown_host_id(h1: psycopg.Connection) -> None:
    """An id nobody registered is another host's as far as h1 is concerned: refused, not "no host"."""
    with pytest.raises(psycopg.Error) as caught:
        store.set_host_state(h1, "nobody", "draining")
    assert caught.value.sqlstate == DENIED


def test_the_submitter_may_not_drain(conn: psycopg.Connection, dsn: str, postgres: Postgres) -> None:
    register(conn, "h2")
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    with login(dsn, TEST_SUBMITTER) as submitter, pytest.raises(psycopg.Error) as caught:
        store.set_host_state(submitter, "h2", "draining")
    assert caught.value.sqlstate == DENIED


def test_the_admin_drains_any_host_and_a_dead_one_stays_dead(conn: psycopg.Connection) -> None:
    register(conn, "h2")
    assert store.set_host_state(conn, "h2", "draining") == "active"
    assert store.set_host_state(conn, "nobody", "draining") is None
    conn.execute("UPDATE unitvisor.hosts SET state = 'dead' WHERE id = 'h2'")
    assert store.set_host_state(conn, "h2", "active") == "dead"
    assert state_of(conn, "h2") == "dead"


def test_only_active_and_draining_are_states_to_set(conn: psycopg.Connection) -> None:
    register(conn, "h2")
    for state in ("dead", "stopped"):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            store.set_host_state(conn, "h2", state)


# -- a retired host's login role --------------------------------------------------------------------------


@pytest.fixture
def retiring(conn: psycopg.Connection) -> Iterator[tuple[str, str]]:
    """A host id of this test's own with its own login role (roles are the cluster's, shared by every test
    database), registered as that role and stopped: ready to be forgotten. Yields (host id, role)."""
    host_id = f"old-{uuid.uuid4().hex[:8]}"
    role = store.default_host_role_name(host_id)
    store.add_host_role(conn, host_id, role, "pw")
    with login(conn.info.dsn, role) as session:
        fence = register(session, host_id)
        store.mark_host_stopped(session, fence)
    yield host_id, role


def role_row(conn: psycopg.Connection, role: str) -> tuple | None:
    return conn.execute("SELECT rolcanlogin, pg_has_role(oid, 'unitvisor_host', 'MEMBER') FROM pg_roles "
                        "WHERE rolname = %s", (role,)).fetchone()


def test_forgetting_a_host_drops_its_login_role(conn: psycopg.Connection, retiring: tuple[str, str]) -> None:
    host_id, role = retiring
    assert store.retire_host(conn, host_id) == store.Forgotten("stopped", 0, role, "dropped")
    assert role_row(conn, role) is None
    assert conn.execute("SELECT count(*) FROM unitvisor.host_roles WHERE host_id = %s", (host_id,)).fetchone()[0] == 0
    with pytest.raises(store.DatabaseError):
        login(conn.info.dsn, role)


def test_a_role_that_still_owns_something_is_disabled_instead(conn: psycopg.Connection,
                                                              retiring: tuple[str, str]) -> None:
    host_id, role = retiring
    conn.execute(sql.SQL("GRANT SELECT ON unitvisor.schema_migrations TO {}").format(sql.Identifier(role)))
    forgotten = store.retire_host(conn, host_id)
    assert (forgotten.role, forgotten.role_fate) == (role, "disabled")
    assert "privileges for table" in forgotten.kept_because
    assert role_row(conn, role) == (False, False)  # NOLOGIN, and out of unitvisor_host
    with pytest.raises(store.DatabaseError):
        login(conn.info.dsn, role)


def test_a_role_that_may_not_drop_roles_changes_nothing(conn: psycopg.Connection, dsn: str, postgres: Postgres,
                                                        retiring: tuple[str, str]) -> None:
    """The Install's admin login (a member of unitvisor_admin, no CREATEROLE): the row and the role stay, in
    one transaction, and the error names the role."""
    host_id, role = retiring
    ensure_login_role(postgres, "uvtest_admin", store.ADMIN_ROLE)
    with login(dsn, "uvtest_admin") as admin, pytest.raises(store.RoleNotDropped) as caught:
        store.retire_host(admin, host_id)
    assert caught.value.role == role
    assert state_of(conn, host_id) == "stopped" and role_row(conn, role) == (True, True)
    with login(dsn, "uvtest_admin") as admin:
        assert store.retire_host(admin, host_id, keep_role=True) == store.Forgotten("stopped", 0, role, "kept")
    assert role_row(conn, role) == (True, True)
    # Forgotten with the role kept (or by 0.7.0, which never touched it): a later forget drops the role.
    assert store.retire_host(conn, host_id) == store.Forgotten(None, 0, role, "dropped")
    assert role_row(conn, role) is None


def test_a_live_host_keeps_its_row_and_its_role(conn: psycopg.Connection, retiring: tuple[str, str]) -> None:
    host_id, role = retiring
    conn.execute("UPDATE unitvisor.hosts SET state = 'draining' WHERE id = %s", (host_id,))
    assert store.retire_host(conn, host_id) == store.Forgotten("draining", 0)
    assert role_row(conn, role) == (True, True)


def test_a_drained_host_whose_daemon_stopped_is_forgotten_without_being_declared_dead(
        conn: psycopg.Connection, retiring: tuple[str, str]) -> None:
    """The README's retirement: drain, wait, apt purge (the daemon stops), forget. A drained host's clean
    stop makes it 'stopped' (schema 24), which forget takes at once, without a peer declaring it dead first."""
    host_id, role = retiring
    with login(conn.info.dsn, role) as session:
        fence = register(session, host_id)
        store.set_host_state(session, host_id, "draining")
        store.mark_host_stopped(session, fence)
    assert state_of(conn, host_id) == "stopped"
    assert store.retire_host(conn, host_id) == store.Forgotten("stopped", 0, role, "dropped")
    assert conn.execute("SELECT 1 FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone() is None
    assert role_row(conn, role) is None


# -- when the next attempt is due -------------------------------------------------------------------------


def failed_once(conn: psycopg.Connection, h1: psycopg.Connection, **run: object) -> uuid.UUID:
    """A run claimed by h1 whose first attempt failed, queued again for its retry in 600 s."""
    run_id = store.submit_run(conn, argv=["/bin/false"], max_attempts=3, **run)
    age_jobs(conn)
    fence = store.host_fence(conn, "h1")[1]
    [(_, attempt)] = store.claim(h1, fence, 1, unitspec.UNIT_NAME_FORMAT)
    assert store.record_outcome(h1, fence, attempt, FAILED, "queued", timedelta(seconds=600))
    return run_id


def test_a_run_waiting_for_its_retry_says_when(h1: psycopg.Connection, conn: psycopg.Connection, dsn: str,
                                               postgres: Postgres) -> None:
    run_id = failed_once(conn, h1)
    due = store.next_attempt_at(conn, run_id)
    assert due is not None
    ahead = (due - store.now(conn)).total_seconds()
    assert 590 < ahead <= 600
    assert store.next_attempt_at(h1, run_id) == due  # the host reads it, though it reads no spawn job
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    with login(dsn, TEST_SUBMITTER) as submitter:
        assert store.next_attempt_at(submitter, run_id) == due
    # Once due, or for a run never tried, there is nothing to say.
    age_jobs(conn)
    assert store.next_attempt_at(conn, run_id) is None
    fresh = store.submit_run(conn, argv=["/bin/true"], not_before=store.now(conn) + timedelta(hours=1))
    assert store.next_attempt_at(conn, fresh) is None


def test_a_host_learns_nothing_of_a_run_it_may_not_see(h1: psycopg.Connection, conn: psycopg.Connection, dsn: str,
                                                       postgres: Postgres) -> None:
    run_id = failed_once(conn, h1, host_pin="h1")
    with login(dsn, bind_host_role(conn, postgres, "h2")) as h2:
        assert store.next_attempt_at(h2, run_id) is None
    assert store.next_attempt_at(h1, run_id) is not None
