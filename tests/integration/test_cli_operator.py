"""The operator's day (issue 24, items 2, 3 and 9): the real executable against the real database.

A host's own DSN (the default on a host) hides runs pinned to other hosts: the CLI says so instead
of "no run with id". A run that no live host accepts says why at once, in `show`, `runs` and as a
warning from `submit`, not after explain_waiting's two poll intervals."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.outcomes import Outcome
from tests.harness.postgres import Postgres
from tests.integration.conftest import TEST_SUBMITTER, ensure_login_role, register
from tests.integration.test_cli_db import assert_one_line_error, submit
from tests.integration.test_cli_roles import add, as_role

pytestmark = pytest.mark.integration

HINT = "use the admin's DSN (--dsn-file or UNITVISOR_DSN_FILE)"


# -- item 2: what a host's role cannot see ----------------------------------------------------------

@pytest.fixture
def host_dsn(cli, dsn: str) -> tuple[str, str]:
    """A host's own DSN, as `hosts add` prints it, and its role."""
    host_id = f"web-{uuid.uuid4().hex[:8]}"
    made = json.loads(add(cli, dsn, host_id).stdout)
    return made["dsn"], made["role"]


@pytest.mark.parametrize("command", [["show"], ["logs"], ["cancel"], ["resume"], ["wait", "--timeout", "1s"]])
def test_a_run_pinned_elsewhere_is_said_to_be_hidden_from_a_hosts_role(cli, dsn: str, conn: psycopg.Connection,
                                                                        host_dsn: tuple[str, str], command) -> None:
    pinned = store.submit_run(conn, argv=["/bin/true"], host_pin="another-host")
    line = assert_one_line_error(cli(command[0], str(pinned)[:8], *command[1:], dsn=host_dsn[0]), 1)
    assert f"run {str(pinned)[:8]} is not visible to role {host_dsn[1]}" in line
    assert line.endswith(HINT)
    # with the full id too, where the command reads the run (cancel and resume are refused to the role)
    if command[0] in ("show", "logs", "wait"):
        line = assert_one_line_error(cli(command[0], str(pinned), *command[1:], dsn=host_dsn[0]), 1)
        assert f"is not visible to role {host_dsn[1]}" in line


def test_the_admin_is_told_plainly_that_there_is_no_such_run(cli, dsn: str) -> None:
    line = assert_one_line_error(cli("show", "abcdef12", dsn=dsn), 1)
    assert line == "unitvisor: no run with id abcdef12"
    line = assert_one_line_error(cli("show", str(uuid.uuid4()), dsn=dsn), 1)
    assert line.startswith("unitvisor: no run with id ")


def test_runs_says_on_stderr_when_its_list_may_be_partial(cli, dsn: str, conn: psycopg.Connection,
                                                          host_dsn: tuple[str, str]) -> None:
    store.submit_run(conn, argv=["/bin/true"], host_pin="another-host", labels={"team": "infra"})
    unpinned = store.submit_run(conn, argv=["/bin/true"], labels={"team": "infra"})
    for args in ([], ["--json"]):
        listed = cli("runs", "--label", "team=infra", *args, dsn=host_dsn[0])
        assert listed.returncode == 0, listed.stderr
        assert listed.stderr_lines == [f"note: role {host_dsn[1]} is not shown runs pinned to other hosts "
                                       f"(row-level security): this list may be partial; {HINT}"]
        assert str(unpinned)[:8] in listed.stdout
    assert [r["id"] for r in json.loads(listed.stdout)] == [str(unpinned)]  # still a list, as before
    whole = cli("runs", "--label", "team=infra", "--json", dsn=dsn)
    assert whole.stderr == "" and len(json.loads(whole.stdout)) == 2


# -- item 3: a run no live host accepts says why at once -----------------------------------------------

