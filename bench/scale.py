"""`make bench-scale`: a fleet of 100 and of 300 daemons against one real PostgreSQL, with systemd faked.

Each host is a real `supervisor.daemon.Daemon` (the code `unitvisor daemon` runs: its loop, its one
connection with its LISTEN, its probe, claim and reconcile pass), many of them in threads of a few worker
processes (so that the GIL of one process does not serialise the whole fleet). Only the systemd
adapter is fake: `FakeSystemd` and `FakeWatcher` below stand in for supervisor.systemd's Systemd and
Watcher (the same methods the daemon and the reconciler call): a start "runs" the unit for
`run_seconds`, then the unit is `active/exited` with result success and the watcher reports it
changed, as PropertiesChanged would. No process is started; what is measured is the database's side.

Per fleet size: (S1) idle for `idle_seconds`: the PostgreSQL server's CPU (every backend and the
postmaster's helpers, from /proc/<pid>/stat) per idle host, statements per host per minute
(pg_stat_statements), connections per host (pg_stat_activity). (S2) a trickle of single submits, one at a
time: claim latency (the submit's commit to attempts.claimed_at, both on the database's clock), and how
many daemons each submit makes run a claim (every daemon's store.claim is counted by the bench, in its
worker, with the host and the time), and how many heard its notification, named or not. (S3) a burst of
`burst` runs in one transaction: claim latency p50 and p99, the claim statements it cost, the claims that
took nothing, the hosts declared dead, and the share of the machine the simulated daemons themselves took
(their worker processes' CPU), so that the database's part can be read apart. (S4) idle again with 1,000
runs that no host accepts (an executable no allowlist names), then (S5) with 10,000 runs behind one
concurrency key (whose head no host accepts, so that none may start): the server's CPU per host per minute
beside (S1)'s, watched once the fleet upkeep has written why the runs wait and every daemon has planned
its statements again after the tables were analyzed (costs paid once per run or per ANALYZE, reported
apart: the seconds it took and the server's CPU per run meanwhile). Each window also counts the
heartbeats, their walks of the queue (host_has_work) and the upkeep's explanation passes per host per
minute, which say what its cost is made of.

With `--baseline DIR` (a checkout of an earlier release, e.g. `git worktree add /tmp/base d60b583`), every
fleet size is measured twice in the one run, first with that checkout's daemon code and migrations
(sql/), then with this one's, on the same PostgreSQL: the figures side by side, under the same load.
What each figure means, and the latest results: docs/benchmarks.md, Fleet at scale (simulated).

    .venv/bin/python -m bench.scale            # 100 and 300 daemons (about 6 minutes here)
    .venv/bin/python -m bench.scale --tiny     # 5 daemons, every figure in seconds (the smoke test)
    .venv/bin/python -m bench.scale --fleets 100,300 --burst 10000 --baseline /tmp/base
    .venv/bin/python -m bench.scale --fleets 100,300,1000 --burst 10000 --baseline /tmp/base --baseline-fleets 100,300
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import heapq
import json
import logging
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import psycopg

from bench.run import CLIENT_ROLE, RESULTS, database, interrupt_on_sigterm, loadavg, machine_facts, save, say, summary
from supervisor import __version__, config, daemon, store, systemd
from tests.harness.host import REPO
from tests.harness.postgres import Postgres

# Two connections per daemon: its work connection (with its LISTEN, since 0.4.0) and, while its loop is
# late, the heartbeat sent aside on a connection of its own (schema 19). The 0.8.0 run counted one: at
# 1,000 hosts the aside heartbeats were refused 1,521 times ("too many clients") and 275 live hosts were
# declared dead. Then the bench's own and PostgreSQL's reserved ones (docs/fleet.md, The ceiling of one
# PostgreSQL: a real deployment counts the same, and one per CLI command run at once).
CONNECTIONS_PER_DAEMON = 2
SPARE_CONNECTIONS = 20
HOSTS_PER_WORKER = 25  # daemons per worker process (threads); 300 daemons are 12 processes
CLK_TCK = os.sysconf("SC_CLK_TCK")
CLAIM_STATEMENT = "%unitvisor.claim_jobs(%"
FAILED = -1  # a claim that raised, in the workers' counts
# Each host: the packaged defaults (poll 10 s, reconcile 60 s, max_runs 64, claim_batch 32), its own id,
# no metrics port (300 would clash), no output tails (there is no journal of fake units to read).
HOST_CONFIG = """
[host]
id = "{host}"
name = "{host}"

[runs]
allowed_executables = ["/bin/true"]
output_tail_lines = 0

