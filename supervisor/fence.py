"""`unitvisor fence`: the self-fence, a small service that outlives the daemon (issue 21).

With `[fleet] stop_runs_when_cut_off`, a host whose heartbeat has not been renewed for
`cut_off_after` (host_dead_after - stop_grace - 2 s) must stop its runs before any other host may
declare it dead and run them again. That must hold whatever state the daemon is in: running but cut
off, stopped by `systemctl stop`, crash-looping on a wrong DSN or a rotated password, or cut off right
after a restart, before it ever registered. A thread inside the daemon (0.5.x's dead man's switch)
covered only the first. So the promise is split in two, across the process boundary:

- the **lease** (`/run/unitvisor/lease`): each time the daemon commits a heartbeat it writes, atomically,
  the deadline by CLOCK_BOOTTIME (the heartbeat's send time plus cut_off_after) and whether fencing is
  on. CLOCK_BOOTTIME counts time suspended, as the peers' clocks do, so a suspended host errs early.
- the **fence** (`unitvisor-fence.service`, this module): checks the lease every CHECK_EVERY and, once it
  has expired with fencing on, stops every `unitvisor-run-*` unit whose process still runs, writes one
  journal line per run, and records each name under `/run/unitvisor/fenced/`, where the daemon, when it
  is back, finds them and settles those attempts as `lost` (as a cut-off stop always was).

The fence needs no database and no configuration that the lease does not carry; it reads the
configuration only when there is no lease (below). Nothing here talks to systemd but through
supervisor/systemd.py.

**No lease while runs exist.** /run is a tmpfs: a lease is missing only when no daemon of this version
renewed a heartbeat since boot, yet units of ours run: the first minutes after an upgrade from 0.5.x
(whose daemon wrote none), or someone removed the file. The fence then writes a provisional lease, once
(it never replaces one), expiring `cut_off_after - poll_interval` from now with the configuration's
`stop_runs_when_cut_off`: the last heartbeat is unknown, and a healthy daemon heartbeats every poll
interval, so this assumes it was one poll interval ago, while leaving a daemon that is starting at
least one poll interval to renew. Kept in the file, not in memory, so that a fence that restarts does
not push the deadline on each time. With no configuration it can read, the fence cannot tell whether
fencing is wanted: it says so in the journal and stops nothing (the daemon itself does not start
without a readable configuration).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from supervisor import fleet
from supervisor.config import UNIT_PREFIX, ConfigError, Settings, cut_off_after
from supervisor.log import event
from supervisor.outcomes import Outcome
from supervisor.runenv import RUNTIME_DIRECTORY
from supervisor.systemd import Systemd, SystemdError, SystemdUnavailable, UnitBrief

LEASE = RUNTIME_DIRECTORY / "lease"
FENCED = RUNTIME_DIRECTORY / "fenced"
CHECK_EVERY = 0.5
UNIT_GLOB = UNIT_PREFIX + "*.service"  # unitspec.UNIT_GLOB (unitspec imports this module)
UPTIME = Path("/proc/uptime")  # its first field is CLOCK_BOOTTIME, in hundredths of a second


def boottime() -> float:
    """Seconds since boot, suspend included: the lease's clock, the same for the daemon and the fence."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class Lease:
    deadline: float  # CLOCK_BOOTTIME seconds
    fencing: bool  # stop_runs_when_cut_off of whoever wrote it
    boot_id: str  # a lease of another boot means nothing (its clock started again)
    source: str = "daemon"  # or "fence": a provisional lease (module docstring)

    def encode(self) -> bytes:
        # One line, json.dumps's default separators: start_check_script() reads this layout with the
        # shell's own words (tests/unit/test_fence_start.py checks the two agree).
        return (json.dumps({"deadline": self.deadline, "fencing": self.fencing, "boot_id": self.boot_id,
                            "source": self.source}) + "\n").encode()


def parse_lease(text: bytes) -> Lease | None:
    """The lease in a file's content, or None if it is not one (half a file cannot happen: it is
    renamed into place; this is for a file someone else wrote)."""
    try:
        data = json.loads(text)
        lease = Lease(float(data["deadline"]), data["fencing"], str(data["boot_id"]), str(data.get("source", "daemon")))
    except (ValueError, TypeError, KeyError):
        return None
    return lease if isinstance(lease.fencing, bool) else None


def expired(lease: Lease | None, now: float) -> bool:
    """Whether the runs must be stopped now: a lease with fencing on whose deadline has come."""
    return lease is not None and lease.fencing and now >= lease.deadline


