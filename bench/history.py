"""`make bench` (history): what a million finished runs in the tables cost the daemon's queries, and what
pruning them costs the claim. Needs only PostgreSQL (no systemd test bed): the daemon's statements are
sent through supervisor.store as the daemon sends them.

(H1) The claim, the probe (the heartbeat), and the reconcile pass's queries (open_attempts, which reads
its runs in the same statement; unit_owners; unclaimed_attempts), per call: time from the client, and from
pg_stat_statements the server's time, shared buffers touched and rows, in two databases of one server,
cycle for cycle in turn: one with no finished run in its tables, one with `runs` finished runs (each
with one attempt, four events and one claimed spawn job, as a run that succeeded leaves them), pruning
off. Each cycle submits `per_claim` runs, probes,
claims them, runs the reconcile queries against `open_runs` runs that stay open, and settles what it
claimed. (H2) The claim's latency while another host's daemon prunes them in batches of 1000: first
for a minute at the daemon's pace (daemon.RETENTION_PAUSE between batches), then back to back, without
a pause, until all are gone (the worst case); against the same cycles without pruning.
What each figure means, and the latest results: docs/benchmarks.md, History.

    .venv/bin/python -m bench.history            # a million runs (6 to 10 minutes here)
    .venv/bin/python -m bench.history --tiny     # every figure on tiny sizes, in seconds (the smoke test)
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from bench.run import DB, RESULTS, aligned, database, interrupt_on_sigterm, loadavg, machine_facts, save, say, summary
from supervisor import __version__, store, unitspec
from supervisor.daemon import RETENTION_PAUSE
from supervisor.outcomes import Outcome
from tests.harness.postgres import Postgres

FULL_DB = "bench_history"  # the database that gets the history (bench.run's DB stays without)
HOST = "history-host"
PRUNER = "history-pruner"  # the other host of the fleet, whose daemon prunes
KEEP = timedelta(days=30)  # the default [retention] keep_finished; every filled run is older
PRUNE_BATCH = 1000  # the default [retention] batch_size
SUCCESS = Outcome("success", "exit:0", "exited 0")
# pg_stat_statements' text of each statement the daemon sends, by what it is (a LIKE pattern).
STATEMENTS = {
    "claim": "%unitvisor.claim_jobs(%",
    "probe": "%unitvisor.heartbeat(%",
    "open_attempts": "%FROM unitvisor.attempts a%WHERE a.host_id = %",
    "unit_owners": "%FROM unitvisor.attempts WHERE unit_name = ANY(%",
    "unclaimed_attempts": "%unnest(%::uuid[]%",
}


@dataclass
class Sizes:
    runs: int = 1_000_000
    cycles: int = 300  # claim cycles measured at each size
    per_claim: int = 4  # runs submitted and claimed per cycle
    open_runs: int = 20  # runs kept open throughout: what the reconcile queries find
    fill_chunk: int = 100_000
    paced_seconds: float = 60.0  # how long the pruner works at the daemon's pace before going flat out


TINY = Sizes(runs=3000, cycles=20, open_runs=5, fill_chunk=1000, paced_seconds=1.0)


class History:
    """One database of the cluster, with the host that claims in it."""

    def __init__(self, pg: Postgres, dbname: str, sizes: Sizes) -> None:
        self.dbname = dbname
        self.dsn = pg.dsn_for(dbname)
        self.sizes = sizes
        self.conn = store.connect(self.dsn)
        self.stats = psycopg.connect(pg.dsn, autocommit=True)  # pg_stat_statements, from another database
        self.fence = store.Fence(HOST, store.register_host(self.conn, _profile()).epoch)

    def close(self) -> None:
        self.conn.close()
        self.stats.close()

    # -- the daemon's cycle -------------------------------------------------------------------------

    def submit(self, n: int) -> None:
        with self.conn.transaction():
            for _ in range(n):
                store.submit_run(self.conn, argv=["/bin/true"])
        # Due long enough ago that the claim is not held to a fair share (there is one host anyway).
        self.conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '1 minute' "
                          "WHERE state = 'available'")

    def open_some(self) -> None:
        """Runs that stay open (claimed and started) for the whole benchmark."""
        self.submit(self.sizes.open_runs)
        for _, attempt in store.claim(self.conn, self.fence, self.sizes.open_runs, unitspec.UNIT_NAME_FORMAT):
            store.mark_started(self.conn, self.fence, attempt, "inv-open")

    def cycle(self) -> dict[str, float]:
        """One cycle: submit, probe, claim, the reconcile queries, settle. Milliseconds of each."""
        took: dict[str, float] = {}
        self.submit(self.sizes.per_claim)
        began = time.perf_counter()
        store.probe(self.conn, self.fence, timedelta(minutes=1))
        took["probe"] = (time.perf_counter() - began) * 1000
        began = time.perf_counter()
        claimed = store.claim(self.conn, self.fence, 32, unitspec.UNIT_NAME_FORMAT)
        took["claim"] = (time.perf_counter() - began) * 1000
        began = time.perf_counter()
        pairs = store.open_attempts(self.conn, HOST)
        names = [attempt.unit_name for _, attempt in pairs]
        store.unit_owners(self.conn, names)
        store.unclaimed_attempts(self.conn, [(run.id, attempt.attempt + 1) for run, attempt in pairs])
        took["reconcile"] = (time.perf_counter() - began) * 1000
        for _, attempt in claimed:
            store.record_outcome(self.conn, self.fence, attempt, SUCCESS, "succeeded")
        return took

    def summary(self, cycles: list[dict[str, float]]) -> dict[str, Any]:
        result: dict[str, Any] = {"finished_runs": self.count_finished(), "loadavg": loadavg()}
        for name in ("claim", "probe", "reconcile"):
            result[f"{name}_ms"] = summary([c[name] for c in cycles])
        result["statements"] = self.statements()
        return result

    def statements(self) -> dict[str, dict[str, float]]:
        """Per call of each of the daemon's statements since the last reset: server time, shared buffers
        touched (hit + read: what a query reads, whether or not it was cached) and rows."""
        out = {}
        for name, pattern in STATEMENTS.items():
            row = self.stats.execute(
                """SELECT sum(s.calls), sum(s.total_exec_time), sum(s.shared_blks_hit + s.shared_blks_read),
                          sum(s.rows)
                   FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
                   WHERE d.datname = %s AND s.query LIKE %s""", (self.dbname, pattern)).fetchone()
            calls = int(row[0] or 0)
            out[name] = {"calls": calls, "exec_ms": float(row[1] or 0) / max(calls, 1),
                         "buffers": float(row[2] or 0) / max(calls, 1), "rows": float(row[3] or 0) / max(calls, 1)}
        return out

    def count_finished(self) -> int:
        return self.conn.execute("SELECT count(*) FROM unitvisor.runs WHERE finished_at IS NOT NULL").fetchone()[0]

    # -- a million finished runs --------------------------------------------------------------------

    def fill(self) -> dict[str, Any]:
        """`runs` finished runs, finished between 31 and 90 days ago, set-based, chunk by chunk; then
        VACUUM ANALYZE, as autovacuum would have done to tables that grew this much."""
        say(f"filling {self.sizes.runs} finished runs ...")
        began = time.perf_counter()
        done = 0
        while done < self.sizes.runs:
            n = min(self.sizes.fill_chunk, self.sizes.runs - done)
            with store.connect(self.dsn) as conn, conn.transaction():
                conn.execute("SET LOCAL statement_timeout = 0")
                conn.execute(FILL, {"n": n, "host": HOST})
            done += n
            say(f"  {done} runs ({time.perf_counter() - began:.0f} s)")
        filled = time.perf_counter() - began
        self.vacuum_analyze()
        sizes = self.conn.execute(
            """SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c
               WHERE c.relnamespace = 'unitvisor'::regnamespace AND c.relkind = 'r'""").fetchall()
        return {"seconds": filled, "vacuum_analyze_seconds": time.perf_counter() - began - filled,
                "table_mb": {name: round(size / 2**20, 1) for name, size in sizes if size > 2**16}}

    def vacuum_analyze(self) -> None:
        """What autovacuum does to a table that changed this much: before each H1 measurement, so that
        both sizes are planned from statistics of their own."""
        with store.connect(self.dsn) as conn:
            conn.execute("SET statement_timeout = 0")
            for table in ("runs", "attempts", "run_events", "spawn_jobs", "hosts"):
                conn.execute(f"VACUUM ANALYZE unitvisor.{table}")

    # -- pruning them while claiming ----------------------------------------------------------------

    def prune_while_claiming(self, pause: float, seconds: float | None) -> dict[str, Any]:
        """Claim cycles while another host's daemon prunes (a second host of the fleet, as a pruner is:
        the daemon that claims here never prunes on another connection) in batches of PRUNE_BATCH with
        `pause` seconds between them, until nothing is left or for `seconds`."""
        until = "until done" if seconds is None else f"for {seconds:g} s"
        say(f"(H2) pruning with {pause:g} s between batches, {until}, while claiming ...")
        batches: list[float] = []
        pruned = store.Pruned(0, 0, 0, 0)
        done = threading.Event()

        def pruner() -> None:
            nonlocal pruned
            try:
                with store.connect(self.dsn) as conn:
                    fence = store.Fence(PRUNER, store.register_host(conn, _profile(PRUNER)).epoch)
                    began = time.perf_counter()
                    while seconds is None or time.perf_counter() - began < seconds:
                        sent = time.perf_counter()
                        batch = store.prune_batch(conn, KEEP, PRUNE_BATCH, fence)
                        batches.append((time.perf_counter() - sent) * 1000)
                        pruned += batch
                        if not batch.full(PRUNE_BATCH):
                            return
                        time.sleep(pause)
            finally:
                done.set()

        began = time.perf_counter()
        thread = threading.Thread(target=pruner, name="pruner")
        thread.start()
        cycles = []
        while not done.is_set():
            cycles.append(self.cycle())
        thread.join()
        took = time.perf_counter() - began
        return {"pause": pause, "seconds": took, "runs_per_s": pruned.runs / took if took else 0.0,
                "pruned": asdict(pruned), "batches": len(batches), "batch_ms": summary(batches),
                "cycles": len(cycles), "claim_ms": summary([c["claim"] for c in cycles]),
                "probe_ms": summary([c["probe"] for c in cycles]), "loadavg": loadavg()}


# Four events a run (queued, starting, running, succeeded), as a run that succeeded at once leaves them.
FILL = """
WITH made AS (
    INSERT INTO unitvisor.runs (argv, state, created_at, updated_at, finished_at)
    SELECT ARRAY['/bin/true'], 'succeeded', f - interval '2 seconds', f, f
    FROM (SELECT now() - interval '31 days' - random() * interval '59 days' AS f
          FROM generate_series(1, %(n)s)) g
    RETURNING id, finished_at
), attempts AS (
    INSERT INTO unitvisor.attempts (run_id, attempt, host_id, unit_name, invocation_id, claimed_at, started_at,
                                    ended_at, outcome, exit_status, reason)
    SELECT id, 1, %(host)s, 'unitvisor-run-' || id || '-1.service', md5(id::text), finished_at - interval '1 second',
           finished_at - interval '900 ms', finished_at, 'success', 'exit:0', 'exited 0'
    FROM made
), events AS (
    INSERT INTO unitvisor.run_events (run_id, at, attempt, host_id, state, reason)
    SELECT id, finished_at - e.back, e.attempt, e.host, e.state, e.reason
    FROM made, (VALUES (interval '2 seconds', NULL::integer, NULL::text, 'queued', 'submitted'),
                       (interval '1 second', 1, %(host)s, 'starting', 'claimed by host ' || %(host)s),
                       (interval '900 ms', 1, %(host)s, 'running', 'unit started'),
                       (interval '0', 1, %(host)s, 'succeeded', 'attempt 1: success (exited 0)'))
               AS e(back, attempt, host, state, reason)
)
INSERT INTO unitvisor.spawn_jobs (run_id, state, scheduled_at, claimed_by, claimed_at, created_at)
SELECT id, 'claimed', finished_at - interval '2 seconds', %(host)s, finished_at - interval '1 second',
       finished_at - interval '2 seconds'
