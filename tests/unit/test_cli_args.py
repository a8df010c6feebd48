"""The CLI's argument handling, without a database: global options before or after the command,
a run's own argv after `--` left alone, and range errors that name the range and the unit.

`main()` runs in-process with sys.argv set; the store's connect is replaced, so that what the
command would connect to (and submit) is seen without PostgreSQL."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from supervisor import cli, store


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "unitvisor.toml"
    path.write_text("")
    return path


class Outcome:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    @property
    def line(self) -> str:
        lines = self.err.splitlines()
        assert len(lines) == 1, self.err
        assert lines[0].startswith("unitvisor: ")
        return lines[0]


@pytest.fixture
def run_cli(monkeypatch, capsys):
    monkeypatch.delenv("UNITVISOR_DSN", raising=False)
    monkeypatch.delenv("UNITVISOR_DSN_FILE", raising=False)

    def run(*argv: str) -> Outcome:
        monkeypatch.setattr(sys, "argv", ["unitvisor", *argv])
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        captured = capsys.readouterr()
        return Outcome(code, captured.out, captured.err)

    return run


@pytest.fixture
def connect_fails(monkeypatch) -> list[str]:
    """store.connect records the DSN it was given and fails as an unreachable database would."""
    seen: list[str] = []

    def connect(dsn: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(dsn)
        raise store.DatabaseUnavailable(f"cannot connect to the database at {store.dsn_location(dsn)}: refused")

    monkeypatch.setattr(store, "connect", connect)
    return seen


class FakeConnection:
    def __enter__(self) -> FakeConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def submitted(monkeypatch) -> list[dict[str, Any]]:
    """A database that accepts every submit; returns the fields each submit was given."""
    calls: list[dict[str, Any]] = []

    def submit_run(conn: Any, **fields: Any) -> uuid.UUID:
        calls.append(fields)
        return uuid.UUID(int=1)

    monkeypatch.setattr(store, "connect", lambda dsn, *a, **k: FakeConnection())
    monkeypatch.setattr(store, "pending_migrations", lambda conn: [])
    monkeypatch.setattr(store, "submit_run", submit_run)
    monkeypatch.setattr(store, "fleet_refusals", lambda conn, run_ids: {})
    return calls


# -- global options, before or after the command -------------------------------------------------

A = "host=db-a.example port=5001 dbname=x"
B = "host=db-b.example port=5002 dbname=x"


@pytest.mark.parametrize("argv", [
    ["--config", "{config}", "--dsn", A, "runs"],
    ["--config", "{config}", "runs", "--dsn", A],
    ["runs", "--config", "{config}", "--dsn", A],
    ["runs", f"--dsn={A}", "--config={config}"],
    ["--config", "{config}", "runs", "--state", "queued", "--dsn", A, "--json"],
    ["--config", "{config}", "hosts", "--dsn", A],
    ["--config", "{config}", "hosts", "forget", "web-7", "--dsn", A],
    ["--config", "{config}", "hosts", "--dsn", A, "forget", "web-7"],
    ["--config", "{config}", "show", "abcdef12", "--dsn", A],
    ["--config", "{config}", "drain", "web-7", "--dsn", A],
])
def test_dsn_and_config_before_or_after_the_command(run_cli, connect_fails, config, argv) -> None:
    result = run_cli(*[a.replace("{config}", str(config)) for a in argv])
    assert result.code == 1
    assert "db-a.example:5001" in result.line
    assert connect_fails == [A]


def test_an_option_after_the_command_wins_over_the_one_before(run_cli, connect_fails, config) -> None:
    run_cli("--config", str(config), "--dsn", A, "runs", "--dsn", B)
    assert connect_fails == [B]


def test_dsn_after_the_command_wins_over_the_environment(run_cli, connect_fails, config, monkeypatch) -> None:
    monkeypatch.setenv("UNITVISOR_DSN", A)
    run_cli("--config", str(config), "runs")
    run_cli("--config", str(config), "runs", "--dsn", B)
    assert connect_fails == [A, B]


def _dsn_file(tmp_path, dsn: str, name: str = "admin.dsn"):
    path = tmp_path / name
    path.write_text(dsn + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("where", ["before", "after"])
def test_dsn_file_before_or_after_the_command(run_cli, connect_fails, config, tmp_path, where) -> None:
    """Issue 24: the admin's DSN from a private file, not from the command line."""
    argv = ["--dsn-file", _dsn_file(tmp_path, A)]
    run_cli("--config", str(config), *(argv + ["runs"] if where == "before" else ["runs"] + argv))
    assert connect_fails == [A]


