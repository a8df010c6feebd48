"""Schedules (issue 25, item 7; sql/migrations/028_schedules.sql) against the real schema: the cron
expression's parse and next due time (checked exhaustively around the days clocks change against a
brute-force reading of the documented rule), create_schedule's refusals, submit_run_spec's mapping,
and submit_due_schedules: one run per due time, overlap, catch_up, and two sessions racing for it.

Every test here fails on the schema before 028 (the functions are new). Time is moved with SQL
(next_due), never slept through.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import psycopg
import pytest

from supervisor import store
from tests.conftest import TEMPLATE_DB, throwaway_database
from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration.conftest import bind_host_role, register, run_concurrently, session_as
from tests.integration.test_sql_api_example import assert_example_prints_its_out

RUN = '{"argv": ["/bin/true"]}'


@pytest.fixture(scope="module")
def pure(postgres: Postgres) -> Iterator[psycopg.Connection]:
    """One migrated database for the tests that write nothing (the cron functions, refusals): a database
    a test costs more than the test itself on a loaded machine."""
    with throwaway_database(postgres, TEMPLATE_DB) as dsn, store.connect(dsn) as connection:
        yield connection


def cron_next(conn: psycopg.Connection, cron: str, tz: str, after: datetime) -> datetime | None:
    return conn.execute("SELECT unitvisor.cron_next(%s, %s, %s)", (cron, tz, after)).fetchone()[0]


def refusal(conn: psycopg.Connection, query: str, *args: object) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught, conn.transaction():
        conn.execute(query, args)
    return caught.value


def create(conn: psycopg.Connection, name: str = "s", cron: str = "* * * * *", tz: str = "UTC", run: str = RUN,
           **more: str) -> datetime:
    named = "".join(f", {k} => %({k})s" for k in more)
    return conn.execute(f"SELECT unitvisor.create_schedule(%(name)s, %(cron)s, %(tz)s, %(run)s::jsonb{named})",
                        {"name": name, "cron": cron, "tz": tz, "run": run, **more}).fetchone()[0]


def due_now(conn: psycopg.Connection, name: str = "s", ago: str = "1 second") -> datetime:
    """Make the schedule due `ago` (its next due time set back), as if that time had come. Never in a
    minute's last 15 seconds: a test that then crossed into the next minute (the fresh-clone run's loaded
    trixie pass did) found an every-minute schedule due a second time, the new minute (missed 1). Nor in
    its first 5: `ago` would set the due time back into the previous minute, so a pass finds the whole
    minute due (the latest cron time up to now) and a second due time a second later is that same minute,
    the same run (test_overlap[queue-2] after sleeping to second 1, in CI)."""
    second = float(conn.execute("SELECT extract(second FROM clock_timestamp())").fetchone()[0])
    if not 5 <= second < 45:
        time.sleep((65 - second) % 60)
    return conn.execute("UPDATE unitvisor.schedules SET next_due = date_trunc('second', now()) - %s::interval "
                        "WHERE name = %s RETURNING next_due", (ago, name)).fetchone()[0]


def schedule(conn: psycopg.Connection, name: str = "s") -> dict:
    return {row["name"]: row for row in store.list_schedules(conn)}[name]


def runs_of(conn: psycopg.Connection, name: str = "s") -> list[tuple]:
    return conn.execute("SELECT id, labels ->> 'unitvisor/due', concurrency_key, state FROM unitvisor.runs "
                        "WHERE labels ->> 'unitvisor/schedule' = %s ORDER BY seq", (name,)).fetchall()


# -- the cron expression ---------------------------------------------------------------------------


@pytest.mark.parametrize(("cron", "minutes", "hours", "days", "months", "weekdays", "any_day", "any_weekday"), [
    ("* * * * *", list(range(60)), list(range(24)), list(range(1, 32)), list(range(1, 13)), list(range(7)), True, True),
    ("1,5-9/2 */6 1 jan-mar/2 7", [1, 5, 7, 9], [0, 6, 12, 18], [1], [1, 3], [0], False, False),
    ("0 9 * * MON-fri", [0], [9], list(range(1, 32)), list(range(1, 13)), [1, 2, 3, 4, 5], True, False),
    ("30/15 23 */10 DEC sun,0,7", [30, 45], [23], [1, 11, 21, 31], [12], [0], True, False),
    ("@daily", [0], [0], list(range(1, 32)), list(range(1, 13)), list(range(7)), True, True),
    ("@weekly", [0], [0], list(range(1, 32)), list(range(1, 13)), [0], True, False),
    ("  0   0\t1 1 *  ", [0], [0], [1], [1], list(range(7)), False, True),
])
def test_a_cron_expression_parses_into_its_sets(pure: psycopg.Connection, cron: str, minutes: list[int],
                                                hours: list[int], days: list[int], months: list[int],
                                                weekdays: list[int], any_day: bool, any_weekday: bool) -> None:
    row = pure.execute("SELECT (f).minutes, (f).hours, (f).days, (f).months, (f).weekdays, (f).any_day, "
                       "(f).any_weekday FROM (SELECT unitvisor.cron_parse(%s) AS f) p", (cron,)).fetchone()
    assert row == (minutes, hours, days, months, weekdays, any_day, any_weekday)


@pytest.mark.parametrize(("cron", "message"), [
    ("* * * *", "cron: must have 5 fields (minute hour day-of-month month day-of-week), or be @hourly, @daily, "
                "@weekly, @monthly or @yearly; it has 4 field(s)"),
    ("* * * * * *", "cron: must have 5 fields"),
    ("", "it has 0 field(s)"),
    ("@reboot", "it has 1 field(s)"),
    ("60 * * * *", "cron: the minute field has 60, out of range (0 to 59)"),
    ("* 24 * * *", "cron: the hour field has 24, out of range (0 to 23)"),
    ("* * 0 * *", "cron: the day-of-month field has 0, out of range (1 to 31)"),
    ("* * * 13 *", "cron: the month field has 13, out of range (1 to 12 or JAN to DEC)"),
    ("* * * * 8", "cron: the day-of-week field has 8, out of range (0 to 7 or SUN to SAT)"),
    ("* * * foo *", "cron: the month field has \"foo\", which is neither a number nor a name (1 to 12 or JAN to DEC)"),
    ("* * * * monday", "which is neither a number nor a name"),
    ("5-1 * * * *", "cron: the minute field has the range 5-1, which goes backwards (a range does not wrap)"),
    ("*/0 * * * *", "cron: the minute field has the step /0, out of range (1 to 60)"),
    ("*/61 * * * *", "out of range (1 to 60)"),
    ("1,,2 * * * *", "cron: the minute field has \"\", which is not *, a value or a range a-b"),
    ("L * * * *", "neither a number nor a name"),
    ("? * * * *", "which is not *, a value or a range"),
    ("0 0 30 2 *", "cron: matches no time in the next 10 years"),
])
def test_a_bad_cron_expression_is_refused_naming_cron_and_the_field(pure: psycopg.Connection, cron: str,
                                                                    message: str) -> None:
    error = refusal(pure, "SELECT unitvisor.create_schedule('s', %s, 'UTC', '{\"argv\": [\"/bin/true\"]}')", cron)
    assert error.sqlstate == "22023"
    assert message in error.diag.message_primary
    assert pure.execute("SELECT count(*) FROM unitvisor.schedules").fetchone()[0] == 0


@pytest.mark.parametrize(("cron", "tz", "after", "expected"), [
    ("* * * * *", "UTC", "2026-12-02 10:00:30Z", "2026-12-02 10:01Z"),
    ("* * * * *", "UTC", "2026-12-02 10:01Z", "2026-12-02 10:02Z"),  # strictly after
    ("0 9 * * mon-fri", "UTC", "2026-12-04 10:00Z", "2026-12-07 09:00Z"),  # Friday after 9: Monday
    ("0 0 13 * 5", "UTC", "2026-12-01 00:00Z", "2026-12-04 00:00Z"),  # both days restricted: either (Friday the 4th)
    ("0 0 */2 * 5", "UTC", "2026-12-01 00:00Z", "2026-12-11 00:00Z"),  # '*' first: both (odd day and Friday)
    ("0 0 29 2 *", "UTC", "2097-01-01 00:00Z", "2104-02-29 00:00Z"),  # 2100 is no leap year
    ("@yearly", "UTC", "2026-12-02 00:00Z", "2027-01-01 00:00Z"),
    ("@hourly", "Asia/Kolkata", "2026-12-02 10:00Z", "2026-12-02 10:30Z"),  # +05:30
    ("0 9 * * *", "America/New_York", "2026-12-02 12:00Z", "2026-12-02 14:00Z"),
    ("0 9 31 * *", "UTC", "2026-11-01 00:00Z", "2026-12-31 09:00Z"),  # November has no 31st
])
def test_the_next_due_time(pure: psycopg.Connection, cron: str, tz: str, after: str, expected: str) -> None:
    assert cron_next(pure, cron, tz, datetime.fromisoformat(after)) == datetime.fromisoformat(expected)


def test_a_schedule_that_never_comes_again_has_no_next_due_time(pure: psycopg.Connection) -> None:
    assert cron_next(pure, "0 0 31 2 *", "UTC", datetime(2026, 1, 1, tzinfo=UTC)) is None


@pytest.mark.parametrize(("cron", "after", "expected"), [
    # Clocks go forward at 02:00 CET to 03:00 CEST (01:00 UTC): 02:30 does not exist that day and is due
    # at the end of the gap, 03:00 CEST; the day before and after, at 02:30.
    ("30 2 * * *", "2026-03-28 00:00Z", "2026-03-28 01:30Z"),
    ("30 2 * * *", "2026-03-28 01:30Z", "2026-03-29 01:00Z"),
    ("30 2 * * *", "2026-03-29 01:00Z", "2026-03-30 00:30Z"),
    # Every 15 minutes: 02:00 to 02:45 and 03:00 make one run at 03:00 CEST, then 03:15.
    ("*/15 * * * *", "2026-03-29 00:45Z", "2026-03-29 01:00Z"),
    ("*/15 * * * *", "2026-03-29 01:00Z", "2026-03-29 01:15Z"),
    # Clocks go back at 03:00 CEST to 02:00 CET (01:00 UTC): 02:30 happens twice, and is due once, the first.
    ("30 2 * * *", "2026-10-24 12:00Z", "2026-10-25 00:30Z"),
    ("30 2 * * *", "2026-10-25 00:30Z", "2026-10-26 01:30Z"),
    # Every 15 minutes: after 02:45 CEST comes 03:00 CET, an hour and a quarter later.
    ("*/15 * * * *", "2026-10-25 00:45Z", "2026-10-25 02:00Z"),
    # Created during the second 02:xx: its times have passed once already.
    ("*/15 * * * *", "2026-10-25 01:10Z", "2026-10-25 02:00Z"),
])
def test_the_days_clocks_change_in_berlin(pure: psycopg.Connection, cron: str, after: str, expected: str) -> None:
    assert cron_next(pure, cron, "Europe/Berlin", datetime.fromisoformat(after)) == datetime.fromisoformat(expected)


def transitions(tz: str, year: int) -> list[datetime]:
    """The instants (UTC) in `year` when `tz`'s offset changes, to the minute."""
    zone, found = ZoneInfo(tz), []
    t = datetime(year, 1, 1, tzinfo=UTC)
    while t.year == year:
        later = t + timedelta(hours=1)
        if t.astimezone(zone).utcoffset() != later.astimezone(zone).utcoffset():
            low, high = t, later
            while high - low > timedelta(minutes=1):
                mid = low + (high - low) / 2
                mid = mid.replace(second=0, microsecond=0)
                if mid == low:
                    break
                if mid.astimezone(zone).utcoffset() == low.astimezone(zone).utcoffset():
                    low = mid
                else:
                    high = mid
            found.append(high)
        t = later
    return found


