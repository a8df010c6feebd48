"""The one module that talks to systemd (PID 1) over D-Bus, through pystemd.

Every method is a thin, synchronous call on one long-lived connection; D-Bus errors are mapped to the
few exceptions below so that no caller ever sees pystemd's types. State changes arrive on a second
connection (`Watcher`) that only receives signals, so that the main loop can `select()` on its file
descriptor: pystemd holds the GIL during calls, and a signal queued behind a method reply on a shared
connection would be invisible to `select()`. The signals of our units carry their state, which the
loop decides on without reading it back (`Watcher`, `Systemd.state`).

Methods are called with `call_method` and explicit signatures rather than through pystemd's
introspected objects: that costs no introspection round trip per object (pystemd 0.11 re-introspects
on every load) and behaves the same on pystemd 0.11 (Debian bookworm) and the newest release.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pystemd.dbusexc import DBusBaseError, DBusNoSuchUnitError, DBusUnknownPropertyError
from pystemd.dbuslib import DBus, apply_signature, path_decode, path_encode
from pystemd.systemd1 import unit_signatures

from supervisor.model import Accounting

DEST = b"org.freedesktop.systemd1"
MANAGER_PATH = b"/org/freedesktop/systemd1"
MANAGER_IFACE = b"org.freedesktop.systemd1.Manager"
PROPS_IFACE = b"org.freedesktop.DBus.Properties"
UNIT_IFACE = b"org.freedesktop.systemd1.Unit"
SERVICE_IFACE = b"org.freedesktop.systemd1.Service"
UNIT_PATH_PREFIX = b"/org/freedesktop/systemd1/unit"

# Properties that pystemd (0.11 up to 0.15) cannot marshal because it does not know their D-Bus
# signature; registered once so that the unit spec can be a plain dict. Signatures are systemd's own
# (org.freedesktop.systemd1(5)).
_EXTRA_SIGNATURES = {
    b"ExecStartEx": b"a(sasas)",
    b"ExecConditionEx": b"a(sasas)",  # the lease checked at a run's start (unitspec.start_condition)
    b"ExecStopPostEx": b"a(sasas)",
    b"LogExtraFields": b"aay",
    b"IOWeight": b"t",
    b"OOMPolicy": b"s",
    # The run sandbox (unitspec._sandbox); checked against systemd 252's dbus-execute.c and a live PID 1.
    b"CapabilityBoundingSet": b"t",
    b"ProtectProc": b"s",
    b"ProcSubset": b"s",
    b"ProtectKernelLogs": b"b",
    b"ProtectClock": b"b",
    b"ProtectHostname": b"b",
    b"RestrictNamespaces": b"t",
    b"RestrictSUIDSGID": b"b",
    b"SystemCallErrorNumber": b"i",
    b"RestrictAddressFamilies": b"(bas)",
    b"UMask": b"u",
    # Not a unit setting: asks PID 1 to hold a reference on the new unit for the calling connection
    # (systemd >= 236), so that it stays loaded after it ends (Systemd.start_transient).
    b"AddRef": b"b",
}
unit_signatures.KNOWN_UNIT_SIGNATURES.update(_EXTRA_SIGNATURES)

# errno values that mean "the connection is gone", as opposed to "PID 1 said no".
_CONNECTION_ERRNOS = {
    errno.ENOTCONN, errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE, errno.ENOENT,
    errno.ETIMEDOUT, errno.ESHUTDOWN,
}


class SystemdError(Exception):
    """PID 1 refused or failed a request (the message says why, in systemd's words)."""


class SystemdUnavailable(SystemdError):
    """The bus is not reachable or the connection broke: reconnect and reconcile."""


class UnitRefused(SystemdError):
    """systemd refused to create the unit as specified (bad property, bad value)."""


@dataclass(frozen=True)
class UnitState:
    """What systemd says about one loaded service unit; only the fields the supervisor decides on."""

    name: str
    active_state: str
    sub_state: str
    result: str
    exec_main_code: int
    exec_main_status: int
    invocation_id: str
    job_pending: bool
    # systemd's own clock (CLOCK_REALTIME, microseconds since the epoch; 0: never happened): when the
    # main process was forked, when it was reaped, and when the unit last became active (for Type=exec:
    # once execve() of the command succeeded).
    exec_main_start_usec: int = 0
    exec_main_exit_usec: int = 0
    active_enter_usec: int = 0
    # What systemd measured of the unit, read with its state, so that an outcome records it before
    # the unit is released (which discards it).
    accounting: Accounting = field(default_factory=Accounting)

    @property
    def started_at(self) -> datetime | None:
        return from_usec(self.exec_main_start_usec)

    @property
    def ended_at(self) -> datetime | None:
        return from_usec(self.exec_main_exit_usec)

    @property
    def has_ended(self) -> bool:
        """True once the main process is gone for good and the result is final.

        A clean exit leaves the unit `inactive/dead`, a failure `failed`; the unit stays loaded that
        way while a bus client (the daemon: AddRef, Ref) holds a reference on it. A unit started by
        unitvisor 0.3.0 (RemainAfterExit=yes) shows a clean exit as `active/exited` instead, which
        is still recognised, so that an upgraded daemon settles those too. A queued job (start or
        stop) means the state is still moving.
        """
        if self.job_pending:
            return False
        return self.active_state in ("failed", "inactive") or (
            self.active_state == "active" and self.sub_state == "exited"
        )


@dataclass(frozen=True)
class UnitBrief:
    """A loaded unit as ListUnitsByPatterns shows it."""

    active_state: str
    sub_state: str
    job_pending: bool

    @property
    def plainly_running(self) -> bool:
        return self.active_state == "active" and self.sub_state == "running" and not self.job_pending

    @property
    def process_running(self) -> bool:
        """Its process may still run: not ended (a 0.3.0 unit, RemainAfterExit=yes, that exited is
        `active/exited`)."""
        return self.active_state in ("active", "activating", "deactivating", "reloading") and self.sub_state != "exited"


def from_usec(usec: int) -> datetime | None:
    """A systemd timestamp (microseconds since the epoch, 0 or UINT64_MAX when unset) as a datetime."""
    if usec <= 0 or usec >= 2**63:
        return None
    return datetime.fromtimestamp(usec // 1_000_000, UTC).replace(microsecond=usec % 1_000_000)


# The unit properties an outcome records (org.freedesktop.systemd1(5)). CPU and IO counters are kept
# by systemd after the unit's cgroup is gone (cached when it is removed); MemoryPeak exists from
# systemd 256 on. MemoryCurrent and TasksCurrent are not recorded: they are live counts, which are
# gone (UINT64_MAX) with the processes by the time an outcome is read.
_ACCOUNTING_PROPERTIES = {
    "cpu_usage_nsec": b"CPUUsageNSec",
    "memory_peak_bytes": b"MemoryPeak",
    "io_read_bytes": b"IOReadBytes",
    "io_write_bytes": b"IOWriteBytes",
}


def accounting_from_properties(props: dict[bytes, Any]) -> Accounting:
    """Pure: a unit's accounting properties as values, None where systemd has none. systemd says
    "unavailable" with UINT64_MAX (no such controller, accounting off, a cgroup v1 controller it may
    not use); a property this systemd does not know is absent. Anything from 2^63 up is treated the
    same: no real counter gets there, and the database column is a signed bigint."""
    values: dict[str, int | None] = {}
    for key, prop in _ACCOUNTING_PROPERTIES.items():
        raw = props.get(prop)
        values[key] = int(raw) if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 2**63 else None
    return Accounting(**values)


# What no signal carries (systemd sends no PropertiesChanged for its counters): an ended unit's
# accounting, read with a `Get` each also when its signals said the rest (Systemd.state).
_ACCOUNTING_READS = tuple((SERVICE_IFACE, prop) for prop in _ACCOUNTING_PROPERTIES.values())

# What `Systemd.state` reads of a unit, one `Get` each, in this order. Not `GetAll`: that marshals all
# of a unit's ~400 properties, of which UnitState uses these (in the test bed, 0.8-1.2 ms of the
# caller's CPU a `GetAll`, 0.4 ms these 14 `Get`s; one `GetAll` each of the Unit and Service
# interfaces costs as much as `GetAll("")`: docs/benchmarks.md). Several `Get`s are not one
# snapshot, so the unit's state comes first: `has_ended` decides on `Job`, `ActiveState` and
# `SubState` alone, and once they say "ended", the unit does not change again (no Restart=, one
# invocation per unit name), so what is read after them is that ended invocation's. If the unit
# moves between two reads instead, the values may mix two moments of a unit that was still running,
# which decides nothing final, and the move itself sends a PropertiesChanged signal: the unit is read
# again.
_STATE_PROPERTIES = (
    (UNIT_IFACE, b"Job"),
    (UNIT_IFACE, b"ActiveState"),
    (UNIT_IFACE, b"SubState"),
    (UNIT_IFACE, b"InvocationID"),
    (UNIT_IFACE, b"ActiveEnterTimestamp"),
    (SERVICE_IFACE, b"Result"),
    (SERVICE_IFACE, b"ExecMainCode"),
    (SERVICE_IFACE, b"ExecMainStatus"),
    (SERVICE_IFACE, b"ExecMainStartTimestamp"),
    (SERVICE_IFACE, b"ExecMainExitTimestamp"),
    *_ACCOUNTING_READS,
)


def unit_state(name: str, props: dict[bytes, Any]) -> UnitState:
    """Pure: a unit's state from its properties as D-Bus gives them (a `Get` each, or a signal's
    payload), defaults where one is absent."""
    job = props.get(b"Job") or (0, b"/")
    invocation = props.get(b"InvocationID") or []
    return UnitState(
        name=name,
        active_state=_text(props.get(b"ActiveState", b"")),
        sub_state=_text(props.get(b"SubState", b"")),
        result=_text(props.get(b"Result", b"")),
        exec_main_code=int(props.get(b"ExecMainCode", 0)),
        exec_main_status=int(props.get(b"ExecMainStatus", 0)),
        invocation_id=bytes(invocation).hex(),
        job_pending=int(job[0]) != 0,
        exec_main_start_usec=int(props.get(b"ExecMainStartTimestamp", 0)),
        exec_main_exit_usec=int(props.get(b"ExecMainExitTimestamp", 0)),
        active_enter_usec=int(props.get(b"ActiveEnterTimestamp", 0)),
        accounting=accounting_from_properties(props),
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _error_text(exc: DBusBaseError) -> str:
    message = exc.err_message
    return _text(message) if message else str(exc)


def _map_error(exc: DBusBaseError, what: str) -> SystemdError:
    code = abs(exc.errno) if isinstance(exc.errno, int) else 0
    # PID 1's own answers (NoSuchUnit is ENOENT too) are refusals, not a broken connection. An error
    # that sd-bus named after an errno (System.Error.ENOTCONN, after the peer hung up) is no answer.
    name = _text(exc.err_name or b"")
    answered = isinstance(exc, DBusNoSuchUnitError) or (bool(name) and not name.startswith("System.Error."))
    if code in _CONNECTION_ERRNOS and not answered:
        return SystemdUnavailable(f"{what}: systemd is not reachable over D-Bus ({_error_text(exc)})")
    return SystemdError(f"{what}: {_error_text(exc)}")


def _is_unit_exists(exc: DBusBaseError) -> bool:
    return exc.errno == -errno.EEXIST or _text(exc.err_name or b"").endswith(".UnitExists")


def _is_unknown_property(exc: BaseException | None) -> bool:
    """A `Get` of a property this systemd does not have (MemoryPeak before systemd 256)."""
    return isinstance(exc, DBusUnknownPropertyError)


def _is_gone(exc: BaseException | None) -> bool:
    """A call on a unit's object that found no such object: the unit was unloaded (sd-bus maps
    UnknownObject to ENXIO)."""
    if isinstance(exc, DBusNoSuchUnitError):
        return True
    return isinstance(exc, DBusBaseError) and (
        exc.errno == -errno.ENXIO or _text(exc.err_name or b"").endswith(".UnknownObject"))


def _open_bus() -> DBus:
    bus = DBus()
    try:
        bus.open()
    except DBusBaseError as exc:
        raise _map_error(exc, "connecting to the system bus") from exc
    return bus


# How many units one connection holds a reference on, at most. Chosen, not inherited (systemd sets no
# such bound): PID 1 tracks each holder of each unit on the system bus with match rules of its own
# connection, and dbus-daemon allows a connection 512 of them (max_match_rules_per_connection, the
# default in Debian's system.conf), for all clients together. Measured in the test bed (systemd 252,
# dbus 1.14): a connection starting units with AddRef got "Message recipient disconnected from message
# bus without replying" at its 506th held unit, and at its 256th while it also had 256 start jobs queued
# (consistent with queued jobs being tracked the same way; bench/inside.py queues no more than that for
# this reason): PID 1 had been thrown off the bus, which breaks every client of PID 1 on the host, not
# only this daemon. 100 leaves PID 1 most of its rules for the daemon's queued start jobs (claim_batch),
# itself and other clients. Past it a new unit is started as 0.3.0 started every unit
# (RemainAfterExit=yes, no AddRef: kept loaded by itself, released with a stop job), and a unit adopted
# is read but not held (a clean end of it is collected at once and proven from the journal, as after a
# restart). Raising it towards 256 would put PID 1's bus connection at risk again.
MAX_HELD_UNITS = 100


class _Connection:
    """One bus connection, opened on demand and dropped on any connection error."""

    def __init__(self) -> None:
        self._bus: DBus | None = None
        # Units this connection holds a reference on (AddRef at creation, or Ref). PID 1 drops them
        # all when the connection closes, so they are forgotten with it.
        self._refs: set[str] = set()

    @property
    def connected(self) -> bool:
        return self._bus is not None

    def close(self) -> None:
        if self._bus is not None:
            try:
                self._bus.close()
            except DBusBaseError:
                pass
            self._bus = None
        self._refs.clear()


class Systemd(_Connection):
    """Method calls to PID 1 on one connection. Not thread-safe; one per process.

    `max_held`: how many units this connection may hold (MAX_HELD_UNITS). 0 for a connection that
    does not outlive a command (`unitvisor reconcile` by hand): PID 1 drops its references when it
    closes, so a unit it started would be collected the moment it ends, while the daemon may not hold
    it yet, and only the journal (which may lag behind) would be left to say how it ended. Its units
    are RemainAfterExit=yes instead, kept loaded until the daemon settles and releases them.
    """

    def __init__(self, max_held: int = MAX_HELD_UNITS) -> None:
        super().__init__()
        self._max_held = max_held
        # Properties this systemd answered UnknownProperty for (MemoryPeak before 256): not asked for
        # again on this connection, a round trip saved on every outcome. Forgotten on a new connection,
        # which an upgraded PID 1 (daemon-reexec) may have added them by.
        self._unknown: set[bytes] = set()

    def connect(self) -> None:
        self.close()
        self._unknown.clear()
        self._bus = _open_bus()

    def _call(self, path: bytes, iface: bytes, method: bytes, args: list, what: str) -> Any:
        if self._bus is None:
            self.connect()
        assert self._bus is not None
        try:
            return self._bus.call_method(DEST, path, iface, method, args).body
        except DBusBaseError as exc:
            mapped = _map_error(exc, what)
            if isinstance(mapped, SystemdUnavailable):
                self.close()
            raise mapped from exc

    def start_transient(self, name: str, properties: dict[bytes, Any]) -> bool:
        """Start a transient service; return False when a unit of that name is already loaded.

        An existing name is adoption, never an error and never a second run: the name is derived
        from (run, attempt), so if it exists it is this attempt's unit. With `AddRef` in the
        properties, PID 1 holds a reference on the new unit for this connection (see `ref`), unless
        the connection holds MAX_HELD_UNITS already: then the unit is RemainAfterExit=yes instead.
        """
        if properties.get(b"AddRef") and len(self._refs) >= self._max_held:
            properties = {**{k: v for k, v in properties.items() if k != b"AddRef"}, b"RemainAfterExit": True}
        args = apply_signature(b"ss", [name.encode(), b"fail"])
        args += unit_signatures.signature_array(properties)
        args += [(ord(b"a"), b"(sa(sv))"), (-1, None)]
        try:
            self._call(MANAGER_PATH, MANAGER_IFACE, b"StartTransientUnit", args, f"starting {name}")
        except SystemdError as exc:
            cause = exc.__cause__
            if isinstance(cause, DBusBaseError) and _is_unit_exists(cause):
                return False
            if isinstance(exc, SystemdUnavailable):
                raise
            raise UnitRefused(str(exc)) from cause
        if properties.get(b"AddRef"):
            self._refs.add(name)
        return True

    def state(self, name: str, signalled: UnitState | None = None) -> UnitState | None:
        """The unit's state, or None when no unit of that name is loaded.

        `signalled`: its state as its last signals said (Watcher.signalled). A unit they say is not over
        is taken as they say, without a call. An ended one needs what no signal carries, its accounting,
        read at the unit's path (which its name gives: no GetUnit), and nothing else: an ended unit does
        not change again (_STATE_PROPERTIES). Its accounting unread (the unit collected since, PID 1
        saying no) is unknown, not a reason to lose the outcome its signals said."""
        if signalled is not None:
            if not signalled.has_ended:
                return signalled
            path = path_encode(UNIT_PATH_PREFIX, name.encode())
            try:
                counters = self._get(path, name, _ACCOUNTING_READS)
            except SystemdUnavailable:
                raise
            except SystemdError:
                counters = {}
            return replace(signalled, accounting=accounting_from_properties(counters))
        try:
            path = self._call(MANAGER_PATH, MANAGER_IFACE, b"GetUnit",
                              apply_signature(b"s", [name.encode()]), f"looking up {name}")
        except SystemdError as exc:
            if isinstance(exc.__cause__, DBusNoSuchUnitError):
                return None
            raise
        return unit_state(name, self._get(path, name, _STATE_PROPERTIES))

    def _get(self, path: bytes, name: str, reads: tuple[tuple[bytes, bytes], ...]) -> dict[bytes, Any]:
        """Properties of one unit, a `Get` each; one this systemd does not know is left out (as GetAll
        leaves it out: None for accounting, a default for the rest) and not asked for again."""
        props: dict[bytes, Any] = {}
        for iface, prop in reads:
            if prop in self._unknown:
                continue
            try:
                props[prop] = self._call(path, PROPS_IFACE, b"Get", apply_signature(b"ss", [iface, prop]),
                                         f"reading {name}")
            except SystemdError as exc:
                if not _is_unknown_property(exc.__cause__):
                    raise
                self._unknown.add(prop)
        return props

    def load_state(self, name: str) -> str:
        """`loaded`, `not-found`, `masked`...: whether systemd has a unit file (or a builtin) for it."""
        path = self._call(MANAGER_PATH, MANAGER_IFACE, b"LoadUnit", apply_signature(b"s", [name.encode()]),
                          f"loading {name}")
        props = self._call(path, PROPS_IFACE, b"GetAll", apply_signature(b"s", [b"org.freedesktop.systemd1.Unit"]),
                           f"reading {name}")
        return _text(props.get(b"LoadState", b""))

    def main_pid(self, name: str) -> int:
        """The main process of a loaded service, 0 when it has none (or the unit is not loaded)."""
        try:
            path = self._call(MANAGER_PATH, MANAGER_IFACE, b"GetUnit", apply_signature(b"s", [name.encode()]),
                              f"looking up {name}")
        except SystemdError as exc:
            if isinstance(exc.__cause__, DBusNoSuchUnitError):
                return 0
            raise
        props = self._call(path, PROPS_IFACE, b"GetAll", apply_signature(b"s", [b"org.freedesktop.systemd1.Service"]),
                           f"reading {name}")
        return int(props.get(b"MainPID", 0))

    def list_units(self, pattern: str) -> dict[str, UnitBrief]:
        """The loaded units matching a glob, in one call: enough to tell a unit that is simply
        running from one whose state needs a full read."""
        args = apply_signature(b"asas", [[], [pattern.encode()]])
        rows = self._call(MANAGER_PATH, MANAGER_IFACE, b"ListUnitsByPatterns", args,
                          f"listing {pattern}")
        # (name, description, load state, active state, sub state, following, path, job id, ...)
        return {_text(row[0]): UnitBrief(_text(row[3]), _text(row[4]), int(row[7]) != 0) for row in rows}

    def _unit_call(self, method: bytes, signature: bytes, values: list, name: str) -> bool:
        """A call on one unit by name; False when the unit is not loaded (nothing to do)."""
        try:
            self._call(MANAGER_PATH, MANAGER_IFACE, method, apply_signature(signature, values),
                       f"{method.decode()} {name}")
        except SystemdError as exc:
            if isinstance(exc.__cause__, DBusNoSuchUnitError):
                return False
            raise
        return True

    def stop(self, name: str) -> bool:
        return self._unit_call(b"StopUnit", b"ss", [name.encode(), b"replace"], name)

    def kill(self, name: str, whom: str, signum: int) -> bool:
        """Send a signal to a unit's processes (KillUnit: `whom` is "main" or "all"); False when the unit
        is not loaded. The run's warning (stopsignals.py): it neither stops the unit nor changes its state."""
        return self._unit_call(b"KillUnit", b"ssi", [name.encode(), whom.encode(), signum], name)

    def reset_failed(self, name: str) -> bool:
        return self._unit_call(b"ResetFailedUnit", b"s", [name.encode()], name)

    def freeze(self, name: str) -> bool:
        """Freeze a unit's processes where they are (the cgroup v2 freezer: FreezeUnit, systemd 246 and
        later); PID 1 answers once they are frozen. False when the unit is not loaded. A host that cannot
        freeze (cgroup v1) raises SystemdError with PID 1's own words ("not supported")."""
        return self._unit_call(b"FreezeUnit", b"s", [name.encode()], name)

    def thaw(self, name: str) -> bool:
        """Let a frozen unit's processes run on (ThawUnit); as freeze."""
        return self._unit_call(b"ThawUnit", b"s", [name.encode()], name)

    def ref(self, name: str) -> bool:
        """Hold a reference on a loaded unit for this connection (once: PID 1 counts each Ref), so
        that it stays loaded after it ends, `inactive` or `failed` with its Result, exit status,
        timestamps and accounting readable, until `release` (or until this connection closes: PID 1
        then drops the reference and collects an ended unit). For a unit this daemon adopted rather
        than created (created ones get AddRef). False when the unit is not loaded (it ended and was
        collected already: the journal is what is left). True without a reference when the
        connection holds MAX_HELD_UNITS already: the unit is loaded now, and if it ends cleanly it is
        collected and its outcome proven from the journal."""
        if name in self._refs:
            return True
        # Ref() on the unit's own object, not the manager's RefUnit: that one loads a unit that is not
        # loaded, and refuses one whose load state is not `loaded`, which a transient unit of ours is
        # not after a daemon-reload (systemd 252 cannot read back the ExecStartEx= it wrote to the
        # transient file: `bad-setting`, though the unit and its state are still there).
        try:
            path = self._call(MANAGER_PATH, MANAGER_IFACE, b"GetUnit", apply_signature(b"s", [name.encode()]),
                              f"looking up {name}")
        except SystemdError as exc:
            if isinstance(exc.__cause__, DBusNoSuchUnitError):
                return False
            raise
        if len(self._refs) >= self._max_held:
            return True
        try:
            self._call(path, UNIT_IFACE, b"Ref", [], f"Ref {name}")
        except SystemdError as exc:
            if _is_gone(exc.__cause__):  # unloaded between the two calls
                return False
            raise
        self._refs.add(name)
        return True

    def unref(self, name: str) -> bool:
        """Drop this connection's reference on a unit, if it holds one. A refusal (the unit is not
        loaded, or PID 1 says it is not referenced) is nothing to do: at worst a reference is left
        that PID 1 drops with this connection."""
        if name not in self._refs:
            return False
        self._refs.discard(name)
        try:
            return self._unit_call(b"UnrefUnit", b"s", [name.encode()], name)
        except SystemdUnavailable:
            raise
        except SystemdError:
            return False

    def release(self, name: str, active_state: str | None = None) -> None:
        """Let PID 1 unload a finished unit whose outcome is recorded, so that none piles up.

        `active_state` is the state it was settled in. `inactive` (a clean exit): dropping the
        reference is all; `failed`: reset-failed too (PID 1 keeps a failed unit until then). `active`
        (a unit of 0.3.0, RemainAfterExit=yes, `exited`) or unknown (None): a stop job first, as
        0.3.0 released every unit."""
        if active_state not in ("inactive", "failed"):
            self.stop(name)
        if active_state != "inactive":
            self.reset_failed(name)
        self.unref(name)


# What a unit's PropertiesChanged signals must carry for its state to be taken from them: every
# property of _STATE_PROPERTIES but the counters, by interface.
_SIGNALLED = {iface: frozenset(prop for i, prop in _STATE_PROPERTIES
                               if i == iface and (i, prop) not in _ACCOUNTING_READS)
              for iface in (UNIT_IFACE, SERVICE_IFACE)}


class Watcher(_Connection):
    """A receive-only connection: systemd's signals about units, as a set of changed unit names, and
    for each the state its signals said when they say all of it (`signalled`).

    PID 1 sends a unit's change as two PropertiesChanged signals back to back, its Service interface's
    then its Unit interface's, each with the current value of every property of the interface that
    emits changes (seen with systemd 252 in the test bed, tests/system/test_signalled_state.py; no
    counters). A Unit signal that comes right after its Service signal is one moment of the unit, all
    that UnitState says but its accounting: the loop decides on it without reading the unit again (issue
    27: reading back every changed unit, GetUnit and 14 `Get`s, was a fifth of the loop's time, in PID
    1's queue behind the starts). A Unit signal without its Service signal just before (one dropped by
    a broker, or the pair split by a reconnect) says nothing of the unit's state: the name alone is
    noted, and the unit is read in full, as every changed unit was before. A dropped Unit signal is
    what it was before: a change the next reconcile pass finds.
    """

    _RULES = (
        b"type='signal',sender='org.freedesktop.systemd1',interface='org.freedesktop.DBus.Properties',"
        b"member='PropertiesChanged',path_namespace='/org/freedesktop/systemd1/unit'",
        b"type='signal',sender='org.freedesktop.systemd1',interface='org.freedesktop.systemd1.Manager',"
        b"member='UnitRemoved'",
        b"type='signal',sender='org.freedesktop.systemd1',interface='org.freedesktop.systemd1.Manager',"
        b"member='Reloading'",
    )

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self._prefix = prefix
        # The object path of every unit whose name starts with the prefix starts with this (sd-bus
        # escapes a name character by character; only an empty name is special).
        self._path_prefix = path_encode(UNIT_PATH_PREFIX, prefix.encode()) if prefix else UNIT_PATH_PREFIX + b"/"
        # The last Service signal of each unit whose Unit signal has not come yet (it comes next).
        self._service: dict[bytes, dict[bytes, Any]] = {}
        # The state each unit named by the last drain was in, by its signals, when they said all of it.
        self.signalled: dict[str, UnitState] = {}

    def connect(self) -> None:
        self.close()
        self._service.clear()  # a pair split by the reconnect is no pair
        bus = _open_bus()
        try:
            for rule in self._RULES:
                bus.call_method(b"org.freedesktop.DBus", b"/org/freedesktop/DBus",
                                b"org.freedesktop.DBus", b"AddMatch", apply_signature(b"s", [rule]))
            # Without Subscribe, PID 1 sends unit signals to the bus only while someone else happens
            # to be subscribed.
            bus.call_method(DEST, MANAGER_PATH, MANAGER_IFACE, b"Subscribe", [])
        except DBusBaseError as exc:
            bus.close()
            raise _map_error(exc, "subscribing to systemd's signals") from exc
        self._bus = bus

    def fileno(self) -> int:
        assert self._bus is not None, "Watcher.fileno() before connect()"
        return self._bus.get_fd()

    def drain(self) -> tuple[set[str], bool]:
        """Read every queued signal. Returns (changed unit names under our prefix, reloaded); `signalled`
        then holds the state of those whose signals said all of it."""
        if self._bus is None:
            raise SystemdUnavailable("not subscribed to systemd's signals")
        changed: set[str] = set()
        self.signalled = {}
        reloaded = False
        empty_in_a_row = 0
        # pystemd drops sd_bus_process()'s return code, and an internal step (a method reply, the
        # bus driver's own messages) also comes back as an empty message: only two empties in a
        # row mean the queue is drained.
        while empty_in_a_row < 2:
            try:
                msg = self._bus.process()
            except DBusBaseError as exc:
                self.close()
                raise _map_error(exc, "reading systemd's signals") from exc
            if msg.is_empty():
                empty_in_a_row += 1
                continue
            empty_in_a_row = 0
            # The headers first; a body is decoded only for a unit of ours and for UnitRemoved. Decoding
            # every signal (process_reply(True)), most of them PropertiesChanged of other units, was a
            # third of the daemon's CPU under load.
            member = msg.get_member()
            if member == b"PropertiesChanged":
                path = msg.get_path() or b""
                if not path.startswith(self._path_prefix):
                    continue  # another unit's: not decoded
                name = _text(path_decode(path, UNIT_PATH_PREFIX))
                if not name.startswith(self._prefix):
                    continue
                msg.process_reply(False)
                self._note_properties(name, path, msg.body[0], msg.body[1])
            elif member == b"UnitRemoved":
                msg.process_reply(False)
                name = _text(msg.body[0])
                self._service.pop(_text(msg.body[1]).encode(), None)
                # Ended and collected (a unit no one held): its last signals still say how it ended.
                if name in self.signalled and not self.signalled[name].has_ended:
                    del self.signalled[name]
            else:
                reloaded = reloaded or member == b"Reloading"
                continue
            if name.startswith(self._prefix):
                changed.add(name)
        return changed, reloaded

    def _note_properties(self, name: str, path: bytes, interface: bytes, properties: dict[bytes, Any]) -> None:
        """One PropertiesChanged signal of a unit of ours: a Service signal waits for its Unit signal,
        and a Unit signal right after it makes the unit's state `signalled`; any other leaves it unsaid."""
        if interface == SERVICE_IFACE:
            self._service[path] = properties
            return
        service = self._service.pop(path, None)
        if (interface == UNIT_IFACE and service is not None and _SIGNALLED[SERVICE_IFACE] <= service.keys()
                and _SIGNALLED[UNIT_IFACE] <= properties.keys()):
            self.signalled[name] = unit_state(name, {**service, **properties})
        else:
            self.signalled.pop(name, None)
