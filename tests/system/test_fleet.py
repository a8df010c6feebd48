"""A fleet: three test bed hosts (containers with their own machine id and systemd) on one
PostgreSQL, each with a real unitvisor.service. Allowlists that differ, a host powered off, a host
cut off from the database (reset and black hole, with and without stop_runs_when_cut_off), a second
daemon with a host id in use, and a burst spread over the hosts."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator

import psycopg
import pytest

from supervisor import store
from tests.conftest import _unavailable
from tests.harness import testbed as testbed_mod
from tests.harness.fleet import ALLOW_DRILLS, Fleet, fleet_config, submit_many
from tests.harness.host import Host, wait_for

DEAD_AFTER = 6  # seconds; poll 1 s, stop_grace 1 s: the cut-off stop comes at 6 - 1 - 2 = 3 s


def config(host_id: str, allowed: str = ALLOW_DRILLS, cut_off: bool = False) -> str:
    return fleet_config(host_id, dead_after=DEAD_AFTER, cut_off=cut_off, allowed=allowed)


class Drill:
    """A booted fleet of three (tests/harness/fleet.py) and what the drills do to it and read from it."""

    def __init__(self, fleet: Fleet, dsn: str) -> None:
        self.fleet = fleet
        self.dsn = dsn  # straight to PostgreSQL, never through a proxy
        self.hosts = fleet.hosts

    @property
    def viewer(self) -> Host:
        """The host whose CLI the tests read through: fleet-2, which no drill powers off or cuts off."""
        return self.hosts[1]

    def start(self, *hosts: Host) -> None:
        for host in hosts or self.hosts:
            host.start(configure=False)

    def sql(self, query: str, params: object = None) -> list[tuple]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    def submit(self, argv: list[str], count: int = 1, **args: object) -> list[str]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return [str(run_id) for run_id in submit_many(conn, argv, count, **args)]

    def runs(self, run_ids: list[str]) -> dict[str, dict]:
        return {run_id: self.viewer.show(run_id) for run_id in run_ids}

    def host_state(self, host_id: str) -> str:
        rows = self.sql("SELECT state FROM unitvisor.hosts WHERE id = %s", (host_id,))
        return rows[0][0] if rows else ""


@contextlib.contextmanager
def drill(dsn: str, configs: dict[str, str] | None = None, proxied: tuple[int, ...] = ()) -> Iterator[Drill]:
    reason = testbed_mod.available()
    if reason:
        _unavailable(reason)
    testbed_mod.cleanup_stale()
    ids = ("fleet-1", "fleet-2", "fleet-3")
    texts = {host_id: config(host_id) for host_id in ids} | (configs or {})
    with Fleet(dsn, size=3, configs=texts, proxied=proxied) as fleet:
        yield Drill(fleet, dsn)


def live_units(host: Host) -> set[str]:
    """Run ids whose unit's process runs on this host now (an exited or failed unit is not live)."""
    out = host.tb.run("systemctl", "list-units", "--all", "--plain", "--no-legend", "unitvisor-run-*",
                      check=False, timeout=20).stdout
    live = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[3] not in ("exited", "dead", "failed"):
            live.add(parts[0].removeprefix("unitvisor-run-")[:36])
    return live


class Sampler:
    """Every second, which host runs a live unit of which run: the proof that two copies of one run
    never (or, without stop_runs_when_cut_off, do) run at once."""

    def __init__(self, hosts: list[Host]) -> None:
        self.hosts = hosts
        self.overlaps: list[tuple[float, str, list[str]]] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.monotonic()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            where = defaultdict(list)
            for host in self.hosts:
                with contextlib.suppress(Exception):  # a host powered off has no units to list
                    for run_id in live_units(host):
                        where[run_id].append(host.host_id)
            self.samples += 1
            self.overlaps += [(time.monotonic() - self._start, run, hosts)
                              for run, hosts in where.items() if len(hosts) > 1]


def hosts_of(data: dict) -> list[tuple[str, str | None]]:
    return [(a["host"], a["outcome"]) for a in data["attempts"]]


def wait_all(fleet: Drill, run_ids: list[str], timeout: float = 90) -> dict[str, dict]:
    return {run_id: fleet.viewer.wait_run(run_id, timeout=timeout) for run_id in run_ids}


