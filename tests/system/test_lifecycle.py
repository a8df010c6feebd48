"""When a run may start, on two test bed hosts sharing one PostgreSQL, each with a real
unitvisor.service (sql/006_lifecycle.sql): runs of one concurrency key never overlap across the two
hosts and start in submission order; a run that cannot start by its deadline expires; a not_before
run starts no earlier."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import psycopg

from tests.conftest import _unavailable
from tests.harness import testbed as testbed_mod
from tests.harness.fleet import Fleet, fleet_config, submit_many
from tests.harness.host import Host, wait_for

HOSTS = ("fleet-1", "fleet-2")


@contextlib.contextmanager
def two_hosts(dsn: str, prefix: str = "uv-lifecycle") -> Iterator[list[Host]]:
    """Two hosts polling every second, started; under test bed names of their own (`prefix`: one per
    test module), so that they never meet another test session's fleet on this machine."""
    reason = testbed_mod.available()
    if reason:
        _unavailable(reason)
    testbed_mod.cleanup_stale()
    with Fleet(dsn, size=2, prefix=prefix, configs={h: fleet_config(h) for h in HOSTS}) as fleet:
        for host in fleet.hosts:
            host.start(configure=False)
        yield fleet.hosts


def sql(dsn: str, query: str, params: object = None) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def submit(dsn: str, argv: list[str], **args: object) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return str(submit_many(conn, argv, 1, **args)[0])


def test_runs_of_one_key_never_overlap_across_two_hosts_and_start_in_order(dsn: str) -> None:
    with two_hosts(dsn) as hosts:
        # Pinned alternately to the two hosts, so that each host has a run of the key it could start at
        # once while the other host's runs: only the key holds it back.
        run_ids = [submit(dsn, ["/bin/sleep", "1"], concurrency_key="deploy-prod", host_pin=HOSTS[n % 2])
                   for n in range(4)]
        results = [hosts[0].wait_run(run_id, timeout=90) for run_id in run_ids]
        assert [r["state"] for r in results] == ["succeeded"] * 4, results
        # The times of each attempt are systemd's own (the unit's start and exit), on one machine clock.
        rows = sql(dsn, """SELECT a.run_id::text, a.host_id, a.started_at, a.ended_at FROM unitvisor.attempts a
                           JOIN unitvisor.runs r ON r.id = a.run_id ORDER BY a.started_at""")
        assert [row[0] for row in rows] == run_ids  # one attempt each, started in submission order
        assert [row[1] for row in rows] == [HOSTS[n % 2] for n in range(4)]
        for before, after in zip(rows, rows[1:], strict=False):
            assert after[2] >= before[3], f"run {after[0]} started before run {before[0]} had ended: {rows}"
        waited = sql(dsn, "SELECT count(*) FROM unitvisor.run_events WHERE reason LIKE "
                          "'waiting: waits for run % with the same concurrency key'")
        print(f"4 runs of one key on 2 hosts: {[(r[1], r[2].time(), r[3].time()) for r in rows]}; "
              f"waiting events: {waited[0][0]}")


def test_a_run_expires_at_its_deadline_and_a_not_before_run_starts_no_earlier(dsn: str) -> None:
    with two_hosts(dsn) as hosts:
        holder = submit(dsn, ["/bin/sleep", "300"], concurrency_key="db-migration")
        wait_for(lambda: hosts[1].show(holder)["state"] == "running", timeout=60, what="the key's first run to run")
        # A run no host may run, alone in the queue: no claim ever meets it (the heartbeat tells no host
        # to claim), so only the daemons' fleet upkeep can expire it.
        nowhere = submit(dsn, ["/bin/true"], host_pin="fleet-9",
                         start_deadline=sql(dsn, "SELECT now()")[0][0] + timedelta(seconds=3))
        hosts[1].wait_run(nowhere, timeout=60)
        assert any("runs-expired" in host.daemon_log() for host in hosts)  # the upkeep's event, not a claim's
        # Behind a run of its key that will not end in time; and one that may not start yet.
        now = sql(dsn, "SELECT now()")[0][0]
        behind = submit(dsn, ["/bin/true"], concurrency_key="db-migration", start_deadline=now + timedelta(seconds=3))
        later = submit(dsn, ["/bin/true"], not_before=now + timedelta(seconds=8))
        assert hosts[1].show(later)["wait_reason"].startswith("not before ")

        for run_id in (behind, nowhere):
            data = hosts[1].wait_run(run_id, timeout=60)
            assert data["state"] == "expired" and data["attempts"] == [], data
            assert data["finished_at"] is not None
        expiry = {run_id: hosts[1].show(run_id)["events"][-1] for run_id in (behind, nowhere)}
        assert expiry[behind]["state"] == "expired"
        assert expiry[behind]["reason"].startswith("not started by its start deadline ")
        assert expiry[behind]["reason"].endswith(
            f"it was waiting for run {holder} (running) with the same concurrency key")
        assert expiry[nowhere]["reason"].endswith(
            "it was waiting for pinned to host fleet-9, which is not known (see unitvisor hosts)")
        waited = hosts[0].cli("wait", behind, check=False)
        assert (waited.returncode, waited.stdout.strip()) == (1, f"run {behind} expired")

        data = hosts[1].wait_run(later, timeout=60)
        assert data["state"] == "succeeded", data
        [(claimed, started, not_before)] = sql(
            dsn, """SELECT a.claimed_at, a.started_at, r.not_before FROM unitvisor.attempts a
                    JOIN unitvisor.runs r ON r.id = a.run_id WHERE a.run_id = %s""", (later,))
        assert claimed >= not_before and started >= not_before
        print(f"not_before run claimed {(claimed - not_before).total_seconds():.2f}s after its not_before")
        hosts[1].cli("cancel", holder)

