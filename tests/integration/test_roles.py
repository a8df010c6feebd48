"""Issue 11: the three kinds of role (sql/004_roles.sql), logged in for real.

Every forbidden action is its own test, refused by the database itself (the SQLSTATE is checked:
42501, insufficient_privilege, for PostgreSQL's own refusals and for unitvisor.require_host's), or,
where the database answers by showing nothing (a run pinned to another host, a job it may not
claim), changing nothing. Then what each role needs still works: a control plane submits, cancels,
resumes and reads; a host goes through the whole daemon cycle; an admin drains and forgets.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from supervisor import store, unitspec
from supervisor.model import Attempt
from supervisor.outcomes import Outcome
from tests.harness.postgres import Postgres
from tests.integration.conftest import (
    TEST_SUBMITTER,
    age_jobs,
    bind_host_role,
    connected,
    ensure_login_role,
    host_profile,
    register,
    silence,
)

FMT = unitspec.UNIT_NAME_FORMAT
DENIED = "42501"
SUCCESS = Outcome("success", "exit:0", "exited 0")
SECRET_ENV = {"TOKEN": "for-h2-only"}


def login(dsn: str, role: str) -> psycopg.Connection:
    """A new session logged in as `role` (the throwaway cluster trusts 127.0.0.1)."""
    return store.connect(make_conninfo(dsn, user=role))


@dataclass
class World:
    """Two hosts, h1 and h2, each logged in as its own bound role, and a control plane's session.

    pinned: pinned to h2 (with a secret in its environment), claimed by h2. mine: pinned to h1,
    claimed by h1 and settled (success). free: unpinned, claimed by h1, open. queued: a run of
    h2's waiting, never claimed (h2 is full)."""

    admin: psycopg.Connection
    h1: psycopg.Connection
    h2: psycopg.Connection
    submitter: psycopg.Connection
    f1: store.Fence
    f2: store.Fence
    pinned: Attempt
    mine: Attempt
    free: Attempt
    queued: uuid.UUID


@pytest.fixture
def world(conn: psycopg.Connection, dsn: str, postgres: Postgres) -> Iterator[World]:
    roles = {host: bind_host_role(conn, postgres, host) for host in ("h1", "h2")}
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    sessions = [login(dsn, roles["h1"]), login(dsn, roles["h2"]), login(dsn, TEST_SUBMITTER)]
    h1, h2, submitter = sessions
    try:
        f1 = register(h1, "h1", max_runs=10)
        f2 = register(h2, "h2", max_runs=1)
        pinned_id = store.submit_run(submitter, argv=["/bin/true"], host_pin="h2", environment=SECRET_ENV,
                                     priority=5)
        mine_id = store.submit_run(submitter, argv=["/bin/true"], host_pin="h1", priority=4)
        free_id = store.submit_run(submitter, argv=["/bin/true"])
        queued = store.submit_run(submitter, argv=["/bin/true"], host_pin="h2")
        age_jobs(conn)
        [(_, pinned)] = store.claim(h2, f2, 1, FMT)
        claimed = {attempt.run_id: attempt for _, attempt in store.claim(h1, f1, 10, FMT)}
        assert pinned.run_id == pinned_id and set(claimed) == {mine_id, free_id}
        assert store.record_outcome(h1, f1, claimed[mine_id], SUCCESS, "succeeded")
        yield World(conn, h1, h2, submitter, f1, f2, pinned, claimed[mine_id], claimed[free_id], queued)
    finally:
        for session in sessions:
            session.close()


def refused(conn: psycopg.Connection, statement: str, params: tuple | dict | None = None,
            sqlstate: str = DENIED) -> psycopg.Error:
    """Run a statement that the database must refuse with `sqlstate`; return the error."""
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(statement, params)
    assert caught.value.sqlstate == sqlstate, f"{caught.value.sqlstate}: {caught.value}"
    return caught.value


def refused_call(call: Callable[[], object], sqlstate: str = DENIED) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        call()
    assert caught.value.sqlstate == sqlstate, f"{caught.value.sqlstate}: {caught.value}"
    return caught.value


def attempt_row(conn: psycopg.Connection, attempt: Attempt) -> tuple:
    return conn.execute("SELECT outcome, exit_status, reason, ended_at, started_at, host_id FROM unitvisor.attempts "
                        "WHERE run_id = %s AND attempt = %s", (attempt.run_id, attempt.attempt)).fetchone()


# -- a host may not ... -------------------------------------------------------------------------------


def test_host_cannot_update_another_hosts_attempt(world: World) -> None:
    refused(world.h1, "UPDATE unitvisor.attempts SET outcome = 'success', ended_at = now() "
                      "WHERE run_id = %s", (world.pinned.run_id,))


def test_host_cannot_record_an_outcome_for_a_live_hosts_attempt(world: World) -> None:
    before = attempt_row(world.admin, world.pinned)
    assert store.record_outcome(world.h1, world.f1, world.pinned, SUCCESS, "succeeded") is False
    assert attempt_row(world.admin, world.pinned) == before


