"""`unitvisor daemon`: one thread, one loop.

The loop select()s on its one database connection's socket (which also LISTENs) and on the systemd
signal connection, with the nearest timer as its timeout. Each wake-up drains what is ready, does the
work that is due (claim, settle changed units, cancel, the probe that is also the heartbeat,
reconcile) and feeds the watchdog. Nothing is kept in memory that cannot be rebuilt from PostgreSQL
and systemd after a kill -9.
"""

from __future__ import annotations

import logging
import math
import os
import random
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import FrameType

import psycopg
import sdnotify

from supervisor import (
    __version__,
    faults,
    fence,
    fleet,
    freezer,
    heartbeat,
    pressure,
    river,
    riversource,
    stopsignals,
    store,
    unitspec,
)
from supervisor.config import UNIT_PREFIX, ConfigError, Settings, machine_id
from supervisor.guard import Guard, GuardedConnection
from supervisor.journal import Journal, TailReader
from supervisor.log import event
from supervisor.metrics import Metrics, State
from supervisor.model import Attempt, Run
from supervisor.reconciler import Reconciler, change_needs_rows
from supervisor.systemd import Systemd, SystemdError, SystemdUnavailable, UnitState, Watcher

log = logging.getLogger("unitvisor")

_BACKOFF_MAX = 30.0


def spread(seconds: float) -> float:
    """A retry's pause, drawn between half the backoff and all of it ("equal jitter").

    Chosen over the bare doubling because a fleet fails together: a database restart, a failover or
    an overloaded server cuts every host at the same moment, and hosts that all wait 1, 2, 4 ... 30 s
    come back in waves of the whole fleet at once (bench.scale's 1,000 daemons never all registered
    within 300 s: each wave of connections timed out together and doubled together). Half the pause
    stays fixed, so a lone host still backs off as the schedule says.
    """
    return random.uniform(seconds / 2, seconds)
# A database call that waits longer than this has met a silent network, not a slow statement: the
# server ends any statement after its statement_timeout (store.SESSION_SETTINGS, 15 s) first.
STALL_AFTER = 20.0
# Seconds between two batches of a retention backlog (the first pass after an upgrade may find a
# million runs): the loop claims, probes and settles between them, and the database's other sessions
# get the rest of the time. A batch of 1000 runs takes about 0.1 s (docs/benchmarks.md, History), so a
# million runs take about 10 minutes; 0 would keep this daemon pruning for most of its loop.
RETENTION_PAUSE = 0.5
# What the loop notes for River's notifications (beside the channels of unitvisor's own): a River insert
# into a served queue (claim River jobs now), a River cancel (finish the held jobs now).
RIVER_CLAIM = "river:claim"
RIVER_FINISH = "river:finish"
# Seconds between two reads of the slice's pressure files (supervisor/pressure.py). The kernel
# recomputes avg10 every 2 s, so reading more often sees the same figure; less often, a host goes on
# claiming for longer into a stall. Reading three small files costs no statement: the host row is
# written only when what it says changes.
PRESSURE_EVERY = 2.0
# A figure that moved by less than this (percentage points) is not written to the host row again.
PRESSURE_REPORT_STEP = 1.0
# What the journal's `host-state` event says of the state an operator gave the host row.
HOST_STATE_TEXT = {
    "draining": "drained (unitvisor drain): claims nothing new; its runs in flight finish and are recorded",
    "active": "undrained (unitvisor undrain): claims runs again",
}

