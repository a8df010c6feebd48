"""supervisor.daemon.Daemon: registration, one daemon per host id, containment of what goes wrong in the
loop, and claiming. systemd, the watcher, sd_notify and every store function are mocks: no socket, no
bus, no database. The thread of the guard is never started."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import uuid
from datetime import UTC, datetime, timedelta
from unittest import mock

import psycopg
import pytest

from supervisor import __version__, fence, fleet, pressure, store
from supervisor import daemon as daemon_mod
from supervisor.config import DaemonSettings, FleetSettings, HostSettings, RetentionSettings, RunSettings, Settings
from supervisor.daemon import Conflict, Daemon
from supervisor.guard import GuardedConnection
from supervisor.model import Attempt, Pruned, Run
from supervisor.reconciler import Reconciler
from supervisor.systemd import SystemdError, SystemdUnavailable, UnitState
from supervisor.unitspec import unit_name

REAL_SPREAD = daemon_mod.spread  # before the boundaries fixture stands in for it

DSN = "host=db.example port=5433 dbname=unitvisor user=uv password=secret"
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def make_settings(**fleet_values) -> Settings:
    return dataclasses.replace(Settings(), host=HostSettings(id="h1", name="host-1"),
                               runs=RunSettings(allowed_executables=("/bin/*",)),
                               fleet=FleetSettings(**fleet_values))


@pytest.fixture(autouse=True)
def psi(mocker):
    """The slice's pressure files (supervisor/pressure.py's shell) and the host row's report of them:
    a host under no pressure unless a test says otherwise."""
    return mock.Mock(read=mocker.patch.object(daemon_mod.pressure, "read",
                                              return_value=pressure.Reading({"memory": 0.0, "io": 0.0})),
                     report=mocker.patch.object(store, "set_pressure"))


@pytest.fixture
def events(mocker):
    return mocker.patch.object(daemon_mod, "event")


@pytest.fixture
def boundaries(mocker, monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    # A retry's pause is drawn at random (daemon.spread, tested below on its own): the exact schedule here.
    mocker.patch.object(daemon_mod, "spread", side_effect=lambda seconds: seconds)
    return mock.Mock(Systemd=mocker.patch.object(daemon_mod, "Systemd"),
                     Watcher=mocker.patch.object(daemon_mod, "Watcher"),
                     sdnotify=mocker.patch.object(daemon_mod, "sdnotify"))


@pytest.fixture
def make(boundaries, events):
    def build(settings=None, is_root=True, connected=True):
        d = Daemon(settings or make_settings(), lambda: DSN)
        d.is_root = is_root
        d._sleep = mock.Mock()
        if connected:
            d.conn = mock.MagicMock(name="conn")
            d.conn.pgconn.notifies.return_value = None  # libpq's queue of notifications: empty
            d.dsn = DSN
            d.fence = store.Fence("h1", 4)
        return d
    return build


def event_names(events):
    return [c.args[0] for c in events.call_args_list]


def statuses(d):
    return [c.args[0] for c in d.notifier.notify.call_args_list if c.args[0].startswith("STATUS=")]


# -- construction ---------------------------------------------------------------------------------

def test_construction_touches_no_bus_and_no_database(make, boundaries):
    d = make(connected=False)
    boundaries.Systemd.assert_called_once_with()
    boundaries.Systemd.return_value.connect.assert_not_called()
    boundaries.Watcher.assert_called_once_with("unitvisor-run-")
    assert d.conn is None and d.notified == set() and d.fence is None
    assert d.guard._thread is None


def test_the_guard_only_breaks_stalls_the_fence_owns_the_cut_off(make):
    """The dead man's switch moved to unitvisor-fence (supervisor/fence.py): the guard has no stop."""
    guard = make(make_settings(stop_runs_when_cut_off=True)).guard
    assert guard.stall_after == daemon_mod.STALL_AFTER
    assert not hasattr(guard, "cut_off_after") and not hasattr(daemon_mod, "_stop_running_units")


# -- _guard: nothing that goes wrong ends the daemon ------------------------------------------------

def boom(exc):
    def work():
        raise exc
    return work


def assert_db_closed(d, conn):
    assert d.conn is None and d.notified == set()
    conn.close.assert_called_once_with()


def test_guard_success_returns_true_and_touches_nothing(make, events):
    d = make()
    conn = d.conn
    assert d._guard(lambda: None) is True
    assert d.conn is conn
    events.assert_not_called()


def test_guard_turns_fenced_into_a_closed_db_a_fenced_event_and_a_quick_retry(make, events):
    d = make()
    conn = d.conn
    d.backoff = 16.0
    assert d._guard(boom(store.Fenced("host h1 is fenced: its row is gone, or its epoch 4 is over"))) is False
    assert_db_closed(d, conn)
    assert d.backoff == 1.0
    fenced = [c for c in events.call_args_list if c.args[0] == "fenced"]
    assert len(fenced) == 1
    assert fenced[0].kwargs["level"] == logging.WARNING
    assert fenced[0].kwargs["detail"] == "host h1 is fenced: its row is gone, or its epoch 4 is over"
    assert d.problem == "fenced: host h1 is fenced: its row is gone, or its epoch 4 is over; registering again"
    assert statuses(d)[-1].startswith(f"STATUS={d.problem}; retrying. ")
    d._sleep.assert_not_called()
    assert d.error_backoff == 1.0


@pytest.mark.parametrize("exc", [
    store.DatabaseUnavailable("cannot connect to the database at db.example:5433: timeout"),
    psycopg.OperationalError("server closed the connection unexpectedly\n\tThis probably means..."),
    psycopg.InterfaceError("the connection is closed"),
])
def test_guard_turns_a_lost_connection_into_a_closed_db_and_a_status_problem(make, events, exc):
    d = make()
    conn = d.conn
    assert d._guard(boom(exc)) is False
    assert_db_closed(d, conn)
    assert d.problem == f"database at db.example:5433 unreachable: {store.one_line(exc)}"
    assert "secret" not in d.problem
    assert statuses(d)[-1].startswith(f"STATUS={d.problem}; retrying. ")
    assert event_names(events) == ["degraded"]
    d._sleep.assert_not_called()


def test_guard_turns_a_lost_bus_into_closed_bus_connections_only(make, events):
    d = make()
    conn = d.conn
    assert d._guard(boom(SystemdUnavailable("listing: systemd is not reachable over D-Bus"))) is False
    d.systemd.close.assert_called_once_with()
    d.watcher.close.assert_called_once_with()
    assert d.conn is conn
    conn.close.assert_not_called()
    assert d.problem == "listing: systemd is not reachable over D-Bus"


@pytest.mark.parametrize("exc", [
    RuntimeError("boom"), KeyError("state"), store.DatabaseError("odd"), psycopg.errors.UndefinedColumn("no column"),
    SystemdError("refused"),
])
def test_guard_contains_any_other_exception_with_a_closed_db_and_a_backoff(make, events, exc):
    d = make()
    conn = d.conn
    assert d._guard(boom(exc)) is False
    assert_db_closed(d, conn)
    assert d.problem == f"internal error: {type(exc).__name__}: {store.one_line(exc)}"
    assert statuses(d)[-1].startswith(f"STATUS={d.problem}; retrying. ")
    d._sleep.assert_called_once_with(1.0)
    assert d.error_backoff == 2.0