def reference_due_times(cron_sets: tuple, tz: str, start: datetime, end: datetime) -> list[datetime]:
    """The documented rule, by brute force: every local minute of the window that matches, each at the
    first instant that has that local time, or (a local time that does not exist) at the first instant
    after its gap; the distinct instants, in order."""
    minutes, hours, days, months, weekdays, any_day, any_weekday = cron_sets
    zone = ZoneInfo(tz)

    def exists(local: datetime) -> bool:
        return local.replace(tzinfo=zone).astimezone(UTC).astimezone(zone).replace(tzinfo=None) == local

    def earliest(local: datetime) -> datetime:
        if not exists(local):
            while not exists(local):
                local += timedelta(minutes=1)
        instants = [local.replace(tzinfo=zone, fold=f).astimezone(UTC) for f in (0, 1)]
        return min(i for i in instants if i.astimezone(zone).replace(tzinfo=None) == local)

    def matches(local: datetime) -> bool:
        dow = local.isoweekday() % 7
        day_ok = (local.day in days and dow in weekdays) if (any_day or any_weekday) else (
            local.day in days or dow in weekdays)
        return local.minute in minutes and local.hour in hours and local.month in months and day_ok

    local = start.astimezone(zone).replace(tzinfo=None, second=0, microsecond=0) - timedelta(hours=3)
    last = end.astimezone(zone).replace(tzinfo=None) + timedelta(hours=3)
    found = set()
    while local <= last:
        if matches(local):
            found.add(earliest(local))
        local += timedelta(minutes=1)
    return sorted(t for t in found if start < t <= end)


