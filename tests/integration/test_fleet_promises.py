"""Issue 21, the fleet's own promises (sql/013_fleet_promises.sql), against the real schema: a host id
held through a restart, "dead" decided by the database's clock, who may settle an attempt, a claim only
by a live host, submission order within a concurrency key, and durations on one clock.

Each test here failed on the schema before 013 (the commit that added it says how), but those marked
as proofs: they show a promise that already held (a fenced host's claim), so that it stays.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.config import Settings
from supervisor.model import Attempt
from supervisor.outcomes import Outcome
from supervisor.reconciler import Reconciler
from supervisor.systemd import Systemd
from tests.integration.conftest import backend_gone, connected, host_profile, register, silence
from tests.integration.test_migrate_operations import sql_dir_up_to

pytestmark = pytest.mark.usefixtures("as_bound_roles")

FMT = unitspec.UNIT_NAME_FORMAT
WEEK = timedelta(days=7)
SUCCEEDED = Outcome("success", "exit:0", "exited 0")
LOST = Outcome("lost", None, "host h1 was silent for 120s (its host_dead_after is 60s); declared dead by host h2")
DENIED = psycopg.errors.InsufficientPrivilege


@contextmanager
def connection(dsn: str) -> Iterator[psycopg.Connection]:
    """Another daemon's session, with a statement_timeout short enough that a hang fails instead."""
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        yield other


def started_run(conn: psycopg.Connection, fence: store.Fence, retry_on: list[str] | None = None,
                **values: Any) -> tuple[uuid.UUID, Attempt]:
    run_id = store.submit_run(conn, argv=["/bin/true"], **values)
    if retry_on is not None:  # (store.submit_run has no retry_on; submit_run does)
        conn.execute("UPDATE unitvisor.runs SET retry_on = %s WHERE id = %s", (retry_on, run_id))
    [(_, attempt)] = store.claim(conn, fence, 1, FMT)
    assert attempt.run_id == run_id
    store.mark_started(conn, fence, attempt, f"inv-{run_id.hex[:8]}")
    return run_id, attempt