def test_guard_error_backoff_doubles_up_to_30s(make):
    d = make(connected=False)
    for _ in range(8):
        d._guard(boom(RuntimeError("again")))
    assert [c.args[0] for c in d._sleep.call_args_list] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert d.error_backoff == 30.0


def test_spread_draws_between_half_the_backoff_and_all_of_it():
    draws = [REAL_SPREAD(8.0) for _ in range(2000)]
    assert min(draws) >= 4.0 and max(draws) <= 8.0
    # Spread, not a constant: a fleet's retries land over the whole window (both halves of it).
    assert min(draws) < 5.0 and max(draws) > 7.0


def test_a_retry_pause_is_the_spread_of_the_backoff(make, mocker):
    d = make(connected=False)
    spread = mocker.patch.object(daemon_mod, "spread", return_value=0.7)
    d._guard(boom(RuntimeError("again")))
    spread.assert_called_once_with(1.0)
    d._sleep.assert_called_once_with(0.7)


def test_a_problem_repeated_is_one_event(make, events):
    d = make(connected=False)
    for _ in range(3):
        d._guard(boom(psycopg.OperationalError("gone")))
    assert event_names(events) == ["degraded"]
    assert len(statuses(d)) == 3


def test_closing_the_db_holds_the_guards_lock(make):
    d = make()
    held = []
    d.conn.close.side_effect = lambda: held.append(d.guard.closing().locked())
    d._close_db()
    assert held == [True]


def test_a_close_that_fails_still_forgets_the_connection(make):
    d = make()
    conn = d.conn
    conn.close.side_effect = psycopg.OperationalError("already broken")
    d.notified.add(store.SPAWN_CHANNEL)
    d._close_db()
    assert d.conn is None and d.notified == set()  # what a closed session heard is not acted on
    conn.close.assert_called_once_with()


# -- registration -----------------------------------------------------------------------------------

@pytest.fixture
def st(mocker):
    """The store functions _connect and _register call."""
    fakes = {name: mocker.patch.object(store, name) for name in
             ("connect", "listen", "pending_migrations", "set_idle_session_timeout", "register_host",
              "register_wake_channel", "claim")}
    made = []

    def connect(dsn, cls=psycopg.Connection):
        made.append(mock.MagicMock(name=f"conn-{cls.__name__}"))
        return made[-1]
    fakes["connect"].side_effect = connect
    fakes["pending_migrations"].return_value = []
    fakes["register_host"].return_value = store.Registration(True, "active", 5, "registered")
    fakes["claim"].return_value = []
    fakes["register_wake_channel"].return_value = "unitvisor_spawn_h1"
    return mock.Mock(made=made, **fakes)


def test_register_refused_raises_conflict_with_the_detail(make, st, events):
    d = make()
    d.fence = None
    detail = "host id h1 is held by instance 0a1b2c3d4e5f6a7b (heartbeat 3s ago)"
    st.register_host.return_value = store.Registration(False, None, None, detail)
    with pytest.raises(Conflict) as info:
        d._register()
    assert str(info.value) == detail
    assert d.fence is None
    assert d.guard._renewed_at is None  # nothing was renewed: the cut-off clock does not start
    events.assert_called_once_with("host-id-conflict", level=logging.ERROR, host="h1", instance=d.instance,
                                   detail=detail)


def test_register_sets_the_fence_state_and_renews_the_guard(make, st, events, mocker):
    d = make()
    clock = mocker.patch.object(daemon_mod, "time")
    clock.monotonic.side_effect = [1000.0, 1000.5]
    st.register_host.return_value = store.Registration(True, "draining", 9, "epoch kept")
    d._register()
    assert d.fence == store.Fence("h1", 9)
    assert d.host_state == "draining"
    assert d.guard._renewed_at == 1000.0  # measured from before the statement was sent
    assert d.connected_since == 1000.5
    st.set_idle_session_timeout.assert_called_once_with(d.conn, 60.0)
    st.register_host.assert_called_once_with(d.conn, fleet.host_profile(d.settings, __version__, d.instance,
                                                                         fleet.boot_id(), True))
    events.assert_called_once_with("registered", host="h1", epoch=9, state="draining", detail="epoch kept")


def test_register_tells_the_database_a_daemon_without_root_cannot_start(make, st):
    d = make(is_root=False)
    d._register()
    profile = st.register_host.call_args.args[1]
    assert profile.can_start is False and "not root" in profile.cannot_start_reason


@pytest.mark.parametrize("fencing", [True, False])
def test_register_writes_the_lease_from_the_boottime_before_the_statement(make, st, mocker, fencing):
    """The fence's deadline (supervisor/fence.py): the heartbeat's send time by CLOCK_BOOTTIME plus
    cut_off_after (60 - 10 - 2 = 48 s), and whether fencing is on."""
    d = make(make_settings(stop_runs_when_cut_off=fencing))
    mocker.patch.object(fence, "boottime", side_effect=[500.0, 501.0])
    d._register()
    assert fence.read_lease(d.boot_id) == fence.Lease(548.0, fencing, d.boot_id, "daemon")


def test_a_refused_registration_writes_no_lease(make, st):
    d = make(make_settings(stop_runs_when_cut_off=True))
    st.register_host.return_value = store.Registration(False, None, None, "held")
    with pytest.raises(Conflict):
        d._register()
    assert fence.read_lease(d.boot_id) is None
    st.register_wake_channel.assert_not_called()  # a clone listens on no channel of the host it is not


def test_a_lease_that_cannot_be_written_is_said_once_and_the_loop_goes_on(make, st, events, runtime_directory):
    d = make(make_settings(stop_runs_when_cut_off=True))
    runtime_directory.write_text("a file where the directory should be")
    d._register()
    d._register()
    assert event_names(events).count("lease-not-written") == 1


def test_connect_on_conflict_waits_a_poll_interval_and_does_nothing(make, st, events):
    d = make(make_settings(), connected=False)
    d.settings = dataclasses.replace(d.settings, daemon=DaemonSettings(poll_interval=12.0))
    st.register_host.return_value = store.Registration(False, None, None, "held by another instance")
    assert d._connect() is False
    assert d.backoff == 12.0
    assert d.conn is None
    (conn,) = st.made  # one session, closed: the host lock is not held by a daemon that does nothing
    conn.close.assert_called_once_with()
    assert d.problem == ("not working: held by another instance; this daemon claims, starts and stops nothing "
                         "while it lasts")
    d.systemd.connect.assert_not_called()
    d.watcher.connect.assert_not_called()
    assert "host-id-conflict" in event_names(events)


def test_connect_success_registers_and_connects_the_bus(make, st, events):
    d = make(connected=False)
    d.systemd.connected = False
    d.problem = "earlier trouble"
    assert d._connect() is True
    assert st.connect.call_args_list == [mock.call(DSN, GuardedConnection)]  # one connection, no other
    assert d.conn.guard is d.guard
    d.conn.add_notify_handler.assert_called_once_with(d._on_notify)
    st.listen.assert_called_once_with(d.conn, store.SPAWN_CHANNEL, store.CANCEL_CHANNEL)
    assert d.fence == store.Fence("h1", 5)
    # Its own channel, in the registration's transaction (schema 048).
    st.register_wake_channel.assert_called_once_with(d.conn, store.Fence("h1", 5))
    assert d.wake_channel == "unitvisor_spawn_h1"
    d.watcher.connect.assert_called_once_with()
    d.systemd.connect.assert_called_once_with()
    assert d.problem == ""
    assert event_names(events) == ["registered", "database-connected", "systemd-connected"]