@pytest.mark.parametrize("tz", ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "America/Santiago"])
@pytest.mark.parametrize("cron", ["*/15 * * * *", "30 2 * * *", "0 1,2,3 * * *", "59 1 * * *", "*/7 0-4 * * *",
                                  "0 * * * *", "45 0 * * sun"])
def test_the_next_due_time_around_every_clock_change_matches_the_documented_rule(
        pure: psycopg.Connection, tz: str, cron: str) -> None:
    """Exhaustive over each 2026 change of the zone's clocks: the sequence cron_next walks, from a day
    before the change to a day after, is exactly the rule's (Lord Howe moves its clocks by 30 minutes,
    Santiago at midnight)."""
    row = pure.execute("SELECT (f).minutes, (f).hours, (f).days, (f).months, (f).weekdays, (f).any_day, "
                       "(f).any_weekday FROM (SELECT unitvisor.cron_parse(%s) AS f) p", (cron,)).fetchone()
    changes = transitions(tz, 2026)
    assert len(changes) == 2, changes
    for change in changes:
        start, end = change - timedelta(days=1), change + timedelta(days=1)
        walked = pure.execute(
            """WITH RECURSIVE walk(t) AS (
                   SELECT unitvisor.cron_next(%(cron)s, %(tz)s, %(start)s)
                   UNION ALL SELECT unitvisor.cron_next(%(cron)s, %(tz)s, walk.t) FROM walk WHERE walk.t <= %(end)s)
               SELECT t FROM walk WHERE t <= %(end)s""",
            {"cron": cron, "tz": tz, "start": start, "end": end}).fetchall()
        assert [t for (t,) in walked] == reference_due_times(row, tz, start, end), (tz, cron, change)


