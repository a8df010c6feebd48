"""`make bench-fleet`: the fleet's two figures, on three test bed hosts on one PostgreSQL.

Boots a throwaway PostgreSQL (bench.run's) and, for every drill, a fresh fleet of three systemd test
beds (tests/harness/fleet.py), each running the real unitvisor.service, on a fresh database. Measures:

  (F1) power-off to respawn: K runs of `sleep 600` run on fleet-1; fleet-1 loses power; the time
       until the last of them has its second attempt running on another host, by the database's
       clock, against `[fleet] host_dead_after`;
  (F2) spread: 60 runs of `sleep 30` submitted in one transaction to three equal idle hosts; how
       many each host runs once all are running, against the fair share (20 each).

What each figure means, and the latest results, are in docs/benchmarks.md ("Fleet"). Everything it
starts is gone when it ends, also on failure or Ctrl-C (the harness's context managers).

    .venv/bin/python -m bench.fleet              # 5 drills of each (a few minutes), JSON to bench/results/
    .venv/bin/python -m bench.fleet --tiny       # one small drill of each, in seconds (the smoke test)
    .venv/bin/python -m bench.fleet --drills 10 --dead-after 20
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench.run import (
    DB,
    RESULTS,
    aligned,
    database,
    interrupt_on_sigterm,
    loadavg,
    machine_facts,
    pct,
    save,
    say,
    versions,
)
from supervisor import store
from tests.harness import testbed as testbed_mod
from tests.harness.fleet import Fleet, fleet_config, submit_many
from tests.harness.host import wait_for
from tests.harness.postgres import Postgres

PREFIX = "uv-bfleet"  # the test beds' names, uv-bfleet-1..3: apart from the tests' uv-fleet-N
HOST_IDS = ("fleet-1", "fleet-2", "fleet-3")
TERMINAL = ("succeeded", "failed", "cancelled")
@dataclass
class Sizes:
    drills: int = 5
    poll: int = 1  # [daemon] poll_interval, seconds: also the heartbeat period
    dead_after: int = 10  # [fleet] host_dead_after, seconds
    runs: int = 6  # (F1) runs on the host that loses power
    spread_runs: int = 60  # (F2) runs submitted at once


TINY = Sizes(drills=1, dead_after=3, runs=2, spread_runs=6)
# A claim this long after the commit that made its jobs due (a submit, a declaration of death) was not
# made on the NOTIFY's wake-up, which takes tens of milliseconds here, but at a later poll or re-claim.
LATE = 0.5

TARGETS = {
    # From docs/fleet.md: a host is declared dead once its heartbeat is older than host_dead_after, by a
    # daemon that looks once a poll interval; the heartbeat itself comes once a poll interval. So from
    # the power-off: between host_dead_after - poll and host_dead_after + poll; then claim and start.
    "declared_dead": "power-off -> declared dead within host_dead_after +- one poll interval, "
                     "after at least host_dead_after of silence",
    "spread": "each host runs its fair share of the burst: n/3 +- 20% (20 +- 4 of 60)",
}


# -- one drill's fleet ----------------------------------------------------------------------------


class Drill:
    """A fresh database and a freshly booted fleet of three, the daemons started on all of them."""

    def __init__(self, pg: Postgres, sizes: Sizes, number: int, kind: str, facts: dict[str, Any]) -> None:
        self.pg = pg
        self.facts = facts  # filled by the first drill: the versions of what runs
        self.sizes = sizes
        self.dbname = f"fleet_{kind}_{number}"
        self.fleet: Fleet | None = None
        self.conn: psycopg.Connection | None = None

    @contextlib.contextmanager
    def up(self) -> Iterator[Drill]:
        with psycopg.connect(self.pg.dsn, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {self.dbname} TEMPLATE {DB}")  # migrated: a copy of bench.run's
        dsn = self.pg.dsn_for(self.dbname)
        # The drills' settings (tests/system/test_fleet.py), with the benchmark's own poll interval and
        # host_dead_after, and only what the drills run allowed.
        configs = {host_id: fleet_config(host_id, poll=self.sizes.poll, dead_after=self.sizes.dead_after,
                                         allowed='["/bin/sleep"]') for host_id in HOST_IDS}
        with Fleet(dsn, size=3, prefix=PREFIX, configs=configs) as fleet, \
                psycopg.connect(dsn, autocommit=True) as conn:
            self.fleet, self.conn = fleet, conn
            with ThreadPoolExecutor(max_workers=3) as pool:  # each waits for its daemon's READY=1
                list(pool.map(lambda host: host.start(configure=False), fleet.hosts))
            wait_for(lambda: self.sql("SELECT count(*) FROM unitvisor.hosts WHERE state = 'active'") == [(3,)],
                     timeout=30, what="the three hosts to register")
            if not self.facts:
                self.facts.update(versions(fleet[0].tb, conn))
            yield self

    def sql(self, query: str, params: object = None) -> list[tuple]:
        assert self.conn is not None
        cur = self.conn.execute(query, params)
        return cur.fetchall() if cur.description else []

    def submit(self, argv: list[str], count: int, **args: object) -> list[uuid.UUID]:
        assert self.conn is not None
        return submit_many(self.conn, argv, count, **args)

    def running(self, run_ids: list[uuid.UUID]) -> int:
        return self.sql("SELECT count(*) FROM unitvisor.runs WHERE id = ANY(%s) AND state = 'running'",
                        (run_ids,))[0][0]

    def cancel(self, run_ids: list[uuid.UUID]) -> bool:
        """Cancel the drill's runs and wait until each has ended; False if some did not in time."""
        assert self.conn is not None
        for run_id in run_ids:
            store.cancel_run(self.conn, run_id)
        try:
            wait_for(lambda: self.sql("SELECT count(*) FROM unitvisor.runs WHERE id = ANY(%s) AND state <> ALL(%s)",
                                      (run_ids, list(TERMINAL))) == [(0,)], timeout=60, what="the runs to end")
        except AssertionError as exc:
            say(f"  warning: {exc}")
            return False
        return True


