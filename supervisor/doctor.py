"""`unitvisor doctor`: is this host fit to run runs? Each check is one line: ok, warn or fail, and
what to do about it."""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor import cgroup, config, fleet, pressure, store, taskspeak
from supervisor.systemd import Systemd, SystemdError

PERSISTENT_JOURNAL = Path("/var/log/journal")
MACHINE_ID = Path("/etc/machine-id")
# The controllers behind the limits a run can have: MemoryMax, CPUQuota, TasksMax, IOWeight.
NEEDED_CONTROLLERS = ("memory", "cpu", "pids", "io")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, warn, fail
    message: str


def cgroup_check(root: Path = cgroup.ROOT) -> Check:
    available = cgroup.controllers(root)
    if available is None:
        return Check("cgroups", "warn", "legacy (v1) cgroup hierarchy: systemd records the limits but may not "
                     "enforce them all; boot with systemd.unified_cgroup_hierarchy=1")
    missing = [c for c in NEEDED_CONTROLLERS if c not in available]
    if missing:
        return Check("cgroups", "warn", f"cgroup v2 without {', '.join(missing)}: those limits are not enforced")
    return Check("cgroups", "ok", f"cgroup v2 with {', '.join(NEEDED_CONTROLLERS)}")


def pressure_check(host: config.HostSettings, slice_name: str, cgroup_root: Path = cgroup.ROOT,
                   proc_pressure: Path = pressure.PROC_PRESSURE) -> Check:
    """Whether admission by pressure acts here: the daemon reads the same files with the same code
    (pressure.read, pressure.decide), so what this says is what it does. Off where PSI cannot be read
    (a cgroup-v1 or hybrid host, a kernel with PSI disabled) is a warning: such a host claims into a
    slice that is already thrashing. Off by [host] pressure_resources = [] is the administrator's
    choice, and says so."""
    if not host.pressure_resources:
        return Check("pressure", "ok", "admission by pressure off by [host] pressure_resources = []")
    reading = pressure.read(slice_name, host.pressure_resources, cgroup_root, proc_pressure)
    if reading.unavailable is not None:
        return Check("pressure", "warn", f"PSI unavailable ({reading.unavailable}): admission by pressure is off, "
                     "this host claims whatever its runs' stall")
    admission = pressure.decide(reading, host.pressure_slow_at, host.pressure_stop_at, 1)
    where = (f"{slice_name}'s pressure files" if (cgroup_root / slice_name).is_dir()
             else f"{proc_pressure} (no run in {slice_name} yet, so no cgroup of it to read)")
    said = f"PSI read from {where}: admission by pressure active ({', '.join(host.pressure_resources)}; slows " \
           f"at {host.pressure_slow_at:g}%, stops at {host.pressure_stop_at:g}%)"
    if admission.state == pressure.OPEN:
        return Check("pressure", "ok", said)
    return Check("pressure", "warn", f"{said}; now {admission.detail}")


def tasks_peak_check(cgroup_root: Path = cgroup.ROOT, release: str | None = None) -> Check:
    """Whether a run's peak tasks (tasks_peak) is measured: the same test the reconciler makes once
    (taskspeak.available). Where it is not, the figure is NULL, which show and --json explain."""
    why = taskspeak.unavailable(cgroup_root, release)
    if why is None:
        return Check("tasks peak", "ok", "measured (each run's cgroup's pids.peak, read as its unit ends)")
    return Check("tasks peak", "warn", f"not measured: {why}; runs record tasks_peak NULL (pids.peak needs cgroup "
                 "v2 with the pids controller on Linux 6.1 or later, as Debian 12 and 13 boot by default)")


def journal_check(persistent: Path = PERSISTENT_JOURNAL, machine_id: Path = MACHINE_ID) -> Check:
    """A run that succeeds while the daemon is down is proven only by PID 1's journal records
    (supervisor/journal.py); across a reboot that takes a persistent journal, which journald keeps in
    /var/log/journal/<machine id> (Storage=persistent, or auto with /var/log/journal present). The
    directory is what journald actually uses, whatever journald.conf and its drop-ins say."""
    try:
        ident = machine_id.read_text().strip()
    except OSError as exc:
        return Check("journal", "warn", f"cannot read {machine_id} ({exc.strerror}): cannot tell whether the "
                     "journal is persistent")
    if ident and (persistent / ident).is_dir():
        return Check("journal", "ok", f"persistent ({persistent / ident})")
    return Check("journal", "warn", "volatile: a run that succeeds while the daemon is down is recorded lost "
                 "after a reboot; mkdir -p /var/log/journal && systemctl restart systemd-journald")


