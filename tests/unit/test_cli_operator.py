"""The small frictions of an operator's day (issue 24, item 9), without a database: --runtime in
whole seconds, click's messages without ".;", the COMMAND column cut at a word, the attempts line
after a resume, "run ... succeeded", prune's default age, and a header per attempt in `logs`."""

from __future__ import annotations

import pytest

from supervisor import store
from supervisor.cli import output
from tests.unit.test_cli_args import A, FakeConnection, config, run_cli, submitted  # noqa: F401 (fixtures)

# -- item 9 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "seconds"), [("90", 90), ("1.5m", 90), ("2h", 7200), ("1", 1)])
def test_runtime_is_whole_seconds(run_cli, submitted, config, given, seconds) -> None:  # noqa: F811
    result = run_cli("--config", str(config), "--dsn", A, "submit", "--runtime", given, "--", "/bin/true")
    assert result.code == 0, result.err
    assert submitted[0]["runtime_max_sec"] == seconds and isinstance(submitted[0]["runtime_max_sec"], int)


def test_runtime_of_a_second_and_a_half_is_refused_not_cut(run_cli, submitted, config) -> None:  # noqa: F811
    result = run_cli("--config", str(config), "--dsn", A, "submit", "--runtime", "1.5", "--", "/bin/true")
    assert result.code == 2 and "1.5 is not a whole number of seconds" in result.line
    assert submitted == []


@pytest.mark.parametrize("argv", [["show"], ["submit", "--bogus"], ["frobnicate"], ["runs", "--state", "nope"]])
def test_click_messages_have_no_stray_period_before_the_semicolon(run_cli, config, argv) -> None:  # noqa: F811
    result = run_cli("--config", str(config), *argv)
    assert result.code == 2
    assert ".;" not in result.line and "; see '" in result.line


@pytest.mark.parametrize(("argv", "width", "shown"), [
    (["/usr/bin/python3", "-c", "print(1)"], 60, "/usr/bin/python3 -c 'print(1)'"),
    (["/opt/jobs/bin/backup", "--target", "s3://bucket/nightly", "--verbose"], 40,
     "/opt/jobs/bin/backup --target…"),
    (["/opt/" + "x" * 80], 20, "/opt/xxxxxxxxxxxxxx…"),
    (["/opt/jobs/bin/backup", "--target", "s3://bucket/nightly", "--verbose"], None,
     "/opt/jobs/bin/backup --target s3://bucket/nightly --verbose"),
])
def test_the_command_is_cut_at_a_word_with_an_ellipsis(argv, width, shown) -> None:
    text = output.command_text(argv, width)
    assert text == shown
    assert width is None or len(text) <= width


@pytest.mark.parametrize(("made", "most", "shown"), [
    (0, 2, "0 of 2"), (2, 2, "2 of 2"), (3, 2, "3 (2 by --max-attempts, 1 more by resume)"),
    (5, 1, "5 (1 by --max-attempts, 4 more by resume)"),
])
def test_the_attempts_line_after_a_resume(made, most, shown) -> None:
    assert output.attempts_text(made, most) == shown


@pytest.mark.parametrize(("state", "phrase"), [
    ("succeeded", "succeeded"), ("expired", "expired"), ("running", "is running"), ("queued", "is queued"),
])
def test_a_state_reads_as_english(state, phrase) -> None:
    assert output.state_phrase(state) == phrase


def test_prune_defaults_to_retention_keep_finished(run_cli, tmp_path, monkeypatch) -> None:  # noqa: F811
    seen = []
    monkeypatch.setattr(store, "connect", lambda dsn, *a, **k: FakeConnection())
    monkeypatch.setattr(store, "pending_migrations", lambda conn: [])
    monkeypatch.setattr(store, "prune_count", lambda conn, age: seen.append(age) or store.Pruned(3, 4, 5, 6))
    path = tmp_path / "unitvisor.toml"
    path.write_text('[retention]\nkeep_finished = "7d"\n')
    result = run_cli("--config", str(path), "--dsn", A, "prune", "--dry-run")
    assert result.code == 0, result.err
    assert [age.total_seconds() for age in seen] == [7 * 86400]
    assert result.out.startswith("would delete 3 run(s) finished more than 7d00h ago")

    path.write_text('[retention]\nkeep_finished = "off"\n')
    result = run_cli("--config", str(path), "--dsn", A, "prune", "--dry-run")
    assert result.code == 2 and "give --older-than" in result.line


def test_logs_of_several_attempts_here_prints_a_header_before_each(run_cli, tmp_path, monkeypatch) -> None:  # noqa: F811
    import subprocess
    import uuid

    from supervisor.cli import runs
    from supervisor.model import Attempt, Run

    run_id = uuid.UUID(int=7)
    attempts = [Attempt(run_id, 1, "h1", "u1", outcome="exit-code", exit_status="exit:3"),
                Attempt(run_id, 2, "h1", "u2", outcome="success", exit_status="exit:0")]
    monkeypatch.setattr(store, "connect", lambda dsn, *a, **k: FakeConnection())
    monkeypatch.setattr(store, "pending_migrations", lambda conn: [])
    monkeypatch.setattr(store, "get_run", lambda conn, rid: Run(run_id, ["/bin/true"], state="succeeded"))
    monkeypatch.setattr(store, "get_attempts", lambda conn, rid: attempts)
    monkeypatch.setattr(store, "get_outcome_records", lambda conn, rid: {})
    monkeypatch.setattr(runs.Journal, "has_output", lambda self, rid, attempt: True)
    monkeypatch.setattr(runs.os, "execvp", lambda *a: pytest.fail("one journalctl for all attempts"))
    commands = []

    def journalctl(cmd, check):
        commands.append(cmd)
        print(f"output of {cmd[-1]}", flush=True)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(runs.subprocess, "run", journalctl)
    path = tmp_path / "unitvisor.toml"
    path.write_text('[host]\nid = "h1"\n')
    result = run_cli("--config", str(path), "--dsn", A, "logs", str(run_id), "-n", "5")
    assert result.code == 0, result.err
    assert [c[-2:] for c in commands] == [["UNITVISOR_ATTEMPT=1", "--lines=5"], ["UNITVISOR_ATTEMPT=2", "--lines=5"]]
    assert result.out.splitlines() == [
        f"-- attempt 1 of run {run_id} on host h1: exit-code (exit:3) --", "output of --lines=5",
        f"-- attempt 2 of run {run_id} on host h1: success (exit:0) --", "output of --lines=5"]
