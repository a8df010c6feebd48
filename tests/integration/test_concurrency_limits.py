"""Concurrency limits beyond one run per key (schema 032): a key's concurrency_limit, named fleet-wide
limits on label selectors, their wait reasons, claims racing on many sessions, and the CLI."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.model import Attempt
from supervisor.outcomes import Outcome
from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration.conftest import age_jobs, fence_of, register, run_concurrently
from tests.integration.test_sql_api_example import assert_example_prints_its_out

pytestmark = pytest.mark.usefixtures("as_bound_roles")

FMT = unitspec.UNIT_NAME_FORMAT
SUCCESS = Outcome("success", "exit:0", "exited 0")
LIVE = ("starting", "running")


def submit(conn: psycopg.Connection, **values: object) -> uuid.UUID:
    values.setdefault("argv", ["/bin/true"])
    return store.submit_run(conn, **values)


def claim(conn: psycopg.Connection, host: str = "h1", batch: int = 10) -> list[Attempt]:
    return [attempt for _, attempt in store.claim(conn, register(conn, host), batch, FMT)]


def claimed_ids(conn: psycopg.Connection, host: str = "h1", batch: int = 10) -> list[uuid.UUID]:
    return [a.run_id for a in claim(conn, host, batch)]


def finish(conn: psycopg.Connection, attempt: Attempt) -> None:
    store.record_outcome(conn, fence_of(conn, attempt.host_id), attempt, SUCCESS, "succeeded")


def state(conn: psycopg.Connection, run_id: uuid.UUID) -> str:
    return store.get_run(conn, run_id).state


def wait_reason(conn: psycopg.Connection, run_id: uuid.UUID) -> str | None:
    store.explain_waiting(conn, timedelta(0))
    return store.get_run(conn, run_id).wait_reason


def live_count(conn: psycopg.Connection, **where: str) -> int:
    clause, params = "state IN ('starting', 'running')", []
    for column, value in where.items():
        clause += f" AND {'labels @> %s::jsonb' if column == 'labels' else column + ' = %s'}"
        params.append(value)
    return conn.execute(f"SELECT count(*) FROM unitvisor.runs WHERE {clause}", params).fetchone()[0]


# -- a key's concurrency_limit --------------------------------------------------------------------------


def test_a_key_with_a_limit_of_two_runs_two_at_once_in_submission_order(conn: psycopg.Connection) -> None:
    # The second has the higher priority: within a key, submission order still decides.
    runs = [submit(conn, concurrency_key="k", concurrency_limit=2, priority=p) for p in (0, 9, 0)]
    assert store.get_run(conn, runs[0]).concurrency_limit == 2
    # One run of a key per claim: its head.
    first = claim(conn)
    assert [a.run_id for a in first] == [runs[0]]
    second = claim(conn)
    assert [a.run_id for a in second] == [runs[1]]
    assert claim(conn) == [] and state(conn, runs[2]) == "queued"
    assert wait_reason(conn, runs[2]) == (
        f"waits for run {runs[0]} (starting) with the same concurrency key, 2 of 2 live")

    finish(conn, second[0])
    assert claimed_ids(conn) == [runs[2]]
    assert live_count(conn, concurrency_key="k") == 2


def test_the_default_limit_is_one_at_a_time_as_before(conn: psycopg.Connection) -> None:
    first, second = submit(conn, concurrency_key="k"), submit(conn, concurrency_key="k")
    assert store.get_run(conn, first).concurrency_limit == 1
    [attempt] = claim(conn)
    assert claim(conn) == []
    assert wait_reason(conn, second) == f"waits for run {first} (starting) with the same concurrency key"
    finish(conn, attempt)
    assert claimed_ids(conn) == [second]


def test_runs_of_one_key_with_different_limits_keep_the_smallest(conn: psycopg.Connection) -> None:
    """The documented rule (docs/sql-api.md): a run starts only while fewer runs of its key are live than
    the smallest limit among its own and the live runs'. A run that asked for one at a time is never
    joined; a run of limit 1 waits until the key is empty."""
    alone = submit(conn, concurrency_key="k", concurrency_limit=1)
    wide = submit(conn, concurrency_key="k", concurrency_limit=3)
    [alone_attempt] = claim(conn)
    assert claim(conn) == []  # wide allows 3, but the live run allows itself no company
    assert wait_reason(conn, wide) == f"waits for run {alone} (starting) with the same concurrency key"
    finish(conn, alone_attempt)

    wide_too = submit(conn, concurrency_key="k", concurrency_limit=3)
    narrow = submit(conn, concurrency_key="k", concurrency_limit=1)
    assert claimed_ids(conn) == [wide]
    assert claimed_ids(conn) == [wide_too]
    assert claim(conn) == []  # narrow: 2 live, not fewer than its 1
    assert wait_reason(conn, narrow).startswith(f"waits for run {wide} (starting) with the same concurrency key")
    for _, attempt in store.open_attempts(conn, "h1"):
        finish(conn, attempt)
    assert claimed_ids(conn) == [narrow]


def test_a_run_behind_a_held_head_says_the_head_is_held(conn: psycopg.Connection) -> None:
    head = submit(conn, concurrency_key="k", hold=True)
    behind = submit(conn, concurrency_key="k")
    held_by = store.hold_of(conn, head)[1]
    assert claim(conn) == []
    assert wait_reason(conn, behind) == (
        f"waits for run {head} (queued, held by {held_by}) with the same concurrency key")


@pytest.mark.parametrize(("values", "message"), [
    ({"concurrency_key": "k", "concurrency_limit": 0}, r"concurrency_limit: 0 is out of range \(1 to 10000\)"),
    ({"concurrency_key": "k", "concurrency_limit": 10001}, r"concurrency_limit: 10001 is out of range"),
    ({"concurrency_limit": 2}, r"concurrency_limit: needs concurrency_key"),
])
def test_a_bad_concurrency_limit_is_refused_by_name(conn: psycopg.Connection, values: dict, message: str) -> None:
    with pytest.raises(store.DatabaseError, match=message + r".*\(runs_concurrency_limit_valid\)"):
        submit(conn, **values)


def test_a_null_concurrency_limit_is_refused_by_name(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.NotNullViolation, match="concurrency_limit: must not be NULL"):
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], concurrency_key => 'k', "
                     "concurrency_limit => NULL)")


def test_an_update_to_a_bad_concurrency_limit_is_refused_by_the_trigger(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    with pytest.raises(psycopg.errors.CheckViolation, match="concurrency_limit: needs concurrency_key"):
        conn.execute("UPDATE unitvisor.runs SET concurrency_limit = 5 WHERE id = %s", (run_id,))


# -- named limits -------------------------------------------------------------------------------------


def test_set_change_list_and_drop_a_limit(conn: psycopg.Connection) -> None:
    assert store.set_limit(conn, "batch", {"team": "batch"}, 20) is True
    assert store.set_limit(conn, "batch", {"team": "batch"}, 2) is False
    [row] = store.list_limits(conn)
    assert (row["name"], row["selector"], row["max_live"], row["live"]) == ("batch", {"team": "batch"}, 2, 0)
    assert row["set_by"]
    assert store.drop_limit(conn, "batch") is True
    assert store.drop_limit(conn, "batch") is False
    assert store.list_limits(conn) == []


@pytest.mark.parametrize(("name", "selector", "max_live", "message"), [
    ("-bad", {"team": "x"}, 1, "name: must be 1 to 63 letters"),
    ("", {"team": "x"}, 1, "name: must be 1 to 63 letters"),
    ("ok", ["team"], 1, "selector: must be a JSON object of labels"),
    ("ok", {"team": 3}, 1, "selector: must be a JSON object of labels"),
    ("ok", {"team": "x"}, -1, r"max_live: -1 is out of range \(0 to 1000000"),
    ("ok", {"team": "x"}, None, r"max_live: NULL is out of range"),
])
def test_a_bad_limit_argument_is_refused_by_name(conn: psycopg.Connection, name: str, selector: object,
                                                 max_live: int | None, message: str) -> None:
    with pytest.raises(store.DatabaseError, match="the database refused the limit: " + message):
        store.set_limit(conn, name, selector, max_live)  # type: ignore[arg-type]
    assert store.list_limits(conn) == []


def test_a_named_limit_holds_its_runs_back_and_says_so(conn: psycopg.Connection) -> None:
    store.set_limit(conn, "batch", {"team": "batch"}, 2)
    batch = [submit(conn, labels={"team": "batch", "n": str(i)}) for i in range(4)]
    other = submit(conn, labels={"team": "web"})
    attempts = claim(conn)
    assert sorted(a.run_id for a in attempts) == sorted([batch[0], batch[1], other])
    assert [r["live"] for r in store.list_limits(conn)] == [2]
    assert store.pass_figures(conn, register(conn, "h1")).limits == {"batch": (2, 2)}  # a daemon's gauges
    assert wait_reason(conn, batch[2]) == "limit batch: 2 of 2 live"

    finish(conn, attempts[0])
    assert len(claimed_ids(conn)) == 1
    assert live_count(conn, labels='{"team": "batch"}') == 2
    # Lowered below its live count: nothing stops, nothing starts.
    store.set_limit(conn, "batch", {"team": "batch"}, 1)
    assert claim(conn) == [] and live_count(conn, labels='{"team": "batch"}') == 2
    assert wait_reason(conn, batch[3]) == "limit batch: 2 of 1 live"
    store.drop_limit(conn, "batch")
    assert len(claimed_ids(conn)) == 1


def test_a_limit_of_zero_lets_none_start_and_an_empty_selector_counts_every_run(conn: psycopg.Connection) -> None:
    store.set_limit(conn, "stop", {"team": "batch"}, 0)
    held = submit(conn, labels={"team": "batch"})
    free = submit(conn, labels={"team": "web"})
    assert claimed_ids(conn) == [free]
    assert wait_reason(conn, held) == "limit stop: 0 of 0 live"
    store.drop_limit(conn, "stop")
    store.set_limit(conn, "fleet", {}, 1)
    assert claim(conn) == []
    assert wait_reason(conn, held) == "limit fleet: 1 of 1 live"


def test_a_limited_key_head_keeps_its_key_waiting_in_order(conn: psycopg.Connection) -> None:
    """A key's head held back by a named limit holds its key: the runs behind it do not overtake it."""
    store.set_limit(conn, "gpu", {"gpu": "yes"}, 0)
    head = submit(conn, concurrency_key="k", concurrency_limit=5, labels={"gpu": "yes"})
    behind = submit(conn, concurrency_key="k", concurrency_limit=5)
    assert claim(conn) == []
    assert wait_reason(conn, head) == "limit gpu: 0 of 0 live"
    assert wait_reason(conn, behind) == f"waits for run {head} (queued) with the same concurrency key"
    store.set_limit(conn, "gpu", {"gpu": "yes"}, 1)
    assert claimed_ids(conn) == [head]
    assert claimed_ids(conn) == [behind]