def test_host_cannot_record_an_outcome_with_another_hosts_fence(world: World) -> None:
    refused_call(lambda: store.record_outcome(world.h1, world.f2, world.pinned, SUCCESS, "succeeded"))
    assert attempt_row(world.admin, world.pinned)[0] is None


def test_host_cannot_mark_another_hosts_attempt_started(world: World) -> None:
    refused_call(lambda: store.mark_started(world.h1, world.f2, world.pinned, "inv"))
    store.mark_started(world.h1, world.f1, world.pinned, "inv")  # with its own fence: not its attempt
    assert attempt_row(world.admin, world.pinned)[4] is None


def test_host_claims_nothing_pinned_to_another_host(world: World) -> None:
    store.record_outcome(world.h2, world.f2, world.pinned, SUCCESS, "succeeded")  # h2 has room for `queued` now
    assert store.claim(world.h1, world.f1, 10, FMT) == []
    assert store.get_attempts(world.admin, world.queued) == []


def test_host_cannot_claim_as_another_host(world: World) -> None:
    refused(world.h1, "SELECT * FROM unitvisor.claim_jobs(%s, %s, 10, %s)", ("h2", world.f2.epoch, FMT))


def test_host_cannot_register_as_another_host(world: World) -> None:
    refused_call(lambda: store.register_host(world.h1, host_profile("h3")))
    assert store.host_fence(world.admin, "h3") is None


def test_host_cannot_heartbeat_as_another_host(world: World) -> None:
    refused_call(lambda: store.probe(world.h1, world.f2, timedelta(minutes=1)))


def test_host_cannot_declare_hosts_dead_as_another_host(world: World) -> None:
    silence(world.admin, "h1", 3600)
    refused_call(lambda: store.declare_dead_hosts(world.h1, world.f2, 3600))
    assert store.host_fence(world.admin, "h1")[0] == "active"


def test_host_cannot_take_the_upkeeps_turn_declare_or_heartbeat_as_another_host(world: World) -> None:
    """Schema 19's host functions check the caller as the older ones do."""
    silence(world.admin, "h1", 3600)
    refused_call(lambda: store.fleet_upkeep_turn(world.h1, world.f2, timedelta(seconds=10)))
    refused_call(lambda: store.declare_dead(world.h1, world.f2, 3600, 5))
    refused_call(lambda: store.renew_heartbeat(world.h1, world.f2))
    assert store.host_fence(world.admin, "h1")[0] == "active"


def test_host_cannot_expire_runs_as_another_host(world: World) -> None:
    refused_call(lambda: store.expire_runs(world.h1, world.f2))


def test_host_cannot_call_the_expiry_or_the_key_check_directly(world: World) -> None:
    # Not granted: they read and write every run, and only the fenced functions call them.
    refused(world.h1, "SELECT unitvisor.expire_overdue_runs()")
    refused(world.h1, "SELECT unitvisor.concurrency_blocker(r) FROM unitvisor.runs r")


def test_host_cannot_append_an_event_for_another_host(world: World) -> None:
    refused_call(lambda: store.record_event(world.h1, world.f2, world.pinned, "running", "forged"))
    refused(world.h1, "INSERT INTO unitvisor.run_events (run_id, host_id, state, reason) "
                      "VALUES (%s, 'h2', 'running', 'x')", (world.pinned.run_id,))


def test_host_cannot_append_an_event_about_another_hosts_attempt(world: World) -> None:
    count = len(store.get_events(world.admin, world.pinned.run_id, 100))
    store.record_event(world.h1, world.f1, world.pinned, "running", "forged")
    assert len(store.get_events(world.admin, world.pinned.run_id, 100)) == count


def test_host_cannot_update_a_runs_argv(world: World) -> None:
    refused(world.h1, "UPDATE unitvisor.runs SET argv = ARRAY['/bin/sh', '-c', 'evil'] WHERE id = %s",
            (world.free.run_id,))


def test_host_cannot_update_a_runs_environment(world: World) -> None:
    refused(world.h1, """UPDATE unitvisor.runs SET environment = '{"LD_PRELOAD": "/tmp/x.so"}' WHERE id = %s""",
            (world.free.run_id,))


def test_host_cannot_update_a_runs_memory_max(world: World) -> None:
    refused(world.h1, "UPDATE unitvisor.runs SET memory_max = NULL WHERE id = %s", (world.free.run_id,))


def test_host_cannot_insert_a_run(world: World) -> None:
    refused(world.h1, "INSERT INTO unitvisor.runs (argv) VALUES (ARRAY['/bin/true'])")


def test_host_cannot_submit_a_run(world: World) -> None:
    refused_call(lambda: store.submit_run(world.h1, argv=["/bin/true"]))


def test_host_cannot_read_a_run_pinned_to_another_host(world: World) -> None:
    assert store.get_run(world.h1, world.pinned.run_id) is None
    assert world.h1.execute("SELECT count(*) FROM unitvisor.runs WHERE environment ? 'TOKEN'").fetchone()[0] == 0
    assert store.get_run(world.h2, world.pinned.run_id).environment == SECRET_ENV  # its own host reads it


