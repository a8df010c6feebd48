"""A run row -> the transient unit's name and properties. Pure: no I/O, no clock.

The unit name is a function of (run id, attempt) only: it is the idempotency key that makes a
second start of the same attempt an adoption rather than a second run. The run id is a UUID (the
database type guarantees it, and `unit_name` takes a `uuid.UUID`), so no run id can smuggle a `/`,
`@`, `.` or anything else that would change what the name means.
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from typing import Any

from supervisor import envpolicy, fence, globs, runenv, stopsignals, taskspeak
from supervisor.config import CAPABILITIES, ROOT, UNIT_PREFIX, RunSettings, Settings
from supervisor.model import Attempt, Run

# One format for Python and for the claim query (store.py passes it to SQL's format()), so that the
# name an attempt row stores and the name the daemon computes cannot drift apart.
UNIT_NAME_FORMAT = UNIT_PREFIX + "%s-%s.service"
UNIT_GLOB = UNIT_PREFIX + "*.service"
_UNIT_NAME_RE = re.compile(
    "^" + re.escape(UNIT_PREFIX)
    + r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})-([1-9][0-9]{0,8})\.service\Z")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")

USEC = 1_000_000


class Refused(Exception):
    """The run may not start on this host, or cannot be expressed as a unit; the message says why."""


def unit_name(run_id: uuid.UUID, attempt: int) -> str:
    if not isinstance(run_id, uuid.UUID) or type(attempt) is not int or attempt < 1:
        raise ValueError(f"no unit name for run {run_id!r} attempt {attempt!r}")
    return UNIT_NAME_FORMAT % (run_id, attempt)


def parse_unit_name(name: str) -> tuple[uuid.UUID, int] | None:
    """(run id, attempt) for one of our unit names, None for anything else."""
    match = _UNIT_NAME_RE.match(name)
    if not match:
        return None
    return uuid.UUID(match.group(1)), int(match.group(2))


def _check_executable(argv: list[str], allowed: tuple[str, ...]) -> None:
    if not argv or not all(isinstance(a, str) for a in argv):
        raise Refused("argv is empty or not a list of strings")
    if any("\0" in a for a in argv):
        raise Refused("argv contains a NUL byte")
    path = argv[0]
    # A glob like /usr/bin/* must not admit /usr/bin/../../tmp/x: only a normalised absolute path
    # is compared with the allowlist.
    if not path.startswith("/") or os.path.normpath(path) != path or path.startswith("//"):
        raise Refused(f"executable {path!r} is not a normalised absolute path")
    if not allowed:
        raise Refused("this host allows no executables ([runs] allowed_executables is empty)")
    if not any(globs.matches(path, pattern) for pattern in allowed):
        raise Refused(f"executable {path} is not in this host's allowed_executables")


def environment(run: Run, runs: RunSettings) -> dict[str, str]:
    """The run's environment, checked: valid names and values, and no name this host refuses
    (envpolicy: names that change what an allowed program runs). The claim already skips a run this
    host refuses; this is the second line, for a row that reached the daemon anyway. Delivered
    through a root-only file (runenv.py), never as the unit's Environment=."""
    env = run.environment
    if not isinstance(env, dict):
        raise Refused("environment is not an object of NAME: value")
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
            raise Refused(f"environment name {name!r} is not valid")
        if not isinstance(value, str) or "\0" in value or "\n" in value:
            raise Refused(f"environment value of {name} must be a string without NUL or newline")
        why = envpolicy.refusal(name, runs.allowed_environment)
        if why:
            raise Refused(why)
        out[name] = value
    return out


def _run_user(run: Run, runs: RunSettings) -> str:
    """The user a run runs as: its own, else the host's [runs] user; '' for a DynamicUser."""
    return run.run_user or runs.user


def _user(run: Run, runs: RunSettings) -> dict[bytes, Any]:
    wanted = _run_user(run, runs)
    if run.run_user and run.run_user != runs.user and run.run_user not in runs.allowed_users:
        raise Refused(f"user {run.run_user} is not in this host's allowed_users")
    if not wanted:
        return {b"DynamicUser": True}
    return {b"User": wanted.encode()}