def test_connect_refuses_a_schema_that_is_not_current(make, st):
    d = make(connected=False)
    st.pending_migrations.return_value = ["002_fleet"]
    assert d._connect() is False
    st.register_host.assert_not_called()
    assert d.conn is None
    assert d.problem == "the database schema is not current (missing 002_fleet): run `unitvisor migrate`"


def test_the_conflict_event_says_when_the_daemon_tries_again(make, st, events):
    d = make(connected=False)
    st.register_host.return_value = store.Registration(False, None, None, "held by another instance")
    d._connect()
    (degraded,) = [c for c in events.call_args_list if c.args[0] == "degraded"]
    assert degraded.kwargs["retry_in"] == "10s"


# -- claiming ---------------------------------------------------------------------------------------

def claimed_pair(n):
    run_id = uuid.UUID(f"00000000-0000-4000-8000-{n:012d}")
    return (Run(id=run_id, argv=["/bin/true"], state="starting"),
            Attempt(run_id=run_id, attempt=1, host_id="h1", unit_name=unit_name(run_id, 1), claimed_at=T0))


@pytest.mark.parametrize(("is_root", "state", "stopping"), [
    (False, "active", False), (True, "draining", False), (True, "dead", False), (True, "active", True),
])
def test_claim_and_spawn_claims_nothing_unless_root_and_active(make, st, is_root, state, stopping):
    d = make(is_root=is_root)
    d.host_state, d.stopping = state, stopping
    d.reconciler = mock.Mock()
    d._claim_and_spawn()
    st.claim.assert_not_called()
    d.reconciler.isolated.assert_not_called()
    assert d.timers.reclaim == math.inf


def test_claim_and_spawn_starts_each_claimed_run_and_sets_the_reclaim_timer(make, st, events, mocker):
    d = make()
    d.reconciler = mock.Mock(in_flight=3)
    pairs = [claimed_pair(1), claimed_pair(2)]
    st.claim.return_value = pairs
    mocker.patch.object(daemon_mod, "time").monotonic.return_value = 500.0
    d._claim_and_spawn()
    st.claim.assert_called_once_with(d.conn, d.fence, 32, "unitvisor-run-%s-%s.service")
    assert d.timers.reclaim == 500.0 + fleet.RECLAIM_AFTER
    assert d.claimed == 2 and d.reconciler.in_flight == 5
    assert [c.args[:2] for c in d.reconciler.isolated.call_args_list] == pairs
    assert event_names(events) == ["claimed", "claimed"]


def test_claim_and_spawn_keeps_an_earlier_reclaim(make, st, mocker):
    d = make()
    d.reconciler = mock.Mock(in_flight=0)
    d.timers.reclaim = 100.0
    st.claim.return_value = [claimed_pair(1)]
    mocker.patch.object(daemon_mod, "time").monotonic.return_value = 500.0
    d._claim_and_spawn()
    assert d.timers.reclaim == 100.0


def test_an_empty_claim_sets_no_reclaim(make, st):
    d = make()
    d.reconciler = mock.Mock(in_flight=0)
    d._claim_and_spawn()
    st.claim.assert_called_once()
    assert d.timers.reclaim == math.inf


def test_a_full_batch_claims_again(make, st):
    d = make(dataclasses.replace(make_settings(), daemon=DaemonSettings(claim_batch=2)))
    d.reconciler = mock.Mock(in_flight=0)
    st.claim.side_effect = [[claimed_pair(1), claimed_pair(2)], [claimed_pair(3)]]
    d._claim_and_spawn()
    assert st.claim.call_count == 2
    assert d.claimed == 3


def _with_slots(make, max_runs: int, batch: int = 32) -> Daemon:
    return make(dataclasses.replace(make_settings(), host=HostSettings(id="h1", name="host-1", max_runs=max_runs),
                                    daemon=DaemonSettings(claim_batch=batch)))


def test_a_host_with_every_slot_taken_claims_nothing(make, st):
    d = _with_slots(make, max_runs=4)
    d.reconciler = mock.Mock(in_flight=4)
    d._claim_and_spawn()
    st.claim.assert_not_called()
    assert d.timers.reclaim == math.inf


def test_a_claim_asks_for_no_more_than_the_free_slots(make, st):
    d = _with_slots(make, max_runs=10)
    d.reconciler = mock.Mock(in_flight=7)
    d._claim_and_spawn()
    st.claim.assert_called_once_with(d.conn, d.fence, 3, "unitvisor-run-%s-%s.service")


def test_full_batches_stop_when_the_host_is_full(make, st):
    """Without the free slots counted, a third claim would be sent, for the database to answer none."""
    d = _with_slots(make, max_runs=4, batch=2)
    d.reconciler = mock.Mock(in_flight=0)
    st.claim.side_effect = [[claimed_pair(1), claimed_pair(2)], [claimed_pair(3), claimed_pair(4)], []]
    d._claim_and_spawn()
    assert st.claim.call_count == 2
    assert d.claimed == 4 and d.reconciler.in_flight == 4


def _settling(d: Daemon, mocker, settles: int = 1) -> None:
    """One iteration of the loop in which systemd says a unit changed and its outcome is recorded."""
    d.reconciler.started_units, d.reconciler.settled_units = set(), set()
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    mocker.patch.object(store, "open_attempts", return_value=[])
    d.watcher.drain.return_value = ({"unitvisor-run-a-1.service"}, False)
    d.timers = daemon_mod.Timers(claim=math.inf, reconcile=math.inf, retention=math.inf, upkeep=math.inf,
                                 pressure=math.inf, refill=d.timers.refill)

    def settle(pairs, signalled=None):
        d.reconciler.settled += settles
    mocker.patch.object(d, "_reconcile_attempts", side_effect=settle)
    d._iteration()


@pytest.mark.parametrize(("signals", "read"), [
    ({"a": "running", "b": "running"}, []),  # both started here and running: nothing to read
    ({"a": "running", "b": "dead"}, ["b"]),  # only the one that ended
    ({"a": None, "b": "running"}, ["a"]),  # its signals did not say all of it: read in full
    ({"a": None, "settled": None}, ["a"]),  # one settled here, collected since (UnitRemoved): not read
    ({"settled": "dead"}, []),
])
def test_a_change_reads_the_rows_of_only_the_units_that_need_them(make, st, mocker, signals, read):
    """Issue 27: a unit starting, running and stopping changes several times; while its attempt is
    recorded as started and its signals say it is not over, the change needs no statement."""
    d = make()
    names = {key: unit_name(uuid.UUID(int=n + 1), 1) for n, key in enumerate(signals)}
    d.reconciler = mock.Mock(in_flight=0, settled=0, freed_key=False, freed_labelled=False,
                             started_units={name for key, name in names.items() if key != "settled"},
                             settled_units={name for key, name in names.items() if key == "settled"})
    mocker.patch.object(d, "_reconcile_attempts")
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    open_attempts = mocker.patch.object(store, "open_attempts", return_value=[])
    d.watcher.drain.return_value = (set(names.values()), False)
    d.watcher.signalled = {
        names[key]: UnitState(names[key], "active" if sub == "running" else "inactive", sub, "success", 0, 0, "i",
                              False)
        for key, sub in signals.items() if sub is not None}
    d.timers = daemon_mod.Timers(claim=math.inf, reconcile=math.inf, retention=math.inf, upkeep=math.inf,
                                 pressure=math.inf)
    d._iteration()
    if read:
        open_attempts.assert_called_once_with(d.conn, "h1", unit_names=sorted(names[key] for key in read))
    else:
        open_attempts.assert_not_called()