def hold_a_secret_in_h2s_run(world: World) -> None:
    """The issue's finding: h2's run printed a secret, kept as its output tail; it has events and a
    reason why another of h2's runs waits."""
    assert store.record_outcome(world.h2, world.f2, world.pinned, SUCCESS, "succeeded")
    assert store.record_output_tails(world.h2, world.f2, [(world.pinned.run_id, world.pinned.attempt,
                                                          "db_password=hunter2\n")]) == 1
    world.admin.execute("INSERT INTO unitvisor.run_waits (run_id, reason) VALUES (%s, 'h2 is full')", (world.queued,))


# Everything a host role might read a run's facts from, by the run's id.
RUN_FACTS = {
    "attempts": "SELECT unit_name, outcome, exit_status, output_tail FROM unitvisor.attempts WHERE run_id = %s",
    "run_events": "SELECT state, reason FROM unitvisor.run_events WHERE run_id = %s",
    "run_waits": "SELECT reason FROM unitvisor.run_waits WHERE run_id = %s",
    "runs": "SELECT state FROM unitvisor.runs WHERE id = %s",
    "run_status": "SELECT state, outcome, exit_status FROM unitvisor.run_status(%s)",
}


def test_host_reads_nothing_of_a_run_pinned_to_another_host(world: World) -> None:
    hold_a_secret_in_h2s_run(world)
    for run_id in (world.pinned.run_id, world.queued):
        for name, query in RUN_FACTS.items():
            assert world.h1.execute(query, (run_id,)).fetchall() == [], name
    assert world.h1.execute("SELECT count(*) FROM unitvisor.attempts WHERE output_tail LIKE '%hunter2%' "
                            "OR host_id = 'h2'").fetchone() == (0,)
    assert world.h1.execute("SELECT count(*) FROM unitvisor.run_events WHERE host_id = 'h2'").fetchone() == (0,)
    assert world.h1.execute("SELECT count(*) FROM unitvisor.run_waits").fetchone() == (0,)
    refused(world.h1, "SELECT run_id FROM unitvisor.spawn_jobs")
    # Nor through the planner's statistics: pg_stats shows a table's most common values (an output tail
    # among them) to whoever may read the column, except while row security is on for that reader.
    world.admin.execute("ANALYZE unitvisor.attempts, unitvisor.run_events, unitvisor.run_waits")
    assert world.admin.execute("SELECT count(*) FROM pg_stats WHERE schemaname = 'unitvisor' "
                               "AND tablename = 'attempts' AND attname = 'output_tail'").fetchone() == (1,)
    assert world.h1.execute("SELECT tablename FROM pg_stats WHERE schemaname = 'unitvisor' AND tablename IN "
                            "('attempts', 'run_events', 'run_waits')").fetchall() == []
    # The CLI's reads, with a host's DSN.
    assert store.get_attempts(world.h1, world.pinned.run_id) == []
    assert store.get_outcome_records(world.h1, world.pinned.run_id) == {}
    assert store.get_events(world.h1, world.pinned.run_id) == []
    assert world.pinned.run_id not in {r["id"] for r in store.list_runs(world.h1)}
    assert world.pinned.run_id not in {r.id for r in store.runs_with_labels(world.h1, {})}


def test_host_reads_all_of_its_own_runs_and_the_submitter_of_every_run(world: World) -> None:
    hold_a_secret_in_h2s_run(world)
    assert store.get_outcome_records(world.h2, world.pinned.run_id)[1].output_tail == "db_password=hunter2\n"
    assert store.get_outcome_records(world.submitter, world.pinned.run_id)[1].output_tail == "db_password=hunter2\n"
    for host, run_id in ((world.h2, world.pinned.run_id), (world.h2, world.queued), (world.submitter, world.queued),
                         (world.h1, world.mine.run_id), (world.h1, world.free.run_id)):
        assert host.execute(RUN_FACTS["runs"], (run_id,)).fetchall() != []
        assert len(store.get_events(host, run_id)) >= 1
    assert world.h2.execute(RUN_FACTS["run_waits"], (world.queued,)).fetchall() == [("h2 is full",)]
    assert [a.host_id for a in store.get_attempts(world.h1, world.mine.run_id)] == ["h1"]
    assert list(store.get_outcome_records(world.h1, world.mine.run_id)) == [1]
    # An unpinned run's attempts are every host's to read, whoever ran them (as the run is).
    assert [a.host_id for a in store.get_attempts(world.h2, world.free.run_id)] == ["h1"]


def test_host_reads_a_dead_hosts_open_attempts_it_takes_over(world: World) -> None:
    assert store.get_attempts(world.h1, world.pinned.run_id) == []
    silence(world.admin, "h2", 3600)
    connected(world.admin, "h1")  # a declarer connected for longer than h2's host_dead_after (013)
    with world.h1.transaction():
        assert [d.host_id for d in store.declare_dead_hosts(world.h1, world.f1, 3600)] == ["h2"]
        [(run, taken)] = store.open_attempts(world.h1, "h2")
    assert (run.id, taken.attempt) == (world.pinned.run_id, 1)
    assert [a.host_id for a in store.get_attempts(world.h1, world.pinned.run_id)] == ["h2"]


