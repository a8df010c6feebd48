"""The store sends this host's clock with every outcome it records, so that the database can put the
times systemd read on this host on its own clock (sql/013_fleet_promises.sql). The database side, with a
clock 30 s off, is tests/integration/test_fleet_promises.py."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from unittest.mock import MagicMock

from supervisor import store
from supervisor.model import Attempt
from supervisor.outcomes import Outcome


def test_record_outcomes_sends_the_hosts_clock_read_at_the_call(mocker) -> None:
    conn = MagicMock()
    conn.execute.return_value.fetchall.return_value = [(1, True)]
    read = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    mocker.patch.object(store, "host_clock", return_value=read)
    attempt = Attempt(run_id=uuid.uuid4(), attempt=1, host_id="h1", unit_name="u")
    ended = read - timedelta(seconds=3)
    assert store.record_outcome(conn, store.Fence("h1", 7), attempt, Outcome("success", "exit:0", "exited 0"),
                                "succeeded", ended_at=ended) is True
    query, params = conn.execute.call_args.args
    assert "t.io_write_bytes, %s::timestamptz, t.tasks_peak)" in query  # record_outcome's 18-argument form
    assert params[:3] == ("h1", 7, read)
    assert [ended] in params  # systemd's reading goes as read: the database moves it


def test_the_hosts_clock_is_the_real_time_with_its_zone() -> None:
    before = datetime.now(UTC)
    read = store.host_clock()
    assert read.tzinfo is not None and before <= read <= datetime.now(UTC)