def test_dsn_file_wins_over_the_environments_dsn_and_its_own_variable(run_cli, connect_fails, config, tmp_path,
                                                                       monkeypatch) -> None:
    monkeypatch.setenv("UNITVISOR_DSN_FILE", _dsn_file(tmp_path, B, "env.dsn"))
    run_cli("--config", str(config), "runs")
    monkeypatch.setenv("UNITVISOR_DSN", A)
    run_cli("--config", str(config), "runs")
    run_cli("--config", str(config), "runs", "--dsn-file", _dsn_file(tmp_path, B))
    assert connect_fails == [B, A, B]


def test_the_dsn_given_last_wins_whichever_its_kind(run_cli, connect_fails, config, tmp_path) -> None:
    run_cli("--config", str(config), "--dsn", A, "runs", "--dsn-file", _dsn_file(tmp_path, B))
    run_cli("--config", str(config), "--dsn-file", _dsn_file(tmp_path, B), "runs", "--dsn", A)
    assert connect_fails == [B, A]
    both = run_cli("--config", str(config), "--dsn", A, "--dsn-file", _dsn_file(tmp_path, B), "runs")
    assert both.code == 1 and both.line == "unitvisor: --dsn and --dsn-file both given: give one"


def test_config_after_the_command_is_read(run_cli, connect_fails, tmp_path) -> None:
    config = tmp_path / "with-dsn.toml"
    config.write_text(f'[database]\ndsn = "{B}"\n')
    run_cli("runs", "--config", str(config))
    assert connect_fails == [B]
    missing = tmp_path / "missing.toml"
    result = run_cli("runs", "--config", str(missing))
    assert result.code == 1 and str(missing) in result.line


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_before_or_after_the_command_shows_the_traceback(run_cli, connect_fails, config, where,
                                                               monkeypatch) -> None:
    argv = ["--config", str(config), "--dsn", A]
    argv = [*argv, "--debug", "runs"] if where == "before" else [*argv, "runs", "--debug"]
    monkeypatch.setattr(sys, "argv", ["unitvisor", *argv])
    with pytest.raises(cli.Unreachable):
        cli.main()


def test_debug_with_a_usage_error_is_one_line_not_a_traceback(run_cli, config) -> None:
    for argv in (["runs", "--debug", "--no-such-option"], ["--debug", "runs", "--no-such-option"]):
        result = run_cli("--config", str(config), *argv)
        assert result.code == 2
        assert "--no-such-option" in result.line and "Traceback" not in result.err


HOSTILE_COMMANDS = [
    ["/bin/sh", "-c", "echo $0", "--dsn", "host=evil port=1"],
    ["/bin/echo", "--debug"],
    ["/bin/echo", "--config", "/etc/shadow", "--dsn=x", "--debug", "--", "--help"],
    ["/usr/bin/env", "--dsn", "--config", "--debug"],
]


@pytest.mark.parametrize("command", HOSTILE_COMMANDS)
def test_a_runs_own_options_after_dashes_are_never_read(run_cli, submitted, config, command) -> None:
    result = run_cli("--config", str(config), "--dsn", A, "submit", "--", *command)
    assert result.code == 0, result.err
    assert result.out == f"{uuid.UUID(int=1)}\n"
    assert [c["argv"] for c in submitted] == [command]


@pytest.mark.parametrize("command", HOSTILE_COMMANDS)
def test_dsn_after_submit_and_a_hostile_command(run_cli, connect_fails, config, command) -> None:
    result = run_cli("--config", str(config), "submit", "--dsn", A, "--memory", "1G", "--", *command)
    assert result.code == 1 and "db-a.example:5001" in result.line
    assert connect_fails == [A]


def test_debug_in_a_runs_command_does_not_turn_on_tracebacks(run_cli, config, monkeypatch) -> None:
    def submit_run(conn: Any, **fields: Any) -> uuid.UUID:
        raise RuntimeError("boom")

    monkeypatch.setattr(store, "connect", lambda dsn, *a, **k: FakeConnection())
    monkeypatch.setattr(store, "pending_migrations", lambda conn: [])
    monkeypatch.setattr(store, "submit_run", submit_run)
    result = run_cli("--config", str(config), "--dsn", A, "submit", "--", "/bin/echo", "--debug")
    assert result.code == 1
    assert "internal error: RuntimeError: boom" in result.line


