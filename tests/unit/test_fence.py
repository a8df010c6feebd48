"""supervisor.fence: the lease, the decision, and one round of the fence with systemd mocked at its
boundary. The files go to a temporary directory (tests/unit/conftest.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest

from supervisor import fence
from supervisor.config import ConfigError, DaemonSettings, FleetSettings, Settings, SystemdSettings
from supervisor.fence import Fence, Lease
from supervisor.systemd import SystemdError, SystemdUnavailable, UnitBrief

BOOT = "d18df450-22ee-4b4a-ae5d-2c412e798a3f"
RUNNING = UnitBrief("active", "running", False)
A, B, C = (f"unitvisor-run-{x * 8}-aaaa-bbbb-cccc-{x * 12}-1.service" for x in "abc")


def settings(fencing: bool = True, dead_after: float = 60.0, grace: float = 10.0, poll: float = 10.0) -> Settings:
    return dataclasses.replace(Settings(), daemon=DaemonSettings(poll_interval=poll),
                               systemd=SystemdSettings(stop_grace=grace),
                               fleet=FleetSettings(host_dead_after=dead_after, stop_runs_when_cut_off=fencing))


# -- the pure decision ------------------------------------------------------------------------------

@pytest.mark.parametrize(("lease", "now", "expected"), [
    (None, 1e9, False),  # no lease: the fence provides one first (below), never stops on nothing
    (Lease(100.0, True, BOOT), 99.9, False),
    (Lease(100.0, True, BOOT), 100.0, True),
    (Lease(100.0, True, BOOT), 1e9, True),
    (Lease(100.0, False, BOOT), 1e9, False),  # stop_runs_when_cut_off off: runs keep running, ever
])
def test_expired(lease, now, expected):
    assert fence.expired(lease, now) is expected


def test_the_daemons_lease_ends_cut_off_after_its_heartbeat_was_sent():
    """host_dead_after - stop_grace - 2 s after the send: the stop (SIGKILL after stop_grace) is over
    2 s before any peer may declare the host dead, counted from the heartbeat's later commit."""
    assert fence.daemon_lease(settings(), 1000.0, BOOT) == Lease(1048.0, True, BOOT, "daemon")
    assert fence.daemon_lease(settings(False, 6, 1, 1), 5.0, BOOT) == Lease(8.0, False, BOOT, "daemon")


def test_a_provisional_lease_assumes_the_last_heartbeat_came_a_poll_interval_before():
    assert fence.provisional_lease(settings(), 1000.0, BOOT) == Lease(1038.0, True, BOOT, "fence")
    assert fence.provisional_lease(settings(False), 1000.0, BOOT).fencing is False


def test_to_stop_takes_units_whose_process_may_run_and_not_yet_stopped():
    units = {A: RUNNING, B: UnitBrief("deactivating", "stop-sigterm", True), C: UnitBrief("failed", "failed", False),
             "unitvisor-run-d-1.service": UnitBrief("active", "exited", False),
             "unitvisor-run-e-1.service": UnitBrief("activating", "start", True)}
    assert fence.to_stop(units, fenced=[]) == [A, B, "unitvisor-run-e-1.service"]
    assert fence.to_stop(units, fenced=[A, B]) == ["unitvisor-run-e-1.service"]


# -- the files --------------------------------------------------------------------------------------

def test_a_lease_round_trips_and_is_replaced_atomically(runtime_directory):
    fence.write_lease(Lease(1.5, True, BOOT))
    fence.write_lease(Lease(2.5, False, BOOT))
    assert fence.read_lease(BOOT) == Lease(2.5, False, BOOT)
    assert sorted(p.name for p in runtime_directory.iterdir()) == ["lease"]  # no temporary file left
    assert oct(runtime_directory.stat().st_mode & 0o777) == "0o700"


def test_a_provided_lease_never_replaces_one(runtime_directory):
    assert fence.provide_lease(Lease(1.0, True, BOOT, "fence")) is True
    assert fence.provide_lease(Lease(9.0, True, BOOT, "fence")) is False
    assert fence.read_lease(BOOT) == Lease(1.0, True, BOOT, "fence")
    assert sorted(p.name for p in runtime_directory.iterdir()) == ["lease"]


@pytest.mark.parametrize("text", [b"", b"{", b'{"deadline": 1}', b'{"deadline": "x", "fencing": true, "boot_id": "b"}',
                                  b'{"deadline": 1, "fencing": "yes", "boot_id": "b"}',
                                  b'{"deadline": 1, "fencing": true, "boot_id": "another boot"}'])
