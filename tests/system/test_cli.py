"""The operator's commands end to end on a test bed host: real systemd, PostgreSQL and journald."""

from __future__ import annotations

import json

import psycopg

from tests.harness.host import VENV_BIN, Host, wait_for


def test_logs_of_a_run_also_after_its_unit_is_gone(host: Host) -> None:
    host.start()
    run_id = host.submit("--", "/bin/sh", "-c", "for i in 1 2 3; do echo line $i; done; echo oops >&2")
    data = host.wait_run(run_id)
    wait_for(lambda: not host.loaded_run_units(), what="the unit to be gone")
    out = wait_for(lambda: (o := host.cli("logs", run_id[:8], "--attempt", "1").stdout) and "oops" in o and o,
                   what="the run's output in the journal")
    assert [line.split(": ", 1)[1] for line in out.splitlines()] == ["line 1", "line 2", "line 3", "oops"]
    assert host.cli("logs", run_id, "-n", "1").stdout.strip().endswith("oops")
    assert data["logs_command"] == f"journalctl UNITVISOR_RUN={run_id}"
    missing = host.cli("logs", run_id, "--attempt", "2", check=False)
    assert (missing.returncode, missing.stderr.count("\n")) == (1, 1)


def test_logs_of_a_run_on_another_host_says_where(host: Host) -> None:
    with psycopg.connect(host.dsn, autocommit=True) as conn:
        run_id = conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])").fetchone()[0]
        conn.execute("UPDATE unitvisor.spawn_jobs SET state = 'claimed', claimed_by = 'other-host'")
        conn.execute("INSERT INTO unitvisor.attempts (run_id, attempt, host_id, unit_name) VALUES "
                     "(%s, 1, 'other-host', %s)", (run_id, f"unitvisor-run-{run_id}-1.service"))
    result = host.cli("logs", str(run_id), check=False)
    assert result.returncode == 1
    assert "ran on host other-host" in result.stderr and "journalctl UNITVISOR_RUN=" in result.stderr


def test_wait_exit_codes(host: Host) -> None:
    host.start()
    ok = host.submit("--", "/bin/sh", "-c", "sleep 1")
    bad = host.submit("--", "/bin/false")
    slow = host.submit("--", "/bin/sleep", "300")
    assert host.cli("wait", ok).returncode == 0
    assert host.cli("wait", bad, check=False).returncode == 1
    timed_out = host.cli("wait", slow, "--timeout", "1s", check=False)
    assert timed_out.returncode == 124 and "still" in timed_out.stderr
    host.cli("cancel", slow)
    assert host.cli("wait", slow, check=False).returncode == 1


def test_hosts_drain_and_undrain(host: Host) -> None:
    host.start()
    [row] = json.loads(host.cli("hosts", "--json").stdout)
    assert (row["id"], row["state"], row["in_flight"]) == ("testhost-1", "active", 0)
    assert row["heartbeat_age_seconds"] < 30
    assert "testhost-1" in host.cli("hosts").stdout
    assert "active -> draining" in host.cli("drain", "testhost-1").stdout
    run_id = host.submit("--", "/bin/true")  # at once: the drain holds before the next claim
    host.stop()
    host.start()  # a draining host stays draining across restarts, and claims nothing
    # Proof that the daemon saw the run and left it: the fleet's upkeep says why it waits.
    # (Its event: `show` says why at once as the admin, from fleet_refusal, before any daemon looked.)
    data = wait_for(lambda: (d := host.show(run_id)) and [e for e in d["events"]
                                                          if (e["reason"] or "").startswith("waiting: ")] and d,
                    timeout=30, what="the reason it waits")
    # Issue 24: the reason names the drained host, not "every host is dead, stopped, draining or silent".
    assert data["attempts"] == [] and data["wait_reason"] == "no live host: host testhost-1 is draining"
    assert "draining" in host.unit_props("unitvisor.service", "StatusText")["StatusText"]
    host.cli("undrain", "testhost-1")
    assert host.wait_run(run_id, timeout=30)["state"] == "succeeded"
    # The daemon saw the undrain at a heartbeat and said so once in its journal (and the drain once,
    # when a heartbeat came between it and the stop; the restarted daemon registered as draining).
    said = [line for line in host.daemon_log().splitlines() if "host-state" in line]
    assert said and "state=active before=draining" in said[-1], said
    assert sum("state=active" in line for line in said) == 1 and len(said) <= 2, said
    unknown = host.cli("drain", "no-such-host", check=False)
    assert unknown.returncode == 1 and "no host no-such-host" in unknown.stderr


