"""Concurrency limits on two test bed hosts sharing one PostgreSQL, each with a real unitvisor.service
(sql/migrations/032_concurrency_limits.sql): a named limit of 2 and a key's concurrency_limit of 2, each
over runs pinned alternately to the two hosts, so that each host always has a run it could start but
for the limit. Never three live at once, from the attempts' own start and exit times (systemd's); the
limit is reached (two at once); a run held back says which limit in its wait reason."""

from __future__ import annotations

import json

import psycopg
from psycopg.types.json import Jsonb

from tests.harness.fleet import submit_many
from tests.harness.host import Host, wait_for
from tests.system.test_lifecycle import HOSTS, sql, two_hosts

LIMIT = 2


def submit(dsn: str, count: int, **args: object) -> list[str]:
    """`count` runs of 3 s, pinned alternately to the two hosts."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [str(submit_many(conn, ["/bin/sleep", "3"], 1, host_pin=HOSTS[n % 2], **args)[0])
                for n in range(count)]


def wait_for_reason(hosts: list[Host], run_id: str, reason: str) -> None:
    """Until `show` on the run's host says `reason` (the start of it) as its wait reason now, or as one
    of its events; else fails with what it says and the daemons' logs."""
    def said() -> bool:
        shown = hosts[1].show(run_id)
        return (shown["wait_reason"] or "").startswith(reason) or any(
            (e["reason"] or "").startswith("waiting: " + reason) for e in shown["events"])
    try:
        wait_for(said, timeout=60, what=f"run {run_id}'s wait reason to be {reason!r}")
    except AssertionError as exc:
        logs = "\n".join(f"== {host.host_id}\n{host.daemon_log()}" for host in hosts)
        raise AssertionError(f"{exc}\n{hosts[1].show(run_id)}\n{logs}") from None


def most_live_at_once(dsn: str, run_ids: list[str]) -> tuple[int, set[str]]:
    """The most attempts of these runs that ran at one instant, by systemd's start and exit times (one
    machine clock), and the hosts they ran on."""
    rows = sql(dsn, "SELECT host_id, started_at, ended_at FROM unitvisor.attempts WHERE run_id = ANY(%s::uuid[])",
               (run_ids,))
    assert len(rows) == len(run_ids) and all(r[1] and r[2] for r in rows), rows
    most = max(sum(1 for _, started, ended in rows if started <= at < ended) for _, at, _ in rows)
    return most, {r[0] for r in rows}


def test_a_limit_of_two_is_never_passed_across_two_hosts(dsn: str) -> None:
    with two_hosts(dsn, prefix="uv-limits") as hosts:
        sql(dsn, "SELECT unitvisor.set_limit('batch', '{\"team\": \"batch\"}', %s)", (LIMIT,))
        named = submit(dsn, 8, labels=Jsonb({"team": "batch"}))
        # A run held back names the limit (explain_waiting, after two poll intervals) and the CLI counts it.
        # Read from its history too, not only its wait reason of the moment: a reason is cleared again
        # whenever a pass finds one of the two live runs just ended, and on a loaded machine a poll of the
        # CLI (seconds each) may fall in those gaps only.
        wait_for_reason(hosts, named[-1], "limit batch: 2 of 2 live")
        listed = json.loads(hosts[0].cli("limits", "--json").stdout)
        assert [(r["name"], r["max_live"]) for r in listed] == [("batch", LIMIT)] and listed[0]["live"] <= LIMIT
        for run_id in named:
            assert hosts[0].wait_run(run_id, timeout=120)["state"] == "succeeded"
        most, used = most_live_at_once(dsn, named)
        assert most == LIMIT and used == set(HOSTS), (most, used)

        keyed = submit(dsn, 5, concurrency_key="imports", concurrency_limit=LIMIT)
        for run_id in keyed:
            assert hosts[1].wait_run(run_id, timeout=120)["state"] == "succeeded"
        most, used = most_live_at_once(dsn, keyed)
        assert most == LIMIT and used == set(HOSTS), (most, used)
        # Claimed in submission order: the order in which each left `queued` (its events' ids, given out
        # under the key's lock), not systemd's start times, which two hosts' daemons set apart by their
        # own delays (the fresh-clone run saw the second run's unit start first, on the other host).
        claimed = [row[0] for row in sql(dsn, "SELECT run_id::text FROM unitvisor.run_events "
                                              "WHERE run_id = ANY(%s::uuid[]) AND state <> 'queued' "
                                              "GROUP BY run_id ORDER BY min(id)", (keyed,))]
        assert claimed == keyed
