"""supervisor.daemon.Daemon.run and its sd_notify messages: READY=1 once (even while the database is down),
STOPPING=1, STATUS= on trouble and recovery, and the watchdog at half of WATCHDOG_USEC.

sdnotify, systemd, the watcher, the store, signal handlers and the clock are mocks; the guard's thread is
never started. The loop is driven by the mocks: a test ends it by setting `stopping` from inside one of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from datetime import UTC, datetime
from unittest import mock

import psycopg
import pytest

from supervisor import daemon as daemon_mod
from supervisor import freezer, store
from supervisor.config import HostSettings, MetricsSettings, RunSettings, Settings
from supervisor.daemon import Daemon, Timers

DSN = "host=db.example dbname=unitvisor user=uv"


class Clock:
    """time.monotonic and time.sleep for the daemon module: sleeping advances the clock."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(mocker):
    c = Clock()
    mocker.patch.object(daemon_mod, "time", mock.Mock(monotonic=c.monotonic, sleep=c.sleep))
    return c


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    return monkeypatch


@pytest.fixture
def boundaries(mocker, env):
    # A retry's pause is drawn at random (daemon.spread, tested in test_daemon.py): the exact schedule here.
    mocker.patch.object(daemon_mod, "spread", side_effect=lambda seconds: seconds)
    mocker.patch.object(daemon_mod, "Systemd")
    mocker.patch.object(daemon_mod, "Watcher")
    mocker.patch.object(daemon_mod, "sdnotify")
    mocker.patch.object(daemon_mod, "event")
    mocker.patch.object(daemon_mod, "Reconciler")
    mocker.patch.object(daemon_mod, "signal")  # no handler of the test process is replaced
    mocker.patch.object(daemon_mod.os, "pipe2", return_value=(-1, -1))


def settings() -> Settings:
    # No metrics server: these tests run the loop, not a socket (tests/unit/test_metrics.py has it).
    return dataclasses.replace(Settings(), host=HostSettings(id="h1", name="host-1"),
                               runs=RunSettings(allowed_executables=("/bin/*",)),
                               metrics=MetricsSettings(listen=""))


@pytest.fixture
def make(boundaries):
    def build() -> Daemon:
        d = Daemon(settings(), lambda: DSN)
        d.is_root = True
        d.guard = mock.MagicMock()  # the thread is never started
        return d
    return build


def notes(d: Daemon) -> list[str]:
    return [c.args[0] for c in d.notifier.notify.call_args_list]


def kinds(d: Daemon) -> list[str]:
    return [n.split("=", 1)[0] for n in notes(d)]


def stop_after(d: Daemon, n: int):
    """A side effect that sets `stopping` on its n-th call."""
    calls = []

    def effect(*args, **kwargs):
        calls.append(args)
        if len(calls) >= n:
            d.stopping = True
    return effect


# -- READY=1 and STOPPING=1 -----------------------------------------------------------------------------------

def test_ready_once_while_the_database_stays_down(make, clock):
    d = make()
    d._connect = mock.Mock(return_value=False)
    d._sleep = mock.Mock(side_effect=stop_after(d, 4))
    assert d.run() == 0
    assert notes(d) == ["READY=1", "STOPPING=1"]
    assert d._connect.call_count == 4
    assert [c.args[0] for c in d._sleep.call_args_list] == [1.0, 2.0, 4.0, 8.0]  # backing off meanwhile


def test_ready_is_not_sent_again_when_the_database_comes_up(make, clock):
    d = make()
    d._connect = mock.Mock(side_effect=[False, False, True])
    d._connected = lambda: d._connect.call_count == 3  # up after the third try
    d._sleep = mock.Mock()
    d._reconcile = mock.Mock()
    d._iteration = mock.Mock(side_effect=stop_after(d, 2))
    d.run()
    assert kinds(d) == ["READY", "STOPPING"]
    d._reconcile.assert_called_once_with()  # the repair pass right after the connect
    assert d.backoff == 1.0


