"""A run runs as root only where [runs] allowed_users names root: the config, the unit spec and
`unitvisor doctor` (the claim's side is in tests/integration/test_environment_claims.py)."""

from __future__ import annotations

import dataclasses
import pwd
import uuid

import pytest

from supervisor import doctor
from supervisor.config import ConfigError, RunSettings, Settings, parse
from supervisor.model import Attempt, Run
from supervisor.unitspec import Refused, build, unit_name

RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")
RUNS = '[runs]\nallowed_executables = ["/bin/true"]\n'


# -- config -------------------------------------------------------------------------------------

@pytest.mark.parametrize("allowed", ["[]", '["alice"]', '["rootx", "root0"]'])
def test_user_root_without_root_in_allowed_users_is_refused(allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(f'{RUNS}user = "root"\nallowed_users = {allowed}\n', "u.toml")
    message = str(info.value)
    assert message.startswith('u.toml: [runs] user = "root" runs every run as root')
    assert "[runs] allowed_users" in message


def test_user_root_without_allowed_users_at_all_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\[runs\] user = \"root\""):
        parse(f'{RUNS}user = "root"\n')


def test_user_root_with_root_in_allowed_users_is_accepted() -> None:
    settings = parse(f'{RUNS}user = "root"\nallowed_users = ["alice", "root"]\n')
    assert (settings.runs.user, settings.runs.allowed_users) == ("root", ("alice", "root"))


@pytest.mark.parametrize("text", ['allowed_users = ["root"]\n', 'user = "svc"\nallowed_users = ["root"]\n', ""])
def test_root_in_allowed_users_alone_is_accepted(text: str) -> None:
    parse(RUNS + text)


# -- unit spec: a run's run_user ----------------------------------------------------------------

def props(run_user: str | None, **runs: object) -> dict:
    runs.setdefault("allowed_executables", ("/bin/true",))
    settings = dataclasses.replace(Settings(), runs=RunSettings(**runs))  # type: ignore[arg-type]
    run = Run(id=RUN_ID, argv=["/bin/true"], run_user=run_user)
    return build(run, Attempt(run_id=RUN_ID, attempt=1, host_id="h1", unit_name=unit_name(RUN_ID, 1)), settings)


@pytest.mark.parametrize("runs", [
    {},
    {"user": "svc"},
    {"allowed_users": ("alice",)},
    {"user": "svc", "allowed_users": ("alice", "bob")},
    {"allowed_users": ("roots", "admin")},
])
def test_a_run_asking_for_root_is_refused_unless_allowed_users_names_it(runs: dict) -> None:
    with pytest.raises(Refused) as info:
        props("root", **runs)
    assert str(info.value) == "user root is not in this host's allowed_users"


def test_a_run_asking_for_root_runs_as_root_where_allowed_users_names_it() -> None:
    assert props("root", allowed_users=("root",))[b"User"] == b"root"


def test_no_run_is_root_by_default() -> None:
    assert props(None)[b"DynamicUser"] is True
    assert b"User" not in props(None)


# -- doctor -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("runs", "message"), [
    (RunSettings(allowed_users=("root",)), "[runs] allowed_users names root: a run that asks for it runs as root"),
    (RunSettings(user="root", allowed_users=("root",)), "[runs] user and allowed_users name root: every run runs"),
    (RunSettings(user="root"), "[runs] user names root: every run runs as root"),  # parse() refuses it; warned too
])
def test_doctor_warns_when_root_is_named(runs: RunSettings, message: str) -> None:
    [check] = doctor.root_runs_check(runs)
    assert check.status == "warn" and check.name == "root runs"
    assert check.message.startswith(message)


@pytest.mark.parametrize("runs", [RunSettings(), RunSettings(user="svc", allowed_users=("alice", "rootless"))])
def test_doctor_says_nothing_when_root_is_not_named(runs: RunSettings) -> None:
    assert doctor.root_runs_check(runs) == []


def _passwd(uid: int) -> pwd.struct_passwd:
    return pwd.struct_passwd(("x", "x", uid, uid, "", "/", "/bin/sh"))


def test_doctor_fails_a_user_of_id_0_under_another_name() -> None:
    uids = {"toor": 0, "svc": 1000, "root": 0}

    def getpwnam(name: str) -> pwd.struct_passwd:
        return _passwd(uids[name])

    runs = RunSettings(user="svc", allowed_users=("toor", "root", "ghost"))
    [check] = doctor.root_alias_check(runs, getpwnam)
    assert (check.status, check.name) == ("fail", "root runs")
    assert check.message.startswith("[runs] user toor has user id 0: name it root")
    assert doctor.root_alias_check(RunSettings(user="svc", allowed_users=("root",)), getpwnam) == []


def test_doctor_run_checks_include_the_root_warning(tmp_path, mocker) -> None:
    config = tmp_path / "unitvisor.toml"
    config.write_text(f'{RUNS}allowed_users = ["root"]\n')
    mocker.patch.object(doctor, "_systemd_checks", return_value=([], 0))
    mocker.patch.object(doctor, "_database_checks", return_value=[])
    mocker.patch.object(doctor, "cgroup_check", return_value=doctor.Check("cgroups", "ok", "fine"))
    checks = doctor.run_checks(config, None)
    assert [c.status for c in checks if c.name == "root runs"] == ["warn"]
    assert all(c.status != "fail" for c in checks)
