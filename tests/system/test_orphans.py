"""A unit of ours is only ever stopped as an orphan when its attempt row is gone or settled: never a
run that a reconcile pass by hand did not see claimed, never a run of another host id."""

from __future__ import annotations

import threading

import psycopg

from tests.harness.host import Host, wait_for

CONFIG = """
[host]
id = "{host_id}"

[daemon]
poll_interval = "1s"

[systemd]
stop_grace = "1s"

[fleet]
host_dead_after = "6s"

[runs]
allowed_executables = ["/bin/sleep", "/bin/true"]
"""


def test_reconcile_by_hand_beside_the_claiming_daemon_stops_no_run(host: Host) -> None:
    host.start()
    stop = threading.Event()
    passes = []

    def reconcile_by_hand() -> None:
        while not stop.is_set():
            passes.append(host.cli("reconcile", check=False).returncode)

    by_hand = threading.Thread(target=reconcile_by_hand, daemon=True)
    by_hand.start()
    try:
        with psycopg.connect(host.dsn, autocommit=True) as conn:
            run_ids = []
            for _ in range(8):  # bursts, so that claims and starts land inside the passes
                run_ids += [str(r[0]) for r in conn.execute(
                    "SELECT unitvisor.submit_run(ARRAY['/bin/sleep', '2']) FROM generate_series(1, 5)")]
                wait_for(lambda: len(passes) >= 1, what="a pass by hand")
        results = [host.wait_run(run_id, timeout=90) for run_id in run_ids]
    finally:
        stop.set()
        by_hand.join(timeout=60)
    assert passes and set(passes) == {0}, passes
    for data in results:
        assert [(a["outcome"], a["exit_status"]) for a in data["attempts"]] == [("success", "exit:0")], \
            [(a["outcome"], a["reason"]) for a in data["attempts"]]
    assert "stop-orphan" not in host.daemon_log()


def test_a_changed_host_id_leaves_the_old_ids_runs_alone_until_that_id_is_declared_dead(host: Host) -> None:
    host.configure(config=CONFIG.format(host_id="old-id"))
    host.start()
    run_id = host.submit("--count-lost", "--", "/bin/sleep", "300")  # lost ends it (027): one attempt to look at
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: host.show(run_id)["state"] == "running", what="the run to run under the old id")
    host.configure(config=CONFIG.format(host_id="new-id"))
    host.tb.run("systemctl", "restart", "unitvisor.service")
    # The new id sees a unit whose attempt is open on another host: left running, not an orphan.
    wait_for(lambda: "its attempt is open on host old-id" in host.daemon_log(), timeout=30,
             what="the new daemon to leave the old id's unit alone")
    assert host.unit_props(unit, "SubState")["SubState"] == "running"
    # The old id falls silent; once it is declared dead its attempt is lost, and the unit is stale.
    data = host.wait_run(run_id, timeout=60)
    assert [(a["host"], a["outcome"]) for a in data["attempts"]] == [("old-id", "lost")], data
    assert "declared dead by host new-id" in data["attempts"][0]["reason"]
    wait_for(lambda: host.unit_props(unit, "ActiveState").get("ActiveState") in ("inactive", "failed", ""),
             timeout=30, what="the stale unit to be stopped")
    assert "stop-stale" in host.daemon_log()
