"""The parts of the benchmark that must run inside the test bed, next to its systemd.

`bench.run` (outside) runs this file with the checkout's virtualenv python through the test bed's
`run()`; each subcommand prints one JSON object on stdout and nothing else. It is a plain script,
not a module of the package, because `nsenter` starts it in the container's root directory, where
the checkout is not on sys.path.

Subcommands:
  limit      StartTransientUnit in a loop on one connection: systemd's own limit, the baseline
  outcome-loop  the daemon's systemd side alone: starts as slots free, each end read from its signals
  active     one start at a time, timed to the unit being active
  units      start long-running units under given names (the loaded units of a reconcile pass)
  reconcile  one reconcile pass (or its decide phase) through supervisor.reconciler.Reconciler
  tails      the cost of reading ended runs' output tails (one journalctl per outcome, or per batch)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg

from supervisor import config, store, taskspeak, unitspec
from supervisor.journal import Journal
from supervisor.model import Attempt, Run
from supervisor.systemd import Systemd, Watcher

BENCH_CONFIG = """
[runs]
allowed_executables = ["/bin/true", "/bin/sleep", "/usr/bin/seq"]
"""
# [runs] keys that turn the run sandbox off, so that one benchmark run compares the sandbox with its
# absence, and unitvisor with its sandbox off with peers that start bare units: every sandbox property
# at systemd's default, and no mount namespace (private_tmp, protect_system and protect_home off, and
# a fixed user instead of a DynamicUser, which implies all three). NoNewPrivileges stays: it costs
# systemd nothing measurable, and it is what lets such a unit go without InaccessiblePaths= (unitspec).
# "nobody" stands for the dedicated user a host would name.
SANDBOX_KEYS_OFF = """
capability_bounding_set = ["all"]
protect_proc = "default"
protect_kernel = false
protect_control_groups = false
protect_clock = false
protect_hostname = false
restrict_namespaces = false
restrict_suid_sgid = false
restrict_realtime = false
lock_personality = false
system_call_architectures = []
system_call_filter = []
restrict_address_families = []
private_devices = false
umask = "0022"
"""
UNSANDBOXED_RUNS = """
user = "nobody"
private_tmp = false
protect_system = "no"
protect_home = "no"
""" + SANDBOX_KEYS_OFF


def _bare_props(argv: list[str]) -> dict[bytes, Any]:
    """The least a transient service needs: what `systemd-run /bin/true` sends."""
    return {
        b"Description": b"unitvisor bench",
        b"ExecStart": [(argv[0].encode(), [a.encode() for a in argv], False)],
    }


def _product_props(argv: list[str], sandbox: bool = True, runs_extra: str | None = None,
                   copy_tasks_peak: bool | None = None) -> dict[bytes, Any]:
    """Exactly the properties the daemon gives a run's unit (unitspec.build), for a run of argv; with
    `sandbox` off, as a host configured with UNSANDBOXED_RUNS gives it; with `runs_extra`, as a host
    with those [runs] keys does. The tasks-peak stop command as the daemon on this host gives it
    (taskspeak.available()), unless `copy_tasks_peak` says."""
    if runs_extra is None:
        runs_extra = "" if sandbox else UNSANDBOXED_RUNS
    settings = config.parse(BENCH_CONFIG + runs_extra)
    run_id = uuid.uuid4()
    run = Run(id=run_id, argv=argv)
    attempt = Attempt(run_id=run_id, attempt=1, host_id="bench", unit_name=unitspec.unit_name(run_id, 1))
    if copy_tasks_peak is None:
        copy_tasks_peak = taskspeak.available()
    return unitspec.build(run, attempt, settings, copy_tasks_peak=copy_tasks_peak)


def _units_like(systemd: Systemd, pattern: str) -> list[tuple[str, str, str]]:
    """(name, active state, sub state) of the loaded units matching a glob, in one D-Bus call."""
    from pystemd.dbuslib import apply_signature

    from supervisor.systemd import MANAGER_IFACE, MANAGER_PATH

    rows = systemd._call(MANAGER_PATH, MANAGER_IFACE, b"ListUnitsByPatterns",
                         apply_signature(b"asas", [[], [pattern.encode()]]), "listing")
    return [(r[0].decode(), r[3].decode(), r[4].decode()) for r in rows]


def wait(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def unit_props(kind: str, argv: list[str]) -> dict[bytes, Any]:
    """A run's unit properties of one of PROPS; bench/peers.py starts its units with these too."""
    if kind == "bare":
        return _bare_props(argv)
    return _product_props(argv, sandbox=kind == "product")


