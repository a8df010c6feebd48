"""`unitvisor hosts add`, and a command the database refuses to a role: the real executable, against
the real database, logged in as each kind of role (sql/004_roles.sql)."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from supervisor import store
from tests.harness.postgres import Postgres
from tests.integration.conftest import TEST_SUBMITTER, ensure_login_role, register
from tests.integration.test_cli_db import assert_one_line_error


def as_role(dsn: str, role: str) -> str:
    return make_conninfo(dsn, user=role)


@pytest.fixture
def host_id() -> str:
    """A host id of this test's own: roles are the cluster's, shared by every test database."""
    return f"web-{uuid.uuid4().hex[:8]}"


def add(cli, dsn: str, *args: str):
    return cli("hosts", "add", *args, "--json", dsn=dsn)


def test_hosts_add_creates_a_bound_login_role_and_prints_its_dsn(cli, dsn: str, conn: psycopg.Connection,
                                                                 host_id: str) -> None:
    result = add(cli, dsn, host_id)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    role = store.default_host_role_name(host_id)
    assert (out["host_id"], out["role"], out["config"]) == (host_id, role, f'[host]\nid = "{host_id}"')
    params = conninfo_to_dict(out["dsn"])
    ours = conninfo_to_dict(dsn)
    assert (params["user"], params["host"], params["port"], params["dbname"]) == (
        role, ours["host"], ours["port"], ours["dbname"])
    assert len(params["password"]) >= 32
    # Stored as a SCRAM verifier made on the client: the password itself never reached the server.
    stored, can_login = conn.execute("SELECT rolpassword, rolcanlogin FROM pg_authid WHERE rolname = %s",
                                     (role,)).fetchone()
    assert stored.startswith("SCRAM-SHA-256$") and params["password"] not in stored and can_login
    assert conn.execute("SELECT host_id FROM unitvisor.host_roles WHERE role_name = %s", (role,)).fetchone() == (
        host_id,)
    with store.connect(out["dsn"]) as host:
        assert store.whoami(host) == store.Identity("host", host_id)


def test_hosts_add_prints_the_dsn_and_the_config_line_for_people(cli, dsn: str, host_id: str) -> None:
    result = cli("hosts", "add", host_id, "--role", f"uvtest_{host_id.replace('-', '_')}", "--db-host",
                 "db.example.com", dsn=dsn)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert conninfo_to_dict(lines[0])["host"] == "db.example.com"
    assert conninfo_to_dict(lines[0])["user"] == f"uvtest_{host_id.replace('-', '_')}"
    assert lines[1:] == ["[host]", f'id = "{host_id}"']


def test_hosts_add_refuses_a_host_id_bound_already(cli, dsn: str, host_id: str) -> None:
    assert add(cli, dsn, host_id).returncode == 0
    line = assert_one_line_error(add(cli, dsn, host_id, "--role", "uvtest_other"), 1)
    assert f"host id {host_id} is bound to role {store.default_host_role_name(host_id)} already" in line
    assert "--new-password" in line


def test_hosts_add_new_password_rotates_the_password(cli, dsn: str, conn: psycopg.Connection,
                                                     host_id: str) -> None:
    first = json.loads(add(cli, dsn, host_id).stdout)
    role = first["role"]
    before = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,)).fetchone()[0]
    result = add(cli, dsn, host_id, "--new-password")
    assert result.returncode == 0, result.stderr
    second = json.loads(result.stdout)
    assert second["role"] == role and second["new_password"] is True
    assert conninfo_to_dict(second["dsn"])["password"] != conninfo_to_dict(first["dsn"])["password"]
    after = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,)).fetchone()[0]
    assert after != before


def connection_limit(conn: psycopg.Connection, role: str) -> int:
    return conn.execute("SELECT rolconnlimit FROM pg_roles WHERE rolname = %s", (role,)).fetchone()[0]


def test_hosts_add_gives_the_role_a_small_connection_limit(cli, dsn: str, conn: psycopg.Connection,
                                                           host_id: str) -> None:
    out = json.loads(add(cli, dsn, host_id).stdout)
    assert connection_limit(conn, out["role"]) == store.DEFAULT_HOST_CONNECTION_LIMIT == 5


def test_hosts_add_connection_limit_is_enforced_and_the_role_cannot_lift_it(cli, dsn: str, conn: psycopg.Connection,
                                                                           host_id: str) -> None:
    result = add(cli, dsn, host_id, "--connection-limit", "2")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert connection_limit(conn, out["role"]) == 2
    with store.connect(out["dsn"]) as first, store.connect(out["dsn"]):
        with pytest.raises(store.DatabaseUnavailable, match="too many connections for role"):
            store.connect(out["dsn"])
        # CONNECTION LIMIT is an attribute only a role that may create roles changes, unlike the password.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            first.execute(f'ALTER ROLE "{out["role"]}" CONNECTION LIMIT -1')
    assert connection_limit(conn, out["role"]) == 2


def test_hosts_add_new_password_sets_the_connection_limit_only_when_given(cli, dsn: str, conn: psycopg.Connection,
                                                                          host_id: str) -> None:
    role = json.loads(add(cli, dsn, host_id, "--connection-limit", "3").stdout)["role"]
    assert add(cli, dsn, host_id, "--new-password").returncode == 0
    assert connection_limit(conn, role) == 3
    assert add(cli, dsn, host_id, "--new-password", "--connection-limit", "7").returncode == 0
    assert connection_limit(conn, role) == 7


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_hosts_add_refuses_a_connection_limit_that_is_not_a_positive_number(cli, dsn: str, host_id: str,
                                                                            value: str) -> None:
    result = add(cli, dsn, host_id, "--connection-limit", value)
    assert result.returncode == 2 and "--connection-limit" in result.stderr


def test_hosts_add_new_password_refuses_while_the_host_is_live_unless_forced(cli, dsn: str, conn: psycopg.Connection,
                                                                           host_id: str) -> None:
    """A live daemon is locked out at its next reconnect (issue 21): refused before acting, in one line
    that says why and what to do; --force rotates, with a warning. (Failed on the old code: the rotation
    went through without a word.)"""
    role = json.loads(add(cli, dsn, host_id).stdout)["role"]
    before = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,)).fetchone()[0]
    with store.connect(dsn) as daemon:
        register(daemon, host_id)  # heartbeat: now
        line = assert_one_line_error(add(cli, dsn, host_id, "--new-password"), 1)
        assert f"host {host_id} is live" in line and "locked out at its next reconnect" in line
        assert "--force" in line and "drain and stop it first" in line
        assert conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,)).fetchone()[0] == before
        forced = add(cli, dsn, host_id, "--new-password", "--force")
        assert forced.returncode == 0, forced.stderr
        assert "warning: host" in forced.stderr and "write the new DSN on it now" in forced.stderr
        assert json.loads(forced.stdout)["new_password"] is True
        assert conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,)).fetchone()[0] != before


def test_hosts_add_force_goes_only_with_new_password(cli, dsn: str, host_id: str) -> None:
    assert_one_line_error(add(cli, dsn, host_id, "--force"), 2)


def test_hosts_add_new_password_of_an_unbound_host_id_is_an_error(cli, dsn: str, host_id: str) -> None:
    line = assert_one_line_error(add(cli, dsn, host_id, "--new-password"), 1)
    assert f"host id {host_id} has no role yet" in line


def test_a_host_role_cannot_add_hosts(cli, dsn: str, host_id: str) -> None:
    host_dsn = json.loads(add(cli, dsn, host_id).stdout)["dsn"]
    line = assert_one_line_error(add(cli, host_dsn, f"{host_id}-2"), 1)
    assert "it needs unitvisor_admin and the right to create roles" in line


def test_a_host_role_cannot_submit_and_is_told_which_role_can(cli, dsn: str, host_id: str) -> None:
    host_dsn = json.loads(add(cli, dsn, host_id).stdout)["dsn"]
    line = assert_one_line_error(cli("submit", "--", "/bin/true", dsn=host_dsn), 1)
    assert "refused `unitvisor submit`" in line and "it needs unitvisor_submitter" in line


def test_a_host_role_cannot_cancel(cli, dsn: str, host_id: str, conn: psycopg.Connection) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"])
    host_dsn = json.loads(add(cli, dsn, host_id).stdout)["dsn"]
    line = assert_one_line_error(cli("cancel", str(run_id), dsn=host_dsn), 1)
    assert "it needs unitvisor_submitter" in line
    assert store.get_run(conn, run_id).state == "queued"


@pytest.mark.parametrize("command", ["hold", "release"])
def test_a_host_role_cannot_hold_or_release(cli, dsn: str, host_id: str, conn: psycopg.Connection,
                                            command: str) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"], hold=command == "release")
    host_dsn = json.loads(add(cli, dsn, host_id).stdout)["dsn"]
    line = assert_one_line_error(cli(command, str(run_id), dsn=host_dsn), 1)
    assert f"refused `unitvisor {command}`" in line and "it needs unitvisor_submitter" in line


def test_a_submitter_cannot_drain_and_is_told_which_role_can(cli, dsn: str, postgres: Postgres) -> None:
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    line = assert_one_line_error(cli("drain", "h1", dsn=as_role(dsn, TEST_SUBMITTER)), 1)
    assert "refused `unitvisor drain`" in line
    assert line.endswith("it needs unitvisor_admin, or the role of host h1: pass its DSN with --dsn-file or "
                         "UNITVISOR_DSN_FILE"), line


def test_a_submitter_submits_cancels_resumes_and_reads_with_the_cli(cli, dsn: str, postgres: Postgres) -> None:
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    submitter = as_role(dsn, TEST_SUBMITTER)
    submitted = cli("submit", "--", "/bin/true", dsn=submitter)
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    assert cli("cancel", run_id, dsn=submitter).returncode == 0
    assert cli("resume", run_id, dsn=submitter).returncode == 0
    assert cli("hold", run_id, dsn=submitter).returncode == 0  # schema 030
    assert cli("release", run_id, dsn=submitter).returncode == 0
    shown = cli("show", run_id, "--json", dsn=submitter)
    assert shown.returncode == 0 and json.loads(shown.stdout)["state"] == "queued"
    assert run_id[:8] in cli("runs", dsn=submitter).stdout


@pytest.mark.parametrize("schema", ["before 004 (001 to 003)", "new (sql/schema.sql)"])
def test_migrate_by_a_role_that_may_not_create_roles_says_what_it_needs(cli, empty_dsn: str, postgres: Postgres,
                                                                         tmp_path, schema: str) -> None:
    """The one login role of a deployment before 004 owns the database but may not create or grant
    roles: migration 004 is refused, in one line, and nothing of it is left behind. So is a new
    database's schema.sql, which creates the roles as 004 does."""
    ensure_login_role(postgres, "uvtest_plain", "pg_monitor")  # any role: only the login matters
    dbname = conninfo_to_dict(empty_dsn)["dbname"]
    with store.connect(postgres.dsn) as superuser:
        superuser.execute(f"ALTER DATABASE {dbname} OWNER TO uvtest_plain")
    first = "001_schema"
    if schema.startswith("before"):
        for _version, path in store.migration_files()[:3]:
            (tmp_path / path.name).write_text(path.read_text())
        with store.connect(as_role(empty_dsn, "uvtest_plain")) as plain:
            assert store.migrate(plain, tmp_path)[-1] == "003_run_policy"
        first = "004_roles"
    line = assert_one_line_error(cli("migrate", dsn=as_role(empty_dsn, "uvtest_plain")), 1)
    assert "refused `unitvisor migrate`" in line and "it needs a role that may create roles" in line
    with store.connect(empty_dsn) as conn:
        assert store.pending_migrations(conn)[0] == first