def seconds(values: list[float]) -> dict[str, float]:
    return {"p50": pct(values, 50), "min": min(values), "max": max(values), "n": len(values)}


# -- (F1) power-off to respawn ------------------------------------------------------------------


def power_off(pg: Postgres, sizes: Sizes, number: int, facts: dict[str, Any]) -> dict[str, Any]:
    """K runs on fleet-1 (the others drained while they are claimed), fleet-1's power cut, and when
    each run's second attempt was recorded running elsewhere, all on the database's clock."""
    with Drill(pg, sizes, number, "power", facts).up() as drill:
        assert drill.fleet is not None
        first, *others = drill.fleet
        viewer = others[0].host  # the CLI of a host that keeps its power
        for member in others:
            viewer.cli("drain", member.host_id)
        run_ids = drill.submit(["/bin/sleep", "600"], sizes.runs, max_attempts=2, retry_backoff_sec=0,
                               retry_backoff_max_sec=0)
        wait_for(lambda: drill.running(run_ids) == len(run_ids), timeout=60, what="the runs to run on fleet-1")
        hosts = drill.sql("SELECT DISTINCT host_id FROM unitvisor.attempts WHERE run_id = ANY(%s)", (run_ids,))
        if hosts != [("fleet-1",)]:
            raise RuntimeError(f"the runs were claimed by {hosts}, not only fleet-1")
        for member in others:
            viewer.cli("undrain", member.host_id)
        # Past one probe of the undrained hosts, then a random part of a poll interval: the cut lands
        # anywhere in fleet-1's heartbeat period, not at the same phase in every drill.
        delay = sizes.poll * (1 + random.random())
        time.sleep(delay)

        # The cut, on the database's clock: every time below is a timestamp PostgreSQL wrote.
        before = drill.sql("SELECT clock_timestamp()")[0][0]
        started = time.monotonic()
        first.power_cut()
        cut_took = time.monotonic() - started
        after = drill.sql("SELECT clock_timestamp()")[0][0]

        def respawned() -> bool:
            return drill.sql("""SELECT count(*) FROM unitvisor.attempts WHERE run_id = ANY(%s) AND attempt = 2
                                AND started_at IS NOT NULL AND outcome IS NULL""", (run_ids,)) == [(len(run_ids),)]

        wait_for(respawned, timeout=sizes.dead_after + 60, interval=0.1, what="every run to run again elsewhere")
        rows = drill.sql(
            """SELECT extract(epoch FROM a2.started_at - %(cut)s)::float8,
                      extract(epoch FROM a2.claimed_at - %(cut)s)::float8,
                      a2.host_id, a1.outcome, a1.reason
               FROM unitvisor.attempts a1 JOIN unitvisor.attempts a2 ON a2.run_id = a1.run_id AND a2.attempt = 2
               WHERE a1.run_id = ANY(%(ids)s) AND a1.attempt = 1""", {"cut": before, "ids": run_ids})
        dead = drill.sql("""SELECT state, extract(epoch FROM dead_at - %(cut)s)::float8,
                                   extract(epoch FROM %(cut)s - heartbeat_at)::float8, dead_reason
                            FROM unitvisor.hosts WHERE id = 'fleet-1'""", {"cut": before})[0]
        cancelled = drill.cancel(run_ids)
    started_s = [row[0] for row in rows]
    state, dead_s, heartbeat_age, dead_reason = dead
    return {
        "runs": len(run_ids),
        "last_running_s": max(started_s), "first_running_s": min(started_s),
        "respawns": sorted(({"host": row[2], "claimed_s": row[1], "running_s": row[0]} for row in rows),
                           key=lambda x: x["running_s"]),
        "declared_dead_s": dead_s, "dead_to_last_running_s": max(started_s) - dead_s,
        "last_heartbeat_before_cut_s": heartbeat_age, "silence_at_declaration_s": dead_s + heartbeat_age,
        "respawned_on": dict(Counter(row[2] for row in rows)),
        "first_attempt_outcomes": dict(Counter(row[3] for row in rows)),
        "first_attempt_reason": rows[0][4], "fleet_1_state": state, "dead_reason": dead_reason,
        "cut_delay_s": delay, "cut_call_s": cut_took, "cut_clock_window_s": (after - before).total_seconds(),
        "cancelled_cleanly": cancelled, "loadavg": loadavg(),
    }