def test_an_expired_run_says_which_limit_it_waited_for(conn: psycopg.Connection) -> None:
    store.set_limit(conn, "stop", {"team": "batch"}, 0)
    run_id = submit(conn, labels={"team": "batch"}, start_deadline=store.now(conn) + timedelta(hours=1))
    conn.execute("UPDATE unitvisor.runs SET start_deadline = now() - interval '1 second' WHERE id = %s", (run_id,))
    assert conn.execute("SELECT unitvisor.expire_overdue_runs()").fetchone()[0] == 1
    reasons = [e["reason"] for e in store.get_events(conn, run_id, limit=10)]
    assert any("limit stop: 0 of 0 live" in r for r in reasons), reasons



def test_a_starved_run_under_a_full_limit_does_not_reserve_the_host(conn: psycopg.Connection) -> None:
    """A large run that has waited past starve_after for memory would reserve its host (backfill stops
    behind it), but under a full named limit it could not start anyway: the host claims the runs behind
    it instead of running under capacity for as long as the limit stays full (max_live 0: a pause)."""
    mib = 1 << 20
    fence = register(conn, "h1", budget=1000 * mib)

    def claimed() -> list[uuid.UUID]:  # as this host (claim() above registers it again, without a budget)
        return [attempt.run_id for _, attempt in store.claim(conn, fence, 10, FMT)]

    submit(conn, memory_max=600 * mib)
    [(_, first)] = store.claim(conn, fence, 10, FMT)
    store.set_limit(conn, "pause", {"team": "batch"}, 0)
    large = submit(conn, memory_max=600 * mib, priority=5, labels={"team": "batch"})
    small = submit(conn, memory_max=100 * mib)
    age_jobs(conn, 600)  # both due for ten minutes: past the claim's starve_after (5 minutes)
    assert claimed() == [small]
    assert state(conn, large) == "queued"
    # Without the limit the starved run reserves the host again: nothing smaller overtakes it.
    store.drop_limit(conn, "pause")
    submit(conn, memory_max=100 * mib)
    age_jobs(conn, 600)
    assert claimed() == []
    finish(conn, first)
    assert claimed()[0] == large