# PID 1 tracks the bus client of every queued job with a match rule of its own, and dbus-daemon allows
# one connection 512 (max_match_rules_per_connection): with more start jobs queued than that, PID 1
# loses its bus connection ("Message recipient disconnected from message bus without replying",
# seen with the sandboxed units, whose starts are slower than the loop). The daemon never has more
# than max_runs (64) starts in flight; the loop here waits for the queue to halve past this many.
MAX_QUEUED_JOBS = 256


def queued_jobs(systemd: Systemd) -> int:
    """Jobs in PID 1's queue (start jobs not yet done), in one D-Bus call."""
    from supervisor.systemd import MANAGER_IFACE, MANAGER_PATH

    return len(systemd._call(MANAGER_PATH, MANAGER_IFACE, b"ListJobs", [], "listing jobs"))


def start_all(props: dict[bytes, Any], n: int, prefix: str) -> dict[str, Any]:
    """N starts back to back on one connection, each call timed; then how long systemd took to run
    them all (the loop only enqueues start jobs: StartTransientUnit returns before the unit runs; it
    waits only when MAX_QUEUED_JOBS are queued, and says for how long)."""
    systemd = Systemd()
    systemd.connect()
    calls = []
    throttled_s = 0.0
    t0 = time.perf_counter()
    for i in range(n):
        if i % 32 == 0 and queued_jobs(systemd) > MAX_QUEUED_JOBS:
            w0 = time.perf_counter()
            wait(lambda: queued_jobs(systemd) <= MAX_QUEUED_JOBS // 2, 300)
            throttled_s += time.perf_counter() - w0
        c0 = time.perf_counter()
        systemd.start_transient(f"{prefix}-{i}.service", props)
        calls.append((time.perf_counter() - c0) * 1000)
    loop_s = time.perf_counter() - t0
    pattern = f"{prefix}-*.service"
    if not props.get(b"RemainAfterExit") and not props.get(b"AddRef"):
        # Neither RemainAfterExit nor AddRef: a unit that ran is unloaded at once, so "none left"
        # means "all ran".
        drained = wait(lambda: not _units_like(systemd, pattern), 300)
    else:
        # RemainAfterExit=yes, or AddRef (as the daemon's units: this connection holds them loaded
        # once ended, inactive or failed): all ran when none is still starting.
        drained = wait(lambda: all(sub in ("exited", "failed", "dead") or active == "failed"
                                    for _, active, sub in _units_like(systemd, pattern)), 300)
    drain_s = time.perf_counter() - t0
    for name, _, _ in _units_like(systemd, pattern):  # clean up, untimed
        systemd.release(name)
    systemd.close()
    return {"n": n, "call_ms": calls, "loop_s": loop_s, "drain_s": drain_s, "drained": drained,
            "throttled_s": throttled_s}


def cmd_limit(args: argparse.Namespace) -> dict[str, Any]:
    """`start_all` of one kind of unit (PROPS), or of bare units with some of the daemon's properties."""
    props = unit_props(args.props, ["/bin/true"])
    if args.with_props:
        # Which of the daemon's unit properties cost systemd what: bare, plus only these.
        product = _product_props(["/bin/true"])
        for key in args.with_props.split(","):
            props[key.encode()] = product[key.encode()]
    return {"props": args.props, **start_all(props, args.n, args.prefix)}


def outcome_loop(props: dict[bytes, Any], n: int, prefix: str, hold: bool, split: bool = False,
                 max_runs: int = 64, batch: int = 32) -> dict[str, Any]:
    """The daemon's side of systemd alone, with no database and none of its bookkeeping (issue 27): at
    most `max_runs` units at once, started `batch` at a time as slots free (the packaged max_runs and
    claim_batch), each unit's end taken from its signals (Watcher, subscribed as the daemon is) and,
    with `hold`, read and released as the daemon does (AddRef, the ended unit's accounting, UnrefUnit);
    without it the units are not held and their signals alone say they ended. Beside the raw loop
    (`start_all`) and the daemon, it says how much of the daemon's gap to the raw loop is what reading
    outcomes costs PID 1 and the bus, and how much the rest of the loop (PostgreSQL, logs, rows).

    `split` (with `hold`) is the design issue 27 proposes, tried: the signals and the accounting's reads
    in a second process on a connection of its own, which tells this one (through a pipe) each unit that
    ended; this one starts and releases. A process, not a thread: pystemd waits for PID 1's reply holding
    the GIL (sd_bus_call, with no `nogil` and no asynchronous call in 0.15), so a thread would wait too."""
    if not hold:
        props = {k: v for k, v in props.items() if k != b"AddRef"}
    reader_r = reader = None
    if split:
        reader_r, writer = os.pipe()
        reader = os.fork()
        if reader == 0:  # the reader: signals and accounting, each ended unit's name and state down the pipe
            os.close(reader_r)
            code = 0
            try:
                _read_outcomes(prefix, n, writer)
            except BaseException:
                code = 1
            os._exit(code)
        os.close(writer)
    systemd = Systemd()
    systemd.connect()
    watcher = None if split else Watcher(prefix)
    if watcher is not None:
        watcher.connect()
    running: set[str] = set()
    started = ended = reads = 0
    pending = b""
    t0, self0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    while ended < n:
        take = min(batch, max_runs - len(running), n - started)
        for _ in range(max(take, 0)):
            name = f"{prefix}{started}.service"
            systemd.start_transient(name, props)
            running.add(name)
            started += 1
        if reader_r is not None:
            select.select([reader_r], [], [], 1.0)
            pending += os.read(reader_r, 65536)
            *lines, pending = pending.split(b"\n")
            for line in lines:
                name, active_state = line.decode().split()
                systemd.release(name, None if active_state == "-" else active_state)
                running.discard(name)
                ended += 1
            continue
        assert watcher is not None
        select.select([watcher.fileno()], [], [], 1.0)
        changed, _ = watcher.drain()
        over, read = _ended(systemd, watcher, changed & running, read_all=hold)
        reads += read
        for name, active_state in over:
            if hold:
                systemd.release(name, active_state)
            running.discard(name)
            ended += 1
    seconds, self1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    if watcher is not None:
        watcher.close()
    systemd.close()
    if reader is not None:
        os.waitpid(reader, 0)
    return {"n": n, "hold": hold, "split": split, "max_runs": max_runs, "seconds": seconds,
            "runs_per_s": n / seconds, "state_reads": reads, "cpu_ms_per_run": _cpu_ms(self0, self1) / n}


def _read_outcomes(prefix: str, n: int, out: int) -> None:
    """outcome_loop's reader process: `n` ended units of `prefix`, each as "name active_state" on `out`."""
    systemd, watcher = Systemd(), Watcher(prefix)
    systemd.connect()
    watcher.connect()
    done: set[str] = set()
    while len(done) < n:
        select.select([watcher.fileno()], [], [], 1.0)
        changed, _ = watcher.drain()
        over, _ = _ended(systemd, watcher, changed - done, read_all=True)
        done.update(name for name, _ in over)
        if over:
            os.write(out, "".join(f"{name} {active_state or '-'}\n" for name, active_state in over).encode())


def _ended(systemd: Systemd, watcher: Watcher, names: set[str],
           read_all: bool) -> tuple[list[tuple[str, str | None]], int]:
    """Which of `names` (changed in the watcher's last drain) ended, each with its active state (None: not
    loaded), and how many were read from PID 1: every one with `read_all` (the daemon's Systemd.state,
    its accounting for an ended unit), else only those whose signals did not say all of their state."""
    over, reads = [], 0
    for name in sorted(names):
        signalled = watcher.signalled.get(name)
        if read_all or signalled is None:
            state = systemd.state(name, signalled)
            reads += 1
        else:
            state = signalled
        if state is None or state.has_ended:
            over.append((name, state.active_state if state else None))
    return over, reads


def cmd_outcome_loop(args: argparse.Namespace) -> dict[str, Any]:
    """`outcome_loop` of one kind of unit (PROPS)."""
    return {"props": args.props, **outcome_loop(unit_props(args.props, ["/bin/true"]), args.n, args.prefix,
                                                hold=args.hold or args.split, split=args.split,
                                                max_runs=args.max_runs)}


# What makes a run's unit dearer for systemd to start than a bare one, with the sandbox off
# (bench/unit_cost.py): each variant is the daemon's unit for a [runs] config, less some properties.
UNIT_COST_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dynamic user, private /tmp, read-only system and home (sandbox off before)": (SANDBOX_KEYS_OFF, ()),
    "fixed user, no mount namespace (sandbox off)": (UNSANDBOXED_RUNS, ()),
    "... with no_new_privileges off: NoNewPrivileges=no and InaccessiblePaths": (
        UNSANDBOXED_RUNS + "no_new_privileges = false\n", ()),
    "... less CPU, memory and IO accounting": (
        UNSANDBOXED_RUNS, ("CPUAccounting", "MemoryAccounting", "IOAccounting")),
    "... less Type=exec": (UNSANDBOXED_RUNS, ("Type",)),
    "... less User= (root)": (UNSANDBOXED_RUNS, ("User",)),
    "packaged defaults (sandboxed)": ("", ()),
    # The peak-tasks stop command (supervisor/taskspeak.py): one /bin/sh that PID 1 spawns as each unit
    # ends; what it costs is the difference between this line and the one above.
    "... less the tasks-peak stop command (ExecStopPost, TasksAccounting)": ("", ("ExecStopPostEx", "TasksAccounting")),
    "fixed user, no mount namespace, less the tasks-peak stop command": (
        UNSANDBOXED_RUNS, ("ExecStopPostEx", "TasksAccounting")),
}