# -- (F2) spread ----------------------------------------------------------------------------------


def spread(pg: Postgres, sizes: Sizes, number: int, facts: dict[str, Any]) -> dict[str, Any]:
    """A burst of runs on three equal idle hosts: how many each runs once all are running."""
    n = sizes.spread_runs
    with Drill(pg, sizes, number, "spread", facts).up() as drill:
        drill.sql("SELECT pg_sleep(%s)", (sizes.poll,))  # every daemon past its first probe: idle
        before = drill.sql("SELECT clock_timestamp()")[0][0]
        run_ids = drill.submit(["/bin/sleep", "30"], n)  # one transaction: one wake-up for everyone
        wait_for(lambda: drill.running(run_ids) == n, timeout=60, interval=0.1, what=f"all {n} runs to be running")
        per_host = dict(drill.sql("SELECT host_id, count(*) FROM unitvisor.attempts WHERE run_id = ANY(%s) "
                                  "GROUP BY host_id ORDER BY host_id", (run_ids,)))
        attempts = sum(per_host.values())
        all_running = drill.sql("SELECT extract(epoch FROM max(started_at) - %s)::float8 FROM unitvisor.attempts "
                                "WHERE run_id = ANY(%s)", (before, run_ids))[0][0]
        # When each host claimed, from the submit: a claim LATE or more after it was not the one the
        # NOTIFY woke (a later poll, or the re-claim after the spread grace).
        claims = {host: {"first_s": first, "last_s": last, "late": late} for host, first, last, late in drill.sql(
            """SELECT host_id, extract(epoch FROM min(claimed_at) - %(t)s)::float8,
                      extract(epoch FROM max(claimed_at) - %(t)s)::float8,
                      count(*) FILTER (WHERE claimed_at - %(t)s >= %(late)s * interval '1 second')
               FROM unitvisor.attempts WHERE run_id = ANY(%(ids)s) GROUP BY host_id""",
            {"t": before, "ids": run_ids, "late": LATE})}
        cancelled = drill.cancel(run_ids)
    counts = {host_id: per_host.get(host_id, 0) for host_id in HOST_IDS}
    return {"runs": n, "per_host": counts, "attempts": attempts, "all_running_s": all_running, "claims": claims,
            "claimed_late": sum(c["late"] for c in claims.values()),
            "cancelled_cleanly": cancelled, "loadavg": loadavg()}


