"""`unitvisor daemon`: one thread, one loop.

The loop select()s on the LISTEN connection's socket and on the systemd signal connection, with the
nearest timer as its timeout. Each wake-up drains what is ready, does the work that is due (claim,
settle changed units, cancel, the probe that is also the heartbeat, reconcile) and feeds the
watchdog. Nothing is kept in memory that cannot be rebuilt from PostgreSQL and systemd after a kill -9.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psycopg
import sdnotify

from supervisor import __version__, faults, store, unitspec
from supervisor.config import UNIT_PREFIX, ConfigError, Settings
from supervisor.log import event
from supervisor.model import Attempt, Run
from supervisor.reconciler import Reconciler
from supervisor.systemd import Systemd, SystemdError, SystemdUnavailable, Watcher

log = logging.getLogger("unitvisor")

_BACKOFF_MAX = 30.0


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass
class Timers:
    """Monotonic deadlines of the periodic work."""

    claim: float = 0.0
    reconcile: float = 0.0
    watchdog: float = 0.0

    def nearest(self, now: float, cap: float) -> float:
        return max(0.0, min(self.claim, self.reconcile, self.watchdog, now + cap) - now)


class Daemon:
    def __init__(self, settings: Settings, dsn_source: Callable[[], str]) -> None:
        """`dsn_source` is asked again before every connection attempt, so that a DSN written after
        the daemon started (a fresh install) is picked up without a restart."""
        self.settings = settings
        self.dsn_source = dsn_source
        self.dsn = ""
        self.host_id = settings.host_id
        self.systemd = Systemd()
        self.watcher = Watcher(UNIT_PREFIX)
        self.conn: store.Connection | None = None
        self.listen_conn: store.Connection | None = None
        self.notifier = sdnotify.SystemdNotifier()
        self.stopping = False
        self.host_state = "active"
        self.timers = Timers()
        self.claimed = 0
        self.reconciler: Reconciler | None = None
        self.problem = ""  # what is wrong right now, for STATUS=
        self.backoff = 1.0
        watchdog_usec = _watchdog_usec()
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else 0.0
        self.wakeup_r = -1

    # -- lifecycle --------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # A signal also writes a byte to this pipe, which the loop select()s on: SIGTERM ends a wait
        # at once instead of after the poll interval.
        self.wakeup_r, wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wakeup_w)
        if not self.settings.runs.allowed_executables:
            event("allowlist-empty", level=logging.WARNING,
                  detail="[runs] allowed_executables is empty: every run will be refused")
        event("starting", host=self.host_id, version=__version__, config=self.settings.source)
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
                    self._sleep(self.backoff)
                    self.backoff = min(self.backoff * 2, _BACKOFF_MAX)
                    continue
                self.backoff = 1.0
                # After every (re)connect, before anything else: repair what changed while we
                # were not looking.
                self.reconciler = Reconciler(self.settings, self.host_id, self.conn, self.systemd)
                if not self._guard(self._reconcile):
                    continue
                if not ready:
                    self.notifier.notify("READY=1")
                    event("ready", host=self.host_id)
                    ready = True
            self._guard(self._iteration)
        self.notifier.notify("STOPPING=1")
        event("stopping", host=self.host_id, detail="runs keep running; they are adopted on the next start")
        self._guard(lambda: store.mark_host_stopped(self.conn, self.host_id) if self.conn else None)
        self._disconnect()
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            self._feed_watchdog()
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def _connected(self) -> bool:
        return self.conn is not None and self.listen_conn is not None and self.systemd.connected \
            and self.watcher.connected

    def _connect(self) -> bool:
        try:
            if self.conn is None or self.listen_conn is None:
                self._close_db()
                self.dsn = self.dsn_source()
                self.conn = store.connect(self.dsn)
                self.listen_conn = store.connect(self.dsn)
                store.listen(self.listen_conn, store.SPAWN_CHANNEL, store.CANCEL_CHANNEL)
                pending = store.pending_migrations(self.conn)
                if pending:
                    raise store.DatabaseError(
                        f"the database schema is not current (missing {', '.join(pending)}): run `unitvisor migrate`")
                self.host_state = store.register_host(
                    self.conn, self.host_id, self.settings.host_name, self.settings.host.max_runs,
                    self.settings.host.memory_budget, __version__, boot_id())
                event("database-connected", host=self.host_id, db=store.dsn_location(self.dsn))
            if not self.systemd.connected or not self.watcher.connected:
                self.watcher.connect()
                self.systemd.connect()
                event("systemd-connected", host=self.host_id)
        except ConfigError as exc:
            self._trouble(f"waiting for a database: {exc}")
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

    def _trouble(self, message: str) -> None:
        message = " ".join(message.split())
        if message != self.problem:
            event("degraded", level=logging.ERROR, detail=message, retry_in=f"{self.backoff:.0f}s")
        self.problem = message
        self._status()

    def _close_db(self) -> None:
        for conn in (self.conn, self.listen_conn):
            if conn is not None:
                try:
                    conn.close()
                except psycopg.Error:
                    pass
        self.conn = self.listen_conn = None

    def _disconnect(self) -> None:
        self._close_db()
        self.systemd.close()
        self.watcher.close()

    def _guard(self, work: Callable[[], object]) -> bool:
        """Run one piece of work; a lost database or bus drops the connection for a retry."""
        try:
            work()
            return True
        except store.CONNECTION_LOST as exc:
            self._close_db()
            self._trouble(f"database at {store.dsn_location(self.dsn)} unreachable: {store.one_line(exc)}")
        except SystemdUnavailable as exc:
            self.systemd.close()
            self.watcher.close()
            self._trouble(str(exc))
        return False

    # -- the loop ---------------------------------------------------------------------------------

    def _iteration(self) -> None:
        assert self.conn is not None and self.listen_conn is not None
        now = time.monotonic()
        timeout = self.timers.nearest(now, cap=self.settings.daemon.poll_interval)
        readable, _, _ = _select([self.listen_conn.fileno(), self.watcher.fileno(), self.wakeup_r], timeout)
        if self.wakeup_r in readable:
            _drain_pipe(self.wakeup_r)
            if self.stopping:
                return
        wake_claim, wake_cancel = self._drain_notifications() if readable else (False, False)
        changed, reloaded = self.watcher.drain()
        if reloaded:
            event("systemd-reloaded", host=self.host_id)
        now = time.monotonic()
        settled_before = self.reconciler.settled
        if changed:
            self._reconcile_attempts(store.open_attempts(self.conn, self.host_id, unit_names=sorted(changed)))
        # A settled run frees a slot: claim again now rather than at the next poll, or a backlog
        # larger than max_runs drains one batch per poll interval.
        wake_claim = wake_claim or self.reconciler.settled > settled_before
        if now >= self.timers.claim:
            probe = store.probe(self.conn, self.host_id)
            self.host_state = probe.host_state or self.host_state
            wake_claim, wake_cancel = wake_claim or probe.claimable, wake_cancel or probe.cancels
            self.timers.claim = now + self.settings.daemon.poll_interval
        if wake_cancel:
            self._reconcile_attempts(store.open_attempts(self.conn, self.host_id, cancel_requested=True))
        if wake_claim:
            self._claim_and_spawn()
        if now >= self.timers.reconcile or reloaded:
            self._reconcile()
        self._feed_watchdog()
        self._status()

    def _reconcile(self) -> None:
        self.reconciler.reconcile_pass()
        self.timers.reconcile = time.monotonic() + self.settings.daemon.reconcile_interval

    def _reconcile_attempts(self, pairs: list[tuple[Run, Attempt]]) -> None:
        for run, attempt in pairs:
            self.reconciler.isolated(run, attempt, lambda r=run, a=attempt: self.reconciler.reconcile_one(r, a))

    def _drain_notifications(self) -> tuple[bool, bool]:
        """Read queued NOTIFYs without blocking. They are hints: what they say is re-read from the
        tables, and the fallback poll covers any that were lost."""
        assert self.listen_conn is not None
        pgconn = self.listen_conn.pgconn
        pgconn.consume_input()
        claim = cancel = False
        while (note := pgconn.notifies()) is not None:
            channel = note.relname.decode()
            claim = claim or channel == store.SPAWN_CHANNEL
            cancel = cancel or channel == store.CANCEL_CHANNEL
        return claim, cancel

    def _feed_watchdog(self) -> None:
        now = time.monotonic()
        if self.watchdog_interval and now >= self.timers.watchdog:
            self.notifier.notify("WATCHDOG=1")
            self.timers.watchdog = now + self.watchdog_interval
        elif not self.watchdog_interval:
            self.timers.watchdog = now + 3600

    def _status(self) -> None:
        r = self.reconciler
        text = f"runs in flight: {r.in_flight if r else 0}, claimed: {self.claimed}, settled: {r.settled if r else 0}"
        if self.host_state == "draining":
            text += "; draining"
        if self.problem:
            text = f"{self.problem}; retrying. {text}"
        self.notifier.notify(f"STATUS={text}")

    # -- work -------------------------------------------------------------------------------------

    def _claim_and_spawn(self) -> None:
        assert self.conn is not None
        if self.host_state != "active" or self.stopping:
            return
        daemon = self.settings.daemon
        while not self.stopping:
            claimed = store.claim(self.conn, self.host_id, daemon.claim_batch, self.settings.host.max_runs,
                                  self.settings.host.memory_budget, unitspec.UNIT_NAME_FORMAT)
            if not claimed:
                return
            self.claimed += len(claimed)
            self.reconciler.in_flight += len(claimed)
            for run, attempt in claimed:
                event("claimed", run=run.id, attempt=attempt.attempt, unit=attempt.unit_name)
            faults.point("after-claim")
            for run, attempt in claimed:
                self.reconciler.isolated(run, attempt, lambda r=run, a=attempt: self.reconciler.start(r, a))
            if len(claimed) < daemon.claim_batch:
                return


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