def test_a_lease_that_is_not_one_of_this_boot_is_no_lease_and_is_removed(runtime_directory, text):
    (runtime_directory).mkdir()
    (runtime_directory / "lease").write_bytes(text)
    assert fence.read_lease(BOOT) is None
    assert not (runtime_directory / "lease").exists()


def test_fenced_units_are_mirrored_by_files_that_a_settlement_removes(runtime_directory):
    fence.record_fenced(A)
    fence.record_fenced(B)
    units = fence.FencedUnits()
    assert units == set()
    units.refresh()
    assert units == {A, B}
    units.discard(A)  # what the reconciler does once the attempt's outcome is recorded
    units.discard("unitvisor-run-never-1.service")
    assert fence.fenced_units() == {B}
    units.refresh()
    assert units == {B}  # not read back


def test_fence_records_that_cannot_be_read_are_said_once_and_checked(runtime_directory, mocker):
    """Not "none stopped": a guess that would settle a cut-off run as killed. Said once, until read again."""
    fence.record_fenced(A)
    events = mocker.patch("supervisor.fence.event")
    units = fence.FencedUnits()
    units.check()
    with mock.patch.object(Path, "iterdir", side_effect=PermissionError(13, "Permission denied")):
        with pytest.raises(fence.RecordsUnreadable, match="cannot read the fence's records in .*: Permission denied"):
            fence.fenced_units()
        units.refresh()
        units.refresh()
    assert units == set() and units.unreadable is not None
    with pytest.raises(fence.RecordsUnreadable, match="Permission denied"):
        units.check()
    ((args, kwargs),) = [(c.args, c.kwargs) for c in events.call_args_list]
    assert args == ("fence-records-unreadable",) and "Permission denied" in kwargs["detail"]
    units.refresh()
    assert units == {A} and units.unreadable is None
    units.check()


# -- one round of the fence -------------------------------------------------------------------------

@pytest.fixture
def bus():
    systemd = mock.Mock(connected=True)
    systemd.list_units.return_value = {A: RUNNING, B: RUNNING}
    systemd.stop.return_value = True
    return systemd


@pytest.fixture
def clock(mocker):
    now = mock.Mock(return_value=1000.0)
    mocker.patch.object(fence, "boottime", now)
    return now


@pytest.fixture
def events(mocker):
    return mocker.patch.object(fence, "event")


def make(bus, config=settings) -> Fence:
    return Fence(config, systemd=bus, boot_id=BOOT)


def names(events) -> list[str]:
    return [c.args[0] for c in events.call_args_list]


def test_a_live_lease_stops_nothing_and_lists_nothing(bus, clock):
    fence.write_lease(Lease(1001.0, True, BOOT))
    assert make(bus).check(1000.0) == []
    bus.list_units.assert_not_called()
    bus.stop.assert_not_called()


def test_an_expired_lease_stops_every_run_once_records_it_and_says_so_per_run(bus, clock, events):
    fence.write_lease(Lease(990.0, True, BOOT))
    f = make(bus)
    assert f.check(1000.0) == [A, B]
    assert [c.args[0] for c in bus.stop.call_args_list] == [A, B]
    bus.list_units.assert_called_with("unitvisor-run-*.service")
    assert fence.fenced_units() == {A, B}
    assert names(events) == ["fenced", "fenced"]
    assert events.call_args_list[0].kwargs["unit"] == A
    assert events.call_args_list[0].kwargs["run"] == A.removeprefix("unitvisor-run-")[:36]
    # Still stopping (PID 1's stop job), or stopped: nothing again, not even a journal line.
    assert f.check(1000.5) == []
    assert bus.stop.call_count == 2 and names(events) == ["fenced", "fenced"]


def test_an_expired_lease_with_fencing_off_stops_nothing(bus, clock):
    fence.write_lease(Lease(0.0, False, BOOT))
    assert make(bus).check(1e9) == []
    bus.stop.assert_not_called()


def test_a_lease_renewed_during_the_round_stops_no_further_unit(bus, clock):
    fence.write_lease(Lease(990.0, True, BOOT))

    def renew(name):
        fence.write_lease(Lease(1100.0, True, BOOT))  # the daemon got its heartbeat through meanwhile
        return True
    bus.stop.side_effect = renew
    assert make(bus).check(1000.0) == [A]
    assert fence.fenced_units() == {A}  # settled `lost` by the daemon: safe, if needless