def sandbox_properties() -> list[str]:
    """The unit properties that the packaged defaults set and sandbox off does not (or sets otherwise):
    what `--each-property` takes out of the packaged units one at a time (issue 27: each sandbox
    property's cost in PID 1)."""
    packaged = _product_props(["/bin/true"], copy_tasks_peak=True)
    other_run = _product_props(["/bin/true"], copy_tasks_peak=True)  # what is the run's own (its id), not the sandbox's
    off = _product_props(["/bin/true"], runs_extra=UNSANDBOXED_RUNS, copy_tasks_peak=True)
    return sorted(key.decode() for key, value in packaged.items()
                  if other_run[key] == value and (key not in off or off[key] != value))


def unit_cost_variants(each_property: bool) -> dict[str, tuple[str, tuple[str, ...]]]:
    """UNIT_COST_VARIANTS, or the packaged units less each sandbox property in turn, and less all of them."""
    if not each_property:
        return UNIT_COST_VARIANTS
    keys = sandbox_properties()
    return {"packaged defaults (sandboxed)": ("", ()),
            **{f"... less {key}": ("", (key,)) for key in keys},
            "... less every one of them": ("", tuple(keys))}


def cmd_unit_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Starts per second (all ran) of bare units and of each variant (unit_cost_variants), `rounds` times
    in turn."""
    variants = unit_cost_variants(args.each_property)
    out: dict[str, list[float]] = {"bare (what systemd-run sends)": []}
    out.update({label: [] for label in variants})
    if args.only:
        # Only the kinds whose label holds one of these words (a comparison of two, in less time).
        out = {label: [] for label in out if any(word in label for word in args.only.split(","))}
    for round_ in range(args.rounds):
        for i, label in enumerate(out):
            if label not in variants:
                props = _bare_props(["/bin/true"])
            else:
                runs, less = variants[label]
                # With the stop command everywhere (also where this host has no pids.peak), so that the
                # kinds "less" it measure what it costs PID 1.
                props = _product_props(["/bin/true"], runs_extra=runs, copy_tasks_peak=True)
                for key in less:
                    props.pop(key.encode())
            ran = start_all(props, args.n, f"bench-cost-{round_}-{i}")
            out[label].append(args.n / ran["drain_s"])
    return {"n": args.n, "rounds": args.rounds, "starts_per_s": out}


def cmd_active(args: argparse.Namespace) -> dict[str, Any]:
    """One start at a time: from the call to the unit being active by systemd's own timestamp
    (ActiveEnterTimestamp, CLOCK_REALTIME in µs), with the daemon's unit properties."""
    from pystemd.dbuslib import apply_signature

    from supervisor.systemd import DEST, MANAGER_IFACE, MANAGER_PATH, PROPS_IFACE

    props = unit_props(args.props, ["/bin/true"])
    props[b"RemainAfterExit"] = True  # so that the timestamp can still be read after the exit
    systemd = Systemd()
    systemd.connect()
    to_active, call = [], []
    for i in range(args.n):
        name = f"{args.prefix}-{i}.service"
        t_call = time.time()
        systemd.start_transient(name, props)
        call.append((time.time() - t_call) * 1000)
        path = systemd._call(MANAGER_PATH, MANAGER_IFACE, b"GetUnit", apply_signature(b"s", [name.encode()]), name)

        def entered(path: bytes = path) -> int:
            return int(systemd._bus.call_method(DEST, path, PROPS_IFACE, b"Get", apply_signature(
                b"ss", [b"org.freedesktop.systemd1.Unit", b"ActiveEnterTimestamp"])).body)

        wait(lambda entered=entered: entered() != 0, 10)
        to_active.append(entered() / 1000 - t_call * 1000)
        systemd.release(name)
    systemd.close()
    return {"n": args.n, "props": args.props, "to_active_ms": to_active, "call_ms": call}