# -- the report ---------------------------------------------------------------------------------


def summarise(r: dict[str, Any]) -> None:
    sizes, targets = r["sizes"], {}
    d, poll = sizes["dead_after"], sizes["poll"]
    if drills := r["power_off"]["drills"]:
        po = r["power_off"]
        last = [x["last_running_s"] for x in drills]
        po["last_running_s"] = seconds(last)
        po["ratio_to_dead_after"] = {"p50": pct(last, 50) / d, "max": max(last) / d}
        for key in ("declared_dead_s", "dead_to_last_running_s", "silence_at_declaration_s",
                    "last_heartbeat_before_cut_s"):
            po[key] = seconds([x[key] for x in drills])
        for x in drills:
            x["claimed_late"] = sum(1 for y in x["respawns"] if y["claimed_s"] - x["declared_dead_s"] >= LATE)
        targets["declared_dead"] = (
            [po["declared_dead_s"]["min"], po["declared_dead_s"]["max"]],
            all(d - poll <= x["declared_dead_s"] <= d + poll and x["silence_at_declaration_s"] >= d for x in drills))
    if drills := r["spread"]["drills"]:
        sp = r["spread"]
        counts = [c for x in drills for c in x["per_host"].values()]
        share = sizes["spread_runs"] / len(HOST_IDS)
        sp["fair_share"], sp["per_host_min"], sp["per_host_max"] = share, min(counts), max(counts)
        sp["all_running_s"] = seconds([x["all_running_s"] for x in drills])
        targets["spread"] = ([min(counts), max(counts)], all(abs(c - share) <= 0.2 * share for c in counts))
    r["targets"] = {name: {"goal": TARGETS[name], "value": value, "met": met}
                    for name, (value, met) in targets.items()}


def table(r: dict[str, Any]) -> str:
    sizes, po, sp, t = r["sizes"], r["power_off"], r["spread"], r["targets"]
    d, poll = sizes["dead_after"], sizes["poll"]

    def mark(name: str) -> str:
        return "met" if t[name]["met"] else "MISSED"

    def span(stats: dict[str, float], *keys: str) -> str:
        return " / ".join(f"{stats[key]:.2f}" for key in keys) + " s"

    rows: list[tuple[str, str, str, str]] = [("figure", "unitvisor", "baseline (same run)", "vs baseline / target")]
    if po["drills"]:
        last, ratio = po["last_running_s"], po["ratio_to_dead_after"]
        rows += [
            (f"(F1) power-off -> last of {sizes['runs']} runs running elsewhere, p50 / max ({last['n']} drills)",
             span(last, "p50", "max"), f"host_dead_after {d} s", f"{ratio['p50']:.2f}x / {ratio['max']:.2f}x of it"),
            ("(F1) ... power-off -> declared dead, min / p50 / max", span(po["declared_dead_s"], "min", "p50", "max"),
             f"{d} s +- poll {poll} s", mark("declared_dead")),
            ("(F1) ... silence at the declaration (last heartbeat -> dead), min / max",
             span(po["silence_at_declaration_s"], "min", "max"), f">= {d} s", ""),
            ("(F1) ... declared dead -> last run running, p50 / max",
             span(po["dead_to_last_running_s"], "p50", "max"), "", "claim + start"),
            (f"(F1) ... claimed >= {LATE:g} s after the declaration, per drill",
             ", ".join(str(x["claimed_late"]) for x in po["drills"]), "0", f"of {sizes['runs']} runs"),
            ("(F1) per drill: power-off -> last running",
             ", ".join(f"{x['last_running_s']:.2f}" for x in po["drills"]), "", "s"),
            ("(F1) per drill: respawned on", ", ".join("/".join(str(x["respawned_on"].get(h, 0)) for h in HOST_IDS[1:])
                                                       for x in po["drills"]), "", "fleet-2/fleet-3"),
        ]
    if sp["drills"]:
        rows += [
            (f"(F2) spread of {sizes['spread_runs']} runs, per drill (fleet-1/2/3)",
             ", ".join("/".join(str(x["per_host"][h]) for h in HOST_IDS) for x in sp["drills"]),
             f"{sp['fair_share']:.0f} each", ""),
            (f"(F2) ... min / max per host ({len(sp['drills'])} drills)",
             f"{sp['per_host_min']} / {sp['per_host_max']}", f"{sp['fair_share']:.0f} +- {0.2 * sp['fair_share']:.0f}",
             mark("spread")),
            (f"(F2) ... claimed >= {LATE:g} s after the submit, per drill",
             ", ".join(str(x["claimed_late"]) for x in sp["drills"]), "0", f"of {sizes['spread_runs']} runs"),
            ("(F2) ... submit -> all running, p50 / max", span(sp["all_running_s"], "p50", "max"), "", ""),
        ]
    lines = aligned(rows)
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------


