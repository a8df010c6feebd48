"""The River source (issue 26, schema 034) against River's real tables (tests/integration/river_schema.py,
versions 6 and 7) on a real PostgreSQL: jobs inserted as River's InsertTx inserts them, claimed with
River's semantics as each host's bound login role (so the GRANTs docs/river.md lists are proven enough),
made into runs in the claim's transaction, and finished completed, discarded or cancelled; the crash
between claim and finish; two hosts claiming one queue."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import sql

from supervisor import river, riversource, store, unitspec
from supervisor.config import RiverSettings
from supervisor.outcomes import Outcome
from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration import river_schema
from tests.integration.conftest import backend_gone, bind_host_role, register, session_as, wait_notifies
from tests.integration.test_sql_api_example import assert_example_prints_its_out

SETTINGS = RiverSettings(schema="river", queues=("spawn",), kinds=("tm_spawn_run",),
                         spec_function="platform.unitvisor_spec")

# A platform whose runs table holds argv and limits, and its spec function (docs/river.md's example).
PLATFORM = """
CREATE SCHEMA platform;
CREATE TABLE platform.runs (id text PRIMARY KEY, argv text[] NOT NULL, memory_max bigint, extra jsonb DEFAULT '{}');
CREATE FUNCTION platform.unitvisor_spec(job_args jsonb, job_kind text, job_id bigint) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('argv', to_jsonb(r.argv), 'memory_max', r.memory_max,
                              'labels', jsonb_build_object('platform_run_id', r.id)) || r.extra
    FROM platform.runs r WHERE r.id = job_args ->> 'run_id'
$$;
GRANT USAGE ON SCHEMA platform TO unitvisor_river;
GRANT SELECT ON platform.runs TO unitvisor_river;
GRANT EXECUTE ON FUNCTION platform.unitvisor_spec(jsonb, text, bigint) TO unitvisor_river;
"""


@pytest.fixture(params=river_schema.VERSIONS, ids=lambda v: f"river-v{v}")
def platform(request: pytest.FixtureRequest, conn: psycopg.Connection) -> int:
    """River's tables at each supported version, and the platform's schema beside them."""
    river_schema.create(conn, "river", request.param)
    create_platform(conn)
    return request.param


def create_platform(conn: psycopg.Connection) -> None:
    with conn.transaction():
        for statement in PLATFORM.split(";\n"):
            if statement.strip():
                conn.execute(statement)


def spawn(conn: psycopg.Connection, argv: list[str] | None = None, *, queue: str = "spawn",
          kind: str = "tm_spawn_run", priority: int = 1, extra: dict | None = None,
          scheduled_at: datetime | None = None) -> tuple[str, int]:
    """What the platform's control plane does: its run row and the River job, in one transaction."""
    platform_id = f"pr-{uuid.uuid4().hex[:8]}"
    with conn.transaction():
        conn.execute("INSERT INTO platform.runs (id, argv, extra) VALUES (%s, %s, %s)",
                     (platform_id, argv or ["/bin/true"], psycopg.types.json.Jsonb(extra or {})))
        job_id = river_schema.insert_tx(conn, kind, {"run_id": platform_id}, queue=queue, priority=priority,
                                        scheduled_at=scheduled_at)
    return platform_id, job_id


def bind_river_host(conn: psycopg.Connection, postgres: Postgres, host: str) -> str:
    """The login role bound to `host`, granted unitvisor_river as docs/river.md tells the admin to do for
    the hosts that serve a River source (roles are the cluster's: granted once, kept)."""
    role = bind_host_role(conn, postgres, host)
    if not conn.execute("SELECT pg_has_role(%s, %s, 'MEMBER')", (role, store.RIVER_ROLE)).fetchone()[0]:
        conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(store.RIVER_ROLE), sql.Identifier(role)))
    return role


@contextmanager
def as_host(conn: psycopg.Connection, postgres: Postgres, host: str) -> Iterator[None]:
    with session_as(conn, bind_river_host(conn, postgres, host)):
        yield


def claim(conn: psycopg.Connection, postgres: Postgres, fence: store.Fence, limit: int = 10) -> list[store.RiverClaim]:
    with as_host(conn, postgres, fence.host_id):
        return riversource.claim(conn, fence, SETTINGS, limit)


def finish(conn: psycopg.Connection, postgres: Postgres, fence: store.Fence) -> list[riversource.Finished]:
    with as_host(conn, postgres, fence.host_id):
        return riversource.finish_held(conn, fence, SETTINGS)


