"""`python -m bench.claim_slots`: what a backlog's claims cost the server, by how many hosts claim at once.

A burst wakes every host of a fleet, and each one's claim walks the same head of the queue (issue 23's
burst of 10,000 runs at 300 hosts). This measures the claims alone, no starts and no outcomes, on one
throwaway PostgreSQL: `runs` runs submitted at once, then `hosts` sessions, each a registered host, claim
`claim_batch` at a time, all together, until the queue is empty; an empty claim is tried again 50 ms later
(the fair share holds a host back for a second while other hosts may take theirs). Each case's figures:
the server's CPU (its sessions', from /proc) per run claimed, the seconds to the last claim, and the claim
statements, those that got none, and those that failed (a lock or statement timeout: counted, and tried
again 50 ms later, as a daemon tries again). A case is hosts x `unitvisor.claim_slots` (0: no bound,
as before sql/migrations/046_claims_take_a_slot.sql). Every host may take every run (max_runs as large as
the backlog), so that nothing but the claims' own work decides. Results: docs/benchmarks.md, "0.11.0 with
046: claims take a slot".

    .venv/bin/python -m bench.claim_slots           # six cases of 10,000 runs (about 3 minutes)
    .venv/bin/python -m bench.claim_slots --tiny    # seconds (the smoke test)
"""

from __future__ import annotations

import datetime as dt
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import psycopg

from bench.claim_latency import BATCH, FMT, fence_of, fleet_database
from bench.run import RESULTS, loadavg, report, say, tiny_parser
from bench.scale import cpu_since, server_cpu_by_kind
from supervisor import store
from tests.harness.postgres import Postgres

EMPTY_PAUSE = 0.05  # s before a host whose claim came back empty tries again


@dataclass
class Sizes:
    runs: int = 10000
    # (hosts claiming at once, claim_slots)
    cases: tuple[tuple[int, int], ...] = ((1, 0), (16, 0), (300, 0), (300, 2), (300, 4), (300, 8))


TINY = Sizes(runs=200, cases=((1, 0), (8, 0), (8, 2)))


class Claimers:
    """`hosts` sessions claiming from one database until told to stop, and their counts; `admin`, the
    database's own session (closed with them), watches the queue."""

    def __init__(self, pg: Postgres, dbname: str, admin: store.Connection, hosts: int, slots: int) -> None:
        self.admin = admin
        self.sessions = []
        for i in range(hosts):
            conn = store.connect(pg.dsn_for(dbname))
            conn.execute("SELECT set_config('unitvisor.claim_slots', %s, false)", (str(slots),))
            self.sessions.append((conn, fence_of(self.admin, f"h{i}")))
        self.lock = threading.Lock()
        self.start, self.stop = threading.Event(), threading.Event()
        self.claims = self.empty = self.taken = self.failed = 0
        self.first_failure: str | None = None

    def claimer(self, conn: store.Connection, fence: store.Fence) -> None:
        self.start.wait()
        while not self.stop.is_set():
            try:
                got = len(store.claim(conn, fence, BATCH, FMT))
            except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:  # counted, tried again
                with self.lock:
                    self.failed += 1
                    self.first_failure = self.first_failure or store.one_line(exc)
                time.sleep(EMPTY_PAUSE)
                continue
            with self.lock:
                self.claims += 1
                self.empty += got == 0
                self.taken += got
            if not got:
                time.sleep(EMPTY_PAUSE)

    def available(self) -> int:
        return self.admin.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE state = 'available'").fetchone()[0]

    def close(self) -> None:
        for conn, _ in self.sessions:
            conn.close()
        self.admin.close()


def case(pg: Postgres, n: int, runs: int, hosts: int, slots: int) -> dict[str, Any]:
    dbname = f"slots_{n}"
    admin = fleet_database(pg, dbname, None, hosts, 0)
    admin.execute("UPDATE unitvisor.hosts SET max_runs = %s", (runs,))
    admin.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true']) FROM generate_series(1, %s)", (runs,))
    admin.execute("VACUUM ANALYZE")
    claimers = Claimers(pg, dbname, admin, hosts, slots)
    threads = [threading.Thread(target=claimers.claimer, args=session) for session in claimers.sessions]
    try:
        for thread in threads:
            thread.start()
        before, began = server_cpu_by_kind(pg), time.monotonic()
        claimers.start.set()
        while claimers.available() and any(thread.is_alive() for thread in threads):
            time.sleep(0.05)
        seconds = time.monotonic() - began
        claimers.stop.set()
        for thread in threads:
            thread.join()
        sessions = cpu_since(before, server_cpu_by_kind(pg)).get("sessions", 0.0)
    finally:
        claimers.stop.set()
        claimers.start.set()
        claimers.close()
    assert claimers.taken == runs, (claimers.taken, runs)  # every run claimed once, none twice
    return {"hosts": hosts, "claim_slots": slots, "runs": runs, "seconds_to_last_claim": seconds,
            "server_cpu_seconds": sessions, "server_cpu_ms_per_run": sessions * 1000 / runs,
            "claims": claimers.claims, "empty_claims": claimers.empty, "failed_claims": claimers.failed,
            "first_failure": claimers.first_failure, "loadavg": loadavg()}


def run(sizes: Sizes) -> dict[str, Any]:
    results: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                               "sizes": asdict(sizes), "loadavg": {"start": loadavg()}, "cases": []}
    most = max(hosts for hosts, _ in sizes.cases)
    pg = Postgres(settings={"max_connections": str(most + 20)})
    try:
        pg.init()
        pg.start()
        for n, (hosts, slots) in enumerate(sizes.cases):
            say(f"{sizes.runs} runs, {hosts} hosts claiming at once, claim_slots {slots} ...")
            results["cases"].append(case(pg, n, sizes.runs, hosts, slots))
    finally:
        pg.stop()
    results["loadavg"]["end"] = loadavg()
    return results


def table(results: dict[str, Any]) -> str:
    lines = [f"{'hosts':>5} {'claim_slots':>11} {'server CPU a run':>16} {'to the last claim':>17} "
             f"{'claims (empty)':>15} {'failed':>6}"]
    for c in results["cases"]:
        lines.append(f"{c['hosts']:>5} {c['claim_slots'] or 'none':>11} {c['server_cpu_ms_per_run']:>13.2f} ms "
                     f"{c['seconds_to_last_claim']:>15.1f} s {c['claims']:>7} ({c['empty_claims']}) "
                     f"{c['failed_claims']:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = tiny_parser("python -m bench.claim_slots", __doc__, RESULTS / "claim_slots.json").parse_args(argv)
    results = run(TINY if args.tiny else Sizes())
    report(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
