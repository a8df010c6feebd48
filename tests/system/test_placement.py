"""Placement on a two-host fleet of the test bed (issue 25, item 4; sql/migrations/033_placement.sql):
each host's real unitvisor.service registers its [host] labels; a run pinned by host_labels goes to the
host that has them, whichever host's CLI submitted it; a run no host matches waits and says why; and
the retry of an attempt lost with its host (a power cut) goes to the other host."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from tests.conftest import _unavailable
from tests.harness import testbed as testbed_mod
from tests.harness.fleet import Fleet, fleet_config
from tests.harness.host import wait_for

HOSTS = ("place-1", "place-2")
ZONES = {"place-1": "a", "place-2": "b"}


def config(host_id: str) -> str:
    """The fleet's short timings (a host silent 6 s is dead), and labels: a zone each, one pool for both."""
    labels = f'labels = {{ zone = "{ZONES[host_id]}", pool = "batch" }}\n'
    text = fleet_config(host_id)
    assert f'name = "{host_id}"\n' in text
    return text.replace(f'name = "{host_id}"\n', f'name = "{host_id}"\n{labels}')


@contextlib.contextmanager
def two_hosts(dsn: str) -> Iterator[Fleet]:
    """Two hosts polling every second, started, under test bed names of their own."""
    reason = testbed_mod.available()
    if reason:
        _unavailable(reason)
    testbed_mod.cleanup_stale()
    with Fleet(dsn, size=2, prefix="uv-place", host_ids=HOSTS, configs={h: config(h) for h in HOSTS}) as fleet:
        for host in fleet.hosts:
            host.start(configure=False)
        yield fleet


def test_a_run_goes_to_the_host_with_its_labels_and_one_no_host_matches_waits_saying_why(dsn: str) -> None:
    with two_hosts(dsn) as fleet:
        one, two = fleet.hosts
        listed = {h["id"]: h["labels"] for h in json.loads(one.cli("hosts", "--json").stdout)}
        assert listed == {"place-1": {"zone": "a", "pool": "batch"}, "place-2": {"zone": "b", "pool": "batch"}}
        # Each submitted on the other host's CLI: where a run is submitted says nothing of where it runs.
        to_two = one.submit("--host-label", "zone=b", "--", "/bin/true")
        to_one = two.submit("--host-label", "zone=a", "--host-label", "pool=batch", "--", "/bin/true")
        submitted = one.cli("submit", "--host-label", "zone=c", "--host-label", "pool=batch", "--", "/bin/true")
        nowhere = submitted.stdout.strip()
        said = "no live host accepts it: has no label zone=c (place-1, place-2)"
        assert submitted.stderr.strip() == f"unitvisor: warning: run {nowhere} waits: {said}"

        for run_id, host_id in ((to_two, "place-2"), (to_one, "place-1")):
            data = one.wait_run(run_id, timeout=60)
            assert data["state"] == "succeeded", data
            assert [a["host"] for a in data["attempts"]] == [host_id]
        # show says why at once (refusals_now); the fleet upkeep records it too, two poll intervals on, as
        # an event and the reason `wait_reason` keeps. It never starts.
        assert two.show(nowhere)["no_host_accepts"] == said
        wait_for(lambda: any(e["reason"] == f"waiting: {said}" for e in two.show(nowhere)["events"]), timeout=60,
                 what="the fleet upkeep to record why the run waits")
        data = two.show(nowhere)
        assert (data["state"], data["attempts"], data["host_labels"]) == ("queued", [], {"zone": "c", "pool": "batch"})
        assert data["wait_reason"] == said
        one.cli("cancel", nowhere)


def test_a_lost_attempts_retry_goes_to_the_other_host(dsn: str) -> None:
    with two_hosts(dsn) as fleet:
        first, second = fleet[0], fleet[1]
        # place-2 drained while the run is claimed, so that its first attempt is place-1's.
        second.host.cli("drain", "place-2")
        run_id = first.host.submit("--host-label", "pool=batch", "--", "/bin/sleep", "300")
        wait_for(lambda: first.host.show(run_id)["state"] == "running", timeout=60, what="the run to run on place-1")
        second.host.cli("undrain", "place-2")
        wait_for(lambda: json.loads(second.host.cli("hosts", "--json").stdout)[1]["state"] == "active", timeout=30,
                 what="place-2 to be active again")

        # A power cut: the attempt is lost (settled by place-2 once place-1 is declared dead, or by place-1
        # itself when it comes back and takes its id over); place-1 is back and live for the retry.
        first.power_cut()
        first.boot()
        first.host.start(configure=False)

        def retried() -> dict | None:
            data = second.host.show(run_id)
            return data if len(data["attempts"]) == 2 and data["state"] == "running" else None

        data = wait_for(retried, timeout=120, what="the retry to run")
        lost, retry = data["attempts"]
        assert (lost["host"], lost["outcome"]) == ("place-1", "lost"), data
        assert retry["host"] == "place-2", data
        assert any(e["reason"] == "claimed by host place-2" and e["attempt"] == 2 for e in data["events"]), data
        second.host.cli("cancel", run_id)