def run_of(conn: psycopg.Connection, job_id: int) -> dict | None:
    row = conn.execute("SELECT id, state, labels, argv, memory_max, river_job_id FROM unitvisor.runs "
                       "WHERE river_job_id = %s", (job_id,)).fetchone()
    return dict(zip(("id", "state", "labels", "argv", "memory_max", "river_job_id"), row, strict=True)) if row else None


def start_unit(conn: psycopg.Connection, fence: store.Fence) -> None:
    """What the daemon does next with the run: claim its spawn job and mark its unit started."""
    for _, attempt in store.claim(conn, fence, 10, unitspec.UNIT_NAME_FORMAT):
        store.mark_started(conn, fence, attempt, None)


# -- the claim -------------------------------------------------------------------------------------------


def test_a_job_inserted_in_the_platforms_transaction_becomes_a_linked_run(conn, postgres, platform, dsn) -> None:
    with store.connect(dsn) as listener:
        store.listen(listener, river.insert_channel("river"))
        platform_id, job_id = spawn(conn, ["/bin/echo", "hi"])
        notes = wait_notifies(listener)
    assert [(n.channel, n.payload) for n in notes] == [("river.river_insert", '{"queue": "spawn"}')]
    assert river.insert_queue(notes[0].payload) == "spawn"
    fence = register(conn, "h1")

    claimed = claim(conn, postgres, fence)

    assert [(c.job_id, c.attempt, c.refused) for c in claimed] == [(job_id, 1, None)]
    job = river_schema.job(conn, job_id)
    assert (job["state"], job["attempt"], job["attempted_by"], job["finalized_at"]) == (
        "running", 1, ["unitvisor:h1"], None)
    assert job["attempted_at"] is not None
    run = run_of(conn, job_id)
    assert run == {"id": claimed[0].run_id, "state": "queued", "labels": {"platform_run_id": platform_id},
                   "argv": ["/bin/echo", "hi"], "memory_max": None, "river_job_id": job_id}
    # Held, not finished: the unit has not started.
    assert finish(conn, postgres, fence) == []
    assert river_schema.job(conn, job_id)["state"] == "running"


def test_only_due_jobs_of_the_kinds_and_queues_served_in_rivers_order(conn, postgres, platform) -> None:
    _, other_kind = spawn(conn, kind="email")
    _, other_queue = spawn(conn, queue="default")
    _, later = spawn(conn, scheduled_at=datetime.now(UTC) + timedelta(hours=1))
    _, low = spawn(conn, priority=3)
    _, high = spawn(conn, priority=1)
    _, paused = spawn(conn, queue="paused")
    conn.execute("INSERT INTO river.river_queue (name, paused_at, updated_at) VALUES ('paused', now(), now())")
    settings = RiverSettings(schema="river", queues=("spawn", "paused"), kinds=("tm_spawn_run",),
                             spec_function="platform.unitvisor_spec")
    fence = register(conn, "h1")
    with as_host(conn, postgres, "h1"):
        first = riversource.claim(conn, fence, settings, 1)
        rest = riversource.claim(conn, fence, settings, 10)
    assert [c.job_id for c in first] == [high]
    assert [c.job_id for c in rest] == [low]
    for job_id in (other_kind, other_queue, paused):
        assert river_schema.job(conn, job_id)["state"] == "available"
    assert river_schema.job(conn, later)["state"] == "scheduled"


def test_attempted_by_keeps_rivers_newest_hundred(conn, postgres, platform) -> None:
    _, job_id = spawn(conn)
    conn.execute("UPDATE river.river_job SET attempted_by = ARRAY(SELECT 'go_' || i FROM generate_series(1, 100) i), "
                 "attempt = 3 WHERE id = %s", (job_id,))
    claim(conn, postgres, register(conn, "h1"))
    job = river_schema.job(conn, job_id)
    assert job["attempt"] == 4
    assert len(job["attempted_by"]) == 100
    assert job["attempted_by"][0] == "go_2" and job["attempted_by"][-1] == "unitvisor:h1"


# -- refusals: discarded with River's error element ---------------------------------------------------------


def assert_discarded(conn: psycopg.Connection, job_id: int, words: str) -> dict:
    job = river_schema.job(conn, job_id)
    assert job["state"] == "discarded" and job["finalized_at"] is not None
    assert len(job["errors"]) == 1
    error = job["errors"][0]
    assert set(error) == {"at", "attempt", "error", "trace"}
    assert error["attempt"] == job["attempt"] == 1 and error["trace"] == ""
    assert datetime.fromisoformat(error["at"].replace("Z", "+00:00")) > datetime.now(UTC) - timedelta(minutes=5)
    assert words in error["error"], error["error"]
    return error