[metrics]
listen = ""
"""


@dataclass
class Sizes:
    fleets: list[int] = field(default_factory=lambda: [100, 300])
    idle_seconds: float = 60.0
    trickle: int = 20  # single submits, one after another
    trickle_gap: float = 2.0  # seconds between two single submits; a daemon woken by one claims in it
    burst: int = 1000  # runs submitted in one transaction
    run_seconds: float = 0.5  # how long a fake unit "runs"
    ready_timeout: float = 300.0  # every daemon registered and through its first reconcile pass
    burst_timeout: float = 300.0
    refused: int = 1000  # (S4) runs no host accepts
    behind_key: int = 10000  # (S5) runs behind one concurrency key
    # (S4), (S5): their window opens once every run's wait is explained and no run event has been written
    # for `quiet_seconds`, or after `settle_timeout` (Fleet._explained).
    quiet_seconds: float = 20.0
    settle_timeout: float = 240.0
    # ... and `replan_seconds` after the vacuum: its ANALYZE invalidates every session's plans of the tables
    # it analyzed, and each daemon's next heartbeat and reconcile query plan again (0.5 to 1 ms of server
    # time for the heartbeat alone, once per session and ANALYZE: paid 300 times at once, it was 2 ms per
    # host per minute of (S4)'s window at 300 hosts). One poll interval and a margin.
    replan_seconds: float = 12.0


TINY = Sizes(fleets=[5], idle_seconds=3.0, trickle=3, trickle_gap=1.0, burst=20, ready_timeout=120.0,
             burst_timeout=120.0, refused=50, behind_key=100, quiet_seconds=2.0, settle_timeout=5.0,
             replan_seconds=1.0)
COUNTED_FUNCTIONS = ("heartbeat", "host_has_work", "explain_waiting")  # Fleet._function_calls
REFUSED_EXECUTABLE = "/opt/rollout/new-binary"  # in no host's allowed_executables (HOST_CONFIG)


# -- the fake systemd (in the worker processes) --------------------------------------------------


class Ender(threading.Thread):
    """One per worker process: ends each fake unit when its time is up, on behalf of every FakeSystemd."""

    def __init__(self) -> None:
        super().__init__(name="fake-unit-ender", daemon=True)
        self.due: list[tuple[float, int, FakeSystemd, str]] = []
        self.order = 0  # ties of `due` never compare FakeSystemd objects
        self.cond = threading.Condition()

    def add(self, when: float, fake: FakeSystemd, name: str) -> None:
        with self.cond:
            self.order += 1
            heapq.heappush(self.due, (when, self.order, fake, name))
            self.cond.notify()

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.due or self.due[0][0] > time.monotonic():
                    self.cond.wait(self.due[0][0] - time.monotonic() if self.due else None)
                _, _, fake, name = heapq.heappop(self.due)
            fake.end(name)


class FakeWatcher:
    """supervisor.systemd.Watcher's interface: a file descriptor that is readable when units changed."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.changed: set[str] = set()
        self.lock = threading.Lock()
        self.connected = False
        self.signalled: dict[str, systemd.UnitState] = {}  # names only: the fake systemd's reads cost nothing

    def connect(self) -> None:
        self.connected = True

    def close(self) -> None:
        self.connected = False

    def fileno(self) -> int:
        return self.read_fd

    def signal(self, name: str) -> None:
        with self.lock:
            self.changed.add(name)
        try:
            os.write(self.write_fd, b"\0")
        except BlockingIOError:  # the pipe is full: the loop is readable anyway
            pass

    def drain(self) -> tuple[set[str], bool]:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        with self.lock:
            changed, self.changed = self.changed, set()
        return changed, False


class FakeSystemd:
    """supervisor.systemd.Systemd's interface, in memory: a started unit is active/running for the
    ender's `run_seconds`, then active/exited with result success (Type=exec with RemainAfterExit, as
    unitspec builds it), and the watcher hears of it; release() unloads it."""

    def __init__(self, watcher: FakeWatcher, ender: Ender, run_seconds: float) -> None:
        self.watcher = watcher
        self.ender = ender
        self.run_seconds = run_seconds
        self.units: dict[str, systemd.UnitState] = {}
        self.lock = threading.Lock()
        self.connected = False

    def connect(self) -> None:
        self.connected = True

    def close(self) -> None:
        self.connected = False

    def start_transient(self, name: str, properties: dict[bytes, Any]) -> bool:
        now = int(time.time() * 1e6)
        with self.lock:
            if name in self.units:
                return False
            self.units[name] = systemd.UnitState(
                name=name, active_state="active", sub_state="running", result="success", exec_main_code=0,
                exec_main_status=0, invocation_id=os.urandom(16).hex(), job_pending=False,
                exec_main_start_usec=now, active_enter_usec=now)
        self.ender.add(time.monotonic() + self.run_seconds, self, name)
        return True

    def end(self, name: str) -> None:
        with self.lock:
            unit = self.units.get(name)
            if unit is None:
                return
            self.units[name] = systemd.UnitState(
                name=name, active_state="active", sub_state="exited", result="success", exec_main_code=1,  # CLD_EXITED
                exec_main_status=0, invocation_id=unit.invocation_id, job_pending=False,
                exec_main_start_usec=unit.exec_main_start_usec, exec_main_exit_usec=int(time.time() * 1e6),
                active_enter_usec=unit.active_enter_usec)
        self.watcher.signal(name)

    def state(self, name: str, signalled: systemd.UnitState | None = None) -> systemd.UnitState | None:
        with self.lock:
            return self.units.get(name)

    def list_units(self, pattern: str) -> dict[str, systemd.UnitBrief]:
        with self.lock:  # every unit here is the daemon's own (the pattern is always unitspec.UNIT_GLOB)
            return {name: systemd.UnitBrief(u.active_state, u.sub_state, u.job_pending)
                    for name, u in self.units.items()}

    def stop(self, name: str) -> bool:
        with self.lock:
            return self.units.pop(name, None) is not None

    def reset_failed(self, name: str) -> bool:
        return False

    def ref(self, name: str) -> bool:
        with self.lock:
            return name in self.units

    def release(self, name: str, active_state: str | None = None) -> None:
        self.stop(name)


# -- a worker process: many daemons in threads ---------------------------------------------------