def runs_on_first_host(fleet: Drill, argv: list[str], count: int, also: list[str] | None = None,
                       **args: object) -> list[str]:
    """Submit runs while only fleet-1 claims (the others drained), and wait until they all run there.
    `also`: a second command, submitted once with the same arguments."""
    first, *others = fleet.hosts
    for host in others:
        fleet.viewer.cli("drain", host.host_id)
    run_ids = fleet.submit(argv, count, **args) + (fleet.submit(also, 1, **args) if also else [])
    wait_for(lambda: all(d["state"] == "running" for d in fleet.runs(run_ids).values()), timeout=60,
             what="the runs to run on fleet-1")
    assert {a["host"] for d in fleet.runs(run_ids).values() for a in d["attempts"]} == {"fleet-1"}
    for host in others:
        fleet.viewer.cli("undrain", host.host_id)
    return run_ids


# -- claims -----------------------------------------------------------------------------------------


def test_every_run_lands_on_a_host_that_allows_it_and_none_is_refused(dsn: str) -> None:
    allowed = {"fleet-1": '["/bin/sh"]', "fleet-2": '["/bin/sleep"]', "fleet-3": "[]"}
    with drill(dsn, {host_id: config(host_id, allowed=a) for host_id, a in allowed.items()}) as fleet:
        fleet.start()
        shells = fleet.submit(["/bin/sh", "-c", "exit 0"], 10)
        sleeps = fleet.submit(["/bin/sleep", "0.1"], 10)
        nobody = fleet.submit(["/bin/true"], 1)
        for run_id, data in wait_all(fleet, shells + sleeps).items():
            assert data["state"] == "succeeded", data
            expected = "fleet-1" if run_id in shells else "fleet-2"
            assert hosts_of(data) == [(expected, "success")], data
        assert fleet.sql("SELECT count(*) FROM unitvisor.attempts WHERE outcome = 'refused' OR host_id = 'fleet-3'") \
            == [(0,)]
        data = wait_for(lambda: (d := fleet.viewer.show(nobody[0]))["wait_reason"] and d, timeout=30,
                        what="the reason the /bin/true run waits")
        assert data["wait_reason"] == ("no live host accepts it: executable /bin/true is not allowed "
                                       "(fleet-1, fleet-2, fleet-3)")


def test_a_burst_spreads_over_three_idle_hosts(dsn: str) -> None:
    with drill(dsn) as fleet:
        fleet.start()
        run_ids = fleet.submit(["/bin/sleep", "30"], 60)  # one transaction: one wake-up for everyone
        wait_for(lambda: fleet.sql("SELECT count(*) FROM unitvisor.runs WHERE state = 'running'") == [(60,)],
                 timeout=60, what="all 60 runs to be running")
        spread = Counter(host for (host,) in fleet.sql("SELECT host_id FROM unitvisor.attempts"))
        print(f"spread of 60 runs over 3 hosts: {dict(spread)}")
        assert sum(spread.values()) == 60
        assert all(16 <= spread[h.host_id] <= 24 for h in fleet.hosts), spread
        with store.connect(fleet.dsn) as conn:
            for run_id in run_ids:
                store.cancel_run(conn, uuid.UUID(run_id))


# -- dead hosts ----------------------------------------------------------------------------------------


def test_a_host_powered_off_is_declared_dead_and_its_runs_respawn_elsewhere(dsn: str) -> None:
    with drill(dsn) as fleet:
        fleet.start()
        first = fleet.fleet[0]
        # The pinned run first, and the power cut right after the others run: on a loaded machine (the
        # fresh-clone CI run) the wait for the pinned run once outlasted runs of 8 s, which then ended on
        # fleet-1 before the cut and were never lost.
        at_most_once = fleet.submit(["/bin/sleep", "300"], 1, host_pin="fleet-1", retry_on=["exit-code"],
                                    max_attempts=3)
        wait_for(lambda: fleet.viewer.show(at_most_once[0])["state"] == "running", what="the pinned run to run")
        retried = runs_on_first_host(fleet, ["/bin/sleep", "15"], 4, max_attempts=2, retry_backoff_sec=0,
                                     retry_backoff_max_sec=0)
        cut_at = time.monotonic()
        first.power_cut()
        results = wait_all(fleet, retried, timeout=DEAD_AFTER + 60)
        print(f"power-off to the last run finished elsewhere: {time.monotonic() - cut_at:.1f}s "
              f"(host_dead_after {DEAD_AFTER}s, runs of 15s)")
        for data in results.values():
            assert data["state"] == "succeeded", data
            [(host1, lost), (host2, success)] = hosts_of(data)
            assert (host1, lost, success) == ("fleet-1", "lost", "success") and host2 != "fleet-1", data
            assert "host fleet-1 was silent for" in data["attempts"][0]["reason"]
        once = fleet.viewer.wait_run(at_most_once[0])
        assert (once["state"], hosts_of(once)) == ("failed", [("fleet-1", "lost")])
        assert fleet.host_state("fleet-1") == "dead"
        assert "dead" in fleet.viewer.cli("hosts").stdout
        waiting = fleet.submit(["/bin/true"], 1, host_pin="fleet-1")
        data = wait_for(lambda: (d := fleet.viewer.show(waiting[0]))["wait_reason"] and d, timeout=30,
                        what="the pinned run to say why it waits")
        assert data["wait_reason"].startswith("pinned to host fleet-1, which is dead")

        # It comes back: it registers again, starts nothing of what was taken over, runs what waits for it.
        first.boot()
        fleet.start(first.host)
        wait_for(lambda: fleet.host_state("fleet-1") == "active", what="fleet-1 to rejoin")
        assert fleet.viewer.wait_run(waiting[0])["state"] == "succeeded"
        for run_id, data in fleet.runs(retried + at_most_once).items():
            assert len(data["attempts"]) == len(results.get(run_id, once)["attempts"]), data
        # (Not asserted: that the journal kept the powered-off boot. A power cut loses what journald
        # had not flushed, and under load that can be all of it.)
        assert "rejoined after being declared dead" in first.host.daemon_log()


