"""What one host claims, under a real systemd: never a run it may not run, never stuck behind a run
that does not fit, nothing at all without root; and `hosts forget`."""

from __future__ import annotations

from datetime import datetime

from tests.harness.host import Host, wait_for

BUDGETED = """
[host]
id = "testhost-1"
memory_budget = "100M"

[daemon]
poll_interval = "1s"

[runs]
allowed_executables = ["/bin/sh", "/bin/true", "/bin/sleep"]
"""


def attempt_times(host: Host, run_id: str) -> tuple[datetime, datetime]:
    [attempt] = host.show(run_id)["attempts"]
    return datetime.fromisoformat(attempt["started_at"]), datetime.fromisoformat(attempt["ended_at"])


def test_a_run_over_the_budget_waits_and_smaller_runs_behind_it_still_start(host: Host) -> None:
    host.configure(config=BUDGETED)
    host.start()
    oversized = host.submit("--memory", "1G", "--priority", "10", "--", "/bin/true")
    small = [host.submit("--memory", "10M", "--", "/bin/true") for _ in range(3)]
    for run_id in small:
        assert host.wait_run(run_id)["state"] == "succeeded"
    data = wait_for(lambda: (d := host.show(oversized))["wait_reason"] and d, timeout=30, what="the reason it waits")
    assert data["attempts"] == []
    assert data["wait_reason"] == ("no live host accepts it: memory_max 1073741824 bytes is over the memory budget "
                                   "(testhost-1)")


def test_a_run_that_does_not_fit_now_is_backfilled_around_then_starts(host: Host) -> None:
    host.configure(config=BUDGETED)
    host.start()
    big = host.submit("--memory", "80M", "--", *host.gated("big"))
    wait_for(lambda: host.show(big)["state"] == "running", what="the 80M run to run")
    # 50M does not fit beside 80M in 100M; the 10M run behind it does, and must not wait for it.
    blocked = host.submit("--memory", "50M", "--priority", "5", "--", "/bin/true")
    behind = host.submit("--memory", "10M", "--", "/bin/true")
    assert host.wait_run(behind)["state"] == "succeeded"
    assert host.show(blocked)["attempts"] == [], "the 50M run started while 80M of the 100M budget was in use"
    assert host.show(big)["state"] == "running"
    host.open_gate("big")
    assert host.wait_run(blocked, timeout=60)["state"] == "succeeded"
    _, big_end = attempt_times(host, big)
    blocked_start, _ = attempt_times(host, blocked)
    assert blocked_start >= big_end, "the 50M run started while 80M of the 100M budget was in use"


def test_a_daemon_without_root_claims_nothing_and_says_why(host: Host) -> None:
    """systemd starts units only for root: a daemon running as another user must leave the fleet's
    runs to hosts that can run them, not claim and fail them."""
    host.configure()
    host.tb.run("chmod", "0644", "/etc/unitvisor/unitvisor.toml")
    host.start(environment={"UNITVISOR_DSN": host.dsn}, configure=False, user="nobody")
    run_id = host.submit("--", "/bin/true")
    data = wait_for(lambda: (d := host.show(run_id))["wait_reason"] and d, timeout=30, what="the reason it waits")
    assert data["attempts"] == []
    assert "cannot start units (the daemon is not root" in data["wait_reason"]
    status = host.unit_props("unitvisor.service", "StatusText")["StatusText"]
    assert "not root: claiming nothing" in status
    assert "claims nothing: the daemon is not root" in host.cli("hosts").stdout
    # Both services name /run/unitvisor as their RuntimeDirectory, and the one that starts last makes it
    # its user's, mode 0700: the fence (root) started after this daemon takes it away from it (a
    # rehearsal's daemon met it at its start, and never got past "internal error" to READY). The
    # records it can no longer read are said once, and the daemon goes on.
    invocation = host.unit_props("unitvisor.service", "InvocationID")["InvocationID"]

    def said() -> str:  # this daemon's own lines: the test bed's journal holds the module's earlier ones
        return host.tb.run("journalctl", f"_SYSTEMD_INVOCATION_ID={invocation}", "--no-pager", "-o", "cat").stdout

    host.tb.run("systemctl", "restart", "unitvisor-fence.service")
    host.tb.run("systemctl", "daemon-reload")  # which makes the daemon reconcile at once
    wait_for(lambda: "fence-records-unreadable" in said(), what="the daemon to say it cannot read them")
    host.tb.run("systemctl", "daemon-reload")
    wait_for(lambda: said().count("systemd-reloaded") >= 2, what="a second pass")
    assert "internal error" not in said() and said().count("fence-records-unreadable") == 1, said()
    status = host.unit_props("unitvisor.service", "StatusText")["StatusText"]
    assert "not root: claiming nothing" in status and "retrying" not in status, status


def test_hosts_forget_only_a_stopped_or_dead_host_with_nothing_open(host: Host) -> None:
    host.start()
    refused = host.cli("hosts", "forget", "testhost-1", check=False)
    assert refused.returncode == 1 and "is active" in refused.stderr
    unknown = host.cli("hosts", "forget", "no-such-host", check=False)
    assert unknown.returncode == 1 and "no host no-such-host" in unknown.stderr
    host.stop()
    assert "forgotten" in host.cli("hosts", "forget", "testhost-1").stdout
    assert "testhost-1" not in host.cli("hosts").stdout