def _may_become_root(run: Run, runs: RunSettings) -> bool:
    """Whether the run's processes may have user id 0, and so read the environment files of other
    runs (root owns them: no capability is needed). A run as another user, under NoNewPrivileges
    (set-user-id bits and file capabilities ignored), can never get there, and the runtime directory's
    mode (0700, root's) keeps it out; a run that can is kept off it, and off the host's controls, by
    root_confinement().

    Chosen, not inherited: the path used to be in every unit. It is the one property that gives a
    unit a mount namespace by itself, and a host that turned the sandbox's namespaces off (a fixed
    [runs] user, private_tmp, protect_system, protect_home off) paid it on every start: systemd
    started such units at half the rate (docs/benchmarks.md, "Sandbox off"). If this said False for a
    run that can become root, that run could read every other run's secrets."""
    return _run_user(run, runs) == ROOT or not runs.no_new_privileges


# What a run that may become root must not reach. Without capabilities such a run is still user id 0
# to every file and socket that root owns, and these turn that into the host: PID 1's own socket and
# the system bus (systemctl or busctl there starts a transient unit as root with every capability and
# no sandbox), PID 1's Varlink socket (systemd 257 and later), the answers to password prompts, the
# host's DSN (its database role), and the daemon's runtime directory (every run's environment file).
# "/var/run/...": the same paths on a host where /var/run is not the usual symlink to /run (on one
# where it is, systemd resolves both to one mount). Not /run/systemd as a whole: systemd 252 fails a
# unit with 226/NAMESPACE when it is inaccessible (seen in the test bed; systemd #27997 for /run), and
# TemporaryFileSystem=/run/systemd, which 252 takes, would hide the journal's sockets too (syslog(3),
# sd_journal_print) and rely on what each systemd version needs there while it sets up the namespace.
# The other Varlink services of systemd 257 that act for a caller of user id 0 are named one by one
# (a guest of Debian 13 listed them; tests/vm/test_systemd257.py checks each one it has): sysext
# merges system extensions over /usr, Credentials decrypts with the host's key, PCRExtend and
# BootControl write the TPM's measurements and the boot entries, Hostname, ManagedOOM and machined
# act on the host, and udev's control socket stops or reconfigures device handling. Not the resolver's
# or userdb's sockets: name lookups go through them.
ROOT_RUN_VARLINK = ("/run/systemd/io.systemd.sysext", "/run/systemd/io.systemd.Credentials",
                    "/run/systemd/io.systemd.PCRExtend", "/run/systemd/io.systemd.BootControl",
                    "/run/systemd/io.systemd.Hostname", "/run/systemd/io.systemd.ManagedOOM",
                    "/run/systemd/machine/io.systemd.Machine", "/run/udev/control")
ROOT_RUN_INACCESSIBLE = tuple(
    prefix + path
    for path in ("/run/systemd/private", "/run/systemd/io.systemd.Manager", "/run/systemd/ask-password",
                 "/run/dbus/system_bus_socket", str(runenv.RUNTIME_DIRECTORY), *ROOT_RUN_VARLINK)
    for prefix in ("", "/var")
) + ("/etc/unitvisor",)
# Read-only for such a run: /run is a tmpfs of its own, which ProtectSystem=strict alone did not keep
# read-only in the test bed once ProtectProc= or ProtectKernelTunables= with ProtectControlGroups= were
# set (systemd 252 in a container), and a drop-in written to /run/systemd/system/ runs as full root at
# the next daemon-reload. Read-only does not stop connect() on a socket there: hence the list above.
ROOT_RUN_READ_ONLY = ("/run", "/var/run")


def root_confinement(settings: Settings) -> dict[bytes, Any]:
    """The properties that keep a run that may become root off the host's controls. Not a key, and not
    part of the sandbox one may turn off. It costs one mount namespace, which most such runs have anyway
    (PrivateTmp, ProtectSystem). PID 1 reads the unit's environment file before it sets the namespace
    up, so the run still gets its environment. "-": no error where a path does not exist (the Varlink
    socket before systemd 257, /etc/unitvisor on a host configured by --dsn alone). A [database]
    dsn_file outside /etc/unitvisor is kept out too: it is the same password."""
    paths = list(ROOT_RUN_INACCESSIBLE)
    if settings.database.dsn_file and not settings.database.dsn_file.startswith("/etc/unitvisor/"):
        paths.append(settings.database.dsn_file)
    return {
        b"InaccessiblePaths": [b"-" + path.encode() for path in paths],
        b"ReadOnlyPaths": [b"-" + path.encode() for path in ROOT_RUN_READ_ONLY],
    }