# -- create_schedule -------------------------------------------------------------------------------


def test_create_returns_the_first_due_time_and_the_schedule_lists(conn: psycopg.Connection) -> None:
    first = create(conn, "nightly", "30 2 * * *", "Europe/Berlin", '{"argv": ["/bin/true"], "max_attempts": 2}',
                   overlap="queue", catch_up="one")
    now = conn.execute("SELECT now()").fetchone()[0]
    assert first == cron_next(conn, "30 2 * * *", "Europe/Berlin", now)
    row = schedule(conn, "nightly")
    assert (row["cron"], row["timezone"], row["overlap"], row["catch_up"], row["paused"], row["next_due"],
            row["last_due"], row["run"]) == ("30 2 * * *", "Europe/Berlin", "queue", "one", False, first, None,
                                             {"argv": ["/bin/true"], "max_attempts": 2})
    assert conn.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0] == 0  # the trial submit is undone


@pytest.mark.parametrize(("args", "message"), [
    (("bad name", "* * * * *", "UTC", RUN), "name: must be 1 to 63 of"),
    (("-x", "* * * * *", "UTC", RUN), "name: must be 1 to 63 of"),
    (("x" * 64, "* * * * *", "UTC", RUN), "name: must be 1 to 63 of"),
    (("s", None, "UTC", RUN), "cron: must not be NULL"),
    (("s", "* * * * *", "Mars/Olympus", RUN), "timezone: 'Mars/Olympus' is not a time zone name of pg_timezone_names"),
    (("s", "* * * * *", "EST5", RUN), "timezone: 'EST5' is not a time zone name"),  # AT TIME ZONE takes it; not a name
    (("s", "* * * * *", None, RUN), "timezone: NULL is not"),
    (("s", "* * * * *", "UTC", None), "run: must be a JSON object of submit_run's argument names"),
    (("s", "* * * * *", "UTC", '["/bin/true"]'), "run: must be a JSON object"),
    (("s", "* * * * *", "UTC", '{"argv": ["/bin/true"], "memroy_max": 1}'),
     "run: spec: unknown key 'memroy_max', not one of submit_run's arguments"),
    (("s", "* * * * *", "UTC", '{"memory_max": 1048576}'), "run: argv: required"),
    (("s", "* * * * *", "UTC", '{"argv": ["/bin/true"], "memory_max": 5}'), "run: memory_max: 5 is out of range"),
    (("s", "* * * * *", "UTC", '{"argv": ["bin/true"]}'), "run: argv"),
    (("s", "* * * * *", "UTC", '{"argv": ["/bin/true"], "idempotency_key": "k"}'), "run: may not have idempotency_key"),
    (("s", "* * * * *", "UTC",
      '{"argv": ["/bin/true"], "not_before": "2030-01-01 00:00Z", "start_deadline": "2031-01-01 00:00Z"}'),
     "run: may not have not_before, start_deadline"),
    # 63 labels of its own, and the schedule's 2: over the 64 a run may have.
    (("s", "* * * * *", "UTC", json.dumps({"argv": ["/bin/true"], "labels": {f"k{i}": "v" for i in range(63)}})),
     "run: labels"),
])
def test_create_refuses_each_argument_naming_it(pure: psycopg.Connection, args: tuple, message: str) -> None:
    error = refusal(pure, "SELECT unitvisor.create_schedule(%s, %s, %s, %s::jsonb)", *args)
    assert message in error.diag.message_primary, error.diag.message_primary
    assert pure.execute("SELECT count(*) FROM unitvisor.schedules").fetchone()[0] == 0
    assert pure.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0] == 0


@pytest.mark.parametrize(("overlap", "catch_up", "message"), [
    ("never", "none", "overlap: must be skip, queue or allow"),
    (None, "none", "overlap: must be"),
    ("skip", "all", "catch_up: must be none or one"),
])
def test_create_refuses_overlap_and_catch_up_naming_them(pure: psycopg.Connection, overlap: str | None,
                                                         catch_up: str, message: str) -> None:
    error = refusal(pure, "SELECT unitvisor.create_schedule('s', '* * * * *', 'UTC', %s::jsonb, %s, %s)",
                    RUN, overlap, catch_up)
    assert error.sqlstate == "22023" and error.diag.message_primary.startswith(message)


def test_a_second_schedule_of_a_name_is_refused_and_drop_and_pause_work(conn: psycopg.Connection) -> None:
    create(conn, "s")
    error = refusal(conn, "SELECT unitvisor.create_schedule('s', '* * * * *', 'UTC', %s::jsonb)", RUN)
    assert (error.sqlstate, error.diag.message_primary) == ("23505", "name: a schedule named s exists "
                                                            "(drop_schedule it first)")
    assert conn.execute("SELECT unitvisor.pause_schedule('s')").fetchone()[0] is False
    assert conn.execute("SELECT unitvisor.pause_schedule('s')").fetchone()[0] is True
    assert conn.execute("SELECT unitvisor.pause_schedule('nope')").fetchone()[0] is None
    assert conn.execute("SELECT unitvisor.drop_schedule('s')").fetchone()[0] is True
    assert conn.execute("SELECT unitvisor.drop_schedule('s')").fetchone()[0] is False


