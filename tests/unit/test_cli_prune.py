"""`unitvisor prune`: its argument errors (exit 2, one line, nothing deleted), and how it loops over
batches and waits for a busy lock, with the store replaced (tests/integration/test_cli_retention.py
runs it against PostgreSQL)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from supervisor import store
from supervisor.cli import operations
from tests.unit.test_cli_args import FakeConnection, config, run_cli  # noqa: F401 (fixtures)


class Calls(list):
    """The (older_than, batch_size) of each prune call; `script` is what the calls return, in order."""

    script: list[store.Pruned]


@pytest.fixture
def batches(monkeypatch) -> Calls:
    """A database whose prune returns the batches of `batches.script`; records each call."""
    calls = Calls()
    script: list[store.Pruned] = []
    calls.script = script

    def prune_batch(conn: Any, older_than: timedelta, batch_size: int, fence: Any = None) -> store.Pruned:
        assert fence is None  # the admin's prune, not a host's
        calls.append((older_than, batch_size))
        return script.pop(0)

    monkeypatch.setattr(store, "connect", lambda dsn, *a, **k: FakeConnection())
    monkeypatch.setattr(store, "pending_migrations", lambda conn: [])
    monkeypatch.setattr(store, "prune_batch", prune_batch)
    monkeypatch.setattr(operations.time, "sleep", lambda seconds: None)
    monkeypatch.setenv("UNITVISOR_DSN", "host=db.example dbname=x")
    return calls


@pytest.mark.parametrize(("args", "message"), [
    ([], "Missing option '--older-than'."),
    (["--older-than", "0"], "--older-than: invalid duration '0': must be more than zero (the range is 1s to 115740d)"),
    (["--older-than", "thirty days"], "--older-than: invalid duration 'thirty days': use a number with s, m, h or d, "
     "like 90s or 10m (the range is 1s to 115740d)"),
    (["--older-than", "-1d"], "--older-than: invalid duration '-1d': use a number with s, m, h or d, like 90s or 10m "
     "(the range is 1s to 115740d)"),
    (["--older-than", "0.5"], "--older-than: 0.5 seconds is out of range (1s to 115740d)"),
    (["--older-than", "30d", "--batch-size", "0"], "--batch-size: 0 is out of range (1 to 100000)"),
    (["--older-than", "30d", "--batch-size", "100001"], "--batch-size: 100001 is out of range (1 to 100000)"),
])
def test_a_bad_argument_is_exit_2_in_one_line_and_deletes_nothing(run_cli, config, batches, args,  # noqa: F811
                                                                   message) -> None:
    result = run_cli("--config", str(config), "prune", *args)
    assert result.code == 2
    assert result.line == f"unitvisor: {message}; see 'unitvisor prune --help'"
    assert batches == []


def test_prune_loops_while_batches_are_full_and_waits_out_a_busy_lock(run_cli, config, batches) -> None:  # noqa: F811
    batches.script.extend([store.Pruned(2, 2, 6, 2), store.Pruned(0, 0, 0, 0, busy=True),
                           store.Pruned(2, 1, 3, 0), store.Pruned(1, 1, 3, 1)])
    result = run_cli("--config", str(config), "prune", "--older-than", "30d", "--batch-size", "2", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out) == {"dry_run": False, "older_than_seconds": 30 * 86400.0, "runs": 5,
                                      "attempts": 4, "events": 12, "jobs": 3}
    assert batches == [(timedelta(days=30), 2)] * 4


def test_prune_gives_up_on_a_lock_held_too_long(run_cli, config, batches, monkeypatch) -> None:  # noqa: F811
    batches.script.extend([store.Pruned(2, 2, 6, 2)] + [store.Pruned(0, 0, 0, 0, busy=True)] * 3)
    clock = iter(range(0, 1000, 25))  # 25 s later at every look
    monkeypatch.setattr(operations.time, "monotonic", lambda: float(next(clock)))
    result = run_cli("--config", str(config), "prune", "--older-than", "1d", "--batch-size", "2")
    assert result.code == 1
    assert result.line == ("unitvisor: another session has been pruning for 60s; 2 runs deleted so far; "
                           "try again later")