def test_a_unit_gone_before_its_stop_is_not_recorded(bus, clock):
    fence.write_lease(Lease(990.0, True, BOOT))
    bus.stop.side_effect = lambda name: name != A
    assert make(bus).check(1000.0) == [B]
    assert fence.fenced_units() == {B}


def test_one_units_refusal_does_not_keep_the_others_running(bus, clock, events):
    fence.write_lease(Lease(990.0, True, BOOT))
    bus.stop.side_effect = [SystemdError("StopUnit: Transaction is destructive"), True]
    assert make(bus).check(1000.0) == [B]
    assert names(events) == ["fence-stop-failed", "fenced"]


def test_a_lost_bus_leaves_no_record_of_a_stop_that_did_not_happen(bus, clock):
    fence.write_lease(Lease(990.0, True, BOOT))
    bus.stop.side_effect = SystemdUnavailable("not reachable")
    with pytest.raises(SystemdUnavailable):
        make(bus).check(1000.0)
    assert fence.fenced_units() == set()


# -- no lease while runs exist (module docstring) ----------------------------------------------------

def test_no_lease_and_no_run_provides_nothing(bus, clock):
    bus.list_units.return_value = {C: UnitBrief("failed", "failed", False)}
    assert make(bus).check(1000.0) == []
    assert fence.read_lease(BOOT) is None


def test_no_lease_while_runs_exist_provides_one_then_stops_them_when_it_expires(bus, clock, events):
    f = make(bus)
    assert f.check(1000.0) == []
    assert fence.read_lease(BOOT) == Lease(1038.0, True, BOOT, "fence")
    assert names(events) == ["lease-provided"]
    # A fence restarted meanwhile does not push the deadline on: the lease is in the file.
    assert make(bus).check(1037.9) == []
    bus.stop.assert_not_called()
    clock.return_value = 1038.0
    assert make(bus).check(1038.0) == [A, B]


def test_no_lease_is_never_provided_over_the_daemons(bus, clock):
    f = make(bus)
    real = fence.provide_lease

    def daemon_first(lease, path=None):
        fence.write_lease(Lease(2000.0, True, BOOT))
        return real(lease, path)
    with mock.patch.object(fence, "provide_lease", daemon_first):
        f.check(1000.0)
    assert fence.read_lease(BOOT) == Lease(2000.0, True, BOOT, "daemon")


def test_no_lease_and_no_readable_configuration_stops_nothing_and_says_so_once(bus, clock, events):
    def broken() -> Settings:
        raise ConfigError("/etc/unitvisor/unitvisor.toml: line 3: expected '='")
    f = make(bus, broken)
    for now in (1000.0, 1000.5, 2000.0):
        assert f.check(now) == []
    assert fence.read_lease(BOOT) is None
    assert names(events) == ["fence-trouble"]
    assert "stopping nothing" in events.call_args.kwargs["detail"]


# -- the service loop -------------------------------------------------------------------------------

def test_run_goes_on_after_a_lost_bus_and_reconnects(bus, clock, mocker, events):
    f = make(bus)
    mocker.patch.object(fence, "signal")
    sleep = mocker.patch.object(fence.time, "sleep")
    rounds = [SystemdUnavailable("not reachable"), RuntimeError("odd"), []]

    def check(now):
        outcome = rounds.pop(0)
        if not rounds:
            f.stopping = True
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    f.check = check
    assert f.run() == 0
    assert sleep.call_count == 3
    bus.close.assert_called()
    assert names(events) == ["fence-starting", "fence-trouble", "fence-trouble"]


def test_the_stopping_message_says_what_happens_to_runs_left_running():
    on = fence.cut_off_status(settings(True), 2)
    assert "2 run(s)" in on and "48s" in on and "unitvisor-fence stops them" in on
    off = fence.cut_off_status(settings(False), 2)
    assert "60s (host_dead_after)" in off and "may run again" in off and "stop_runs_when_cut_off" in off


def test_unit_names_give_their_run_id():
    assert fence.unitspec_run_id(A) == A.removeprefix("unitvisor-run-")[:36]
    assert fence.unitspec_run_id("unitvisor-run-x.service") is None


def test_the_lease_lives_in_the_daemons_runtime_directory():
    from supervisor import runenv
    assert Path("/run/unitvisor") == runenv.RUNTIME_DIRECTORY