def test_a_unit_of_a_run_pinned_to_another_host_is_held_elsewhere_not_an_orphan(world: World) -> None:
    """unit_owners for a unit found on h1's machine whose attempt is h2's (a changed host id, a restored
    image): open on another host, then ended, without saying which host or how it ended."""
    name = world.pinned.unit_name
    assert store.unit_owners(world.h1, [name]) == {name: store.UnitOwner(None, None)}
    assert store.unit_owners(world.h2, [name]) == {name: store.UnitOwner("h2", None)}
    assert store.record_outcome(world.h2, world.f2, world.pinned, Outcome("exit-code", "exit:3", "x"), "failed")
    assert store.unit_owners(world.h1, [name]) == {name: store.UnitOwner(None, "ended")}
    assert store.unit_owners(world.h1, [world.free.unit_name, "unitvisor-run-nothing.service"]) == {
        world.free.unit_name: store.UnitOwner("h1", None)}


def test_hosts_in_flight_counts_every_hosts_attempts_for_a_host_role(world: World) -> None:
    assert {h["id"]: h["in_flight"] for h in store.list_hosts(world.h1)} == {"h1": 1, "h2": 1}


def test_every_table_a_host_reads_that_holds_a_run_is_under_a_policy(conn: psycopg.Connection) -> None:
    """A table (or view) granted to hosts that has a run_id column, or is runs, must have row security
    on and a policy for hosts: a new one that forgot it shows up here."""
    unguarded = conn.execute(
        """SELECT c.relname FROM pg_class c
           WHERE c.relnamespace = 'unitvisor'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')
             AND has_table_privilege(%s, c.oid, 'SELECT')
             AND (c.relname = 'runs' OR EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = c.oid
                                                AND a.attname = 'run_id' AND NOT a.attisdropped))
             AND NOT (c.relrowsecurity AND EXISTS (SELECT 1 FROM pg_policy p WHERE p.polrelid = c.oid
                                                   AND %s::regrole = ANY (p.polroles)))
           ORDER BY 1""", (store.HOST_ROLE, store.HOST_ROLE)).fetchall()
    assert unguarded == []


def test_host_cannot_delete_an_event(world: World) -> None:
    refused(world.h1, "DELETE FROM unitvisor.run_events WHERE run_id = %s", (world.free.run_id,))


def test_host_cannot_update_an_event(world: World) -> None:
    refused(world.h1, "UPDATE unitvisor.run_events SET reason = 'rewritten' WHERE run_id = %s", (world.free.run_id,))


def test_host_cannot_update_another_hosts_row(world: World) -> None:
    refused(world.h1, "UPDATE unitvisor.hosts SET state = 'draining' WHERE id = 'h2'")
    refused_call(lambda: store.set_host_state(world.h1, "h2", "draining"))


def test_host_cannot_update_its_own_epoch(world: World) -> None:
    refused(world.h1, "UPDATE unitvisor.hosts SET epoch = epoch + 1 WHERE id = 'h1'")


def test_host_cannot_drop_a_table(world: World) -> None:
    refused(world.h1, "DROP TABLE unitvisor.run_events")


def test_host_cannot_create_a_table_in_the_schema(world: World) -> None:
    refused(world.h1, "CREATE TABLE unitvisor.mine (x int)")


def test_host_cannot_truncate_history(world: World) -> None:
    refused(world.h1, "TRUNCATE unitvisor.run_events")


def test_host_cannot_cancel_a_run(world: World) -> None:
    refused_call(lambda: store.cancel_run(world.h1, world.free.run_id))


def test_host_cannot_resume_a_run(world: World) -> None:
    refused_call(lambda: store.resume_run(world.h1, world.mine.run_id))


def test_host_reads_through_run_status_only_what_the_policy_on_runs_lets_it_see(world: World) -> None:
    # run_status runs with the caller's rights: a run pinned to another host is no row for h1.
    assert world.h1.execute("SELECT id FROM unitvisor.run_status(%s)", (world.pinned.run_id,)).fetchall() == []
    assert world.h1.execute("SELECT id FROM unitvisor.run_status(%s)",
                            (world.free.run_id,)).fetchall() == [(world.free.run_id,)]


def test_host_cannot_read_the_host_role_bindings(world: World) -> None:
    refused(world.h1, "SELECT * FROM unitvisor.host_roles")


def test_host_cannot_bind_itself_to_another_host(world: World) -> None:
    refused(world.h1, "UPDATE unitvisor.host_roles SET host_id = 'h2'")


def test_host_cannot_call_check_fence_itself(world: World) -> None:
    refused(world.h1, "SELECT unitvisor.check_fence('h1', %s)", (world.f1.epoch,))


