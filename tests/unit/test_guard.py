"""supervisor.guard: the stall breaker, driven by hand through Guard.check(now).

The thread is never started here: `check` is called with chosen monotonic times, `_run` with a
stopping event that says "go on" once, and the loop's clock (`busy`) is the patched `time` of the module.
"""

from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace
from unittest import mock

import psycopg
import pytest

from supervisor import guard as guard_mod
from supervisor.guard import Guard, GuardedConnection

STALL = 20.0
CUT_OFF = 48.0


class FakeConn:
    """What the guard touches of a connection: `closed` and `pgconn.socket`."""

    def __init__(self, fd: int = 99, closed: bool = False) -> None:
        self.closed = closed
        self.pgconn = SimpleNamespace(socket=fd)


@pytest.fixture
def clock(mocker):
    """The module's time: busy() stamps time.monotonic()."""
    fake = mocker.patch.object(guard_mod, "time")
    fake.monotonic.return_value = 100.0
    return fake


@pytest.fixture
def shutdown(mocker):
    return mocker.patch.object(guard_mod, "_shutdown")


@pytest.fixture
def events(mocker):
    return mocker.patch.object(guard_mod, "event")


def names(events):
    return [c.args[0] for c in events.call_args_list]


def make_guard():
    return Guard(STALL), None


# -- the stall breaker --------------------------------------------------------------------------

def test_a_call_waiting_longer_than_stall_after_gets_its_socket_shut_down_once(clock, shutdown, events):
    guard, _ = make_guard()
    conn = FakeConn()
    guard.busy(conn)  # at 100
    guard.check(100.0 + STALL)  # exactly stall_after: not yet
    shutdown.assert_not_called()
    guard.check(100.0 + STALL + 0.5)
    shutdown.assert_called_once_with(conn)
    assert names(events) == ["database-stalled"]
    assert "no answer from the database for 20s" in events.call_args.kwargs["detail"]
    guard.check(100.0 + STALL + 1.0)
    guard.check(100.0 + 10 * STALL)
    shutdown.assert_called_once_with(conn)
    assert names(events) == ["database-stalled"]


@pytest.mark.parametrize("now", [100.0, 110.0, 119.99, 120.0])
def test_no_shutdown_before_stall_after(clock, shutdown, events, now):
    guard, _ = make_guard()
    guard.busy(FakeConn())
    guard.check(now)
    shutdown.assert_not_called()
    events.assert_not_called()


def test_no_shutdown_after_idle(clock, shutdown, events):
    guard, _ = make_guard()
    conn = FakeConn()
    guard.busy(conn)
    guard.idle(conn)
    guard.check(100.0 + 100 * STALL)
    shutdown.assert_not_called()
    events.assert_not_called()


def test_no_shutdown_of_a_connection_already_closed(clock, shutdown):
    guard, _ = make_guard()
    guard.busy(FakeConn(closed=True))
    guard.check(100.0 + 2 * STALL)
    shutdown.assert_not_called()


def test_the_stall_clock_starts_again_at_each_busy(clock, shutdown):
    guard, _ = make_guard()
    conn = FakeConn()
    guard.busy(conn)
    guard.idle(conn)
    clock.monotonic.return_value = 115.0
    guard.busy(conn)
    guard.check(130.0)  # 30 s after the first busy, 15 s after this one
    shutdown.assert_not_called()
    guard.check(135.5)
    shutdown.assert_called_once_with(conn)


def test_a_new_call_after_the_breaker_fired_is_watched_again(clock, shutdown):
    guard, _ = make_guard()
    first, second = FakeConn(1), FakeConn(2)
    guard.busy(first)
    guard.check(121.0)
    clock.monotonic.return_value = 200.0
    guard.busy(second)  # the loop reconnected and waits again
    guard.check(210.0)
    guard.check(221.0)
    assert shutdown.call_args_list == [mock.call(first), mock.call(second)]


def test_the_socket_is_shut_down_while_holding_the_closing_lock(clock, mocker):
    """The loop closes connections under guard.closing(): a socket number closed and reused by
    something else must never be shut down by the guard."""
    guard, _ = make_guard()
    held = []
    mocker.patch.object(guard_mod, "_shutdown", side_effect=lambda conn: held.append(guard.closing().locked()))
    guard.busy(FakeConn())
    guard.check(200.0)
    assert held == [True]
    assert not guard.closing().locked()


def test_check_waits_for_a_close_in_progress(clock, shutdown):
    guard, _ = make_guard()
    guard.busy(FakeConn())
    checker = threading.Thread(target=guard.check, args=(200.0,))
    with guard.closing():
        checker.start()
        checker.join(timeout=0.05)
        assert checker.is_alive()  # blocked on the lock the loop holds while it closes
        shutdown.assert_not_called()
    checker.join(timeout=5)
    assert not checker.is_alive()
    shutdown.assert_called_once()