def test_reconcile_dry_run_prints_and_changes_nothing_then_a_pass_repairs(host: Host) -> None:
    host.start()
    run_id = host.submit("--", *host.gated("repair", exit_code=5))
    wait_for(lambda: host.show(run_id)["state"] == "running", what="the run to be running")
    host.stop()
    host.open_gate("repair")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: host.unit_props(unit, "ActiveState")["ActiveState"] == "failed", what="the run to end")
    config = ["--config", "/etc/unitvisor/unitvisor.toml"]
    dry = host.cli(*config, "reconcile", "--dry-run").stdout
    assert unit in dry and "settle" in dry
    assert host.show(run_id)["state"] == "running"
    assert unit in host.loaded_run_units()
    real = host.cli(*config, "reconcile").stdout
    assert "settle" in real
    data = host.show(run_id)
    assert (data["state"], data["attempts"][0]["exit_status"]) == ("failed", "exit:5")
    assert unit not in host.loaded_run_units()
    assert "nothing to reconcile" in host.cli(*config, "reconcile", "--dry-run").stdout


def test_resume_runs_a_new_attempt_with_the_row_as_it_is_now(host: Host) -> None:
    host.start()
    run_id = host.submit("--memory", "64M", "--", "/bin/false")
    assert host.wait_run(run_id)["state"] == "failed"
    with psycopg.connect(host.dsn, autocommit=True) as conn:
        conn.execute("UPDATE unitvisor.runs SET argv = ARRAY['/bin/true'], memory_max = %s WHERE id = %s",
                     (128 << 20, run_id))
    assert "queued again" in host.cli("resume", run_id).stdout
    data = host.wait_run(run_id)
    assert data["state"] == "succeeded"
    assert [a["attempt"] for a in data["attempts"]] == [1, 2]
    assert data["attempts"][1]["unit"].endswith("-2.service")
    refused = host.cli("resume", run_id, check=False)
    assert refused.returncode == 1 and "succeeded" in refused.stderr


def test_doctor(host: Host) -> None:
    host.start()
    result = host.cli("--config", "/etc/unitvisor/unitvisor.toml", "doctor", check=False)
    lines = dict((line.split()[1], line.split()[0]) for line in result.stdout.splitlines())
    assert lines["config"] == lines["database"] == lines["schema"] == lines["systemd"] == "ok"
    assert lines["slice"] == "ok"
    assert lines["host"] == "ok", result.stdout  # "host id": its own daemon is not another machine
    assert lines["cgroups"] in ("ok", "warn")
    # As root with the daemon's config, doctor checks the daemon's DSN and says so; the shell's --dsn
    # (host.cli gives one) is said apart.
    said = {line.split()[1]: line for line in result.stdout.splitlines()}
    assert "the daemon's DSN from /etc/unitvisor/dsn: reachable at" in said["database"], result.stdout
    assert said["shell"].split()[0] == "ok" and "--dsn gives the daemon's DSN" in said["shell"], result.stdout
    bad = "host=127.0.0.1 port=1 user=x dbname=x connect_timeout=2"
    down = host.tb.run(str(VENV_BIN / "unitvisor"), "--dsn", bad, "doctor", check=False)
    said = {line.split()[1]: line for line in down.stdout.splitlines()}
    assert said["database"].split()[0] == "ok", down.stdout
    assert said["shell"].split()[0] == "warn" and "not the daemon's" in said["shell"], down.stdout
    # Issue 24: the daemon's DSN does not connect while the shell's does. The old doctor checked --dsn
    # and said ok; the daemon would never have connected.
    host.tb.write("/etc/unitvisor/dsn", bad + "\n")
    try:
        broken = host.cli("doctor", check=False)
    finally:
        host.tb.write("/etc/unitvisor/dsn", host.dsn + "\n")
    said = {line.split()[1]: line for line in broken.stdout.splitlines()}
    assert broken.returncode == 1
    assert said["database"].startswith("fail") and "the daemon's DSN from /etc/unitvisor/dsn: " in said["database"]
    assert said["shell"].split()[0] == "ok" and "reachable at" in said["shell"], broken.stdout


def test_version(host: Host) -> None:
    assert host.cli("version").stdout.startswith("unitvisor ")
    assert host.cli("--version").stdout.startswith("unitvisor, version ")