def test_host_cannot_become_the_admin(world: World) -> None:
    refused(world.h1, "SET ROLE unitvisor_admin")


def test_host_cannot_rewrite_its_own_settled_outcome(world: World) -> None:
    before = attempt_row(world.admin, world.mine)
    refused(world.h1, "UPDATE unitvisor.attempts SET outcome = 'exit-code', exit_status = 'exit:1' "
                      "WHERE run_id = %s", (world.mine.run_id,))
    failed = Outcome("exit-code", "exit:1", "exited 1")
    assert store.record_outcome(world.h1, world.f1, world.mine, failed, "failed") is False
    assert attempt_row(world.admin, world.mine) == before


def test_an_unbound_host_role_cannot_register(world: World, dsn: str, postgres: Postgres) -> None:
    ensure_login_role(postgres, "uvtest_unbound", store.HOST_ROLE)
    with login(dsn, "uvtest_unbound") as unbound:
        refused_call(lambda: store.register_host(unbound, host_profile("h9")))
        assert unbound.execute("SELECT kind, host_id FROM unitvisor.whoami()").fetchone() == ("unbound", None)


# -- a control plane may not ... ----------------------------------------------------------------------


def test_submitter_cannot_update_attempts(world: World) -> None:
    refused(world.submitter, "UPDATE unitvisor.attempts SET outcome = 'success', ended_at = now()")


def test_submitter_cannot_update_hosts(world: World) -> None:
    refused(world.submitter, "UPDATE unitvisor.hosts SET state = 'draining'")


def test_submitter_cannot_delete_events(world: World) -> None:
    refused(world.submitter, "DELETE FROM unitvisor.run_events")


def test_submitter_cannot_update_a_run_directly(world: World) -> None:
    refused(world.submitter, "UPDATE unitvisor.runs SET state = 'succeeded'")


def test_submitter_cannot_run_ddl(world: World) -> None:
    refused(world.submitter, "DROP TABLE unitvisor.runs")
    refused(world.submitter, "CREATE TABLE unitvisor.mine (x int)")


def test_submitter_cannot_claim_jobs(world: World) -> None:
    refused(world.submitter, "SELECT * FROM unitvisor.claim_jobs('h1', %s, 10, %s)", (world.f1.epoch, FMT))


def test_submitter_cannot_register_a_host(world: World) -> None:
    refused_call(lambda: store.register_host(world.submitter, host_profile("h7")))


def test_submitter_cannot_record_an_outcome(world: World) -> None:
    refused_call(lambda: store.record_outcome(world.submitter, world.f1, world.free, SUCCESS, "succeeded"))


def test_submitter_cannot_read_the_host_role_bindings(world: World) -> None:
    refused(world.submitter, "SELECT * FROM unitvisor.host_roles")


def test_host_cannot_prune_without_its_fence(world: World) -> None:
    """unitvisor.prune (any age, no floor) is the admin's; a host goes through prune_history."""
    refused(world.h1, "SELECT * FROM unitvisor.prune(interval '1 second')")


def test_host_cannot_prune_as_another_host(world: World) -> None:
    refused_call(lambda: store.prune_batch(world.h1, timedelta(days=1), 10, world.f2))


def test_host_prunes_the_fleets_old_history_as_itself(world: World) -> None:
    """Any host may be the fleet's pruner (whichever holds the lock): it deletes every old finished run,
    also one that another host ran or that it may not read (prune_history runs as the admin)."""
    world.admin.execute("UPDATE unitvisor.runs SET finished_at = now() - interval '40 days' WHERE id = %s",
                        (world.mine.run_id,))
    assert store.prune_batch(world.h2, timedelta(days=30), 10, world.f2).runs == 1
    assert store.get_run(world.admin, world.mine.run_id) is None


def test_submitter_cannot_prune(world: World) -> None:
    refused(world.submitter, "SELECT * FROM unitvisor.prune(interval '1 day')")
    refused_call(lambda: store.prune_batch(world.submitter, timedelta(days=1), 10, world.f1))


# -- nobody but the admin: the catch-all ----------------------------------------------------------------


def test_public_may_execute_no_function_of_the_schema(conn: psycopg.Connection) -> None:
    """Functions are executable by PUBLIC unless revoked: a new one that forgot it shows up here."""
    executable = conn.execute(
        """SELECT p.oid::regprocedure::text FROM pg_proc p
           WHERE p.pronamespace = 'unitvisor'::regnamespace AND has_function_privilege('public', p.oid, 'EXECUTE')
           ORDER BY 1""").fetchall()
    assert executable == []


def test_public_holds_no_privilege_on_the_schema_or_its_tables(conn: psycopg.Connection) -> None:
    on_relations = conn.execute(
        """SELECT c.relname, a.privilege_type FROM pg_class c, aclexplode(c.relacl) a
           WHERE c.relnamespace = 'unitvisor'::regnamespace AND a.grantee = 0""").fetchall()
    on_schema = conn.execute(
        """SELECT a.privilege_type FROM pg_namespace n, aclexplode(n.nspacl) a
           WHERE n.nspname = 'unitvisor' AND a.grantee = 0""").fetchall()
    assert (on_relations, on_schema) == ([], [])