@pytest.mark.parametrize(("last_claim", "claims_after_settle"), [
    ([[claimed_pair(1)]], False),  # short: the queue had nothing more for it, and a submit notifies it
    ([[]], False),  # empty likewise
    ([[claimed_pair(1), claimed_pair(2)], [claimed_pair(3), claimed_pair(4)]], True),  # stopped at a full host
])
def test_a_settle_claims_again_only_when_the_last_claim_may_have_left_work(make, st, mocker, last_claim,
                                                                         claims_after_settle):
    """Issue 23: 0.11.0 claimed after every settle, and at the end of a burst that was an empty claim per
    host. A full host still claims at once when a slot frees: a backlog must not drain a batch a poll."""
    d = _with_slots(make, max_runs=4, batch=2)
    d.reconciler = mock.Mock(in_flight=0, settled=0, freed_key=False, freed_labelled=False)
    st.claim.side_effect = last_claim
    d._claim_and_spawn()
    st.claim.reset_mock(side_effect=True)
    st.claim.return_value = []
    d.reconciler.in_flight = 0
    _settling(d, mocker)
    assert st.claim.called is claims_after_settle


@pytest.fixture
def long_refill_wait(mocker) -> None:
    """REFILL_WAIT made a minute long, so that a loaded machine cannot end the wait between two iterations
    a test means to fall inside it (CI once took over the packaged 0.1 s between them)."""
    mocker.patch.object(daemon_mod, "REFILL_WAIT", 60.0)


@pytest.mark.parametrize(("in_flight", "at_once"), [(63, False), (57, False), (56, True), (0, True)])
def test_a_full_hosts_settle_claims_at_once_only_with_a_quarter_batch_free(make, st, mocker, in_flight, at_once,
                                                                            long_refill_wait):
    """Issue 27: runs ending one at a time were claimed one at a time, two statements each. With fewer
    than a quarter of a batch free (8 of the packaged 32) the claim waits REFILL_WAIT, then is made."""
    d = make()  # max_runs 64, claim_batch 32
    d.reconciler = mock.Mock(in_flight=in_flight, settled=0, freed_key=False, freed_labelled=False)
    d.claim_left_work = True
    before = time.monotonic()
    _settling(d, mocker)
    assert st.claim.called is at_once
    if at_once:
        assert d.timers.refill == math.inf
        return
    assert before + daemon_mod.REFILL_WAIT <= d.timers.refill <= time.monotonic() + daemon_mod.REFILL_WAIT
    assert d.timers.nearest(time.monotonic(), 3600.0) <= daemon_mod.REFILL_WAIT  # the loop wakes for it
    _settling(d, mocker, settles=0)  # an iteration before the wait is over: still no claim
    st.claim.assert_not_called()
    d.timers.refill = time.monotonic()  # the wait is over
    _settling(d, mocker, settles=0)
    st.claim.assert_called_once()
    assert d.timers.refill == math.inf


def test_a_notification_claims_at_once_and_takes_the_held_claim_with_it(make, st, mocker, long_refill_wait):
    d = make()
    d.reconciler = mock.Mock(in_flight=60, settled=0, freed_key=False, freed_labelled=False)
    d.claim_left_work = True
    _settling(d, mocker)
    st.claim.assert_not_called()
    d.notified.add(store.SPAWN_CHANNEL)
    _settling(d, mocker, settles=0)
    st.claim.assert_called_once()
    assert d.timers.refill == math.inf


@pytest.mark.parametrize(("max_runs", "batch", "at"), [(64, 32, 8), (4, 32, 1), (1, 1, 1), (200, 100, 25)])
def test_the_refill_threshold_is_a_quarter_of_the_smaller_of_batch_and_slots(make, max_runs, batch, at):
    assert _with_slots(make, max_runs=max_runs, batch=batch)._refill_at() == at


def test_a_daemon_that_has_not_claimed_yet_claims_after_a_settle(make, st, mocker):
    d = make()
    d.reconciler = mock.Mock(in_flight=0, settled=0, freed_key=False, freed_labelled=False)
    _settling(d, mocker)
    st.claim.assert_called_once()


@pytest.mark.parametrize(("why", "claims"), [
    ("key", True),  # its key's next run
    ("labels and a limit", True),  # a named limit's next run
    ("labels, no limit", False),  # no limit in the fleet: labels hold nothing back
    ("budget", True),  # a run that did not fit may fit now
])
def test_a_settle_that_may_let_a_held_run_start_claims_again(make, st, mocker, why, claims):
    """A key's or a named limit's next run becomes claimable with no NOTIFY; with a memory_budget, a run
    that did not fit may fit now."""
    settings = make_settings()
    if why == "budget":
        settings = dataclasses.replace(settings, host=HostSettings(id="h1", name="host-1", memory_budget=1 << 30))
    d = make(settings)
    d.reconciler = mock.Mock(in_flight=0, settled=0, freed_key=why == "key", freed_labelled=why.startswith("labels"))
    if why == "labels and a limit":
        d.limit_figures = {"batch": (2, 2)}
    d._claim_and_spawn()  # short: nothing left
    st.claim.reset_mock()
    _settling(d, mocker)
    assert st.claim.called is claims
    assert d.reconciler.freed_key is False and d.reconciler.freed_labelled is False  # looked at once
    st.claim.reset_mock()
    _settling(d, mocker)
    assert st.claim.called is (why == "budget")


def test_a_slowed_host_counts_as_leaving_work(make, st, mocker, psi):
    d = make()
    d.reconciler = mock.Mock(in_flight=0, settled=0, freed_key=False, freed_labelled=False)
    d.claim_left_work = False
    under(psi, memory=30.0)
    st.claim.return_value = [claimed_pair(1)]
    d._claim_and_spawn()  # one claim a poll interval while slowed: what it left is claimed later
    assert d.admission.state == "slowed" and d.claim_left_work is True
    d.claim_left_work = False
    d._claim_and_spawn()  # within that interval: no claim at all
    st.claim.assert_called_once()
    assert d.claim_left_work is True


@pytest.mark.parametrize("claimable", [False, True])
def test_the_reclaim_asks_the_probe_first_and_claims_only_when_there_is_work(make, st, mocker, claimable):
    """Issue 23: in a burst on 300 hosts the claim the reclaim timer sent regardless found the jobs left
    to other hosts' shares mostly taken by them: most of the empty claims."""
    d = make()
    d.reconciler = mock.Mock(in_flight=0, settled=0, freed_key=False, freed_labelled=False)
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    probe = mocker.patch.object(store, "probe", return_value=store.Probe("active", claimable, False, False))
    d.watcher.drain.return_value = (set(), False)
    d.timers = daemon_mod.Timers(claim=math.inf, reclaim=0.0, reconcile=math.inf, retention=math.inf,
                                 upkeep=math.inf, pressure=math.inf)
    d.listening_since = time.monotonic() - 60
    d._iteration()
    # A job just submitted is left to the hosts its NOTIFY woke (schema 047), for the spread grace.
    probe.assert_called_once_with(d.conn, d.fence, fleet.explain_after(d.settings), fleet.LEFT_TO_WOKEN)
    assert st.claim.called is claimable
    assert d.timers.reclaim == math.inf and d.timers.claim > time.monotonic()  # the poll's next, as usual


