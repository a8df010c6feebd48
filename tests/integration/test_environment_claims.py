"""What a host refuses to claim, on the real schema: a run that sets an environment name the host's
allowlist does not open (supervisor/envpolicy.py: any name it does not name, and a name on the
denylist that it does not name exactly), and a run that asks for root where allowed_users does not
name it. Such a run waits, and `unitvisor show` says why; a host that allows it claims it."""

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


ALLOWLISTS = [("*",), ("LANG", "LANGUAGE", "LC_*", "TZ"), ("APP_*", "PATH"), ("L*",), ("LD_PRELOAD", "LD_AUDIT"), ()]


@pytest.mark.parametrize("name", CASES)
def test_the_database_and_python_refuse_the_same_names(conn: psycopg.Connection, name: str) -> None:
    """The claim asks refused_environment_name (PostgreSQL's = and `~` over what the host registered);
    unitspec asks envpolicy.refusal (the globs, in Python): for the refused name, names that merely
    contain it, its lowercase, and names of the default set, under several allowlists, one answer."""
    candidates = (name, f"MY_{name}", f"{name}X", name.lower(), "LANG", "LC_ALL", "APP_X", "TAR_OPTIONS")
    runs = {c: store.submit_run(conn, argv=["/bin/true"], environment={c: "x"}) for c in candidates}
    for i, allowed in enumerate(ALLOWLISTS):
        register(conn, f"h{i}", allowed_environment=allowed)
        for candidate, run_id in runs.items():
            refused = conn.execute(
                "SELECT unitvisor.refused_environment_name(h, r) FROM unitvisor.hosts h, unitvisor.runs r "
                "WHERE h.id = %s AND r.id = %s", (f"h{i}", run_id)).fetchone()[0]
            assert (refused is not None) == (envpolicy.refusal(candidate, allowed) is not None), (candidate, allowed)


# What the issue found passing 0.5's denylist: each makes some allowed program run the submitter's code.
ISSUE_NAMES = ("TAR_OPTIONS", "GIT_CONFIG_COUNT", "GIT_CONFIG_KEY_0", "RSYNC_RSH", "LUA_INIT", "MAKEFLAGS",
               "LESSOPEN", "DOTNET_STARTUP_HOOKS", "OPENSSL_CONF")


@pytest.mark.parametrize("name", ISSUE_NAMES)
def test_a_name_the_allowlist_does_not_name_is_never_claimed(conn: psycopg.Connection, name: str) -> None:
    """Issue 21: the denylist let every one of these through. A host with the default allowlist (the
    locale and the time zone) claims a run that sets only those, never one that sets a name it does
    not name; a host that names it, or a pattern that matches it, claims it."""
    defaults = ("LANG", "LANGUAGE", "LC_*", "TZ")  # envpolicy.DEFAULT_ALLOWED, written out
    refused = store.submit_run(conn, argv=["/bin/true"], environment={"LANG": "C.UTF-8", name: "x"})
    fine = store.submit_run(conn, argv=["/bin/true"], environment={"LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC"})
    assert claim(conn, "h1", allowed_environment=defaults) == {fine}
    assert claim(conn, "h1", allowed_environment=defaults) == set()
    assert wait_reason(conn, refused) == f"no live host accepts it: environment name {name} is not allowed (h1)"
    assert claim(conn, "h2", allowed_environment=(*defaults, name[:3] + "*")) == {refused}


def test_a_pattern_never_opens_a_denied_name_an_exact_name_does(conn: psycopg.Connection) -> None:
    preload = store.submit_run(conn, argv=["/bin/true"], environment={"LD_PRELOAD": "/x.so"})
    library = store.submit_run(conn, argv=["/bin/true"], environment={"LD_LIBRARY_PATH": "/x"})
    both = store.submit_run(conn, argv=["/bin/true"], environment={"LD_PRELOAD": "/x.so", "BASH_ENV": "/x"})
    app = store.submit_run(conn, argv=["/bin/true"], environment={"APP_MODE": "x"})
    assert claim(conn, "h1", allowed_environment=("*",)) == {app}
    assert claim(conn, "h2", allowed_environment=("LD_*", "L*", "BASH_*")) == set()
    assert claim(conn, "h3", allowed_environment=("LD_PRELOAD",)) == {preload}
    assert claim(conn, "h4", allowed_environment=("LD_PRELOAD", "BASH_ENV", "LD_LIBRARY_PATH")) == {both, library}


def test_a_daemon_that_registers_no_allowlist_keeps_its_denylist(conn: psycopg.Connection) -> None:
    """A 0.5.x daemon calls register_host_environment only: until it is upgraded its host refuses by the
    denylist, as that daemon's own check does (sql/015: chosen so that the previous release keeps
    working between migrate and its upgrade). A 0.6 daemon's allowlist replaces it, and a 0.5.x daemon
    registering again for the same id (a downgrade) clears that allowlist."""
    tar = store.submit_run(conn, argv=["/bin/true"], environment={"TAR_OPTIONS": "x"})
    preload = store.submit_run(conn, argv=["/bin/true"], environment={"LD_PRELOAD": "/x.so"})

    def register_as_05(host: str) -> store.Fence:
        fence = register(conn, host)
        conn.execute("SELECT unitvisor.register_host_environment(%s, %s, %s, %s)",
                     (host, fence.epoch, list(envpolicy.denied_regexes()), []))
        return fence

    fence = register_as_05("old")
    names, patterns = conn.execute(
        "SELECT environment_names, environment_patterns FROM unitvisor.hosts WHERE id = 'old'").fetchone()
    assert (names, patterns) == (None, None)
    assert {a.run_id for _, a in store.claim(conn, fence, 100, unitspec.UNIT_NAME_FORMAT)} == {tar}
    assert wait_reason(conn, preload) == "no live host accepts it: environment name LD_PRELOAD is not allowed (old)"
    register(conn, "new", allowed_environment=("LANG",))
    register_as_05("new")
    assert conn.execute("SELECT environment_names IS NULL AND environment_patterns IS NULL FROM unitvisor.hosts "
                        "WHERE id = 'new'").fetchone()[0]


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
    register(conn, "h1", allowed_environment=("LD_PRELOAD", "APP_*", "TZ"))
    denied, names, patterns, allowed = conn.execute(
        "SELECT environment_denied, environment_names, environment_patterns, environment_allowed "
        "FROM unitvisor.hosts WHERE id = 'h1'").fetchone()
    assert tuple(denied) == envpolicy.denied_regexes()
    assert (names, patterns, allowed) == (["LD_PRELOAD", "TZ"], [r"^APP\_[^/]*$"], None)
    assert all(re.fullmatch(r"\^.*\$", rx) for rx in denied + patterns)


def test_a_row_whose_environment_is_not_an_object_does_not_break_the_claim(conn: psycopg.Connection) -> None:
    conn.execute("ALTER TABLE unitvisor.runs DROP CONSTRAINT IF EXISTS runs_environment_valid")
    conn.execute("DROP TRIGGER IF EXISTS runs_arguments_valid ON unitvisor.runs")  # the check since schema 22
    bad = store.submit_run(conn, argv=["/bin/true"])
    conn.execute("UPDATE unitvisor.runs SET environment = '[\"A=1\"]'::jsonb WHERE id = %s", (bad,))
    good = store.submit_run(conn, argv=["/bin/true"])
    # The daemon claims the bad row too and refuses it with a reason (unitspec), as before 003.
    assert claim(conn, "h1") == {bad, good}