def test_ready_after_the_first_reconcile_when_the_database_is_up_at_start(make, clock):
    d = make()
    order = []
    d._connect = mock.Mock(return_value=True)
    d._reconcile = mock.Mock(side_effect=lambda: order.append(list(kinds(d))))
    d._iteration = mock.Mock(side_effect=stop_after(d, 1))
    d.run()
    assert order == [[]]  # nothing announced before the repair pass
    assert notes(d) == ["READY=1", "STOPPING=1"]
    assert daemon_mod.event.call_args_list[1] == mock.call("ready", host="h1")


def test_ready_waits_for_a_reconcile_that_succeeds(make, clock):
    d = make()
    d._connect = mock.Mock(return_value=True)
    d._connected = mock.Mock(return_value=False)
    d._reconcile = mock.Mock(side_effect=[store.DatabaseUnavailable("cannot connect: timeout"), None])
    d._iteration = mock.Mock(side_effect=stop_after(d, 1))
    d.run()
    assert kinds(d) == ["STATUS", "READY", "STOPPING"]
    assert d._connect.call_count == 2


def test_stopping_is_the_last_word_and_marks_the_host_stopped(make, clock, mocker):
    d = make()
    mark = mocker.patch.object(store, "mark_host_stopped")
    d._connect = mock.Mock(return_value=True)
    d._reconcile = mock.Mock()

    def iteration():
        d.conn, d.fence = mock.Mock(), store.Fence("h1", 3)
        d.stopping = True
    d._iteration = iteration
    d._connected = mock.Mock(return_value=False)
    d.run()
    assert notes(d)[-1] == "STOPPING=1"
    mark.assert_called_once()
    d.guard.start.assert_called_once_with()
    d.guard.stop.assert_called_once_with()


def test_a_signal_before_the_first_connect_still_says_stopping(make, clock):
    d = make()
    d.stopping = True
    d.run()
    assert notes(d) == ["STOPPING=1"]


def test_sigterm_sets_stopping(make):
    d = make()
    d._on_signal(15, None)
    assert d.stopping is True


# -- STATUS= on trouble and recovery ----------------------------------------------------------------------------

@pytest.fixture
def st(mocker):
    fakes = {name: mocker.patch.object(store, name) for name in
             ("connect", "listen", "pending_migrations", "set_idle_session_timeout", "register_host")}
    fakes["pending_migrations"].return_value = []
    fakes["register_host"].return_value = store.Registration(True, "active", 5, "registered")
    return mock.Mock(**fakes)


def test_status_says_what_is_wrong_then_that_it_recovered(make, clock, st):
    d = make()
    d.systemd.connected = d.watcher.connected = False
    st.connect.side_effect = [psycopg.OperationalError("connection refused"), mock.MagicMock()]

    def connected_once_set_up():
        return d.conn is not None and d.systemd.connected and d.watcher.connected

    def bus_up():
        d.systemd.connected = d.watcher.connected = True
    d.watcher.connect.side_effect = bus_up
    d._connected = connected_once_set_up
    d._sleep = mock.Mock()
    d._reconcile = mock.Mock()

    def iteration():
        d._status()
        d.stopping = True
    d._iteration = iteration
    d.run()
    assert notes(d) == [
        "STATUS=database: connection refused; retrying. runs in flight: 0, claimed since start: 0, "
        "settled since start: 0",
        "READY=1",
        f"STATUS=runs in flight: {d.reconciler.in_flight}, claimed since start: 0, "
        f"settled since start: {d.reconciler.settled}",
        "STOPPING=1",
    ]
    assert d.problem == ""


def test_the_counts_are_both_since_the_start_after_a_reconnect(make, clock, st):
    """Issue 24: `claimed` counted since the daemon's start and `settled` since the last connect (each
    connection has a new reconciler), so a reconnect showed "claimed: 9, settled: 0". Both go on."""
    d = make()
    daemon_mod.Reconciler.side_effect = lambda *a, **k: mock.Mock(settled=0, in_flight=0)
    st.connect.side_effect = lambda *a, **k: mock.MagicMock()
    d._reconcile = mock.Mock()
    passes = []

    def iteration():
        passes.append(d.reconciler)
        if len(passes) == 1:  # the first connection claims and settles 9, then is lost
            d.claimed, d.reconciler.settled = 9, 9
            d.conn = None
            return
        d._status()
        d.stopping = True
    d._iteration = iteration
    d.run()
    assert passes[0] is not passes[1]  # a reconciler of the new connection
    assert notes(d)[-2] == "STATUS=runs in flight: 0, claimed since start: 9, settled since start: 9"