@pytest.mark.parametrize(("listened", "left"), [(None, timedelta(0)), (0.0, timedelta(0)), (0.5, timedelta(0)),
                                              (fleet.SPREAD_GRACE, fleet.LEFT_TO_WOKEN), (60.0, fleet.LEFT_TO_WOKEN)])
def test_a_job_is_left_to_the_woken_only_by_a_daemon_that_listened_for_the_grace(make, listened, left):
    """Schema 047: a daemon that began to LISTEN less than the grace ago (a start, a reconnect) may have
    missed the notification of a job that young, which may have gone to nobody (a single host that
    restarts): it counts every job, so its first claim after a start is not put off by a poll interval."""
    d = make()
    now = time.monotonic()
    if listened is not None:
        d.listening_since = now - listened
    assert d._left_to_woken(now) == left


def _spawning(make, mocker, systemd):
    """A daemon whose claim returns three runs, with a real Reconciler and the two marks spied on."""
    d = make()
    d.reconciler = Reconciler(d.settings, d.fence, d.conn, systemd)
    marks = mocker.patch.object(store, "mark_started")
    many = mocker.patch.object(store, "mark_started_many")
    return d, marks, many


def test_a_batch_is_started_back_to_back_and_marked_in_one_statement(make, st, mocker):
    systemd = mock.Mock(start_transient=mock.Mock(return_value=True))
    d, marks, many = _spawning(make, mocker, systemd)
    d.guard.renewed(time.monotonic())
    pairs = [claimed_pair(1), claimed_pair(2), claimed_pair(3)]
    st.claim.return_value = pairs
    d._claim_and_spawn()
    assert systemd.start_transient.call_count == 3
    marks.assert_not_called()
    assert many.call_args_list == [mock.call(d.conn, d.fence, [a for _, a in pairs])]


def test_a_stale_heartbeat_marks_each_unit_at_once(make, st, mocker):
    """Past half of host_dead_after since the heartbeat, a peer may fence this host any moment: each
    start is marked before the next, so that a fence stops the batch after one unit (below)."""
    systemd = mock.Mock(start_transient=mock.Mock(return_value=True))
    d, marks, many = _spawning(make, mocker, systemd)
    d.guard.renewed(time.monotonic() - d.settings.fleet.host_dead_after / 2 - 0.1)
    st.claim.return_value = [claimed_pair(1), claimed_pair(2)]
    d._claim_and_spawn()
    assert [c.args[2].run_id for c in marks.call_args_list] == [claimed_pair(1)[0].id, claimed_pair(2)[0].id]
    assert all(c.args[2] == [] for c in many.call_args_list)


def test_a_heartbeat_going_stale_mid_batch_marks_what_was_started_first(make, st, mocker):
    systemd = mock.Mock(start_transient=mock.Mock(return_value=True))
    d, marks, many = _spawning(make, mocker, systemd)
    mocker.patch.object(d, "_unfenceable", side_effect=[True, True, False])
    pairs = [claimed_pair(1), claimed_pair(2), claimed_pair(3)]
    st.claim.return_value = pairs
    d._claim_and_spawn()
    assert many.call_args_list[0] == mock.call(d.conn, d.fence, [pairs[0][1], pairs[1][1]])
    assert [c.args[2] for c in marks.call_args_list] == [pairs[2][1]]


def test_units_started_before_the_bus_went_are_marked_started(make, st, mocker):
    systemd = mock.Mock(start_transient=mock.Mock(side_effect=[True, SystemdUnavailable("bus gone")]))
    d, marks, many = _spawning(make, mocker, systemd)
    d.guard.renewed(time.monotonic())
    pairs = [claimed_pair(1), claimed_pair(2), claimed_pair(3)]
    st.claim.return_value = pairs
    with pytest.raises(SystemdUnavailable):
        d._claim_and_spawn()
    assert many.call_args_list == [mock.call(d.conn, d.fence, [pairs[0][1]])]


def test_a_fenced_start_starts_nothing_more_of_the_batch(make, st, mocker):
    """With a stale heartbeat (a new daemon's guard has none yet), as after a long stall."""
    d = make()
    systemd = mock.Mock(start_transient=mock.Mock(return_value=True))
    d.reconciler = Reconciler(d.settings, d.fence, d.conn, systemd)
    mocker.patch.object(store, "mark_started", side_effect=store.Fenced("host h1 is fenced: its epoch 4 is over"))
    st.claim.return_value = [claimed_pair(1), claimed_pair(2), claimed_pair(3)]
    with pytest.raises(store.Fenced):
        d._claim_and_spawn()
    assert systemd.start_transient.call_count == 1


# -- STATUS= ----------------------------------------------------------------------------------------

def test_status_of_a_daemon_without_root_says_it_claims_nothing(make):
    d = make(is_root=False)
    d._status()
    assert statuses(d) == [
        "STATUS=runs in flight: 0, claimed since start: 0, settled since start: 0; not root: claiming nothing"]


def test_status_of_root_does_not_mention_root(make):
    d = make()
    d._status()
    assert statuses(d) == ["STATUS=runs in flight: 0, claimed since start: 0, settled since start: 0"]


def test_status_says_draining_cut_off_and_the_problem(make):
    d = make(is_root=False)
    d.reconciler = mock.Mock(in_flight=4, settled=9)
    d.claimed = 12
    d.host_state = "draining"
    d.fenced.add("unitvisor-run-a-1.service")
    d.problem = "database at db.example:5433 unreachable: gone"
    d._status()
    assert statuses(d) == [
        "STATUS=database at db.example:5433 unreachable: gone; retrying. runs in flight: 4, claimed since start: 12, "
        "settled since start: 9; "
        "draining; not root: claiming nothing; runs stopped by unitvisor-fence (stop_runs_when_cut_off), being settled"]


# -- fleet upkeep -----------------------------------------------------------------------------------

def test_fleet_upkeep_passes_how_long_this_daemon_has_been_connected(make, mocker):
    d = make()
    d.reconciler = mock.Mock()
    d.connected_since = 1000.0
    turn = mocker.patch.object(store, "fleet_upkeep_turn", return_value=True)
    mocker.patch.object(daemon_mod, "time").monotonic.return_value = 1075.0
    d._fleet_upkeep()
    turn.assert_called_once_with(d.conn, store.Fence("h1", 4), timedelta(seconds=10))
    d.reconciler.take_over_dead_hosts.assert_called_once_with(75.0)
    # Schedules before the turn; expired runs before the reasons: a run that just expired needs none.
    assert [c[0] for c in d.reconciler.method_calls] == ["submit_due_schedules", "take_over_dead_hosts",
                                                         "expire_overdue", "explain_waiting"]
    assert d.timers.upkeep == 1085.0


def test_fleet_upkeep_does_nothing_but_ask_when_it_is_another_hosts_turn(make, mocker):
    d = make()
    d.reconciler = mock.Mock()
    mocker.patch.object(store, "fleet_upkeep_turn", return_value=False)
    mocker.patch.object(daemon_mod, "time").monotonic.return_value = 1075.0
    d._fleet_upkeep()
    # Due schedules are submitted by every daemon the probe flags: the database makes each due time one
    # run (sql/migrations/028_schedules.sql), and the turn may be a 0.8.0 daemon's, which submits none.
    assert [c[0] for c in d.reconciler.method_calls] == ["submit_due_schedules"]
    assert d.timers.upkeep == 1085.0  # asks again a poll interval later


TIMEOUT = psycopg.errors.QueryCanceled("canceling statement due to statement timeout")