class _ThreadSignals:
    """Stands in for the `signal` module in supervisor.daemon, in the worker processes only: Python lets
    only the main thread install handlers, and the bench stops each daemon itself (stopping, then a wake)."""

    SIGTERM = SIGINT = 0

    @staticmethod
    def signal(signum: int, handler: object) -> None:
        return None

    @staticmethod
    def set_wakeup_fd(fd: int) -> int:
        return -1


def worker(hosts: list[str], dsn: str, run_seconds: float, pipe: Pipe) -> None:
    """Run one daemon per host id in threads until told to stop; then send every claim each made:
    (wall-clock time the statement was sent, host, jobs claimed, or FAILED when the statement raised:
    a statement or lock timeout, a dropped connection; pg_stat_statements never counts those)."""
    # The daemons' warnings, each with its time and host (the thread), on the bench's stderr: what a
    # declared-dead host and the hosts around it said is the diagnosis (issue 23, point 2).
    logging.basicConfig(format="%(asctime)s %(threadName)s %(message)s")
    logging.getLogger("unitvisor").setLevel(logging.WARNING)
    daemon.signal = _ThreadSignals  # type: ignore[assignment]
    claims: list[tuple[float, str, int]] = []
    real_claim = store.claim

    def counted_claim(conn: store.Connection, fence: store.Fence, batch: int, unit_format: str) -> list:
        sent = time.time()
        try:
            claimed = real_claim(conn, fence, batch, unit_format)
        except Exception:
            claims.append((sent, fence.host_id, FAILED))
            raise
        claims.append((sent, fence.host_id, len(claimed)))  # list.append is atomic under the GIL
        return claimed

    store.claim = counted_claim  # the daemon calls store.claim through the module
    # Which daemons heard a spawn hint, named or not (time, host): PostgreSQL sends a notification to every
    # session that listens on its channel, and each daemon reads it to learn whether it is named.
    heard: list[tuple[float, str]] = []
    real_heard = daemon.Daemon._heard

    def counted_heard(self: daemon.Daemon, channel: str, payload: str) -> None:
        if channel.startswith(store.SPAWN_CHANNEL):  # the shared channel, or (048) the host's own
            heard.append((time.time(), self.host_id))
        real_heard(self, channel, payload)

    daemon.Daemon._heard = counted_heard  # type: ignore[method-assign]
    ender = Ender()
    ender.start()
    daemons = []
    for host in hosts:
        d = daemon.Daemon(config.parse(HOST_CONFIG.format(host=host), f"<{host}>"), lambda: dsn)
        # The fake systemd starts units for anyone; a real one needs root, which is all the daemon's check
        # is about (it would claim nothing otherwise).
        d.is_root = True
        d.watcher = FakeWatcher()
        d.systemd = FakeSystemd(d.watcher, ender, run_seconds)
        daemons.append(d)
    threads = [threading.Thread(target=d.run, name=d.host_id, daemon=True) for d in daemons]
    for t in threads:
        t.start()
    while not all(d.reconciler is not None and not d.problem for d in daemons):
        time.sleep(0.2)
    pipe.send("ready")
    pipe.recv()  # "stop"
    for d in daemons:
        d.stopping = True
        d._wake()
    for t in threads:
        t.join(30)
    pipe.send((claims, heard))


def boot(code: str | None, *args: Any) -> None:
    """A worker process's entry: with `code` (a directory holding only a `supervisor` link to a baseline
    checkout's package), the daemons run that code. The spawned child imported this module, and so
    supervisor, as the parent's main module; it is dropped and imported again from `code`."""
    if code:
        for name in [m for m in sys.modules if m == "supervisor" or m.startswith("supervisor.")]:
            del sys.modules[name]
        sys.modules.pop("bench.scale", None)
        sys.path.insert(0, code)
    from bench.scale import worker as fresh_worker
    fresh_worker(*args)


# -- the bench (in the main process) -------------------------------------------------------------


def _cpu_seconds(pid: int, reaped: bool = False) -> float:
    """utime + stime of the process, and with `reaped` cutime + cstime: its children that ended and
    that it waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone since it was listed
        return 0.0
    return sum(int(f) for f in fields[11:15 if reaped else 13]) / CLK_TCK


# The titles of the server's other processes (PostgreSQL 15 to 18), none of them a session.
_OTHER_SERVER_PROCESSES = ("logical replication", "logger", "stats collector", "archiver", "startup", "walsender",
                           "walreceiver", "walsummarizer", "io worker", "slotsync worker")


def _server_kind(pid: int) -> str:
    """What a server process is, from the title PostgreSQL gives it: `postgres: walwriter`, `postgres:
    autovacuum worker`, or a session's `postgres: <user> <database> <client> <state>`."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "sessions"
    title = title.removeprefix("postgres: ")
    for kind in ("walwriter", "checkpointer", "background writer", "autovacuum"):
        if title.startswith(kind):
            return kind
    return "other" if title.startswith(_OTHER_SERVER_PROCESSES) else "sessions"


def server_cpu_by_kind(pg: Postgres) -> dict[str, float]:
    """CPU seconds used so far by the PostgreSQL server, by kind of process: the sessions (the daemons'
    statements), each of the server's own workers (what the writes those statements make cost it
    later: WAL, checkpoints, vacuum), and `ended`, the processes that ended and were reaped with the
    postmaster's own time (autovacuum workers, each ending after its table; sessions that closed).
    Counting only the live ones made a window's figure negative when backends ended in it (0.11.0's
    1,000 hosts: the daemons' idle_session_timeout ended hundreds of sessions)."""
    postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])
    own = _cpu_seconds(postmaster)
    kinds = {"ended": _cpu_seconds(postmaster, reaped=True) - own, "other": own}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == postmaster:
            pid = int(stat.parent.name)
            kind = _server_kind(pid)
            kinds[kind] = kinds.get(kind, 0.0) + _cpu_seconds(pid)
    return kinds