@pytest.mark.parametrize(("extra", "words"), [
    ({"memory_maxx": 5}, "spec: unknown key 'memory_maxx'"),
    ({"memory_max": -1}, "memory_max"),
    ({"river_job_id": 7}, "river_job_id: set by unitvisor"),
    ({"host_pin": "nowhere"}, "placement: the run cannot be placed: pinned to host nowhere, which is not known"),
])
def test_a_refused_spec_discards_the_job_and_makes_no_run(conn, postgres, platform, extra, words) -> None:
    _, job_id = spawn(conn, extra=extra)
    _, good = spawn(conn)
    claimed = claim(conn, postgres, register(conn, "h1"))
    assert {c.job_id: c.run_id is not None for c in claimed} == {job_id: False, good: True}
    assert_discarded(conn, job_id, words)
    assert run_of(conn, job_id) is None
    assert run_of(conn, good) is not None  # the refusal was its job's alone (a savepoint)


def test_a_spec_function_that_finds_nothing_is_a_refusal(conn, postgres, platform) -> None:
    job_id = river_schema.insert_tx(conn, "tm_spawn_run", {"run_id": "no-such-run"}, queue="spawn")
    claim(conn, postgres, register(conn, "h1"))
    assert_discarded(conn, job_id, "spec: the spec function must return a JSON object")


def test_no_live_host_accepts_it(conn, postgres, platform) -> None:
    _, job_id = spawn(conn, ["/opt/forbidden"])
    claim(conn, postgres, register(conn, "h1", allowed=("/bin/*",)))
    assert_discarded(conn, job_id, "placement: the run cannot be placed: no live host accepts it: executable "
                                   "/opt/forbidden is not allowed (h1)")


def test_a_misconfigured_platform_claims_nothing(conn, postgres, platform) -> None:
    """The daemon's role may not execute the spec function: every job stays available (not discarded)."""
    _, job_id = spawn(conn)
    conn.execute("REVOKE EXECUTE ON FUNCTION platform.unitvisor_spec(jsonb, text, bigint) FROM unitvisor_river, PUBLIC")
    with pytest.raises(store.RiverMisconfigured, match="permission denied for function unitvisor_spec"):
        claim(conn, postgres, register(conn, "h1"))
    job = river_schema.job(conn, job_id)
    assert (job["state"], job["attempt"], job["attempted_by"]) == ("available", 0, None)
    assert run_of(conn, job_id) is None


# -- the finish ------------------------------------------------------------------------------------------


def test_completed_once_the_unit_started(conn, postgres, platform) -> None:
    _, job_id = spawn(conn)
    fence = register(conn, "h1")
    claim(conn, postgres, fence)
    start_unit(conn, fence)
    assert [(f.job_id, f.state, f.written) for f in finish(conn, postgres, fence)] == [
        (job_id, river.Finish.COMPLETED, True)]
    job = river_schema.job(conn, job_id)
    assert (job["state"], job["errors"]) == ("completed", None)
    assert job["finalized_at"] is not None
    assert finish(conn, postgres, fence) == []  # no longer held


def test_discarded_when_the_run_ends_without_starting(conn, postgres, platform) -> None:
    """The start failed (systemd refused the unit): the run ends failed, its River job discarded with why."""
    _, job_id = spawn(conn)
    fence = register(conn, "h1")
    claim(conn, postgres, fence)
    [(_, attempt)] = store.claim(conn, fence, 10, unitspec.UNIT_NAME_FORMAT)
    store.record_outcome(conn, fence, attempt, Outcome("start-failed", None, "systemd refused the unit: no such user"),
                         "failed")
    [done] = finish(conn, postgres, fence)
    assert done.state == river.Finish.DISCARDED
    assert_discarded(conn, job_id, "ended failed without starting")


def test_a_river_cancel_while_held_cancels_the_run(conn, postgres, platform, dsn) -> None:
    _, job_id = spawn(conn)
    fence = register(conn, "h1")
    claim(conn, postgres, fence)
    with store.connect(dsn) as listener:
        store.listen(listener, river.control_channel("river"))
        river_schema.cancel(conn, job_id)
        [note] = wait_notifies(listener)
    assert river.control_cancel(note.payload) == job_id
    [done] = finish(conn, postgres, fence)
    assert done.state == river.Finish.CANCELLED
    job = river_schema.job(conn, job_id)
    assert job["state"] == "cancelled" and "cancelled through River" in job["errors"][0]["error"]
    assert run_of(conn, job_id)["state"] == "cancelled"


