"""The heartbeat that the daemon's own work cannot starve (issue 23).

The loop's probe is the heartbeat (one statement a poll interval, on the loop's one connection, that
also asks whether there is work). But the loop does everything in turn: a claim, a reconcile pass or
the fleet upkeep on a database slowed by a burst can each take up to the statement_timeout, and
several in a row kept a live host from heartbeating for longer than its host_dead_after: its peers
declared it dead and ran its runs again (95 hosts in issue 23's burst).

So a small thread watches when the heartbeat was last renewed. Once the loop is late with it (more
than LATE_POLLS poll intervals since the last one was sent), the thread sends the heartbeat alone
(unitvisor.renew_heartbeat: the same row, the same epoch check) on a connection of its own, opened
then and closed once the loop has kept time again for a while. An idle or merely busy fleet therefore
still costs one session per host; only a host whose loop is behind holds a second one, for as long as
it is behind.

What it does not do: keep a wedged daemon alive. It sends only while the loop has shown progress
(fed its watchdog) within half the host's host_dead_after; a loop stuck for longer is not a live host,
and is left to be declared dead (and to systemd's watchdog).

Fencing is as before (docs/fleet.md): a heartbeat renews the lease from its send time, whichever
connection carried it, and a host whose epoch is over renews nothing (the loop's next statement finds
it fenced and registers again).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from supervisor import fence as fence_lease
from supervisor import store
from supervisor.log import event

CHECK_EVERY = 0.5
# The loop is late once its last heartbeat was sent this many poll intervals ago: a healthy loop
# sends one every poll interval, and peers wait host_dead_after (at least 3) before declaring.
LATE_POLLS = 1.5
# The thread's connection is closed once the loop has kept time for this many poll intervals.
CLOSE_AFTER_POLLS = 6
# After a failed send, the next waits 1 s, then twice as long each time, at most half a poll interval,
# each pause a random part of that (from half to all of it). Checking every CHECK_EVERY, a host that
# cannot connect (a server refusing sessions at max_connections answers at once) tried twice a second:
# a fleet of them reconnecting at once is the storm that keeps the server from answering (bench.scale's
# 1,000 hosts, 0.11.0). Half a poll interval still leaves several tries within host_dead_after.
RETRY_FIRST = 1.0
RETRY_MAX_POLLS = 0.5


@dataclass
class Loop:
    """What the thread reads of the daemon's loop, each a callable so that it reads the current value."""

    fence: Callable[[], store.Fence | None]  # None while not registered: nothing to renew
    dsn: Callable[[], str]
    renewed_at: Callable[[], float | None]  # monotonic send time of the last committed heartbeat
    alive_at: Callable[[], float]  # monotonic time the loop last showed progress
    renewed: Callable[[float, float], bool]  # a heartbeat sent at (monotonic, boottime) committed


class AsideHeartbeat:
    def __init__(self, loop: Loop, poll_interval: float, dead_after: float,
                 on_sent: Callable[[], None] = lambda: None) -> None:
        self.loop = loop
        self.late_after = LATE_POLLS * poll_interval
        self.close_after = CLOSE_AFTER_POLLS * poll_interval
        self.retry_max = RETRY_MAX_POLLS * poll_interval
        self.alive_within = dead_after / 2
        self.on_sent = on_sent
        self.conn: psycopg.Connection | None = None
        self.last_sent = 0.0
        self.error = ""
        self.failures = 0
        self.retry_at = 0.0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="unitvisor-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * CHECK_EVERY)
        self._close()

    def _run(self) -> None:
        while not self._stopping.wait(CHECK_EVERY):
            try:
                self.check(time.monotonic())
            except Exception as exc:  # the thread must outlive any one failure of its own
                event("heartbeat-aside-error", level=logging.ERROR, detail=f"{type(exc).__name__}: {exc}")

    def due(self, now: float) -> bool:
        """Whether the loop is late with its heartbeat and still alive, so that this thread sends it."""
        renewed = self.loop.renewed_at()
        return (renewed is not None and now - renewed > self.late_after
                and now - self.loop.alive_at() < self.alive_within)

    def check(self, now: float) -> bool:
        """One round: send the heartbeat if it is due; close the connection once the loop kept time.
        Returns whether a heartbeat was sent and committed."""
        fence = self.loop.fence()
        if fence is None or not self.due(now):
            if self.conn is not None and now - self.last_sent > self.close_after:
                self._close()
            return False
        if now < self.retry_at:
            return False
        late_by = now - (self.loop.renewed_at() or now)  # read now: the loop may send its own meanwhile
        began = time.monotonic()
        try:
            if self.conn is None:
                self.conn = store.connect(self.loop.dsn())
            sent, sent_boot = time.monotonic(), fence_lease.boottime()
            state = store.renew_heartbeat(self.conn, fence)
        except (store.DatabaseError, psycopg.Error) as exc:
            self._close()
            if str(exc) != self.error:
                event("heartbeat-aside-failed", level=logging.WARNING, host=fence.host_id, detail=store.one_line(exc))
            self.error = str(exc)
            pause = min(self.retry_max, RETRY_FIRST * 2 ** self.failures) * random.uniform(0.5, 1.0)
            self.failures += 1
            self.retry_at = now + (time.monotonic() - began) + pause
            return False
        self.error, self.failures, self.retry_at = "", 0, 0.0
        if now - self.last_sent > self.close_after:  # the first of a late spell: said once, not each time
            event("heartbeat-aside", level=logging.WARNING, host=fence.host_id,
                  detail=f"the loop's last heartbeat was sent {late_by:.0f}s ago; "
                         "sending it on a connection of its own while the loop is busy")
        self.last_sent = now
        if state is None:  # the epoch is over: the loop finds out and registers again
            return False
        if self.loop.renewed(sent, sent_boot):
            self.on_sent()
        return True

    def _close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg.Error:
                pass
            self.conn = None