def root_runs_check(runs: config.RunSettings) -> list[Check]:
    """Advice, not a failure: root runs are allowed when named, but a root run can read every other
    run's environment file and undo the host's sandbox, so the administrator should see it each time."""
    keys = [key for key, names_root in (("user", runs.user == config.ROOT),
                                        ("allowed_users", config.ROOT in runs.allowed_users)) if names_root]
    if not keys:
        return []
    who = "every run" if runs.user == config.ROOT else "a run that asks for it"
    return [Check("root runs", "warn", f"[runs] {' and '.join(keys)} name{'s' if len(keys) == 1 else ''} root: "
                  f"{who} runs as root on this host; list a dedicated user instead unless a run really needs root")]


def root_alias_check(runs: config.RunSettings,
                     getpwnam: Callable[[str], pwd.struct_passwd] = pwd.getpwnam) -> list[Check]:
    """A user of id 0 under another name than root is root to the kernel, but not to the daemon,
    which keys root runs on the name: they would run without the root warning, and without the
    confinement that keeps a root run off PID 1, the bus, the DSN and other runs' environment files
    (unitspec.root_confinement)."""
    aliases = []
    for name in dict.fromkeys((runs.user, *runs.allowed_users)):
        if not name or name == config.ROOT:
            continue
        try:
            if getpwnam(name).pw_uid == 0:
                aliases.append(name)
        except KeyError:
            continue  # no such user here: a run as that user fails to start, and says so
    return [Check("root runs", "fail", f"[runs] user {name} has user id 0: name it root (and list root in "
                  "allowed_users) so that its runs are treated as root runs") for name in aliases]


def run_checks(config_path: Path | None, dsn_override: str | None, dsn_file: str | Path | None = None) -> list[Check]:
    checks: list[Check] = []
    try:
        settings = config.load(config_path)
        checks.append(Check("config", "ok", f"{settings.source} parses"))
    except config.ConfigError as exc:
        return [Check("config", "fail", f"{exc}; fix the file, every key is documented in the example")]
    if settings.runs.allowed_executables:
        checks.append(Check("allowlist", "ok", f"{len(settings.runs.allowed_executables)} allowed executables"))
    else:
        checks.append(Check("allowlist", "warn", "[runs] allowed_executables is empty: this host claims no run"))
    checks += root_runs_check(settings.runs) + root_alias_check(settings.runs)
    if os.geteuid() != 0:
        checks.append(Check("root", "warn", "not running as root: a daemon started like this claims no run "
                            "(systemd starts units only for root)"))
    systemd_checks, daemon_pid = _systemd_checks(settings)
    checks += _database_checks(settings, dsn_override, daemon_pid, dsn_file)
    checks += systemd_checks
    checks.append(cgroup_check())
    checks.append(pressure_check(settings.host, settings.systemd.slice))
    checks.append(tasks_peak_check())
    checks.append(journal_check())
    return checks


@dataclass(frozen=True)
class DsnChoice:
    """Which DSN doctor checks: the daemon's (`daemons`) or the shell's, where it comes from (`origin`, for
    people), and where the shell's comes from when it gives one besides the daemon's (`other`)."""
    daemons: bool
    origin: str
    other: str | None = None


def choose_dsn(settings: config.Settings, dsn_override: str | None, dsn_file: str | Path | None,
               euid: int) -> DsnChoice:
    """As root with the daemon's config (/etc/unitvisor/unitvisor.toml), the daemon's DSN: the one the
    host must reach, whatever the shell gives (an operator's admin DSN in UNITVISOR_DSN_FILE reached the
    database while the daemon's /etc/unitvisor/dsn did not, and doctor said ok). Elsewhere (not root: the
    daemon's DSN file is root's; another config: not the daemon's) the shell's, as every command."""
    shell = config.shell_dsn_origin(dsn_override, dsn_file)
    source = Path(settings.source)
    if euid == 0 and source.is_file() and source.resolve() == config.DEFAULT_PATH.resolve():
        return DsnChoice(True, f"the daemon's DSN from {config.configured_dsn_origin(settings)}", shell)
    return DsnChoice(False, f"the DSN from {shell or config.configured_dsn_origin(settings)}")


