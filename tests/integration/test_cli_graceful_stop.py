"""`unitvisor submit`'s graceful stop options (schema 026) and what `show` says of them, as a subprocess
against the real database."""

from __future__ import annotations

import json

import psycopg
import pytest

from supervisor import store
from tests.integration.conftest import assert_nothing_written
from tests.integration.test_cli_db import assert_one_line_error, submit


def test_submit_stores_the_stop_settings_and_show_says_them(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--stop-signal", "sigint", "--stop-timeout", "5s", "--runtime", "1m",
                    "--warn-before", "10s", "--warn-signal", "USR2", "--", "/bin/true")
    run = store.get_run(conn, run_id)
    assert (run.stop_signal, run.stop_timeout, run.warn_before, run.warn_signal) == ("INT", 5, 10, "USR2")
    data = json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)
    assert data["stop"] == {"stop_signal": "INT", "stop_timeout": 5, "warn_before": 10, "warn_signal": "USR2"}
    assert "  stop:      signal=SIGINT timeout=5s warn=SIGUSR2 10s before runtime\n" in cli(
        "show", str(run_id), dsn=dsn).stdout


def test_a_run_without_them_shows_the_defaults_in_json_and_no_stop_line(cli, dsn: str) -> None:
    run_id = submit(cli, dsn, "--", "/bin/true")
    data = json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)
    assert data["stop"] == {"stop_signal": "TERM", "stop_timeout": None, "warn_before": None, "warn_signal": None}
    assert data["attempts"] == []
    assert "  stop:" not in cli("show", str(run_id), dsn=dsn).stdout


@pytest.mark.parametrize("args", [
    pytest.param(["--stop-signal", "SEGV"], id="stop-signal"),
    pytest.param(["--stop-signal", "15"], id="stop-signal-number"),
    pytest.param(["--stop-timeout", "0s"], id="stop-timeout-zero"),
    pytest.param(["--stop-timeout", "2d"], id="stop-timeout-long"),
    pytest.param(["--warn-before", "10s"], id="warn-before-without-runtime"),
    pytest.param(["--runtime", "10s", "--warn-before", "10s"], id="warn-before-not-before"),
    pytest.param(["--warn-signal", "USR1"], id="warn-signal-alone"),
    pytest.param(["--runtime", "1m", "--warn-before", "10s", "--warn-signal", "KILL"], id="warn-signal-kill"),
])
def test_bad_stop_options_are_usage_errors_and_write_nothing(cli, dsn: str, conn: psycopg.Connection,
                                                             args: list[str]) -> None:
    line = assert_one_line_error(cli("submit", *args, "--", "/bin/true", dsn=dsn), 2)
    assert "--stop-" in line or "--warn-" in line, line
    assert_nothing_written(conn)