# -- submit_run_spec -------------------------------------------------------------------------------


def test_the_spec_maps_each_key_onto_submit_runs_argument(conn: psycopg.Connection) -> None:
    run_id = conn.execute("""SELECT unitvisor.submit_run_spec('{"argv": ["/bin/echo", "a b", "NULL"],
        "environment": {"A": "1"}, "memory_max": "268435456", "cpu_quota_percent": 50, "max_attempts": 3,
        "retry_on": ["lost", "exit-code"], "private_network": true, "labels": {"team": "x"},
        "not_before": "2099-01-01T00:00:00Z", "priority": -2, "host_pin": null}')""").fetchone()[0]
    row = conn.execute("SELECT argv, environment, memory_max, cpu_quota_percent, max_attempts, retry_on, "
                       "private_network, labels, not_before, priority, host_pin FROM unitvisor.runs WHERE id = %s",
                       (run_id,)).fetchone()
    assert row == (["/bin/echo", "a b", "NULL"], {"A": "1"}, 268435456, 50, 3, ["lost", "exit-code"], True,
                   {"team": "x"}, datetime(2099, 1, 1, tzinfo=UTC), -2, None)


def test_every_argument_of_submit_run_is_a_key_of_the_spec(conn: psycopg.Connection) -> None:
    """The keys are read from submit_run's signature: an argument a later migration adds is a key at once."""
    names = conn.execute("SELECT proargnames FROM pg_proc WHERE oid = 'unitvisor.submit_run'::regproc").fetchone()[0]
    assert "argv" in names and "memory_high" in names
    for name in names:
        with conn.transaction(force_rollback=True):
            try:
                conn.execute("SELECT unitvisor.submit_run_spec(jsonb_build_object('argv', '[\"/bin/true\"]'::jsonb) "
                             "|| jsonb_build_object(%s::text, NULL))", (name,))
            except psycopg.Error as exc:
                assert "unknown key" not in exc.diag.message_primary, name


@pytest.mark.parametrize(("spec", "sqlstate", "message"), [
    ('{"argv": ["/bin/true"], "memroy_max": 1}', "22023",
     "spec: unknown key 'memroy_max', not one of submit_run's arguments (docs/sql-api.md)"),
    ('{"max_attempts": 2}', "23502", 'argv: required (the spec has no key "argv")'),
    ('{"argv": "/bin/true"}', "22023", "argv: must be a JSON array of strings or numbers"),
    ('{"argv": [["/bin/true"]]}', "22023", "argv: must be a JSON array of strings or numbers"),
    ('{"argv": ["/bin/true"], "max_attempts": "three"}', "22023",
     "max_attempts: not a valid integer (as a JSON string)"),
    ('{"argv": ["/bin/true"], "max_attempts": 1.5}', "22023", "max_attempts: not a valid integer (as a JSON number)"),
    ('{"argv": ["/bin/true"], "max_attempts": [1]}', "22023", "max_attempts: must be a JSON string, number or boolean"),
    ('{"argv": ["/bin/true"], "max_attempts": null}', "23502",
     "max_attempts: must not be NULL (leave it out for its default)"),
    ('{"argv": ["/bin/true"], "memory_max": 5}', "23514", "memory_max: 5 is out of range"),
    ('"x"', "22023", "spec: must be a JSON object of submit_run's argument names"),
])
def test_the_spec_refuses_naming_the_key(pure: psycopg.Connection, spec: str, sqlstate: str, message: str) -> None:
    error = refusal(pure, "SELECT unitvisor.submit_run_spec(%s::jsonb)", spec)
    assert error.sqlstate == sqlstate
    assert error.diag.message_primary.startswith(message), error.diag.message_primary


def test_a_spec_value_is_never_echoed(pure: psycopg.Connection) -> None:
    error = refusal(pure, "SELECT unitvisor.submit_run_spec(%s::jsonb)",
                    '{"argv": ["/bin/true"], "max_attempts": "hunter2"}')
    assert "hunter2" not in str(error)


# -- submit_due_schedules --------------------------------------------------------------------------


