"""`python -m bench.heartbeat_cost`: the server's time in one heartbeat, by schema, idle and with a backlog.

The heartbeat is six statements a minute on every host: most of an idle fleet's cost (bench.scale's (S1)),
and with runs queued that nobody may start, what (S4) adds to it. bench.scale measures that on a whole
simulated fleet, where the machine's load moves each figure by more than a migration does. This times one
heartbeat alone, on one throwaway PostgreSQL with `track_functions = pl`: the server's own time in
`unitvisor.heartbeat` (pg_stat_user_functions, the client's round trip left out) and, within it, in
`require_host`, the check every host call starts with. One heartbeat a transaction, as a daemon sends
them (a session keeps its plans across transactions, not what a transaction sets up).

Per schema (the one before sql/migrations/045_host_check_planned_once.sql, and the current one), per
phase, per round: `calls` heartbeats of host h0 of 30 registered hosts, one after the other. Phases:
idle (no job queued), then refused (1,000 runs of an executable no host accepts: the heartbeat's work mark
holds, 041). Schemas alternate round by round, so that the machine's load falls on both alike. Results:
docs/benchmarks.md, "The heartbeat alone".

    .venv/bin/python -m bench.heartbeat_cost           # 20 rounds of 500 (under a minute)
    .venv/bin/python -m bench.heartbeat_cost --tiny    # seconds (the smoke test)
"""

from __future__ import annotations

import datetime as dt
import sys
from dataclasses import asdict, dataclass
from typing import Any

from bench.claim_latency import fence_of, fleet_database
from bench.run import RESULTS, loadavg, report, say, summary, tiny_parser
from supervisor import store
from tests.harness.postgres import Postgres

BASELINE = 44  # before 045 (acts_as in PL/pgSQL)
HOSTS = 30
PHASES = ("idle", "refused")
REFUSED = 1000
FUNCTIONS = ("heartbeat", "require_host")


@dataclass
class Sizes:
    rounds: int = 20
    calls: int = 500


TINY = Sizes(rounds=2, calls=20)


def function_ms(conn: store.Connection) -> dict[str, tuple[int, float]]:
    """Calls and total ms so far of each of FUNCTIONS in this database (what the server has flushed)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = conn.execute("SELECT funcname, calls, total_time FROM pg_stat_user_functions WHERE funcname = ANY(%s)",
                        (list(FUNCTIONS),)).fetchall()
    return {name: (calls, total) for name, calls, total in rows}


def heartbeats(conn: store.Connection, fence: store.Fence, calls: int) -> dict[str, float]:
    """us of server time per heartbeat, in all and in require_host, over `calls` heartbeats."""
    before = function_ms(conn)
    for _ in range(calls):
        conn.execute("SELECT * FROM unitvisor.heartbeat(%s, %s, '20s')", (fence.host_id, fence.epoch)).fetchall()
    after = function_ms(conn)
    per: dict[str, float] = {}
    for name in FUNCTIONS:
        count = after[name][0] - before.get(name, (0, 0.0))[0]
        assert count == calls, (name, count, calls)  # every heartbeat counted, and nothing else
        per[name] = (after[name][1] - before.get(name, (0, 0.0))[1]) * 1000 / calls
    return per


def run(sizes: Sizes) -> dict[str, Any]:
    results: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                               "sizes": asdict(sizes), "loadavg": {"start": loadavg()}}
    pg = Postgres(settings={"track_functions": "pl"})
    schemas: dict[str, int | None] = {f"to {BASELINE:03d}": BASELINE, "current": None}
    try:
        pg.init()
        pg.start()
        conns = {label: fleet_database(pg, f"heartbeat_{i}", upto, HOSTS, 0)
                 for i, (label, upto) in enumerate(schemas.items())}
        results["postgres"] = conns["current"].execute("SHOW server_version").fetchone()[0]
        figures: dict[str, dict[str, dict[str, list[float]]]] = {
            label: {phase: {name: [] for name in FUNCTIONS} for phase in PHASES} for label in schemas}
        for phase in PHASES:
            say(f"{phase}: {sizes.rounds} rounds of {sizes.calls} heartbeats per schema ...")
            for conn in conns.values():
                if phase == "refused":
                    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/refused']) FROM generate_series(1, %s)",
                                 (REFUSED,))
                    conn.execute("VACUUM ANALYZE")
            for _ in range(sizes.rounds):
                for label, conn in conns.items():
                    for name, us in heartbeats(conn, fence_of(conn, "h0"), sizes.calls).items():
                        figures[label][phase][name].append(us)
        for conn in conns.values():
            conn.close()
    finally:
        pg.stop()
    results["loadavg"]["end"] = loadavg()
    results["figures"] = {label: {phase: {name: summary(values) for name, values in by_name.items()}
                                  for phase, by_name in by_phase.items()} for label, by_phase in figures.items()}
    return results


def table(results: dict[str, Any]) -> str:
    lines = [f"{'schema':<8} {'phase':<8} {'heartbeat p50 (us)':>20} {'require_host p50 (us)':>22}"]
    for label, by_phase in results["figures"].items():
        for phase, f in by_phase.items():
            lines.append(f"{label:<8} {phase:<8} {f['heartbeat']['p50']:>20.1f} {f['require_host']['p50']:>22.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = tiny_parser("python -m bench.heartbeat_cost", __doc__, RESULTS / "heartbeat_cost.json").parse_args(argv)
    results = run(TINY if args.tiny else Sizes())
    report(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