@pytest.mark.parametrize("failing", ["submit_due_schedules", "take_over_dead_hosts", "expire_overdue",
                                     "explain_waiting"])
def test_a_failing_upkeep_step_leaves_the_other_steps_going(make, mocker, events, failing):
    d = make()
    d.metrics = mock.Mock()
    d.reconciler = mock.Mock()
    getattr(d.reconciler, failing).side_effect = TIMEOUT
    mocker.patch.object(store, "fleet_upkeep_turn", return_value=True)
    d._fleet_upkeep()
    assert [c[0] for c in d.reconciler.method_calls] == ["submit_due_schedules", "take_over_dead_hosts",
                                                         "expire_overdue", "explain_waiting"]
    (failed,) = [c for c in events.call_args_list if c.args[0] == "fleet-upkeep-failed"]
    assert failed.kwargs["detail"] == "canceling statement due to statement timeout"
    d.metrics.upkeep_failures.inc.assert_called_once_with()


def test_a_lost_connection_in_the_upkeep_goes_up_to_the_loop(make, mocker):
    d = make()
    d.reconciler = mock.Mock()
    d.reconciler.expire_overdue.side_effect = psycopg.OperationalError("server closed the connection unexpectedly")
    mocker.patch.object(store, "fleet_upkeep_turn", return_value=True)
    with pytest.raises(psycopg.OperationalError):
        d._fleet_upkeep()


@pytest.mark.parametrize("failure", [TIMEOUT, psycopg.errors.LockNotAvailable("lock timeout"),
                                     psycopg.errors.DeadlockDetected("deadlock detected")])
def test_a_failing_upkeep_never_skips_the_hosts_own_claim(make, mocker, events, failure):
    """Issue 23: on a busy database the upkeep's explain_waiting hit the statement_timeout, and the
    failure ended the loop's iteration before the claim the probe had asked for. (Failed before the
    fix: the claim was never called, and the iteration failed.)"""
    d = make()
    d.metrics = mock.Mock()
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    mocker.patch.object(store, "probe", return_value=store.Probe("active", True, False, True))
    mocker.patch.object(store, "fleet_upkeep_turn", return_value=True, create=True)
    claim = mocker.patch.object(store, "claim", return_value=[])
    d.watcher.drain.return_value = (set(), False)
    d.reconciler = mock.Mock(settled=0, in_flight=0)
    d.reconciler.explain_waiting.side_effect = failure
    d.reconciler.take_over_dead_hosts.side_effect = failure
    d.timers = daemon_mod.Timers(claim=0.0, reconcile=0.0, retention=math.inf, upkeep=0.0)
    assert d._guard(d._iteration) is True
    claim.assert_called_once()
    d.reconciler.reconcile_pass.assert_called_once_with()  # the rest of the iteration too
    assert d.conn is not None and d.problem == ""


def test_a_heartbeat_sent_before_the_last_renewal_renews_nothing(make, mocker):
    """The loop and the aside thread both renew: an older send must not pull the lease back."""
    d = make()
    write = mocker.patch.object(daemon_mod.fence, "write_lease")
    assert d._renewed(100.0, 5100.0) is True
    assert d._renewed(99.0, 5099.0) is False
    assert d.guard.renewed_at == 100.0 and write.call_count == 1
    assert d._renewed(101.0, 5101.0) is True and d.guard.renewed_at == 101.0


def test_the_loop_shows_progress_when_it_feeds_the_watchdog(make, mocker):
    d = make()
    mocker.patch.object(daemon_mod, "time").monotonic.return_value = 4242.0
    d._feed_watchdog()
    assert d.alive_at == 4242.0


# -- drain and undrain, as the heartbeat reads them --------------------------------------------------

def test_a_drain_and_an_undrain_are_each_said_once_in_the_journal(make, mocker, events):
    """`unitvisor drain` changes the host row; the daemon learns it at its next heartbeat and says so
    once, not at every heartbeat (before issue 24 it said nothing: the journal had no line for it)."""
    d = make()
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    probe = mocker.patch.object(store, "probe")
    d.watcher.drain.return_value = (set(), False)
    d.reconciler = mock.Mock(settled=0, in_flight=0)
    for state in ("active", "draining", "draining", "draining", "active", "active"):
        probe.return_value = store.Probe(state, False, False, False)
        d.timers = daemon_mod.Timers(claim=0.0, reconcile=math.inf, retention=math.inf, upkeep=math.inf,
                                     pressure=math.inf)
        d._iteration()
    said = [c.kwargs for c in events.call_args_list if c.args[0] == "host-state"]
    assert [(e["before"], e["state"]) for e in said] == [("active", "draining"), ("draining", "active")]
    assert said[0]["detail"].startswith("drained (unitvisor drain): claims nothing new")
    assert said[1]["detail"].startswith("undrained (unitvisor undrain)")
    assert d.host_state == "active"


# -- retention ---------------------------------------------------------------------------------------

@pytest.fixture
def prune(mocker):
    return mocker.patch.object(store, "prune_batch")


def test_retention_is_due_at_once_when_on_and_never_when_off(make):
    assert make().timers.retention == 0.0
    off = dataclasses.replace(make_settings(), retention=RetentionSettings(keep_finished=None))
    assert make(off).timers.retention == math.inf


@pytest.mark.parametrize(("pruned", "next_in", "logged"), [
    (Pruned(runs=1000, attempts=1000, events=3000, jobs=1000), daemon_mod.RETENTION_PAUSE, True),  # a backlog
    (Pruned(runs=3, attempts=3, events=9, jobs=1000), daemon_mod.RETENTION_PAUSE, True),  # jobs of kept runs left
    (Pruned(runs=3, attempts=3, events=9, jobs=3), 600.0, True),  # done until the next interval
    (Pruned(0, 0, 0, 0), 600.0, False),
    (Pruned(0, 0, 0, 0, busy=True), 600.0, False),  # another daemon prunes: try again at the interval
])
def test_a_retention_batch_then_the_next_after_a_pause_or_the_interval(make, mocker, prune, events, pruned, next_in,
                                                                       logged):
    d = make()
    d.metrics = mock.Mock()
    mocker.patch.object(daemon_mod, "time").monotonic.return_value = 2000.0
    prune.return_value = pruned
    d._prune()
    prune.assert_called_once_with(d.conn, timedelta(days=30), 1000, store.Fence("h1", 4))
    d.metrics.pruned.assert_called_once_with(pruned)
    assert d.timers.retention == 2000.0 + next_in
    assert event_names(events) == (["pruned"] if logged else [])


def test_a_retention_batch_is_in_the_loop_when_due(make, mocker, prune):
    """The iteration calls it when its timer is due, and its failure is the guard's, as any work's."""
    d = make()
    d._prune = mock.Mock()
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    mocker.patch.object(store, "probe", return_value=store.Probe("active", False, False, False))
    d.watcher.drain.return_value = (set(), False)
    d.reconciler = mock.Mock(settled=0)
    d.timers = daemon_mod.Timers(claim=math.inf, reconcile=math.inf, retention=0.0)
    d._iteration()
    d._prune.assert_called_once_with()


# -- output tails -----------------------------------------------------------------------------------

def test_the_daemons_tail_reader_is_threaded_with_the_hosts_bounds(make):
    d = make(dataclasses.replace(make_settings(), runs=RunSettings(output_tail_lines=5, output_tail_bytes=64)))
    tails = d.output_tails
    assert (tails.threaded, tails.max_lines, tails.max_bytes) == (True, 5, 64)