def _shell_dsn_check(settings: config.Settings, dsn_override: str | None, dsn_file: str | Path | None,
                     origin: str, daemon_dsn: str | None) -> Check:
    """The DSN the shell gives besides the daemon's, said apart from it: a warning at most, since the
    host's fitness is the daemon's DSN's."""
    said = f"{origin} (this shell's, for the commands run here; not the daemon's)"
    try:
        dsn = config.resolve_dsn(settings, dsn_override, dsn_file)
        if dsn == daemon_dsn:
            return Check("shell DSN", "ok", f"{origin} gives the daemon's DSN")
        with store.connect(dsn):
            pass
    except (config.ConfigError, store.DatabaseError) as exc:
        return Check("shell DSN", "warn", f"{said}: {exc}")
    return Check("shell DSN", "ok", f"{said}: reachable at {store.dsn_location(dsn)}")


def _database_checks(settings: config.Settings, dsn_override: str | None, daemon_pid: int = 0,
                     dsn_file: str | Path | None = None, euid: int | None = None) -> list[Check]:
    choice = choose_dsn(settings, dsn_override, dsn_file, os.geteuid() if euid is None else euid)
    checks = _database_checks_of(settings, choice, dsn_override, dsn_file, daemon_pid)
    if choice.other:
        daemon_dsn = _quietly(lambda: config.configured_dsn(settings))
        checks.insert(1, _shell_dsn_check(settings, dsn_override, dsn_file, choice.other, daemon_dsn))
    return checks


def _quietly(read: Callable[[], str]) -> str | None:
    try:
        return read()
    except config.ConfigError:
        return None


def _database_checks_of(settings: config.Settings, choice: DsnChoice, dsn_override: str | None,
                        dsn_file: str | Path | None, daemon_pid: int) -> list[Check]:
    try:
        dsn = (config.configured_dsn(settings) if choice.daemons
               else config.resolve_dsn(settings, dsn_override, dsn_file))
        with store.connect(dsn) as conn:
            pending = store.pending_migrations(conn)
            db_now = store.now(conn).timestamp()
            hosts = {row["id"]: row for row in store.list_hosts(conn)} if not pending else {}
            identity = store.whoami(conn) if not pending else None
            defaults = store.role_settings(conn)
            open_to_all = store.public_may_connect(conn)
    except (config.ConfigError, store.DatabaseError) as exc:
        return [Check("database", "fail", f"{choice.origin}: {exc}")]
    checks = [Check("database", "ok", f"{choice.origin}: reachable at {store.dsn_location(dsn)}")]
    if pending:
        checks.append(Check("schema", "fail", f"missing migrations {', '.join(pending)}: run `unitvisor migrate`"))
    else:
        checks.append(Check("schema", "ok", "current"))
    if identity is not None:
        checks.append(role_check(identity, settings.host_id))
    checks.append(role_settings_check(defaults))
    checks.append(Check("connect", "warn", "every role of the cluster may connect to this database (PUBLIC holds "
                        "CONNECT): revoke it as README's Install does") if open_to_all
                  else Check("connect", "ok", "only the roles granted CONNECT may connect to this database"))
    if not pending:
        checks.append(host_id_check(settings.host_id, hosts.get(settings.host_id),
                                    fleet.instance_id(config.machine_id(), daemon_boot_id(daemon_pid))))
    skew = abs(time.time() - db_now)
    checks.append(Check("clock", "ok" if skew < 1 else "warn",
                        f"{skew:.2f}s from the database's clock" + ("" if skew < 1 else "; run NTP on both")))
    return checks


def role_check(identity: store.Identity, host_id: str) -> Check:
    """Which kind of database role this host's DSN logs in as (README, Roles: who may do what), and
    whether its daemon may act as this host's id with it."""
    if identity.kind == "admin":
        return Check("role", "ok", "admin (a member of unitvisor_admin: may act as any host; give each host "
                     "its own role with `unitvisor hosts add`)")
    if identity.kind == "host" and identity.host_id == host_id:
        return Check("role", "ok", f"host, bound to {host_id}")
    if identity.kind == "host":
        return Check("role", "fail", f"host, bound to {identity.host_id}, but this host's id is {host_id}: the "
                     f"daemon may not act as it; set [host] id = \"{identity.host_id}\" or use {host_id}'s DSN")
    if identity.kind == "submitter":
        return Check("role", "fail", "submitter (a control plane's role): the daemon may not act as any host; "
                     "give this host its own role with `unitvisor hosts add`")
    return Check("role", "fail", "unbound (no unitvisor role, or a host role bound to no host id): the daemon "
                 "may not act as any host; give this host its own role with `unitvisor hosts add`")