def test_a_job_river_took_back_is_left_alone(conn, postgres, platform) -> None:
    """River's rescuer made the held job retryable and a Go client claimed it again (attempt 2): the
    finish of unitvisor's attempt 1 writes nothing."""
    _, job_id = spawn(conn)
    fence = register(conn, "h1")
    claim(conn, postgres, fence)
    conn.execute("UPDATE river.river_job SET attempt = 2, attempted_by = attempted_by || 'go_client'::text "
                 "WHERE id = %s", (job_id,))
    with as_host(conn, postgres, "h1"):
        assert not store.finish_river_job(conn, "river", job_id, 1, river.Finish.COMPLETED, None)
    assert finish(conn, postgres, fence) == []  # not held: its last claimer is someone else
    assert river_schema.job(conn, job_id)["state"] == "running"


def test_a_daemon_killed_between_claim_and_finish_finishes_when_back(conn, postgres, platform, dsn) -> None:
    """The claim commits on one session, which dies (kill -9 of the daemon); the run starts; the next
    session of the same host (the daemon restarted) finishes the job at its reconcile pass."""
    _, job_id = spawn(conn)
    with store.connect(dsn) as first:
        fence = register(first, "h1")
        claim(first, postgres, fence)
        pid = first.info.backend_pid
    # Its host lock goes with its server process, which ends after the client has closed (the
    # fresh-clone run's loaded machine registered again before that: "held by another live daemon").
    backend_gone(conn, pid)
    assert river_schema.job(conn, job_id)["state"] == "running"
    fence = register(conn, "h1")
    start_unit(conn, fence)
    [done] = finish(conn, postgres, fence)
    assert done.state == river.Finish.COMPLETED
    assert river_schema.job(conn, job_id)["state"] == "completed"


def test_a_claim_rolled_back_leaves_no_run_and_the_job_available(conn, postgres, platform, dsn) -> None:
    """The claim and the run are one transaction: a session killed inside it leaves nothing behind."""
    _, job_id = spawn(conn)
    with store.connect(dsn) as victim:
        fence = register(victim, "h1")
        pid = victim.info.backend_pid
        conn.execute(sql.SQL("CREATE OR REPLACE FUNCTION platform.unitvisor_spec(job_args jsonb, job_kind text, "
                             "job_id bigint) RETURNS jsonb LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(30); "
                             "RETURN '{{}}'; END $$"))
        killer = threading.Timer(1.0, lambda: conn.execute("SELECT pg_terminate_backend(%s)", (pid,)))
        killer.start()
        with pytest.raises(store.CONNECTION_LOST):
            riversource.claim(victim, fence, SETTINGS, 10)
        killer.join()
    job = river_schema.job(conn, job_id)
    assert (job["state"], job["attempt"]) == ("available", 0)
    assert run_of(conn, job_id) is None


# -- schema versions -------------------------------------------------------------------------------------


def test_the_supported_version_is_served(conn, platform) -> None:
    assert riversource.check_schema(conn, SETTINGS) is None


def test_an_unknown_version_is_refused(conn, platform) -> None:
    conn.execute("INSERT INTO river.river_migration (line, version) VALUES ('main', 8)")
    problem = riversource.check_schema(conn, SETTINGS)
    assert problem is not None and "River schema version 8 is not one this unitvisor knows (it knows 6, 7)" in problem


def test_no_river_tables_is_refused(conn) -> None:
    problem = riversource.check_schema(conn, SETTINGS)
    assert problem is not None and "no table river.river_migration" in problem


# -- two hosts, one queue ----------------------------------------------------------------------------------


def test_two_hosts_claiming_one_queue_claim_each_job_once(conn, postgres, platform, dsn) -> None:
    jobs = [spawn(conn)[1] for _ in range(40)]
    taken: dict[str, list[int]] = {"h1": [], "h2": []}
    with store.connect(dsn) as c2:
        fences = {"h1": register(conn, "h1"), "h2": register(c2, "h2")}
        conns = {"h1": conn, "h2": c2}
        for host in fences:  # bind each host's role before the race (a binding commits on its own session)
            bind_river_host(conns[host], postgres, host)
        barrier = threading.Barrier(2)

        def worker(host: str) -> None:
            barrier.wait()
            while True:
                claimed = claim(conns[host], postgres, fences[host], limit=3)
                if not claimed:
                    return
                taken[host].extend(c.job_id for c in claimed)

        threads = [threading.Thread(target=worker, args=(h,)) for h in fences]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    every = taken["h1"] + taken["h2"]
    assert sorted(every) == sorted(jobs)  # each once, none twice, none left
    assert conn.execute("SELECT count(*), count(DISTINCT river_job_id) FROM unitvisor.runs").fetchone() == (40, 40)
    by = dict(conn.execute("SELECT id, attempted_by[1] FROM river.river_job").fetchall())
    assert {j for j in jobs if by[j] == "unitvisor:h1"} == set(taken["h1"])


