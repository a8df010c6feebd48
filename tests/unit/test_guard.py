"""supervisor.guard: the stall breaker and the dead man's switch, driven by hand through Guard.check(now).

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
from supervisor.systemd import SystemdUnavailable

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


def make_guard(cut_off_after=CUT_OFF, stopped=("unitvisor-run-a-1.service", "unitvisor-run-b-1.service")):
    stop_units = mock.Mock(return_value=list(stopped))
    return Guard(STALL, cut_off_after, stop_units), stop_units


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


# -- the dead man's switch ----------------------------------------------------------------------

def test_cut_off_stops_the_units_once_at_cut_off_after(events):
    guard, stop_units = make_guard()
    guard.renewed(1000.0)
    guard.check(1000.0 + CUT_OFF - 0.1)
    stop_units.assert_not_called()
    assert guard.cut_off is False
    guard.check(1000.0 + CUT_OFF)
    stop_units.assert_called_once_with()
    assert guard.cut_off is True
    assert guard.cut_off_units == {"unitvisor-run-a-1.service", "unitvisor-run-b-1.service"}
    assert names(events) == ["cut-off"]
    assert events.call_args.kwargs["runs"] == 2
    assert "heartbeat not renewed for 48s" in events.call_args.kwargs["detail"]
    for later in (1049.0, 1100.0, 10_000.0):
        guard.check(later)
    stop_units.assert_called_once_with()
    assert names(events) == ["cut-off"]


def test_cut_off_fires_again_only_after_a_renewal(events):
    guard, stop_units = make_guard()
    guard.renewed(0.0)
    guard.check(CUT_OFF)
    assert guard.cut_off
    stop_units.return_value = ["unitvisor-run-c-1.service"]
    guard.renewed(500.0)
    assert guard.cut_off is False
    guard.check(500.0 + CUT_OFF - 1)
    assert stop_units.call_count == 1
    guard.check(500.0 + CUT_OFF)
    assert stop_units.call_count == 2
    assert guard.cut_off_units == {"unitvisor-run-a-1.service", "unitvisor-run-b-1.service",
                                   "unitvisor-run-c-1.service"}


def test_a_renewal_before_the_deadline_postpones_it():
    guard, stop_units = make_guard()
    guard.renewed(0.0)
    guard.check(40.0)
    guard.renewed(40.0)
    guard.check(80.0)
    stop_units.assert_not_called()
    guard.check(88.0)
    stop_units.assert_called_once()


def test_cut_off_never_fires_when_the_switch_is_off():
    guard, stop_units = make_guard(cut_off_after=None)
    guard.renewed(0.0)
    for now in (CUT_OFF, 1e3, 1e9):
        guard.check(now)
    stop_units.assert_not_called()
    assert guard.cut_off is False and guard.cut_off_units == set()


def test_cut_off_never_fires_before_a_first_renewal():
    """Before the first registration nothing of this daemon's runs could be claimed elsewhere."""
    guard, stop_units = make_guard()
    for now in (CUT_OFF, 1e3, 1e9):
        guard.check(now)
    stop_units.assert_not_called()
    assert guard.cut_off is False


def test_cut_off_with_nothing_running_records_nothing(events):
    guard, stop_units = make_guard(stopped=())
    guard.renewed(0.0)
    guard.check(CUT_OFF)
    stop_units.assert_called_once()
    assert guard.cut_off is True and guard.cut_off_units == set()
    assert events.call_args.kwargs["runs"] == 0


def test_stall_and_cut_off_in_one_check(clock, shutdown, events):
    guard, stop_units = make_guard()
    guard.renewed(50.0)
    guard.busy(FakeConn())  # at 100
    guard.check(125.0)  # stalled for 25 s, and 75 s since the heartbeat
    shutdown.assert_called_once()
    stop_units.assert_called_once()
    assert names(events) == ["database-stalled", "cut-off"]


def test_a_failed_cut_off_stop_is_tried_again_at_the_next_check():
    guard, stop_units = make_guard()
    stop_units.side_effect = [SystemdUnavailable("connecting to the system bus: systemd is not reachable"),
                              ["unitvisor-run-a-1.service"]]
    guard.renewed(0.0)
    with pytest.raises(SystemdUnavailable):
        guard.check(CUT_OFF)
    guard.check(CUT_OFF + guard_mod.CHECK_EVERY)
    assert stop_units.call_count == 2
    assert guard.cut_off_units == {"unitvisor-run-a-1.service"}


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


def test_an_exception_in_stop_units_is_contained_by_run(clock, events):
    guard, stop_units = make_guard()
    stop_units.side_effect = RuntimeError("bus gone")
    guard.renewed(0.0)
    clock.monotonic.return_value = 1000.0
    run_once(guard)  # returns: the exception did not escape
    stop_units.assert_called_once()
    assert names(events) == ["guard-error"]
    assert events.call_args.kwargs["detail"] == "RuntimeError: bus gone"


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
