"""`python -m bench.claim_latency`: what the claim statement and the submitter's COMMIT cost one run, by schema.

Issue 14's latency goal counts everything from a submit's COMMIT to its unit started, and the claim
statement is part of it. bench.scale's single-submit "claim latency" is not that statement: it runs from
the commit to `attempts.claimed_at`, which is `now()` inside the claim, i.e. the statement's start (the
wake-up), so it cannot say whether a schema made the statement itself slower. This does, on one
throwaway PostgreSQL, with databases side by side: the schema up to 008 (before 009's claim and 010's
wake targets), up to 010, and the current one, measured alternately (round by round) so that the
machine's load falls on all of them alike.

Per fleet shape (host rows registered, open attempts per host, which the fair share's `busy` count and
010's wake targets read), per schema, per round:
  claim of 1    one run submitted, then claim_jobs(batch 32) timed from the client (one round trip);
  claim burst   `burst` runs submitted, then one claim_jobs(batch 32) timed;
  submit COMMIT one run submitted in a transaction, its COMMIT timed (010 computes the hosts to wake
                there, before the commit, so it delays the NOTIFY too).
The claims run in a transaction that is rolled back, so every round starts from the same tables. The
host claiming is h0 with 64 slots (the packaged max_runs); with more than one host, the fair share is in
force and the claim asks also_accepted. Results: docs/benchmarks.md, "The claim statement and the
submitter's commit, one run at a time".

    .venv/bin/python -m bench.claim_latency           # 3 shapes x 3 schemas, 200 rounds (15 min, loaded)
    .venv/bin/python -m bench.claim_latency --tiny    # seconds (the smoke test)
"""

from __future__ import annotations

import datetime as dt
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.run import RESULTS, loadavg, report, say, summary, tiny_parser
from supervisor import envpolicy, globs, store, unitspec
from tests.harness.postgres import Postgres

FMT = unitspec.UNIT_NAME_FORMAT
BATCH = 32  # the packaged claim_batch
MAX_RUNS = 64  # the packaged max_runs
# The schemas compared with the current one: before sql/migrations/009_claim_cost.sql and
# sql/migrations/010_wake_targets.sql, and before sql/migrations/011_commit_wake_cost.sql.
BASELINES = (8, 10)


@dataclass
class Sizes:
    # (host rows, open attempts per host)
    shapes: list[tuple[int, int]] = field(default_factory=lambda: [(1, 0), (300, 0), (300, 32)])
    rounds: int = 200
    burst: int = 100
    vacuum_every: int = 50  # rounds; rolled-back rows leave dead index entries behind


TINY = Sizes(shapes=[(1, 0), (3, 2)], rounds=5, burst=10, vacuum_every=3)


def profile(host: str) -> store.HostProfile:
    """A host that accepts /bin/true, as a daemon with the packaged defaults registers it."""
    allowed = ("/bin/true",)
    return store.HostProfile(
        host_id=host, name=host, instance=f"inst-{host}", max_runs=MAX_RUNS, memory_budget=None,
        version="bench", boot_id="bench", allowed_executables=allowed,
        executable_patterns=tuple(globs.glob_regex(p) for p in allowed), run_user="", allowed_users=(),
        environment_denied=envpolicy.denied_regexes(), environment_names=(), environment_patterns=(),
        can_start=True, cannot_start_reason=None, poll_interval=10.0, dead_after=3600.0)


@contextmanager
def schema_dir(upto: int | None) -> Iterator[Path | None]:
    """The migrations up to `upto` in a directory of their own (None: all of them, from store.SQL_DIR)."""
    if upto is None:
        yield None
        return
    where = Path(tempfile.mkdtemp(prefix="uv-claim-latency-"))
    try:
        for version, path in store.migration_files():
            if int(version[:3]) <= upto:
                shutil.copy(path, where)
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def fleet_database(pg: Postgres, name: str, upto: int | None, hosts: int, open_per_host: int) -> store.Connection:
    """A database migrated up to `upto`, `hosts` live hosts, each with `open_per_host` open attempts."""
    with store.connect(pg.dsn) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    conn = store.connect(pg.dsn_for(name))
    conn.execute("SET statement_timeout = 0")
    with schema_dir(upto) as where:
        store.migrate(conn, where)
    if upto is not None and upto < 15:
        # The current store registers a host's environment allowlist with sql/migrations/015's function, which an
        # older schema lacks: there, the denylist as the older daemons registered it (the runs here set
        # no environment, so the claims compared do not depend on it).
        conn.execute("""CREATE FUNCTION unitvisor.register_host_allowlist(h text, e bigint, denied text[],
                            names text[], patterns text[]) RETURNS void LANGUAGE sql AS
                        $$ SELECT unitvisor.register_host_environment(h, e, denied, '{}') $$""")
    if upto is not None and upto < 33:
        # And its labels with 033's (placement), which an older schema has no use for: a host without them.
        conn.execute("""CREATE FUNCTION unitvisor.register_host_labels(h text, e bigint, labels jsonb) RETURNS void
                        LANGUAGE sql AS $$ SELECT $$""")
    # One session registers every host: register_host's lock is per host id, and nothing else here
    # contends for them.
    for i in range(hosts):
        assert store.register_host(conn, profile(f"h{i}")).registered
    if open_per_host:
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true']) FROM generate_series(1, %s)",
                     (hosts * open_per_host,))
        # Past spread_grace, so that no claim holds back for a fair share: each host takes its own.
        conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '1 minute'")
        for i in range(hosts):
            fence = fence_of(conn, f"h{i}")
            conn.execute("SELECT * FROM unitvisor.claim_jobs(%s, %s, %s, %s)",
                         (fence.host_id, fence.epoch, open_per_host, FMT)).fetchall()
    conn.execute("VACUUM ANALYZE")
    return conn