def start_condition(settings: Settings) -> dict[bytes, Any]:
    """With [fleet] stop_runs_when_cut_off, the lease checked at the unit's start (the model's
    START_NEEDS_LEASE, docs/fleet.md): an ExecCondition= that lets the command start only while this
    machine's lease (/run/unitvisor/lease) is valid. The fence stops what runs once the lease is over;
    this keeps what had not started yet from starting after it: a claim whose answer came late, a start
    job PID 1 had queued, a start the daemon made after the database went away. "privileged" (the `+`
    prefix): the check runs as root with none of the run's sandbox, so that it can read the lease in the
    daemon's runtime directory, which a run that may become root cannot reach (root_confinement).
    "no-env-expand" (the `:` prefix): systemd must leave the script's ${...} to the shell (without it,
    PID 1 replaced `${d%%,*}` by the empty value of a variable of that name, and refused every start). No
    fencing, no check: nothing would be stopped at the lease's end either, and a start costs one process
    less."""
    if not settings.fleet.stop_runs_when_cut_off:
        return {}
    return {b"ExecConditionEx": [(b"/bin/sh", [b"/bin/sh", b"-c", fence.start_check_script().encode()],
                                  [b"privileged", b"no-env-expand"])]}


def _limits(run: Run) -> dict[bytes, Any]:
    props: dict[bytes, Any] = {}
    if run.memory_max is not None:
        props[b"MemoryMax"] = run.memory_max
        # No swap beyond it: memory_max is all the memory a run may use, as its users read it. With
        # MemoryMax= alone, a host with swap lets a run go on past its limit in swap (cgroup v2
        # charges swap apart, and systemd's MemorySwapMax= default is infinity), slowly and at the
        # expense of every other run's pages, and it is killed only once swap is full too. A run that
        # wants swap has no way to ask for it yet: that would be a limit of its own, not this one.
        props[b"MemorySwapMax"] = 0
    if run.memory_high is not None:
        # Throttled, not killed, over it: the kernel reclaims the run's pages and slows its allocations
        # (memory.high). Not bounded by swap: MemorySwapMax=0 comes with memory_max only, so a run with
        # memory_high alone may be pushed into a host's swap, which is what throttling means there.
        props[b"MemoryHigh"] = run.memory_high
    if run.cpu_quota_percent is not None:
        # CPUQuotaPerSecUSec: CPU time per second of wall time; 100% = one CPU = 1s per second.
        props[b"CPUQuotaPerSecUSec"] = run.cpu_quota_percent * USEC // 100
    if run.tasks_max is not None:
        props[b"TasksMax"] = run.tasks_max
    if run.io_weight is not None:
        props[b"IOWeight"] = run.io_weight
    if run.runtime_max_sec is not None:
        props[b"RuntimeMaxUSec"] = run.runtime_max_sec * USEC
    return props


