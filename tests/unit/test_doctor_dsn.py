"""Which DSN `unitvisor doctor` checks (issue 24): as root on a host with the daemon's config
(/etc/unitvisor/unitvisor.toml), the daemon's, and the shell's said apart from it; elsewhere the shell's."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import config, doctor


@pytest.fixture
def daemon_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The daemon's config at a place of the test's own, standing for /etc/unitvisor/unitvisor.toml."""
    path = tmp_path / "unitvisor.toml"
    path.write_text(f'[database]\ndsn_file = "{tmp_path / "dsn"}"\n')
    monkeypatch.setattr(config, "DEFAULT_PATH", path)
    for name in ("UNITVISOR_DSN", "UNITVISOR_DSN_FILE"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_root_with_the_daemons_config_checks_the_daemons_dsn(daemon_config: Path) -> None:
    settings = config.load(None)
    choice = doctor.choose_dsn(settings, None, None, euid=0)
    assert choice == doctor.DsnChoice(True, f"the daemon's DSN from {daemon_config.parent / 'dsn'}", None)


@pytest.mark.parametrize(("override", "dsn_file", "env", "said"), [
    ("host=db", None, {}, "--dsn"),
    (None, "/root/admin.dsn", {}, "--dsn-file /root/admin.dsn"),
    (None, None, {"UNITVISOR_DSN": "host=db"}, "UNITVISOR_DSN"),
    (None, None, {"UNITVISOR_DSN_FILE": "/root/admin.dsn"}, "UNITVISOR_DSN_FILE (/root/admin.dsn)"),
])
def test_a_dsn_the_shell_gives_is_named_beside_the_daemons(daemon_config: Path, monkeypatch: pytest.MonkeyPatch,
                                                           override: str | None, dsn_file: str | None,
                                                           env: dict[str, str], said: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    choice = doctor.choose_dsn(config.load(None), override, dsn_file, euid=0)
    assert (choice.daemons, choice.other) == (True, said)


def test_the_daemons_dsn_in_the_config_itself_is_named_so(daemon_config: Path) -> None:
    daemon_config.write_text('[database]\ndsn = "host=db dbname=unitvisor"\n')
    choice = doctor.choose_dsn(config.load(daemon_config), None, None, euid=0)
    assert choice.origin == f"the daemon's DSN from [database] dsn in {daemon_config}"


def test_not_root_checks_the_shells_dsn(daemon_config: Path) -> None:
    """The daemon's DSN file is root's alone: a user checks what the shell gives, as every command."""
    choice = doctor.choose_dsn(config.load(None), "host=db", None, euid=1000)
    assert choice == doctor.DsnChoice(False, "the DSN from --dsn", None)


def test_another_config_is_not_the_daemons(daemon_config: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.toml"
    other.write_text("")
    assert doctor.choose_dsn(config.load(other), "host=db", None, euid=0) == doctor.DsnChoice(
        False, "the DSN from --dsn", None)


def test_no_config_file_checks_the_shells_dsn(daemon_config: Path) -> None:
    daemon_config.unlink()
    choice = doctor.choose_dsn(config.load(None), None, None, euid=0)
    assert choice == doctor.DsnChoice(False, "the DSN from /etc/unitvisor/dsn", None)


def test_doctor_says_the_daemons_dsn_fails_though_the_shells_would_not(daemon_config: Path) -> None:
    """The daemon's DSN file is missing: the database check fails and names it; the shell's DSN (which
    does not connect either, here) is a warning beside it."""
    checks = doctor._database_checks(config.load(None), "host=127.0.0.1 port=1 dbname=x connect_timeout=2", euid=0)
    assert [(c.name, c.status) for c in checks] == [("database", "fail"), ("shell DSN", "warn")]
    assert checks[0].message.startswith(f"the daemon's DSN from {daemon_config.parent / 'dsn'}: no database configured")
    assert checks[1].message.startswith("--dsn (this shell's, for the commands run here; not the daemon's): ")
