"""Retries by policy, and adoption of a unit that already carries an attempt's name."""

from __future__ import annotations

import psycopg

from tests.harness.host import Host, journal_invocations, wait_for


def submit_sql(host: Host, sql: str) -> str:
    with psycopg.connect(host.dsn, autocommit=True) as conn:
        return str(conn.execute(sql).fetchone()[0])


def test_failed_attempts_are_retried_until_attempts_run_out(host: Host) -> None:
    host.start()
    run_id = submit_sql(host, "SELECT unitvisor.submit_run(ARRAY['/bin/sh', '-c', 'exit 1'], max_attempts => 3, "
                              "retry_backoff_sec => 1, retry_backoff_max_sec => 2)")
    data = host.wait_run(run_id, states=("failed",), timeout=60)
    assert [(a["attempt"], a["outcome"]) for a in data["attempts"]] == [(1, "exit-code"), (2, "exit-code"),
                                                                         (3, "exit-code")]
    reasons = [e["reason"] for e in data["events"] if e["state"] == "queued"]
    assert any("retry in" in r for r in reasons)


def test_retry_on_narrows_what_is_retried(host: Host) -> None:
    host.start()
    run_id = submit_sql(host, "SELECT unitvisor.submit_run(ARRAY['/bin/sh', '-c', 'exit 1'], max_attempts => 3, "
                              "retry_backoff_sec => 1, retry_on => ARRAY['timeout'])")
    data = host.wait_run(run_id)
    assert len(data["attempts"]) == 1


def test_a_unit_that_already_has_the_attempts_name_is_adopted_not_started_twice(host: Host) -> None:
    run_id = host.submit("--", "/bin/sh", "-c", "sleep 2; exit 6")  # no daemon yet: stays queued
    unit = f"unitvisor-run-{run_id}-1.service"
    # Someone (a crashed daemon's start call that did arrive) already started this attempt's unit.
    host.tb.run("systemd-run", "--unit", unit, "--property=RemainAfterExit=yes", "--property=Type=exec",
                "/bin/sh", "-c", "sleep 2; exit 6")
    host.start()
    data = host.wait_run(run_id)
    [attempt] = data["attempts"]
    assert (attempt["outcome"], attempt["exit_status"]) == ("exit-code", "exit:6")
    assert len(journal_invocations(host, unit)) == 1
    assert any("existed: adopted" in e["reason"] for e in data["events"])
    wait_for(lambda: not host.loaded_run_units(), what="the unit to be released")