# What each role may run and touch, in full: a later migration that grants more must say so here.
HOST_FUNCTIONS = {
    "claim_jobs", "declare_dead_hosts", "expire_runs", "explain_waiting", "heartbeat", "mark_host_stopped",
    "mark_started", "max_rows_bound", "my_host_id", "prune_history", "record_event", "record_outcome",
    "record_output_tails", "register_host", "register_host_allowlist", "register_host_environment", "run_status",
    "runs_with_labels", "wait_reason", "whoami", "host_holds_run", "host_may_see", "unit_owners", "host_in_flight",
    "set_host_pressure", "fleet_upkeep_turn", "declare_dead", "renew_heartbeat", "set_host_state",
    "next_attempt_at", "refusals_now",
    "cron_next", "submit_due_schedules",  # 028: schedules (a host reads no schedule, it submits the due ones)
    "mark_warned",  # 026: graceful stop
    "failure_verdict",  # 027: failure rules
    "freeze_pending", "freeze_text", "held_text", "freeze_requests", "record_freeze",  # 030: hold and freeze
    "limit_status",  # 032: named limits (the daemon's metrics read them)
    "host_labels", "register_host_labels",  # 033: placement
    "after_text", "dependency_met", "retention_states", "count_skips",  # 035: dependencies
    "register_wake_channel"}  # 048: its own channel
SUBMITTER_FUNCTIONS = {"cancel_run", "max_rows_bound", "my_host_id", "resume_run", "run_status",
                       "runs_with_labels", "submit_run", "wait_reason", "whoami", "host_in_flight", "next_attempt_at",
                       "refusals_now",
                       "cron_next", "create_schedule", "drop_schedule", "pause_schedule", "submit_run_spec",  # 028
                       "failure_verdict",  # 027
                       "freeze_pending", "freeze_text", "held_text", "hold_run", "release_run", "freeze_run",
                       "thaw_run",  # 030
                       "limit_status", "set_limit", "drop_limit",  # 032: named limits
                       "host_labels",  # 033: placement
                       "after_text", "dependency_met", "retention_states"}  # 035 (and resume_run's second form)
# 034: the River source's functions create runs, so a host role has them only when granted unitvisor_river too.
RIVER_FUNCTIONS = {"submit_river_run", "river_runs", "cancel_river_run"}
READ = {"attempts", "hosts", "run_events", "run_waits", "runs", "schema_migrations",
        "run_dependencies"}  # 035


@pytest.mark.parametrize(("role", "functions", "tables"), [
    (store.HOST_ROLE, HOST_FUNCTIONS, {(t, "SELECT") for t in READ}),
    (store.SUBMITTER_ROLE, SUBMITTER_FUNCTIONS, {(t, "SELECT") for t in READ | {"spawn_jobs", "schedules", "limits"}}),
    (store.RIVER_ROLE, RIVER_FUNCTIONS, set()),
])
def test_each_role_holds_exactly_its_privileges(conn: psycopg.Connection, role: str, functions: set[str],
                                                tables: set[tuple[str, str]]) -> None:
    executable = {row[0] for row in conn.execute(
        """SELECT p.proname FROM pg_proc p
           WHERE p.pronamespace = 'unitvisor'::regnamespace AND has_function_privilege(%s, p.oid, 'EXECUTE')""",
        (role,))}
    granted = set(conn.execute(
        """SELECT c.relname, a.privilege_type FROM pg_class c, aclexplode(c.relacl) a
           WHERE c.relnamespace = 'unitvisor'::regnamespace AND a.grantee = %s::regrole""", (role,)).fetchall())
    # Named both ways, so that a failure says which function was granted or taken away.
    assert (executable - functions, functions - executable, granted) == (set(), set(), tables)


def test_every_object_of_the_schema_is_the_admins(conn: psycopg.Connection) -> None:
    owners = conn.execute(
        """SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_class c WHERE c.relnamespace = 'unitvisor'::regnamespace
           UNION SELECT DISTINCT pg_get_userbyid(p.proowner) FROM pg_proc p
                 WHERE p.pronamespace = 'unitvisor'::regnamespace
           UNION SELECT pg_get_userbyid(n.nspowner) FROM pg_namespace n WHERE n.nspname = 'unitvisor'""").fetchall()
    assert owners == [(store.ADMIN_ROLE,)]


def test_every_security_definer_function_has_a_safe_search_path(conn: psycopg.Connection) -> None:
    unsafe = conn.execute(
        """SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p
           WHERE p.pronamespace = 'unitvisor'::regnamespace AND p.prosecdef
             AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY (p.proconfig), false)""").fetchall()
    assert unsafe == []


# -- ... and what each role needs still works ---------------------------------------------------------


