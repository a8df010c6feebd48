"""What a host refuses to claim, on the real schema: a run that sets an environment name the host
refuses (supervisor/envpolicy.py, every pattern), and a run that asks for root where allowed_users
does not name it. Such a run waits, and `unitvisor show` says why; a host that allows it claims it."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest

from supervisor import envpolicy, store, unitspec
from tests.integration.conftest import CliResult, register

# Real names for each refused pattern: the bare name, or one name a prefix pattern covers.
NAMES = {
    "LD_*": "LD_PRELOAD", "BASH_FUNC_*": "BASH_FUNC_x", "PYTHON*": "PYTHONPATH", "PERL5*": "PERL5OPT",
    "SYSTEMD_*": "SYSTEMD_X", "LISTEN_*": "LISTEN_FDS",
}
CASES = [pytest.param(NAMES.get(pattern, pattern), id=pattern) for pattern, _ in envpolicy.DENIED]


def test_every_prefix_pattern_has_a_name() -> None:
    assert {pattern for pattern, _ in envpolicy.DENIED if "*" in pattern} == set(NAMES)


def claim(conn: psycopg.Connection, host: str, **profile: object) -> set[uuid.UUID]:
    fence = register(conn, host, **profile)
    return {attempt.run_id for _, attempt in store.claim(conn, fence, 100, unitspec.UNIT_NAME_FORMAT)}


def wait_reason(conn: psycopg.Connection, run_id: uuid.UUID) -> str | None:
    store.explain_waiting(conn, timedelta(0))
    return store.get_run(conn, run_id).wait_reason


@pytest.mark.parametrize("name", CASES)
def test_a_host_never_claims_a_run_that_sets_a_refused_name(conn: psycopg.Connection, name: str) -> None:
    refused = store.submit_run(conn, argv=["/bin/true"], environment={"OK": "1", name: "x"})
    fine = store.submit_run(conn, argv=["/bin/true"], environment={"OK": "1", f"MY_{name}": "x"})
    assert claim(conn, "h1") == {fine}
    assert claim(conn, "h1") == set()
    assert wait_reason(conn, refused) == f"no live host accepts it: environment name {name} is not allowed (h1)"
    assert conn.execute("SELECT count(*) FROM unitvisor.attempts WHERE run_id = %s", (refused,)).fetchone()[0] == 0


@pytest.mark.parametrize("name", CASES)
def test_a_host_that_allows_the_name_claims_the_run(conn: psycopg.Connection, name: str) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"], environment={name: "x"})
    assert claim(conn, "h1") == set()
    assert claim(conn, "h2", allowed_environment=(name,)) == {run_id}


@pytest.mark.parametrize("name", CASES)
def test_the_database_and_python_refuse_the_same_names(conn: psycopg.Connection, name: str) -> None:
    """The claim matches the regexes a host registers (PostgreSQL's `~`); unitspec matches the globs
    (Python): for the refused name, a name that merely contains it, and its lowercase, one answer."""
    register(conn, "h1")
    for candidate in (name, f"MY_{name}", f"{name}X", name.lower()):
        row = conn.execute(
            "SELECT %s ~ ANY (h.environment_denied) AND NOT %s ~ ANY (coalesce(h.environment_allowed, '{}')) "
            "FROM unitvisor.hosts h WHERE h.id = 'h1'", (candidate, candidate)).fetchone()
        assert row[0] == (envpolicy.refusal(candidate, ()) is not None), candidate


def test_allowing_one_name_opens_that_name_only(conn: psycopg.Connection) -> None:
    preload = store.submit_run(conn, argv=["/bin/true"], environment={"LD_PRELOAD": "/x.so"})
    library = store.submit_run(conn, argv=["/bin/true"], environment={"LD_LIBRARY_PATH": "/x"})
    both = store.submit_run(conn, argv=["/bin/true"], environment={"LD_PRELOAD": "/x.so", "BASH_ENV": "/x"})
    assert claim(conn, "h1", allowed_environment=("LD_PRELOAD",)) == {preload}
    assert claim(conn, "h2", allowed_environment=("LD_*",)) == {library}
    assert claim(conn, "h3", allowed_environment=("LD_PRELOAD", "BASH_ENV")) == {both}


def test_the_reason_names_each_host_and_its_refusal(conn: psycopg.Connection) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"], environment={"BASH_ENV": "/x", "PYTHONPATH": "/y"})
    register(conn, "h1")
    register(conn, "h2", allowed_environment=("BASH_ENV",))
    # The first refused name in name order (min()), per host.
    assert wait_reason(conn, run_id) == ("no live host accepts it: environment name BASH_ENV is not allowed (h1); "
                                         "environment name PYTHONPATH is not allowed (h2)")


def test_unitvisor_show_says_why_a_run_with_a_refused_name_waits(conn: psycopg.Connection, dsn: str,
                                                                 cli: Callable[..., CliResult]) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"], environment={"LD_PRELOAD": "/tmp/evil.so"})
    assert claim(conn, "h1") == set()
    store.explain_waiting(conn, timedelta(0))
    result = cli("show", str(run_id), "--json", dsn=dsn)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["attempts"] == []
    assert data["wait_reason"] == "no live host accepts it: environment name LD_PRELOAD is not allowed (h1)"
    text = cli("show", str(run_id), dsn=dsn).stdout
    assert "environment name LD_PRELOAD is not allowed" in text


# -- root ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("run_user", "users"), [
    ("root", ()), ("root", ("alice",)), ("root", ("rootx",)),
])
def test_a_run_asking_for_root_is_never_claimed_unless_allowed_users_names_it(
        conn: psycopg.Connection, run_user: str, users: tuple[str, ...]) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"], run_user=run_user)
    assert claim(conn, "h1", users=users, run_user="svc") == set()
    assert wait_reason(conn, run_id) == "no live host accepts it: user root is not allowed (h1)"
    assert claim(conn, "h2", users=("alice", "root")) == {run_id}


def test_the_regexes_are_the_ones_a_daemon_registers(conn: psycopg.Connection) -> None:
    register(conn, "h1", allowed_environment=("LD_PRELOAD",))
    denied, allowed = conn.execute(
        "SELECT environment_denied, environment_allowed FROM unitvisor.hosts WHERE id = 'h1'").fetchone()
    assert tuple(denied) == envpolicy.denied_regexes()
    assert tuple(allowed) == envpolicy.allowed_regexes(("LD_PRELOAD",))
    assert all(re.fullmatch(r"\^.*\$", rx) for rx in denied)


def test_a_row_whose_environment_is_not_an_object_does_not_break_the_claim(conn: psycopg.Connection) -> None:
    conn.execute("ALTER TABLE unitvisor.runs DROP CONSTRAINT IF EXISTS runs_environment_valid")
    bad = store.submit_run(conn, argv=["/bin/true"])
    conn.execute("UPDATE unitvisor.runs SET environment = '[\"A=1\"]'::jsonb WHERE id = %s", (bad,))
    good = store.submit_run(conn, argv=["/bin/true"])
    # The daemon claims the bad row too and refuses it with a reason (unitspec), as before 003.
    assert claim(conn, "h1") == {bad, good}