def cmd_units(args: argparse.Namespace) -> dict[str, Any]:
    """Start a long-running unit (/bin/sleep) under each name read from stdin, in the daemon's slice."""
    names = json.load(sys.stdin)
    props = _bare_props(["/bin/sleep", "infinity"])
    props[b"Slice"] = b"unitvisor.slice"
    systemd = Systemd()
    systemd.connect()
    t0 = time.perf_counter()
    created = sum(systemd.start_transient(name, props) for name in names)
    wanted = set(names)
    ok = wait(lambda: sum(name in wanted and active == "active"
                           for name, active, _ in _units_like(systemd, "unitvisor-run-*")) >= len(wanted), 300)
    systemd.close()
    return {"started": created, "running": ok, "seconds": time.perf_counter() - t0}


def _statements(stats: psycopg.Connection, database: str) -> int:
    """Statements PostgreSQL executed in `database` since the last reset, by pg_stat_statements
    (BEGIN and COMMIT included). `stats` is a connection to another database, so that reading the
    statistics does not count itself."""
    return int(stats.execute(
        """SELECT coalesce(sum(calls), 0) FROM pg_stat_statements
           WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s)""", (database,)).fetchone()[0])


class _CountingCursor(psycopg.Cursor):
    """Counts execute() calls on the client side, to cross-check the server's count."""

    count = 0

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        _CountingCursor.count += 1
        return super().execute(*args, **kwargs)