def cpu_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A window's server CPU by kind: what each kind used between two readings (a kind may appear or
    go: an autovacuum worker ends, and its time moves to `ended`)."""
    return {kind: after.get(kind, 0.0) - before.get(kind, 0.0) for kind in sorted(set(before) | set(after))}


# The daemons' statements in pg_stat_statements: every role's but the bench's own, in the fleet's database
# (the two parameters, in this order: CLIENT_ROLE, the database's name).
_DAEMON_STATEMENTS = """FROM pg_stat_statements s JOIN pg_roles u ON u.oid = s.userid
                        JOIN pg_database d ON d.oid = s.dbid
                        WHERE u.rolname <> %s AND d.datname = %s"""


def baseline_migrations(baseline: Path) -> Path:
    """A checkout's migrations: sql/migrations/ since they moved there (with schema.sql beside them),
    sql/ itself in a checkout from before."""
    moved = baseline / "sql" / "migrations"
    return moved if moved.is_dir() else baseline / "sql"


class Fleet:
    """N daemons in worker processes against one database of the cluster, and the bench's connection."""

    def __init__(self, pg: Postgres, n: int, sizes: Sizes, baseline: Path | None = None,
                 code: str | None = None) -> None:
        self.pg, self.n, self.sizes = pg, n, sizes
        self.dbname = f"scale_{n}" + ("_baseline" if baseline else "")
        with store.connect(pg.dsn) as conn:
            conn.execute(f"CREATE DATABASE {self.dbname}")
        with store.connect(pg.dsn_for(self.dbname)) as conn:
            store.migrate(conn, baseline_migrations(baseline) if baseline else None)
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        # The bench's own statements (submits, polling) log in as CLIENT_ROLE, counted apart.
        self.conn = psycopg.connect(pg.dsn_for(self.dbname).replace("user=postgres", f"user={CLIENT_ROLE}"),
                                    autocommit=True)
        hosts = [f"scale-{i:03d}" for i in range(1, n + 1)]
        context = multiprocessing.get_context("spawn")  # no fork of this process's threads and connections
        self.workers: list[tuple[multiprocessing.process.BaseProcess, Pipe]] = []
        for start in range(0, n, HOSTS_PER_WORKER):
            ours, theirs = context.Pipe()
            proc = context.Process(target=boot, daemon=True, args=(
                code, hosts[start:start + HOSTS_PER_WORKER], pg.dsn_for(self.dbname), sizes.run_seconds, theirs))
            proc.start()
            self.workers.append((proc, ours))
        # Every daemon connects at once, as after a database restart: the server forks and authenticates
        # them all; allow 0.6 s a daemon beyond 500 (a 2-core machine at 1,000 took longer than 300 s).
        ready_timeout = max(sizes.ready_timeout, 0.6 * n)
        deadline = time.monotonic() + ready_timeout
        for _, pipe in self.workers:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise SystemExit(f"{n} daemons: not all registered within {ready_timeout:.0f} s")
            pipe.recv()
        self.claims: list[tuple[float, str, int]] = []
        self.heard: list[tuple[float, str]] = []
        self.epochs = dict(self.conn.execute("SELECT id, epoch FROM unitvisor.hosts").fetchall())

    def stop(self) -> None:
        for _, pipe in self.workers:
            pipe.send("stop")
        for proc, pipe in self.workers:
            if pipe.poll(60):
                claims, heard = pipe.recv()
                self.claims += claims
                self.heard += heard
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self.conn.close()

    def _daemon_statements(self, pattern: str = "%") -> int:
        return self.conn.execute(
            f"SELECT coalesce(sum(s.calls), 0)::bigint {_DAEMON_STATEMENTS} AND s.query LIKE %s",
            (CLIENT_ROLE, self.dbname, pattern)).fetchone()[0]

    def simulation_cpu(self) -> float:
        """CPU seconds the worker processes (the simulated daemons and their fake systemd) used so far."""
        return sum(_cpu_seconds(proc.pid) for proc, _ in self.workers if proc.pid)

    def hosts_declared_dead(self) -> int:
        """Hosts declared dead since the fleet was ready: `dead` now, or registered again since (a new
        epoch: a live daemon declared dead is fenced, and registers again)."""
        return self.conn.execute(
            "SELECT count(*) FROM unitvisor.hosts h WHERE h.state = 'dead' OR h.epoch <> (%s::jsonb ->> h.id)::bigint",
            (json.dumps(self.epochs),)).fetchone()[0]

    def _idle_window(self) -> dict[str, Any]:
        """`idle_seconds` of the fleet as it is: the server's CPU (in all, and by kind of process) and the
        daemons' statements, per host and minute, with the statements that took the server's time."""
        self.conn.execute("SELECT pg_stat_statements_reset()")
        cpu, calls, began = server_cpu_by_kind(self.pg), self._function_calls(), time.monotonic()
        time.sleep(self.sizes.idle_seconds)
        seconds = time.monotonic() - began
        by_kind = cpu_since(cpu, server_cpu_by_kind(self.pg))
        total, minutes = sum(by_kind.values()), seconds / 60
        return {"seconds": seconds, "server_cpu_seconds": total, "loadavg": loadavg(),
                "server_cpu_ms_per_host_per_minute": total * 1000 / self.n / minutes,
                "server_cpu_share_of_one_core": total / seconds,
                "server_cpu_ms_per_host_per_minute_by_kind": {
                    kind: used * 1000 / self.n / minutes for kind, used in by_kind.items()},
                "statements_per_host_per_minute": self._daemon_statements() / self.n / minutes,
                "calls_per_host_per_minute": {
                    name: count / self.n / minutes for name, count in self._function_calls(calls).items()},
                "claim_statements_per_host_per_minute": self._daemon_statements(CLAIM_STATEMENT) / self.n / minutes,
                "top_statements": self._top_statements(self.n * minutes, "per_host_per_minute")}

    def _function_calls(self, since: dict[str, int] | None = None) -> dict[str, int]:
        """Calls so far (or since `since`) of the functions whose count says what a window's cost is made of:
        the heartbeat, its walk of the queue (host_has_work) and the fleet upkeep's explanation of waits.
        The server counts them (track_functions, see run()); a backend reports its counts when it goes
        idle, at most a second late while it is busy, so that a window's edges blur by about that much."""
        rows = self.conn.execute(
            "SELECT funcname, calls FROM pg_stat_user_functions WHERE schemaname = 'unitvisor' "
            "AND funcname = ANY(%s)", (list(COUNTED_FUNCTIONS),)).fetchall()
        now = dict.fromkeys(COUNTED_FUNCTIONS, 0) | dict(rows)
        return {name: count - (since or {}).get(name, 0) for name, count in now.items()}

    def _top_statements(self, per: float, unit: str, count: int = 8) -> list[dict[str, Any]]:
        """The daemons' statements since pg_stat_statements' reset, those that took the server the most
        time first (time in the executor, which includes waiting for a lock or for the CPU): what a
        window's figure is made of, divided by `per` (hosts times minutes, or runs), named by `unit`."""
        rows = self.conn.execute(
            rf"""SELECT left(regexp_replace(s.query, '\s+', ' ', 'g'), 120), sum(s.calls)::bigint,
                        sum(s.total_exec_time)::float8 {_DAEMON_STATEMENTS}
                 GROUP BY 1 ORDER BY 3 DESC LIMIT %s""", (CLIENT_ROLE, self.dbname, count)).fetchall()
        return [{"statement": query, f"calls_{unit}": calls / per, f"exec_ms_{unit}": spent / per,
                 "mean_ms": spent / calls if calls else 0.0}
                for query, calls, spent in rows]

    def _submit_sql(self, count: int, argv0: str, key: str | None) -> None:
        with self.conn.transaction():
            self.conn.execute("SET LOCAL statement_timeout = 0")
            self.conn.execute("SELECT unitvisor.submit_run(ARRAY[%s::text], concurrency_key => %s) "
                              "FROM generate_series(1, %s)", (argv0, key, count))

    def _cancel_queued(self) -> None:
        with self.conn.transaction():
            self.conn.execute("SET LOCAL statement_timeout = 0")
            self.conn.execute("SELECT unitvisor.cancel_run(r.id) FROM unitvisor.runs r WHERE r.state = 'queued'")

    def _settled(self) -> None:
        """Wait until no run is queued, starting or running (the burst's runs ended)."""
        deadline = time.monotonic() + self.sizes.burst_timeout
        while time.monotonic() < deadline and self.conn.execute(
                "SELECT count(*) FROM unitvisor.runs WHERE state IN ('queued', 'starting', 'running')").fetchone()[0]:
            time.sleep(0.5)

    def _explained(self, runs: int) -> dict[str, Any]:
        """Wait (at most `settle_timeout`) until the fleet upkeep has written why each of the `runs` queued
        runs waits and no run event has been written for `quiet_seconds` since (a round that follows, as
        before 043), then vacuum and analyze the tables the submit wrote, as autovacuum would once, and let
        every daemon plan its statements again (`replan_seconds`): costs paid once per run or per ANALYZE
        and not per host and minute, which (S4) and (S5) leave out. Returns how long that took and the
        server's CPU per run meanwhile."""
        def state() -> tuple[int, int]:
            return self.conn.execute(
                "SELECT (SELECT count(*) FROM unitvisor.run_waits w JOIN unitvisor.runs r ON r.id = w.run_id "
                "        WHERE r.state = 'queued'), "
                "       (SELECT coalesce(max(id), 0) FROM unitvisor.run_events)").fetchone()

        cpu, began = server_cpu_by_kind(self.pg), time.monotonic()
        (explained, seen), quiet_since = state(), began
        while explained < runs or time.monotonic() - quiet_since < self.sizes.quiet_seconds:
            if time.monotonic() - began > self.sizes.settle_timeout:
                break
            time.sleep(1.0)
            explained, newest = state()
            if newest != seen:
                seen, quiet_since = newest, time.monotonic()
        settled = explained >= runs and time.monotonic() - quiet_since >= self.sizes.quiet_seconds
        self.conn.execute("VACUUM (ANALYZE) unitvisor.runs, unitvisor.attempts, unitvisor.spawn_jobs, "
                          "unitvisor.run_events, unitvisor.run_waits")
        time.sleep(self.sizes.replan_seconds)
        used = sum(cpu_since(cpu, server_cpu_by_kind(self.pg)).values())
        return {"settle_seconds": time.monotonic() - began, "settled": settled, "explained": explained,
                "settle_server_cpu_ms_per_run": used * 1000 / runs}

    def waiting(self) -> dict[str, Any]:
        """(S4) idle with `refused` runs no host accepts; (S5) idle with `behind_key` runs behind one key
        whose head no host accepts (so none may start), each watched once the runs' reasons are written
        (_explained). Each is cancelled before the next."""
        self._settled()
        self._submit_sql(self.sizes.refused, REFUSED_EXECUTABLE, None)
        settling = self._explained(self.sizes.refused)
        refused = self._idle_window()
        self._cancel_queued()
        self._submit_sql(1, REFUSED_EXECUTABLE, "bench-key")
        self._submit_sql(self.sizes.behind_key, "/bin/true", "bench-key")
        behind_settling = self._explained(self.sizes.behind_key + 1)
        behind = self._idle_window()
        self._cancel_queued()
        return {"refused": {"runs": self.sizes.refused, **settling, **refused},
                "behind_key": {"runs": self.sizes.behind_key, **behind_settling, **behind}}

    def connections(self) -> int:
        return self.conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND usename <> %s",
                                 (self.dbname, CLIENT_ROLE)).fetchone()[0]

    def idle(self) -> dict[str, Any]:
        """(S1) The fleet with nothing to do, after its first poll intervals have passed."""
        time.sleep(min(self.sizes.idle_seconds, 10.0))  # past the start: every daemon in its steady loop
        window = self._idle_window()
        connections = self.connections()
        return {**window, "connections": connections, "connections_per_host": connections / self.n}

    def _submit(self, count: int) -> tuple[list[str], float]:
        """`count` runs in one transaction; their ids and the commit's time on the database's clock. The
        commit timestamp itself (track_commit_timestamp), not a clock read after COMMIT returned: the
        daemons' NOTIFY arrives at the commit, and their claims were seen to come before such a read."""
        with self.conn.transaction():
            ids = [str(store.submit_run(self.conn, argv=["/bin/true"])) for _ in range(count)]
            xid = self.conn.execute("SELECT pg_current_xact_id()::text::xid").fetchone()[0]
        return ids, self.conn.execute("SELECT extract(epoch FROM pg_xact_commit_timestamp(%s::xid))::float8",
                                      (xid,)).fetchone()[0]

    def _latencies_ms(self, committed: dict[str, float], timeout: float) -> tuple[list[float], list[float]]:
        """Claim latency of each run, from its submit's commit: to its first attempt's claimed_at (the claim
        statement's now(): when that claim began, before any wait for a claim slot, 046), and to the commit
        of that claim (the commit timestamp of the 'starting' event the claim wrote: when the run was
        claimed for every other session)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.conn.execute(
                """SELECT a.run_id::text, extract(epoch FROM a.claimed_at)::float8,
                          (SELECT extract(epoch FROM min(pg_xact_commit_timestamp(e.xmin)))::float8
                           FROM unitvisor.run_events e
                           WHERE e.run_id = a.run_id AND e.attempt = 1 AND e.state = 'starting')
                   FROM unitvisor.attempts a WHERE a.attempt = 1 AND a.run_id = ANY(%s::uuid[])""",
                (list(committed),)).fetchall()
            if len(rows) == len(committed) or time.monotonic() > deadline:
                return ([(claimed - committed[run]) * 1000 for run, claimed, _ in rows],
                        [(done - committed[run]) * 1000 for run, _, done in rows if done is not None])
            time.sleep(0.2)

    def trickle(self) -> dict[str, Any]:
        """(S2) Single submits, `trickle_gap` apart: each one's claim latency, and the claim statements
        (pg_stat_statements) that followed it. Who ran them is read from the workers' counts at the end."""
        committed: dict[str, float] = {}
        self.submits: list[tuple[float, float]] = []  # (wall clock at the submit, then after the gap)
        statements = []
        for _ in range(self.sizes.trickle):
            before, sent = self._daemon_statements(CLAIM_STATEMENT), time.time()
            ids, at = self._submit(1)
            committed[ids[0]] = at
            time.sleep(self.sizes.trickle_gap)
            self.submits.append((sent, time.time()))
            statements.append(self._daemon_statements(CLAIM_STATEMENT) - before)
        latencies, to_commit = self._latencies_ms(committed, self.sizes.burst_timeout)
        return {"submits": self.sizes.trickle, "gap_s": self.sizes.trickle_gap, "claimed": len(latencies),
                "claim_latency_ms": summary(latencies), "claim_committed_ms": summary(to_commit),
                "claim_statements_per_submit": summary(statements)}

    def burst(self) -> dict[str, Any]:
        """(S3) `burst` runs in one transaction, claimed by the fleet."""
        self.conn.execute("SELECT pg_stat_statements_reset()")
        before, cpu = self._daemon_statements(CLAIM_STATEMENT), server_cpu_by_kind(self.pg)
        sim, wall, cores = self.simulation_cpu(), time.monotonic(), os.cpu_count() or 1
        self.burst_window = (time.time(), math.inf)
        began = time.monotonic()
        ids, at = self._submit(self.sizes.burst)
        latencies, to_commit = self._latencies_ms(dict.fromkeys(ids, at), self.sizes.burst_timeout)
        self.burst_window = (self.burst_window[0], time.time())
        by_kind = cpu_since(cpu, server_cpu_by_kind(self.pg))
        server = sum(by_kind.values())
        per_host = self.conn.execute(
            "SELECT count(DISTINCT host_id) FROM unitvisor.attempts WHERE attempt = 1 AND run_id = ANY(%s::uuid[])",
            (ids,)).fetchone()[0]
        return {"runs": self.sizes.burst, "claimed": len(latencies), "seconds": time.monotonic() - began,
                "claim_latency_ms": summary(latencies), "claim_committed_ms": summary(to_commit),
                "hosts_that_claimed": per_host,
                "claim_statements": self._daemon_statements(CLAIM_STATEMENT) - before, "loadavg": loadavg(),
                "server_cpu_seconds": server, "server_cpu_seconds_by_kind": by_kind,
                # of the whole machine (every core): the simulation's own part of the load, and the server's
                "simulation_cpu_share": (self.simulation_cpu() - sim) / (time.monotonic() - wall) / cores,
                "server_cpu_share": server / (time.monotonic() - wall) / cores,
                "top_statements": self._top_statements(self.sizes.burst, "per_run")}

    def woken(self) -> dict[str, Any]:
        """(S2) how many daemons each single submit made run a claim: the distinct hosts whose store.claim
        was sent in the gap after it (the workers' counts), and how many of them got the run."""
        hosts, empty, failed, heard = [], [], [], []
        for began, ended in self.submits:
            calls = [(host, got) for sent, host, got in self.claims if began <= sent < ended]
            hosts.append(len({host for host, _ in calls}))
            heard.append(len({host for at, host in self.heard if began <= at < ended}))
            empty.append(sum(1 for _, got in calls if not got))
            failed.append(sum(1 for _, got in calls if got == FAILED))
        return {"daemons_that_claimed": summary(hosts), "daemons_that_heard": summary(heard),
                "empty_claims": summary(empty),
                "failed_claims": summary(failed), "share_of_fleet_p50": summary(hosts)["p50"] / self.n}

    def burst_claims(self) -> dict[str, int]:
        """(S3) the claims the daemons sent from the burst's submit until its last run was claimed: those
        that got jobs, those that got none, those that failed (the workers' counts)."""
        began, ended = self.burst_window
        got = [n for sent, _, n in self.claims if began <= sent < ended]
        return {"sent": len(got), "with_jobs": sum(1 for n in got if n > 0), "empty": got.count(0),
                "failed": got.count(FAILED)}


