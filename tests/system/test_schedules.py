"""Schedules on two test bed hosts sharing one PostgreSQL, each with a real unitvisor.service polling
every second (sql/migrations/028_schedules.sql): both daemons' upkeep sees each due time, and each due
time makes one run, which one of the hosts runs; once the host that submitted them is killed, the other
submits the next. A cron minute is too slow for a test: the schedule's next due time is set seconds
ahead, four times over."""

from __future__ import annotations

import re
import time

from tests.harness.host import wait_for
from tests.system.test_lifecycle import sql, two_hosts

DUE_TIMES = 3


def test_each_due_time_of_a_schedule_makes_one_run_across_two_hosts(dsn: str) -> None:
    with two_hosts(dsn) as hosts:
        sql(dsn, """SELECT unitvisor.create_schedule('tick', '0 0 1 1 *', 'UTC', '{"argv": ["/bin/true"]}',
                                                     overlap => 'allow')""")
        dues: list = []

        def next_due_reached() -> None:
            # Whole seconds apart, as the run's idempotency key reads its due time.
            due = sql(dsn, "UPDATE unitvisor.schedules SET next_due = date_trunc('second', now()) + interval '2 s' "
                           "RETURNING next_due")[0][0]
            dues.append(due)
            wait_for(lambda: sql(dsn, "SELECT last_due FROM unitvisor.schedules")[0][0] == due, timeout=30,
                     what=f"due time {len(dues)} to be reached")
            time.sleep(1.1)  # the next one another second on, and both daemons' probes past this one

        for _ in range(DUE_TIMES):
            next_due_reached()
        # Failover: a daemon that has submitted one dies (kill -9); the other submits the next.
        submitters = [h for h in hosts if "schedule-due" in h.daemon_log()]
        submitters[-1].kill()
        survivor = next(h for h in hosts if h is not submitters[-1])
        said_before = survivor.daemon_log().count("schedule-due")
        next_due_reached()
        assert survivor.daemon_log().count("schedule-due") == said_before + 1
        runs = sql(dsn, """SELECT r.labels ->> 'unitvisor/due', r.id::text FROM unitvisor.runs r
                           WHERE r.labels ->> 'unitvisor/schedule' = 'tick'""")
        stamps = [d.strftime("%Y-%m-%dT%H:%M:%SZ") for d in dues]
        assert sorted(r[0] for r in runs) == stamps, runs  # one run per due time, no more
        for _, run_id in runs:
            assert survivor.wait_run(run_id, timeout=60)["state"] == "succeeded"
        [(submitted, missed, skipped, next_due)] = sql(
            dsn, "SELECT submitted, missed, skipped, next_due FROM unitvisor.schedules")
        assert (submitted, missed, skipped, next_due.year) == (DUE_TIMES + 1, 0, 0, dues[-1].year + 1)
        # Said once per due time across the two hosts' journals: by the host that submitted it.
        logs = "\n".join(host.daemon_log() for host in hosts)
        said = re.findall(r"schedule-due .*schedule=tick .*due=(\S+)", logs)
        assert len(said) == DUE_TIMES + 1, said
        print(f"{DUE_TIMES + 1} due times, submitted by: "
              f"{[h.host_id for h in hosts for _ in re.findall('schedule-due', h.daemon_log())]}")
