"""The peers in the benchmark: what a team would hack together instead of unitvisor (issue 14).

A pgqueuer worker whose one entrypoint starts a transient unit of /bin/true for each job, in one of
two ways:

  systemd-run  a `systemd-run --unit=NAME --property=... -- /bin/true` process per job. systemd-run
               waits for its start job to finish (no --no-block), as a script calling it would.
  pystemd      one `StartTransientUnit` call per job on one pystemd connection opened at start-up,
               through the same `supervisor.systemd.Systemd.start_transient` as unitvisor. It returns
               once PID 1 has queued the start job, like the raw loop of bench/inside.py.

Each starts its units with one of bench/inside.py's property sets (imported, never copied, so that a
peer and unitvisor can never start different units): `bare` (what `systemd-run /bin/true` sends),
`product` (unitvisor's units, `unitspec.build()`, sandboxed) or `unsandboxed` (unitvisor's with the
sandbox off). For systemd-run the D-Bus properties are spelled as `--property=` options
(`run_options`), and `check` proves on the running systemd that both ways give the same unit.

It runs inside the test bed with the benchmark's own virtualenv (.venv-bench-peers: pgqueuer and
asyncpg, bench/peers-requirements.txt), never unitvisor's: the peers are no dependency of unitvisor.
`bench.run` (outside) starts `worker` as a service of the test bed and drives it with `latency` and
`throughput`; each of those prints one JSON object on stdout and nothing else.

Subcommands:
  install     pgqueuer's schema, into the benchmark's database
  check       one unit started each way with the same properties: `systemctl show` must agree
  worker      the pgqueuer worker, until SIGTERM
  latency     jobs one at a time, each committed alone and waited for
  throughput  n jobs committed in one transaction, waited for
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg
from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager

from bench.inside import MAX_QUEUED_JOBS, PROPS, queued_jobs, unit_props, wait
from supervisor.systemd import Systemd

ENTRYPOINT = "start_unit"
ARGV = ["/bin/true"]
STARTS = ("systemd-run", "pystemd")
# pgqueuer's QueueManager.run defaults (batch_size 10, no limit on an entrypoint's concurrency), but
# at most this many jobs in flight at once: unitvisor's max_runs default, so that neither side may
# start more at a time than the other. (Unlimited, 1,000 jobs would mean 1,000 systemd-run
# processes at once on 2 cores.)
MAX_IN_FLIGHT = 64
# `systemctl show` properties that differ between any two units (names, times, PIDs, counters) or
# that name the command's spelling rather than the unit (ExecStart*: see run_options): left out of
# `check`'s comparison.
PER_UNIT = ("Id", "Names", "InvocationID", "MainPID", "ExecMainPID", "ControlGroup", "ControlGroupId",
            "FragmentPath", "ExecStart", "ExecStartEx", "StatusText", "Following", "NRestarts",
            "ExecStopPost", "ExecStopPostEx",  # the tasks-peak command: the same, spelled by systemd-run
            "User", "Group", "UID", "GID",  # DynamicUser: a user named after each unit
            "Refs")  # the bus clients holding the unit (AddRef): pystemd's connection, systemd-run's none
PER_UNIT_SUFFIXES = ("Timestamp", "TimestampMonotonic", "Current", "NSec", "Bytes", "Packets", "Peak")


# -- the units ----------------------------------------------------------------------------------


def _option_values(name: str, value: Any) -> tuple[str, list[str]]:
    """One D-Bus unit property as systemd-run spells it: (its name there, one value per
    `--property=`). Every type unitspec.build() sends is here; anything else is refused, so that a
    property added to unitvisor's units is never silently left out of a peer's."""
    if isinstance(value, bool):
        return name, ["yes" if value else "no"]
    if isinstance(value, bytes):
        return name, [value.decode()]
    if name == "TimeoutStopUSec":
        return "TimeoutStopSec", [f"{value}us"]
    if name == "UMask":
        return name, [f"{value:04o}"]
    if name == "SystemCallErrorNumber":
        return name, [errno.errorcode[value]]
    if name == "RestrictNamespaces" and value == 0:
        return name, ["yes"]  # the D-Bus value is the namespaces allowed: none
    if name == "CapabilityBoundingSet" and value == 0:
        return name, [""]  # the empty set
    if name == "ExecStopPostEx":
        # The tasks-peak command (supervisor/taskspeak.py): its flags as the prefixes `+`, `-`, `:`, and
        # its words quoted as systemd's command-line parser reads them (no backslash in them to escape).
        [(_path, args, flags)] = value
        prefix = "".join({b"privileged": "+", b"ignore-failure": "-", b"no-env-expand": ":"}[f] for f in flags)
        words = " ".join('"' + arg.decode().replace('"', '\\"') + '"' for arg in args)
        return "ExecStopPost", [prefix + words]
    if name == "LogExtraFields":
        return name, [field.decode() for field in value]  # one field per assignment
    if isinstance(value, list) and all(isinstance(item, bytes) for item in value):
        return name, [" ".join(item.decode() for item in value)]
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool):
        allow, items = value  # (allow-list?, names): SystemCallFilter, RestrictAddressFamilies
        return name, [("" if allow else "~") + " ".join(item.decode() for item in items)]
    raise ValueError(f"no systemd-run spelling for the unit property {name}={value!r}")


def run_options(props: dict[bytes, Any]) -> tuple[list[str], list[str]]:
    """(systemd-run's --property= options, the command) for a unit of D-Bus properties `props`.
    The command comes from ExecStart/ExecStartEx and goes on systemd-run's command line, which
    sends it as ExecStart: the `no-env-expand` flag of unitvisor's ExecStartEx has no spelling there
    in systemd 252 (nothing in /bin/true's argv to expand, so the unit does the same)."""
    options, argv = [], []
    for key, value in props.items():
        name = key.decode()
        if name in ("ExecStart", "ExecStartEx"):
            [(_path, args, *_flags)] = value
            argv = [arg.decode() for arg in args]
            continue
        if name == "AddRef":
            # Not a unit setting but a request of the calling connection (systemd-run has no spelling
            # for it, and its connection closes at once): the unit it makes is the same.
            continue
        spelled, values = _option_values(name, value)
        options += [f"--property={spelled}={text}" for text in values]
    return options, argv


def systemd_run(unit: str, props: dict[bytes, Any]) -> list[str]:
    options, argv = run_options(props)
    return ["systemd-run", "--quiet", f"--unit={unit}", *options, "--", *argv]


def _show(unit: str) -> dict[str, str]:
    out = subprocess.run(["systemctl", "show", unit], capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _comparable(show: dict[str, str]) -> dict[str, str]:
    """The properties that must agree, each value's words sorted: systemctl prints sets (After=,
    Wants=, ...) in hash order, which differs between two units with the same set."""
    return {k: " ".join(sorted(v.split())) for k, v in show.items()
            if k not in PER_UNIT and not k.endswith(PER_UNIT_SUFFIXES)}


def cmd_check(args: argparse.Namespace) -> dict[str, Any]:
    """For each property set, one unit of /bin/sleep started through pystemd and one through
    systemd-run with the very same properties; every `systemctl show` property that is not
    per-unit must agree, or the benchmark would compare the peers with a different unit."""
    systemd = Systemd()
    systemd.connect()
    out: dict[str, Any] = {}
    try:
        for kind in args.props.split(","):
            props = unit_props(kind, ["/bin/sleep", "60"])
            tag = uuid.uuid4().hex[:8]
            a, b = f"bench-peer-check-{tag}-a.service", f"bench-peer-check-{tag}-b.service"
            systemd.start_transient(a, props)
            subprocess.run(systemd_run(b, props), check=True, capture_output=True, text=True)
            wait(lambda a=a: _show(a).get("ActiveState") == "active", 30)
            shown_a, shown_b = _comparable(_show(a)), _comparable(_show(b))
            for unit in (a, b):
                subprocess.run(["systemctl", "stop", unit], check=False, capture_output=True)
            differ = {k: [shown_a.get(k), shown_b.get(k)] for k in sorted(set(shown_a) | set(shown_b))
                      if shown_a.get(k) != shown_b.get(k)}
            out[kind] = {"compared": len(shown_a), "differ": differ}
    finally:
        systemd.close()
    bad = {kind: row["differ"] for kind, row in out.items() if row["differ"]}
    if bad:
        raise SystemExit(f"systemd-run and pystemd started different units: {json.dumps(bad)}")
    return out


# -- the worker ---------------------------------------------------------------------------------


class Starter:
    """The job entrypoint's body: one transient unit for each job, named by the job's payload."""

    def __init__(self, start: str, props: str) -> None:
        self.start = start
        self.props = props
        self.systemd: Systemd | None = None
        self.started = 0
        if start == "pystemd":
            self.systemd = Systemd()  # connected by its first call (see _drive)

    async def start_unit(self, job: Job) -> None:
        unit = job.payload.decode()
        # A fresh property set per job, as unitvisor builds one per run (a new run id in its
        # Description and LogExtraFields).
        props = unit_props(self.props, ARGV)
        if self.systemd is None:
            proc = await asyncio.create_subprocess_exec(*systemd_run(unit, props), stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"systemd-run {unit}: {err.decode().strip()}")
            return
        # Called on the event loop, not in a thread: the call only queues a start job (a few ms), and
        # a worker that hands it to a thread pays a thread hop per job for nothing.
        self.started += 1
        if self.started % 32 == 0 and queued_jobs(self.systemd) > MAX_QUEUED_JOBS:
            # The raw loop's guard (bench/inside.py MAX_QUEUED_JOBS): past 512 queued start jobs PID 1
            # loses its bus connection. systemd-run cannot get there: it waits for each start.
            while queued_jobs(self.systemd) > MAX_QUEUED_JOBS // 2:
                await asyncio.sleep(0.01)
        self.systemd.start_transient(unit, props)


async def _worker(args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(args.dsn)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    starter = Starter(args.start, args.props)

    @qm.entrypoint(ENTRYPOINT)
    async def start_unit(job: Job) -> None:
        await starter.start_unit(job)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, qm.shutdown.set)
    await qm.run(max_concurrent_tasks=MAX_IN_FLIGHT)


# -- the driver ---------------------------------------------------------------------------------


async def _committed(conn: asyncpg.Connection, units: list[str]) -> float:
    """Enqueue one job per unit in one transaction; the commit's time by PostgreSQL's commit
    timestamp (track_commit_timestamp), the clock unitvisor's figures use."""
    queries = Queries(AsyncpgDriver(conn))
    async with conn.transaction():
        xid = await conn.fetchval("SELECT pg_current_xact_id()::text")
        await queries.enqueue([ENTRYPOINT] * len(units), [u.encode() for u in units], [0] * len(units))
    return float(await conn.fetchval(
        "SELECT extract(epoch FROM pg_xact_commit_timestamp($1::text::xid))::float8", xid))


async def _drained(conn: asyncpg.Connection, systemd: Systemd, timeout: float, interval: float) -> bool:
    """Until no job is left in pgqueuer's queue and PID 1 has no start job queued: every unit has
    started (the benchmark reads when from the journal). Polled as bench.run waits for unitvisor's
    runs: every 5 ms for one job at a time, every 0.25 s for n at once (so that the polling takes
    no more of the 2 cores from the peer than it takes from unitvisor)."""
    queries = Queries(AsyncpgDriver(conn))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(row.count for row in await queries.queue_size()) and not queued_jobs(systemd):
            return True
        await asyncio.sleep(interval)
    return False


async def _drive(args: argparse.Namespace) -> dict[str, Any]:
    conn = await asyncpg.connect(args.dsn)
    if args.cmd == "install":
        try:
            await Queries(AsyncpgDriver(conn)).install()
        finally:
            await conn.close()
        return {"installed": True}
    # Not connected before its first call (Systemd connects on demand): the system bus closes a
    # connection that has not authenticated within 30 s (auth_timeout), and pystemd's connection
    # authenticates at its first call, which comes only after the n jobs are all done.
    systemd = Systemd()
    try:
        names = [f"{args.prefix}-{i}.service" for i in range(args.n)]
        if args.cmd == "latency":
            committed = {}
            for name in names:
                committed[name] = await _committed(conn, [name])
                if not await _drained(conn, systemd, 60, 0.005):
                    raise SystemExit(f"job {name} not done in 60 s")
            return {"n": args.n, "committed": committed}
        t0 = await _committed(conn, names)
        drained = await _drained(conn, systemd, 120 + args.n / 5, 0.25)
        return {"n": args.n, "committed": t0, "units": names, "drained": drained}
    finally:
        systemd.close()
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install")
    p.add_argument("--dsn", required=True)
    p = sub.add_parser("check")
    p.add_argument("--props", default=",".join(PROPS), help="comma-separated property sets to compare")
    p = sub.add_parser("worker")
    p.add_argument("--dsn", required=True)
    p.add_argument("--start", choices=STARTS, required=True)
    p.add_argument("--props", choices=PROPS, required=True)
    for name in ("latency", "throughput"):
        p = sub.add_parser(name)
        p.add_argument("--dsn", required=True)
        p.add_argument("--n", type=int, required=True)
        p.add_argument("--prefix", required=True, help="unit names: PREFIX-<i>.service")
    args = parser.parse_args()
    if args.cmd == "worker":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        asyncio.run(_worker(args))
        return
    result = cmd_check(args) if args.cmd == "check" else asyncio.run(_drive(args))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