def cmd_reconcile(args: argparse.Namespace) -> dict[str, Any]:
    """One pass (`pass`: Reconciler.reconcile_pass, which acts) or its decide phase (`plan`:
    Reconciler.plan, what `unitvisor reconcile --dry-run` runs), timed, with the database statements
    and the D-Bus calls it used."""
    from supervisor.reconciler import Reconciler

    settings = config.parse(BENCH_CONFIG + f'\n[host]\nid = "{args.host_id}"\n')
    stats = store.connect(args.stats_dsn)
    conn = store.connect(args.dsn)
    conn.cursor_factory = _CountingCursor
    systemd = Systemd()
    systemd.connect()
    dbus_calls = 0
    real_call = systemd._call

    def counted(*a: Any, **kw: Any) -> Any:
        nonlocal dbus_calls
        dbus_calls += 1
        return real_call(*a, **kw)

    systemd._call = counted  # type: ignore[method-assign]
    found = store.host_fence(conn, args.host_id)  # the host registered by the daemon, as `unitvisor reconcile` does
    if found is None:
        raise SystemExit(f"host {args.host_id} is not registered")
    fence = found[1]
    reconciler = Reconciler(settings, fence, conn, systemd)
    stats.execute("SELECT pg_stat_statements_reset()")
    t0 = time.perf_counter()
    done = reconciler.plan() if args.mode == "plan" else reconciler.reconcile_pass()
    seconds = time.perf_counter() - t0
    statements = _statements(stats, conn.info.dbname)
    calls, executes = dbus_calls, _CountingCursor.count  # before the profiled second pass below
    actions: dict[str, int] = {}
    for item in done:
        actions[item.decision.action.value] = actions.get(item.decision.action.value, 0) + 1
    profile = None
    if args.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        Reconciler(settings, fence, conn, systemd).plan()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
        profile = out.getvalue()
    systemd.close()
    conn.close()
    stats.close()
    return {"mode": args.mode, "seconds": seconds, "statements": statements,
            "client_executes": executes, "dbus_calls": calls, "actions": actions,
            "profile": profile}


# bare: what `systemd-run` sends; product: the daemon's; unsandboxed: the daemon's without the sandbox.
PROPS = ("bare", "product", "unsandboxed")


def _cpu_ms(before: resource.struct_rusage, after: resource.struct_rusage) -> float:
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000


class _CountingJournal(Journal):
    """Counts the attempts read alone (output_tail, a journalctl each): every one when read one at a
    time, and in a batch those whose tail the batch could not prove (TailReader)."""

    alone = 0

    def output_tail(self, run_id: str, attempt: int, max_lines: int, max_bytes: int) -> str | None:
        self.alone += 1
        return super().output_tail(run_id, attempt, max_lines, max_bytes)


