"""`python -m bench.notify_fanout`: what one NOTIFY costs as the number of listening sessions grows.

A submit's COMMIT notifies the hosts it names (docs/fleet.md, Who is woken). PostgreSQL (15 and 17, as
Debian has them) signals every session of the database that LISTENs on any channel at each notifying
commit; each reads the queue, and sends the message to its client only if it listens on that channel.
bench.scale sees the result in a fleet of real daemons, where the simulated daemons' own Python takes its
share of the same 2 cores. This measures PostgreSQL's part alone: `others` idle sessions besides one
target session, each listening, and `notifies` notifications on the target's channel, one at a time, from
a third session: the time from sending each (its autocommit statement: the commit is when it is
delivered) to the target's client holding it, and the server's CPU per notification (every server process's,
the idle sessions' included, as bench.scale reads it).

Two layouts, in turns for each number of other sessions: `own` (each session on a channel of its own, as
since sql/migrations/048_named_hosts_told_alone.sql a submit naming a few hosts is sent) and `shared` (every
session on the target's channel, as every daemon listened on unitvisor_spawn before 048: every backend
then also sends the message to its client, which nobody reads here). Results: docs/benchmarks.md, "0.11.0
with 048".

    .venv/bin/python -m bench.notify_fanout           # 0, 100, 300 and 1,000 other sessions (a few minutes)
    .venv/bin/python -m bench.notify_fanout --tiny    # seconds (the smoke test)
"""

from __future__ import annotations

import datetime as dt
import select
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg

from bench.run import RESULTS, loadavg, report, say, summary, tiny_parser
from bench.scale import server_cpu_by_kind
from tests.harness.postgres import Postgres

LAYOUTS = ("own", "shared")
TARGET = "bench_target"


@dataclass
class Sizes:
    others: list[int] = field(default_factory=lambda: [0, 100, 300, 1000])
    notifies: int = 200
    rounds: int = 2
    gap: float = 0.02  # seconds between two notifications: every backend has read the last one


TINY = Sizes(others=[0, 5], notifies=5, rounds=1, gap=0.01)


def server_cpu(pg: Postgres) -> float:
    """Seconds of CPU of the whole server so far, every kind of process (bench.scale's reading)."""
    return sum(server_cpu_by_kind(pg).values())


def wait_for_note(conn: psycopg.Connection, timeout: float = 10.0) -> float:
    """When the target's client held the next notification (time.perf_counter)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn.pgconn.consume_input()
        if conn.pgconn.notifies() is not None:
            return time.perf_counter()
        select.select([conn.fileno()], [], [], max(0.0, deadline - time.monotonic()))
    raise TimeoutError("the notification did not come")


def measure(pg: Postgres, others: list[psycopg.Connection], layout: str, sizes: Sizes) -> dict[str, Any]:
    """`sizes.notifies` notifications to the target with `others` listening as `layout` says."""
    for i, conn in enumerate(others):
        conn.execute("UNLISTEN *")
        conn.execute(f"LISTEN {TARGET if layout == 'shared' else f'bench_other_{i}'}")
    with psycopg.connect(pg.dsn, autocommit=True) as target, psycopg.connect(pg.dsn, autocommit=True) as sender:
        target.execute(f"LISTEN {TARGET}")
        for conn in others:  # what the layout change sent is read, and every session caught up
            conn.execute("SELECT 1")
        cpu0, latencies = server_cpu(pg), []
        for _ in range(sizes.notifies):
            sent = time.perf_counter()
            sender.execute(f"NOTIFY {TARGET}")
            latencies.append((wait_for_note(target) - sent) * 1000)
            time.sleep(sizes.gap)
        cpu = server_cpu(pg) - cpu0
    return {"latency_ms": summary(latencies), "server_cpu_us_per_notify": cpu * 1e6 / sizes.notifies}


def run(sizes: Sizes) -> dict[str, Any]:
    results: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                               "sizes": asdict(sizes), "loadavg": {"start": loadavg()}, "figures": {}}
    pg = Postgres(settings={"max_connections": str(max(sizes.others) + 20)})
    try:
        pg.init()
        pg.start()
        with psycopg.connect(pg.dsn) as conn:
            results["postgres"] = conn.execute("SHOW server_version").fetchone()[0]
        others: list[psycopg.Connection] = []
        try:
            for n in sorted(sizes.others):
                say(f"{n} other listening sessions: {sizes.rounds} rounds of {sizes.notifies} notifications "
                    f"per layout ...")
                others += [psycopg.connect(pg.dsn, autocommit=True) for _ in range(n - len(others))]
                rounds: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
                for _ in range(sizes.rounds):
                    for layout in LAYOUTS:
                        rounds[layout].append(measure(pg, others, layout, sizes))
                results["figures"][str(n)] = {
                    layout: {"latency_ms_p50": [r["latency_ms"]["p50"] for r in got],
                             "latency_ms_p99": [r["latency_ms"]["p99"] for r in got],
                             "server_cpu_us_per_notify": [r["server_cpu_us_per_notify"] for r in got]}
                    for layout, got in rounds.items()}
        finally:
            for conn in others:
                conn.close()
    finally:
        pg.stop()
    results["loadavg"]["end"] = loadavg()
    return results


def table(results: dict[str, Any]) -> str:
    def each(values: list[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values)

    lines = [f"{'others':>6}  {'layout':<6}  {'commit -> target p50 (ms)':>26}  {'p99 (ms)':>16}  "
             f"{'server CPU us a notify':>24}"]
    for n, by_layout in results["figures"].items():
        for layout, f in by_layout.items():
            lines.append(f"{n:>6}  {layout:<6}  {each(f['latency_ms_p50']):>26}  {each(f['latency_ms_p99']):>16}  "
                         f"{' / '.join(f'{v:.0f}' for v in f['server_cpu_us_per_notify']):>24}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = tiny_parser("python -m bench.notify_fanout", __doc__, RESULTS / "notify_fanout.json").parse_args(argv)
    results = run(TINY if args.tiny else Sizes())
    report(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