def test_submitter_submits_cancels_resumes_and_reads(world: World) -> None:
    s = world.submitter
    run_id = store.submit_run(s, argv=["/bin/true"], max_attempts=2)
    assert store.cancel_run(s, run_id) == store.Transition("cancelled", True)
    assert store.resume_run(s, run_id) == store.Transition("queued", True)
    assert store.cancel_run(s, world.free.run_id) == store.Transition("starting", True)  # its host stops it
    assert store.get_run(s, world.pinned.run_id).environment == SECRET_ENV  # a control plane reads every run
    assert [a.host_id for a in store.get_attempts(s, world.pinned.run_id)] == ["h2"]
    assert [e["reason"] for e in store.get_events(s, run_id)][-1] == "resumed by an operator"
    assert {r["id"] for r in store.list_runs(s)} >= {run_id, world.pinned.run_id}
    assert {h["id"] for h in store.list_hosts(s)} == {"h1", "h2"}
    assert s.execute("SELECT kind FROM unitvisor.whoami()").fetchone() == ("submitter",)
    assert store.run_status(s, world.pinned.run_id).host_id == "h2"


def test_host_goes_through_the_whole_daemon_cycle(world: World) -> None:
    """Heartbeat, claim, start, event, a failed attempt retried, success, declaring a silent host dead
    and settling its attempts, stopping: everything the daemon does, logged in as h1's role."""
    h1, f1 = world.h1, world.f1
    assert h1.execute("SELECT kind, host_id FROM unitvisor.whoami()").fetchone() == ("host", "h1")
    run_id = store.submit_run(world.submitter, argv=["/bin/false"], max_attempts=2)
    age_jobs(world.admin)
    assert store.probe(h1, f1, timedelta(minutes=1)).claimable
    [(run, first)] = store.claim(h1, f1, 10, FMT)
    assert run.id == run_id
    store.mark_started(h1, f1, first, "inv-1")
    store.record_event(h1, f1, first, "running", "stopping nothing, just saying")
    assert (run_id, 1) in {(r.id, a.attempt) for r, a in store.open_attempts(h1, "h1")}
    assert store.unit_owners(h1, [first.unit_name])[first.unit_name].host_id == "h1"
    assert store.record_outcome(h1, f1, first, Outcome("exit-code", "exit:1", "exited 1"), "queued",
                                timedelta(seconds=0))
    [(_, second)] = store.claim(h1, f1, 10, FMT)
    assert second.attempt == 2
    assert store.record_outcome(h1, f1, second, SUCCESS, "succeeded")
    assert store.get_run(h1, run_id).state == "succeeded"
    # h2 falls silent: h1 declares it dead and takes over its attempt, pinned to h2 as it is.
    silence(world.admin, "h2", 3600)
    connected(world.admin, "h1")
    with h1.transaction():
        dead = store.declare_dead_hosts(h1, f1, 3600)
        assert [d.host_id for d in dead] == ["h2"]
        [(run, taken)] = store.open_attempts(h1, "h2")
        assert run.id == world.pinned.run_id
        assert store.record_outcome(h1, f1, taken, Outcome("lost", None, "host h2 died"), "failed")
    assert store.explain_waiting(h1, timedelta(0)) >= 0
    assert store.unclaimed_attempts(h1, [(world.free.run_id, 9)]) == {(world.free.run_id, 9)}
    store.mark_host_stopped(h1, f1)
    assert store.host_fence(h1, "h1")[0] == "stopped"


def test_admin_login_drains_forgets_and_acts_as_any_host(world: World, dsn: str, postgres: Postgres) -> None:
    """A login role that is a member of unitvisor_admin (as the one role of a single-role deployment
    becomes): drain and forget, and act as any host, as 0.2.0's daemons do."""
    ensure_login_role(postgres, "uvtest_admin", store.ADMIN_ROLE)
    with login(dsn, "uvtest_admin") as admin:
        assert admin.execute("SELECT kind FROM unitvisor.whoami()").fetchone() == ("admin",)
        assert store.set_host_state(admin, "h2", "draining") == "active"
        fence = register(admin, "h5")
        assert store.probe(admin, fence, timedelta(minutes=1)).host_state == "active"
        store.mark_host_stopped(admin, fence)
        assert store.forget_host(admin, "h5") == ("stopped", 0)
        assert store.get_run(admin, world.pinned.run_id).environment == SECRET_ENV
        assert admin.execute("SELECT count(*) FROM unitvisor.host_roles").fetchone()[0] >= 2


# -- migrate: concurrent databases, and the single-role deployment before it --------------------------