def host_row(conn: psycopg.Connection, host_id: str) -> dict[str, Any]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("SELECT * FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone()


# -- 1. a host id is held through a restart ---------------------------------------------------------


def restart_with_a_run_open(conn: psycopg.Connection, dsn: str) -> tuple[store.Fence, Attempt]:
    """h1 of instance A with a run running, stopped cleanly (`systemctl restart`'s first half): its row is
    `stopped`, its session and host lock are gone, its run goes on."""
    a = store.connect(dsn)
    fence = register(a, "h1", instance="A")
    _, attempt = started_run(a, fence)
    store.mark_host_stopped(a, fence)
    pid = a.info.backend_pid
    a.close()
    backend_gone(conn, pid)
    assert host_row(conn, "h1")["state"] == "stopped"
    return fence, attempt


def test_a_clone_cannot_take_the_id_while_its_host_restarts_with_runs_open(conn: psycopg.Connection,
                                                                             dsn: str) -> None:
    fence, attempt = restart_with_a_run_open(conn, dsn)
    with connection(dsn) as clone:
        refused = store.register_host(clone, host_profile("h1", instance="B"))
        assert not refused.registered and refused.epoch is None, refused
        assert "held by instance A" in refused.detail and "stopped with 1 attempt(s) open" in refused.detail
        assert "may take it once it has been silent for its host_dead_after (60 s)" in refused.detail
        # Asked again a moment later, it is told the same (STATUS= and the journal do not churn).
        assert store.register_host(clone, host_profile("h1", instance="B")).detail == refused.detail
    row = host_row(conn, "h1")
    assert (row["instance"], row["epoch"], row["state"]) == ("A", fence.epoch, "stopped")
    assert "instance B" in row["conflict_detail"]
    # The real daemon comes back at once, with its epoch, and settles its own run.
    with connection(dsn) as a:
        again = store.register_host(a, host_profile("h1", instance="A"))
        assert (again.registered, again.epoch) == (True, fence.epoch)
        assert store.record_outcome(a, fence, attempt, SUCCEEDED, "succeeded")


def test_a_rebooted_host_with_runs_open_takes_its_id_back_after_host_dead_after(conn: psycopg.Connection,
                                                                                  dsn: str) -> None:
    # After a reboot the same machine is another instance (a new boot id): it waits as a clone would,
    # and then has its runs back to settle (no peer declared it dead meanwhile: a host alone).
    fence, attempt = restart_with_a_run_open(conn, dsn)
    with connection(dsn) as rebooted:
        assert not store.register_host(rebooted, host_profile("h1", instance="A-after-reboot")).registered
        silence(conn, "h1", 61)
        taken = store.register_host(rebooted, host_profile("h1", instance="A-after-reboot"))
        assert (taken.registered, taken.state, taken.detail) == (True, "active", "took over the id from instance A")
        assert taken.epoch > fence.epoch
        new = store.Fence("h1", taken.epoch)
        assert [a.attempt for _, a in store.open_attempts(rebooted, "h1")] == [attempt.attempt]
        assert store.record_outcome(rebooted, new, attempt, Outcome("lost", None, "the host rebooted"), "failed")
        with pytest.raises(store.Fenced):
            store.probe(conn, fence, WEEK)


def take_over(conn: psycopg.Connection, instance: str) -> tuple[store.Registration, int]:
    """What the daemon's registration does (Daemon._register): register_host and, when it took the id
    from another instance, that instance's open attempts settled, in one transaction."""
    with conn.transaction():
        taken = store.register_host(conn, host_profile("h1", instance=instance))
        settled = 0
        if taken.taken_from is not None:
            # Settling touches no unit (the attempts were another machine's): systemd is never connected.
            rec = Reconciler(Settings(), store.Fence("h1", taken.epoch), conn, Systemd())
            settled = rec.take_over_id(taken.taken_from, instance)
    return taken, settled


def test_an_instance_that_takes_a_silent_id_over_settles_its_open_attempts_lost(conn: psycopg.Connection,
                                                                                 dsn: str) -> None:
    """Issue 21 (the model's TAKEOVER): instance A claimed two runs, started one, and went silent with
    the other claimed but not started (A may have started its unit just before the silence). After
    host_dead_after instance B (a clone, or A's machine after a reboot) takes the id: both attempts
    are settled `lost` in the same transaction, each run moved on by its own policy, so that nothing
    of A's is left open for B's reconcile pass to start a second time. Before, both stayed open."""
    a = store.connect(dsn)
    fence = register(a, "h1", instance="A")
    started, started_attempt = started_run(a, fence, max_attempts=2)
    # count_lost (schema 27): a lost attempt uses up its one attempt, as every lost attempt did before
    claimed = store.submit_run(a, argv=["/bin/true"], max_attempts=1, count_lost=True)
    [(_, claimed_attempt)] = store.claim(a, fence, 1, FMT)
    pid = a.info.backend_pid
    a.close()  # A goes silent with both open (a power cut: no clean stop)
    backend_gone(conn, pid)
    silence(conn, "h1", 61)
    with connection(dsn) as b:
        taken, settled = take_over(b, "B")
        assert (taken.registered, taken.taken_from, settled) == (True, "A", 2), taken
        assert store.open_attempts(b, "h1") == []  # nothing for B's reconcile pass to start or adopt
    rows = {(a.run_id, a.attempt): a for run_id in (started, claimed) for a in store.get_attempts(conn, run_id)}
    for attempt in (started_attempt, claimed_attempt):
        row = rows[(attempt.run_id, attempt.attempt)]
        assert row.outcome == "lost" and row.exit_status is None, row
        assert "taken over by instance B from instance A" in row.reason, row.reason
    # Each run by its own policy: attempts left, retried (as a new attempt, another unit); none, failed.
    assert store.get_run(conn, started).state == "queued"
    assert store.get_run(conn, claimed).state == "failed"
    with pytest.raises(store.Fenced):  # A's epoch is over: it writes nothing more
        store.probe(conn, fence, WEEK)


def test_a_restart_of_the_same_instance_takes_nothing_over(conn: psycopg.Connection, dsn: str) -> None:
    """A daemon restarted on the same machine in the same boot adopts its runs, as before."""
    fence, attempt = restart_with_a_run_open(conn, dsn)
    with connection(dsn) as again:
        taken, settled = take_over(again, "A")
        assert (taken.registered, taken.taken_from, settled, taken.epoch) == (True, None, 0, fence.epoch)
        assert [a.attempt for _, a in store.open_attempts(again, "h1")] == [attempt.attempt]


def test_a_stopped_host_with_nothing_open_is_anyones_at_once(conn: psycopg.Connection, dsn: str) -> None:
    a = store.connect(dsn)
    fence = register(a, "h1", instance="A")
    store.mark_host_stopped(a, fence)
    pid = a.info.backend_pid
    a.close()
    backend_gone(conn, pid)
    with connection(dsn) as b:
        taken = store.register_host(b, host_profile("h1", instance="B"))
        assert (taken.registered, taken.detail) == (True, "took over the id from instance A")


# -- 2. the database decides "dead" from its own clock ------------------------------------------------


def test_a_declarer_is_connected_for_as_long_as_its_registration_is_old(conn: psycopg.Connection,
                                                                           dsn: str) -> None:
    declarer = register(conn, "declarer")
    with connection(dsn) as other:
        register(other, "x", dead_after=60.0)
        silence(conn, "x", 1000)
        # Registered a moment ago: whatever it says of itself, it has not been connected for 60 s.
        assert store.declare_dead_hosts(conn, declarer, connected_for=1e9) == []
        connected(conn, "declarer", 59)
        assert store.declare_dead_hosts(conn, declarer, connected_for=1e9) == []
        assert host_row(conn, "x")["state"] == "active"
        connected(conn, "declarer", 61)
        # The caller's own figure still counts when it is the lower (0.5.x daemons pass theirs).
        assert store.declare_dead_hosts(conn, declarer, connected_for=30) == []
        assert [d.host_id for d in store.declare_dead_hosts(conn, declarer, connected_for=1e9)] == ["x"]


def test_a_registration_again_starts_the_count_again(conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "declarer")
    connected(conn, "declarer", 3600)
    with connection(dsn) as other:
        register(other, "x")
        silence(conn, "x", 1000)
        register(conn, "declarer")  # a reconnect: the daemon registers again
        assert store.declare_dead_hosts(conn, declarer, connected_for=3600) == []


def test_a_declarer_that_is_not_live_itself_declares_nothing(conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "declarer")
    connected(conn, "declarer")
    with connection(dsn) as other:
        register(other, "x")
        silence(conn, "x", 1000)
        silence(conn, "declarer", 61)  # itself past its host_dead_after: any peer may declare it
        assert store.declare_dead_hosts(conn, declarer, 3600) == []
        store.probe(conn, declarer, WEEK)  # heard from again
        assert [d.host_id for d in store.declare_dead_hosts(conn, declarer, 3600)] == ["x"]


# -- 3. who may settle an attempt ---------------------------------------------------------------------


@pytest.fixture
def dead_h1(conn: psycopg.Connection, dsn: str) -> Iterator[tuple[psycopg.Connection, store.Fence, dict]]:
    """h1 with open attempts of several policies, declared dead by h2 (committed, not settled yet);
    yields h2's connection and fence, and the attempts by name."""
    h1 = register(conn, "h1")
    attempts = {
        "retry": started_run(conn, h1, max_attempts=3)[1],
        "last": started_run(conn, h1, max_attempts=1, count_lost=True)[1],  # its lost attempt counts
        "at-most-once": started_run(conn, h1, max_attempts=3, retry_on=["exit-code"])[1],
        "cancel": started_run(conn, h1, max_attempts=3)[1],
    }
    store.cancel_run(conn, attempts["cancel"].run_id)
    with connection(dsn) as other:
        h2 = register(other, "h2")
        connected(conn, "h2")
        silence(conn, "h1", 120)
        assert [d.host_id for d in store.declare_dead_hosts(other, h2, 3600)] == ["h1"]
        yield other, h2, attempts


@pytest.mark.parametrize(("name", "outcome", "next_state", "delay"), [
    ("retry", SUCCEEDED, "succeeded", None),                                  # history invented
    ("retry", Outcome("exit-code", "exit:1", "exited 1"), "failed", None),
    ("retry", Outcome("lost", "exit:0", "lost"), "queued", timedelta(0)),     # lost, with an exit status
    ("retry", LOST, "succeeded", None),                                       # lost, the run succeeded
    ("retry", Outcome("cancelled", None, "cancelled"), "cancelled", None),    # nobody asked for a cancel
])
def test_a_peer_may_not_settle_a_dead_hosts_attempt_as_it_likes(conn: psycopg.Connection, dead_h1, name: str,
                                                                 outcome: Outcome, next_state: str,
                                                                 delay: timedelta | None) -> None:
    other, h2, attempts = dead_h1
    with pytest.raises(DENIED, match="may not settle attempt"):
        store.record_outcome(other, h2, attempts[name], outcome, next_state, delay)
    assert [a.outcome for a in store.get_attempts(conn, attempts[name].run_id)] == [None]
    assert store.get_run(conn, attempts[name].run_id).state == "running"


@pytest.mark.parametrize(("name", "proposed", "delay", "decided"), [
    ("retry", "failed", None, "queued"),               # its policy retries it
    ("last", "queued", timedelta(0), "failed"),        # an attempt it does not have
    ("at-most-once", "queued", timedelta(0), "failed"),  # lost is not in its retry_on
])
def test_the_database_decides_what_a_peers_lost_does_to_the_run(conn: psycopg.Connection, dead_h1, name: str,
                                                                 proposed: str, delay: timedelta | None,
                                                                 decided: str) -> None:
    """Schema 27: a peer proposes queued or failed, and the run's failure rules decide (until then a
    proposal against the policy was refused: now a 0.8.0 peer, which counts every lost attempt,
    settles a run whose lost attempts do not count, and the database retries it)."""
    other, h2, attempts = dead_h1
    assert store.record_outcome(other, h2, attempts[name], LOST, proposed, delay)
    assert store.get_run(conn, attempts[name].run_id).state == decided


def test_a_live_peer_records_the_documented_lost(conn: psycopg.Connection, dead_h1) -> None:
    other, h2, attempts = dead_h1
    expected = {"retry": ("queued", timedelta(seconds=5)), "last": ("failed", None),
                "at-most-once": ("failed", None)}
    for name, (next_state, delay) in expected.items():
        assert store.record_outcome(other, h2, attempts[name], LOST, next_state, delay), name
        assert store.get_run(conn, attempts[name].run_id).state == next_state
    # A cancel requested: `cancelled` (what 0.5.x records), or `lost` ending it cancelled.
    assert store.record_outcome(other, h2, attempts["cancel"], Outcome("cancelled", None, "cancel requested"),
                                "cancelled")
    assert store.get_run(conn, attempts["cancel"].run_id).state == "cancelled"


def test_a_peer_that_is_not_live_settles_nothing(conn: psycopg.Connection, dead_h1) -> None:
    other, h2, attempts = dead_h1
    silence(conn, "h2", 61)
    with pytest.raises(DENIED, match="it is not live itself"):
        store.record_outcome(other, h2, attempts["last"], LOST, "failed")
    conn.execute("UPDATE unitvisor.hosts SET heartbeat_at = now(), state = 'stopped' WHERE id = 'h2'")
    with pytest.raises(DENIED, match="it is not live itself"):
        store.record_outcome(other, h2, attempts["last"], LOST, "failed")
    assert store.get_attempts(conn, attempts["last"].run_id)[0].outcome is None


def test_the_owner_still_settles_its_own_attempt_as_it_ended(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    _, attempt = started_run(conn, h1)
    assert store.record_outcome(conn, h1, attempt, SUCCEEDED, "succeeded")


# -- 4. a claim only by a live host -------------------------------------------------------------------


def test_a_host_declared_dead_or_whose_id_was_taken_cannot_claim(conn: psycopg.Connection, dsn: str) -> None:
    # A proof: check_fence refused these before 013 already.
    h1 = register(conn, "h1", instance="A")
    store.submit_run(conn, argv=["/bin/true"])
    with connection(dsn) as other:
        h2 = register(other, "h2")
        connected(conn, "h2")
        silence(conn, "h1", 120)
        assert [d.host_id for d in store.declare_dead_hosts(other, h2, 3600)] == ["h1"]
        with pytest.raises(store.Fenced):
            store.claim(conn, h1, 10, FMT)
    taken = register(conn, "h1", instance="A")  # rejoined: the old epoch is over
    with pytest.raises(store.Fenced):
        store.claim(conn, h1, 10, FMT)
    assert len(store.claim(conn, taken, 10, FMT)) == 1


def test_a_host_silent_past_its_host_dead_after_claims_nothing_until_heard_from(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    run_id = store.submit_run(conn, argv=["/bin/true"])
    silence(conn, "h1", 61)  # any peer may declare it dead now
    assert store.claim(conn, h1, 10, FMT) == []
    store.probe(conn, h1, WEEK)  # its heartbeat
    assert [a.run_id for _, a in store.claim(conn, h1, 10, FMT)] == [run_id]


# -- 5. submission order ------------------------------------------------------------------------------


def submit_in_one_transaction(conn: psycopg.Connection, count: int, **values: Any) -> list[uuid.UUID]:
    with conn.transaction():
        return [store.submit_run(conn, argv=["/bin/true", str(n)], **values) for n in range(1, count + 1)]


def test_runs_of_one_key_submitted_in_one_transaction_run_in_submission_order(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    for round_ in range(25):  # before 013, six runs came out in order once in 720 times
        key = f"steps-{round_}"
        run_ids = submit_in_one_transaction(conn, 6, concurrency_key=key, labels={"round": str(round_)})
        order = []
        for _ in run_ids:
            [(run, attempt)] = store.claim(conn, h1, 10, FMT)
            order.append(run_ids.index(run.id) + 1)
            assert store.record_outcome(conn, h1, attempt, SUCCEEDED, "succeeded")
        assert order == [1, 2, 3, 4, 5, 6], f"round {round_}"
        # Listings newest first are in submission order backwards.
        assert [s.id for s in store.runs_with_labels(conn, {"round": str(round_)})] == run_ids[::-1]
        listed = [r["id"] for r in store.list_runs(conn, labels={"round": str(round_)})]
        assert listed == run_ids[::-1]


def test_a_run_from_before_the_sequence_goes_first(conn: psycopg.Connection) -> None:
    # A run finished before 013 has no number; resumed, it keeps its place ahead of every later run.
    h1 = register(conn, "h1")
    old, new = submit_in_one_transaction(conn, 2, concurrency_key="k")
    conn.execute("UPDATE unitvisor.runs SET seq = NULL, created_at = created_at - interval '1 day' WHERE id = %s",
                 (old,))
    [(run, _)] = store.claim(conn, h1, 10, FMT)
    assert run.id == old


def test_the_migration_numbers_live_runs_in_created_at_order(empty_dsn: str, tmp_path: Path) -> None:
    with store.connect(empty_dsn) as conn:
        store.migrate(conn, sql_dir_up_to(tmp_path, 12))
        ids = [store.submit_run(conn, argv=["/bin/true"], concurrency_key="k") for _ in range(3)]
        done = store.submit_run(conn, argv=["/bin/true"])
        conn.execute("UPDATE unitvisor.runs SET state = 'succeeded', finished_at = now() WHERE id = %s", (done,))
        store.migrate(conn)
        seqs = dict(conn.execute("SELECT id, seq FROM unitvisor.runs").fetchall())
        assert seqs[done] is None
        assert sorted(ids, key=lambda i: seqs[i]) == ids
        later = store.submit_run(conn, argv=["/bin/true"], concurrency_key="k")
        assert conn.execute("SELECT seq FROM unitvisor.runs WHERE id = %s", (later,)).fetchone()[0] > max(
            seqs[i] for i in ids)


# -- 6. durations on one clock ------------------------------------------------------------------------


def running_for_five_seconds(conn: psycopg.Connection) -> tuple[store.Fence, Attempt]:
    """A run whose unit started 5 s ago by the database's clock (the start the daemon records)."""
    fence = register(conn, "h1")
    _, attempt = started_run(conn, fence)
    conn.execute("UPDATE unitvisor.attempts SET claimed_at = claimed_at - interval '6 s', "
                 "started_at = started_at - interval '5 s' WHERE run_id = %s", (attempt.run_id,))
    return fence, attempt


def duration(conn: psycopg.Connection, attempt: Attempt) -> float:
    return conn.execute("SELECT extract(epoch FROM ended_at - started_at)::float8 FROM unitvisor.attempts "
                        "WHERE run_id = %s", (attempt.run_id,)).fetchone()[0]


def db_now(conn: psycopg.Connection) -> datetime:
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]


RECORD = ("SELECT unitvisor.record_outcome(%s, %s, %s, %s, 'exit-code', 'exit:1', 'exited 1', 'failed', NULL, "
          "'inv', %s, %s, NULL, NULL, NULL, NULL{})")


@pytest.mark.parametrize("skew", [-30.0, 30.0])
def test_a_host_whose_clock_is_off_records_the_duration_it_measured(conn: psycopg.Connection, skew: float) -> None:
    fence, attempt = running_for_five_seconds(conn)
    host_now = db_now(conn) + timedelta(seconds=skew)  # the run ends now, by the host's clock
    # As the host's daemon sends it, with its own clock (store.host_clock), read as the run ended.
    conn.execute(RECORD.format(", %s"), (attempt.run_id, attempt.attempt, fence.host_id, fence.epoch,
                                         host_now - timedelta(seconds=5), host_now, host_now))
    assert 5.0 <= duration(conn, attempt) < 6.0


@pytest.mark.parametrize("skew", [-30.0, 30.0])
def test_an_old_daemon_with_a_clock_off_never_records_a_negative_or_future_duration(
        conn: psycopg.Connection, skew: float) -> None:
    # 0.5.x sends no clock: its reading is kept within the attempt's start and the recording.
    fence, attempt = running_for_five_seconds(conn)
    host_now = db_now(conn) + timedelta(seconds=skew)
    conn.execute(RECORD.format(""), (attempt.run_id, attempt.attempt, fence.host_id, fence.epoch,
                                     host_now - timedelta(seconds=5), host_now))
    took = duration(conn, attempt)
    assert 0.0 <= took < 6.0
    if skew > 0:
        assert took >= 5.0  # ahead: the end is the recording's moment


def test_the_store_sends_its_clock_and_a_true_clock_keeps_systemds_times(conn: psycopg.Connection) -> None:
    fence, attempt = running_for_five_seconds(conn)
    started = store.get_attempts(conn, attempt.run_id)[0].started_at
    ended = started + timedelta(seconds=4, microseconds=123456)
    assert store.record_outcome(conn, fence, attempt, SUCCEEDED, "succeeded", started_at=started, ended_at=ended)
    [row] = store.get_attempts(conn, attempt.run_id)
    assert (row.started_at, row.ended_at) == (started, ended)