def measure(pg: Postgres, n: int, sizes: Sizes, baseline: Path | None = None,
            code: str | None = None) -> dict[str, Any]:
    say(f"{n} daemons{' (baseline)' if baseline else ''}: starting ...")
    began = time.monotonic()
    fleet = Fleet(pg, n, sizes, baseline, code)
    try:
        result: dict[str, Any] = {"hosts": n, "workers": len(fleet.workers),
                                  "start_seconds": time.monotonic() - began}
        say(f"{n} daemons: all registered in {result['start_seconds']:.1f} s; idle for {sizes.idle_seconds:g} s ...")
        result["idle"] = fleet.idle()
        say(f"{n} daemons: {sizes.trickle} single submits ...")
        result["trickle"] = fleet.trickle()
        say(f"{n} daemons: a burst of {sizes.burst} runs ...")
        result["burst"] = fleet.burst()
        say(f"{n} daemons: idle with {sizes.refused} runs no host accepts, then {sizes.behind_key} behind one key ...")
        result["waiting"] = fleet.waiting()
        result["hosts_declared_dead"] = fleet.hosts_declared_dead()
    finally:
        fleet.stop()
    result["trickle"]["woken"] = fleet.woken()
    result["burst"]["daemon_claims"] = fleet.burst_claims()
    return result


