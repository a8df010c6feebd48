"""The fleet upkeep explains why runs wait again only when something that could change a reason has changed
(sql/migrations/042_explain_when_changed.sql, issue 23, point 4: every poll interval one daemon computed
the same reasons for up to 1,000 waiting runs).

Each change is made the way the product makes it (a registration, a host falling silent, an outcome,
the clock), and the next pass must write the new reason. Rounds are counted by fleet_refusal's calls
(pg_stat_xact_user_functions), not timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest

from supervisor import store
from tests.integration.conftest import age_jobs, calls_during, register, silence
from tests.integration.test_claim_gate import FMT
from tests.integration.test_fleet_sql import submit, wait_reason
from tests.integration.test_work_mark import end

WAITED = timedelta(seconds=1)  # runs wait for longer: each test ages its jobs (age_jobs)


def explain(conn: psycopg.Connection, waited: timedelta = WAITED) -> tuple[int, bool]:
    """One pass, committed (the mark it leaves is what the next one reads): (events written, whether it
    computed the reasons)."""
    written, calls = calls_during(conn, lambda: store.explain_waiting(conn, waited), commit=True)
    return written, "fleet_refusal" in calls


def settled(conn: psycopg.Connection) -> None:
    """Nothing changes: no round more (a round's own `waiting:` events move no mark since 043; before,
    a whole round more followed one that wrote reasons)."""
    assert explain(conn) == (0, False)
    assert explain(conn) == (0, False)


def test_a_round_that_changes_nothing_is_not_made_again(conn: psycopg.Connection) -> None:
    register(conn, "h1", allowed=("/bin/*",))
    runs = [submit(conn, "/opt/x") for _ in range(5)]
    age_jobs(conn)
    assert explain(conn) == (5, True)
    settled(conn)
    assert {wait_reason(conn, run) for run in runs} == {
        "no live host accepts it: executable /opt/x is not allowed (h1)"}
    # Past its bound (15 min_waits after the round started), a round is made whatever the mark.
    conn.execute("UPDATE unitvisor.fleet_upkeep SET explained_until = now()")
    assert explain(conn) == (0, True)


def a_host_that_accepts_it_registers(conn: psycopg.Connection) -> tuple[Callable[[], object], str | None]:
    return (lambda: register(conn, "h2", allowed=("/opt/*",))), None


def the_host_that_refuses_it_falls_silent(conn: psycopg.Connection) -> tuple[Callable[[], object], str | None]:
    return (lambda: silence(conn, "h1", 3600)), "no live host (every host is dead, stopped, draining or silent)"


@pytest.mark.parametrize("change", [a_host_that_accepts_it_registers, the_host_that_refuses_it_falls_silent])
def test_a_host_that_changes_changes_the_reasons(
        conn: psycopg.Connection,
        change: Callable[[psycopg.Connection], tuple[Callable[[], object], str | None]]) -> None:
    register(conn, "h1", allowed=("/bin/*",))
    run = submit(conn, "/opt/x")
    age_jobs(conn)
    assert explain(conn)[1]
    settled(conn)
    assert wait_reason(conn, run) == "no live host accepts it: executable /opt/x is not allowed (h1)"
    make_change, expected = change(conn)
    make_change()
    assert explain(conn)[1]
    assert wait_reason(conn, run) == expected


def test_a_keys_blocker_that_ends_changes_the_reason(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    keyed = "SELECT unitvisor.submit_run(ARRAY[%s], concurrency_key => 'k')"
    conn.execute(keyed, ("/bin/true",))
    [(_, blocker)] = store.claim(conn, h1, 10, FMT)
    waiting = conn.execute(keyed, ("/bin/false",)).fetchone()[0]
    age_jobs(conn)
    assert explain(conn)[1]
    settled(conn)
    assert wait_reason(conn, waiting) == f"waits for run {blocker.run_id} (starting) with the same concurrency key"
    end(conn, h1, blocker)
    assert explain(conn)[1]
    assert wait_reason(conn, waiting) is None  # nothing holds it: the claim takes it


def test_a_run_that_comes_to_have_waited_long_enough_is_explained_without_any_row_changing(
        conn: psycopg.Connection) -> None:
    register(conn, "h1", allowed=("/bin/*",))
    waited = timedelta(seconds=2)
    run = submit(conn, "/opt/x")
    assert explain(conn, waited) == (0, False)  # not yet waited 2 s: not explained (nothing to compute)
    until = conn.execute("SELECT explained_until - now() FROM unitvisor.fleet_upkeep").fetchone()[0]
    assert until <= waited  # the run's own time, not 15 min_waits
    time.sleep(until.total_seconds() + 0.2)
    assert explain(conn, waited) == (1, True)
    assert wait_reason(conn, run) == "no live host accepts it: executable /opt/x is not allowed (h1)"