def test_concurrent_migrates_in_two_databases_create_the_roles_once() -> None:
    """Roles are the cluster's: a migrate in one database may create them while another database's
    migrate is creating them too. A cluster of its own, where the roles do not exist yet."""
    cluster = Postgres()
    try:
        cluster.init()
        cluster.start()
        with store.connect(cluster.dsn) as admin:
            for name in ("one", "two"):
                admin.execute(f"CREATE DATABASE {name}")
        results: dict[str, list[str]] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def migrate(name: str) -> None:
            try:
                with store.connect(cluster.dsn_for(name)) as conn:
                    barrier.wait(timeout=10)
                    results[name] = store.migrate(conn)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=migrate, args=(name,)) for name in ("one", "two")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors
        assert results["one"] == results["two"] == [path.stem for path in sorted(store.MIGRATIONS_DIR.glob("*.sql"))]
        with store.connect(cluster.dsn) as admin:
            assert admin.execute("SELECT count(*) FROM pg_roles WHERE rolname IN (%s, %s, %s)",
                                 (store.ADMIN_ROLE, store.SUBMITTER_ROLE, store.HOST_ROLE)).fetchone()[0] == 3
    finally:
        cluster.stop()


def test_the_one_role_of_a_single_role_deployment_keeps_working(postgres: Postgres, empty_dsn: str,
                                                                 tmp_path: Path) -> None:
    """Before 004 one login role owned everything, and 0.2.0's daemons connect as it: after 004 (run by
    the superuser) it is an admin member, and 0.2.0's own statements still work for it."""
    ensure_login_role(postgres, "uvtest_legacy", "pg_monitor")  # any role: only the login matters
    dbname = conninfo_to_dict(empty_dsn)["dbname"]
    with store.connect(postgres.dsn) as superuser:
        superuser.execute(f"ALTER DATABASE {dbname} OWNER TO uvtest_legacy")
    for name in ("001_schema.sql", "002_fleet.sql", "003_run_policy.sql"):
        shutil.copy(store.MIGRATIONS_DIR / name, tmp_path / name)
    with login(empty_dsn, "uvtest_legacy") as legacy:
        store.migrate(legacy, tmp_path)  # as it was: the one role migrated, and owned, everything
    with store.connect(empty_dsn) as superuser:
        assert store.migrate(superuser)[0] == "004_roles"
    with login(empty_dsn, "uvtest_legacy") as legacy:
        assert store.whoami(legacy) == store.Identity("admin", None)
        # 0.2.0's statements, as its store.py wrote them: register_host by name with 002's arguments,
        # claim_jobs, the direct heartbeat, start and event with check_fence.
        epoch = legacy.execute(
            "SELECT epoch FROM unitvisor.register_host(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            ("old", "box-old", "inst-old", 10, None, "0.2.0", "boot", ["/**"], ["^/.*$"], "", [], True, None,
             10.0, 60.0)).fetchone()[0]
        run_id = legacy.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])").fetchone()[0]
        legacy.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '1 minute'")
        [(claimed, attempt)] = legacy.execute(
            "SELECT run_id, attempt FROM unitvisor.claim_jobs('old', %s, 10, %s)", (epoch, FMT)).fetchall()
        assert claimed == run_id
        assert legacy.execute("UPDATE unitvisor.hosts h SET heartbeat_at = now() WHERE h.id = 'old' "
                              "AND h.epoch = %s RETURNING h.state", (epoch,)).fetchone() == ("active",)
        legacy.execute("UPDATE unitvisor.attempts SET started_at = now() WHERE run_id = %s AND attempt = %s "
                       "AND (SELECT unitvisor.check_fence('old', %s))", (run_id, attempt, epoch))
        legacy.execute("INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason) "
                       "SELECT %s, %s, 'old', 'running', 'x' WHERE unitvisor.check_fence('old', %s)",
                       (run_id, attempt, epoch))
        assert legacy.execute("SELECT count(*) FROM unitvisor.host_roles").fetchone() == (0,)


# -- README, Install: CONNECT only for the unitvisor roles ----------------------------------------------


def readme_connect_statement(dbname: str) -> str:
    """The README's `psql -c '...'` that revokes CONNECT from PUBLIC, for database `dbname`."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [line] = [x for x in readme.splitlines() if "REVOKE CONNECT ON DATABASE" in x]
    statement = line.split("-c '", 1)[1].rsplit("'", 1)[0]
    assert statement.count("ON DATABASE unitvisor ") == 2, statement
    return statement.replace("ON DATABASE unitvisor ", f'ON DATABASE "{dbname}" ')


def test_after_the_readmes_install_only_the_unitvisor_roles_connect(conn: psycopg.Connection, dsn: str,
                                                                     postgres: Postgres) -> None:
    ensure_login_role(postgres, "uvtest_outsider", "pg_monitor")  # a role of the cluster, of no unitvisor kind
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    ensure_login_role(postgres, "uvtest_admin", store.ADMIN_ROLE)
    host_role = bind_host_role(conn, postgres, "h1")
    login(dsn, "uvtest_outsider").close()  # what createdb leaves: PUBLIC may connect
    conn.execute(readme_connect_statement(conn.info.dbname))
    with pytest.raises(store.DatabaseUnavailable, match="does not have CONNECT privilege"):
        login(dsn, "uvtest_outsider")
    for role in (host_role, TEST_SUBMITTER, "uvtest_admin"):
        with login(dsn, role) as session:
            assert store.whoami(session).kind in ("host", "submitter", "admin")