def role_settings_check(defaults: list[str]) -> Check:
    """Session defaults set on the DSN's role (ALTER ROLE ... SET). A host role may set them on itself
    (PostgreSQL lets any role), and they reach every session of the daemon: default_transaction_read_only
    = on, say, makes every write of the daemon fail. The daemon sets only the timeouts it needs itself
    (store.SESSION_SETTINGS), so anything here was set by someone holding the role or its admin."""
    if not defaults:
        return Check("role settings", "ok", "none set on this role")
    return Check("role settings", "warn", f"{', '.join(defaults)} set on this role (ALTER ROLE ... SET): every "
                 "session of the daemon starts with them; if nobody meant to, remove them as the admin with "
                 "ALTER ROLE ... RESET ALL (and IN DATABASE ... RESET ALL)")


def host_id_check(host_id: str, row: dict | None, instance: str) -> Check:
    """Whether this host's id is this machine's alone: a cloned machine id or a reused [host] id makes
    two daemons share one id, and only one of them works."""
    if row is None:
        return Check("host id", "ok", f"{host_id} (not registered yet: the daemon registers it)")
    state = fleet.host_display_state(row)
    if "conflict" in state:
        return Check("host id", "fail", f"{host_id}: {row['conflict_detail']} {row['conflict_age']:.0f}s ago; give "
                     "each host its own [host] id (or machine id: systemd-machine-id-setup)")
    # The rule register_host applies (sql/migrations/013_fleet_promises.sql): another instance holds the id while it
    # is heard from within its own host_dead_after and is active or draining, or has attempts open.
    dead_after = row.get("dead_after_sec") or 60.0
    if row["instance"] not in (None, instance) and row["heartbeat_age"] < dead_after:
        if row["state"] in ("active", "draining"):
            return Check("host id", "fail", f"{host_id} is in use by another machine or boot (instance "
                         f"{row['instance']}, heard from {row['heartbeat_age']:.0f}s ago); give each host its own "
                         "[host] id")
        if row.get("in_flight"):
            # A host that stopped with runs open: this machine after a reboot, or another machine with
            # this id. Either way the id is free only once the silence has lasted host_dead_after.
            return Check("host id", "warn", f"{host_id} is held by instance {row['instance']}, {row['state']} with "
                         f"{row['in_flight']} run(s) open (this machine before a reboot, or another machine with "
                         f"this id): the daemon takes it over in {dead_after - row['heartbeat_age']:.0f}s, once "
                         f"it has been silent for its host_dead_after ({dead_after:g}s)")
    if row["state"] == "dead":
        return Check("host id", "warn", f"{host_id} was declared dead ({row['dead_reason']}); the daemon registers "
                     "it again when it runs, and stops what was taken over")
    return Check("host id", "ok", f"{host_id} ({state}, epoch {row['epoch']})")


def daemon_boot_id(daemon_pid: int) -> str:
    """The boot id as the running daemon sees it, read through its own root: in a container,
    ProtectKernelTunables= hides the container's boot id from the daemon (it sees the kernel's), so
    this command, outside the daemon's mount namespace, would otherwise compute another instance and
    take its own daemon for another machine. Without a daemon (or its root unreadable): our own."""
    if daemon_pid > 0:
        seen = fleet.boot_id(Path(f"/proc/{daemon_pid}/root/proc/sys/kernel/random/boot_id"))
        if seen:
            return seen
    return fleet.boot_id()


def _systemd_checks(settings: config.Settings) -> tuple[list[Check], int]:
    """The checks, and the daemon's main pid (0: not running)."""
    systemd = Systemd()
    try:
        systemd.connect()
        slice_state = systemd.load_state(settings.systemd.slice)
        daemon_pid = systemd.main_pid("unitvisor.service")
    except SystemdError as exc:
        return [Check("systemd", "fail", f"{exc}; unitvisor needs root and the system bus")], 0
    finally:
        systemd.close()
    checks = [Check("systemd", "ok", "reachable over D-Bus")]
    if slice_state == "loaded":
        checks.append(Check("slice", "ok", f"{settings.systemd.slice} exists"))
    else:
        checks.append(Check("slice", "warn", f"{settings.systemd.slice} is {slice_state}: runs get an implicit "
                            "slice with no host-wide limits; install units/unitvisor.slice"))
    return checks, daemon_pid
