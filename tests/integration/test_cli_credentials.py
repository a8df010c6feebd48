"""Issue 24, the operator's day, through the real `unitvisor` executable against the real database: the
admin's DSN in a private file (--dsn-file, $UNITVISOR_DSN_FILE), refusals that say how to pass the DSN
they need, a host draining itself with its own DSN, `hosts forget` dropping the retired host's role, and
`show` naming the drained host and the time of a retry's next attempt."""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from collections.abc import Callable
from datetime import UTC, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from supervisor import store, unitspec
from supervisor.outcomes import Outcome
from tests.harness.postgres import Postgres
from tests.integration.conftest import (
    CliResult,
    age_jobs,
    ensure_login_role,
    register,
    unitvisor_command,
)
from tests.integration.test_cli_db import assert_one_line_error
from tests.integration.test_cli_roles import add

HOW_TO_PASS = "pass its DSN with --dsn-file or UNITVISOR_DSN_FILE"


@pytest.fixture
def run_cli(empty_config: Path) -> Callable[..., CliResult]:
    """The executable with exactly this environment (UNITVISOR_* and PG* scrubbed, then `env` added)."""

    def run(*args: str, env: dict[str, str] | None = None, config: Path | None = None) -> CliResult:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("UNITVISOR_", "PG"))}
        command, needs = unitvisor_command()
        proc = subprocess.run([*command, "--config", str(config or empty_config), *args],
                              env={**clean, **needs, **(env or {})}, capture_output=True, text=True, timeout=60,
                              cwd="/")
        return CliResult(proc.returncode, proc.stdout, proc.stderr)

    return run


def dsn_file(tmp_path: Path, dsn: str, mode: int = 0o600) -> Path:
    path = tmp_path / f"{uuid.uuid4().hex[:6]}.dsn"
    path.write_text(dsn + "\n")
    path.chmod(mode)
    return path


@pytest.fixture
def host(cli, dsn: str, conn: psycopg.Connection, tmp_path: Path) -> tuple[str, str, Path]:
    """A host id of this test's own (roles are the cluster's), made by `hosts add` and registered:
    (host id, its DSN, a config naming it as this host's [host] id)."""
    host_id = f"web-{uuid.uuid4().hex[:8]}"
    added = add(cli, dsn, host_id)
    assert added.returncode == 0, added.stderr
    host_dsn = json.loads(added.stdout)["dsn"]
    with store.connect(host_dsn) as session:
        register(session, host_id)
    config = tmp_path / "unitvisor.toml"
    config.write_text(f'[host]\nid = "{host_id}"\n')
    return host_id, host_dsn, config


# -- the admin's DSN in a file ---------------------------------------------------------------------------


def test_the_dsn_comes_from_a_private_file_named_by_flag_or_environment(run_cli, dsn: str, tmp_path: Path) -> None:
    private = dsn_file(tmp_path, dsn)
    by_flag = run_cli("hosts", "--dsn-file", str(private))
    assert by_flag.returncode == 0, by_flag.stderr
    by_env = run_cli("hosts", env={"UNITVISOR_DSN_FILE": str(private)})
    assert by_env.returncode == 0, by_env.stderr
    before = run_cli("--dsn-file", str(private), "hosts", "--json")  # before the command, as --dsn
    assert before.returncode == 0 and json.loads(before.stdout) == []


def test_a_dsn_file_others_may_read_is_refused(run_cli, dsn: str, tmp_path: Path) -> None:
    readable = dsn_file(tmp_path, make_conninfo(dsn, password="hunter2"), 0o644)
    line = assert_one_line_error(run_cli("hosts", "--dsn-file", str(readable)), 1)
    assert line == (f"unitvisor: {readable} holds the database DSN but its mode 0644 lets group or others read it; "
                    f"chmod 600 {readable}")
    line = assert_one_line_error(run_cli("hosts", env={"UNITVISOR_DSN_FILE": str(readable)}), 1)
    assert "mode 0644" in line and "hunter2" not in line


# -- a host drains itself ------------------------------------------------------------------------------------