def stop_properties(run: Run, settings: Settings) -> dict[bytes, Any]:
    """How systemd stops the unit, for a cancel (StopUnit) and at runtime_max_sec alike (schema 026): its
    stop_signal as KillSignal= (sent to every process of the unit, KillMode=control-group), and after
    stop_timeout seconds (TimeoutStopSec=, in place of the host's [systemd] stop_grace) SIGKILL
    (SendSIGKILL=yes, in every unit). FinalKillSignal= is left alone: it is what systemd sends if even the
    SIGKILL leaves a process (SIGKILL already). Nothing for a run that names neither: the unit is as
    before. The signal is a number looked up from a fixed list (stopsignals.SIGNALS): a name outside it
    is refused, never passed on.

    With [fleet] stop_runs_when_cut_off, stop_grace also bounds the fence's stop of a cut-off host's runs
    (config.cut_off_after: every run is dead before another host may declare this one dead and start it
    again). A longer stop_timeout would let a run outlive that bound, and run twice: refused here."""
    props: dict[bytes, Any] = {}
    if run.stop_signal is not None:
        try:
            props[b"KillSignal"] = stopsignals.number(run.stop_signal)
        except stopsignals.Refused as exc:
            raise Refused(str(exc)) from None
    if run.stop_timeout is not None:
        if type(run.stop_timeout) is not int or run.stop_timeout < 1:
            raise Refused(f"stop_timeout {run.stop_timeout!r} is not a whole number of seconds from 1")
        grace = settings.systemd.stop_grace
        if settings.fleet.stop_runs_when_cut_off and run.stop_timeout > grace:
            raise Refused(f"stop_timeout {run.stop_timeout} s is longer than this host's [systemd] stop_grace "
                          f"({grace:g} s), which bounds the stop of its runs when it is cut off "
                          "([fleet] stop_runs_when_cut_off)")
        props[b"TimeoutStopUSec"] = run.stop_timeout * USEC
    if run.warn_before is not None:
        # Checked here too, so that a row with a bad one is refused before its unit exists, not when
        # its warning is due.
        try:
            stopsignals.number(run.warn_signal or stopsignals.DEFAULT_WARN_SIGNAL, "warn_signal")
        except stopsignals.Refused as exc:
            raise Refused(str(exc)) from None
    return props


def _capability_mask(names: tuple[str, ...]) -> int:
    mask = 0
    for name in names:
        mask |= 1 << CAPABILITIES.index(name)
    return mask


def _sandbox(runs: RunSettings, run: Run) -> dict[bytes, Any]:
    """The run sandbox ([runs] in config.py says why each default is what it is). A boolean turned
    off is sent as false, an empty list, capability_bounding_set ["all"], restrict_namespaces false
    or system_call_error "kill" leave the property out: either way systemd's own default, as before
    the sandbox."""
    props: dict[bytes, Any] = {
        b"ProtectProc": runs.protect_proc.encode(),
        b"ProcSubset": runs.proc_subset.encode(),
        b"ProtectKernelTunables": runs.protect_kernel,
        b"ProtectKernelModules": runs.protect_kernel,
        b"ProtectKernelLogs": runs.protect_kernel,
        b"ProtectControlGroups": runs.protect_control_groups,
        b"ProtectClock": runs.protect_clock,
        b"ProtectHostname": runs.protect_hostname,
        b"RestrictSUIDSGID": runs.restrict_suid_sgid,
        b"RestrictRealtime": runs.restrict_realtime,
        b"LockPersonality": runs.lock_personality,
        b"PrivateDevices": runs.private_devices,
        b"PrivateUsers": runs.private_users,
        b"MemoryDenyWriteExecute": runs.memory_deny_write_execute,
        # Either says no network: the host for all of its runs, or the run for itself.
        b"PrivateNetwork": runs.private_network or run.private_network,
        b"UMask": int(runs.umask, 8),
    }
    if runs.capability_bounding_set != ("all",):
        # A bitmask of the capabilities kept; 0 is the empty set, also for a run as root.
        props[b"CapabilityBoundingSet"] = _capability_mask(runs.capability_bounding_set)
    if runs.restrict_namespaces:
        # The namespace types still ALLOWED (CLONE_NEW* flags): none.
        props[b"RestrictNamespaces"] = 0
    if runs.system_call_architectures:
        props[b"SystemCallArchitectures"] = [a.encode() for a in runs.system_call_architectures]
    if runs.system_call_filter:
        # (allow list?, names): true makes it an allow list; PID 1 resolves the @groups itself.
        props[b"SystemCallFilter"] = (True, [n.encode() for n in runs.system_call_filter])
        if runs.system_call_error != "kill":
            props[b"SystemCallErrorNumber"] = getattr(errno, runs.system_call_error)
    if runs.restrict_address_families:
        props[b"RestrictAddressFamilies"] = (True, [f.encode() for f in runs.restrict_address_families])
    return props