def test_a_lost_bus_says_so_in_status(make, clock, st):
    d = make()
    d.systemd.connected = d.watcher.connected = False
    st.connect.side_effect = lambda *a, **k: mock.MagicMock()
    d.watcher.connect.side_effect = daemon_mod.SystemdUnavailable(
        "subscribing to systemd's signals: systemd is not reachable over D-Bus ([err -2]: no socket)")
    assert d._connect() is False
    d.watcher.close.assert_called_once_with()
    assert notes(d) == ["STATUS=subscribing to systemd's signals: systemd is not reachable over D-Bus ([err -2]: "
                        "no socket); retrying. runs in flight: 0, claimed since start: 0, settled since start: 0"]


def test_a_multi_line_problem_is_one_status_line(make):
    d = make()
    d._trouble("database: server closed the connection unexpectedly\n\tThis probably means the server terminated")
    (note,) = notes(d)
    assert "\n" not in note and "\t" not in note
    assert note.startswith("STATUS=database: server closed the connection unexpectedly This probably means")


# -- the watchdog ---------------------------------------------------------------------------------------------

def test_watchdog_is_fed_at_half_of_watchdog_usec(make, env, clock):
    env.setenv("WATCHDOG_USEC", "10000000")
    env.setenv("WATCHDOG_PID", str(os.getpid()))
    d = make()
    assert d.watchdog_interval == 5.0
    fed = []
    for now in (1000.0, 1002.0, 1004.999, 1005.0, 1009.9, 1010.0, 1010.1):
        clock.now = now
        before = len(notes(d))
        d._feed_watchdog()
        if len(notes(d)) > before:
            fed.append(now)
    assert fed == [1000.0, 1005.0, 1010.0]
    assert set(notes(d)) == {"WATCHDOG=1"}
    assert d.timers.watchdog == 1015.0


def test_no_watchdog_without_watchdog_usec(make, env, clock):
    d = make()
    assert d.watchdog_interval == 0.0
    d._feed_watchdog()
    assert notes(d) == []
    assert d.timers.watchdog == 1000.0 + 3600  # so that it never sets the loop's select timeout


def test_the_loops_wait_ends_in_time_for_the_watchdog():
    timers = Timers(claim=1030.0, reconcile=1060.0, watchdog=1004.0)
    assert timers.nearest(1000.0, cap=10.0) == 4.0
    assert Timers(claim=1030.0, reconcile=1060.0, watchdog=1004.0 + 3600).nearest(1000.0, cap=10.0) == 10.0


def test_a_backoff_sleep_keeps_feeding_the_watchdog(make, env, clock):
    env.setenv("WATCHDOG_USEC", "2000000")  # 1 s between feeds
    d = make()
    d._sleep(4.0)
    assert notes(d).count("WATCHDOG=1") == 4
    assert clock.now == pytest.approx(1004.0)
    assert max(clock.slept) <= 0.5


def test_a_sleep_ends_at_once_on_stopping(make, clock):
    d = make()
    clock.sleep = mock.Mock(side_effect=lambda s: setattr(d, "stopping", True))
    daemon_mod.time.sleep = clock.sleep
    d._sleep(30.0)
    clock.sleep.assert_called_once()


def test_the_loop_feeds_the_watchdog_while_the_database_is_down(make, env, clock):
    env.setenv("WATCHDOG_USEC", "1000000")
    d = make()
    d._connect = mock.Mock(return_value=False)
    sleeps = []

    def connect():
        sleeps.append(1)
        if len(sleeps) == 3:
            d.stopping = True
        return False
    d._connect = connect
    d.run()
    assert notes(d)[0] == "READY=1"
    assert notes(d).count("WATCHDOG=1") >= 6  # slept 1 + 2 s, fed every 0.5 s
    assert notes(d)[-1] == "STOPPING=1"