@contextlib.contextmanager
def keep_server_log(pg: Postgres, to: Path | None) -> Iterator[None]:
    try:
        yield
    finally:
        if to is not None and (pg.dir / "log").exists():
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pg.dir / "log", to)
            say(f"the server's log: {to}")


def baseline_code(baseline: Path) -> str:
    """A directory whose only entry is `supervisor`, a link to the baseline checkout's package."""
    code = tempfile.mkdtemp(prefix="unitvisor-baseline-")
    os.symlink(baseline.resolve() / "supervisor", Path(code) / "supervisor")
    return code


def run(sizes: Sizes, baseline: Path | None = None, baseline_fleets: list[int] | None = None,
        server_log: Path | None = None) -> dict[str, Any]:
    """Every fleet size of `sizes`, each first with the baseline's code where `baseline_fleets` (default:
    every size) has it. The throwaway server's log is copied to `server_log` at the end, whatever
    happened: 0.11.0's 1,000 hosts saw every session end at once, and the log that said why went with
    the cluster."""
    baseline_fleets = sizes.fleets if baseline_fleets is None else baseline_fleets
    started = dt.datetime.now(dt.UTC)
    with database() as pg, keep_server_log(pg, server_log):
        # bench.run's cluster, with room for the largest fleet's connections (the default 100 would not do).
        needed = CONNECTIONS_PER_DAEMON * max(sizes.fleets) + SPARE_CONNECTIONS
        # (a real deployment: docs/fleet.md, The ceiling of one PostgreSQL)
        pg.settings["max_connections"] = str(max(100, needed))
        # Counts of plpgsql calls, for Fleet._function_calls (a few microseconds a call, baseline alike).
        pg.settings["track_functions"] = "pl"
        pg.restart()
        with pg.connect() as conn:
            server = conn.execute("SHOW server_version").fetchone()[0]
        r: dict[str, Any] = {
            "date": started.isoformat(timespec="seconds"), "machine": machine_facts(), "sizes": asdict(sizes),
            "versions": {"unitvisor": __version__, "postgresql": server, "python": sys.version.split()[0],
                         "psycopg": psycopg.__version__},
            "max_connections": int(pg.settings["max_connections"]), "systemd": "fake (bench/scale.py FakeSystemd)",
            "loadavg": {"start": loadavg()}, "fleets": {},
        }
        code = baseline_code(baseline) if baseline else None
        if baseline:
            r["baseline"] = {"checkout": str(baseline), "fleets": {}, "at": baseline_fleets}
        try:
            for n in sizes.fleets:
                if baseline and n in baseline_fleets:
                    r["baseline"]["fleets"][str(n)] = measure(pg, n, sizes, baseline, code)
                r["fleets"][str(n)] = measure(pg, n, sizes)
        finally:
            if code:
                shutil.rmtree(code, ignore_errors=True)
        r["loadavg"]["end"] = loadavg()
        r["wall_seconds"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
        return r


def table(r: dict[str, Any]) -> str:
    def ms(s: dict[str, float]) -> str:
        return f"{s['p50']:.0f} / {s['p99']:.0f} ms" if not math.isnan(s["p50"]) else "-"

    lines = [f"Fleet at scale (simulated; systemd is a fake), {r['machine']['nproc']} cores, "
             f"load {r['loadavg']['start']}",
             f"{'hosts':>10}  {'(S1) CPU/host/min':>17}  {'stmts/host/min':>14}  "
             f"{'(S2) claim p50/p99':>18}  {'woken':>5}  {'heard':>5}  "
             f"{'(S3) burst p50/p99':>20}  {'(S3) committed':>20}  "
             f"{'empty':>5}  {'dead':>4}  "
             f"{'sim CPU':>7}  {'(S4) refused':>12}  {'(S5) behind key':>15}"]
    rows = [(f"{n} base", f) for n, f in r.get("baseline", {}).get("fleets", {}).items()]
    rows += [(f"{n}", f) for n, f in r["fleets"].items()]
    rows.sort(key=lambda row: (int(row[0].split()[0]), len(row[0].split()) == 1))
    for label, f in rows:
        idle, trickle, burst = f["idle"], f["trickle"], f["burst"]
        woken = trickle["woken"]["daemons_that_claimed"]["p50"]
        heard = trickle["woken"]["daemons_that_heard"]["p50"]
        waiting = f.get("waiting", {})
        per_min = idle["server_cpu_ms_per_host_per_minute"]

        def vs(which: str, waiting: dict = waiting, per_min: float = per_min) -> str:
            got = waiting.get(which, {}).get("server_cpu_ms_per_host_per_minute")
            return f"{got:.1f} ms ({got / per_min:.2f}x)" if got is not None and per_min else "-"

        lines.append(f"{label:>10}  {per_min:>14.1f} ms  {idle['statements_per_host_per_minute']:>14.1f}  "
                     f"{ms(trickle['claim_latency_ms']):>18}  {woken:>5.0f}  {heard:>5.0f}  "
                     f"{ms(burst['claim_latency_ms']):>20}  "
                     f"{ms(burst['claim_committed_ms']) if 'claim_committed_ms' in burst else '-':>20}  "
                     f"{burst['daemon_claims']['empty']:>5}  {f.get('hosts_declared_dead', '-'):>4}  "
                     f"{burst.get('simulation_cpu_share', math.nan):>7.0%}  {vs('refused'):>12}  "
                     f"{vs('behind_key'):>15}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="5 daemons, every figure in seconds (smoke test)")
    parser.add_argument("--fleets", help="comma-separated fleet sizes [default: 100,300]")
    parser.add_argument("--idle-seconds", type=float, help="how long the idle fleet is watched [default: 60]")
    parser.add_argument("--burst", type=int, help="runs submitted in one transaction [default: 1000]")
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier release (its supervisor/ and "
                        "sql/), measured first at every fleet size, in the same run")
    parser.add_argument("--baseline-fleets", help="comma-separated fleet sizes also measured with --baseline "
                        "[default: every size]")
    parser.add_argument("--refused", type=int, help="(S4) runs no host accepts [default: 1000]")
    parser.add_argument("--behind-key", type=int, help="(S5) runs behind one concurrency key [default: 10000]")
    parser.add_argument("--out", type=Path, help="the JSON file [default: bench/results/scale.json, "
                        "or scale-tiny.json with --tiny]")
    parser.add_argument("--server-log", type=Path, default=REPO / "build" / "scale-server.log",
                        help="where the throwaway PostgreSQL's log is kept [default: build/scale-server.log]")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else Sizes()
    if args.fleets:
        sizes.fleets = [int(v) for v in args.fleets.split(",")]
    if args.idle_seconds is not None:
        sizes.idle_seconds = args.idle_seconds
    if args.burst is not None:
        sizes.burst = args.burst
    if args.refused is not None:
        sizes.refused = args.refused
    if args.behind_key is not None:
        sizes.behind_key = args.behind_key
    out = args.out or RESULTS / ("scale-tiny.json" if args.tiny else "scale.json")
    interrupt_on_sigterm()
    baseline_fleets = [int(v) for v in args.baseline_fleets.split(",")] if args.baseline_fleets else None
    results = run(sizes, args.baseline, baseline_fleets, args.server_log)
    save(out, results)
    print(table(results))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