FROM made
"""


def _profile(host: str = HOST) -> store.HostProfile:
    return store.HostProfile(
        host_id=host, name=host, instance=f"{host}-bench", max_runs=100_000, memory_budget=None,
        version=__version__, boot_id="history-bench", allowed_executables=("/bin/true",),
        executable_patterns=("^/bin/true$",), run_user="", allowed_users=(), environment_denied=(),
        environment_names=(), environment_patterns=(), can_start=True, cannot_start_reason=None,
        poll_interval=10.0, dead_after=3600.0)


def measure_side_by_side(empty: History, full: History) -> tuple[dict[str, Any], dict[str, Any]]:
    """H1: the cycles in the two databases taking turns, on one server, so that a load that comes and
    goes on this shared machine falls on both alike."""
    say(f"(H1) {empty.sizes.cycles} cycles in each database, taking turns ...")
    empty.stats.execute("SELECT pg_stat_statements_reset()")
    cycles: dict[str, list[dict[str, float]]] = {"empty": [], "full": []}
    for _ in range(empty.sizes.cycles):
        cycles["empty"].append(empty.cycle())
        cycles["full"].append(full.cycle())
    return empty.summary(cycles["empty"]), full.summary(cycles["full"])


def run(sizes: Sizes) -> dict[str, Any]:
    started = dt.datetime.now(dt.UTC)
    say("starting a throwaway PostgreSQL ...")
    with database() as pg:
        # A second database on the same server, the same schema: the one that gets the history.
        with store.connect(pg.dsn) as conn:
            conn.execute(f"CREATE DATABASE {FULL_DB}")
        with store.connect(pg.dsn_for(FULL_DB)) as conn:
            store.migrate(conn)
        empty, history = History(pg, DB, sizes), History(pg, FULL_DB, sizes)
        try:
            r: dict[str, Any] = {"date": started.isoformat(timespec="seconds"), "machine": machine_facts(),
                                 "sizes": asdict(sizes), "loadavg": {"start": loadavg()}}
            r["versions"] = {"unitvisor": __version__, "python": platform.python_version(),
                             "psycopg": psycopg.__version__,
                             "postgresql": history.conn.execute("SHOW server_version").fetchone()[0]}
            for side in (empty, history):
                side.open_some()
                side.vacuum_analyze()
            r["fill"] = history.fill()
            empty.vacuum_analyze()  # as the other was, after its fill
            r["empty"], r["full"] = measure_side_by_side(empty, history)
            r["prune_paced"] = history.prune_while_claiming(RETENTION_PAUSE, sizes.paced_seconds)
            r["prune"] = history.prune_while_claiming(0.0, None)
            r["after_prune"] = {"finished_runs": history.count_finished()}
            r["wall_seconds"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
            return r
        finally:
            empty.close()
            history.close()


def table(r: dict[str, Any]) -> str:
    empty, full, prune = r["empty"], r["full"], r["prune"]
    n = full["finished_runs"]
    rows = [("figure", f"{empty['finished_runs']} finished runs", f"{n} finished runs", "ratio")]
    for name in ("claim", "probe", "reconcile"):
        a, b = empty[f"{name}_ms"], full[f"{name}_ms"]
        rows.append((f"(H1) {name} p50 / p99, ms (client)", f"{a['p50']:.2f} / {a['p99']:.2f}",
                     f"{b['p50']:.2f} / {b['p99']:.2f}", f"{b['p50'] / a['p50']:.2f}x"))
    for name in STATEMENTS:
        a, b = empty["statements"][name], full["statements"][name]
        rows.append((f"(H1) {name}: server ms, buffers, rows per call",
                     f"{a['exec_ms']:.3f}, {a['buffers']:.1f}, {a['rows']:.1f}",
                     f"{b['exec_ms']:.3f}, {b['buffers']:.1f}, {b['rows']:.1f}",
                     f"{b['buffers'] / a['buffers']:.2f}x buffers" if a["buffers"] else "-"))
    for label, p in (("at the daemon's pace", r["prune_paced"]), ("back to back", prune)):
        rows.append((f"(H2) claim p50 / p99, ms, pruning {label}", f"{full['claim_ms']['p50']:.2f} / "
                     f"{full['claim_ms']['p99']:.2f} (not pruning)",
                     f"{p['claim_ms']['p50']:.2f} / {p['claim_ms']['p99']:.2f} (max {p['claim_ms']['max']:.1f})",
                     f"{p['claim_ms']['p99'] / full['claim_ms']['p99']:.2f}x p99"))
        rows.append((f"(H2) pruned {label}", f"{p['pruned']['runs']} runs in {p['seconds']:.1f} s",
                     f"{p['runs_per_s']:.0f} runs/s, batch p50 / p99 {p['batch_ms']['p50']:.0f} / "
                     f"{p['batch_ms']['p99']:.0f} ms", f"{p['cycles']} claim cycles meanwhile"))
    lines = aligned(rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: every figure in seconds (smoke test)")
    parser.add_argument("--runs", type=int, help="finished runs to fill [default: 1000000]")
    parser.add_argument("--cycles", type=int, help="claim cycles measured at each size [default: 300]")
    parser.add_argument("--out", type=Path, help="the JSON file [default: bench/results/history.json, "
                        "or history-tiny.json with --tiny]")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else Sizes()
    if args.runs is not None:
        sizes.runs = args.runs
    if args.cycles is not None:
        sizes.cycles = args.cycles
    out = args.out or RESULTS / ("history-tiny.json" if args.tiny else "history.json")
    interrupt_on_sigterm()
    results = run(sizes)
    save(out, results)
    print(table(results))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
