"""`make bench`: unitvisor measured against systemd's own limit, each figure next to its baseline
from the same run.

Boots a throwaway PostgreSQL (with pg_stat_statements and commit timestamps) and a throwaway systemd
test bed with the test harness, runs the daemon there under the real unitvisor.service, and
measures: (1) the limit, (2) throughput, (3) latency, (4) reconcile, (5) idle, (6) scaling, (7) the
run sandbox (its systemd-analyze security exposure, and throughput with it and without it). What
each figure means, and the latest results, are in docs/benchmarks.md. Everything it starts is gone
when it ends, also on failure or Ctrl-C (the harness's context managers).

    .venv/bin/python -m bench.run            # the full run (about 10 minutes here), JSON to bench/results/
    .venv/bin/python -m bench.run --tiny     # every figure on tiny sizes, in seconds (the smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench import peers_env, pyspy_top
from bench.inside import UNSANDBOXED_RUNS
from supervisor import __version__, store
from tests.harness import postgres as postgres_mod
from tests.harness import testbed as testbed_mod
from tests.harness.commands import children
from tests.harness.host import REPO, VENV_BIN, Host, wait_for
from tests.harness.postgres import Postgres

INSIDE = REPO / "bench" / "inside.py"
# (3)'s runs and the raw starts beside them, in this many turns of each (Bench.latency).
LATENCY_BLOCKS = 10
PEERS = REPO / "bench" / "peers.py"
RESULTS = REPO / "bench" / "results"
HOST_ID = "bench-host"
DB = "bench"
# The benchmark's own connections log in as this role, so that pg_stat_statements (which keys on
# the user) can tell the daemon's statements (user postgres) from the benchmark's polling.
CLIENT_ROLE = "bench_client"
# The peers' workers log in as this role: their statements per job, counted apart from the daemon's.
PEER_ROLE = "bench_peer"
# (8) the peers (bench/peers.py): (how each job starts its unit, the unit's properties). Bare as the
# issue measured them; `product` is unitvisor's sandboxed units, the same properties as its own.
PEER_VARIANTS = (("systemd-run", "bare"), ("systemd-run", "product"), ("pystemd", "bare"), ("pystemd", "product"))
TERMINAL = ("succeeded", "failed", "cancelled")
MSG_UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"  # PID 1's "Started UNIT", logged on entering active
# The daemon as shipped: the packaged defaults (poll 5 s, heartbeat 10 s, reconcile 60 s, max_runs
# 64, claim_batch 32), with only what a host must set.
DAEMON_CONFIG = f"""
[host]
id = "{HOST_ID}"
name = "{HOST_ID}"

[runs]
allowed_executables = ["/bin/true", "/bin/sleep"]
"""


@dataclass
class Sizes:
    limit: int = 1000
    throughput: int = 1000
    latency: int = 200
    reconcile: int = 10_000
    reconcile_units: int = 1000
    idle_seconds: float = 60.0
    scaling: list[int] = field(default_factory=lambda: [100, 1000, 10_000])
    # (7): passes of `throughput` runs for each of sandboxed and unsandboxed, alternating, so that a
    # load that comes and goes on the machine falls on both.
    sandbox_rounds: int = 2


TINY = Sizes(limit=40, throughput=20, latency=8, reconcile=200, reconcile_units=20, idle_seconds=3.0,
             scaling=[10, 20], sandbox_rounds=1)
# The goal of issue 11: a run's unit rated 3.0 or lower by systemd-analyze security, network allowed.
EXPOSURE_GOAL = 3.0

TARGETS = {
    "throughput_ratio": "throughput >= 0.8 of the limit",
    "latency_to_active": "p50 latency to active within 15 ms of one raw start call's p50",
    "reconcile_time": "a reconcile pass of 10,000 runs under 2 s",
    "reconcile_queries": "database statements of a pass do not grow with the number of runs",
    "idle_statements": "idle: at most a handful of statements a minute (the heartbeat: <= 6)",
    "idle_cpu": "idle: no measurable CPU (< 0.05 s a minute)",
    "idle_memory": "idle: under 60 MB resident",
    "sandbox_exposure": f"a live run's systemd-analyze security exposure <= {EXPOSURE_GOAL} (network allowed)",
}


# -- small helpers ------------------------------------------------------------------------------


SCHEDSTAT_PROCS = ("PID 1", "journald", "dbus-daemon", "the daemon", "the machine")


def machine_cpu() -> tuple[int, int]:
    """The whole machine's CPU time (ns, /proc/stat: every core's busy ticks, the unit's short-lived
    processes and the bench's own included) and its CPU pressure (ns of wall time in which some task
    waited for a CPU, /proc/pressure/cpu), as a `Bench.schedstat` pair."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    ticks = user + nice + system + irq + softirq  # not steal (another guest's), nor guest (inside user)
    some = Path("/proc/pressure/cpu").read_text().split("\n")[0]
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK"), int(some.rsplit("total=", 1)[1]) * 1000


def add_schedstat(into: dict[str, list[int]], before: dict[str, tuple[int, int]],
                  after: dict[str, tuple[int, int]]) -> None:
    """Add each process's CPU and waiting time between two `Bench.schedstat` readings to `into`."""
    for proc, (cpu, waiting) in after.items():
        total = into.setdefault(proc, [0, 0])
        total[0] += cpu - before[proc][0]
        total[1] += waiting - before[proc][1]


def aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """A table's lines: each column padded to its widest cell, a rule of dashes under the first row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": pct(values, 50), "p95": pct(values, 95), "p99": pct(values, 99),
            "min": min(values, default=math.nan), "max": max(values, default=math.nan), "n": len(values)}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def loadavg() -> str:
    """The machine's load average, recorded at each phase: another job on this 2-core machine (a
    test suite, a build) shows here, and explains a figure that moved between runs."""
    return Path("/proc/loadavg").read_text().strip()


class Bench:
    """One benchmark session: the database, the test bed, the daemon's host, and the figures."""

    def __init__(self, pg: Postgres, tb: testbed_mod.Testbed, sizes: Sizes, profile: bool) -> None:
        self.pg = pg
        self.tb = tb
        self.sizes = sizes
        self.profile = profile
        self.daemon_dsn = pg.dsn_for(DB)
        self.client = psycopg.connect(f"host=127.0.0.1 port={pg.port} user={CLIENT_ROLE} dbname={DB}",
                                      autocommit=True)
        self.admin = psycopg.connect(pg.dsn, autocommit=True)  # the statistics, read from another database
        self.host = Host(tb, self.daemon_dsn, host_id=HOST_ID)
        self.results: dict[str, Any] = {"loadavg": {}}

    def close(self) -> None:
        self.client.close()
        self.admin.close()

    # -- inside the test bed ----------------------------------------------------------------------

    def inside(self, *args: str, stdin: str | None = None, timeout: float = 900, script: Path = INSIDE,
               python: Path = VENV_BIN / "python") -> dict[str, Any]:
        """A bench script (bench/inside.py by default) run inside the test bed: its one JSON object."""
        result = self.tb.run(str(python), str(script), *args, input=stdin, timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"bench/{script.name} {args[0]} failed: {result.stderr.strip()[-2000:]}")
        return json.loads(result.stdout)

    def main_pid(self) -> int:
        return int(self.host.unit_props("unitvisor.service", "MainPID")["MainPID"])

    def cpu_seconds(self, pid: int) -> float:
        """utime + stime of a process inside the test bed. CPUUsageNSec is not available on a host
        whose cgroups are v1 and read-only in the container (this one), so /proc it is."""
        stat = self.tb.run("cat", f"/proc/{pid}/stat").stdout
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def unit_cpu_nsec(self, unit: str) -> int | None:
        value = self.host.unit_props(unit, "CPUUsageNSec").get("CPUUsageNSec", "")
        return int(value) if value.isdigit() else None

    def memory_kb(self, pid: int) -> dict[str, int]:
        status = self.tb.run("cat", f"/proc/{pid}/status").stdout
        out = {}
        for line in status.splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(rest.split()[0])
        return out

    def pid_of(self, unit: str) -> int:
        return int(self.host.unit_props(unit, "MainPID")["MainPID"])

    # -- database ---------------------------------------------------------------------------------

    def reset_statements(self) -> None:
        self.admin.execute("SELECT pg_stat_statements_reset()")

    def daemon_statements(self, top: int = 0, role: str = "postgres") -> tuple[int, list[dict[str, Any]]]:
        """Statements run in the benchmark's database by the daemon's role (or a peer's) since the
        last reset."""
        rows = self.admin.execute(
            """SELECT s.calls, s.query FROM pg_stat_statements s
               JOIN pg_database d ON d.oid = s.dbid JOIN pg_roles u ON u.oid = s.userid
               WHERE d.datname = %s AND u.rolname = %s ORDER BY s.calls DESC""", (DB, role)).fetchall()
        total = sum(row[0] for row in rows)
        return total, [{"calls": c, "query": " ".join(q.split())[:160]} for c, q in rows[:top]]

    def xact_commits(self) -> int:
        self.admin.execute("SELECT pg_stat_clear_snapshot()")
        return int(self.admin.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                                      (DB,)).fetchone()[0])

    def wait_quiet(self, timeout: float = 600) -> None:
        """Until no run of the benchmark's is still in flight and no unit of ours is loaded."""
        wait_for(lambda: self.client.execute(
            "SELECT count(*) = 0 FROM unitvisor.runs WHERE state IN ('queued', 'starting', 'running')"
        ).fetchone()[0], timeout=timeout, interval=0.25, what="every run to finish")
        wait_for(lambda: not self.host.loaded_run_units(), timeout=60, what="every unit to be released")

    # -- (1) the limit ----------------------------------------------------------------------------

    def limit(self) -> None:
        n = self.sizes.limit
        self.results["loadavg"]["limit"] = loadavg()
        say(f"(1) the limit: {n} StartTransientUnit calls of /bin/true on one connection ...")
        out: dict[str, Any] = {}
        for props in ("bare", "product", "unsandboxed"):
            raw = self.inside("limit", "--n", str(n), "--props", props, "--prefix", f"bench-{props}")
            out[props] = {
                "n": n, "loop_seconds": raw["loop_s"], "starts_per_s": n / raw["loop_s"],
                "call_ms": summary(raw["call_ms"]), "all_ran_seconds": raw["drain_s"],
                "all_ran_per_s": n / raw["drain_s"], "all_ran": raw["drained"],
                "throttled_seconds": raw["throttled_s"],
            }
        for props in ("bare", "product", "unsandboxed"):
            raw = self.inside("active", "--n", str(self.sizes.latency), "--props", props)
            out[props]["start_to_active_ms"] = summary(raw["to_active_ms"])
        # Issue 27: the daemon's side of systemd alone, the sandbox off (where the gap to the raw loop is),
        # with PID 1's and the bus's CPU beside the loop's own: which of them, if any, is the limit.
        pids = {"pid1": 1, "dbus": self.pid_of("dbus.service")}
        for kind, flags, what in (
                ("signals", (), ""), ("held", ("--hold",), ", each held, read and released as the daemon does"),
                ("split", ("--split",), ", held, read and released, the reads in a second process")):
            say(f"(1) the limit: {n} sandbox-off units as slots free, their ends read from their signals{what} ...")
            cpu0 = {name: self.cpu_seconds(pid) for name, pid in pids.items()}
            raw = self.inside("outcome-loop", "--n", str(n), "--props", "unsandboxed",
                              "--prefix", f"bench-loop-{kind}-", *flags)
            raw["cpu_ms_per_run_of"] = {name: (self.cpu_seconds(pid) - cpu0[name]) * 1000 / n
                                        for name, pid in pids.items()}
            out["unsandboxed"][f"outcome_loop_{kind}"] = raw
        self.results["limit"] = out

    # -- daemon -----------------------------------------------------------------------------------

    def start_daemon(self, runs_extra: str = "") -> None:
        """The daemon with DAEMON_CONFIG, plus `runs_extra` keys in its [runs]."""
        self.host.configure(config=DAEMON_CONFIG + runs_extra)
        self.host.start()
        wait_for(lambda: self.client.execute("SELECT count(*) FROM unitvisor.hosts WHERE id = %s",
                                             (HOST_ID,)).fetchone()[0], what="the host row")

    # -- (5) idle ---------------------------------------------------------------------------------

    def idle(self) -> None:
        seconds = self.sizes.idle_seconds
        self.results["loadavg"]["idle"] = loadavg()
        say(f"(5) idle: the daemon with nothing to do for {seconds:.0f} s ...")
        pid = self.main_pid()
        time.sleep(min(3.0, seconds))  # past start-up: its first claim, heartbeat and reconcile
        self.reset_statements()
        commits0, cpu0, nsec0 = self.xact_commits(), self.cpu_seconds(pid), self.unit_cpu_nsec("unitvisor.service")
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        statements, top = self.daemon_statements(top=12)
        commits1, cpu1, nsec1 = self.xact_commits(), self.cpu_seconds(pid), self.unit_cpu_nsec("unitvisor.service")
        mem = self.memory_kb(pid)
        self.results["idle"] = {
            "seconds": elapsed, "statements": statements, "statements_per_min": statements * 60 / elapsed,
            "xact_commits": commits1 - commits0, "cpu_seconds": cpu1 - cpu0,
            "cpu_seconds_per_min": (cpu1 - cpu0) * 60 / elapsed,
            "cpu_source": "/proc/PID/stat utime+stime (CPUUsageNSec is not set: cgroup v1 in the container)"
            if nsec0 is None else "CPUUsageNSec",
            "cpu_usage_nsec": None if nsec0 is None or nsec1 is None else nsec1 - nsec0,
            "vmhwm_mb": mem["VmHWM"] / 1024, "vmrss_mb": mem["VmRSS"] / 1024, "statements_by_query": top,
        }

    # -- (3) latency ------------------------------------------------------------------------------

    def latency(self, label: str = "latency", beside: bool = False) -> dict[str, Any]:
        """(3) runs of /bin/true one at a time, on the running daemon; `label` names the phase. With
        `beside`, the raw loop's start -> active with the same units too, in turns with the runs
        (LATENCY_BLOCKS blocks of each): the machine's drift over a phase moved either side's p50 by
        several ms from one minute to the next, more than issue 27's 3 ms, and in turns it falls on both."""
        n = self.sizes.latency
        self.results["loadavg"][label] = loadavg()
        say(f"(3) {label}: {n} runs of /bin/true, one at a time{', in turns with raw starts' if beside else ''} ...")
        since = int(time.time()) - 1
        ids: list[uuid.UUID] = []
        raw: dict[str, list[float]] = {"to_active_ms": [], "call_ms": []}
        blocks = min(LATENCY_BLOCKS, n) if beside else 1
        daemon_pid = self.main_pid()
        sched: dict[str, dict[str, list[int]]] = {"daemon's units": {}, "raw loop's": {}}
        spy = self.start_py_spy(daemon_pid, label) if self.profile else None
        for block in range(blocks):
            size = n // blocks + (block < n % blocks)
            before = self.schedstat(daemon_pid) if beside else {}
            for _ in range(size):
                run_id = self.client.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])").fetchone()[0]
                ids.append(run_id)
                wait_for(lambda run_id=run_id: self.client.execute(
                    "SELECT state = ANY(%s) FROM unitvisor.runs WHERE id = %s", (list(TERMINAL), run_id)).fetchone()[0],
                    timeout=60, interval=0.005, what=f"run {run_id}")
            if beside:
                between = self.schedstat(daemon_pid)
                same = self.inside("active", "--n", str(size), "--props", "product",
                                   "--prefix", f"bench-active-beside-{block}")
                for key in raw:
                    raw[key] += same[key]
                add_schedstat(sched["daemon's units"], before, between)
                add_schedstat(sched["raw loop's"], between, self.schedstat(daemon_pid))
        if spy:
            self.stop_py_spy(spy, label)
        rows = self.client.execute(
            """SELECT a.unit_name, a.outcome,
                      extract(epoch FROM pg_xact_commit_timestamp(e.xmin))::float8 AS committed,
                      extract(epoch FROM a.claimed_at)::float8 AS claimed,
                      -- mark_started's now(): its statement is sent once StartTransientUnit has returned.
                      extract(epoch FROM a.started_at)::float8 AS marked_started,
                      -- The spawn job's last write is the claim's: its commit ends the claim.
                      extract(epoch FROM pg_xact_commit_timestamp(j.xmin))::float8 AS claim_committed,
                      -- The run row's last write is the outcome's (record_outcome); the attempt row's
                      -- is its output tail, written two seconds or more later (journal.TailReader).
                      extract(epoch FROM pg_xact_commit_timestamp(r.xmin))::float8 AS recorded
               FROM unitvisor.runs r JOIN unitvisor.attempts a ON a.run_id = r.id
               JOIN unitvisor.run_events e ON e.run_id = r.id AND e.reason = 'submitted'
               JOIN unitvisor.spawn_jobs j ON j.run_id = r.id AND j.state = 'claimed'
               WHERE r.id = ANY(%s)""", (ids,)).fetchall()
        active = self.active_timestamps(since)
        to_active, to_recorded, to_claim, claim_to_active, active_to_recorded = [], [], [], [], []
        # claim -> active, split where the database can see it (issue 27): the claim's own statement
        # (its transaction's start to its commit), the daemon from that commit to its mark_started
        # (building the unit and StartTransientUnit's round trip), and PID 1 after that.
        in_claim, claimed_to_marked, marked_to_active = [], [], []
        missing = 0
        for unit, _outcome, committed, claimed, marked, claim_committed, recorded in rows:
            to_recorded.append((recorded - committed) * 1000)
            to_claim.append((claimed - committed) * 1000)
            in_claim.append((claim_committed - claimed) * 1000)
            claimed_to_marked.append((marked - claim_committed) * 1000)
            if unit not in active:
                missing += 1
                continue
            to_active.append((active[unit] - committed) * 1000)
            claim_to_active.append((active[unit] - claimed) * 1000)
            marked_to_active.append((active[unit] - marked) * 1000)
            active_to_recorded.append((recorded - active[unit]) * 1000)
        out: dict[str, Any] = {
            "n": n, "outcomes": sorted({row[1] for row in rows}), "active_timestamp_missing": missing,
            "to_active_ms": summary(to_active), "to_recorded_ms": summary(to_recorded),
            "breakdown_ms": {"commit_to_claim": summary(to_claim), "claim_to_active": summary(claim_to_active),
                             "active_to_recorded": summary(active_to_recorded),
                             "claim_statement": summary(in_claim),
                             "claim_committed_to_marked_started": summary(claimed_to_marked),
                             "marked_started_to_active": summary(marked_to_active)},
        }
        if beside:
            out["raw_start_to_active_beside_ms"] = summary(raw["to_active_ms"])
            out["raw_start_call_beside_ms"] = summary(raw["call_ms"])
            out["schedstat_ms_per_unit"] = {side: {proc: {"cpu": cpu / n / 1e6, "waiting": waiting / n / 1e6}
                                                   for proc, (cpu, waiting) in procs.items()}
                                            for side, procs in sched.items()}
        return out

    def schedstat(self, daemon_pid: int) -> dict[str, tuple[int, int]]:
        """CPU time and time spent waiting for a CPU (ns, /proc/PID/schedstat) of PID 1, journald,
        dbus-daemon and the daemon in the test bed: issue 27's latency gap, looked for in PID 1 after the
        unit's start call, in who has the CPU while PID 1 starts the unit."""
        script = ("for p in 1 $(pidof -s systemd-journald) $(pidof -s dbus-daemon) " + str(daemon_pid) + "; do "
                  "read cpu waiting _ < /proc/$p/schedstat && echo $cpu $waiting; done")
        lines = self.tb.run("sh", "-c", script).stdout.split()
        numbers = [int(word) for word in lines]
        out = {proc: (numbers[2 * i], numbers[2 * i + 1]) for i, proc in enumerate(SCHEDSTAT_PROCS[:-1])}
        out[SCHEDSTAT_PROCS[-1]] = machine_cpu()
        return out

    def active_timestamps(self, since: int, prefix: str = "unitvisor-run-") -> dict[str, float]:
        """When each unit of ours entered `active`, by PID 1's "Started" record. journald stamps it
        with the time PID 1 sent it (_SOURCE_REALTIME_TIMESTAMP), which is the unit's
        ActiveEnterTimestamp within a few µs; the unit itself is unloaded once its outcome is
        recorded, so its properties cannot be read afterwards."""
        out = self.tb.run("journalctl", "--no-pager", "-q", "-o", "json", f"--since=@{since}", "_PID=1",
                          f"MESSAGE_ID={MSG_UNIT_STARTED}", timeout=120).stdout
        stamps = {}
        for line in out.splitlines():
            entry = json.loads(line)
            unit = entry.get("UNIT", "")
            if unit.startswith(prefix):
                stamps[unit] = int(entry.get("_SOURCE_REALTIME_TIMESTAMP") or entry["__REALTIME_TIMESTAMP"]) / 1e6
        return stamps

    # -- (2) throughput ---------------------------------------------------------------------------

    def throughput(self, n: int, label: str = "") -> dict[str, Any]:
        """n runs of /bin/true submitted in one transaction while the daemon runs; the clock runs
        from that commit to the commit of the last outcome (PostgreSQL's commit timestamps). `label`
        names the profile of a pass of (7): profile-throughput-<n>-<label>.txt."""
        self.results["loadavg"][f"throughput-{n}"] = loadavg()
        say(f"(2) throughput: {n} runs of /bin/true submitted at once ...")
        self.wait_quiet()
        pids = {"daemon": self.main_pid(), "pid1": 1, "journald": self.pid_of("systemd-journald.service")}
        cpu0 = {name: self.cpu_seconds(pid) for name, pid in pids.items()}
        self.reset_statements()
        since = int(time.time()) - 1
        ids = [row[0] for row in self.client.execute(
            "SELECT unitvisor.submit_run(ARRAY['/bin/true']) FROM generate_series(1, %s)", (n,)).fetchall()]
        spied = f"throughput-{n}" + (f"-{label}" if label else "")
        spy = self.start_py_spy(pids["daemon"], spied) if self.profile else None
        try:
            self.wait_quiet(timeout=120 + n / 5)
        finally:
            if spy:
                self.stop_py_spy(spy, spied)
        cpu = {name: self.cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
        statements, top = self.daemon_statements(top=12)
        committed, recorded, outcomes = self.client.execute(
            """SELECT (SELECT min(extract(epoch FROM pg_xact_commit_timestamp(e.xmin)))::float8
                       FROM unitvisor.run_events e WHERE e.run_id = ANY(%(ids)s) AND e.reason = 'submitted'),
                      max(extract(epoch FROM pg_xact_commit_timestamp(a.xmin)))::float8,
                      array_agg(DISTINCT a.outcome)
               FROM unitvisor.attempts a WHERE a.run_id = ANY(%(ids)s)""", {"ids": ids}).fetchone()
        seconds = recorded - committed
        # The peers' measure too (8): from the commit to PID 1's "Started" record of the last unit.
        units = [row[0] for row in self.client.execute(
            "SELECT unit_name FROM unitvisor.attempts WHERE run_id = ANY(%s)", (ids,)).fetchall()]
        active = self.active_timestamps(since)
        started_seconds = max((active[u] for u in units if u in active), default=math.nan) - committed
        return {"n": n, "seconds": seconds, "runs_per_s": n / seconds, "outcomes": sorted(outcomes),
                "started_seconds": started_seconds, "started_runs_per_s": n / started_seconds,
                "started_missing": sum(u not in active for u in units),
                "statements": statements, "statements_per_run": statements / n,
                "cpu_seconds": cpu, "daemon_cpu_ms_per_run": cpu["daemon"] * 1000 / n,
                "statements_by_query": top}

    def start_py_spy(self, pid: int, label: str) -> subprocess.Popen | None:
        """Sample the daemon (PID `pid` in the test bed) while a phase runs, if py-spy is installed
        (before the test bed boots: its root is this machine's, as it was then): `--profile` writes
        collapsed stacks to bench/results/profile-<label>.txt; stop_py_spy() ends it and writes where
        the loop's time goes (bench/pyspy_top.py) to profile-<label>-top.txt.

        Inside the test bed, on the daemon's PID there; with the native frames and every sample. From
        outside, py-spy cannot match the interpreter's thread ids (the test bed's PID namespace) with
        the kernel's, and without the native frames it counts pystemd's waits for PID 1 (made holding
        the GIL) as work: the profile was wall-clock time of four threads, not CPU. pyspy_top tells the
        waits apart by the native frames instead."""
        spy = _which("py-spy")
        if not spy:
            say("  (py-spy not found: no profile)")
            return None
        RESULTS.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(["nsenter", "-t", str(self.tb.leader), "-a", "--", spy, "record", "--pid", str(pid),
                                 "--native", "--idle", "--rate", "100", "--format", "raw",
                                 "--output", str(RESULTS / f"profile-{label}.txt")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def stop_py_spy(spy: subprocess.Popen, label: str) -> None:
        """SIGINT to py-spy, which then writes its profile. nsenter passes no signal on to the command
        it forked, so the signal goes to nsenter's children themselves."""
        for child in children(spy.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGINT)
        try:
            spy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
        raw = RESULTS / f"profile-{label}.txt"
        if raw.exists():
            top = raw.with_name(f"profile-{label}-top.txt")
            top.write_text(pyspy_top.report(pyspy_top.summarize(raw.read_text().splitlines())))
            say(f"  profile: {raw}, where the loop's time goes: {top}")
        else:
            say("  (py-spy wrote no profile)")

    # -- (7) the run sandbox ----------------------------------------------------------------------

    def exposure(self) -> dict[str, Any]:
        """systemd-analyze security of one live run's unit, as the running daemon started it."""
        run_id = self.client.execute("SELECT unitvisor.submit_run(ARRAY['/bin/sleep', '300'])").fetchone()[0]
        unit = wait_for(lambda: (row := self.client.execute(
            """SELECT a.unit_name FROM unitvisor.runs r JOIN unitvisor.attempts a ON a.run_id = r.id
               WHERE r.id = %s AND r.state = 'running'""", (run_id,)).fetchone()) and row[0],
            timeout=60, what="the run to be running")
        out = self.tb.run("systemd-analyze", "security", "--no-pager", unit, timeout=120).stdout
        self.host.cli("cancel", str(run_id))
        self.wait_quiet()
        overall = next(line for line in out.splitlines() if "Overall exposure level" in line)
        failed = [line.split()[1] for line in out.splitlines() if line.startswith("✗")]
        return {"exposure": float(overall.split(":")[1].split()[0]), "overall": overall.strip("→ "),
                "not_met": failed}

    def sandbox(self) -> dict[str, Any]:
        """The exposure and the throughput of the daemon with the sandbox (the defaults) and without it
        (UNSANDBOXED_RUNS: no sandbox, no mount namespace, a fixed user), each pass a daemon restarted with
        its config."""
        n = self.sizes.throughput
        out: dict[str, Any] = {"n": n, "unsandboxed_config": UNSANDBOXED_RUNS.strip().splitlines()}
        for label in ("sandboxed", "unsandboxed"):
            out[label] = {"passes": []}
        for round_ in range(self.sizes.sandbox_rounds):
            for label in ("sandboxed", "unsandboxed"):
                then = "exposure, then " if round_ == 0 else ""
                say(f"(7) sandbox: {label}, round {round_ + 1}: {then}{n} runs at once ...")
                self.host.stop()
                self.start_daemon("" if label == "sandboxed" else UNSANDBOXED_RUNS)
                if round_ == 0:
                    out[label].update(self.exposure())
                    # Latency of this daemon too: the peers' table (8) sets sandbox off beside them.
                    out[label]["latency_to_active_ms"] = self.latency(f"latency-{label}")["to_active_ms"]
                row = self.throughput(n, label=f"{label}-{round_ + 1}")
                out[label]["passes"].append({k: row[k] for k in ("seconds", "runs_per_s", "outcomes",
                                                                 "daemon_cpu_ms_per_run", "cpu_seconds",
                                                                 "started_runs_per_s", "statements_per_run")})
        for label in ("sandboxed", "unsandboxed"):
            passes = out[label]["passes"]
            for key in ("runs_per_s", "started_runs_per_s", "statements_per_run"):
                out[label][key] = sum(p[key] for p in passes) / len(passes)
            out[label]["pid1_cpu_ms_per_run"] = sum(p["cpu_seconds"]["pid1"] for p in passes) * 1000 / (n * len(passes))
        out["throughput_ratio"] = out["sandboxed"]["runs_per_s"] / out["unsandboxed"]["runs_per_s"]
        self.host.stop()
        return out

    # -- (8) the peers ----------------------------------------------------------------------------

    def peer(self, *args: str) -> dict[str, Any]:
        """bench/peers.py inside the test bed, with the peers' own virtualenv."""
        return self.inside(*args, script=PEERS, python=peers_env.PYTHON)

    def peers(self) -> dict[str, Any]:
        """(8) pgqueuer workers that start a transient unit per job, as a team would hack one together
        (bench/peers.py), each timed as unitvisor is: `latency` jobs one at a time and `throughput`
        jobs committed in one transaction, from the commit to PID 1's "Started" record of the unit
        (of the last unit, for throughput). The daemon is stopped meanwhile."""
        dsn = f"postgresql://{PEER_ROLE}@127.0.0.1:{self.pg.port}/{DB}"  # the worker's: its statements
        client = f"postgresql://{CLIENT_ROLE}@127.0.0.1:{self.pg.port}/{DB}"  # the enqueuing driver's
        n, n_latency = self.sizes.throughput, self.sizes.latency
        say("(8) peers: systemd-run and pystemd start the same units (systemctl show), pgqueuer's schema ...")
        out: dict[str, Any] = {"n": n, "latency_n": n_latency, "same_units": self.peer("check"),
                               "versions": peers_env.versions()}
        self.peer("install", "--dsn", client)
        for start, props in PEER_VARIANTS:
            label = f"{start}-{props}"
            self.results["loadavg"][f"peers-{label}"] = loadavg()
            say(f"(8) peers: pgqueuer + {start}, {props} units: {n_latency} jobs one at a time, then {n} at once ...")
            worker = f"bench-peer-worker-{label}.service"
            self.tb.run("systemd-run", "--quiet", f"--unit={worker}", str(peers_env.PYTHON), str(PEERS), "worker",
                        "--dsn", dsn, "--start", start, "--props", props)
            try:
                # One job first, untimed: the worker is listening, its connections and imports warm.
                self.peer("throughput", "--dsn", client, "--n", "1", "--prefix", f"bench-peer-{label}-warm")
                since = int(time.time()) - 1
                lat = self.peer("latency", "--dsn", client, "--n", str(n_latency), "--prefix", f"bench-peer-{label}-l")
                active = self.active_timestamps(since, prefix=f"bench-peer-{label}-l-")
                to_active = [(active[u] - t) * 1000 for u, t in lat["committed"].items() if u in active]
                self.reset_statements()
                since = int(time.time()) - 1
                tp = self.peer("throughput", "--dsn", client, "--n", str(n), "--prefix", f"bench-peer-{label}-t")
                statements, top = self.daemon_statements(top=8, role=PEER_ROLE)
                active = self.active_timestamps(since, prefix=f"bench-peer-{label}-t-")
                seconds = max((active[u] for u in tp["units"] if u in active), default=math.nan) - tp["committed"]
                state = self.host.unit_props(worker, "ActiveState")["ActiveState"]
            finally:
                self.tb.run("systemctl", "stop", worker, check=False)
                # Untimed: the peers never unload their units, and `product` ones (RemainAfterExit) stay
                # loaded; gone before the next variant, so that no variant starts beside another's.
                self.tb.run("systemctl", "stop", f"bench-peer-{label}-*", check=False, timeout=300)
            if state != "active" or not tp["drained"]:
                log = self.tb.run("journalctl", "--no-pager", "-q", "-n", "30", "-u", worker, check=False).stdout
                raise RuntimeError(f"peer {label}: worker {state}, queue drained: {tp['drained']}\n{log}")
            out[label] = {
                "start": start, "props": props, "latency_to_started_ms": summary(to_active),
                "latency_started_missing": n_latency - len(to_active),
                "seconds": seconds, "runs_per_s": n / seconds,
                "started_missing": sum(u not in active for u in tp["units"]),
                "statements": statements, "statements_per_run": statements / n, "statements_by_query": top,
            }
        return out

    # -- (4) reconcile ----------------------------------------------------------------------------

    def reconcile(self, sizes: list[int]) -> list[dict[str, Any]]:
        """Passes with n open attempts of this host, min(n, reconcile_units) of them backed by a
        loaded, running unit; the daemon is stopped, so that its statements do not mix in."""
        self.host.stop()
        unit_ids = [uuid.uuid4() for _ in range(self.sizes.reconcile_units)]
        started = 0
        out = []
        try:
            for n in sorted(sizes):
                units = min(n, len(unit_ids))
                if units > started:
                    names = [f"unitvisor-run-{u}-1.service" for u in unit_ids[started:units]]
                    self.inside("units", stdin=json.dumps(names))
                    started = units
                ids = unit_ids[:units] + [uuid.uuid4() for _ in range(n - units)]
                self.client.execute("DELETE FROM unitvisor.runs WHERE argv = ARRAY['/bin/sleep', 'infinity']")
                with self.client.transaction():
                    self.client.execute(
                        """INSERT INTO unitvisor.runs (id, argv, state)
                           SELECT id, ARRAY['/bin/sleep', 'infinity'], 'running' FROM unnest(%s::uuid[]) id""",
                        (ids,))
                    # Started and adopted (invocation id set): with its unit there, nothing to do.
                    self.client.execute(
                        """INSERT INTO unitvisor.attempts (run_id, attempt, host_id, unit_name, started_at,
                                                           invocation_id)
                           SELECT id, 1, %s, format('unitvisor-run-%%s-1.service', id), now(), 'bench'
                           FROM unnest(%s::uuid[]) id""", (HOST_ID, ids))
                self.client.execute("ANALYZE unitvisor.runs")
                self.client.execute("ANALYZE unitvisor.attempts")
                self.results["loadavg"][f"reconcile-{n}"] = loadavg()
                say(f"(4) reconcile: {n} open attempts, {units} loaded units ...")
                args = ["reconcile", "--dsn", self.daemon_dsn, "--stats-dsn", self.pg.dsn, "--host-id", HOST_ID,
                        "--mode", "plan"]
                if self.profile and n == max(sizes):
                    args.append("--profile")
                row = {"runs": n, "units": units, "plan": self.inside(*args)}
                if n == units:  # every attempt agrees with its unit: the acting pass has nothing to repair
                    row["pass"] = self.inside(*args[:-1], "pass")
                out.append(row)
        finally:
            self.tb.run("systemctl", "stop", "unitvisor-run-*", check=False, timeout=300)
            self.client.execute("DELETE FROM unitvisor.runs WHERE argv = ARRAY['/bin/sleep', 'infinity']")
        return out


def _which(name: str) -> str | None:
    for directory in [str(VENV_BIN), *os.environ.get("PATH", "").split(os.pathsep)]:
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


# -- machine and versions -----------------------------------------------------------------------


def _cgroup_version() -> str:
    kind = subprocess.run(["stat", "-fc", "%T", "/sys/fs/cgroup"], capture_output=True, text=True).stdout.strip()
    if kind == "cgroup2fs":
        return "v2 (unified)"
    return "v1 (hybrid)" if Path("/sys/fs/cgroup/unified").is_dir() else "v1"


def machine_facts() -> dict[str, Any]:
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    virt = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True).stdout.strip()
    return {
        "nproc": os.cpu_count(), "cpu": cpu, "memory_mb": int(meminfo["MemTotal"].split()[0]) // 1024,
        "kernel": platform.release(), "cgroup": _cgroup_version(), "virtualization": virt or "none",
        "pid1": Path("/proc/1/comm").read_text().strip(),
        "os": dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines()
                   if "=" in line).get("PRETTY_NAME", "").strip('"'),
    }


def versions(tb: testbed_mod.Testbed, conn: psycopg.Connection) -> dict[str, str]:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {
        "unitvisor": __version__, "commit": commit, "python": platform.python_version(),
        "psycopg": psycopg.__version__, "pystemd": importlib.metadata.version("pystemd"),
        "systemd": tb.run("systemctl", "--version").stdout.splitlines()[0],
        "postgresql": conn.execute("SHOW server_version").fetchone()[0],
    }


# -- the report ---------------------------------------------------------------------------------


def targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    limit, tp, lat, idle = r["limit"]["bare"], r["throughput"], r["latency"], r["idle"]
    rec = r["reconcile"]
    scaling = r["scaling"]["reconcile"]
    growth = scaling[-1]["plan"]["statements"] - scaling[0]["plan"]["statements"] if len(scaling) > 1 else 0
    gap = lat["to_active_ms"]["p50"] - limit["call_ms"]["p50"]
    exposure = r["sandbox"]["sandboxed"]["exposure"]
    values = {
        "throughput_ratio": (tp["ratio_to_limit"], tp["ratio_to_limit"] >= 0.8),
        "latency_to_active": (gap, gap <= 15),
        "reconcile_time": (rec["plan"]["seconds"], rec["plan"]["seconds"] < 2),
        "reconcile_queries": (growth, growth == 0),
        "idle_statements": (idle["statements_per_min"], idle["statements_per_min"] <= 6),
        "idle_cpu": (idle["cpu_seconds_per_min"], idle["cpu_seconds_per_min"] < 0.05),
        "idle_memory": (idle["vmhwm_mb"], idle["vmhwm_mb"] < 60),
        "sandbox_exposure": (exposure, exposure <= EXPOSURE_GOAL),
    }
    return {name: {"goal": TARGETS[name], "value": value, "met": met} for name, (value, met) in values.items()}


def table(r: dict[str, Any]) -> str:
    bare, prod = r["limit"]["bare"], r["limit"]["product"]
    tp, lat, idle, rec = r["throughput"], r["latency"], r["idle"], r["reconcile"]
    split, raw_call = lat["breakdown_ms"], lat["raw_start_call_beside_ms"]["p50"]
    t = r["targets"]

    def mark(name: str) -> str:
        return "met" if t[name]["met"] else "MISSED"

    rows: list[tuple[str, str, str, str]] = [("figure", "unitvisor", "baseline (same run)", "vs baseline / target")]
    rows += [
        (f"(1) limit: {bare['n']} raw starts, one connection", f"{bare['starts_per_s']:.0f} starts/s",
         "-", f"all ran in {bare['all_ran_seconds']:.2f} s"),
        ("(1) limit: one raw start call p50 / p99",
         f"{bare['call_ms']['p50']:.2f} / {bare['call_ms']['p99']:.2f} ms", "-", ""),
        ("(1) limit with the daemon's unit properties", f"{prod['starts_per_s']:.0f} starts/s",
         f"{bare['starts_per_s']:.0f} starts/s (bare)", f"{prod['starts_per_s'] / bare['starts_per_s']:.2f}x"),
        ("(1) ... one call p50 / p99", f"{prod['call_ms']['p50']:.2f} / {prod['call_ms']['p99']:.2f} ms",
         f"{bare['call_ms']['p50']:.2f} / {bare['call_ms']['p99']:.2f} ms (bare)", ""),
        ("(1) raw start -> active p50 / p99 (daemon's props)",
         f"{prod['start_to_active_ms']['p50']:.1f} / {prod['start_to_active_ms']['p99']:.1f} ms",
         f"{bare['start_to_active_ms']['p50']:.1f} / {bare['start_to_active_ms']['p99']:.1f} ms (bare)", ""),
        (f"(2) throughput: {tp['n']} runs at once", f"{tp['runs_per_s']:.0f} runs/s ({tp['seconds']:.2f} s)",
         f"{bare['starts_per_s']:.0f} starts/s", f"{tp['ratio_to_limit']:.2f} of limit: {mark('throughput_ratio')}"),
        ("(2) ... against the limit with the daemon's props", f"{tp['runs_per_s']:.0f} runs/s",
         f"{prod['starts_per_s']:.0f} starts/s", f"{tp['ratio_to_limit_product']:.2f} of it"),
        ("(2) ... statements per run, daemon CPU per run", f"{tp['statements_per_run']:.1f}, "
         f"{tp['daemon_cpu_ms_per_run']:.2f} ms", "-", ""),
        (f"(3) latency: commit -> active p50 / p99 ({lat['n']} runs)",
         f"{lat['to_active_ms']['p50']:.1f} / {lat['to_active_ms']['p99']:.1f} ms",
         f"{bare['call_ms']['p50']:.2f} ms (raw call p50)",
         f"+{t['latency_to_active']['value']:.1f} ms: {mark('latency_to_active')}"),
        ("(3) ... against raw start -> active (daemon's props)", f"{lat['to_active_ms']['p50']:.1f} ms",
         f"{lat['raw_start_to_active_beside_ms']['p50']:.1f} ms (after (3))",
         f"{lat['to_active_minus_raw_start_to_active_p50_ms']:+.1f} ms"),
        ("(3) ... wake, claim, to start's return, PID 1 after (p50s)",
         " + ".join(f"{split[k]['p50']:.1f}" for k in ("commit_to_claim", "claim_statement",
                                                     "claim_committed_to_marked_started",
                                                     "marked_started_to_active")) + " ms",
         f"call {raw_call:.1f} + {lat['raw_start_to_active_beside_ms']['p50'] - raw_call:.1f} ms (raw)", ""),
        *schedstat_rows(lat),
        ("(3) latency: commit -> outcome recorded p50 / p99",
         f"{lat['to_recorded_ms']['p50']:.1f} / {lat['to_recorded_ms']['p99']:.1f} ms",
         f"{bare['call_ms']['p50']:.2f} ms (raw call p50)",
         f"+{lat['to_recorded_ms']['p50'] - bare['call_ms']['p50']:.1f} ms"),
        (f"(4) reconcile: {rec['runs']} open runs, {rec['units']} units", f"{rec['plan']['seconds']:.2f} s",
         "target 2 s", mark("reconcile_time")),
        ("(4) ... database statements / D-Bus calls", f"{rec['plan']['statements']} / {rec['plan']['dbus_calls']}",
         f"{r['scaling']['reconcile'][0]['plan']['statements']} at {r['scaling']['reconcile'][0]['runs']} runs",
         mark("reconcile_queries")),
        (f"(5) idle {idle['seconds']:.0f} s: statements",
         f"{idle['statements']} ({idle['statements_per_min']:.0f}/min)", "heartbeat: 6/min", mark("idle_statements")),
        ("(5) idle: CPU", f"{idle['cpu_seconds']:.2f} s", "0", mark("idle_cpu")),
        ("(5) idle: peak resident (VmHWM)", f"{idle['vmhwm_mb']:.1f} MB", "60 MB", mark("idle_memory")),
        ("    peak resident after all the load", f"{r['peak_after_load_mb']:.1f} MB", "60 MB", ""),
    ]
    for row in r["scaling"]["throughput"]:
        rows.append((f"(6) throughput at {row['n']} runs",
                     f"{row['runs_per_s']:.0f} runs/s ({row['seconds']:.2f} s)", f"{bare['starts_per_s']:.0f} starts/s",
                     f"{row['runs_per_s'] / bare['starts_per_s']:.2f} of limit"))
    sb = r["sandbox"]
    on, off, raw_off = sb["sandboxed"], sb["unsandboxed"], r["limit"]["unsandboxed"]
    rows += [
        ("(7) sandbox: systemd-analyze security, a live run", f"{on['exposure']:.1f}", f"{off['exposure']:.1f} (off)",
         f"goal <= {EXPOSURE_GOAL}: {mark('sandbox_exposure')}"),
        (f"(7) sandbox: throughput, {sb['n']} runs at once", f"{on['runs_per_s']:.0f} runs/s",
         f"{off['runs_per_s']:.0f} runs/s (off)", f"{sb['throughput_ratio']:.2f}x"),
        ("(7) ... PID 1 CPU per run", f"{on['pid1_cpu_ms_per_run']:.2f} ms",
         f"{off['pid1_cpu_ms_per_run']:.2f} ms (off)", ""),
        ("(7) ... raw starts with the daemon's props", f"{prod['starts_per_s']:.0f} starts/s",
         f"{raw_off['starts_per_s']:.0f} starts/s (off)", f"{prod['starts_per_s'] / raw_off['starts_per_s']:.2f}x"),
        ("(7) ... raw start -> active p50", f"{prod['start_to_active_ms']['p50']:.1f} ms",
         f"{raw_off['start_to_active_ms']['p50']:.1f} ms (off)", ""),
    ]
    for row in r["scaling"]["reconcile"]:
        plan = row["plan"]
        rows.append((f"(6) reconcile at {row['runs']} runs ({row['units']} units)", f"{plan['seconds']:.3f} s",
                     "", f"{plan['statements']} statements, {plan['dbus_calls']} D-Bus calls"))
    lines = aligned(rows)
    return "\n".join(lines)


def schedstat_rows(lat: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(3)'s CPU and run-queue wait per unit of each process, in the daemon's blocks against the raw
    loop's."""
    ours, raw = lat["schedstat_ms_per_unit"]["daemon's units"], lat["schedstat_ms_per_unit"]["raw loop's"]
    return [(f"(3) ... {proc}: CPU + waiting for one, per unit",
             f"{ours[proc]['cpu']:.2f} + {ours[proc]['waiting']:.2f} ms",
             f"{raw[proc]['cpu']:.2f} + {raw[proc]['waiting']:.2f} ms (raw)", "") for proc in SCHEDSTAT_PROCS]


PROPS_LABEL = {"bare": "bare", "product": "unitvisor's (sandboxed)", "unsandboxed": "unitvisor's, sandbox off"}
PEER_LABEL = {"systemd-run": "pgqueuer + systemd-run per job", "pystemd": "pgqueuer + pystemd StartTransientUnit"}


def comparison(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 14's goals against the peers, all from this run: runs/s from the commit of n runs to
    the last unit's "Started" record on both sides; latency p50 from a commit to its unit's."""
    peers, limit = r["peers"], r["limit"]
    defaults, off = r["throughput"]["started_runs_per_s"], r["sandbox"]["unsandboxed"]["started_runs_per_s"]
    latency = r["latency"]["to_active_ms"]["p50"]

    def best_latency(props: str) -> float:
        return min(peers[f"{start}-{p}"]["latency_to_started_ms"]["p50"] for start, p in PEER_VARIANTS if p == props)

    values = {
        "defaults_vs_raw_loop_same_props": (defaults / limit["product"]["starts_per_s"], ">= 0.8", 0.8),
        "sandbox_off_vs_pgqueuer_pystemd_bare": (off / peers["pystemd-bare"]["runs_per_s"], ">= 1", 1.0),
        "sandbox_off_vs_2x_pgqueuer_systemd_run_bare": (off / (2 * peers["systemd-run-bare"]["runs_per_s"]),
                                                        ">= 1", 1.0),
    }
    out = {name: {"value": v, "goal": goal, "met": v >= floor} for name, (v, goal, floor) in values.items()}
    off_latency = r["sandbox"]["unsandboxed"]["latency_to_active_ms"]["p50"]
    for name, gap in (("latency_p50_minus_best_peer_product_ms", latency - best_latency("product")),
                      ("latency_p50_minus_best_peer_bare_ms", latency - best_latency("bare")),
                      ("sandbox_off_latency_p50_minus_best_peer_bare_ms", off_latency - best_latency("bare"))):
        out[name] = {"value": gap, "goal": "<= 0", "met": gap <= 0}
    spr = r["throughput"]["statements_per_run"]
    out["statements_per_run"] = {"value": spr, "goal": "<= 3", "met": spr <= 3}
    return out


# Issue 27's floor for the daemon's CPU and statements per run: 0.5.0's full `make bench`
# (docs/benchmarks.md, "0.5.0: one full run").
BASELINE_050 = RESULTS / "full-0.5.0" / "run.json"


def issue27_targets(r: dict[str, Any], baseline: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 27's targets, each beside its baseline: the raw loop and the peers from this run, the daemon's
    CPU and statements per run from `baseline` (0.5.0's run)."""
    peers, limit, lat = r["peers"], r["limit"], r["latency"]
    tp, off = r["throughput"], r["sandbox"]["unsandboxed"]
    rows = {
        "sandbox_off_vs_pystemd_peer_bare": (off["started_runs_per_s"], peers["pystemd-bare"]["runs_per_s"], 0.9),
        "sandbox_off_vs_raw_loop_same_units": (off["started_runs_per_s"], limit["unsandboxed"]["starts_per_s"], 0.9),
        "defaults_vs_raw_loop_same_units": (tp["started_runs_per_s"], limit["product"]["starts_per_s"], 0.9),
    }
    out: dict[str, dict[str, Any]] = {
        name: {"value": value, "baseline": base, "ratio": value / base, "goal": f">= {floor} of the baseline",
               "met": value >= floor * base} for name, (value, base, floor) in rows.items()}
    gap = lat["to_active_minus_raw_start_to_active_p50_ms"]
    out["latency_p50_minus_raw_start_to_active_ms"] = {
        "value": lat["to_active_ms"]["p50"], "baseline": lat["raw_start_to_active_beside_ms"]["p50"], "ratio": None,
        "goal": "within 3 ms of the baseline", "met": gap <= 3}
    for name, value, base in (
            ("daemon_cpu_ms_per_run", tp["daemon_cpu_ms_per_run"], baseline["throughput"]["daemon_cpu_ms_per_run"]),
            ("statements_per_run", tp["statements_per_run"], baseline["throughput"]["statements_per_run"]),
            ("sandbox_off_statements_per_run", off["statements_per_run"],
             baseline["sandbox"]["unsandboxed"]["statements_per_run"])):
        out[name] = {"value": value, "baseline": base, "ratio": value / base, "goal": "no worse than 0.5.0's",
                     "met": value <= base}
    return out


def issue27_table(r: dict[str, Any]) -> str:
    """Issue 27's targets as `make bench` prints them: each beside its baseline from the same run."""
    names = {
        "sandbox_off_vs_pystemd_peer_bare": "sandbox off, runs/s | pgqueuer + pystemd (bare units)",
        "sandbox_off_vs_raw_loop_same_units": "sandbox off, runs/s | raw loop, the same units",
        "defaults_vs_raw_loop_same_units": "packaged defaults, runs/s | raw loop, the same units",
        "latency_p50_minus_raw_start_to_active_ms": "commit -> active p50 ms | raw start -> active p50, same units",
        "daemon_cpu_ms_per_run": "daemon CPU ms per run (defaults) | 0.5.0's",
        "statements_per_run": "statements per run (defaults) | 0.5.0's",
        "sandbox_off_statements_per_run": "statements per run (sandbox off) | 0.5.0's",
    }
    rows = [("issue 27: figure | its baseline", "value", "baseline", "goal (ratio)", "")]
    for key, name in names.items():
        t = r["peers"]["issue27"][key]
        ratio = f" ({t['ratio']:.2f})" if t["ratio"] is not None else ""
        rows.append((name, f"{t['value']:.2f}", f"{t['baseline']:.2f}", t["goal"] + ratio,
                     "met" if t["met"] else "MISSED"))
    lines = aligned(rows)
    return "\n".join(lines + [""] + sandbox_off_steps(r))


def sandbox_off_steps(r: dict[str, Any]) -> list[str]:
    """Where sandbox off's gap to the raw loop goes (issue 27): the raw loop, then the daemon's side of
    systemd alone (inside.outcome_loop) with the signals only, with each unit held, read and released, and
    with those reads in a second process, then the daemon; each as runs/s and against the raw loop of the
    same units, from this run."""
    off, raw = r["limit"]["unsandboxed"], r["limit"]["unsandboxed"]["starts_per_s"]
    steps = [
        ("the raw loop: starts, nothing read", raw),
        ("... 64 at a time, each end read from its signals", off["outcome_loop_signals"]["runs_per_s"]),
        ("... each unit held, its accounting read, released", off["outcome_loop_held"]["runs_per_s"]),
        ("... the same, the reads in a second process", off["outcome_loop_split"]["runs_per_s"]),
        ("the daemon: the same and PostgreSQL, its rows and logs", r["sandbox"]["unsandboxed"]["started_runs_per_s"]),
    ]
    rows = [("sandbox off, step by step", "runs/s", "of the raw loop")]
    rows += [(name, f"{value:.1f}", f"{value / raw:.2f}") for name, value in steps]
    return aligned(rows)


def peers_table(r: dict[str, Any]) -> str:
    """(8): unitvisor, the raw loop and the peers side by side, then issue 14's goals."""
    peers, limit, lat, tp = r["peers"], r["limit"], r["latency"], r["throughput"]
    off = r["sandbox"]["unsandboxed"]

    def ms(s: dict[str, float]) -> str:
        return f"{s['p50']:.1f} / {s['p95']:.1f} ms"

    rows = [("(8) peers: who", "units", f"runs/s ({peers['n']} at once)", "commit -> started p50 / p95",
             "statements/run")]
    for props in ("bare", "product", "unsandboxed"):
        raw = limit[props]
        rows.append(("raw StartTransientUnit loop", PROPS_LABEL[props], f"{raw['starts_per_s']:.0f}",
                     f"{ms(raw['start_to_active_ms'])} (call)", "-"))
    rows.append(("unitvisor, packaged defaults", PROPS_LABEL["product"], f"{tp['started_runs_per_s']:.0f}",
                 ms(lat["to_active_ms"]), f"{tp['statements_per_run']:.1f}"))
    rows.append(("unitvisor, sandbox off", PROPS_LABEL["unsandboxed"], f"{off['started_runs_per_s']:.0f}",
                 ms(off["latency_to_active_ms"]), f"{off['statements_per_run']:.1f}"))
    for start, props in PEER_VARIANTS:
        peer = peers[f"{start}-{props}"]
        rows.append((PEER_LABEL[start], PROPS_LABEL[props], f"{peer['runs_per_s']:.0f}",
                     ms(peer["latency_to_started_ms"]), f"{peer['statements_per_run']:.1f}"))
    lines = aligned(rows)
    names = {
        "defaults_vs_raw_loop_same_props": "unitvisor defaults / raw loop with the same properties",
        "sandbox_off_vs_pgqueuer_pystemd_bare": "unitvisor sandbox off / pgqueuer + pystemd (bare)",
        "sandbox_off_vs_2x_pgqueuer_systemd_run_bare": "unitvisor sandbox off / 2 x pgqueuer + systemd-run (bare)",
        "latency_p50_minus_best_peer_product_ms": "latency p50: unitvisor - best peer, same properties (ms)",
        "latency_p50_minus_best_peer_bare_ms": "latency p50: unitvisor - best peer, bare (ms)",
        "sandbox_off_latency_p50_minus_best_peer_bare_ms": "latency p50: unitvisor sandbox off - best peer, bare (ms)",
        "statements_per_run": "unitvisor statements per run",
    }
    lines.append("")
    for key, name in names.items():
        goal = peers["comparison"][key]
        lines.append(f"{name}: {goal['value']:.2f} (goal {goal['goal']}: {'met' if goal['met'] else 'MISSED'})")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------


def _sizes(args: argparse.Namespace) -> Sizes:
    sizes = TINY if args.tiny else Sizes()
    for name in ("limit", "throughput", "latency", "reconcile", "reconcile_units", "idle_seconds", "sandbox_rounds"):
        value = getattr(args, name)
        if value is not None:
            setattr(sizes, name, value)
    if args.scaling:
        sizes.scaling = [int(v) for v in args.scaling.split(",")]
    return sizes


@contextlib.contextmanager
def database() -> Iterator[Postgres]:
    """A throwaway cluster with pg_stat_statements (to count statements) and commit timestamps (to
    time from a submit's commit to an outcome's commit on the database's own clock)."""
    postgres_mod.cleanup_stale()
    pg = Postgres(settings={"shared_preload_libraries": "pg_stat_statements", "track_commit_timestamp": "on",
                            "pg_stat_statements.track_utility": "on"})
    try:
        pg.init()
        pg.start()
        with store.connect(pg.dsn) as conn:
            conn.execute(f"CREATE DATABASE {DB}")
            conn.execute(f"CREATE ROLE {CLIENT_ROLE} SUPERUSER LOGIN")
            conn.execute(f"CREATE ROLE {PEER_ROLE} SUPERUSER LOGIN")
            conn.execute("CREATE EXTENSION pg_stat_statements")
        with store.connect(pg.dsn_for(DB)) as conn:
            store.migrate(conn)
        yield pg
    finally:
        pg.stop()


def run(sizes: Sizes, profile: bool) -> dict[str, Any]:
    reason = testbed_mod.available()
    if reason:
        raise SystemExit(f"cannot run the benchmark here: {reason}")
    testbed_mod.cleanup_stale()
    say(f"the peers' virtualenv: {peers_env.ensure()}")
    started = dt.datetime.now(dt.UTC)
    say("starting a throwaway PostgreSQL and booting a throwaway systemd test bed ...")
    with database() as pg, testbed_mod.Testbed("uv-bench", binds=[REPO]) as tb:
        bench = Bench(pg, tb, sizes, profile)
        try:
            r = bench.results
            r["date"] = started.isoformat(timespec="seconds")
            r["machine"] = machine_facts()
            r["versions"] = versions(tb, bench.admin)
            r["sizes"] = asdict(sizes)
            r["daemon_config"] = "packaged defaults; host id and allowed_executables set (see bench/run.py)"
            bench.limit()  # before the daemon runs: systemd alone
            bench.start_daemon()
            bench.idle()  # a fresh daemon, before any load
            # The raw start -> active beside the daemon's runs, in turns with them: phase (1) ran minutes
            # earlier, before the daemon, at another load, and its figure moved the difference by several
            # ms (docs/benchmarks.md, "0.5.0: one full run").
            r["latency"] = bench.latency(beside=True)
            scaled = [bench.throughput(n) for n in sorted(set(sizes.scaling) | {sizes.throughput})]
            r["peak_after_load_mb"] = bench.memory_kb(bench.main_pid())["VmHWM"] / 1024
            main = next(row for row in scaled if row["n"] == sizes.throughput)
            limit = r["limit"]
            main["submitted"] = "in one transaction (unitvisor.submit_run x n) while the daemon runs"
            main["ratio_to_limit"] = main["runs_per_s"] / limit["bare"]["starts_per_s"]
            main["ratio_to_limit_product"] = main["runs_per_s"] / limit["product"]["starts_per_s"]
            r["throughput"] = main
            reconciled = bench.reconcile(sorted(set(sizes.scaling) | {sizes.reconcile}))
            r["reconcile"] = next(row for row in reconciled if row["runs"] == sizes.reconcile)
            r["sandbox"] = bench.sandbox()
            r["peers"] = bench.peers()
            r["peers"]["comparison"] = comparison(r)
            r["scaling"] = {
                "throughput": [{k: row[k] for k in ("n", "seconds", "runs_per_s", "statements_per_run",
                                                    "daemon_cpu_ms_per_run", "cpu_seconds")} for row in scaled
                               if row["n"] in sizes.scaling],
                "reconcile": [row for row in reconciled if row["runs"] in sizes.scaling],
            }
            lat = r["latency"]
            lat["to_active_minus_raw_call_p50_ms"] = lat["to_active_ms"]["p50"] - limit["bare"]["call_ms"]["p50"]
            lat["to_recorded_minus_raw_call_p50_ms"] = lat["to_recorded_ms"]["p50"] - limit["bare"]["call_ms"]["p50"]
            lat["to_active_minus_raw_start_to_active_p50_ms"] = (
                lat["to_active_ms"]["p50"] - lat["raw_start_to_active_beside_ms"]["p50"])
            r["targets"] = targets(r)
            r["peers"]["issue27"] = issue27_targets(r, json.loads(BASELINE_050.read_text()))
            r["wall_seconds"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
            r["loadavg"]["end"] = loadavg()
            bench.host.stop()
            return r
        finally:
            bench.close()


def interrupt_on_sigterm() -> None:
    """A SIGTERM becomes KeyboardInterrupt, so that the harness's context managers still clean up."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def save(out: Path, results: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True, default=str) + "\n")


def tiny_parser(prog: str, doc: str | None, out: Path) -> argparse.ArgumentParser:
    """The command line of a bench with a `--tiny` smoke size and one JSON file of results."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: every figure in seconds (smoke test)")
    parser.add_argument("--out", type=Path, default=out)
    return parser


def report(out: Path, results: dict[str, Any], text: str) -> None:
    """Results saved to `out`, their table on stdout, and where they went on stderr."""
    save(out, results)
    print(text)
    say(f"results: {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: every figure in seconds (smoke test)")
    parser.add_argument("--out", type=Path, help="the JSON file [default: bench/results/latest.json, "
                        "or latest-tiny.json with --tiny]")
    parser.add_argument("--profile", action="store_true",
                        help="also profile: cProfile of the largest reconcile, py-spy of the daemon under load "
                             "and one run at a time (3)")
    for name, help_text in (("limit", "raw starts"), ("throughput", "runs submitted at once"),
                            ("latency", "runs one at a time"), ("reconcile", "open runs in the reconcile pass"),
                            ("reconcile-units", "loaded units in the reconcile pass")):
        parser.add_argument(f"--{name}", type=int, help=f"how many {help_text}")
    parser.add_argument("--idle-seconds", type=float, help="how long the idle daemon is watched")
    parser.add_argument("--scaling", help="comma-separated sizes for (6) [default: 100,1000,10000]")
    parser.add_argument("--sandbox-rounds", type=int, help="passes of (7) for each of sandboxed and unsandboxed")
    args = parser.parse_args(argv)
    sizes = _sizes(args)
    out = args.out or RESULTS / ("latest-tiny.json" if args.tiny else "latest.json")

    interrupt_on_sigterm()
    results = run(sizes, args.profile)
    save(out, results)
    print(table(results))
    print()
    print(peers_table(results))
    print()
    print(issue27_table(results))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
