"""The aside heartbeat (supervisor/heartbeat.py): sent on a connection of its own only when the loop is
late with its probe and still alive; the database at the store boundary is mocked."""

from __future__ import annotations

from unittest import mock

import psycopg
import pytest

from supervisor import heartbeat, store

FENCE = store.Fence("h1", 4)


class FakeLoop:
    def __init__(self) -> None:
        self.fence: store.Fence | None = FENCE
        self.renewed_at: float | None = 100.0
        self.alive_at = 100.0
        self.renewals: list[tuple[float, float]] = []

    def renewed(self, sent: float, sent_boot: float) -> bool:
        self.renewals.append((sent, sent_boot))
        self.renewed_at = sent
        return True

    def as_loop(self) -> heartbeat.Loop:
        return heartbeat.Loop(fence=lambda: self.fence, dsn=lambda: "dbname=x", renewed_at=lambda: self.renewed_at,
                              alive_at=lambda: self.alive_at, renewed=self.renewed)


@pytest.fixture
def loop():
    return FakeLoop()


@pytest.fixture
def db(mocker):
    conn = mock.MagicMock(name="aside-conn")
    return mock.Mock(conn=conn, connect=mocker.patch.object(store, "connect", return_value=conn),
                     renew=mocker.patch.object(store, "renew_heartbeat", return_value="active"),
                     event=mocker.patch.object(heartbeat, "event"),
                     clock=mocker.patch.object(heartbeat.time, "monotonic", return_value=200.0),
                     boot=mocker.patch.object(heartbeat.fence_lease, "boottime", return_value=9200.0))


def aside(loop: FakeLoop, sent: list | None = None) -> heartbeat.AsideHeartbeat:
    return heartbeat.AsideHeartbeat(loop.as_loop(), poll_interval=10.0, dead_after=60.0,
                                    on_sent=(lambda: sent.append(1)) if sent is not None else lambda: None)


def test_nothing_is_sent_while_the_loop_keeps_time(loop, db):
    a = aside(loop)
    assert a.check(114.0) is False  # 14 s since the last heartbeat: under 1.5 poll intervals
    db.connect.assert_not_called()
    db.renew.assert_not_called()


def test_a_late_loop_gets_its_heartbeat_sent_on_a_connection_of_its_own(loop, db):
    sent: list[int] = []
    a = aside(loop, sent)
    loop.alive_at = 112.0  # busy, but alive: it fed its watchdog 4 s ago

    def the_loop_sends_its_own_meanwhile(*_: object) -> str:
        loop.renewed_at = 117.0
        return "active"

    db.renew.side_effect = the_loop_sends_its_own_meanwhile
    assert a.check(116.0) is True
    db.connect.assert_called_once_with("dbname=x")
    db.renew.assert_called_once_with(db.conn, FENCE)
    assert loop.renewals == [(200.0, 9200.0)]  # from the send time, as the loop's own probe
    assert sent == [1]
    assert [c.args[0] for c in db.event.call_args_list] == ["heartbeat-aside"]  # said once per late spell
    assert "was sent 16s ago" in db.event.call_args.kwargs["detail"]  # not from the renewal it just made
    loop.renewed_at = 100.0
    assert a.check(117.0) is True
    assert db.connect.call_count == 1 and db.event.call_count == 1  # the same connection, nothing said again


def test_a_wedged_loop_is_not_kept_alive(loop, db):
    a = aside(loop)
    loop.alive_at = 85.0  # no progress for 31 s: over half of host_dead_after
    assert a.check(116.0) is False
    db.renew.assert_not_called()


def test_an_unregistered_loop_has_nothing_to_renew(loop, db):
    loop.fence = None
    assert aside(loop).check(130.0) is False
    db.renew.assert_not_called()


def test_a_fenced_host_renews_nothing(loop, db):
    db.renew.return_value = None
    loop.alive_at = 115.0
    assert aside(loop).check(116.0) is False
    assert loop.renewals == []


def test_a_failure_closes_the_connection_and_is_said_once(loop, db):
    db.renew.side_effect = psycopg.OperationalError("server closed the connection unexpectedly")
    loop.alive_at = 115.0
    a = aside(loop)
    assert a.check(116.0) is False
    assert a.check(117.1) is False  # the first pause is at most 1 s
    assert db.conn.close.call_count == 2 and a.conn is None
    assert [c.args[0] for c in db.event.call_args_list] == ["heartbeat-aside-failed"]


def test_a_host_that_cannot_connect_tries_less_and_less_often(loop, db, mocker):
    """Not twice a second (its check's pace): a fleet that cannot connect, all trying at once, is the
    storm that keeps the server from answering. 1 s, then twice as long, at most half a poll interval,
    each pause from half to all of that."""
    mocker.patch.object(heartbeat.random, "uniform", side_effect=lambda low, high: high)
    db.connect.side_effect = psycopg.OperationalError("sorry, too many clients already")
    loop.alive_at = 115.0
    a = aside(loop)
    tried, now = [], 116.0
    while now < 140.0:
        before = db.connect.call_count
        a.check(now)
        if db.connect.call_count > before:
            tried.append(now)
        now = round(now + heartbeat.CHECK_EVERY, 1)
        loop.alive_at = now
    assert tried == [116.0, 117.0, 119.0, 123.0, 128.0, 133.0, 138.0]
    db.connect.side_effect = None
    a.check(143.0)
    assert (a.failures, a.retry_at) == (0, 0.0)  # sent: the next failure pauses 1 s again


def test_the_connection_is_closed_once_the_loop_kept_time_again(loop, db):
    a = aside(loop)
    loop.alive_at = 115.0
    assert a.check(116.0) is True
    loop.renewed_at = 170.0  # the loop heartbeats again
    assert a.check(171.0) is False and a.conn is not None  # not at once: it may be late again
    assert a.check(177.0) is False and a.conn is None  # 6 poll intervals after the last aside heartbeat
    db.conn.close.assert_called_once_with()
