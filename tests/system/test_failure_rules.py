"""Failure rules on a real host (issue 25, item 3; sql/migrations/027_failure_rules.sql): a run that exits
75 is retried because retry_on names exit:75; one that exits 3 ends at once by fail_on exit:3 with
attempts left. One booted host, both runs at once: seconds once the host is up."""

from __future__ import annotations

from tests.harness.host import Host
from tests.system.test_retry_adopt import submit_sql


def test_exit_75_is_retried_and_exit_3_fails_at_once(host: Host) -> None:
    host.start()
    # Exits 75 (EX_TEMPFAIL) in its first attempt, 0 in the second: the attempt number ends the unit's
    # name, which is its cgroup's (a file in /tmp would not do: a run's /tmp may be its own).
    retried = submit_sql(host, "SELECT unitvisor.submit_run(ARRAY['/bin/sh', '-c', "
                               "'grep -q -- \"-1\\.service$\" /proc/self/cgroup && exit 75; exit 0'], "
                               "max_attempts => 3, retry_backoff_sec => 0, retry_on => ARRAY['exit:75'])")
    ended = submit_sql(host, "SELECT unitvisor.submit_run(ARRAY['/bin/sh', '-c', 'exit 3'], max_attempts => 5, "
                             "retry_backoff_sec => 0, fail_on => ARRAY['exit:3'])")
    data = host.wait_run(retried, states=("succeeded",), timeout=60)
    assert [(a["attempt"], a["outcome"], a["exit_status"]) for a in data["attempts"]] == [
        (1, "exit-code", "exit:75"), (2, "success", "exit:0")]
    data = host.wait_run(ended, states=("failed",), timeout=60)
    assert [(a["attempt"], a["exit_status"]) for a in data["attempts"]] == [(1, "exit:3")]
    assert data["events"][-1]["reason"].endswith("no retry: fail_on names exit:3")
    assert data["failure_rules"]["fail_on"] == ["exit:3"]