def test_draining_a_dead_host_says_nothing_changed(cli, host: tuple[str, str, Path], conn: psycopg.Connection,
                                                  dsn: str) -> None:
    """set_host_state leaves a dead host dead (it becomes live only by registering): `drain` printed
    "dead -> draining" as if it had drained it."""
    host_id, _, _ = host
    conn.execute("UPDATE unitvisor.hosts SET state = 'dead' WHERE id = %s", (host_id,))
    line = assert_one_line_error(cli("drain", host_id, dsn=dsn), 1)
    assert line.startswith(f"unitvisor: host {host_id} is dead: nothing changed")
    assert conn.execute("SELECT state FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone() == ("dead",)


def test_a_host_drains_and_undrains_itself_with_its_own_dsn(cli, host: tuple[str, str, Path],
                                                           conn: psycopg.Connection) -> None:
    host_id, host_dsn, config = host
    drained = cli("drain", dsn=host_dsn, config=config)
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout == f"host {host_id}: active -> draining\n"
    assert conn.execute("SELECT state FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone() == ("draining",)
    undrained = cli("undrain", host_id, dsn=host_dsn, config=config)
    assert undrained.stdout == f"host {host_id}: draining -> active\n"


def test_a_host_may_not_drain_another(cli, host: tuple[str, str, Path], conn: psycopg.Connection) -> None:
    _, host_dsn, config = host
    register(conn, "other")
    line = assert_one_line_error(cli("drain", "other", dsn=host_dsn, config=config), 1)
    assert "refused `unitvisor drain`" in line and "may not act as host other" in line
    assert line.endswith(f"it needs unitvisor_admin, or the role of host other: {HOW_TO_PASS}"), line
    assert conn.execute("SELECT state FROM unitvisor.hosts WHERE id = 'other'").fetchone() == ("active",)


# -- hosts forget drops the retired host's role -------------------------------------------------------------


def stopped(host_dsn: str, host_id: str) -> None:
    with store.connect(host_dsn) as session:
        store.mark_host_stopped(session, register(session, host_id))


def test_hosts_forget_drops_the_hosts_login_role_and_says_so(cli, dsn: str, host: tuple[str, str, Path],
                                                             conn: psycopg.Connection) -> None:
    host_id, host_dsn, _ = host
    stopped(host_dsn, host_id)
    role = store.default_host_role_name(host_id)
    result = cli("hosts", "forget", host_id, dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"host {host_id} forgotten; its login role {role} dropped: its DSN logs in no more\n")
    assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None
    with pytest.raises(store.DatabaseError):
        store.connect(host_dsn)


def test_hosts_forget_by_an_admin_that_may_not_drop_roles_changes_nothing_and_says_how(
        cli, dsn: str, host: tuple[str, str, Path], conn: psycopg.Connection, postgres: Postgres) -> None:
    host_id, host_dsn, _ = host
    stopped(host_dsn, host_id)
    role = store.default_host_role_name(host_id)
    ensure_login_role(postgres, "uvtest_admin", store.ADMIN_ROLE)
    admin = make_conninfo(dsn, user="uvtest_admin")
    line = assert_one_line_error(cli("hosts", "forget", host_id, dsn=admin), 1)
    assert f"host {host_id} is not forgotten: dropping its login role {role} needs the right to create roles" in line
    assert "runuser -u postgres -- unitvisor" in line and "--keep-role" in line
    assert conn.execute("SELECT state FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone() == ("stopped",)
    kept = cli("hosts", "forget", host_id, "--keep-role", dsn=admin)
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.startswith(f"host {host_id} forgotten; its login role {role} kept (--keep-role)")
    # The role without its host: a forget by a role that may drop it finishes the job.
    again = cli("hosts", "forget", host_id, dsn=dsn)
    assert again.stdout == (f"host {host_id} was forgotten before; its login role {role} dropped: its DSN logs in "
                            "no more\n")


# -- hosts confirm-down: the operator's word, the admin's only ---------------------------------------------


def test_hosts_confirm_down_marks_the_host_and_a_host_role_may_not(cli, dsn: str, host: tuple[str, str, Path],
                                                                    conn: psycopg.Connection) -> None:
    host_id, host_dsn, config = host
    register(conn, "other")
    line = assert_one_line_error(cli("hosts", "confirm-down", "other", dsn=host_dsn, config=config), 1)
    assert "refused `unitvisor hosts confirm-down`" in line and "unitvisor_admin (the database owner)" in line, line
    assert conn.execute("SELECT down_confirmed_at FROM unitvisor.hosts WHERE id = 'other'").fetchone() == (None,)
    result = cli("hosts", "confirm-down", "other", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ("host other (active) confirmed down: declared dead once silent for its "
                             "host_dead_after, unless it is heard from first\n")
    [other] = [h for h in json.loads(cli("hosts", "--json", dsn=dsn).stdout) if h["id"] == "other"]
    assert other["down_confirmed_at"] is not None and other["down_confirmed_by"] == conn.info.user
    assert other["returned_late_at"] is None  # never late (test_fleet_upkeep)
    assert f"other: confirmed down by {conn.info.user}" in cli("hosts", dsn=dsn).stdout
    line = assert_one_line_error(cli("hosts", "confirm-down", "nobody", dsn=dsn), 1)
    assert line == "unitvisor: no host nobody (see `unitvisor hosts`)", line


# -- show: the drained host by name, and the next attempt's time -------------------------------------------


def test_show_names_the_drained_host_a_run_waits_for(cli, dsn: str, conn: psycopg.Connection) -> None:
    fence = register(conn, "web-1")
    store.set_host_state(conn, "web-1", "draining")
    run_id = store.submit_run(conn, argv=["/bin/true"])
    age_jobs(conn)
    store.explain_waiting(conn, timedelta(0))
    assert fence and store.get_run(conn, run_id).wait_reason.startswith("no live host (every host")
    shown = cli("show", str(run_id), dsn=dsn)
    assert "  waiting:   no live host: host web-1 is draining\n" in shown.stdout, shown.stdout
    data = json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)
    assert data["wait_reason"] == "no live host: host web-1 is draining"


def test_show_says_when_a_retry_is_due(cli, dsn: str, conn: psycopg.Connection) -> None:
    fence = register(conn, "web-1")
    run_id = store.submit_run(conn, argv=["/bin/false"], max_attempts=2)
    age_jobs(conn)
    [(_, attempt)] = store.claim(conn, fence, 1, unitspec.UNIT_NAME_FORMAT)
    store.record_outcome(conn, fence, attempt, Outcome("exit-code", "exit:1", "exited 1"), "queued",
                         timedelta(minutes=10))
    due = store.next_attempt_at(conn, run_id)
    data = json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)
    assert data["next_attempt_at"] == due.astimezone(UTC).isoformat()
    shown = cli("show", str(run_id), dsn=dsn).stdout
    # 10 minutes less the time since the outcome, to the second: 10m00s when the two CLI calls took under
    # half a second in all (seen once), 9m59s and down otherwise.
    assert re.search(rf"  waiting:   its retry: next attempt at {re.escape(due.astimezone(UTC).isoformat())} "
                     r"\(in (9m[0-5]\ds|10m00s)\)", shown), shown
    age_jobs(conn)
    assert json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)["next_attempt_at"] is None
