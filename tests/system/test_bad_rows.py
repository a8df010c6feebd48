"""Rows a control plane should never write, written anyway (constraints dropped): each attempt gets a
clear reason, the daemon keeps running, and the other runs are untouched."""

from __future__ import annotations

import json

import psycopg

from tests.harness.host import VENV_BIN, Host, daemon_active, wait_for


def insert_raw(dsn: str, argv: list[str], environment: object) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE unitvisor.runs DROP CONSTRAINT IF EXISTS runs_environment_valid")
        conn.execute("ALTER TABLE unitvisor.runs DROP CONSTRAINT IF EXISTS runs_argv_valid")
        conn.execute("DROP TRIGGER IF EXISTS runs_argv0_normalised ON unitvisor.runs")
        conn.execute("DROP TRIGGER IF EXISTS runs_arguments_valid ON unitvisor.runs")  # the checks since schema 22
        run_id = conn.execute(
            "INSERT INTO unitvisor.runs (argv, environment) VALUES (%s, %s::jsonb) RETURNING id",
            (argv, json.dumps(environment))).fetchone()[0]
        conn.execute("INSERT INTO unitvisor.spawn_jobs (run_id) VALUES (%s)", (run_id,))
    return str(run_id)


def test_malformed_rows_are_refused_and_the_daemon_goes_on(host: Host) -> None:
    # The names of the malformed values below are allowed, so that this host claims those rows and its
    # own check of each value refuses them (a name no host allows is never claimed: see unmatched).
    host.configure(runs_extra='allowed_environment = ["OK", "N"]\n')
    host.start()
    good_before = host.submit("--", "/bin/true")
    bad = {
        "env newline": insert_raw(host.dsn, ["/bin/true"], {"OK": "a\nb"}),
        "env not an object": insert_raw(host.dsn, ["/bin/true"], ["A=1"]),
        "env value not a string": insert_raw(host.dsn, ["/bin/true"], {"N": 5}),
        "dotted argv0 an allowlist glob matches": insert_raw(host.dsn, ["/usr/bin/.."], {}),
    }
    # No allowlist entry can match these, so no host claims them: they wait, and say why.
    unmatched = {
        "env name": insert_raw(host.dsn, ["/bin/true"], {"BAD NAME": "x"}),  # no allowlist can name it
        "relative argv0": insert_raw(host.dsn, ["true"], {}),
        "dotted argv0": insert_raw(host.dsn, ["/usr/bin/../../bin/true"], {}),
    }
    good_after = host.submit("--", "/bin/true")
    for what, run_id in bad.items():
        data = host.wait_run(run_id)
        [attempt] = data["attempts"]
        assert attempt["outcome"] == "refused", what
        assert attempt["reason"], what
    for what, run_id in unmatched.items():
        data = wait_for(lambda r=run_id: (d := host.show(r))["wait_reason"] and d, timeout=30, what=what)
        assert data["attempts"] == [] and "is not allowed" in data["wait_reason"], what
    assert host.wait_run(good_before)["state"] == "succeeded"
    assert host.wait_run(good_after)["state"] == "succeeded"
    assert daemon_active(host) == "active"
    assert host.unit_props("unitvisor.service", "NRestarts")["NRestarts"] == "0"


def test_status_reports_counts(host: Host) -> None:
    host.start()
    host.wait_run(host.submit("--", "/bin/true"))
    running = host.submit("--", "/bin/sleep", "300")
    wait_for(lambda: host.show(running)["state"] == "running", what="the run to be running")
    status = host.unit_props("unitvisor.service", "StatusText")["StatusText"]
    assert counts(status) == "runs in flight: 1, claimed since start: 2, settled since start: 1", status
    host.cli("cancel", running)
    host.wait_run(running)
    wait_for(lambda: counts(host.unit_props("unitvisor.service", "StatusText")["StatusText"])
             == "runs in flight: 0, claimed since start: 2, settled since start: 2", what="STATUS= to count the cancel")


# On a cgroup-v1 test bed STATUS= also says why admission by pressure is off (a cgroup-v2 host with
# PSI says nothing of it while it claims freely): the counts come first, that sentence after them.
PSI_OFF = "admission by pressure off: /sys/fs/cgroup is not cgroup v2 (PSI per slice needs it)"


def counts(status: str) -> str:
    """STATUS='s counts, once the only other thing it says is that sentence."""
    return status.removesuffix(f"; {PSI_OFF}")


def test_empty_allowlist_claims_nothing_and_says_so(host: Host) -> None:
    """A freshly installed host (no allowlist yet) must not fail the fleet's runs: it claims none."""
    host.configure(config='[host]\nid = "testhost-1"\n[daemon]\npoll_interval = "2s"\n')
    host.start()
    run_id = host.submit("--", "/bin/true")
    data = wait_for(lambda: (d := host.show(run_id))["wait_reason"] and d, timeout=30, what="the reason it waits")
    assert data["attempts"] == []
    assert data["wait_reason"] == "no live host accepts it: executable /bin/true is not allowed (testhost-1)"
    assert "allowlist-empty" in host.daemon_log()