# -- claims racing on many sessions -------------------------------------------------------------------


HOSTS = tuple(f"h{i}" for i in range(1, 7))


@pytest.mark.parametrize("kind", ["named limit", "key limit"])
def test_many_hosts_claiming_at_once_never_exceed_a_limit(conn: psycopg.Connection, dsn: str, kind: str) -> None:
    """Six hosts, each on its own session, claim at once, round after round, while runs end between the
    rounds: the limit of 3 is never passed, and reached every round once the hosts poll again.

    A claim that meets another's lock on the key or limit passes over the run (the next poll takes it),
    so how many the contended tries place depends on the machine's load: a loaded CI run once saw every
    try of five sessions meet the sixth's lock, a round ending at 2. What does not depend on it: the
    contended tries place at least one (whoever holds the lock decides from a snapshot taken after it),
    and a poll after them fills the limit."""
    maximum = 3
    if kind == "named limit":
        store.set_limit(conn, "batch", {"team": "batch"}, maximum)
        for i in range(30):
            submit(conn, labels={"team": "batch", "n": str(i)})
        where = {"labels": '{"team": "batch"}'}
    else:
        for _ in range(30):
            submit(conn, concurrency_key="k", concurrency_limit=maximum)
        where = {"concurrency_key": "k"}
    for host in HOSTS:
        register(conn, host)
    age_jobs(conn)
    sessions = {host: store.connect(dsn) for host in HOSTS}
    barrier = threading.Barrier(len(HOSTS))
    try:
        for _ in range(6):
            def worker(host: str) -> None:
                session = sessions[host]
                barrier.wait(10)
                for _ in range(3):  # a claim that met another's lock passes over; it tries again
                    store.claim(session, fence_of(session, host), 2, FMT)

            before = live_count(conn, **where)
            run_concurrently(worker, HOSTS)
            assert before < live_count(conn, **where) <= maximum
            for host in HOSTS:  # each daemon's next poll, no longer contended
                store.claim(sessions[host], fence_of(sessions[host], host), 2, FMT)
            assert live_count(conn, **where) == maximum
            # Two of them end before the next round.
            for attempt in [a for h in HOSTS for _, a in store.open_attempts(conn, h)][:2]:
                finish(conn, attempt)
        # Each round filled the limit again: 3, then the 2 that ended before each of the five others.
        assert conn.execute("SELECT count(*) FROM unitvisor.attempts").fetchone()[0] == maximum + 2 * 5
    finally:
        for session in sessions.values():
            session.close()
    # Never more than the limit live at once, from the attempts' own times: every start counted
    # against the attempts open then.
    overlap = conn.execute(
        """SELECT max(n) FROM (
               SELECT (SELECT count(*) FROM unitvisor.attempts o
                       WHERE o.claimed_at <= a.claimed_at AND (o.ended_at IS NULL OR o.ended_at > a.claimed_at)) AS n
               FROM unitvisor.attempts a) c""").fetchone()[0]
    assert overlap <= maximum