def test_shutdown_wakes_the_peer_without_closing_the_descriptor():
    ours, peer = socket.socketpair()
    try:
        guard_mod._shutdown(FakeConn(ours.fileno()))
        assert peer.recv(1) == b""  # end of file: whoever waited on it gets an error
        os.fstat(ours.fileno())  # still open: psycopg closes it itself
        with pytest.raises(OSError):
            ours.send(b"x")
    finally:
        ours.close()
        peer.close()


def test_shutdown_of_a_descriptor_no_longer_open_is_quiet(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    os.close(fd)
    guard_mod._shutdown(FakeConn(fd))


def test_shutdown_of_a_descriptor_that_is_not_a_socket_is_quiet(tmp_path):
    with open(tmp_path / "f", "w") as file:
        guard_mod._shutdown(FakeConn(file.fileno()))
        os.fstat(file.fileno())


# -- the dead man's switch moved out --------------------------------------------------------------

def test_the_guard_stops_no_unit_however_long_the_heartbeat_is_old(clock, shutdown, events):
    """The cut-off stop is unitvisor-fence's (supervisor/fence.py, tests/unit/test_fence.py): one owner
    for one concern, and one that outlives this process. The guard only keeps the renewal time."""
    guard, _ = make_guard()
    guard.renewed(0.0)
    for now in (CUT_OFF, 1e3, 1e9):
        guard.check(now)
    assert names(events) == []
    assert guard.renewed_within(10.0, 5.0) and not guard.renewed_within(10.0, 10.0)


# -- the thread's loop --------------------------------------------------------------------------

def run_once(guard):
    """_run for one round: the stopping event says 'go on' once, then 'stop'."""
    guard._stopping = mock.Mock()
    guard._stopping.wait.side_effect = [False, True]
    guard._run()
    assert guard._stopping.wait.call_args_list == [mock.call(guard_mod.CHECK_EVERY)] * 2


def test_run_checks_with_the_monotonic_clock(clock, mocker):
    guard, _ = make_guard()
    check = mocker.patch.object(guard, "check")
    clock.monotonic.return_value = 1234.5
    run_once(guard)
    check.assert_called_once_with(1234.5)


def test_run_goes_on_after_an_error(clock, events, mocker):
    guard, _ = make_guard()
    check = mocker.patch.object(guard, "check", side_effect=[ValueError("x"), None])
    guard._stopping = mock.Mock()
    guard._stopping.wait.side_effect = [False, False, True]
    guard._run()
    assert check.call_count == 2
    assert names(events) == ["guard-error"]


def test_stop_without_start_does_not_block():
    guard, _ = make_guard()
    guard.stop()
    assert guard._stopping.is_set()


# -- GuardedConnection --------------------------------------------------------------------------

def guarded():
    """A GuardedConnection object without a server: only wait() is exercised."""
    return GuardedConnection.__new__(GuardedConnection)


def test_wait_marks_the_connection_busy_then_idle_around_the_wait(mocker):
    order = []
    spy = mock.Mock()
    spy.busy.side_effect = lambda c: order.append(("busy", c))
    spy.idle.side_effect = lambda c: order.append(("idle", c))
    conn = guarded()
    conn.guard = spy

    def inner(self, *args, **kwargs):
        order.append(("wait", args, kwargs))
        return "result"

    mocker.patch.object(psycopg.Connection, "wait", inner)
    assert conn.wait("gen", timeout=5) == "result"
    assert order == [("busy", conn), ("wait", ("gen",), {"timeout": 5}), ("idle", conn)]


def test_wait_marks_the_connection_idle_even_when_the_wait_raises(mocker):
    spy = mock.Mock()
    conn = guarded()
    conn.guard = spy
    mocker.patch.object(psycopg.Connection, "wait", side_effect=psycopg.OperationalError("consuming input failed"))
    with pytest.raises(psycopg.OperationalError, match="consuming input failed"):
        conn.wait("gen")
    spy.busy.assert_called_once_with(conn)
    spy.idle.assert_called_once_with(conn)


def test_wait_without_a_guard_just_waits(mocker):
    conn = guarded()
    inner = mocker.patch.object(psycopg.Connection, "wait", return_value=7)
    assert conn.wait("gen") == 7
    inner.assert_called_once_with("gen")


def test_wait_with_a_real_guard_clears_busy(clock, mocker):
    guard, _ = make_guard()
    conn = guarded()
    conn.guard = guard
    seen = []
    mocker.patch.object(psycopg.Connection, "wait", side_effect=lambda *a, **k: seen.append(guard._busy))
    conn.wait("gen")
    assert seen == [conn]
    assert guard._busy is None