# -- what a host role may still do to itself (README, Roles: "A host role and its own password") ------


def test_a_host_role_that_changed_its_own_password_is_recovered_with_new_password(cli, dsn: str,
                                                                                  host_id: str) -> None:
    """PostgreSQL lets every role change its own password, and no privilege, grant or event trigger
    forbids it: whoever holds a host's DSN can lock that host's daemon out. The documented recovery is
    `hosts add NAME --new-password`. If a later PostgreSQL refuses the first statement, README's
    paragraph on it can go."""
    old_dsn = json.loads(add(cli, dsn, host_id).stdout)["dsn"]
    role = conninfo_to_dict(old_dsn)["user"]
    with store.connect(old_dsn) as host:
        host.execute(f"ALTER ROLE \"{role}\" PASSWORD 'chosen-by-an-intruder'")
    new_dsn = json.loads(add(cli, dsn, host_id, "--new-password").stdout)["dsn"]
    with store.connect(new_dsn) as host:
        assert store.whoami(host) == store.Identity("host", host_id)


def test_doctor_warns_of_session_defaults_a_host_role_set_on_itself(cli, dsn: str, host_id: str,
                                                                    conn: psycopg.Connection,
                                                                    tmp_path) -> None:
    host_dsn = json.loads(add(cli, dsn, host_id).stdout)["dsn"]
    role = conninfo_to_dict(host_dsn)["user"]
    config = tmp_path / "unitvisor.toml"
    config.write_text(f'[host]\nid = "{host_id}"\n')

    def line() -> str:
        [found] = [x for x in cli("doctor", dsn=host_dsn, config=config).stdout.splitlines() if "role settings" in x]
        return found

    assert line().startswith("ok")
    with store.connect(host_dsn) as host:
        host.execute(f'ALTER ROLE "{role}" IN DATABASE "{conn.info.dbname}" SET default_transaction_read_only = on')
    try:
        with store.connect(host_dsn) as host:
            assert store.role_settings(host) == ["default_transaction_read_only=on"]
        warned = line()
        assert warned.startswith("warn") and "default_transaction_read_only=on" in warned
    finally:
        conn.execute(f'ALTER ROLE "{role}" IN DATABASE "{conn.info.dbname}" RESET ALL')