def test_a_tail_read_wakes_the_loop_through_the_signal_pipe(make):
    d = make()
    d.output_tails.wake()  # before run(): no pipe yet, nothing happens
    d.wakeup_r, d.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        d.output_tails.wake()
        assert os.read(d.wakeup_r, 16) == b"\0"
    finally:
        os.close(d.wakeup_r)
        os.close(d.wakeup_w)


# -- notifications on the one connection --------------------------------------------------------------

def pg_notify(channel):
    """What libpq's queue holds (psycopg.pq.PGnotify): the channel as bytes."""
    return mock.Mock(relname=channel.encode(), extra=b"", be_pid=4242)


@pytest.fixture
def idle_loop(make, mocker):
    """A connected daemon whose timers are all far away: only a notification makes it claim or cancel."""
    d = make()
    d.conn.fileno.return_value = 7
    d.watcher.fileno.return_value = 8
    d.watcher.drain.return_value = (set(), False)
    d.reconciler = mock.Mock(settled=0, in_flight=0)
    d.timers = daemon_mod.Timers(claim=math.inf, reconcile=math.inf, retention=math.inf, watchdog=math.inf,
                                 pressure=math.inf)
    return mock.Mock(d=d, select=mocker.patch.object(daemon_mod, "_select", return_value=([], [], [])),
                     claim=mocker.patch.object(store, "claim", return_value=[]),
                     open_attempts=mocker.patch.object(store, "open_attempts", return_value=[]))


def test_a_notification_read_while_the_connection_is_idle_wakes_the_claim(idle_loop):
    d = idle_loop.d
    idle_loop.select.return_value = ([7], [], [])
    d.conn.pgconn.notifies.side_effect = [None, pg_notify(store.SPAWN_CHANNEL), None]  # before, after select
    d._iteration()
    assert idle_loop.select.call_args.args == ([7, 8, -1], 10.0)  # the poll interval: nothing was pending
    d.conn.pgconn.consume_input.assert_called_once_with()
    idle_loop.claim.assert_called_once()
    idle_loop.open_attempts.assert_not_called()
    assert d.notified == set()


def test_a_notification_that_arrives_during_a_query_is_not_lost(idle_loop):
    """psycopg reads it while the claim's query runs and hands it to the handler (libpq's queue is then
    empty and the socket not readable): the next iteration acts on it without waiting."""
    d = idle_loop.d
    idle_loop.select.return_value = ([7], [], [])
    d.conn.pgconn.notifies.side_effect = [None, pg_notify(store.SPAWN_CHANNEL), None, None]

    def claim_while_a_cancel_is_sent(*args):
        d._on_notify(psycopg.Notify(store.CANCEL_CHANNEL, "", 4242))
        return []
    idle_loop.claim.side_effect = claim_while_a_cancel_is_sent
    d._iteration()
    assert d.notified == {store.CANCEL_CHANNEL}
    idle_loop.select.return_value = ([], [], [])
    d._iteration()
    assert [c.args[1] for c in idle_loop.select.call_args_list] == [10.0, 0.0]  # no wait for the pending one
    idle_loop.open_attempts.assert_called_once_with(d.conn, "h1", cancel_requested=True)
    idle_loop.claim.assert_called_once()
    assert d.notified == set()


def test_a_notification_left_in_libpqs_queue_is_taken_before_waiting(idle_loop):
    d = idle_loop.d
    d.conn.pgconn.notifies.side_effect = [pg_notify(store.CANCEL_CHANNEL), None]
    d._iteration()
    assert idle_loop.select.call_args.args[1] == 0.0
    d.conn.pgconn.consume_input.assert_not_called()  # the socket was not readable: no read
    idle_loop.open_attempts.assert_called_once_with(d.conn, "h1", cancel_requested=True)
    idle_loop.claim.assert_not_called()


def test_a_connection_closed_by_the_server_is_lost_when_read_and_reconnected(idle_loop):
    d = idle_loop.d
    conn = d.conn
    idle_loop.select.return_value = ([7], [], [])
    conn.pgconn.consume_input.side_effect = psycopg.OperationalError("server closed the connection unexpectedly")
    assert d._guard(d._iteration) is False
    assert d.conn is None
    conn.close.assert_called_once_with()
    assert d.problem.startswith("database at db.example:5433 unreachable: server closed the connection")


def test_listen_is_issued_again_on_every_new_connection_after_its_handler(make, st, mocker):
    d = make(connected=False)
    order = []
    st.listen.side_effect = lambda conn, *channels: order.append(("listen", conn, channels))
    assert d._connect() is True
    first = d.conn
    assert d._guard(boom(psycopg.OperationalError("server closed the connection unexpectedly"))) is False
    d.listening_since = -math.inf
    before = time.monotonic()
    assert d._connect() is True
    assert d.listening_since >= before  # a new session heard nothing before its LISTEN (_left_to_woken)
    second = d.conn
    assert st.made == [first, second] and first is not second
    first.close.assert_called_once_with()
    channels = (store.SPAWN_CHANNEL, store.CANCEL_CHANNEL)
    assert order == [("listen", first, channels), ("listen", second, channels)]
    for conn in (first, second):  # the handler before the LISTEN: nothing heard before it is dropped
        conn.add_notify_handler.assert_called_once_with(d._on_notify)
        assert conn.method_calls.index(mock.call.add_notify_handler(d._on_notify)) == 0


# -- what the fence stopped (supervisor/fence.py) ------------------------------------------------------

def test_a_reconcile_pass_reads_what_the_fence_stopped_first_and_forgets_what_a_peer_settled(make, mocker):
    d = make()
    fence.record_fenced("unitvisor-run-a-1.service")  # its attempt is still open here: settled by the pass
    fence.record_fenced("unitvisor-run-b-1.service")  # taken over by the peer that declared this host dead
    seen = []
    d.reconciler = mock.Mock()
    d.reconciler.reconcile_pass.side_effect = lambda: seen.append(set(d.fenced))
    open_attempts = mocker.patch.object(store, "open_attempts", return_value=[(mock.Mock(), mock.Mock(
        unit_name="unitvisor-run-a-1.service"))])
    d._reconcile()
    assert seen == [{"unitvisor-run-a-1.service", "unitvisor-run-b-1.service"}]
    open_attempts.assert_called_once_with(d.conn, "h1", unit_names=["unitvisor-run-a-1.service",
                                                                     "unitvisor-run-b-1.service"])
    assert d.fenced == {"unitvisor-run-a-1.service"} and fence.fenced_units() == {"unitvisor-run-a-1.service"}


def test_a_reconcile_pass_reads_the_named_limits_for_the_metrics(make, mocker):
    d = make()
    d.reconciler = mock.Mock()
    d.reconciler.pass_figures.return_value = {"batch": (3, 20)}
    mocker.patch.object(store, "open_attempts")
    d._reconcile()
    assert d._metrics_state().limits == {"batch": (3, 20)}


def test_a_reconcile_pass_takes_the_fleets_figures_after_the_pass(make):
    """Schema 035: the runs skipped since any daemon last looked are taken by each reconcile pass (a skip
    happens in whatever session ended the run it needed), after the pass itself."""
    d = make()
    d.reconciler = mock.Mock()
    d._reconcile()
    assert [c[0] for c in d.reconciler.method_calls][:2] == ["reconcile_pass", "pass_figures"]


