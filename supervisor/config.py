"""Settings: /etc/unitvisor/unitvisor.toml -> typed, validated dataclasses. Every default is here.

An unknown key or a bad value stops start-up with one message naming the key, because a typo in a
limit that silently falls back to a default is worse than a daemon that refuses to start.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from supervisor.envpolicy import DEFAULT_ALLOWED, NAME_PATTERN_RE, pattern_problem
from supervisor.labels import labels_problem
from supervisor.pressure import RESOURCES as PRESSURE_RESOURCES
from supervisor.quantities import QuantityError, parse_duration, parse_size

DEFAULT_PATH = Path("/etc/unitvisor/unitvisor.toml")
# The DSN may carry a password, so it has a file of its own that only root reads; the main config
# stays world-readable like any conffile.
DEFAULT_DSN_FILE = Path("/etc/unitvisor/dsn")
UNIT_PREFIX = "unitvisor-run-"
# Seconds between the cut-off stop and the moment another host may declare this one dead, besides
# stop_grace: the guard's check interval and the stop calls themselves.
CUT_OFF_MARGIN = 2.0


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which file and key."""


@dataclass(frozen=True)
class DatabaseSettings:
    dsn: str = ""
    dsn_file: str = str(DEFAULT_DSN_FILE)


@dataclass(frozen=True)
class HostSettings:
    id: str = ""  # empty: this machine's /etc/machine-id
    name: str = ""  # empty: the hostname
    max_runs: int = 64
    memory_budget: int | None = None  # bytes; the sum of running runs' MemoryMax may not exceed it
    # Admission by pressure (supervisor/pressure.py): avg10 of `some` in the PSI files of [systemd]
    # slice, in percent. From pressure_slow_at the host claims fewer runs (at most one claim a poll
    # interval, of fewer runs the nearer it is to pressure_stop_at); from pressure_stop_at it claims
    # none, until the figure falls again. Chosen, not inherited: on a healthy host these figures sit
    # at 0.00; 10% (a second of the last ten with a run waiting for memory or IO) is past the noise of
    # a cold cache, and 40% is well under the 60% at which systemd-oomd (where enabled) starts killing,
    # and is reached about 5 s into a full stall (avg10 is a 10 s average). Higher values claim into a
    # host that is already thrashing; lower ones idle a host for a moment's reclaim.
    pressure_slow_at: float = 10.0
    pressure_stop_at: float = 40.0
    # Which of memory, io and cpu are watched; [] turns admission by pressure off. Not cpu by
    # default: a run held to its own `cpu` quota counts as CPU pressure of the whole slice, and so do
    # more busy runs than cores, which is a full host working, not a host in trouble.
    pressure_resources: tuple[str, ...] = ("memory", "io")
    # Placement (schema 033): this host's labels, registered with it; a run whose host_labels are not
    # all among them is never claimed here. Checked as a run's labels are (supervisor/labels.py).
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DaemonSettings:
    # The fallback poll, which is also the heartbeat: one statement per interval when idle.
    poll_interval: float = 10.0
    reconcile_interval: float = 60.0
    claim_batch: int = 32
    # A unit with our prefix that no attempt on this host owns is stopped: it can only be a run that
    # this host must not be running (its row was deleted, or it belongs to another host id).
    stop_orphans: bool = True


@dataclass(frozen=True)
class FleetSettings:
    # A host silent for longer than this is declared dead by a live daemon, and its open attempts are
    # settled as `lost` (then retried elsewhere or failed by each run's retry_on). Other hosts use the
    # silent host's own value, as it registered it. At least 3 poll intervals: one missed heartbeat
    # (a slow statement, a short network blip) must never cost a host its runs.
    host_dead_after: float = 60.0
    # Chosen, not inherited: off by default, because it trades availability for at-most-once. On,
    # a daemon that could not renew its heartbeat for cut_off_after() stops its own runs before any
    # other host may declare it dead, so two live copies of one run never exist, even in a network
    # partition; off, a partitioned host's runs keep running while their retries start elsewhere.
    stop_runs_when_cut_off: bool = False
    # At most this many hosts are declared dead in one pass of the fleet upkeep (one pass per poll
    # interval), the longest silent first; the rest in the next passes. A live host taken for dead costs
    # its runs (lost, run again elsewhere) and a takeover's work on a database that is already behind;
    # many hosts silent at once is more often the database than a rack. A rack that did die is declared
    # a few hosts a poll interval: 5 hosts of 50 in 10 intervals.
    max_dead_per_pass: int = 5


