"""[retention] under a real systemd: the daemon prunes finished runs older than keep_finished by itself,
in batches, and keeps the young ones; the pruning is in its journal."""

from __future__ import annotations

import psycopg

from tests.harness.host import DEFAULT_CONFIG, Host, wait_for

RETENTION = '\n[retention]\nkeep_finished = "1h"\nbatch_size = 2\ninterval = "1h"\n'


def test_the_daemon_prunes_old_finished_runs_in_batches_and_keeps_young_ones(host: Host) -> None:
    host.start()
    runs = [host.submit("--", "/bin/true") for _ in range(4)]
    for run_id in runs:
        host.wait_run(run_id)
    host.stop()
    old, young = runs[:3], runs[3]
    with psycopg.connect(host.dsn, autocommit=True) as conn:
        conn.execute("UPDATE unitvisor.runs SET finished_at = now() - interval '2 hours' WHERE id = ANY(%s::uuid[])",
                     (old,))
    host.configure(config=DEFAULT_CONFIG.format(host_id=host.host_id, runs_extra="") + RETENTION)
    host.start()

    def gone() -> bool:
        shown = {run_id: host.cli("show", run_id, check=False).returncode for run_id in runs}
        return all(shown[run_id] != 0 for run_id in old) and shown[young] == 0
    # Three old runs in batches of two: a full batch, then the rest half a second later (not an hour).
    wait_for(gone, timeout=60, what="the old runs to be pruned and the young one kept")
    log = host.daemon_log()
    assert "pruned runs=2 attempts=2 events=8" in log and "pruned runs=1 attempts=1 events=4" in log, log
    assert host.show(young)["state"] == "succeeded"