# -- partitions ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["reset", "blackhole"])
def test_a_cut_off_host_stops_its_runs_before_anyone_runs_them_again(dsn: str, how: str) -> None:
    configs = {host_id: config(host_id, cut_off=True) for host_id in ("fleet-1", "fleet-2", "fleet-3")}
    with drill(dsn, configs, proxied=(1,)) as fleet:
        fleet.start()
        first = fleet.fleet[0]
        run_ids = runs_on_first_host(fleet, ["/bin/sleep", "12"], 3, max_attempts=2, retry_backoff_sec=0,
                                     retry_backoff_max_sec=0)
        with Sampler(fleet.hosts) as sampler:
            first.cut(how)
            results = wait_all(fleet, run_ids, timeout=DEAD_AFTER + 60)
            first.heal()
            wait_for(lambda: fleet.host_state("fleet-1") == "active", timeout=60, what="fleet-1 to rejoin")
        assert sampler.samples > 10
        assert sampler.overlaps == [], f"two live copies of one run: {sampler.overlaps}"
        for data in results.values():
            assert data["state"] == "succeeded", data
            assert [outcome for _, outcome in hosts_of(data)] == ["lost", "success"], data
        # The runs were stopped by the host's fence (supervisor/fence.py), one journal line each.
        assert first.host.fence_log().count("\nfenced ") + first.host.fence_log().startswith("fenced ") == 3
        # Back, it learns it was declared dead: from a refused write (fenced) or at registration.
        assert "rejoined after being declared dead" in first.host.daemon_log()


def test_without_stop_runs_when_cut_off_a_partition_runs_copies_until_the_host_comes_back(dsn: str) -> None:
    """What docs/fleet.md says happens with the default: at least once, and the copies overlap while
    the partition lasts; when it heals, the fenced host's late outcomes are refused and its stale
    units stopped."""
    with drill(dsn, proxied=(1,)) as fleet:
        fleet.start()
        first = fleet.fleet[0]
        ends_in_partition, runs_past_it = runs_on_first_host(
            fleet, ["/bin/sleep", "8"], 1, also=["/bin/sleep", "300"], max_attempts=2, retry_backoff_sec=0,
            retry_backoff_max_sec=0)
        with Sampler(fleet.hosts) as sampler:
            first.cut("reset")
            wait_for(lambda: len((d := fleet.viewer.show(runs_past_it))["attempts"]) == 2 and d["state"] == "running",
                     timeout=DEAD_AFTER + 30, what="the long run's copy to run elsewhere")
            time.sleep(8)  # fleet-1's short run ends in here, unheard
            first.heal()
            wait_for(lambda: fleet.host_state("fleet-1") == "active", timeout=60, what="fleet-1 to rejoin")
            wait_for(lambda: not live_units(first.host), timeout=30, what="fleet-1 to stop its stale unit")
        assert any(run == runs_past_it for _, run, _ in sampler.overlaps), "expected overlapping copies"
        short = fleet.viewer.wait_run(ends_in_partition, timeout=60)
        assert [o for _, o in hosts_of(short)] == ["lost", "success"], short  # fleet-1's exit 0 was not merged
        long = fleet.viewer.show(runs_past_it)
        assert [o for _, o in hosts_of(long)] == ["lost", None], long
        log = first.host.daemon_log()
        assert "rejoined after being declared dead" in log and "stop-stale" in log
        fleet.viewer.cli("cancel", runs_past_it)