@dataclass(frozen=True)
class SystemdSettings:
    slice: str = "unitvisor.slice"
    stop_grace: float = 10.0  # SIGTERM, then SIGKILL after this long, when a run is cancelled


@dataclass(frozen=True)
class RunSettings:
    allowed_executables: tuple[str, ...] = ()
    # Empty: each run gets a DynamicUser of its own, the least privilege that still runs a command.
    user: str = ""
    allowed_users: tuple[str, ...] = ()
    # The environment names a run may set (names, or globs such as APP_*); any other is refused, and
    # the host never claims a run that sets one. A name on envpolicy.DENIED (it loads code: LD_*,
    # PYTHON*, PATH, ...) is opened only by its exact name, never by a glob. Default: the locale and
    # the time zone (envpolicy.DEFAULT_ALLOWED).
    allowed_environment: tuple[str, ...] = DEFAULT_ALLOWED
    no_new_privileges: bool = True
    private_tmp: bool = True
    protect_system: str = "strict"
    protect_home: str = "yes"
    # -- the run sandbox (unitspec._sandbox): what a hardened system service gets and a batch command
    # tolerates; `systemd-analyze security` rates a run 1.5 with these, 8.1 without (docs/benchmarks.md).
    # Names of the capabilities a run keeps: none, also for a run as root (it stays root for files,
    # and for nothing else). ["all"] leaves the bounding set as systemd's default, every capability.
    capability_bounding_set: tuple[str, ...] = ()
    # Other users' processes are invisible in /proc, the daemon's and other runs' among them.
    protect_proc: str = "invisible"
    # "all", not "pid" as a hardened service could: a batch command reads /proc/meminfo, /proc/cpuinfo
    # or /proc/loadavg to size itself (JVMs, numpy, `free`, `nproc --all`), which "pid" hides.
    # systemd-analyze lists it at 0.1; the overall score stays 1.5 either way.
    proc_subset: str = "all"
    # ProtectKernelTunables, ProtectKernelModules and ProtectKernelLogs together. Tunables is most of
    # the sandbox's cost in start-up time (docs/benchmarks.md), and stays on: a run as root owns the
    # files of /proc/sys even without capabilities. Off, the score is 2.0.
    protect_kernel: bool = True
    protect_control_groups: bool = True
    protect_clock: bool = True
    protect_hostname: bool = True
    # No new namespace of any kind (unshare, clone flags, user namespaces for rootless containers).
    restrict_namespaces: bool = True
    restrict_suid_sgid: bool = True
    restrict_realtime: bool = True
    lock_personality: bool = True
    # Empty: any architecture's system calls (an x86 host would also take 32-bit ones).
    system_call_architectures: tuple[str, ...] = ("native",)
    # An allow list of calls and @groups, resolved by PID 1; empty: no filter. The daemon's own unit
    # also denies @privileged and @resources: not here, because that breaks `nice`, `ulimit` and the
    # chown of tar or `cp -p`, which batch commands use (with them the score would be 1.3).
    system_call_filter: tuple[str, ...] = ("@system-service",)
    # What a call outside the filter returns: an errno name, so that the program sees an error it can
    # report (`Operation not permitted`), or "kill" (SIGSYS, a core dump that says nothing of why).
    system_call_error: str = "EPERM"
    # Empty: every address family. Network is allowed by default (the database, an API, a mirror);
    # AF_NETLINK, AF_PACKET and the rest are what a batch command does not need.
    restrict_address_families: tuple[str, ...] = ("AF_UNIX", "AF_INET", "AF_INET6")
    private_devices: bool = True
    umask: str = "0077"
    # false: a run reaches the network unless it asks for none (`submit --private-network`); true
    # makes every run on this host networkless but for its own loopback. Most runs need the network,
    # so the default leaves it (a networkless run scores 1.0).
    private_network: bool = False
    # false: in a user namespace of its own, every file of another user (root's included) would show
    # as owned by nobody, which breaks ownership checks (git's safe.directory, ssh's key files, `test
    # -O`); with it the score would be 1.3.
    private_users: bool = False
    # false: it breaks every JIT (the JVM, node, PyPy, LuaJIT, .NET, a regex JIT), which needs memory
    # that is writable and then executable; systemd-analyze lists it at 0.1.
    memory_deny_write_execute: bool = False
    # The end of each run's output kept with its outcome (attempts.output_tail), so that `unitvisor
    # logs` answers from any host, and after this host's journal rotated or the host died; the whole
    # output stays in journald. Both bounds apply (the last lines, then their last bytes); 0 in either
    # keeps none. Read with one journalctl for up to 32 outcomes (docs/benchmarks.md, Output tails).
    output_tail_lines: int = 20
    output_tail_bytes: int = 4096
    # RemoveIPC= and KeyringMode= are left out: DynamicUser= implies RemoveIPC, and for a fixed User=
    # it would remove the IPC objects of that user's other runs still running when one run ends;
    # KeyringMode=private is already systemd's default for system services. DevicePolicy= is left
    # out because PrivateDevices= already makes it `closed` (the one device systemd-analyze still
    # counts, /dev/rtc read-only, comes with ProtectClock). IPAddressDeny= and RootDirectory= are
    # left out: where a run may connect, and what it runs on, are the run's business, not the host's.


