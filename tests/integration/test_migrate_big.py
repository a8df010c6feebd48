"""A big database migrated while it is in use (issue 21): millions of runs at schema 004 (the version
before 005), README's CREATE INDEX CONCURRENTLY statements, then two `unitvisor migrate` at once to
the newest schema while a daemon-like session keeps submitting runs.

Before the fix, 005 added its CHECK constraints in its own transaction: the scan of every run (about
9 s per million runs on the 2-core test machine) ran under the daemons' 15 s statement_timeout and an
ACCESS EXCLUSIVE lock on runs, so the migrate failed on the statement timeout, the second migrate on the
5 s lock timeout, and every submit meanwhile on the lock timeout too.

Why two million runs, not one: a million took 8.5 s in 005's scan here, under the 15 s that made the
old runner fail; two million take about 17 s, past it. Duration (printed with `pytest -s`), on the
2-core development machine: about a minute when it is otherwise idle (the parts measured at a load of
2: 13.5 s per million runs inserted, 9 s per million validated); 206 s and 254 s in all in two runs
while it was shared with seven other engineers' tests (load 12 to 28: 130 to 143 s to insert, 72 to
104 s to migrate).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from supervisor import store
from tests.integration.conftest import CliResult
from tests.integration.test_migrate_operations import readme_prebuilt_index_statements, sql_dir_up_to

RUNS = 2_000_000
ALL_VERSIONS = [path.stem for path in sorted(store.MIGRATIONS_DIR.glob("*.sql"))]


def fill(dsn: str, runs: int) -> None:
    """`runs` finished runs, one a second back from now, as one INSERT ... SELECT generate_series (the
    fastest way to a big table short of COPY). Rows valid by construction, so the argv trigger (002) is
    skipped for the load (session_replication_role = replica, a superuser's setting); a VACUUM then,
    as autovacuum would have done long ago on a database that grew this big."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET statement_timeout = 0")
        conn.execute("SET session_replication_role = replica")
        conn.execute("""
            INSERT INTO unitvisor.runs (argv, state, created_at, updated_at, finished_at)
            SELECT ARRAY['/usr/bin/backup', '--volume', 'v' || g %% 100], 'succeeded',
                   now() - make_interval(secs => g + 5), now() - make_interval(secs => g),
                   now() - make_interval(secs => g)
            FROM generate_series(1, %s) AS g""", (runs,))
        conn.execute("VACUUM ANALYZE unitvisor.runs")


# A VALIDATE CONSTRAINT of the runner in progress, as pg_stat_activity shows it.
VALIDATING = ("SELECT count(*) > 0 FROM pg_stat_activity WHERE state = 'active' "
              "AND query LIKE 'ALTER TABLE %VALIDATE CONSTRAINT%'")


class Submitter(threading.Thread):
    """A session with the daemons' settings (5 s lock_timeout, 15 s statement_timeout) that submits a
    run every 0.2 s until stopped, as a control plane would go on doing during an upgrade; each submit
    noted with whether the runner was validating a constraint both just before and just after it."""

    def __init__(self, dsn: str) -> None:
        super().__init__()
        self.dsn, self.stopping = dsn, threading.Event()
        self.submits: list[tuple[bool, str | None, float]] = []  # (during a validation, error, seconds)

    def run(self) -> None:
        with store.connect(self.dsn) as conn, store.connect(self.dsn) as watcher:
            while not self.stopping.is_set():
                validating = watcher.execute(VALIDATING).fetchone()[0]
                started, error = time.monotonic(), None
                try:
                    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])")
                except psycopg.Error as exc:
                    error = store.one_line(exc)
                seconds = time.monotonic() - started
                validating = validating and watcher.execute(VALIDATING).fetchone()[0]
                self.submits.append((validating, error, seconds))
                self.stopping.wait(0.2)


def test_millions_of_runs_migrate_from_004_to_the_newest_while_runs_are_submitted(
        empty_dsn: str, tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    began = time.monotonic()
    with store.connect(empty_dsn) as conn:
        assert store.migrate(conn, sql_dir_up_to(tmp_path, 4))[-1] == "004_roles"
    fill(empty_dsn, RUNS)
    filled = time.monotonic()

    # What README's Upgrade section tells the operator of a big database to run first: 008's indexes,
    # built without blocking writes.
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        for statement in readme_prebuilt_index_statements():
            conn.execute(statement)
    prebuilt = time.monotonic()

    submitter = Submitter(empty_dsn)
    submitter.start()
    results: dict[str, CliResult] = {}
    first = threading.Thread(target=lambda: results.update(first=cli("--dsn", empty_dsn, "migrate", timeout=600)))
    first.start()
    with store.connect(empty_dsn) as watcher:
        deadline = time.monotonic() + 30
        while watcher.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                              "AND objid::bigint = %s", (store.MIGRATION_LOCK_KEY & 0xFFFF_FFFF,)).fetchone()[0] == 0:
            assert time.monotonic() < deadline, "the first migrate never took the migration lock"
            time.sleep(0.05)
    results["second"] = cli("--dsn", empty_dsn, "migrate", timeout=600)
    first.join(timeout=600)
    migrated = time.monotonic()
    submitter.stopping.set()
    submitter.join(timeout=30)

    submitted = sum(1 for _, error, _ in submitter.submits if error is None)
    during = [(error, seconds) for validating, error, seconds in submitter.submits if validating]
    print(f"\n{RUNS} runs: filled in {filled - began:.1f} s, 008's indexes built concurrently in "
          f"{prebuilt - filled:.1f} s, migrated in {migrated - prebuilt:.1f} s; {submitted} runs submitted "
          f"meanwhile ({len(during)} while a constraint was validated), the slowest in "
          f"{max(seconds for _, _, seconds in submitter.submits):.2f} s; {migrated - began:.1f} s in all")
    assert results["first"].returncode == 0, results["first"].stderr
    assert results["first"].stdout.strip() == f"applied: {', '.join(ALL_VERSIONS[4:])}"
    # The second waited for the first, past the 5 s lock_timeout, and found nothing left to do.
    assert results["second"].returncode == 0, results["second"].stderr
    assert results["second"].stdout.strip() == "schema is current; nothing to apply"
    assert results["second"].stderr.startswith("another migrate is running (server pid ")
    # Runs were submitted while the constraints' scans ran (the longest part), none held past the
    # daemons' lock_timeout: the scans run outside the migrations' ACCESS EXCLUSIVE lock. What may still
    # hold a submit is an index built inside 005 or 006 (README, Upgrade): about a second here, but on
    # a machine under heavy load it may pass 5 s, so a lock timeout is allowed there and only there.
    assert during and all(error is None for error, _ in during), during
    others = [error for _, error, _ in submitter.submits if error is not None and "lock timeout" not in error]
    assert others == [], others
    with store.connect(empty_dsn) as conn:
        assert store.pending_migrations(conn) == []
        assert store.unvalidated_constraints(conn) == []
        assert conn.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0] == RUNS + submitted