def may_start(lease: Lease | None, now: float) -> bool:
    """Whether a run's unit may start now (the model's START_NEEDS_LEASE): a lease that has not
    expired, or that says fencing is off. No lease, or one that cannot be read, refuses: with fencing
    on, the daemon writes its lease after registering, before it claims anything, so a start without
    one is a start nobody vouches for. start_check_script() is this, in /bin/sh.

    The boot id is not compared, unlike read_lease: /run is a tmpfs that systemd mounts afresh at every
    boot, so the file cannot be another boot's; and the boot id a process reads depends on its mount
    namespace where a container manager overmounts it (systemd-nspawn: the sandboxed daemon read the
    kernel's, the check, run outside the sandbox, the container's), which refused every start there."""
    return lease is not None and not expired(lease, now)


def start_check_script(lease: Path | None = None, uptime: Path = UPTIME) -> str:
    """may_start() as a /bin/sh script, the ExecCondition= of every run's unit with fencing on
    (unitspec.start_condition): exit 0 lets the unit start, 1 skips it (systemd's Result=exec-condition,
    the command never runs). A shell, not Python: it runs at every start, and only builtins run in it
    (read, case, test), so it costs one fork and exec of /bin/sh (docs/fleet.md has the measured cost),
    where `python3 -I -S` took about 20 ms, more than systemd spends on the whole start.

    The deadline is compared in hundredths of a second, /proc/uptime's resolution (CLOCK_BOOTTIME, as
    the lease's): the lease's is cut to hundredths (errs early), uptime too (errs late by less than
    that); a start at the very hundredth of the deadline is refused. IFS is set here, not inherited
    (the run's environment file is read for this line too); names with a `%` (bash's exported
    functions) are not valid environment names for a run (unitspec.environment). A deadline the shell
    cannot compare (an exponent, more digits than 64 bits hold) refuses: only a lease nobody wrote
    reads so, and refusing is the safe side. No lease is a refusal too, with nothing on stderr."""
    return f"""IFS=' '
read -r l 2>/dev/null < {_sh_quote(str(lease or LEASE))} || exit 1
read -r u _ < {_sh_quote(str(uptime))} || exit 1
case $l in *'"fencing": false'*) exit 0 ;; *'"fencing": true'*) ;; *) exit 1 ;; esac
case $l in *'"deadline": '*) ;; *) exit 1 ;; esac
d=${{l#*'"deadline": '}}
d=${{d%%,*}}
d=${{d%%'}}'*}}
case $d in '' | *[!0-9.]* | *.*.* | .*) exit 1 ;; esac
case $d in *.*) i=${{d%.*}} f=${{d#*.}}00 ;; *) i=$d f=00 ;; esac
f=${{f%"${{f#??}}"}}
case $u in *.??) ;; *) exit 1 ;; esac
[ "${{u%.*}}${{u#*.}}" -lt "$i$f" ] 2>/dev/null && exit 0
exit 1
"""


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# What systemd records for a unit whose ExecCondition= refused its start (systemd.service(5)).
START_REFUSED_RESULT = "exec-condition"


def refused_start_outcome(result: str, cancel_requested: bool) -> Outcome | None:
    """The outcome of a unit that ended with `result`, if its start was refused by the lease check:
    `lost`, with no exit status, its run moved on by its own policy, as an attempt the fence stopped.
    Not the run's failure (the command never ran, so nothing is known of it), and not the attempt's to
    start again: by the time the check refused, a peer may have declared this host dead and retried the
    run elsewhere; under the same unit name, a second start would be a second "Started" record of one
    attempt. A cancel requested meanwhile wins, as everywhere. None: not refused by the lease check."""
    if result != START_REFUSED_RESULT or cancel_requested:
        return None
    return REFUSED_START


REFUSED_START = Outcome("lost", None, "not started: this host's lease had expired at the unit's start (cut off "
                        "from the database, stop_runs_when_cut_off); the command never ran")


def provisional_lease(settings: Settings, now: float, boot_id: str) -> Lease:
    """The lease the fence writes when runs exist and there is none (module docstring)."""
    delay = cut_off_after(settings) - settings.daemon.poll_interval
    return Lease(now + delay, settings.fleet.stop_runs_when_cut_off, boot_id, source="fence")


def daemon_lease(settings: Settings, sent_at: float, boot_id: str) -> Lease:
    """The lease for a heartbeat sent at boottime `sent_at` and since committed. From the send, not
    the commit: the database stamped the heartbeat later, so the deadline errs early, as the peers'
    host_dead_after counts from that stamp."""
    return Lease(sent_at + cut_off_after(settings), settings.fleet.stop_runs_when_cut_off, boot_id)