def test_doctor_warns_while_every_role_may_connect_to_the_database(cli, dsn: str, host_id: str,
                                                                    conn: psycopg.Connection, tmp_path) -> None:
    from tests.integration.test_roles import readme_connect_statement
    host_dsn = json.loads(add(cli, dsn, host_id).stdout)["dsn"]
    config = tmp_path / "unitvisor.toml"
    config.write_text(f'[host]\nid = "{host_id}"\n')

    def line() -> str:
        [found] = [x for x in cli("doctor", dsn=host_dsn, config=config).stdout.splitlines()
                   if x.split()[1:2] == ["connect"]]
        return found

    assert line().startswith("warn") and "README's Install" in line()  # as createdb leaves it
    conn.execute(readme_connect_statement(conn.info.dbname))
    assert line().startswith("ok")


def is_river_member(conn: psycopg.Connection, role: str) -> bool:
    return conn.execute("SELECT pg_has_role(%s, %s, 'MEMBER')", (role, store.RIVER_ROLE)).fetchone()[0]


def test_hosts_add_river_makes_the_role_a_member_of_unitvisor_river_and_only_then(cli, dsn: str,
                                                                                  conn: psycopg.Connection,
                                                                                  host_id: str) -> None:
    """--river: the host may serve a River source (schema 34); without it a host role may not create runs."""
    river = json.loads(add(cli, dsn, host_id, "--river").stdout)
    plain = json.loads(add(cli, dsn, host_id + "-plain").stdout)
    assert (river["river"], plain["river"]) == (True, False)
    assert (is_river_member(conn, river["role"]), is_river_member(conn, plain["role"])) == (True, False)
    with store.connect(river["dsn"]) as host:
        assert store.river_grant(host) == (river["role"], True)
    with store.connect(plain["dsn"]) as host:
        assert store.river_grant(host) == (plain["role"], False)


def test_hosts_add_river_with_new_password_is_a_usage_error(cli, dsn: str, conn: psycopg.Connection,
                                                          host_id: str) -> None:
    role = json.loads(add(cli, dsn, host_id).stdout)["role"]
    line = assert_one_line_error(add(cli, dsn, host_id, "--new-password", "--river"), 2)
    assert "--river goes with a new role; to an existing one: GRANT unitvisor_river TO its role" in line
    assert not is_river_member(conn, role)