def test_a_due_schedule_is_submitted_once_and_moves_on(conn: psycopg.Connection) -> None:
    fence = register(conn, "h1")
    create(conn, "s", "* * * * *", run='{"argv": ["/bin/true"], "labels": {"team": "x"}}')
    assert store.submit_due_schedules(conn, fence) == []  # not due yet
    due = due_now(conn)
    assert conn.execute("SELECT upkeep FROM unitvisor.heartbeat('h1', %s, '1 hour')",
                        (fence.epoch,)).fetchone()[0] is True
    [turn] = store.submit_due_schedules(conn, fence)
    assert (turn.schedule, turn.due, turn.result, turn.missed) == ("s", due, "submitted", 0)
    run = conn.execute("SELECT labels, idempotency_key, state FROM unitvisor.runs WHERE id = %s",
                       (turn.run_id,)).fetchone()
    stamp = due.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert run == ({"team": "x", "unitvisor/schedule": "s", "unitvisor/due": stamp},
                   f"unitvisor/schedule/s/{stamp}", "queued")
    row = schedule(conn)
    now = conn.execute("SELECT now()").fetchone()[0]
    assert (row["next_due"], row["last_due"], row["last_run_id"], row["last_run_state"], row["submitted"]) == (
        cron_next(conn, "* * * * *", "UTC", now), due, turn.run_id, "queued", 1)
    assert store.submit_due_schedules(conn, fence) == []  # done for this due time
    assert conn.execute("SELECT upkeep FROM unitvisor.heartbeat('h1', %s, '1 hour')",
                        (fence.epoch,)).fetchone()[0] is False
    # The same due time again (a pass whose update was lost, say): the same run, nothing new.
    conn.execute("UPDATE unitvisor.schedules SET next_due = %s", (due,))
    conn.execute("UPDATE unitvisor.runs SET state = 'succeeded', finished_at = now() WHERE id = %s", (turn.run_id,))
    [again] = store.submit_due_schedules(conn, fence)
    assert again.run_id == turn.run_id and len(runs_of(conn)) == 1



def test_a_due_schedule_runs_after_a_run_pinned_to_another_host(conn: psycopg.Connection, postgres: Postgres) -> None:
    """The host that submits a due schedule submits what its submitter wrote: `after` may name a run that
    host's role may not read (pinned to another host), as create_schedule's trial as the submitter let it.
    The pass runs as h1's bound role, as its daemon's does (the run is invisible to that role)."""
    register(conn, "h2")
    fence = register(conn, "h1")
    pinned = store.submit_run(conn, argv=["/bin/true"], host_pin="h2")
    create(conn, "s", "* * * * *", run=f'{{"argv": ["/bin/true"], "after": ["{pinned}"]}}')
    due_now(conn)
    with session_as(conn, bind_host_role(conn, postgres, "h1")):
        assert conn.execute("SELECT count(*) FROM unitvisor.runs WHERE id = %s", (pinned,)).fetchone()[0] == 0
        [turn] = store.submit_due_schedules(conn, fence)
    assert turn.result == "submitted", turn.result
    assert store.dependencies_of(conn, turn.run_id) == ("succeeded", [{"id": pinned, "state": "queued", "met": None}])

def test_a_paused_schedule_submits_nothing_and_resumes_from_now(conn: psycopg.Connection) -> None:
    fence = register(conn, "h1")
    create(conn, "s")
    due_now(conn, ago="10 minutes")
    conn.execute("SELECT unitvisor.pause_schedule('s')")
    assert store.submit_due_schedules(conn, fence) == []
    conn.execute("SELECT unitvisor.pause_schedule('s', false)")
    row = schedule(conn)
    assert row["next_due"] > conn.execute("SELECT now()").fetchone()[0] and row["missed"] == 0


@pytest.mark.parametrize(("overlap", "submitted"), [("skip", 1), ("queue", 2), ("allow", 2)])
def test_overlap(conn: psycopg.Connection, overlap: str, submitted: int) -> None:
    fence = register(conn, "h1")
    create(conn, "s", overlap=overlap)
    due_now(conn, ago="2 seconds")
    [first] = store.submit_due_schedules(conn, fence)
    due_now(conn, ago="1 second")  # the next due time comes while the first run is still queued
    [second] = store.submit_due_schedules(conn, fence)
    runs = runs_of(conn)
    assert len(runs) == submitted
    if overlap == "skip":
        assert second.run_id is None
        assert second.result == f"skipped: run {first.run_id} is still live (overlap skip)"
        assert schedule(conn)["skipped"] == 1 and schedule(conn)["last_run_id"] == first.run_id
        # Once it has ended, the next due time submits again.
        conn.execute("UPDATE unitvisor.runs SET state = 'failed', finished_at = now() WHERE id = %s", (first.run_id,))
        due_now(conn, ago="0 seconds")
        [third] = store.submit_due_schedules(conn, fence)
        assert third.result == "submitted"
    else:
        assert {key for *_, key, _ in runs} == ({"unitvisor/schedule/s"} if overlap == "queue" else {None})
        assert second.result == "submitted"


def test_overlap_queue_keeps_the_runs_own_concurrency_key(conn: psycopg.Connection) -> None:
    fence = register(conn, "h1")
    create(conn, "s", run='{"argv": ["/bin/true"], "concurrency_key": "db"}', overlap="queue")
    due_now(conn)
    store.submit_due_schedules(conn, fence)
    assert [key for *_, key, _ in runs_of(conn)] == ["db"]