# What a fleet upkeep step may fail with and leave the loop going: the server gave up on the statement
# (statement_timeout, lock_timeout) or rolled it back (a deadlock, a serialization failure); the
# connection is fine. Other operational errors mean a lost connection, which the loop handles.
UPKEEP_CONTAINED = (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable, psycopg.errors.TransactionRollback,
                    psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


@dataclass
class Timers:
    """Monotonic deadlines of the periodic work."""

    claim: float = 0.0
    reclaim: float = math.inf  # a claim soon after a burst, for the jobs left to other hosts' shares
    reconcile: float = 0.0
    upkeep: float = 0.0
    retention: float = math.inf  # the next retention batch; never while [retention] keep_finished is off
    watchdog: float = 0.0
    pressure: float = math.inf  # the next read of the slice's PSI files: from registration on, while any is watched
    warn: float = math.inf  # the next run's warning before its runtime_max_sec (stopsignals.py)
    refill: float = math.inf  # the claim a settle asked for, held until enough slots are free (REFILL_WAIT)

    def nearest(self, now: float, cap: float) -> float:
        return max(0.0, min(self.claim, self.reclaim, self.reconcile, self.retention, self.watchdog, self.pressure,
                            self.warn, self.refill, now + cap) - now)


# The claim a settle asks for (Daemon._claim_after_settle) is made at once when a quarter of a claim batch
# is free, else this long after the settle that asked for it. Each claim is two statements (the claim, its
# batch's start marks) however many runs it takes, and a full host whose runs end one at a time (1,000
# runs at once with the packaged sandbox: PID 1 starts one every 38 ms, and each ends soon after) claimed
# one or two at a time: 2.3 statements a run, where 0.5.0 sent 2.0 (issue 27). What it costs: a freed slot
# waits up to this long for its next run while fewer than a quarter of a batch are free, when the host's
# other slots hold runs (and PID 1 the starts not yet taken); a notification's claim is never held.
REFILL_WAIT = 0.1


class Conflict(Exception):
    """Another live daemon holds this host id: this one does nothing until it is gone."""


class Daemon:
    def __init__(self, settings: Settings, dsn_source: Callable[[], str]) -> None:
        """`dsn_source` is asked again before every connection attempt, so that a DSN written after
        the daemon started (a fresh install) is picked up without a restart."""
        self.settings = settings
        self.dsn_source = dsn_source
        self.dsn = ""
        self.host_id = settings.host_id
        self.fence: store.Fence | None = None
        self.is_root = os.geteuid() == 0
        self.boot_id = fleet.boot_id()
        self.instance = fleet.instance_id(machine_id(), self.boot_id)
        self.connected_since = 0.0
        self.guard = Guard(STALL_AFTER)
        # Units unitvisor-fence stopped when this host's lease expired (supervisor/fence.py), read from
        # /run/unitvisor/fenced before each reconcile pass; the reconciler settles them as `lost`.
        self.fenced = fence.FencedUnits()
        # The runs' warnings before their runtime_max_sec (stopsignals.py): the reconciler fills it, the
        # loop's timer follows its next due time. Kept across a reconnect; a pass then drops any whose
        # attempt is no longer open here.
        self.warnings = stopsignals.Schedule()
        self.lease_error = ""
        self.systemd = Systemd()
        self.watcher = Watcher(UNIT_PREFIX)
        # The one database connection of this host: every query, and the LISTEN for wake-ups. One, not
        # a second for LISTEN, so that a fleet of N hosts costs the server N sessions (issue 14).
        self.conn: GuardedConnection | None = None
        self.listening_since = math.inf  # when this connection's LISTEN began (_left_to_woken)
        self.wake_channel = ""  # where this host alone is told of jobs (store.register_wake_channel)
        # Channels that fired since the loop last looked. psycopg hands a notification that arrives
        # while a query runs on the connection to _on_notify; the loop reads those that arrive while
        # it is idle. Both land here, so none is lost to the other path.
        self.notified: set[str] = set()
        self.notifier = sdnotify.SystemdNotifier()
        self.stopping = False
        self.host_state = "active"
        self.timers = Timers(retention=0.0 if settings.retention.keep_finished is not None else math.inf)
        self.claimed = 0
        # Whether the last claim may have left runs this host could take: it stopped at a full host or
        # slowed by pressure, not at a short answer. Unknown at the start.
        self.claim_left_work = True
        # Admission by pressure: what the last read of the slice's PSI files decided, what of it the host
        # row says (None: nothing since this registration), and when a slowed host may claim again.
        # Open until the first read (before any claim): a start under no pressure says nothing of it.
        self.admission = pressure.Admission(pressure.OPEN, None)
        self.pressure_figures: dict[str, float] = {}
        # The fleet's named limits for the metrics (schema 032), read once a reconcile pass.
        self.limit_figures: dict[str, tuple[int, int]] = {}
        self.reported: tuple[str, str | None, dict[str, float]] | None = None
        self.reported_at = 0.0
        self.slowed_until = 0.0
        self.reconciler: Reconciler | None = None
        self.problem = ""  # what is wrong right now, for STATUS=
        # Why the River source ([river]) is not served or not claiming (its schema refused at connect, or
        # the platform's grants or spec function wrong), for STATUS= and said once in the journal.
        self.river_problem = ""
        self.backoff = 1.0
        self.error_backoff = 1.0
        watchdog_usec = _watchdog_usec()
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else 0.0
        self.wakeup_r = self.wakeup_w = -1
        self.metrics = Metrics(self._metrics_state)
        # Ended attempts' output tails, read off the loop; it wakes the loop when one is ready.
        self.output_tails = TailReader(Journal(), settings.runs.output_tail_lines, settings.runs.output_tail_bytes,
                                       wake=self._wake)
        # The heartbeat's renewal may come from the loop (its probe) or from the aside thread (when the
        # loop is late): one at a time, and never backwards (an older send must not shorten the lease).
        self.renew_lock = threading.Lock()
        self.last_renewed_sent = -math.inf
        self.alive_at = time.monotonic()  # the loop's last sign of progress (its watchdog feed)
        self.aside = heartbeat.AsideHeartbeat(
            heartbeat.Loop(fence=lambda: self.fence if self.conn is not None else None, dsn=lambda: self.dsn,
                           renewed_at=lambda: self.guard.renewed_at, alive_at=lambda: self.alive_at,
                           renewed=self._renewed),
            settings.daemon.poll_interval, settings.fleet.host_dead_after,
            on_sent=self.metrics.heartbeats_aside.inc)

    # -- lifecycle --------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # A signal also writes a byte to this pipe, which the loop select()s on: SIGTERM ends a wait
        # at once instead of after the poll interval.
        self.wakeup_r, self.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wakeup_w)
        if not self.settings.runs.allowed_executables:
            event("allowlist-empty", level=logging.WARNING,
                  detail="[runs] allowed_executables is empty: this host claims no run")
        if not self.is_root:
            event("not-root", level=logging.WARNING,
                  detail="the daemon is not root: systemd would refuse its units, so it claims no run")
        # Which psycopg: its C implementation (Debian 13's python3-psycopg-c, which the package recommends)
        # saves 0.3 to 0.5 ms of the daemon's CPU a run (docs/benchmarks.md); bookworm has only the pure one.
        event("starting", host=self.host_id, version=__version__, config=self.settings.source,
              instance=self.instance, psycopg=psycopg.__version__, psycopg_impl=psycopg.pq.__impl__)
        self.metrics.serve(self.settings.metrics.listen)
        self.guard.start()
        self.aside.start()
        ready = False
        while not self.stopping:
            if not self._connected():
                if not self._connect():
                    if not ready:
                        # Chosen, not inherited: readiness means "running and retrying", not "the
                        # database is up". Otherwise a host whose database is down or not yet
                        # configured would fail its start job and crash-loop, and `systemctl
                        # status` would show a restart counter instead of STATUS= saying why.
                        self.notifier.notify("READY=1")
                        ready = True
                    self._sleep(spread(self.backoff))
                    self.backoff = min(self.backoff * 2, _BACKOFF_MAX)
                    continue
                self.backoff = 1.0
                # After every (re)connect, before anything else: repair what changed while we
                # were not looking. The count of settled attempts goes on from the previous
                # connection's, as `claimed` does: STATUS= says both are since the daemon's start.
                settled = self.reconciler.settled if self.reconciler else 0
                self.reconciler = Reconciler(self.settings, self.fence, self.conn, self.systemd,
                                             cut_off_units=self.fenced, warnings=self.warnings)
                self.reconciler.settled = settled
                self.reconciler.tick = self._feed_watchdog
                self.reconciler.metrics = self.metrics
                self.reconciler.output_tails = self.output_tails
                self.reconciler.river_ready = self.settings.river.enabled and not self.river_problem
                if not self._guard(self._reconcile):
                    continue
                if not ready:
                    self.notifier.notify("READY=1")
                    event("ready", host=self.host_id)
                    ready = True
            if self._guard(self._iteration):
                self.error_backoff = 1.0
        self.notifier.notify("STOPPING=1")
        in_flight = self.reconciler.in_flight if self.reconciler else 0
        # Said at the stop, in the journal, because a stop longer than host_dead_after breaks a promise
        # unless the fence keeps it (issue 21); a restart comes back long before either matters.
        event("stopping", level=logging.WARNING if in_flight else logging.INFO, host=self.host_id,
              detail=fence.cut_off_status(self.settings, in_flight) + "; a restart adopts them")
        # The tails of runs that ended just before: read (for a moment at most) and kept.
        self.output_tails.close(TailReader.DELAY + 2.0)
        self._guard(lambda: self.reconciler.write_output_tails() if self.conn and self.reconciler else None)
        self._guard(lambda: store.mark_host_stopped(self.conn, self.fence) if self.conn and self.fence else None)
        self.aside.stop()
        self.guard.stop()
        self._disconnect()
        self.metrics.close()
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _wake(self) -> None:
        """Make the loop's select() return (from another thread): a byte on the signal wake-up pipe."""
        try:
            os.write(self.wakeup_w, b"\0")
        except OSError:  # not running yet (-1), or the pipe is full: the loop wakes anyway
            pass

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            self._feed_watchdog()
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def _connected(self) -> bool:
        return self.conn is not None and self.systemd.connected and self.watcher.connected

    def _connect(self) -> bool:
        try:
            if self.conn is None:
                self._close_db()
                self.dsn = self.dsn_source()
                conn = store.connect(self.dsn, GuardedConnection)
                conn.guard = self.guard
                # Before the LISTEN: from then on every notification reaches the handler or the loop.
                conn.add_notify_handler(self._on_notify)
                self.conn = conn
                # Again after every reconnect: a LISTEN belongs to its session. In autocommit it takes
                # effect at once; inside a transaction it would wait for the commit.
                store.listen(conn, store.SPAWN_CHANNEL, store.CANCEL_CHANNEL)
                self.listening_since = time.monotonic()
                pending = store.pending_migrations(self.conn)
                if pending:
                    raise store.DatabaseError(
                        f"the database schema is not current (missing {', '.join(pending)}): run `unitvisor migrate`")
                self._register()
                self._check_river()
                event("database-connected", host=self.host_id, db=store.dsn_location(self.dsn),
                      epoch=self.fence.epoch if self.fence else None)
            if not self.systemd.connected or not self.watcher.connected:
                self.watcher.connect()
                self.systemd.connect()
                event("systemd-connected", host=self.host_id)
        except ConfigError as exc:
            self._trouble(f"waiting for a database: {exc}")
            return False
        except Conflict as exc:
            self._close_db()
            self.backoff = self.settings.daemon.poll_interval  # before _trouble, whose event says it
            self._trouble(f"not working: {exc}; this daemon claims, starts and stops nothing while it lasts")
            return False
        except (store.DatabaseError, psycopg.Error) as exc:
            self._close_db()
            self._trouble(f"database: {exc}" if not isinstance(exc, store.DatabaseError) else str(exc))
            return False
        except SystemdError as exc:
            self.systemd.close()
            self.watcher.close()
            self._trouble(str(exc))
            return False
        self.problem = ""
        return True

    def _register(self) -> None:
        """Take this host id for this daemon (or learn that another live daemon has it), then renew."""
        assert self.conn is not None
        # A session whose client went silent (a black hole) ends on the server after this long, so
        # that it does not hold this host's lock for ever. A live daemon speaks at least every poll
        # interval (the probe, however quiet the queue), and host_dead_after is at least 3 of them
        # (config), so a session idle only because nothing happened is never ended: waiting for a
        # NOTIFY on it does not count as idle for long. Notifications the server sends do not reset
        # the timer; only what the client sends does.
        store.set_idle_session_timeout(self.conn, self.settings.fleet.host_dead_after)
        profile = fleet.host_profile(self.settings, __version__, self.instance, self.boot_id, self.is_root)
        sent, sent_boot = time.monotonic(), fence.boottime()
        settled = 0
        taking: Reconciler | None = None
        # One transaction: an id taken over from another instance has its open attempts settled with
        # it, or is not taken (issue 21: left open, this instance's reconcile pass could start an
        # attempt the other one claimed and may have started).
        with self.conn.transaction():
            registration = store.register_host(self.conn, profile)
            if registration.registered:
                assert registration.epoch is not None
                taken = store.Fence(self.host_id, registration.epoch)
                self.wake_channel = store.register_wake_channel(self.conn, taken)
                if registration.taken_from is not None:
                    taking = Reconciler(self.settings, taken, self.conn, self.systemd, cut_off_units=self.fenced)
                    taking.metrics = self.metrics
                    settled = taking.take_over_id(registration.taken_from, self.instance)
        if not registration.registered:
            event("host-id-conflict", level=logging.ERROR, host=self.host_id, instance=self.instance,
                  detail=registration.detail)
            raise Conflict(registration.detail)
        assert registration.state is not None and registration.epoch is not None
        if taking is not None:
            taking.count_taken()
        self.fence = store.Fence(self.host_id, registration.epoch)
        self.host_state = registration.state
        # A new registration voids the host row's pressure report (sql/migrations/018): said again at once.
        self.reported, self.timers.pressure = None, 0.0
        self._renewed(sent, sent_boot)
        self.connected_since = time.monotonic()
        if registration.taken_from is None:
            event("registered", host=self.host_id, epoch=registration.epoch, state=registration.state,
                  detail=registration.detail)
        else:
            event("registered", level=logging.WARNING if settled else logging.INFO, host=self.host_id,
                  epoch=registration.epoch, state=registration.state, settled_lost=settled,
                  detail=f"{registration.detail}; settled the {settled} attempt(s) it had open as lost "
                         "(their runs move on by their own policy)")

    def _check_river(self) -> None:
        """At every connect, before any claim: whether River's schema is one this unitvisor knows. A
        version it does not know is refused (said, and in STATUS=), never guessed at: the host's own
        runs go on; River's jobs wait for a unitvisor that knows it. Served: LISTEN on River's insert
        and control channels (hints; the poll is the backstop)."""
        river_settings = self.settings.river
        if not river_settings.enabled:
            return
        assert self.conn is not None
        problem = riversource.check_schema(self.conn, river_settings)
        self._river_trouble(problem or "")
        if problem is None:
            store.listen(self.conn, river.insert_channel(river_settings.schema),
                         river.control_channel(river_settings.schema))

    def _river_trouble(self, problem: str) -> None:
        if problem and problem != self.river_problem:
            event("river-refused", level=logging.ERROR, host=self.host_id, detail=problem)
        self.river_problem = problem

    def _renewed(self, sent: float, sent_boot: float) -> bool:
        """The heartbeat sent at monotonic `sent` (boottime `sent_boot`) was committed: renew the
        guard's clock and the fence's lease. A lease that cannot be written is not fatal: the old one
        expires and the fence stops the runs (the safe side), so it is said, once, and the loop goes on.
        Called by the loop and by the aside heartbeat's thread; one sent before the last renewal renews
        nothing (returns False)."""
        with self.renew_lock:
            if sent < self.last_renewed_sent:
                return False
            self.last_renewed_sent = sent
            self.guard.renewed(sent)
            try:
                fence.write_lease(fence.daemon_lease(self.settings, sent_boot, self.boot_id))
            except OSError as exc:
                if str(exc) != self.lease_error:
                    event("lease-not-written", level=logging.ERROR, path=str(fence.LEASE), detail=str(exc))
                self.lease_error = str(exc)
            else:
                self.lease_error = ""
            return True

    def _trouble(self, message: str) -> None:
        message = " ".join(message.split())
        if message != self.problem:
            event("degraded", level=logging.ERROR, detail=message, retry_in=f"{self.backoff:.0f}s")
        self.problem = message
        self._status()

    def _close_db(self) -> None:
        with self.guard.closing():
            if self.conn is not None:
                try:
                    self.conn.close()
                except psycopg.Error:
                    pass
            self.conn = None
        # What a closed session heard is stale: the reconcile pass after the reconnect and the probe
        # re-read the tables anyway.
        self.notified.clear()

    def _disconnect(self) -> None:
        self._close_db()
        self.systemd.close()
        self.watcher.close()

    def _guard(self, work: Callable[[], object]) -> bool:
        """Run one piece of work; a lost database or bus drops the connection for a retry. Nothing
        that goes wrong in it ends the daemon: it is logged as one event, and the loop goes on."""
        try:
            work()
        except store.Fenced as exc:
            # Declared dead (or the id taken over, or the row deleted) while we were away: register
            # again, for a new epoch. The reconcile pass after it stops every unit whose attempt was
            # taken over; nothing of them is recorded, started or adopted here.
            event("fenced", level=logging.WARNING, host=self.host_id, detail=str(exc))
            self._close_db()
            self._trouble(f"fenced: {exc}; registering again")
            self.backoff = 1.0
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
            # lock_timeout or statement_timeout (store.SESSION_SETTINGS): the connection is fine, the
            # work is not done; it is tried again after a pause, and STATUS= says what holds it up.
            self._trouble(f"database: {store.one_line(exc)}")
            self._pause_after_error()
        except store.CONNECTION_LOST as exc:
            self._close_db()
            self._trouble(f"database at {store.dsn_location(self.dsn)} unreachable: {store.one_line(exc)}")
        except SystemdUnavailable as exc:
            self.systemd.close()
            self.watcher.close()
            self._trouble(str(exc))
        except Exception as exc:  # a bug, or a database error nobody foresaw: contained, retried
            log.debug("traceback", exc_info=True)
            self._close_db()
            self._trouble(f"internal error: {type(exc).__name__}: {store.one_line(exc)}")
            self._pause_after_error()
        else:
            return True
        return False

    def _pause_after_error(self) -> None:
        """Back off, so that an error that repeats costs a retry a while, not a busy loop; the pause
        doubles until an iteration succeeds (run() resets it)."""
        self._sleep(spread(self.error_backoff))
        self.error_backoff = min(self.error_backoff * 2, _BACKOFF_MAX)

    # -- the loop ---------------------------------------------------------------------------------

    def _iteration(self) -> None:
        assert self.conn is not None
        db_fd = self.conn.fileno()
        # Notifications read during the last iteration's queries (or left parsed-but-unread in libpq's
        # buffer by them) never make the socket readable again: act on them now, without waiting.
        self._drain_notifications(receive=False)
        now = time.monotonic()
        timeout = 0.0 if self.notified else self.timers.nearest(now, cap=self.settings.daemon.poll_interval)
        readable, _, _ = _select([db_fd, self.watcher.fileno(), self.wakeup_r], timeout)
        if self.wakeup_r in readable:
            _drain_pipe(self.wakeup_r)
            if self.stopping:
                return
        if db_fd in readable:
            self._drain_notifications(receive=True)
        wake_claim, wake_cancel = store.SPAWN_CHANNEL in self.notified, store.CANCEL_CHANNEL in self.notified
        wake_river, wake_finish = RIVER_CLAIM in self.notified, RIVER_FINISH in self.notified
        self.notified.clear()
        changed, reloaded = self.watcher.drain()
        if reloaded:
            event("systemd-reloaded", host=self.host_id)
        now = time.monotonic()
        settled_before = self.reconciler.settled
        signalled = self.watcher.signalled
        changed = {name for name in changed
                   if change_needs_rows(name, signalled.get(name), self.reconciler.started_units,
                                        self.reconciler.settled_units)}
        if changed:
            self._reconcile_attempts(store.open_attempts(self.conn, self.host_id, unit_names=sorted(changed)),
                                     signalled=signalled)
        if self.reconciler.settled > settled_before and self._claim_after_settle():
            enough = self.settings.host.max_runs - self.reconciler.in_flight >= self._refill_at()
            self.timers.refill = min(self.timers.refill, now if enough else now + REFILL_WAIT)
        if now >= self.timers.reclaim:
            # The probe first, now, and a claim only if it says there is work: by the time the jobs left
            # to other hosts' fair shares are anyone's, those hosts have mostly taken them, and in a burst
            # on 300 hosts the claim sent here regardless was most of the empty claims (issue 23).
            self.timers.claim, self.timers.reclaim = now, math.inf
        if now >= self.timers.pressure:
            before = self.admission.state
            after = self._admit().state
            # Pressure fell: claim now rather than at the next poll (the probe said nothing was claimable
            # while the host row said stopped).
            wake_claim = wake_claim or (before == pressure.STOPPED and after != pressure.STOPPED) or (
                before == pressure.SLOWED and after in (pressure.OPEN, pressure.OFF))
        upkeep = False
        if now >= self.timers.claim:
            sent, sent_boot = time.monotonic(), fence.boottime()
            probe = store.probe(self.conn, self.fence, fleet.explain_after(self.settings), self._left_to_woken(now))
            self._renewed(sent, sent_boot)
            # Read before the claim: a drain takes effect before the next claim, not at the next poll.
            self._host_state_seen(probe.host_state)
            wake_claim, wake_cancel = wake_claim or probe.claimable, wake_cancel or probe.cancels
            self.timers.claim = now + self.settings.daemon.poll_interval
            upkeep = probe.upkeep and now >= self.timers.upkeep
            wake_river = True  # River's inserts notify at most one a 100 ms per queue and client: polled too
        if wake_cancel:
            cancelling = store.open_attempts(self.conn, self.host_id, cancel_requested=True)
            self._reconcile_attempts(cancelling)
            # Freeze and thaw requests come on the same channel (and the same heartbeat flag): schema 030.
            # After the cancels, and those of the runs just stopped answered without systemd: a cancel
            # wins over a freeze (systemd thaws a frozen unit to stop it; freezer.py).
            freezer.act_on_requests(self.conn, self.fence, self.systemd,
                                    lambda result: self.metrics.freezes.labels(result).inc(),
                                    cancelling={attempt.run_id for _, attempt in cancelling})
        if wake_river and self._river_claim():
            wake_claim = wake_finish = True  # this host may start the runs just made: claim them now
        wake_claim = wake_claim or now >= self.timers.refill
        if wake_claim:
            self.timers.refill = math.inf  # this claim is the one a settle asked for, too
            self._claim_and_spawn()
        if wake_finish or (wake_claim and self.reconciler.river_ready):
            self.reconciler.finish_river_jobs()
        # After this host's own claim, never before it (issue 23): the fleet's upkeep on a busy database
        # may take up to the statement_timeout, and a failure in it is contained there.
        if upkeep:
            self._fleet_upkeep()
        if now >= self.timers.reconcile or reloaded:
            self._reconcile()
        self.reconciler.write_output_tails()
        self._warn(now)
        if now >= self.timers.retention:
            self._prune()
        self._feed_watchdog()
        self._status()

    def _host_state_seen(self, state: str) -> None:
        """The host row's state as the heartbeat read it. A change is `unitvisor drain` or `undrain`,
        made by someone else: said once in the journal, when this daemon first acts on it, so that the
        journal shows when the host stopped (or went back to) claiming and why."""
        if state != self.host_state:
            event("host-state", host=self.host_id, state=state, before=self.host_state,
                  detail=HOST_STATE_TEXT.get(state, f"the host row says {state}"))
        self.host_state = state

    def _admit(self) -> pressure.Admission:
        """Read the slice's pressure, decide what this host claims, and say it where it changed: an
        event, and the host row (which the database's claim and a waiting run's reason read)."""
        host, now = self.settings.host, time.monotonic()
        reading = pressure.read(self.settings.systemd.slice, host.pressure_resources)
        admission = pressure.decide(reading, host.pressure_slow_at, host.pressure_stop_at,
                                    self.settings.daemon.claim_batch)
        before, self.admission, self.pressure_figures = self.admission, admission, reading.figures
        if (admission.state, admission.resource) != (before.state, before.resource) or (
                admission.state == pressure.OFF and admission.detail != before.detail):
            level = logging.WARNING if admission.state in (pressure.STOPPED, pressure.OFF) else logging.INFO
            event("admission", level=level, host=self.host_id, state=admission.state, detail=admission.detail)
        self._report_pressure(admission, reading.figures, now)
        self.timers.pressure = (now + PRESSURE_EVERY if admission.state != pressure.OFF
                                else now + self.settings.daemon.poll_interval if host.pressure_resources
                                else math.inf)
        return admission

    def _report_pressure(self, admission: pressure.Admission, figures: dict[str, float], now: float) -> None:
        if self.conn is None or self.fence is None:
            return
        if self.reported is not None:
            state, resource, said = self.reported
            moved = any(abs(figures.get(k, 0.0) - said.get(k, 0.0)) >= PRESSURE_REPORT_STEP
                        for k in {*figures, *said})
            if (state, resource) == (admission.state, admission.resource) and not (
                    moved and now - self.reported_at >= self.settings.daemon.poll_interval):
                return
        store.set_pressure(self.conn, self.fence, admission.state, admission.resource, figures, admission.detail)
        self.reported, self.reported_at = (admission.state, admission.resource, dict(figures)), now

    def _warn(self, now: float) -> None:
        """Send the runs' warnings that are due (Reconciler.send_due_warnings), and set the timer to the
        next one. Due times are on this host's wall clock (a unit's start time is), the loop's timers on
        the monotonic one: converted here, at every iteration, so that a clock step moves it too."""
        if now >= self.timers.warn:
            self.reconciler.send_due_warnings()
        due = self.warnings.next_due()
        self.timers.warn = (math.inf if due is None
                            else time.monotonic() + max(0.0, (due - datetime.now(UTC)).total_seconds()))

    def _reconcile(self) -> None:
        began = time.monotonic()
        self.fenced.refresh()
        self.reconciler.reconcile_pass()
        self._forget_fenced_settled_elsewhere()
        self.metrics.reconciled(time.monotonic() - began)
        # Once a pass, not a poll: a count per limit, for a gauge a user alerts on over minutes.
        self.limit_figures = self.reconciler.pass_figures()
        self.timers.reconcile = time.monotonic() + self.settings.daemon.reconcile_interval

    def _forget_fenced_settled_elsewhere(self) -> None:
        """Drop the fence's record of units whose attempt is no longer open on this host: a peer
        settled it when it declared this host dead (the pass then stops nothing: `stop-stale`), so no
        settlement of ours would ever remove it, and STATUS= would say "being settled" for ever."""
        if not self.fenced:
            return
        names = sorted(self.fenced)
        pairs = store.open_attempts(self.conn, self.host_id, unit_names=names)
        still_open = {attempt.unit_name for _, attempt in pairs}
        for name in names:
            if name not in still_open:
                self.fenced.discard(name)

    def _fleet_upkeep(self) -> None:
        """Submit the runs of due schedules; declare silent hosts dead and take over their runs; expire runs
        past their start deadline; say why runs wait that no host takes. The probe's upkeep flag comes for
        a due schedule, a silent host, a job due for long, or a run past its start deadline (which no claim
        expires); every daemon so flagged submits the due schedules' runs (the database makes each due time
        one run) and asks for the turn at most once a poll interval, and one daemon of the fleet gets it per
        poll interval (unitvisor.fleet_upkeep_turn) for the rest. Each step's failure (a statement timeout
        on a busy database, a lock) is said and counted, and the others and the rest of the loop go on: a
        lost connection or a fence is the loop's to handle, and goes up."""
        self.timers.upkeep = time.monotonic() + self.settings.daemon.poll_interval  # also when it fails
        every = timedelta(seconds=self.settings.daemon.poll_interval)
        # Before the turn, by every daemon the probe flags: the row lock and the idempotency key make each
        # due time one run, not the turn; and the turn may go to a 0.8.0 daemon, which submits no schedule.
        self._upkeep_step("schedules", self.reconciler.submit_due_schedules)
        turn = self._upkeep_step("turn", lambda: store.fleet_upkeep_turn(self.conn, self.fence, every))
        if not turn:
            return
        if self._upkeep_step("declare-dead", lambda: self.reconciler.take_over_dead_hosts(
                time.monotonic() - self.connected_since)):
            # The dead id may have been this very machine's (a changed [host] id): units of what was
            # just taken over are stopped by the next pass, so it comes now, not at its interval.
            self.timers.reconcile = 0.0
        self._upkeep_step("expire", self.reconciler.expire_overdue)
        self._upkeep_step("explain-waiting", self.reconciler.explain_waiting)

    def _upkeep_step(self, step: str, work: Callable[[], object]) -> object:
        """One step of the fleet upkeep: its result, or None when it failed on the database (said once
        per failure, and counted). Raises what the loop must act on: a lost connection, a fence."""
        try:
            return work()
        except UPKEEP_CONTAINED as exc:
            failure: psycopg.Error = exc
        except psycopg.Error as exc:
            if isinstance(exc, store.CONNECTION_LOST):
                raise
            failure = exc
        event("fleet-upkeep-failed", level=logging.WARNING, host=self.host_id, step=step,
              detail=store.one_line(failure))
        self.metrics.upkeep_failures.inc()
        return None

    def _prune(self) -> None:
        """One batch of the fleet's retention ([retention]), committed on its own, when no other daemon
        is pruning right now (the database decides). A full batch means a backlog: the next one comes
        after RETENTION_PAUSE, with the loop's other work between; otherwise after the interval."""
        retention = self.settings.retention
        assert self.conn is not None and self.fence is not None and retention.keep_finished is not None
        pruned = store.prune_batch(self.conn, timedelta(seconds=retention.keep_finished), retention.batch_size,
                                   self.fence)
        if pruned.runs or pruned.jobs:
            event("pruned", runs=pruned.runs, attempts=pruned.attempts, events=pruned.events, jobs=pruned.jobs)
        self.metrics.pruned(pruned)
        backlog = pruned.full(retention.batch_size)
        self.timers.retention = time.monotonic() + (RETENTION_PAUSE if backlog else retention.interval)

    def _reconcile_attempts(self, pairs: list[tuple[Run, Attempt]],
                            signalled: Mapping[str, UnitState] | None = None) -> None:
        """Decide on each attempt, on its unit's state as the signals just read said it where they said
        it (Watcher.signalled), else as systemd says now."""
        if not pairs:
            return
        signalled = signalled or {}
        self.fenced.refresh()  # a unit the fence stopped may be among them: settled as cut off, not as killed
        with self.reconciler.batched_outcomes():
            for run, attempt in pairs:
                self.reconciler.isolated(run, attempt, lambda r=run, a=attempt: self.reconciler.reconcile_one(
                    r, a, signalled.get(a.unit_name)))

    def _on_notify(self, note: psycopg.Notify) -> None:
        """psycopg's handler for a notification it read while a query ran on the connection (it takes
        them out of libpq's queue, so the loop would never see them)."""
        self._heard(note.channel, note.payload)

    def _heard(self, channel: str, payload: str) -> None:
        """Note a notification for the loop, unless it is a spawn hint this host should not act on: one
        that names other hosts (sql/migrations/010_wake_targets.sql), or one that comes while the host is draining
        or has every slot taken, when its claim could take nothing. Ignoring a hint is safe: the probe
        of every poll interval, and the claim after each run that ends, find what it was about."""
        if self.settings.river.enabled and channel.startswith(f"{self.settings.river.schema}.river_"):
            self._heard_river(channel, payload)
            return
        own = channel == self.wake_channel  # schema 048: a request for one of its runs, or a job for it alone
        if own and payload == store.OWN_CHANNEL_REQUEST:
            channel = store.CANCEL_CHANNEL
        elif own or channel == store.SPAWN_CHANNEL:
            targets = None if own else store.spawn_hint_targets(payload)
            if targets is not None and self.host_id not in targets:
                return
            if self.host_state != "active" or self.admission.state == pressure.STOPPED:
                return
            if self.reconciler is not None and self.reconciler.in_flight >= self.settings.host.max_runs:
                return
            channel = store.SPAWN_CHANNEL
        self.notified.add(channel)

    def _heard_river(self, channel: str, payload: str) -> None:
        """River's notifications, as hints: an insert into a queue this host serves wakes the River claim;
        a cancel wakes the finish (which reads every held job's metadata, so the job id is not needed)."""
        schema = self.settings.river.schema
        if channel == river.insert_channel(schema) and river.insert_queue(payload) in self.settings.river.queues:
            self.notified.add(RIVER_CLAIM)
        elif channel == river.control_channel(schema) and river.control_cancel(payload) is not None:
            self.notified.add(RIVER_FINISH)

    def _drain_notifications(self, receive: bool) -> None:
        """Take the NOTIFYs queued on the idle connection into `notified`, without blocking; with
        `receive`, first read what the socket has (it was readable). They are hints: what they say is
        re-read from the tables, and the fallback poll covers any that were lost. A connection the
        server closed fails here, as a lost connection, and the loop reconnects."""
        assert self.conn is not None
        pgconn = self.conn.pgconn
        if receive:
            pgconn.consume_input()
        while (note := pgconn.notifies()) is not None:
            self._heard(note.relname.decode(), note.extra.decode())

    def _feed_watchdog(self) -> None:
        now = time.monotonic()
        self.alive_at = now
        if self.watchdog_interval and now >= self.timers.watchdog:
            self.notifier.notify("WATCHDOG=1")
            self.timers.watchdog = now + self.watchdog_interval
        elif not self.watchdog_interval:
            self.timers.watchdog = now + 3600

    def _status(self) -> None:
        r = self.reconciler
        text = (f"runs in flight: {r.in_flight if r else 0}, claimed since start: {self.claimed}, "
                f"settled since start: {r.settled if r else 0}")
        if self.host_state == "draining":
            text += "; draining"
        if not self.is_root:
            text += "; not root: claiming nothing"
        if self.admission.state in (pressure.SLOWED, pressure.STOPPED) or (
                self.admission.state == pressure.OFF and self.settings.host.pressure_resources):
            text += f"; {self.admission.detail}"
        if self.river_problem:
            text += f"; River source: {self.river_problem}"
        if self.fenced:
            text += "; runs stopped by unitvisor-fence (stop_runs_when_cut_off), being settled"
        if self.problem:
            text = f"{self.problem}; retrying. {text}"
        self.notifier.notify(f"STATUS={text}")

    def _metrics_state(self) -> State:
        """What a scrape shows of the loop (called from the metrics server's thread: reads only)."""
        reconciler, connected = self.reconciler, self.conn is not None
        return State(in_flight=reconciler.in_flight if reconciler else 0, database_up=connected,
                     systemd_up=self.systemd.connected and self.watcher.connected,
                     host_state=self.host_state if connected and self.fence else "unregistered",
                     admission=self.admission.state, pressure=dict(self.pressure_figures),
                     limits=dict(self.limit_figures))

    # -- work -------------------------------------------------------------------------------------

    def _claim_and_spawn(self) -> None:
        assert self.conn is not None and self.fence is not None
        if self.host_state != "active" or self.stopping or not self.is_root:
            return
        daemon = self.settings.daemon
        # Read again just before claiming: a wake-up between two reads must not claim into a stall.
        admission = self._admit()
        if admission.state == pressure.STOPPED:
            return
        if admission.state == pressure.SLOWED and time.monotonic() < self.slowed_until:
            self.timers.reclaim = min(self.timers.reclaim, self.slowed_until)
            self.claim_left_work = True
            return
        most = daemon.claim_batch if admission.limit is None else admission.limit
        while not self.stopping:
            # No claim for a host whose slots are all taken: the database would answer none (issue 23: in a
            # burst, the claim after the one that filled the host was most of the empty claims left).
            take = min(most, self.settings.host.max_runs - self.reconciler.in_flight)
            self.claim_left_work = take <= 0
            if take <= 0:
                return
            sent = time.monotonic()
            claimed = store.claim(self.conn, self.fence, take, unitspec.UNIT_NAME_FORMAT)
            self.metrics.claimed(claimed, sent)
            if not claimed:
                return
            if admission.state == pressure.SLOWED:
                # One claim a poll interval while slowed: the runs just claimed show in the figures
                # before more come.
                self.slowed_until = time.monotonic() + daemon.poll_interval
            # Jobs left to other hosts' fair shares are anyone's after the spread grace: look again then.
            self.timers.reclaim = min(self.timers.reclaim, time.monotonic() + fleet.RECLAIM_AFTER)
            self.claimed += len(claimed)
            self.reconciler.in_flight += len(claimed)
            for run, attempt in claimed:
                event("claimed", run=run.id, attempt=attempt.attempt, unit=attempt.unit_name)
            faults.point("after-claim")
            created: list[Attempt] = []
            try:
                for run, attempt in claimed:
                    self._feed_watchdog()
                    batch: list[Attempt] | None = created
                    if not self._unfenceable():
                        self.reconciler.mark_created(created)
                        created, batch = [], None  # marked at once: a fence stops the batch after this one unit
                    self.reconciler.isolated(run, attempt,
                                             lambda r=run, a=attempt, b=batch: self.reconciler.start(r, a, b))
            finally:
                # Also when the batch ended early (the bus gone): what was created is running.
                self.reconciler.mark_created(created)
            if admission.state == pressure.SLOWED:
                self.claim_left_work = True
                return
            if len(claimed) < take:
                return

    def _claim_after_settle(self) -> bool:
        """Whether the runs settled in this iteration are worth a claim now rather than at the next poll.
        A settled run frees a slot: a backlog larger than max_runs would otherwise drain one batch a
        poll interval, and a key's or a named limit's next run becomes claimable with no NOTIFY. Not
        after a claim that came back short, though: the queue had nothing more for this host then, a
        submit since would have notified it (it had room), and jobs left to others' fair shares are
        claimed again by the reclaim timer. Chosen, not inherited: 0.11.0 claimed after every settle,
        and at the end of a burst that was one empty claim per host (issue 23). What this misses (a run
        made claimable some other way) the next poll's probe finds: so does a limit created since the
        last reconcile pass read the fleet's limits (limit_figures), where a labelled run's settle
        counts only while some limit exists. With a memory_budget, always: a run that did not fit may
        fit now."""
        rec = self.reconciler
        freed = rec.freed_key or (rec.freed_labelled and bool(self.limit_figures))
        rec.freed_key = rec.freed_labelled = False
        return self.claim_left_work or freed or self.settings.host.memory_budget is not None

    def _left_to_woken(self, now: float) -> timedelta:
        """How young a job just submitted is left to the hosts its NOTIFY named (schema 047): the spread
        grace once this connection has listened that long, so that this daemon heard every notification
        of a job that young, and knows it was not named; none before. A daemon just (re)started or
        reconnected missed them, and so may every host (a single host restarting): then it counts every
        job, as every heartbeat did before 047, and the adoption of a unit started before a crash is not
        put off by a poll interval."""
        if now - self.listening_since >= fleet.LEFT_TO_WOKEN.total_seconds():
            return fleet.LEFT_TO_WOKEN
        return timedelta(0)

    def _refill_at(self) -> int:
        """Free slots at which a settle's claim is made at once (REFILL_WAIT): a quarter of a claim batch,
        or of max_runs when that is smaller; 1 for a host of fewer than 8 slots."""
        return max(1, min(self.settings.daemon.claim_batch, self.settings.host.max_runs) // 4)

    def _river_claim(self) -> bool:
        """Claim River jobs into runs ([river]), when this host would claim its own jobs at all (active,
        root, not stopped by pressure) and has free slots; True when it made any run. A configuration
        error of the platform's (grants, the spec function) is said once, and tried again each poll."""
        assert self.conn is not None and self.fence is not None
        if (not self.reconciler.river_ready or self.host_state != "active" or self.stopping or not self.is_root
                or self.admission.state == pressure.STOPPED):
            return False
        free = self.settings.host.max_runs - self.reconciler.in_flight
        try:
            claimed = riversource.claim(self.conn, self.fence, self.settings.river,
                                        min(self.settings.daemon.claim_batch, free))
        except store.RiverMisconfigured as exc:
            self._river_trouble(str(exc))
            return False
        self._river_trouble("")
        made = any(one.run_id is not None for one in claimed)
        if made:
            # The River jobs are running and their runs queued, none started: the crash the reconciler's
            # finish repairs when the daemon is back (tests/system/test_river.py).
            faults.point("after-river-claim")
        return made

    def _unfenceable(self) -> bool:
        """Whether no other host can have fenced this one yet, so that the units of a batch may be
        started back to back and marked started with one statement at the end of it.

        Chosen, not inherited: a mark per start is a round trip to the database on every run's path,
        and it was what stopped a batch at the first unit once the host was fenced, so that a host
        declared dead never started more than one unit its new owner may run too. A live host's epoch
        changes only after it was silent for its host_dead_after (a peer declares it dead, or another
        machine takes the id over; a removed host is a dead or stopped one), counted on the database's
        clock from the heartbeat's commit, which came after `renewed` was taken. Half of that leaves
        room for the two clocks' rates and the batch's own statement; past it, each unit is marked at
        once, as before. If this said True for a host that a peer may already declare dead, a whole
        batch of runs could run twice."""
        return self.guard.renewed_within(self.settings.fleet.host_dead_after / 2, time.monotonic())


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _select(fds: list[int], timeout: float) -> tuple[list, list, list]:
    try:
        return select.select(fds, [], [], timeout)
    except InterruptedError:
        return [], [], []


def _watchdog_usec() -> int:
    try:
        if int(os.environ.get("WATCHDOG_PID", os.getpid())) != os.getpid():
            return 0
        return int(os.environ.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return 0