# -- the CLI ------------------------------------------------------------------------------------------


def test_cli_limits_set_list_drop(conn: psycopg.Connection, dsn: str, cli) -> None:
    assert cli("limits", dsn=dsn).stdout.startswith("no limits")
    made = cli("limits", "set", "batch", "--selector", "team=batch", "--max", "1", dsn=dsn)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "limit batch set: at most 1 live runs with team=batch"
    changed = json.loads(cli("limits", "set", "batch", "--selector", "team=batch", "--max", "2", "--json",
                             dsn=dsn).stdout)
    assert changed == {"name": "batch", "selector": {"team": "batch"}, "max_live": 2, "created": False}

    submit(conn, labels={"team": "batch"})
    submit(conn, labels={"team": "batch"})
    claim(conn)
    table = cli("limits", dsn=dsn).stdout.splitlines()
    assert table[0].split() == ["NAME", "SELECTOR", "LIVE", "MAX", "SET", "BY"]
    assert table[1].split()[:5] == ["batch", "team=batch", "2", "FULL", "2"]
    [listed] = json.loads(cli("limits", "--json", dsn=dsn).stdout)
    assert (listed["name"], listed["live"], listed["max_live"], listed["full"]) == ("batch", 2, 2, True)

    bad = cli("limits", "set", "-x", "--max", "1", dsn=dsn)
    assert bad.returncode == 2  # click reads -x as an option: a usage error
    refused = cli("limits", "set", "bad name", "--max", "-3", dsn=dsn)
    assert refused.returncode == 1 and refused.stderr.startswith("unitvisor: the database refused the limit: name:")
    assert cli("limits", "set", "x", dsn=dsn).returncode == 2  # --max is required

    assert cli("limits", "drop", "batch", dsn=dsn).stdout.strip() == "limit batch dropped"
    missing = cli("limits", "drop", "batch", dsn=dsn)
    assert missing.returncode == 1 and missing.stderr.strip() == (
        "unitvisor: no limit named 'batch' (see `unitvisor limits`)")


