"""The nemesis on real test beds (tests/harness/nemesis.py, docs/fleet.md "Nemesis").

First, the checker is shown to catch what it looks for: on a real fleet, a run's unit is started a
second time by hand (the same unit name on another host, while the first copy runs: a second start
and a second live copy), and a finished run's unit is started again on its own host; the checker,
quiet on the history before, reports each. Then a short seeded schedule of faults runs on three
hosts and must break no promise (`make nemesis` runs a long one)."""

from __future__ import annotations

import os
import time

import psycopg

from tests.conftest import _unavailable
from tests.harness import testbed as testbed_mod
from tests.harness.checker import Report, Sample, check, parse_journal
from tests.harness.fleet import Fleet, Member, fleet_config, submit_many
from tests.harness.host import REPO, wait_for
from tests.harness.nemesis import FAULTS, LATE_ACTIONS, Nemesis, database_history, list_live_units, read_journal

# CI's short schedule: every fault once, in a seeded order, none longer than host_dead_after + 3 s,
# but only two of the four added to it last (failover, rotate_password, apt_upgrade, apt_remove: seed 21
# draws apt_remove and apt_upgrade); about 3 minutes in all (boot, about 2.5 minutes of faults, the
# fleet's quiesce, the audit). And partition_hosts and pg_stall, added after those, once. The hosts run the checkout's
# virtualenv and apt_upgrade/apt_remove are stand-ins here (Nemesis's `packaged`: the .deb's build and
# installs do not fit CI's time; docs/fleet.md, "The package, in the test beds"); `make nemesis` runs dpkg.
CI_SEED = int(os.environ.get("NEMESIS_SEED", "21"))
# A subset, to run by hand (e.g. without the faults a fix is pending for): NEMESIS_FAULTS=kill9,reboot
CI_FAULTS = [name for name in os.environ.get("NEMESIS_FAULTS", "").split(",") if name]


def audit(fleet: Fleet, dsn: str, samples: list[Sample], settled: bool = True) -> Report:
    records = []
    for member in fleet:
        records += parse_journal(member.tb.name, member.host_id, read_journal(member).splitlines())
    attempts, runs = database_history(dsn)
    return check(records, attempts, runs, samples, settled)


def sample(fleet: Fleet, rounds: int, first: int = 1) -> list[Sample]:
    samples = []
    for number in range(first, first + rounds):
        samples += [Sample(number, time.time(), m.tb.name, m.host_id, list_live_units(m)) for m in fleet]
        time.sleep(1)
    return samples


def unit_of(run_id: str) -> str:
    return f"unitvisor-run-{run_id}-1.service"


def plant(member: Member, unit: str, *argv: str) -> None:
    """Start a unit by hand under a run's unit name, as no daemon of ours ever should."""
    member.tb.run("systemd-run", f"--unit={unit}", "-p", "Type=exec", "--quiet", *argv)


def test_the_checker_reports_a_planted_second_start_and_a_second_live_copy(dsn: str) -> None:
    reason = testbed_mod.available()
    if reason:
        _unavailable(reason)
    testbed_mod.cleanup_stale()
    ids = ("fleet-1", "fleet-2")
    configs = {h: fleet_config(h, cut_off=True) for h in ids}
    with Fleet(dsn, size=2, configs=configs) as fleet:
        first, second = fleet
        first.host.start(configure=False)  # fleet-2 runs no daemon: only what is planted runs there
        with psycopg.connect(dsn, autocommit=True) as conn:
            # The long run is cancelled below: 300 s only keeps it running however slow the machine.
            [long_run] = [str(r) for r in submit_many(conn, ["/bin/sleep", "300"])]
            [short_run] = [str(r) for r in submit_many(conn, ["/bin/true"])]
        # 90 s, and the run's events if it ended otherwise: a fresh-clone run, its five passes at once,
        # timed out after 30 s here, and the old wait said nothing of why.
        shown = wait_for(lambda: (d := first.host.show(short_run))["state"] in ("succeeded", "failed", "cancelled",
                                                                                "expired") and d,
                         timeout=90, what="the short run to end")
        assert shown["state"] == "succeeded", shown["events"]
        wait_for(lambda: first.host.show(long_run)["state"] == "running", what="the long run to run")
        before = sample(fleet, 2)
        clean = audit(fleet, dsn, before, settled=False)  # the long run still runs
        assert clean.violations == [], [str(v) for v in clean.violations]
        assert clean.stats["journal_starts"] == 2

        plant(second, unit_of(long_run), "/bin/sleep", "30")   # the same run's unit on another host
        plant(first, unit_of(short_run), "/bin/true")          # a finished run's unit started again
        samples = before + sample(fleet, 3, first=3)
        first.host.cli("cancel", long_run)
        first.host.wait_run(long_run)
        second.tb.run("systemctl", "stop", unit_of(long_run), check=False)
        report = audit(fleet, dsn, samples)

    found = {(v.kind, v.run_id) for v in report.violations}
    print("\n".join(str(v) for v in report.violations))
    assert ("started-twice", long_run) in found
    assert ("started-on-wrong-host", long_run) in found
    assert ("live-copies", long_run) in found
    assert ("overlap-in-journal", long_run) in found
    assert ("started-twice", short_run) in found
    assert found <= {("started-twice", long_run), ("started-on-wrong-host", long_run), ("live-copies", long_run),
                     ("overlap-in-journal", long_run), ("started-twice", short_run)}, found


def test_a_short_nemesis_schedule_breaks_no_promise() -> None:
    reason = testbed_mod.available()
    if reason:
        _unavailable(reason)
    faults = {name: FAULTS[name] for name in CI_FAULTS} if CI_FAULTS else None
    nemesis = Nemesis(CI_SEED, 0, faults, compact=True, out=REPO / "build" / "nemesis" / f"ci-seed-{CI_SEED}")
    report, text = nemesis.run()
    print(text)
    planned = {action.name for action in nemesis.schedule}
    assert planned >= set(faults or FAULTS) - set(LATE_ACTIONS), text
    assert set(nemesis.figures.actions_done) == planned and not nemesis.figures.action_errors, text  # none failed
    assert report.stats["runs"] > 20 and report.stats["journal_starts"] > 20, text
    assert report.violations == [], text