# Chosen, not inherited: on by default, so that a host has its metrics from the moment it is
# installed (a local agent or `curl` reads them without a config change), but on loopback only: the
# server has no authentication and no TLS, and the figures tell anyone who can reach them what this
# host runs and when. Exposing them to a network is the administrator's decision (listen = "0.0.0.0:
# 9863", or a proxy in front). 9863: in Prometheus's range for exporters (9100-9999, whose list of
# allocations is full, so no port there is anyone's alone) and in this machine's /etc/services for
# nothing; a port in use costs the metrics, never the daemon (supervisor/metrics.py).
DEFAULT_METRICS_LISTEN = "127.0.0.1:9863"


@dataclass(frozen=True)
class MetricsSettings:
    # "ADDRESS:PORT" (an IPv4 address, or an IPv6 one in brackets) to serve Prometheus metrics on at
    # /metrics; "" serves none. See docs/metrics.md.
    listen: str = DEFAULT_METRICS_LISTEN


# [retention] bounds. The least age is the database's floor for a host's pruning
# (unitvisor.prune_history_min_age() in sql/migrations/008_retention.sql): a lower value would be refused there at
# every pass, so it is refused here, at start-up. A batch is one transaction of the daemon's session,
# which must end well inside its statement_timeout (store.SESSION_SETTINGS) on a loaded database.
RETENTION_MIN_KEEP = 3600.0
RETENTION_MAX_BATCH = 10_000
# The words that turn retention off, besides 0.
RETENTION_OFF = ("off", "0")


@dataclass(frozen=True)
class RetentionSettings:
    # How long a finished run (succeeded, failed, cancelled, expired, skipped) is kept, with its attempts,
    # events and spawn jobs; claimed and discarded spawn jobs of runs still kept go at the same age. None
    # ("off"): kept for ever. Chosen, not inherited: on, at 30 days. Were it off by default, every table
    # of the schema would grow for ever in the database unitvisor shares with its control plane, until its
    # disk is full (claims would stay as fast: docs/benchmarks.md, History). On, what goes is a
    # supervisor's record of runs a month after they ended; a control plane keeps its own records of what
    # it needs for longer (River, Oban and Sidekiq bound their history by default too; River keeps
    # completed jobs for 24 h). What would break if it changed: off, disks fill; shorter, a control plane
    # that reads results late (run_status) finds no run. A deployment that must keep everything says
    # keep_finished = "off". Whichever daemon of the fleet holds the lock prunes, with its own value: set
    # the same one on every host (README, Retention).
    keep_finished: float | None = 30 * 86400.0
    # Runs deleted per transaction: each batch commits on its own, so locks and the snapshot last one
    # batch, never a whole backlog.
    batch_size: int = 1000
    # How often a daemon tries a pass (one daemon of the fleet prunes at a time; the others skip). A
    # backlog (the first pass after an upgrade) is worked through one batch per loop iteration, with
    # the claims, probes and outcomes of the loop between them (daemon.RETENTION_PAUSE).
    interval: float = 600.0


