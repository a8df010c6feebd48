"""A timeout the daemon's loop cannot enforce on itself, kept by one small thread beside it.

The loop is single-threaded and every call in it is synchronous. A database reached through a
network that silently drops packets (a black hole: a dead NAT entry, a partition behind a proxy)
never answers and never errors: the loop would wait in one psycopg call for ever, and the deadlines
it keeps could not fire. So:

- **Stall breaker.** A database call that has waited longer than `stall_after` (well beyond the
  server's statement_timeout, so only a silent network trips it) gets its socket shut down: the call
  fails as a lost connection, and the loop reconnects. TCP keepalives alone do not catch a peer that
  still acknowledges, such as a proxy.
- (0.5.x also kept a dead man's switch here: the cut-off stop of `stop_runs_when_cut_off`. It moved
  to unitvisor-fence.service, supervisor/fence.py, which outlives this process: a switch inside the
  daemon could not stop runs while the daemon was stopped, crash-looping or never registered. This
  thread still records when the heartbeat was last renewed, for the daemon's own batch starts.)

The thread shares two floats with the loop, and takes a lock only around closing or shutting
down a connection, so that it never shuts down a socket number that was closed and reused.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import psycopg

from supervisor.log import event

CHECK_EVERY = 0.5


class GuardedConnection(psycopg.Connection):
    """A psycopg connection that tells its guard when it waits on the server, and for how long.

    `wait()` is the one method every blocking operation of a psycopg 3 connection goes through, in
    3.1 (Debian bookworm) and in the newest release alike."""

    guard: Guard | None = None

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        guard = self.guard
        if guard is None:
            return super().wait(*args, **kwargs)
        guard.busy(self)
        try:
            return super().wait(*args, **kwargs)
        finally:
            guard.idle(self)


class Guard:
    def __init__(self, stall_after: float) -> None:
        self.stall_after = stall_after
        self._lock = threading.Lock()
        self._busy: GuardedConnection | None = None
        self._busy_since = 0.0
        self._renewed_at: float | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- the loop's side ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="unitvisor-guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * CHECK_EVERY)

    def renewed(self, sent_at: float) -> None:
        """The heartbeat sent at monotonic time `sent_at` was committed. Measured from before it was
        sent: the database stamped it later, so the cut-off deadline errs on the early side."""
        self._renewed_at = sent_at
        self.cut_off = False

    @property
    def renewed_at(self) -> float | None:
        """Monotonic send time of the last heartbeat committed, None before the first."""
        return self._renewed_at

    def renewed_within(self, seconds: float, now: float) -> bool:
        """Whether the heartbeat was last renewed (sent, then committed) less than `seconds` before
        monotonic `now`."""
        renewed = self._renewed_at
        return renewed is not None and now - renewed < seconds

    def busy(self, conn: GuardedConnection) -> None:
        self._busy_since = time.monotonic()
        self._busy = conn

    def idle(self, conn: GuardedConnection) -> None:
        self._busy = None

    def closing(self) -> threading.Lock:
        """Hold this while closing a guarded connection."""
        return self._lock

    # -- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.wait(CHECK_EVERY):
            try:
                self.check(time.monotonic())
            except Exception as exc:  # the guard must outlive any one failure of its own
                event("guard-error", level=logging.ERROR, detail=f"{type(exc).__name__}: {exc}")

    def check(self, now: float) -> None:
        """One round of the stall breaker (the thread calls it every CHECK_EVERY seconds)."""
        with self._lock:
            conn = self._busy
            if conn is not None and now - self._busy_since > self.stall_after and not conn.closed:
                event("database-stalled", level=logging.ERROR,
                      detail=f"no answer from the database for {now - self._busy_since:.0f}s; dropping the "
                             "connection to reconnect")
                _shutdown(conn)
                self._busy = None


def _shutdown(conn: psycopg.Connection) -> None:
    """Wake whoever waits on this connection's socket, with an error, without closing the descriptor
    under psycopg's feet (it closes it itself, and the number stays ours until then)."""
    try:
        sock = socket.socket(fileno=conn.pgconn.socket)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()