def test_cli_submit_with_a_concurrency_limit_and_show(conn: psycopg.Connection, dsn: str, cli) -> None:
    result = cli("submit", "--concurrency-key", "k", "--concurrency-limit", "3", "--", "/bin/true", dsn=dsn)
    assert result.returncode == 0, result.stderr
    run_id = result.stdout.strip()
    shown = json.loads(cli("show", run_id, "--json", dsn=dsn).stdout)
    assert (shown["concurrency_key"], shown["concurrency_limit"]) == ("k", 3)
    assert "start:     concurrency key k (at most 3 live)" in cli("show", run_id, dsn=dsn).stdout
    refused = cli("submit", "--concurrency-limit", "3", "--", "/bin/true", dsn=dsn)
    assert refused.returncode == 1 and "concurrency_limit: needs concurrency_key" in refused.stderr
    usage = cli("submit", "--concurrency-key", "k", "--concurrency-limit", "0", "--", "/bin/true", dsn=dsn)
    assert usage.returncode == 2 and "--concurrency-limit" in usage.stderr


# -- the documented example ---------------------------------------------------------------------------


def test_the_documented_limits_example_runs_and_prints_what_the_docs_show(
        postgres: Postgres, conn: psycopg.Connection) -> None:
    assert_example_prints_its_out(postgres, conn.info.dbname, REPO / "docs" / "examples" / "limits.sql")
    assert store.list_limits(conn) == []
    assert conn.execute("SELECT state, concurrency_limit FROM unitvisor.runs").fetchall() == [("cancelled", 3)] * 2


def test_run_argument_problem_still_takes_the_arguments_before_concurrency_limit(conn: psycopg.Connection) -> None:
    """concurrency_limit is its last argument, defaulted: a submit_run written before 032 (another
    migration's, merged beside this one) that passes the 26 before it still finds the function."""
    twenty_six = ", ".join(["ARRAY['/bin/true']", "'{}'::jsonb"] + ["NULL"] * 24)
    assert conn.execute(f"SELECT (unitvisor.run_argument_problem({twenty_six})).message").fetchone()[0] is None
    assert conn.execute(f"SELECT (unitvisor.run_argument_problem({twenty_six}, 0)).message").fetchone()[0] == (
        "concurrency_limit: 0 is out of range (1 to 10000)")