# [river]: an identifier as PostgreSQL folds an unquoted one (lower case, at most 63 bytes), for River's
# schema and the two parts of the spec function's name; River's own queue and kind names are 1 to 127
# characters (its queue_length and kind_length constraints).
_SQL_NAME = r"[a-z_][a-z0-9_$]{0,62}"
_SQL_NAME_RE = re.compile(rf"^{_SQL_NAME}\Z")
_QUALIFIED_NAME_RE = re.compile(rf"^{_SQL_NAME}\.{_SQL_NAME}\Z")
RIVER_NAME_MAX = 127


@dataclass(frozen=True)
class RiverSettings:
    """A River source (docs/river.md): claim the River jobs of `kinds` in `queues` of River's tables in
    `schema` and make each a run with the platform's `spec_function`. Off while `schema` is empty."""

    # The schema River's tables are in ("public" when River was migrated without a schema).
    schema: str = ""
    # River queues and job kinds to serve: a job must be in one of the queues and of one of the kinds.
    queues: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    # The platform's function, schema-qualified: spec(job_args jsonb, job_kind text, job_id bigint)
    # RETURNS jsonb, submit_run's argument names as keys.
    spec_function: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.schema)


@dataclass(frozen=True)
class Settings:
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    host: HostSettings = field(default_factory=HostSettings)
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    systemd: SystemdSettings = field(default_factory=SystemdSettings)
    runs: RunSettings = field(default_factory=RunSettings)
    fleet: FleetSettings = field(default_factory=FleetSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    river: RiverSettings = field(default_factory=RiverSettings)
    source: str = "defaults"

    @property
    def host_id(self) -> str:
        return self.host.id or machine_id()

    @property
    def host_name(self) -> str:
        return self.host.name or socket.gethostname()


_SIZE_KEYS = {"memory_budget"}
_DURATION_KEYS = {"poll_interval", "reconcile_interval", "stop_grace", "host_dead_after", "interval"}
# Durations that may also be "off" (or 0), which becomes None.
_OPTIONAL_DURATION_KEYS = {"keep_finished"}
_CHOICES = {
    "protect_system": {"strict", "full", "yes", "no"},
    "protect_home": {"yes", "read-only", "tmpfs", "no"},
    "protect_proc": {"default", "invisible", "ptraceable", "noaccess"},
    "proc_subset": {"all", "pid"},
}
# Linux's capability numbers (linux/capability.h): a name's index is its bit in the D-Bus bitmask.
CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
    "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
    "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)
_ADDRESS_FAMILY_RE = re.compile(r"^AF_[A-Z0-9]+\Z")
_SYSCALL_RE = re.compile(r"^@?[a-z0-9_-]+\Z")
_UMASK_RE = re.compile(r"^0?[0-7]{3}\Z")
# \Z, not $: `$` also matches before a trailing newline.
_SLICE_RE = re.compile(r"^[A-Za-z0-9_.\-]+\.slice\Z")
_LISTEN_RE = re.compile(r"^(?:\[(?P<v6>[^\]]*)\]|(?P<v4>[^:\[\]]*)):(?P<port>[0-9]{1,5})\Z")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\Z")
# A run runs as root only where [runs] allowed_users names it: neither [runs] user nor a run's own
# run_user gets there otherwise (unitspec and the claim refuse a run_user not in allowed_users).
ROOT = "root"


def machine_id() -> str:
    try:
        return Path("/etc/machine-id").read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


# Whole numbers where 0 means "none", with an upper bound: the database refuses a tail over 64 KiB
# (attempts_output_tail_valid), and more than 1000 lines would be a log store, which journald is.
_BOUNDED_INTS = {"output_tail_lines": (0, 1000), "output_tail_bytes": (0, 65536)}
# Percentages of time stalled (PSI), above 0 and at most 100.
_PERCENT_KEYS = {"pressure_slow_at", "pressure_stop_at"}


def _convert(section: str, key: str, value: Any, default: Any) -> Any:
    where = f"[{section}] {key}"
    try:
        if key in _SIZE_KEYS:
            # `false` == 0 in Python, but it is no size: only "" or 0 mean "no budget".
            return None if value in ("", 0) and not isinstance(value, bool) else parse_size(value)
        if key in _DURATION_KEYS:
            return parse_duration(value)
        if key in _OPTIONAL_DURATION_KEYS:
            if isinstance(value, bool):
                raise QuantityError(f'invalid duration {value!r}: use a duration like "30d", or "off"')
            off = value == 0 or (isinstance(value, str) and value.strip() in RETENTION_OFF)
            return None if off else parse_duration(value)
    except QuantityError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if key in _PERCENT_KEYS:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 100:
            raise ConfigError(f"{where}: expected a percentage above 0 and at most 100")
        return float(value)
    if isinstance(default, dict):
        return _labels(where, value)
    if isinstance(default, tuple):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings")
        return tuple(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false")
        return value
    if key in _BOUNDED_INTS:
        low, high = _BOUNDED_INTS[key]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"{where}: expected a whole number from {low} to {high}")
        return value
    if isinstance(default, int):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: expected a whole number of at least 1")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string")
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ConfigError(f"{where}: expected one of {', '.join(sorted(_CHOICES[key]))}")
    return value