def to_stop(units: Mapping[str, UnitBrief], fenced: Iterable[str]) -> list[str]:
    """The units to stop once the lease has expired: ours whose process may still run, but for those
    already stopped for this expiry (their stop job is PID 1's to finish; one journal line each)."""
    done = set(fenced)
    return sorted(name for name, brief in units.items() if brief.process_running and name not in done)


# -- files ------------------------------------------------------------------------------------------


def _temp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")


def write_lease(lease: Lease, path: Path | None = None) -> None:
    """Replace the lease atomically (the daemon's write): the fence reads the old one or the new one."""
    path = path or LEASE
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = _temp(path)
    temp.write_bytes(lease.encode())
    os.replace(temp, path)


def provide_lease(lease: Lease, path: Path | None = None) -> bool:
    """Put `lease` in place only if there is none (the fence's write: a lease the daemon wrote in
    the meantime wins). True if it was put in place."""
    path = path or LEASE
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = _temp(path)
    temp.write_bytes(lease.encode())
    try:
        os.link(temp, path)  # fails if a lease exists: no replacing, not even by a race
        return True
    except FileExistsError:
        return False
    finally:
        temp.unlink(missing_ok=True)


def read_lease(boot_id: str, path: Path | None = None) -> Lease | None:
    """The lease of this boot, or None (none, unreadable as a lease, or another boot's, which is
    removed so that a provisional lease can take its place)."""
    path = path or LEASE
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    lease = parse_lease(text)
    if lease is None or lease.boot_id != boot_id:
        event("lease-discarded", level=logging.WARNING, path=str(path),
              detail="not a lease of this boot; treated as no lease")
        path.unlink(missing_ok=True)
        return None
    return lease


class RecordsUnreadable(Exception):
    """The fence's records cannot be read, so whether it stopped a unit is unknown. Seen with a daemon
    that is not root (a misconfiguration it claims nothing under): the two services share
    /run/unitvisor, and the one that starts last makes it its user's, mode 0700."""


def fenced_units(directory: Path | None = None) -> set[str]:
    """The units the fence stopped that the daemon has not settled yet. Raises RecordsUnreadable when
    the directory exists but cannot be read: "none" would be a guess."""
    directory = directory or FENCED
    try:
        return {entry.name for entry in directory.iterdir() if not entry.name.startswith(".")}
    except FileNotFoundError:
        return set()
    except OSError as exc:
        raise RecordsUnreadable(f"cannot read the fence's records in {directory}: {exc.strerror or exc}") from None


def record_fenced(name: str, directory: Path | None = None) -> None:
    directory = directory or FENCED
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    (directory / name).touch()


class FencedUnits(set):
    """The daemon's set of units stopped by the fence and not yet settled, mirrored by the files under
    /run/unitvisor/fenced: the reconciler discards a name once its attempt's outcome is recorded, and
    the file goes with it, so that the name is not read back and settled as cut off a second time. A
    name the fence records while the daemon runs is read in at the next reconcile pass (`refresh`).

    When the records cannot be read, `unreadable` says why (said once in the journal) and `check` raises:
    an attempt whose outcome depends on them is left open for a later pass, not settled as killed when
    the fence may have cut it off; a daemon with nothing open goes on as usual."""

    def __init__(self, directory: Path | None = None) -> None:
        super().__init__()
        self.directory = directory or FENCED
        self.unreadable: str | None = None

    def refresh(self) -> None:
        try:
            self.update(fenced_units(self.directory))
        except RecordsUnreadable as exc:
            if str(exc) != self.unreadable:
                event("fence-records-unreadable", level=logging.WARNING, path=str(self.directory), detail=str(exc))
            self.unreadable = str(exc)
        else:
            self.unreadable = None

    def check(self) -> None:
        """Raises RecordsUnreadable while the last refresh could not read the records."""
        if self.unreadable is not None:
            raise RecordsUnreadable(self.unreadable)

    def discard(self, name: str) -> None:
        if name in self:
            with contextlib.suppress(OSError):
                (self.directory / name).unlink(missing_ok=True)
        super().discard(name)


# -- the service --------------------------------------------------------------------------------------