def run(sizes: Sizes, only: str | None = None) -> dict[str, Any]:
    reason = testbed_mod.available()
    if reason:
        raise SystemExit(f"cannot run the benchmark here: {reason}")
    testbed_mod.cleanup_stale()
    started = dt.datetime.now(dt.UTC)
    say("starting a throwaway PostgreSQL ...")
    config = fleet_config(HOST_IDS[0], poll=sizes.poll, dead_after=sizes.dead_after, allowed='["/bin/sleep"]')
    r: dict[str, Any] = {"date": started.isoformat(timespec="seconds"), "machine": machine_facts(),
                         "sizes": asdict(sizes), "config": config.strip(), "versions": {},
                         "loadavg": {"start": loadavg()}}
    with database() as pg:
        r["power_off"] = {"drills": []}
        for n in range(1, sizes.drills + 1 if only != "spread" else 1):
            say(f"(F1) power-off drill {n}/{sizes.drills}: {sizes.runs} runs on fleet-1, "
                f"host_dead_after {sizes.dead_after} s ...")
            r["power_off"]["drills"].append(power_off(pg, sizes, n, r["versions"]))
            say(f"  last run running elsewhere {r['power_off']['drills'][-1]['last_running_s']:.2f} s after the cut")
        r["spread"] = {"drills": []}
        for n in range(1, sizes.drills + 1 if only != "power-off" else 1):
            say(f"(F2) spread drill {n}/{sizes.drills}: {sizes.spread_runs} runs at once on three idle hosts ...")
            r["spread"]["drills"].append(spread(pg, sizes, n, r["versions"]))
            say(f"  {r['spread']['drills'][-1]['per_host']}")
    r["boot"] = "a fresh fleet of three test beds and a fresh database for every drill"
    summarise(r)
    r["wall_seconds"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    r["loadavg"]["end"] = loadavg()
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="one drill of each, 2 runs, 6 in the burst, host_dead_after 3 s (smoke test)")
    parser.add_argument("--drills", type=int, help="drills of each figure [default: 5]")
    parser.add_argument("--runs", type=int, help="(F1) runs on the host that loses power [default: 6]")
    parser.add_argument("--spread-runs", type=int, help="(F2) runs submitted at once [default: 60]")
    parser.add_argument("--dead-after", type=int, help="[fleet] host_dead_after, seconds [default: 10]")
    parser.add_argument("--poll", type=int, help="[daemon] poll_interval, seconds [default: 1]")
    parser.add_argument("--only", choices=["power-off", "spread"], help="measure only this figure")
    parser.add_argument("--out", type=Path, help="the JSON file [default: bench/results/fleet.json, "
                        "or fleet-tiny.json with --tiny]")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else Sizes()
    for name in ("drills", "runs", "spread_runs", "dead_after", "poll"):
        if getattr(args, name) is not None:
            setattr(sizes, name, getattr(args, name))
    if sizes.drills < 1 or sizes.dead_after < 3 * sizes.poll:
        parser.error("at least one drill, and host_dead_after at least 3 poll intervals")
    out = args.out or RESULTS / ("fleet-tiny.json" if args.tiny else "fleet.json")

    interrupt_on_sigterm()
    results = run(sizes, args.only)
    save(out, results)
    print(table(results))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