def _labels(where: str, value: Any) -> dict[str, str]:
    """A table of labels (`labels = { zone = "a" }`), each pair as a run's label must be."""
    if not isinstance(value, dict):
        raise ConfigError(f'{where}: expected a table of labels, like {{ zone = "a", disk = "ssd" }}')
    problem = labels_problem(value)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return dict(value)


def _section(cls: type, name: str, table: Any) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}]: expected a table")
    defaults = cls()
    known = {f.name for f in fields(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(f"[{name}] {key}: unknown key (known: {', '.join(sorted(known))})")
    values = {key: _convert(name, key, table[key], getattr(defaults, key)) for key in table}
    return cls(**values)


# A run's host_pin holds at most this (unitvisor.check_run_sizes, sql/migrations/015): a longer id could not be pinned.
HOST_ID_MAX = 255


def _validate(settings: Settings) -> None:
    if len(settings.host.id) > HOST_ID_MAX:
        raise ConfigError(f"[host] id: {len(settings.host.id)} characters, over the limit of {HOST_ID_MAX} "
                          "(a run's host_pin names a host id in at most that)")
    if not _SLICE_RE.match(settings.systemd.slice):
        raise ConfigError("[systemd] slice: expected a unit name ending in .slice")
    for user in (settings.runs.user, *settings.runs.allowed_users):
        if user and not _USER_RE.match(user):
            raise ConfigError(f"[runs] user {user!r}: not a valid user name")
    if settings.runs.user == ROOT and ROOT not in settings.runs.allowed_users:
        # Every run of the host would be root: said twice, so that it is never one slip of a key.
        raise ConfigError('[runs] user = "root" runs every run as root: also list "root" in [runs] '
                          "allowed_users to mean it, or leave user empty (a DynamicUser for each run)")
    for pattern in settings.runs.allowed_executables:
        if not pattern.startswith("/"):
            raise ConfigError(f"[runs] allowed_executables: {pattern!r} is not an absolute path")
        if "[" in pattern or "]" in pattern:
            # The database filters claims with the same patterns (as regular expressions): * and ?
            # translate exactly; character classes would be a second dialect to keep in step.
            raise ConfigError(f"[runs] allowed_executables: {pattern!r}: character classes ([...]) are not "
                              "supported; use * (any characters within one path component) or ?")
    for pattern in settings.runs.allowed_environment:
        if not NAME_PATTERN_RE.match(pattern):
            raise ConfigError(f"[runs] allowed_environment: {pattern!r} is not an environment name or pattern "
                              "(letters, digits and _, not starting with a digit; * and ? as wildcards)")
        problem = pattern_problem(pattern)
        if problem:
            raise ConfigError(f"[runs] allowed_environment: {problem}")
    _validate_pressure(settings.host)
    _validate_sandbox(settings.runs)
    _validate_fleet(settings)
    _validate_retention(settings.retention)
    _validate_river(settings.river)
    parse_listen(settings.metrics.listen)


def parse_listen(value: str) -> tuple[str, int] | None:
    """[metrics] listen as (address, port); None for "" (no metrics). Only IP addresses: the daemon
    binds once at start, and a name would put a DNS lookup (which may hang, or answer several
    addresses) in its start-up path."""
    if value == "":
        return None
    where = "[metrics] listen"
    match = _LISTEN_RE.match(value)
    if not match:
        raise ConfigError(f'{where}: {value!r} is not ADDRESS:PORT (for example "127.0.0.1:9863" or '
                          '"[::1]:9863"; "" for no metrics)')
    address = match.group("v6") if match.group("v6") is not None else match.group("v4")
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        raise ConfigError(f"{where}: {address!r} is not an IP address (a host name is not accepted: use "
                          "127.0.0.1, [::1], or this host's address)") from None
    if (parsed.version == 6) != (match.group("v6") is not None):
        raise ConfigError(f"{where}: an IPv6 address goes in brackets, an IPv4 one without: {value!r}")
    port = int(match.group("port"))
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}: port {port} is out of range (1 to 65535)")
    return address, port


def _validate_pressure(host: HostSettings) -> None:
    for name in host.pressure_resources:
        if name not in PRESSURE_RESOURCES:
            raise ConfigError(f"[host] pressure_resources: {name!r} is not one of {', '.join(PRESSURE_RESOURCES)}")
    if host.pressure_slow_at > host.pressure_stop_at:
        raise ConfigError(f"[host] pressure_slow_at ({host.pressure_slow_at:g}) is above pressure_stop_at "
                          f"({host.pressure_stop_at:g}): the host would stop claiming before it slowed down")


def _validate_sandbox(runs: RunSettings) -> None:
    caps = runs.capability_bounding_set
    if caps != ("all",):
        for name in caps:
            if name not in CAPABILITIES:
                raise ConfigError(f"[runs] capability_bounding_set: {name!r} is not a capability name "
                                  "(CAP_NET_BIND_SERVICE, ...; or [\"all\"] alone for every capability)")
    for name in runs.system_call_architectures:
        if not re.match(r"^[a-z0-9_-]+\Z", name):
            raise ConfigError(f"[runs] system_call_architectures: {name!r} is not an architecture name "
                              "(native, x86-64, ...)")
    for name in runs.system_call_filter:
        if not _SYSCALL_RE.match(name):
            raise ConfigError(f"[runs] system_call_filter: {name!r} is not a system call or @group name")
    if runs.system_call_error != "kill" and not (
            runs.system_call_error.startswith("E") and runs.system_call_error in errno.errorcode.values()):
        raise ConfigError(f"[runs] system_call_error: {runs.system_call_error!r} is not an errno name "
                          "(EPERM, EACCES, ...) or \"kill\"")
    for name in runs.restrict_address_families:
        if not _ADDRESS_FAMILY_RE.match(name):
            raise ConfigError(f"[runs] restrict_address_families: {name!r} is not an address family (AF_INET, ...)")
    if not _UMASK_RE.match(runs.umask):
        raise ConfigError(f"[runs] umask: {runs.umask!r} is not an octal mode like \"0077\"")


def cut_off_after(settings: Settings) -> float:
    """Seconds without a renewed heartbeat after which a daemon with stop_runs_when_cut_off stops its
    runs: early enough that the last one is dead (SIGKILL after stop_grace, plus a margin for the
    stop calls) before another host may declare this one dead at host_dead_after."""
    return settings.fleet.host_dead_after - settings.systemd.stop_grace - CUT_OFF_MARGIN


def _validate_fleet(settings: Settings) -> None:
    poll = settings.daemon.poll_interval
    dead_after = settings.fleet.host_dead_after
    if dead_after < 3 * poll:
        raise ConfigError(f"[fleet] host_dead_after: {dead_after:g}s is less than 3 poll intervals "
                          f"(3 x [daemon] poll_interval = {3 * poll:g}s): a host would be declared dead "
                          "after two missed heartbeats")
    if settings.fleet.stop_runs_when_cut_off and cut_off_after(settings) < 2 * poll:
        raise ConfigError(
            f"[fleet] stop_runs_when_cut_off: runs would be stopped after {cut_off_after(settings):g}s without a "
            f"heartbeat (host_dead_after - stop_grace - {CUT_OFF_MARGIN:g}s), less than 2 poll intervals "
            f"({2 * poll:g}s); raise host_dead_after or lower stop_grace or poll_interval")


def _validate_retention(retention: RetentionSettings) -> None:
    if retention.keep_finished is not None and retention.keep_finished < RETENTION_MIN_KEEP:
        raise ConfigError(f"[retention] keep_finished: {retention.keep_finished:g}s is less than 1h, the least a "
                          'host may prune at (the database refuses less); "off" keeps history for ever')
    if retention.batch_size > RETENTION_MAX_BATCH:
        raise ConfigError(f"[retention] batch_size: {retention.batch_size} is out of range (1 to "
                          f"{RETENTION_MAX_BATCH}): one batch is one transaction, which must stay short")


def _validate_river(river: RiverSettings) -> None:
    """[river]: all of it or none of it; names the database will take as they are written."""
    given = {f.name for f in fields(RiverSettings) if getattr(river, f.name) != getattr(RiverSettings(), f.name)}
    if not given:
        return
    for key in ("schema", "queues", "kinds", "spec_function"):
        if key not in given:
            raise ConfigError(f"[river] {key}: required when [river] is set (docs/river.md)")
    if not _SQL_NAME_RE.match(river.schema):
        raise ConfigError(f"[river] schema: {river.schema!r} is not a lower-case SQL name (letters, digits, _; "
                          "at most 63 characters)")
    if not _QUALIFIED_NAME_RE.match(river.spec_function):
        raise ConfigError(f"[river] spec_function: {river.spec_function!r} is not a schema-qualified lower-case "
                          'function name, such as "platform.unitvisor_spec"')
    for key in ("queues", "kinds"):
        names = getattr(river, key)
        for name in names:
            if not 0 < len(name) <= RIVER_NAME_MAX or not name.isprintable():
                raise ConfigError(f"[river] {key}: {name[:40]!r} is not a River {key[:-1]} name "
                                  f"(1 to {RIVER_NAME_MAX} printable characters)")
        if len(set(names)) != len(names):
            raise ConfigError(f"[river] {key}: a name is listed twice")


_SECTIONS = {
    "database": DatabaseSettings,
    "host": HostSettings,
    "daemon": DaemonSettings,
    "systemd": SystemdSettings,
    "runs": RunSettings,
    "fleet": FleetSettings,
    "metrics": MetricsSettings,
    "retention": RetentionSettings,
    "river": RiverSettings,
}


def parse(text: str, source: str = "<string>") -> Settings:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise ConfigError(f"{source}: unknown section [{sorted(unknown)[0]}] (known: {', '.join(_SECTIONS)})")
    try:
        sections = {name: _section(cls, name, data.get(name, {})) for name, cls in _SECTIONS.items()}
        three_polls = 3 * sections["daemon"].poll_interval
        if "host_dead_after" not in data.get("fleet", {}) and three_polls > FleetSettings.host_dead_after:
            # A longer poll interval stretches the default with it, rather than failing validation
            # over a key its author never set.
            sections["fleet"] = replace(sections["fleet"], host_dead_after=three_polls)
        settings = Settings(**sections, source=source)
        _validate(settings)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return settings


def load(path: Path | None) -> Settings:
    """Read the config; with no path given and no file at the default place, the defaults apply."""
    explicit = path is not None
    path = path or DEFAULT_PATH
    try:
        text = path.read_text()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: no such file") from None
        return Settings()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(text, str(path))


def private_file_problem(path: Path, holds: str) -> str | None:
    """Why a file that holds credentials may not be trusted with them (as ssh judges a private key):
    it must belong to root or to whoever reads it, and give no access to group or others. None: fine."""
    info = path.stat()
    if info.st_uid not in (0, os.geteuid()):
        return f"{path} {holds} but belongs to uid {info.st_uid}, not root; chown root: {path}"
    if info.st_mode & 0o077:
        return f"{path} {holds} but its mode {info.st_mode & 0o777:04o} lets group or others read it; chmod 600 {path}"
    return None


def _has_password(dsn: str) -> bool:
    try:
        return bool(conninfo_to_dict(dsn).get("password"))
    except psycopg.ProgrammingError:
        return False  # not a DSN at all: connecting says so


def resolve_dsn(settings: Settings, override: str | None, file_override: str | Path | None = None) -> str:
    """The DSN from --dsn, then --dsn-file, then $UNITVISOR_DSN, then $UNITVISOR_DSN_FILE, then the
    config's [database] dsn, then its root-only DSN file ([database] dsn_file, /etc/unitvisor/dsn).

    A password is refused where others could read it: in a config file that is not private (the
    packaged one is world-readable, as conffiles are), or in a DSN file that is not (doctor and the
    daemon say which and how to fix it, once, instead of leaking it on). A DSN file the operator names
    (--dsn-file, $UNITVISOR_DSN_FILE: the home that keeps the admin's password out of `ps` and shell
    history) is judged as the host's own, as ssh judges a private key, and must exist and hold one."""
    if override and file_override:
        raise ConfigError("--dsn and --dsn-file both given: give one")
    if override:
        return override
    if file_override:
        return read_dsn_file(Path(file_override), "--dsn-file")
    if os.environ.get("UNITVISOR_DSN"):
        return os.environ["UNITVISOR_DSN"]
    if os.environ.get("UNITVISOR_DSN_FILE"):
        return read_dsn_file(Path(os.environ["UNITVISOR_DSN_FILE"]), "UNITVISOR_DSN_FILE")
    return configured_dsn(settings)


def shell_dsn_origin(override: str | None, file_override: str | Path | None = None) -> str | None:
    """Which of the shell's ways to give a DSN gives it (resolve_dsn's order), for people; None when the
    shell gives none and the config's applies."""
    if override:
        return "--dsn"
    if file_override:
        return f"--dsn-file {file_override}"
    if os.environ.get("UNITVISOR_DSN"):
        return "UNITVISOR_DSN"
    if os.environ.get("UNITVISOR_DSN_FILE"):
        return f"UNITVISOR_DSN_FILE ({os.environ['UNITVISOR_DSN_FILE']})"
    return None


def configured_dsn_origin(settings: Settings) -> str:
    """Where the config's DSN comes from (configured_dsn), for people."""
    return f"[database] dsn in {settings.source}" if settings.database.dsn else settings.database.dsn_file


def configured_dsn(settings: Settings) -> str:
    """The DSN of the config alone: its [database] dsn, else its DSN file. What the daemon connects with:
    its unit starts `unitvisor daemon` with neither --dsn nor a UNITVISOR_DSN (resolve_dsn's rules)."""
    if settings.database.dsn:
        source = Path(settings.source)
        if _has_password(settings.database.dsn) and source.is_file():
            problem = private_file_problem(source, "has a password in [database] dsn")
            if problem:
                raise ConfigError(f"{problem}; or better, move the DSN to {settings.database.dsn_file}")
        return settings.database.dsn
    dsn_file = Path(settings.database.dsn_file)
    try:
        dsn = dsn_file.read_text().strip()
        problem = private_file_problem(dsn_file, "holds the database DSN") if dsn else None
    except FileNotFoundError:
        dsn, problem = "", None
    except OSError as exc:
        raise ConfigError(f"{dsn_file}: cannot read the database DSN: {exc.strerror}") from None
    if problem:
        raise ConfigError(problem)
    if not dsn:
        raise ConfigError(f"no database configured: set --dsn, --dsn-file, UNITVISOR_DSN, UNITVISOR_DSN_FILE, "
                          f"[database] dsn, or write it to {dsn_file}")
    return dsn


def read_dsn_file(path: Path, named_by: str) -> str:
    """The DSN in a file the caller named (`named_by` says where): it must exist, hold a DSN, and be
    private (mode 0600 or 0400, owned by root or by whoever reads it), whether or not the DSN in it has
    a password: a file named for credentials is treated as holding them."""
    try:
        dsn = path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"{path} ({named_by}): no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path} ({named_by}): cannot read the database DSN: {exc.strerror}") from None
    problem = private_file_problem(path, "holds the database DSN")
    if problem:
        raise ConfigError(problem)
    if not dsn:
        raise ConfigError(f"{path} ({named_by}) is empty: write the DSN in it, on one line")
    return dsn