def fence_of(conn: store.Connection, host: str) -> store.Fence:
    found = store.host_fence(conn, host)
    assert found is not None, host
    return found[1]


def timed_claim(conn: store.Connection, fence: store.Fence, queued: int) -> float:
    """ms of one claim_jobs statement over `queued` fresh runs, rolled back with them."""
    with conn.transaction(force_rollback=True):
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true']) FROM generate_series(1, %s)", (queued,))
        began = time.perf_counter()
        taken = conn.execute("SELECT * FROM unitvisor.claim_jobs(%s, %s, %s, %s)",
                             (fence.host_id, fence.epoch, BATCH, FMT)).fetchall()
        elapsed = time.perf_counter() - began
    assert taken, "the claim took nothing: the measure would be of another path"
    return elapsed * 1000


def timed_commit(conn: store.Connection) -> float:
    """ms of the COMMIT of one submit_run; its job is then removed again, so the queue stays empty."""
    conn.execute("BEGIN")
    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])")
    began = time.perf_counter()
    conn.execute("COMMIT")
    elapsed = time.perf_counter() - began
    conn.execute("DELETE FROM unitvisor.spawn_jobs WHERE state = 'available'")
    return elapsed * 1000


def measure(pg: Postgres, sizes: Sizes, hosts: int, open_per_host: int) -> dict[str, Any]:
    schemas: dict[str, int | None] = {f"to {upto:03d}": upto for upto in BASELINES} | {"current": None}
    say(f"{hosts} hosts, {open_per_host} open attempts each: preparing {len(schemas)} databases ...")
    conns = {label: fleet_database(pg, f"claim_{hosts}_{open_per_host}_{i}", upto, hosts, open_per_host)
             for i, (label, upto) in enumerate(schemas.items())}
    try:
        figures: dict[str, dict[str, list[float]]] = {
            label: {"claim_1": [], "claim_burst": [], "submit_commit": []} for label in schemas}
        for done in range(1, sizes.rounds + 1):
            for label, conn in conns.items():
                fence = fence_of(conn, "h0")
                figures[label]["claim_1"].append(timed_claim(conn, fence, 1))
                figures[label]["claim_burst"].append(timed_claim(conn, fence, sizes.burst))
                figures[label]["submit_commit"].append(timed_commit(conn))
                if done % sizes.vacuum_every == 0:
                    conn.execute("VACUUM")
        return {label: {name: summary(values) for name, values in f.items()} for label, f in figures.items()}
    finally:
        for conn in conns.values():
            conn.close()


def run(sizes: Sizes) -> dict[str, Any]:
    results: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                               "sizes": asdict(sizes), "loadavg": {"start": loadavg()}, "shapes": []}
    pg = Postgres()
    try:
        pg.init()
        pg.start()
        with pg.connect() as conn:
            results["postgres"] = conn.execute("SHOW server_version").fetchone()[0]
        for hosts, open_per_host in sizes.shapes:
            figures = measure(pg, sizes, hosts, open_per_host)
            results["shapes"].append({"hosts": hosts, "open_per_host": open_per_host, "figures": figures})
            results["loadavg"][f"{hosts}x{open_per_host}"] = loadavg()
    finally:
        pg.stop()
    return results


def table(results: dict[str, Any]) -> str:
    lines = [f"{'hosts x open':<14} {'schema':<8} {'claim of 1 p50/p95':>20} {'claim of burst p50/p95':>24} "
             f"{'submit COMMIT p50/p95':>22}"]
    for shape in results["shapes"]:
        for label, f in shape["figures"].items():
            cells = [f"{f[k]['p50']:.2f} / {f[k]['p95']:.2f} ms" for k in ("claim_1", "claim_burst", "submit_commit")]
            lines.append(f"{shape['hosts']:>5} x {shape['open_per_host']:<6} {label:<8} {cells[0]:>20} "
                         f"{cells[1]:>24} {cells[2]:>22}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = tiny_parser("python -m bench.claim_latency", __doc__, RESULTS / "claim_latency.json")
    parser.add_argument("--rounds", type=int, help="rounds per shape (default 200)")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else Sizes()
    if args.rounds:
        sizes.rounds = args.rounds
    results = run(sizes)
    report(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