def build(run: Run, attempt: Attempt, settings: Settings, copy_tasks_peak: bool = True) -> dict[bytes, Any]:
    """The unit's properties. Raises Refused when the run may not or cannot run here. `copy_tasks_peak`:
    the unit copies its cgroup's pids.peak at its end (taskspeak.available(): this host has one)."""
    if attempt.unit_name != unit_name(run.id, attempt.attempt):
        raise Refused(f"attempt row names unit {attempt.unit_name!r}, expected {unit_name(run.id, attempt.attempt)}")
    runs = settings.runs
    argv = list(run.argv)
    _check_executable(argv, runs.allowed_executables)
    if run.working_directory is not None and (
            not run.working_directory.startswith("/") or "\0" in run.working_directory):
        raise Refused(f"working directory {run.working_directory!r} is not an absolute path")
    props: dict[bytes, Any] = {
        b"Description": f"unitvisor run {run.id} attempt {attempt.attempt}".encode(),
        b"Slice": settings.systemd.slice.encode(),
        # exec, not simple: the start job fails when the binary or the user is missing, instead of
        # the unit looking started and failing a moment later with 203/EXEC.
        b"Type": b"exec",
        # The unit ends `inactive` (clean exit) or `failed` and is not kept `active/exited`: releasing
        # an exited unit cost PID 1 a stop job per run (0.3.0 did that), half of its start rate.
        # What keeps an ended unit loaded, with Result, ExecMain*, timestamps and accounting readable
        # until the daemon has recorded the outcome and releases it (Unref), is AddRef: a reference
        # that PID 1 holds for the daemon's bus connection. When that connection closes (the daemon
        # stopped or crashed), PID 1 collects a cleanly ended unit at once, and the reconciler reads
        # the outcome from PID 1's journal records instead (journal.py).
        b"RemainAfterExit": False,
        b"AddRef": True,
        # no-env-expand: systemd must not expand $VAR in the arguments; what the row says runs.
        b"ExecStartEx": [(argv[0].encode(), [a.encode() for a in argv], [b"no-env-expand"])],
        b"LogExtraFields": [f"UNITVISOR_RUN={run.id}".encode(), f"UNITVISOR_ATTEMPT={attempt.attempt}".encode()],
        b"KillMode": b"control-group",
        b"TimeoutStopUSec": int(settings.systemd.stop_grace * USEC),
        b"SendSIGKILL": True,
        b"NoNewPrivileges": runs.no_new_privileges,
        b"PrivateTmp": runs.private_tmp,
        b"ProtectSystem": runs.protect_system.encode(),
        b"ProtectHome": runs.protect_home.encode(),
        # What the outcome records (systemd.accounting_from_properties): systemd measures only what a
        # unit asks for, and its defaults differ by version and cgroup layout (IO is off by default).
        # Each costs PID 1 a counter read when the unit ends; where a controller is unavailable (cgroup
        # v1 in a container) systemd ignores the request and the outcome records NULL. TasksAccounting
        # enables the pids controller on the unit's cgroup (Debian's default already), whose pids.peak
        # the stop command below copies out: systemd keeps no task figure of an ended unit.
        b"CPUAccounting": True,
        b"MemoryAccounting": True,
        b"IOAccounting": True,
        b"TasksAccounting": True,
    }
    if copy_tasks_peak:
        # The peak number of tasks, read by the unit itself before its cgroup is removed (taskspeak.py):
        # a fixed command, the same for every run, run by PID 1 as root outside the sandbox. Only where
        # the kernel has a pids.peak to copy: it costs PID 1 a process per unit.
        props[b"ExecStopPostEx"] = [taskspeak.STOP_POST_COMMAND]
    # Checked here so that a run this host refuses is never started; the values themselves are not
    # a property (any user reads those over D-Bus): the reconciler writes them to a root-only file
    # and adds EnvironmentFiles= (runenv.py).
    environment(run, runs)
    if run.working_directory:
        props[b"WorkingDirectory"] = run.working_directory.encode()
    props.update(_user(run, runs))
    if _may_become_root(run, runs):
        props.update(root_confinement(settings))
    props.update(_limits(run))
    props.update(stop_properties(run, settings))
    props.update(_sandbox(runs, run))
    props.update(start_condition(settings))
    return props