class Fence:
    """One round every CHECK_EVERY: read the lease; stop the runs if it has expired with fencing on;
    provide a lease if there is none while runs exist."""

    def __init__(self, load_settings: Callable[[], Settings], systemd: Systemd | None = None,
                 lease_path: Path | None = None, fenced_dir: Path | None = None, boot_id: str | None = None) -> None:
        self.load_settings = load_settings
        self.systemd = systemd or Systemd()
        self.lease_path = lease_path or LEASE
        self.fenced_dir = fenced_dir or FENCED
        self.boot_id = boot_id or fleet.boot_id()
        self.stopping = False
        self._said = ""  # the last warning about the lease, said once until it changes

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        event("fence-starting", lease=str(self.lease_path), boot_id=self.boot_id)
        while not self.stopping:
            try:
                self.check(boottime())
            except SystemdUnavailable as exc:
                self.systemd.close()  # reopened at the next check
                self._say(f"systemd: {exc}")
            except Exception as exc:  # the fence must outlive any one failure of its own
                self._say(f"{type(exc).__name__}: {exc}")
            time.sleep(CHECK_EVERY)
        self.systemd.close()
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _say(self, detail: str) -> None:
        if detail != self._said:
            event("fence-trouble", level=logging.ERROR, detail=detail)
        self._said = detail

    def _units(self) -> dict[str, UnitBrief]:
        if not self.systemd.connected:
            self.systemd.connect()
        return self.systemd.list_units(UNIT_GLOB)

    def check(self, now: float) -> list[str]:
        """One round; returns the units it stopped."""
        lease = read_lease(self.boot_id, self.lease_path)
        if lease is None:
            self._provide(now)
            return []
        if not expired(lease, now):
            self._said = ""
            return []
        return self._stop(now, lease)

    def _provide(self, now: float) -> None:
        if not any(brief.process_running for brief in self._units().values()):
            return
        try:
            settings = self.load_settings()
        except ConfigError as exc:
            self._say(f"no lease at {self.lease_path} while runs exist, and no configuration to tell whether "
                      f"to fence them ({exc}): stopping nothing")
            return
        lease = provisional_lease(settings, now, self.boot_id)
        if provide_lease(lease, self.lease_path):
            event("lease-provided", level=logging.WARNING, fencing=lease.fencing,
                  expires_in=f"{lease.deadline - now:.0f}s",
                  detail="runs exist but no daemon renewed a lease this boot: assuming its last heartbeat came "
                         "one poll interval ago")

    def _stop(self, now: float, lease: Lease) -> list[str]:
        stopped = []
        for name in to_stop(self._units(), fenced_units(self.fenced_dir)):
            # Read again before each stop: a daemon that renewed its lease in the meantime keeps its runs
            # (a stop it races with is settled `lost`, which is safe; this only narrows the window).
            if not expired(read_lease(self.boot_id, self.lease_path), boottime()):
                break
            # Recorded before the stop: a fence killed between the two leaves a name whose unit ended
            # some other way, which the daemon settles `lost` (it would have been, cut off); the other
            # order could leave a stopped unit that the daemon settles as killed by a signal.
            record_fenced(name, self.fenced_dir)
            try:
                if not self.systemd.stop(name):  # gone since the listing: it ended by itself
                    (self.fenced_dir / name).unlink(missing_ok=True)
                    continue
                stopped.append(name)
            except SystemdUnavailable:
                (self.fenced_dir / name).unlink(missing_ok=True)
                raise  # the bus is gone: the next round tries again
            except SystemdError as exc:  # one unit's refusal must not keep the others running
                event("fence-stop-failed", level=logging.ERROR, unit=name, detail=str(exc))
                continue
            event("fenced", level=logging.ERROR, unit=name, run=unitspec_run_id(name),
                  detail=f"heartbeat lease expired {now - lease.deadline:.1f}s ago (stop_runs_when_cut_off): "
                         "stopped before any other host may declare this one dead; the daemon settles it "
                         "as lost when it is back")
        return stopped


def unitspec_run_id(name: str) -> str | None:
    """The run id in a unit name of ours (unitvisor-run-<run id>-<attempt>.service), for the journal."""
    stem = name.removeprefix(UNIT_PREFIX)
    return stem[:36] if len(stem) > 36 else None


def cut_off_status(settings: Settings, in_flight: int) -> str:
    """What the daemon says when it stops, of the runs it leaves running (issue 21: `systemctl stop`
    beyond host_dead_after must warn before it breaks a promise)."""
    dead_after = settings.fleet.host_dead_after
    if settings.fleet.stop_runs_when_cut_off:
        return (f"{in_flight} run(s) in flight keep running; unless this daemon is back within "
                f"{cut_off_after(settings):g}s, unitvisor-fence stops them (stop_runs_when_cut_off) and they are "
                "settled lost")
    return (f"{in_flight} run(s) in flight keep running; if this daemon is not back within {dead_after:g}s "
            "(host_dead_after) they are declared lost and may run again elsewhere while still running here "
            "(drain first, or turn on [fleet] stop_runs_when_cut_off)")