# -- docs/river.md's psql example ---------------------------------------------------------------------------


def test_the_documented_psql_example_runs_and_prints_what_the_docs_show(conn, postgres) -> None:
    assert_example_prints_its_out(postgres, conn.info.dbname, REPO / "docs" / "examples" / "river.sql")
    assert conn.execute("SELECT state, river_job_id FROM unitvisor.runs").fetchall() == [("cancelled", 42)]


def test_the_jobs_of_a_host_declared_dead_are_finished_by_a_live_one(conn, postgres, platform, dsn) -> None:
    _, job_id = spawn(conn)
    with store.connect(dsn) as c1:
        claim(c1, postgres, register(c1, "h1"))
    conn.execute("UPDATE unitvisor.hosts SET state = 'dead', dead_reason = 'test' WHERE id = 'h1'")
    fence = register(conn, "h2")
    assert finish(conn, postgres, fence) == []  # held by the dead host, its run not started yet
    start_unit(conn, fence)  # the fleet places the run elsewhere
    [done] = finish(conn, postgres, fence)
    assert (done.job_id, done.state) == (job_id, river.Finish.COMPLETED)
    assert river_schema.job(conn, job_id)["attempted_by"] == ["unitvisor:h1"]  # River's record of who claimed


def test_a_river_schema_the_role_may_not_read_is_a_problem_not_an_error(conn, postgres, platform) -> None:
    conn.execute("REVOKE SELECT ON river.river_migration FROM unitvisor_river")
    register(conn, "h1")
    with as_host(conn, postgres, "h1"):
        problem = riversource.check_schema(conn, SETTINGS)
    assert problem is not None and "cannot read river.river_migration: permission denied" in problem


# -- who may make runs from River jobs (review finding 1) ---------------------------------------------------


# Each River function, with arguments that would pass its fence: a plain host role is refused before it.
RIVER_CALLS = {
    "submit": "SELECT unitvisor.submit_river_run(%s, %s, '{\"argv\": [\"/bin/true\"]}', 12345)",
    "runs": "SELECT * FROM unitvisor.river_runs(%s, %s, ARRAY[12345]::bigint[])",
    "cancel": "SELECT * FROM unitvisor.cancel_river_run(%s, %s, 12345)",
}


@pytest.mark.parametrize("statement", RIVER_CALLS.values(), ids=RIVER_CALLS.keys())
def test_a_host_role_without_unitvisor_river_may_not_call_the_river_functions(conn, postgres, statement) -> None:
    """A host's DSN alone must not create runs (README, Roles): only a member of unitvisor_river may."""
    fence = register(conn, "plain-host")  # a host id no test grants unitvisor_river to
    with session_as(conn, bind_host_role(conn, postgres, "plain-host")):
        with pytest.raises(psycopg.Error) as caught, conn.transaction():
            conn.execute(statement, (fence.host_id, fence.epoch))
        assert caught.value.sqlstate == "42501", f"{caught.value.sqlstate}: {caught.value}"
        assert "permission denied for function" in str(caught.value)
    assert conn.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0] == 0


def test_a_member_of_unitvisor_river_makes_the_run(conn, postgres) -> None:
    """The same call as the refused one above, by a host granted unitvisor_river: the grant is enough."""
    fence = register(conn, "h1")
    with as_host(conn, postgres, "h1"):
        run_id = conn.execute("SELECT unitvisor.submit_river_run(%s, %s, '{\"argv\": [\"/bin/true\"]}', 12345)",
                              (fence.host_id, fence.epoch)).fetchone()[0]
    assert conn.execute("SELECT river_job_id FROM unitvisor.runs WHERE id = %s", (run_id,)).fetchone() == (12345,)


def test_a_river_host_without_unitvisor_river_is_told_at_connect(conn, postgres, platform) -> None:
    """The daemon's connect check (riversource.check_schema): a problem naming the role and the GRANT,
    not an error, so that the daemon goes on with its own runs."""
    register(conn, "plain-host")
    role = bind_host_role(conn, postgres, "plain-host")
    with session_as(conn, role):
        problem = riversource.check_schema(conn, SETTINGS)
    assert problem == (f"[river]: role {role} is not a member of unitvisor_river, which may create runs from River "
                       f"jobs: GRANT unitvisor_river TO {role} (docs/river.md, Privileges)")
    with as_host(conn, postgres, "h1"):
        assert riversource.check_schema(conn, SETTINGS) is None  # granted, and River's tables readable