def cmd_tails(args: argparse.Namespace) -> dict[str, Any]:
    """Start `units` runs' units that print `lines` lines each (exactly the daemon's properties), wait
    for them to end, then read their tails as the daemon does when it records the outcomes, `reads`
    in all, `batch` attempts a read (Journal.output_tails, as TailReader reads every attempt due; 1:
    one journalctl each): the time per read, and per attempt the daemon's own CPU (fork, pipe,
    decode), journalctl's, and how many journalctl processes it took."""
    systemd = Systemd()
    names = []
    for _ in range(args.units):
        props = _product_props(["/usr/bin/seq", "1", str(args.lines)])
        run_id = props[b"LogExtraFields"][0].decode().split("=", 1)[1]
        name = f"unitvisor-run-{run_id}-1.service"
        systemd.start_transient(name, props)
        names.append((name, run_id))
    wait(lambda: all(systemd.state(n).has_ended for n, _ in names), 120)
    journal, defaults = _CountingJournal(), config.RunSettings()
    # Timed only once journald has taken in every line (a burst leaves it behind: docs/benchmarks.md),
    # so that every read is of a complete output, as most of the daemon's are.
    for _, run_id in names:
        wait(lambda run_id=run_id: journal.output_tail(run_id, 1, 1, 100) == str(args.lines), 60)
    journal.alone = 0
    batch = min(args.batch, args.units)  # distinct attempts in a batch, as the daemon's are
    times: list[float] = []
    self0, children0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    for first in range(0, args.reads, batch):
        attempts = [(names[i % len(names)][1], 1) for i in range(first, min(first + batch, args.reads))]
        began = time.perf_counter()
        tails = journal.output_tails(attempts, defaults.output_tail_lines, defaults.output_tail_bytes)
        times.append(time.perf_counter() - began)
        assert all(tail is not None and tail.split("\n")[-1] == str(args.lines) for tail in tails), tails
    self1, children1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    for name, _ in names:
        systemd.release(name)
    times.sort()
    processes = journal.alone + (len(times) if batch > 1 else 0)
    return {
        "reads": args.reads, "units": args.units, "lines_each": args.lines, "batch": batch,
        "p50_ms": statistics.median(times) * 1000, "p99_ms": times[max(0, int(len(times) * 0.99) - 1)] * 1000,
        "daemon_cpu_ms_per_attempt": _cpu_ms(self0, self1) / args.reads,
        "journalctl_cpu_ms_per_attempt": _cpu_ms(children0, children1) / args.reads,
        "journalctl_per_attempt": processes / args.reads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("limit")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--prefix", default="bench-raw")
    p.add_argument("--props", choices=PROPS, default="bare")
    p.add_argument("--with-props", help="comma-separated properties of the daemon's units to add to bare ones")
    p = sub.add_parser("outcome-loop")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--prefix", default="bench-loop-")
    p.add_argument("--props", choices=PROPS, default="unsandboxed")
    p.add_argument("--hold", action="store_true", help="hold, read and release each unit as the daemon does")
    p.add_argument("--split", action="store_true", help="... with the signals and reads in a second process")
    p.add_argument("--max-runs", type=int, default=64, help="units at once (the packaged max_runs: 64)")
    p = sub.add_parser("unit-cost")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", help="comma-separated words: only the kinds whose label holds one")
    p.add_argument("--each-property", action="store_true",
                   help="the packaged units less each sandbox property in turn, instead of the [runs] configs")
    p = sub.add_parser("active")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--prefix", default="bench-active")
    p.add_argument("--props", choices=PROPS, default="product")
    sub.add_parser("units")
    p = sub.add_parser("reconcile")
    p.add_argument("--dsn", required=True)
    p.add_argument("--stats-dsn", required=True, help="a connection to another database of the cluster")
    p.add_argument("--host-id", required=True)
    p.add_argument("--mode", choices=("plan", "pass"), default="plan")
    p.add_argument("--profile", action="store_true")
    p = sub.add_parser("tails")
    p.add_argument("--units", type=int, default=200)
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--reads", type=int, default=200)
    p.add_argument("--batch", type=int, default=1, help="attempts a read (the daemon: TailReader.MAX_BATCH at most)")
    args = parser.parse_args()
    handler = {"limit": cmd_limit, "outcome-loop": cmd_outcome_loop, "unit-cost": cmd_unit_cost,
               "active": cmd_active, "units": cmd_units,
               "reconcile": cmd_reconcile, "tails": cmd_tails}[args.cmd]
    json.dump(handler(args), sys.stdout)


if __name__ == "__main__":
    main()