@pytest.mark.parametrize(("catch_up", "hours", "result", "runs"), [
    # The fleet was down: the schedule's last three (or one) hourly due times passed, the latest 2 to 3
    # minutes ago (over a minute late: missed).
    ("none", 2, "missed (3 due time(s), the latest", 0),
    ("one", 2, "submitted late, for 3 missed due time(s) (catch_up one)", 1),
    ("none", 0, "missed (1 due time(s), the latest", 0),
    ("one", 0, "submitted late, for 1 missed due time(s) (catch_up one)", 1),
])
def test_catch_up_after_an_outage(conn: psycopg.Connection, catch_up: str, hours: int, result: str,
                                  runs: int) -> None:
    fence = register(conn, "h1")
    latest = conn.execute("SELECT date_trunc('minute', now() - interval '3 minutes')").fetchone()[0]
    create(conn, "s", f"{latest.astimezone(UTC).minute} * * * *", catch_up=catch_up)
    conn.execute("UPDATE unitvisor.schedules SET next_due = %s - make_interval(hours => %s)", (latest, hours))
    [turn] = store.submit_due_schedules(conn, fence)
    assert turn.result.startswith(result), turn.result
    assert (turn.due, turn.missed, len(runs_of(conn))) == (latest, hours + 1, runs)
    assert [due for _, due, *_ in runs_of(conn)] == [latest.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")] * runs
    row = schedule(conn)
    assert (row["missed"], row["last_due"]) == (hours + 1, latest)
    assert row["next_due"] == latest + timedelta(hours=1)


@pytest.mark.parametrize("catch_up", ["none", "one"])
def test_after_an_outage_an_on_time_due_time_runs_and_the_rest_are_missed(conn: psycopg.Connection,
                                                                          catch_up: str) -> None:
    """Every minute, down for five: this minute's due time is on time and runs (one run, whatever
    catch_up says); the five before it are missed."""
    fence = register(conn, "h1")
    create(conn, "s", catch_up=catch_up)
    conn.execute("UPDATE unitvisor.schedules SET next_due = date_trunc('minute', now()) - interval '5 minutes'")
    [turn] = store.submit_due_schedules(conn, fence)
    now = conn.execute("SELECT now()").fetchone()[0]
    assert (turn.result, turn.missed, turn.due) == ("submitted", 5, now.replace(second=0, microsecond=0))
    assert len(runs_of(conn)) == 1


def test_a_long_outage_counts_at_most_a_thousand_and_still_moves_on(conn: psycopg.Connection) -> None:
    fence = register(conn, "h1")
    create(conn, "s", catch_up="none")
    conn.execute("UPDATE unitvisor.schedules SET next_due = date_trunc('minute', now()) - interval '30 days'")
    [turn] = store.submit_due_schedules(conn, fence)
    assert turn.missed == 1000 and turn.result == "submitted"  # this minute's is on time
    assert schedule(conn)["next_due"] > conn.execute("SELECT now()").fetchone()[0]


def test_a_pass_stops_taking_schedules_after_its_budget_and_the_next_goes_on(conn: psycopg.Connection) -> None:
    """After a month's outage each schedule counts 1,000 missed times (0.05 to 0.2 s of work): a pass takes
    no schedule once it has worked its budget (2 seconds for the daemons, well inside their
    statement_timeout; 10 ms here, so that one schedule fills it), and the next passes take the rest,
    each schedule once."""
    fence = register(conn, "h1")
    for i in range(4):
        create(conn, f"s{i}")
    conn.execute("UPDATE unitvisor.schedules SET next_due = date_trunc('minute', now()) - interval '30 days'")
    taken = []
    for _ in range(4):
        turns = conn.execute("SELECT schedule FROM unitvisor.submit_due_schedules(%s, %s, budget => '10 ms')",
                             (fence.host_id, fence.epoch)).fetchall()
        assert len(turns) == 1
        taken += [t for (t,) in turns]
    assert sorted(taken) == ["s0", "s1", "s2", "s3"]
    assert store.submit_due_schedules(conn, fence) == []


def test_a_refused_run_is_said_and_the_schedule_moves_on(conn: psycopg.Connection) -> None:
    fence = register(conn, "h1")
    create(conn, "s")
    # A spec that a later check refuses (written directly: create_schedule would refuse it now).
    conn.execute("""UPDATE unitvisor.schedules SET run = '{"argv": ["/bin/true"], "memory_max": 5}'""")
    due_now(conn)
    [turn] = store.submit_due_schedules(conn, fence)
    assert turn.run_id is None and turn.result.startswith("refused: memory_max: 5 is out of range")
    assert schedule(conn)["next_due"] > conn.execute("SELECT now()").fetchone()[0]


def test_the_step_is_fenced_and_a_silent_host_submits_nothing(conn: psycopg.Connection, dsn: str) -> None:
    fence = register(conn, "h1")
    create(conn, "s")
    due_now(conn)
    with pytest.raises(store.Fenced):
        store.submit_due_schedules(conn, store.Fence("h1", fence.epoch + 1000))
    conn.execute("UPDATE unitvisor.hosts SET heartbeat_at = now() - interval '2 minutes'")
    assert store.submit_due_schedules(conn, fence) == []
    assert runs_of(conn) == []


def test_two_hosts_racing_for_due_schedules_submit_each_due_time_once(conn: psycopg.Connection, dsn: str) -> None:
    """Two sessions (two hosts' daemons) run the upkeep's statement at the same moment, again and again,
    over 20 schedules made due each round: every due time makes exactly one run."""
    hosts = ("h1", "h2")
    fences = {}
    for host in hosts:
        with store.connect(dsn) as other:
            fences[host] = register(other, host)
    # Yearly: each round's due time (set below) is the only one that has come. Every minute, as
    # elsewhere, a minute that began during the test was due too, and a later round's pass submitted
    # that minute again (its run, by its idempotency key): the fresh-clone run's loaded machine crossed
    # one (100 run ids returned, 80 distinct).
    for i in range(20):
        create(conn, f"s{i}", cron="0 0 1 1 *", overlap="allow")
    submitted: dict[str, list[uuid.UUID]] = {host: [] for host in hosts}
    barrier = threading.Barrier(len(hosts))
    rounds = 5
    base = conn.execute("SELECT date_trunc('second', now())").fetchone()[0]

    def upkeep(host: str) -> None:
        with store.connect(dsn) as other:
            for round_number in range(1, rounds + 1):
                barrier.wait(timeout=30)
                if host == "h1":  # a due time of its own each round (seconds apart), for every schedule
                    other.execute("UPDATE unitvisor.schedules SET next_due = %s",
                                  (base - timedelta(seconds=round_number),))
                barrier.wait(timeout=30)
                submitted[host] += [t.run_id for t in store.submit_due_schedules(other, fences[host]) if t.run_id]

    run_concurrently(upkeep, hosts)
    every = submitted["h1"] + submitted["h2"]
    assert len(every) == len(set(every))
    due_times = conn.execute("SELECT labels ->> 'unitvisor/schedule', labels ->> 'unitvisor/due', count(*) "
                             "FROM unitvisor.runs GROUP BY 1, 2").fetchall()
    assert all(count == 1 for *_, count in due_times)
    assert len(every) == len(due_times) == 20 * rounds
    assert sum(s["submitted"] for s in store.list_schedules(conn)) == len(every)


# -- the documented example ------------------------------------------------------------------------


SCRIPT = REPO / "docs" / "examples" / "schedules.sql"
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def test_the_documented_schedules_example_runs_and_prints_what_the_docs_show(
        postgres: Postgres, conn: psycopg.Connection) -> None:
    assert_example_prints_its_out(postgres, conn.info.dbname, SCRIPT)
    assert conn.execute("SELECT count(*) FROM unitvisor.schedules").fetchone()[0] == 0


# -- unitvisor schedules ---------------------------------------------------------------------------


def test_the_cli_lists_schedules_with_their_next_and_last_run(conn: psycopg.Connection, dsn: str, cli) -> None:
    assert "no schedules" in cli("schedules", dsn=dsn).stdout
    fence = register(conn, "h1")
    create(conn, "nightly", "30 2 * * *", "Europe/Berlin", catch_up="one")
    create(conn, "often", "*/5 * * * *", "UTC", overlap="allow")
    conn.execute("SELECT unitvisor.pause_schedule('often')")
    due = due_now(conn, "nightly")
    [turn] = store.submit_due_schedules(conn, fence)
    row = schedule(conn, "nightly")
    shown = cli("schedules", dsn=dsn)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["NAME", "CRON", "TIMEZONE", "NEXT", "LAST", "LAST", "RUN", "OVERLAP", "CATCH-UP",
                                "MISSED"]
    berlin = ZoneInfo("Europe/Berlin")
    nightly = next(line for line in lines if line.startswith("nightly"))
    assert row["next_due"].astimezone(berlin).strftime("%Y-%m-%d %H:%M %z") in nightly
    assert f"{due.astimezone(berlin).strftime('%Y-%m-%d %H:%M %z')} (submitted)" in nightly
    assert f"{str(turn.run_id)[:8]} queued" in nightly
    assert "PAUSED" in next(line for line in lines if line.startswith("often"))
    listed = cli("schedules", "--json", dsn=dsn)
    assert listed.returncode == 0, listed.stderr
    by_name = {s["name"]: s for s in json.loads(listed.stdout)}
    assert by_name["nightly"] | {"created_at": None} == {
        "name": "nightly", "cron": "30 2 * * *", "timezone": "Europe/Berlin", "run": {"argv": ["/bin/true"]},
        "overlap": "skip", "catch_up": "one", "paused": False,
        "next_due": row["next_due"].astimezone(UTC).isoformat(),
        "last_due": due.astimezone(UTC).isoformat(), "last_result": "submitted",
        "last_at": row["last_at"].astimezone(UTC).isoformat(),
        "last_run_id": str(turn.run_id), "last_run_state": "queued", "submitted": 1, "skipped": 0, "missed": 0,
        "created_at": None, "created_by": row["created_by"]}
    assert by_name["often"]["paused"] is True


def test_a_schedules_run_may_not_link_a_river_job(pure: psycopg.Connection) -> None:
    """034: river_job_id links one run to one River job (the River source sets it); a schedule makes many."""
    error = refusal(pure, "SELECT unitvisor.create_schedule('s', '* * * * *', 'UTC', %s::jsonb)",
                    '{"argv": ["/bin/true"], "river_job_id": 42}')
    assert error.sqlstate == "22023" and error.diag.message_primary.startswith("run: may not have river_job_id: ")
    assert pure.execute("SELECT count(*) FROM unitvisor.schedules").fetchone()[0] == 0