@pytest.mark.parametrize(("usec", "pid", "expected"), [
    (None, None, 0),
    ("30000000", None, 30000000),  # no WATCHDOG_PID: meant for us
    ("30000000", "self", 30000000),
    ("30000000", "other", 0),  # meant for another process (the watchdog was for the parent, say)
    ("30000000", "not-a-pid", 0),
    ("garbage", "self", 0),
    ("", None, 0),
])
def test_watchdog_usec_honours_watchdog_pid(env, usec, pid, expected):
    if usec is not None:
        env.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        env.setenv("WATCHDOG_PID", {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(pid, pid))
    assert daemon_mod._watchdog_usec() == expected


def test_a_watchdog_for_another_process_is_not_fed(make, env, clock):
    env.setenv("WATCHDOG_USEC", "10000000")
    env.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    d = make()
    d._feed_watchdog()
    assert notes(d) == []


# -- which spawn notifications wake the claim (sql/010_wake_targets.sql) ------------------------------------

@pytest.mark.parametrize(("payload", "targets"), [
    ("", None),  # every host, as before 010 (and what 0.3.0's trigger sends)
    ('{"hosts": ["h1", "h2"]}', frozenset({"h1", "h2"})),
    ('{"hosts": []}', frozenset()),
    ("not json", None),  # a payload this release cannot read: every host
    ('{"hosts": "h1"}', None),
    ('{"hosts": [1]}', None),
    ('{"later": true}', None),
    ("[]", None),
])
def test_spawn_hint_targets(payload, targets):
    assert store.spawn_hint_targets(payload) == targets


@pytest.fixture
def listening(make):
    d = make()
    d.reconciler = mock.Mock(in_flight=0)
    return d


@pytest.mark.parametrize(("payload", "wakes"), [
    ("", True),
    ('{"hosts": ["h1"]}', True),
    ('{"hosts": ["h0", "h1", "h2"]}', True),
    ('{"hosts": ["h2"]}', False),  # another host's run (its pin), or others have the room
    ('{"hosts": []}', False),
    ("garbage", True),
])
def test_a_spawn_hint_wakes_the_claim_only_when_it_names_this_host(listening, payload, wakes):
    listening._on_notify(psycopg.Notify(store.SPAWN_CHANNEL, payload, 4242))
    assert listening.notified == ({store.SPAWN_CHANNEL} if wakes else set())


def test_a_hint_on_its_own_channel_wakes_the_claim(listening):
    # Schema 048: a job that names this host alone, told on the channel its registration returned.
    listening.wake_channel = "unitvisor_spawn_0123"
    listening._on_notify(psycopg.Notify("unitvisor_spawn_0123", "", 4242))
    assert listening.notified == {store.SPAWN_CHANNEL}


def test_a_hint_on_its_own_channel_is_filtered_as_any(listening):
    listening.wake_channel = "unitvisor_spawn_0123"
    listening.reconciler.in_flight = listening.settings.host.max_runs  # every slot taken
    listening._on_notify(psycopg.Notify("unitvisor_spawn_0123", "", 4242))
    listening.reconciler.in_flight, listening.host_state = 0, "draining"
    listening._on_notify(psycopg.Notify("unitvisor_spawn_0123", "", 4242))
    assert listening.notified == set()


def test_a_request_on_its_own_channel_wakes_the_cancel_pass_whatever_the_slots(listening):
    # A cancel or freeze request for one of its runs (schema 048): acted on full, draining or not.
    listening.wake_channel = "unitvisor_spawn_0123"
    listening.reconciler.in_flight, listening.host_state = listening.settings.host.max_runs, "draining"
    listening._on_notify(psycopg.Notify("unitvisor_spawn_0123", store.OWN_CHANNEL_REQUEST, 4242))
    assert listening.notified == {store.CANCEL_CHANNEL}


def test_hints_read_from_the_idle_connection_are_filtered_too(listening):
    queue = [mock.Mock(relname=store.SPAWN_CHANNEL.encode(), extra=b'{"hosts": ["h2"]}'),
             mock.Mock(relname=store.CANCEL_CHANNEL.encode(), extra=b""), None]
    listening.conn = mock.Mock(pgconn=mock.Mock(notifies=mock.Mock(side_effect=queue)))
    listening._drain_notifications(receive=False)
    assert listening.notified == {store.CANCEL_CHANNEL}
    queue[:] = [mock.Mock(relname=store.SPAWN_CHANNEL.encode(), extra=b'{"hosts": ["h1"]}'), None]
    listening.conn.pgconn.notifies.side_effect = queue
    listening._drain_notifications(receive=False)
    assert listening.notified == {store.CANCEL_CHANNEL, store.SPAWN_CHANNEL}


@pytest.mark.parametrize("host_state", ["draining", "stopped"])
def test_a_host_that_is_not_active_ignores_spawn_hints_but_not_cancels(listening, host_state):
    listening.host_state = host_state
    listening._on_notify(psycopg.Notify(store.SPAWN_CHANNEL, '{"hosts": ["h1"]}', 4242))
    listening._on_notify(psycopg.Notify(store.SPAWN_CHANNEL, "", 4242))
    assert listening.notified == set()
    listening._on_notify(psycopg.Notify(store.CANCEL_CHANNEL, "", 4242))
    assert listening.notified == {store.CANCEL_CHANNEL}


def test_a_host_with_every_slot_taken_ignores_spawn_hints(listening):
    listening.reconciler.in_flight = listening.settings.host.max_runs
    listening._on_notify(psycopg.Notify(store.SPAWN_CHANNEL, "", 4242))
    assert listening.notified == set()
    listening.reconciler.in_flight -= 1  # one run ended: room again
    listening._on_notify(psycopg.Notify(store.SPAWN_CHANNEL, "", 4242))
    assert listening.notified == {store.SPAWN_CHANNEL}


# -- a forged notification (issue 21): any session with CONNECT may NOTIFY on the daemons' channels ------

FORGED_RUN = "6f1d9a2e-0000-4000-8000-00000000f0f0"


def test_a_forged_notification_only_wakes_the_daemon(make, clock, mocker):
    """A cancel naming a run, a spawn hint naming this host with more fields, and a forged completion:
    the daemon wakes, asks the database which of its attempts have a cancel request and what it may
    claim, and acts on those answers only. No part of a payload reaches a call."""
    d = make()
    d.fence = store.Fence("h1", 7)
    d.reconciler = mock.Mock(in_flight=0, settled=0)
    d.timers = Timers(claim=clock.now + 60, reconcile=clock.now + 60)
    d.watcher.drain.return_value = (set(), False)
    forged = [(store.CANCEL_CHANNEL, FORGED_RUN),
              (store.SPAWN_CHANNEL, f'{{"hosts": ["h1"], "run_id": "{FORGED_RUN}", "argv": ["/bin/sh"]}}'),
              ("unitvisor_run_finished", f'{{"run_id": "{FORGED_RUN}", "state": "succeeded"}}')]
    notes = [mock.Mock(relname=c.encode(), extra=p.encode()) for c, p in forged]
    d.conn = mock.Mock(fileno=mock.Mock(return_value=-1),
                       pgconn=mock.Mock(notifies=mock.Mock(side_effect=[*notes, None, None, None])))
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    open_attempts = mocker.patch.object(daemon_mod.store, "open_attempts", return_value=[])
    claim = mocker.patch.object(daemon_mod.store, "claim", return_value=[])
    freezes = mocker.patch.object(daemon_mod.store, "freeze_requests", return_value=[])
    d._iteration()
    open_attempts.assert_called_once_with(d.conn, "h1", cancel_requested=True)
    freezes.assert_called_once_with(d.conn, d.fence)  # schema 030: the same channel asks for freezes
    d.systemd.freeze.assert_not_called()
    d.systemd.thaw.assert_not_called()
    claim.assert_called_once_with(d.conn, d.fence, d.settings.daemon.claim_batch, mock.ANY)
    d.reconciler.reconcile_one.assert_not_called()  # the database named no attempt to stop
    d.systemd.stop.assert_not_called()
    for called in (open_attempts, claim, d.reconciler, d.systemd):
        assert FORGED_RUN not in repr(called.mock_calls)


def test_changed_units_are_decided_on_the_state_their_signals_said(make, clock, mocker):
    """Issue 27: a unit whose signals said all of its state is not read back from systemd; one whose
    signals did not (Watcher.signalled lacks it) is read as before."""
    d = make()
    d.fence = store.Fence("h1", 7)
    d.reconciler = mock.MagicMock(in_flight=2, settled=0)
    d.timers = Timers(claim=clock.now + 60, reconcile=clock.now + 60)
    said = mock.Mock(name="its state, as its signals said")
    d.watcher.drain.return_value = ({"unitvisor-run-a-1.service", "unitvisor-run-b-1.service"}, False)
    d.watcher.signalled = {"unitvisor-run-a-1.service": said}
    a, b = (mock.Mock(unit_name=f"unitvisor-run-{x}-1.service") for x in "ab")
    runs = mock.Mock(name="run a"), mock.Mock(name="run b")
    d.conn = mock.Mock(fileno=mock.Mock(return_value=-1), pgconn=mock.Mock(notifies=mock.Mock(return_value=None)))
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    mocker.patch.object(daemon_mod.store, "open_attempts", return_value=[(runs[0], a), (runs[1], b)])
    d.reconciler.isolated.side_effect = lambda run, attempt, work: work()
    d._iteration()
    assert d.reconciler.reconcile_one.call_args_list == [mock.call(runs[0], a, said), mock.call(runs[1], b, None)]


@pytest.mark.parametrize(("fencing", "said"), [
    (False, "if this daemon is not back within 60s (host_dead_after) they are declared lost and may run again"),
    (True, "unless this daemon is back within 48s, unitvisor-fence stops them"),
])
def test_a_stop_with_runs_in_flight_warns_what_becomes_of_them(make, clock, mocker, fencing, said):
    """`systemctl stop` longer than host_dead_after breaks a promise unless the fence keeps it: the
    daemon says which, in the journal, as it stops (issue 21)."""
    d = make()
    d.settings = dataclasses.replace(d.settings, fleet=dataclasses.replace(d.settings.fleet,
                                                                           stop_runs_when_cut_off=fencing))
    mocker.patch.object(store, "mark_host_stopped")
    d.reconciler = mock.Mock(in_flight=3)
    d.stopping = True
    d.run()
    [stopping] = [c for c in daemon_mod.event.call_args_list if c.args[0] == "stopping"]
    assert stopping.kwargs["level"] == logging.WARNING
    assert "3 run(s) in flight keep running" in stopping.kwargs["detail"] and said in stopping.kwargs["detail"]


def test_a_freeze_pending_on_a_run_being_cancelled_is_answered_without_freezing(make, clock, mocker):
    """One pass after a cancel's notification: the run is stopped (the reconciler), and the freeze
    still asked for on it is answered by the freezer without FreezeUnit (freezer.answer_for_cancelled)."""
    d = make()
    d.fence = store.Fence("h1", 7)
    d.reconciler = mock.MagicMock(in_flight=0, settled=0)
    d.timers = Timers(claim=clock.now + 60, reconcile=clock.now + 60)
    d.watcher.drain.return_value = (set(), False)
    note = mock.Mock(relname=store.CANCEL_CHANNEL.encode(), extra=b"")
    d.conn = mock.Mock(fileno=mock.Mock(return_value=-1),
                       pgconn=mock.Mock(notifies=mock.Mock(side_effect=[note, None, None, None])))
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    run_id = uuid.uuid4()
    mocker.patch.object(daemon_mod.store, "open_attempts", return_value=[(mock.Mock(), mock.Mock(run_id=run_id))])
    mocker.patch.object(daemon_mod.store, "claim", return_value=[])
    mocker.patch.object(daemon_mod.store, "freeze_requests", return_value=[
        store.FreezeRequest(run_id, 1, "unitvisor-run-x-1.service", "frozen", datetime(2026, 12, 2, tzinfo=UTC))])
    record = mocker.patch.object(daemon_mod.store, "record_freeze", return_value=True)
    d._iteration()
    d.reconciler.isolated.assert_called_once()  # the stop of the cancelled run
    d.systemd.freeze.assert_not_called()
    [answer] = record.call_args_list
    assert answer.args[3:] == ("thawed", freezer.CANCELLED_FREEZE)