def test_a_reconcile_pass_with_nothing_fenced_asks_nothing_more(make, mocker):
    d = make()
    d.reconciler = mock.Mock()
    open_attempts = mocker.patch.object(store, "open_attempts")
    d._reconcile()
    open_attempts.assert_not_called()


def test_a_takeover_settles_the_previous_instances_attempts_in_the_registering_transaction(make, st, events,
                                                                                            mocker):
    """Issue 21: another instance takes a silent id: its open attempts are settled `lost` inside the
    registration's transaction (Reconciler.take_over_id), and the journal says how many."""
    d = make()
    order = []
    d.conn.transaction.return_value.__enter__.side_effect = lambda: order.append("begin")
    d.conn.transaction.return_value.__exit__.side_effect = lambda *exc: order.append("commit")
    st.register_host.side_effect = lambda conn, profile: (order.append("register"), store.Registration(
        True, "active", 12, "took over the id from instance A", taken_from="A"))[1]
    take = mocker.patch.object(daemon_mod.Reconciler, "take_over_id",
                               side_effect=lambda previous, instance: (order.append("settle"), 2)[1])
    d._register()
    assert order == ["begin", "register", "settle", "commit"]
    take.assert_called_once_with("A", d.instance)
    assert d.fence == store.Fence("h1", 12)
    (call,) = [c for c in events.call_args_list if c.args[0] == "registered"]
    assert call.kwargs["settled_lost"] == 2 and call.kwargs["level"] == logging.WARNING
    assert "settled the 2 attempt(s) it had open as lost" in call.kwargs["detail"]


def test_a_restart_of_the_same_instance_settles_nothing(make, st, events, mocker):
    d = make()
    take = mocker.patch.object(daemon_mod.Reconciler, "take_over_id")
    st.register_host.return_value = store.Registration(True, "active", 5, "registered")
    d._register()
    take.assert_not_called()


# -- admission by pressure ----------------------------------------------------------------------------

def under(psi, **figures):
    psi.read.return_value = pressure.Reading(dict(figures))


def test_a_host_under_no_pressure_claims_its_batch_and_says_nothing_of_it(make, st, events, psi):
    d = make()
    d.reconciler = mock.Mock(in_flight=0)
    d._claim_and_spawn()
    st.claim.assert_called_once_with(d.conn, d.fence, 32, "unitvisor-run-%s-%s.service")
    assert "admission" not in event_names(events)
    psi.report.assert_called_once_with(d.conn, d.fence, "open", None, {"memory": 0.0, "io": 0.0},
                                       "io pressure 0.0% (avg10), under 10%")
    d._status()
    assert "pressure" not in statuses(d)[-1]


def test_a_host_over_the_stop_level_claims_nothing_and_says_so_everywhere(make, st, events, psi):
    """Fails without admission by pressure: the claim would be made."""
    d = make()
    d.reconciler = mock.Mock(in_flight=1)
    under(psi, memory=55.0, io=2.0)
    d._claim_and_spawn()
    st.claim.assert_not_called()
    psi.report.assert_called_once_with(d.conn, d.fence, "stopped", "memory", {"memory": 55.0, "io": 2.0},
                                       "memory pressure 55.0% (avg10) >= 40%: claiming nothing")
    assert events.call_args_list[-1] == mock.call("admission", level=logging.WARNING, host="h1", state="stopped",
                                                  detail="memory pressure 55.0% (avg10) >= 40%: claiming nothing")
    d._status()
    assert statuses(d)[-1].endswith("; memory pressure 55.0% (avg10) >= 40%: claiming nothing")
    state = d._metrics_state()
    assert (state.admission, state.pressure) == ("stopped", {"memory": 55.0, "io": 2.0})
    # A spawn hint is not acted on while stopped: the claim could take nothing.
    d._heard(store.SPAWN_CHANNEL, "")
    assert d.notified == set()


def test_a_slowed_host_claims_fewer_once_a_poll_interval(make, st, mocker, psi):
    d = make()
    d.reconciler = mock.Mock(in_flight=0)
    clock = mocker.patch.object(daemon_mod, "time")
    clock.monotonic.return_value = 1000.0
    under(psi, io=25.0)  # halfway between 10 and 40: half of the batch of 32
    st.claim.return_value = [claimed_pair(n) for n in range(16)]
    d._claim_and_spawn()
    st.claim.assert_called_once_with(d.conn, d.fence, 16, "unitvisor-run-%s-%s.service")  # one claim, full or not
    clock.monotonic.return_value = 1005.0
    d.timers.reclaim = math.inf
    d._claim_and_spawn()
    assert st.claim.call_count == 1
    assert d.timers.reclaim == 1000.0 + d.settings.daemon.poll_interval  # tried again when it may
    clock.monotonic.return_value = 1010.0
    d._claim_and_spawn()
    assert st.claim.call_count == 2


def test_the_loop_reads_pressure_on_its_timer_and_claims_as_soon_as_it_falls(make, st, mocker, psi):
    d = make()
    d.reconciler = mock.Mock(in_flight=1, settled=0)
    d.watcher.drain.return_value = (set(), False)
    d.watcher.fileno.return_value = 98
    d.wakeup_r = 99
    mocker.patch.object(daemon_mod, "_select", return_value=([], [], []))
    d.timers.claim = d.timers.reconcile = d.timers.watchdog = math.inf
    d.timers.retention = math.inf
    under(psi, memory=70.0)
    d.timers.pressure = 0.0  # as registration sets it
    d._iteration()
    assert d.admission.state == "stopped"
    st.claim.assert_not_called()
    assert d.timers.pressure <= time.monotonic() + daemon_mod.PRESSURE_EVERY
    under(psi, memory=3.0)
    d.timers.pressure = 0.0
    d._iteration()
    assert d.admission.state == "open"
    st.claim.assert_called_once()
    assert [c.args[2] for c in psi.report.call_args_list] == ["stopped", "open"]


def test_figures_that_barely_move_are_not_written_again(make, st, mocker, psi):
    d = make()
    clock = mocker.patch.object(daemon_mod, "time")
    clock.monotonic.return_value = 1000.0
    under(psi, memory=50.0)
    d._admit()
    under(psi, memory=58.0)  # moved, but within a poll interval of the last write
    clock.monotonic.return_value = 1005.0
    d._admit()
    assert psi.report.call_count == 1
    clock.monotonic.return_value = 1011.0
    d._admit()
    assert psi.report.call_count == 2
    under(psi, memory=58.5)  # a poll interval later, but barely moved
    clock.monotonic.return_value = 1100.0
    d._admit()
    assert psi.report.call_count == 2


def test_a_new_registration_reports_again(make, st, psi):
    d = make()
    d._admit()
    d._register()
    assert d.reported is None and d.timers.pressure == 0.0
    d._admit()
    assert psi.report.call_count == 2


def test_off_where_psi_cannot_be_read_claims_as_before_and_says_why(make, st, events, psi):
    d = make()
    d.reconciler = mock.Mock(in_flight=0)
    psi.read.return_value = pressure.Reading({}, "/sys/fs/cgroup is not cgroup v2 (PSI per slice needs it)")
    d._claim_and_spawn()
    st.claim.assert_called_once()
    d._status()
    assert statuses(d)[-1].endswith("; admission by pressure off: /sys/fs/cgroup is not cgroup v2 "
                                    "(PSI per slice needs it)")
    assert d.timers.pressure > time.monotonic() + daemon_mod.PRESSURE_EVERY  # read again at the poll interval