@pytest.mark.parametrize("role", ["admin", "submitter"])
def test_a_run_no_live_host_accepts_says_why_at_once(cli, dsn: str, conn: psycopg.Connection, postgres: Postgres,
                                                     role: str) -> None:
    """As the admin and as the submitter, the role a control plane submits with (before schema 23
    only the admin might ask fleet_refusal: the submitter got no warning and no reason at once)."""
    if role == "submitter":
        ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
        dsn = as_role(dsn, TEST_SUBMITTER)
    fence = register(conn, "h1", allowed=("/usr/bin/python3",))
    cases = {
        ("--", "/bin/sh", "-c", "true"): "no live host accepts it: executable /bin/sh is not allowed (h1)",
        ("--host", "nosuch", "--", "/usr/bin/python3"):
            "pinned to host nosuch, which is not known (see unitvisor hosts)",
        ("--user", "nosuchuser", "--", "/usr/bin/python3"):
            "no live host accepts it: user nosuchuser is not allowed (h1)",
    }
    for args, why in cases.items():
        result = cli("submit", *args, dsn=dsn)
        assert result.returncode == 0, result.stderr
        run_id = uuid.UUID(result.stdout.strip())
        assert result.stderr_lines == [f"unitvisor: warning: run {run_id} waits: {why}"]
        shown = cli("show", str(run_id), dsn=dsn)
        assert f"  waiting:   {why}\n" in shown.stdout
        data = json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)
        assert (data["wait_reason"], data["no_host_accepts"]) == (why, why)
        listed = cli("runs", dsn=dsn).stdout
        assert f"{str(run_id)[:8]}: waits: {why}\n" in listed
    rows = json.loads(cli("runs", "--json", dsn=dsn).stdout)
    assert sorted(r["no_host_accepts"] for r in rows) == sorted(cases.values())

    # h1 beats as its daemon would: the eleven CLI calls above took over a minute on the fresh-clone
    # run's loaded machine, and h1 was then silent ("no live host").
    store.renew_heartbeat(conn, fence)
    conn.commit()
    accepted = cli("submit", "--", "/usr/bin/python3", "-c", "print(1)", dsn=dsn)
    assert accepted.returncode == 0 and accepted.stderr == ""
    data = json.loads(cli("show", accepted.stdout.strip(), "--json", dsn=dsn).stdout)
    assert (data["wait_reason"], data["no_host_accepts"]) == (None, None)


def test_with_no_live_host_submit_warns_and_still_queues(cli, dsn: str, conn: psycopg.Connection) -> None:
    result = cli("submit", "--", "/bin/true", dsn=dsn)
    assert result.returncode == 0
    run_id = uuid.UUID(result.stdout.strip())
    assert result.stderr.startswith(f"unitvisor: warning: run {run_id} waits: no live host")
    assert store.get_run(conn, run_id).state == "queued"


# -- item 9 --------------------------------------------------------------------------------------------

def finish(conn: psycopg.Connection, fence: store.Fence, outcome: Outcome, state: str) -> None:
    (_, attempt), = store.claim(conn, fence, 1, unitspec.UNIT_NAME_FORMAT)
    store.mark_started(conn, fence, attempt, None)
    store.record_outcome(conn, fence, attempt, outcome, state, timedelta(0) if state == "queued" else None)


def test_resume_past_max_attempts_and_of_a_succeeded_run_read_sensibly(cli, dsn: str,
                                                                         conn: psycopg.Connection) -> None:
    fence = register(conn, "h1")
    run_id = submit(cli, dsn, "--max-attempts", "2", "--", "/bin/false")
    finish(conn, fence, Outcome("exit-code", "exit:1", "exited 1"), "queued")
    finish(conn, fence, Outcome("exit-code", "exit:1", "exited 1"), "failed")
    assert cli("resume", str(run_id), dsn=dsn).returncode == 0
    finish(conn, fence, Outcome("exit-code", "exit:1", "exited 1"), "failed")
    shown = cli("show", str(run_id), dsn=dsn).stdout
    assert "  attempts:  3 (2 by --max-attempts, 1 more by resume)\n" in shown

    done = submit(cli, dsn, "--", "/bin/true")
    finish(conn, fence, Outcome("success", "exit:0", "exited 0"), "succeeded")
    line = assert_one_line_error(cli("resume", str(done), dsn=dsn), 1)
    assert line == f"unitvisor: run {done} succeeded; only a failed, cancelled, expired or skipped run can be resumed"


def test_runs_cuts_a_long_command_at_a_word_and_wide_shows_it_all(cli, dsn: str, conn: psycopg.Connection) -> None:
    register(conn, "h1")
    argv = ["/opt/jobs/bin/backup", "--target", "s3://bucket/nightly/" + "x" * 30, "--verbose"]
    submit(cli, dsn, "--", *argv)
    narrow = cli("runs", dsn=dsn).stdout.splitlines()[1]
    assert narrow.endswith("/opt/jobs/bin/backup --target…")
    wide = cli("runs", "--wide", dsn=dsn).stdout.splitlines()[1]
    assert wide.endswith(" ".join(argv))