# -- range errors name the range and the unit ---------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["submit", "--memory", "256"],
     "--memory: 256 bytes is out of range (1M to 4E; a bare number is bytes, use 256M)"),
    (["submit", "--memory", "1K"], "--memory: 1K is out of range (1M to 4E)"),
    (["submit", "--memory", "99999999T"], "--memory: 99999999T is out of range (1M to 4E)"),
    (["submit", "--memory", "0"], "--memory: invalid size '0': must be more than zero (the range is 1M to 4E)"),
    (["submit", "--memory-high", "256"],
     "--memory-high: 256 bytes is out of range (1M to 4E; a bare number is bytes, use 256M)"),
    (["submit", "--memory-high", "99999999T"], "--memory-high: 99999999T is out of range (1M to 4E)"),
    (["submit", "--memory", "256M", "--memory-high", "512M"],
     "--memory-high: 512M is above --memory 256M: a run is throttled before it is killed"),
    (["submit", "--cpu", "100001%"], "--cpu: 100001% is out of range (1% to 100000%)"),
    (["submit", "--cpu", "100001"], "--cpu: 100001% is out of range (1% to 100000%)"),
    (["submit", "--tasks", "0"], "--tasks: 0 is out of range (1 to 4194304)"),
    (["submit", "--io-weight", "10001"], "--io-weight: 10001 is out of range (1 to 10000)"),
    (["submit", "--runtime", "0.5"], "--runtime: 0.5 seconds is out of range (1s to 3650d)"),
    (["submit", "--runtime", "3651d"], "--runtime: 3651d is out of range (1s to 3650d)"),
    (["submit", "--runtime", "1.5"], "--runtime: 1.5 is not a whole number of seconds (the range is 1s to 3650d)"),
    (["submit", "--runtime", "2.5s"], "--runtime: 2.5s is not a whole number of seconds (the range is 1s to 3650d)"),
    (["submit", "--max-attempts", "1001"], "--max-attempts: 1001 is out of range (1 to 1000)"),
    (["submit", "--priority", "99999999999"],
     "--priority: 99999999999 is out of range (-2147483648 to 2147483647)"),
    (["runs", "--limit", "0"], "--limit: 0 is out of range (1 to 100000)"),
    (["runs", "--since", "0.5"], "--since: 0.5 seconds is out of range (1s to 115740d)"),
    (["logs", "abcdef12", "--attempt", "0"], "--attempt: 0 is out of range (at least 1)"),
    (["logs", "abcdef12", "-n", "-1"], "--lines: -1 is out of range (at least 0)"),
    (["wait", "abcdef12", "--timeout", "0.5"], "--timeout: 0.5 seconds is out of range (1s to 115740d)"),
])
def test_a_range_error_names_the_range_and_the_unit(run_cli, config, args, message) -> None:
    argv = ["--config", str(config), *args]
    if args[0] == "submit":
        argv += ["--", "/bin/true"]
    result = run_cli(*argv)
    assert result.code == 2
    command = args[0]
    assert result.line == f"unitvisor: {message}; see 'unitvisor {command} --help'"


@pytest.mark.parametrize(("args", "fields"), [
    (["--memory-high", "384M"], {"memory_high": 384 << 20}),
    (["--memory", "512M", "--memory-high", "512M"], {"memory_max": 512 << 20, "memory_high": 512 << 20}),
    ([], {"memory_high": None}),  # not asked: not sent (a database before schema 017 takes the run)
])
def test_memory_high_is_submitted_as_bytes(run_cli, submitted, config, args, fields) -> None:
    result = run_cli("--config", str(config), "--dsn", A, "submit", *args, "--", "/bin/true")
    assert result.code == 0, result.err
    assert {key: submitted[0].get(key) for key in fields} == fields


def test_an_option_that_is_not_a_number(run_cli, config) -> None:
    result = run_cli("--config", str(config), "submit", "--tasks", "many", "--", "/bin/true")
    assert result.code == 2
    assert result.line.startswith("unitvisor: --tasks: 'many' is not a valid integer")


def test_the_help_still_shows_the_ranges() -> None:
    import click

    ctx = click.Context(cli.cli.commands["submit"], info_name="submit", terminal_width=200, max_content_width=200)
    text = cli.cli.commands["submit"].get_help(ctx)
    assert "1<=x<=4194304" in text and "1M to 4E" in text
    assert "--dsn" not in text  # the global options' copies are hidden: the group's help has them
