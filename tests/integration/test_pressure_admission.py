"""Admission by pressure in the database (sql/018_admission_pressure.sql): what a host reports, that a
host stopped by pressure is refused by the claim and the probe, that a waiting run says so, and that
`unitvisor hosts` shows it. Each test fails without the migration: the function, the columns and the
refusal are all it adds."""

from __future__ import annotations

import json
from datetime import timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from tests.integration.conftest import age_jobs, connected, register

pytestmark = pytest.mark.usefixtures("as_bound_roles")

FMT = unitspec.UNIT_NAME_FORMAT
WEEK = timedelta(days=7)
STOPPED = ("stopped", "memory", {"memory": 55.0, "io": 1.0}, "memory pressure 55.0% (avg10) >= 40%: claiming nothing")


def submit(conn: psycopg.Connection) -> object:
    return conn.execute("SELECT unitvisor.submit_run(argv => ARRAY['/bin/true'])").fetchone()[0]


def claimed(conn: psycopg.Connection, fence: store.Fence) -> set:
    return {attempt.run_id for _, attempt in store.claim(conn, fence, 100, FMT)}


def test_a_host_stopped_by_pressure_is_refused_and_the_waiting_run_says_why(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    store.set_pressure(conn, h1, *STOPPED)
    run_id = submit(conn)
    assert store.probe(conn, h1, WEEK).claimable is False  # not woken to claim nothing
    assert claimed(conn, h1) == set()
    assert store.explain_waiting(conn, timedelta(0)) == 1
    reason = store.get_run(conn, run_id).wait_reason
    assert reason == "no live host accepts it: claims nothing under memory pressure (h1)"

    # Pressure falls: the host reports it and claims again, and the reason goes.
    store.set_pressure(conn, h1, "open", None, {"memory": 2.0, "io": 0.0}, "memory pressure 2.0% (avg10), under 10%")
    assert store.probe(conn, h1, WEEK).claimable is True
    assert claimed(conn, h1) == {run_id}
    assert store.get_run(conn, run_id).wait_reason is None


def test_a_stopped_hosts_runs_go_to_another_host(conn: psycopg.Connection, dsn: str) -> None:
    h1 = register(conn, "h1")
    store.set_pressure(conn, h1, *STOPPED)
    with psycopg.connect(dsn, autocommit=True) as other:
        h2 = register(other, "h2")
        run_id = submit(conn)
        age_jobs(conn)
        assert claimed(conn, h1) == set()
        assert claimed(other, h2) == {run_id}


def test_slowed_and_off_are_the_daemons_to_act_on_and_refuse_nothing(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    store.set_pressure(conn, h1, "slowed", "io", {"memory": 0.0, "io": 20.0}, "io pressure 20.0% ...")
    first = submit(conn)
    assert claimed(conn, h1) == {first}
    store.set_pressure(conn, h1, "off", None, {}, "admission by pressure off: no PSI")
    second = submit(conn)
    assert claimed(conn, h1) == {second}


def test_a_report_older_than_the_hosts_registration_is_void(conn: psycopg.Connection, cli, dsn: str) -> None:
    """The daemon that reported stopped is gone (killed, or replaced by a 0.6.0 daemon that reports
    nothing): its host is not kept closed by it."""
    h1 = register(conn, "h1")
    store.set_pressure(conn, h1, *STOPPED)
    shown = json.loads(cli("hosts", "--json", dsn=dsn).stdout)
    assert shown[0]["pressure"] == {"state": "stopped", "resource": "memory", "figures": {"memory": 55.0, "io": 1.0},
                                    "detail": STOPPED[3], "age_seconds": pytest.approx(0, abs=5)}
    table = cli("hosts", dsn=dsn).stdout
    assert "stopped (memory 55%)" in table and f"h1: {STOPPED[3]}" in table

    connected(conn, "h1", seconds=-1)  # registered again after the report
    run_id = submit(conn)
    assert claimed(conn, h1) == {run_id}
    assert json.loads(cli("hosts", "--json", dsn=dsn).stdout)[0]["pressure"] is None


def test_a_host_that_never_reported_is_judged_as_before(conn: psycopg.Connection, cli, dsn: str) -> None:
    h1 = register(conn, "h1")
    run_id = submit(conn)
    assert claimed(conn, h1) == {run_id}
    shown = json.loads(cli("hosts", "--json", dsn=dsn).stdout)
    assert shown[0]["pressure"] is None
    assert cli("hosts", dsn=dsn).stdout.splitlines()[1].split()[7] == "-"  # ADMISSION


def test_a_fenced_host_cannot_report(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    with pytest.raises(store.Fenced):
        store.set_pressure(conn, store.Fence("h1", h1.epoch + 1000), *STOPPED)