def test_a_drained_host_that_stops_stays_drained_and_is_not_declared_dead(dsn: str) -> None:
    """Issue 24 (schema 24): drain fleet-1, `systemctl stop unitvisor` on it, and wait three times its
    host_dead_after with fleet-2 live and doing the fleet's upkeep: fleet-1 stays `stopped (drained)`,
    never `dead`. Started again it is draining and claims nothing, not even a run pinned to it. Failed
    before: its clean stop left it `draining`, and fleet-2 declared it dead within seconds."""
    with drill(dsn) as fleet:
        first, second, _ = fleet.hosts
        fleet.start(first, second)
        assert "active -> draining" in first.cli("drain").stdout
        first.stop()
        assert fleet.host_state("fleet-1") == "stopped"
        time.sleep(3 * DEAD_AFTER)
        assert fleet.host_state("fleet-1") == "stopped"
        assert "stopped (drained)" in fleet.viewer.cli("hosts").stdout
        assert "host-dead" not in second.daemon_log()
        [run_id] = fleet.submit(["/bin/true"], 1, host_pin="fleet-1")
        first.start(configure=False)
        assert fleet.host_state("fleet-1") == "draining"
        time.sleep(3)  # three of its poll intervals: each would have claimed the run
        assert fleet.viewer.show(run_id)["state"] == "queued"


# -- one daemon per host id ------------------------------------------------------------------------------


def test_a_second_daemon_with_a_host_id_in_use_does_nothing(dsn: str) -> None:
    with drill(dsn, {"fleet-2": config("fleet-1")}) as fleet:
        first, second, _ = fleet.hosts
        fleet.start(first)
        run_ids = fleet.submit(["/bin/sleep", "6"], 3)
        wait_for(lambda: all(d["state"] == "running" for d in fleet.runs(run_ids).values()), what="runs to run")
        fleet.start(second)
        wait_for(lambda: "held by another live daemon" in second.unit_props("unitvisor.service", "StatusText")
                 .get("StatusText", ""), timeout=30, what="the duplicate to say why it does nothing")
        assert "conflict" in fleet.viewer.cli("hosts").stdout
        doctor = second.cli("doctor", check=False)
        assert doctor.returncode == 1 and "host id" in doctor.stdout, doctor.stdout
        for data in wait_all(fleet, run_ids).values():
            assert hosts_of(data) == [("fleet-1", "success")], data
        log = second.daemon_log()
        assert "host-id-conflict" in log
        for word in ("claimed", "stop", "settled", "adopted", "started"):
            assert f"\n{word} " not in log and not log.startswith(f"{word} "), log


def test_a_clone_cannot_take_the_id_while_its_host_restarts_with_runs_open(dsn: str) -> None:
    """Issue 21: `systemctl restart` on fleet-1 while another machine is configured with its id. Between
    the stop and the start fleet-1 is `stopped` with runs open: the clone is refused (before schema 13 it
    took the id, settled fleet-1's runs `lost` and they ran again). host_dead_after 30 s on both, so that
    the restart fits well inside it on a loaded machine."""
    held = fleet_config("fleet-1", dead_after=30)
    with drill(dsn, {"fleet-1": held, "fleet-2": held}) as fleet:
        first, clone, third = fleet.hosts
        fleet.start(first, third)
        run_ids = fleet.submit(["/bin/sleep", "10"], 2, host_pin="fleet-1")
        wait_for(lambda: all(d["state"] == "running" for d in fleet.runs(run_ids).values()), what="runs to run")
        first.stop()
        assert fleet.host_state("fleet-1") == "stopped"
        fleet.start(clone)
        status = wait_for(lambda: (t := clone.unit_props("unitvisor.service", "StatusText").get("StatusText", ""))
                          and "held by instance" in t and t, timeout=20, what="the clone to say why it waits")
        assert "stopped with 2 attempt(s) open" in status, status
        fleet.start(first)  # the restart's second half: the id is fleet-1's again at once
        for data in wait_all(fleet, run_ids).values():
            assert hosts_of(data) == [("fleet-1", "success")], data
        log = clone.daemon_log()
        assert "host-id-conflict" in log
        for word in ("claimed", "settled", "adopted", "started"):
            assert f"\n{word} " not in log and not log.startswith(f"{word} "), log