def test_bad_config_stops_start_up_with_one_clear_message(host: Host) -> None:
    host.configure(config='[runs]\nallowed_executables = ["/bin/true"]\nbogus_key = 1\n')
    host.install_units()
    result = host.tb.run("systemctl", "start", "unitvisor.service", check=False, timeout=60)
    assert result.returncode != 0
    log = host.daemon_log()
    assert "[runs] bogus_key: unknown key" in log
    assert "Traceback" not in log


def test_no_database_configured_waits_and_says_so_then_picks_it_up(host: Host) -> None:
    host.configure()
    host.tb.run("rm", "-f", "/etc/unitvisor/dsn")
    host.start()  # the start job succeeds: the daemon is up, waiting
    status = host.unit_props("unitvisor.service", "StatusText")["StatusText"]
    assert "waiting for a database" in status and "no database configured" in status
    host.configure()  # writes the DSN file
    run_id = host.submit("--", "/bin/true")
    assert host.wait_run(run_id, timeout=60)["state"] == "succeeded"
    assert host.unit_props("unitvisor.service", "NRestarts")["NRestarts"] == "0"


def test_a_dsn_file_others_may_read_is_refused_by_the_daemon_and_doctor_until_fixed(host: Host) -> None:
    """As ssh with a private key: the DSN holds the database password, so a DSN file that group or
    others may read is not used. The daemon stays up and says why; doctor fails with the fix."""
    host.configure()
    host.tb.run("chmod", "644", "/etc/unitvisor/dsn")
    host.start()
    problem = "/etc/unitvisor/dsn holds the database DSN but its mode 0644 lets group or others read it"
    status = wait_for(lambda: problem in (s := host.unit_props("unitvisor.service", "StatusText")["StatusText"]) and s,
                      timeout=30, what="STATUS= to name the DSN file's mode")
    assert "chmod 600 /etc/unitvisor/dsn" in status
    doctor = host.tb.run(str(VENV_BIN / "unitvisor"), "doctor", check=False)
    assert doctor.returncode == 1
    assert f"{problem}; chmod 600 /etc/unitvisor/dsn" in doctor.stdout
    assert host.dsn not in doctor.stdout + doctor.stderr + host.daemon_log()  # the DSN never leaks
    host.tb.run("chmod", "600", "/etc/unitvisor/dsn")
    assert host.wait_run(host.submit("--", "/bin/true"), timeout=60)["state"] == "succeeded"
    assert host.unit_props("unitvisor.service", "NRestarts")["NRestarts"] == "0"


def test_a_column_added_by_hand_and_a_held_row_lock_leave_the_daemon_running(host: Host) -> None:
    """A control plane adds its own columns; someone holds a lock on a row the daemon needs. Neither
    may end the daemon: rows are read by explicit columns, and every session has a lock_timeout."""
    host.start()
    with psycopg.connect(host.dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE unitvisor.runs ADD COLUMN book_id text")
        conn.execute("ALTER TABLE unitvisor.attempts ADD COLUMN billed boolean NOT NULL DEFAULT false")
        conn.execute("ALTER TABLE unitvisor.hosts ADD COLUMN rack text")
    assert host.wait_run(host.submit("--", "/bin/true"))["state"] == "succeeded"
    with psycopg.connect(host.dsn) as locker:  # a transaction of someone else's, left open
        locker.execute("SELECT 1 FROM unitvisor.hosts WHERE id = 'testhost-1' FOR UPDATE")
        run_id = host.submit("--", "/bin/true")
        status = wait_for(lambda: "canceling statement due to lock timeout" in (
            s := host.unit_props("unitvisor.service", "StatusText").get("StatusText", "")) and s, timeout=60,
            what="STATUS= to say the daemon waits for a lock")
        assert "retrying" in status
        assert daemon_active(host) == "active"
        locker.rollback()
    assert host.wait_run(run_id, timeout=60)["state"] == "succeeded"
    assert daemon_active(host) == "active"
    assert host.unit_props("unitvisor.service", "NRestarts")["NRestarts"] == "0"


def test_a_host_row_deleted_by_hand_is_registered_again(host: Host) -> None:
    host.start()
    running = host.submit("--", *host.gated("deleted-row"))
    wait_for(lambda: host.show(running)["state"] == "running", what="the run to run")
    with psycopg.connect(host.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM unitvisor.hosts WHERE id = 'testhost-1'")
        wait_for(lambda: conn.execute("SELECT state FROM unitvisor.hosts WHERE id = 'testhost-1'").fetchone(),
                 timeout=30, what="the host to register again")
    host.open_gate("deleted-row")
    assert host.wait_run(running)["state"] == "succeeded"  # its run was adopted, not lost
    assert host.wait_run(host.submit("--", "/bin/true"))["state"] == "succeeded"
    assert daemon_active(host) == "active"
