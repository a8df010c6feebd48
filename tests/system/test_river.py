"""The River source on a test bed host with a real unitvisor.service (issue 26): a River-shaped spawn job
inserted in the platform's transaction becomes a run that really runs, and its River row ends
`completed`; a refused one ends `discarded` with River's error; a daemon killed (SIGKILL) between the
River claim and the finish finishes the job once it is back, with one run and one unit."""

from __future__ import annotations

import psycopg

from tests.harness.host import DEFAULT_CONFIG, Host, daemon_active, journal_invocations, wait_for
from tests.integration import river_schema
from tests.integration.test_river import create_platform, run_of, spawn

RIVER_CONFIG = """
[river]
schema = "river"
queues = ["spawn"]
kinds = ["tm_spawn_run"]
spec_function = "platform.unitvisor_spec"
"""


def prepare(host: Host) -> psycopg.Connection:
    """River's tables and the platform's schema, before the daemon starts (it checks River's version at
    connect); the host configured with [river]. Returns the platform's own session."""
    conn = psycopg.connect(host.dsn, autocommit=True)
    river_schema.create(conn, "river", 7)
    create_platform(conn)
    host.configure(config=DEFAULT_CONFIG.format(host_id=host.host_id, runs_extra="") + RIVER_CONFIG)
    return conn


def river_state(conn: psycopg.Connection, job_id: int) -> str:
    return river_schema.job(conn, job_id)["state"]


def test_a_river_job_becomes_a_run_on_the_host_and_ends_completed(host: Host) -> None:
    with prepare(host) as conn:
        host.start()
        _, job_id = spawn(conn, ["/bin/sh", "-c", "exit 0"])
        _, refused = spawn(conn, extra={"memroy_max": 1})
        wait_for(lambda: river_state(conn, job_id) == "completed", timeout=60, what="the River job to be completed")
        job = river_schema.job(conn, job_id)
        assert (job["attempt"], job["attempted_by"], job["errors"]) == (1, [f"unitvisor:{host.host_id}"], None)
        run = run_of(conn, job_id)
        assert host.wait_run(str(run["id"]), timeout=60)["state"] == "succeeded"
        wait_for(lambda: river_state(conn, refused) == "discarded", timeout=30, what="the refused job to be discarded")
        [error] = river_schema.job(conn, refused)["errors"]
        assert "spec: unknown key 'memroy_max'" in error["error"] and error["attempt"] == 1
        assert run_of(conn, refused) is None
        assert "river-claimed" in host.daemon_log() and "river-finished" in host.daemon_log()


def test_a_daemon_killed_between_claim_and_finish_finishes_when_back(host: Host) -> None:
    with prepare(host) as conn:
        host.install_units({"UNITVISOR_FAULT": "after-river-claim"})
        host.tb.run("systemctl", "start", "--no-block", "unitvisor.service")
        _, job_id = spawn(conn, ["/bin/sh", "-c", "exit 0"])
        wait_for(lambda: daemon_active(host) in ("failed", "inactive"), timeout=60,
                 what="the daemon to die after the River claim")
        # Killed after the claim's commit, before any start: the job is held, its run queued.
        assert river_state(conn, job_id) == "running"
        run = run_of(conn, job_id)
        assert run is not None and run["state"] == "queued"
        host.tb.run("systemctl", "reset-failed", "unitvisor.service", check=False)
        host.start()  # no fault now
        wait_for(lambda: river_state(conn, job_id) == "completed", timeout=90, what="the River job to be completed")
        assert host.wait_run(str(run["id"]), timeout=60)["state"] == "succeeded"
        assert conn.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0] == 1
        assert len(journal_invocations(host, f"unitvisor-run-{run['id']}-1.service")) == 1
