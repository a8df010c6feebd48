"""supervisor.fleet: who this host is, what it registers, what a dead host's attempt ends with, and how
a host's state reads to an operator. Pure functions: no database, no systemd."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from supervisor import envpolicy, fleet, store
from supervisor.config import DaemonSettings, FleetSettings, HostSettings, RunSettings, Settings
from supervisor.globs import glob_regex
from supervisor.model import Run
from supervisor.outcomes import Outcome

MACHINE = "0123456789abcdef0123456789abcdef"
BOOT = "9f1e0b3c-1234-4d5e-8f00-aabbccddeeff"
RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")


# -- boot and instance ----------------------------------------------------------------------------

def test_boot_id_is_read_and_stripped(tmp_path):
    path = tmp_path / "boot_id"
    path.write_text(BOOT + "\n")
    assert fleet.boot_id(path) == BOOT


def test_boot_id_missing_is_empty(tmp_path):
    assert fleet.boot_id(tmp_path / "absent") == ""


def test_instance_id_is_stable_across_calls_and_releases():
    """The database stores it: a restarted (or upgraded) daemon on the same machine and boot must
    compute the very same value, or it would be refused as a second daemon with its own host id."""
    assert fleet.instance_id(MACHINE, BOOT) == fleet.instance_id(MACHINE, BOOT) == "0688af026674181d"


def test_instance_id_is_16_hex_digits():
    value = fleet.instance_id(MACHINE, BOOT)
    assert len(value) == 16 and int(value, 16) >= 0


@pytest.mark.parametrize(("machine", "boot"), [
    (MACHINE[:-1] + "0", BOOT),  # a cloned image with another machine id
    (MACHINE, BOOT[:-1] + "0"),  # the same machine after a reboot
    ("", BOOT), (MACHINE, ""), ("", ""),
    (MACHINE + BOOT[:1], BOOT[1:]),  # the separator keeps the two fields apart
])
def test_instance_id_differs_when_machine_or_boot_differs(machine, boot):
    assert fleet.instance_id(machine, boot) != fleet.instance_id(MACHINE, BOOT)


# -- the host profile ---------------------------------------------------------------------------

def profile_settings():
    return dataclasses.replace(
        Settings(),
        host=HostSettings(id="web-1", name="web-1.example", max_runs=7, memory_budget=2 << 30),
        daemon=DaemonSettings(poll_interval=15.0),
        fleet=FleetSettings(host_dead_after=75.0),
        runs=RunSettings(allowed_executables=("/usr/bin/*", "/opt/tool-?/run", "/bin/a.b"), user="svc",
                         allowed_users=("alice", "bob"), allowed_environment=("LD_LIBRARY_PATH", "APP_*")))


@pytest.mark.parametrize("is_root", [True, False])
def test_host_profile_carries_what_the_claim_filters_on(is_root):
    settings = profile_settings()
    profile = fleet.host_profile(settings, "1.2.3", "inst", "boot", is_root)
    assert profile == store.HostProfile(
        host_id="web-1", name="web-1.example", instance="inst", max_runs=7, memory_budget=2 << 30,
        version="1.2.3", boot_id="boot",
        allowed_executables=("/usr/bin/*", "/opt/tool-?/run", "/bin/a.b"),
        executable_patterns=(r"^\/usr\/bin\/[^/]*$", r"^\/opt\/tool\-[^/]\/run$", r"^\/bin\/a\.b$"),
        run_user="svc", allowed_users=("alice", "bob"),
        environment_denied=envpolicy.denied_regexes(), environment_names=("LD_LIBRARY_PATH",),
        environment_patterns=(r"^APP\_[^/]*$",),
        can_start=is_root,
        cannot_start_reason=None if is_root else "the daemon is not root; systemd starts units only for root",
        poll_interval=15.0, dead_after=75.0)


def test_host_profile_patterns_are_the_glob_regexes_in_order():
    settings = profile_settings()
    profile = fleet.host_profile(settings, "v", "i", "b", True)
    assert profile.executable_patterns == tuple(glob_regex(p) for p in settings.runs.allowed_executables)
    assert isinstance(profile.executable_patterns, tuple)


def test_host_profile_of_root_can_start():
    profile = fleet.host_profile(profile_settings(), "v", "i", "b", is_root=True)
    assert profile.can_start is True
    assert profile.cannot_start_reason is None


def test_host_profile_without_root_cannot_start_and_says_why():
    profile = fleet.host_profile(profile_settings(), "v", "i", "b", is_root=False)
    assert profile.can_start is False
    assert profile.cannot_start_reason and "not root" in profile.cannot_start_reason


def test_host_profile_with_an_empty_allowlist_registers_no_pattern():
    profile = fleet.host_profile(Settings(host=HostSettings(id="h")), "v", "i", "b", True)
    assert profile.allowed_executables == () and profile.executable_patterns == ()
    assert (profile.poll_interval, profile.dead_after) == (10.0, 60.0)


def test_explain_after_is_two_poll_intervals():
    assert fleet.explain_after(profile_settings()) == timedelta(seconds=30)
    assert fleet.explain_after(Settings()) == timedelta(seconds=20)


def test_reclaim_comes_after_the_spread_grace():
    assert fleet.RECLAIM_AFTER > fleet.SPREAD_GRACE


# -- a dead host's attempts -----------------------------------------------------------------------

DEAD = store.DeadHost(host_id="web-3", silent=75.4, dead_after=60.0)


def test_takeover_outcome_is_lost_naming_the_host_its_silence_and_the_declarer():
    run = Run(id=RUN_ID, argv=["/bin/true"])
    assert fleet.takeover_outcome(run, DEAD, "web-1") == Outcome(
        "lost", None, "host web-3 was silent for 75s (its host_dead_after is 60s); declared dead by host web-1")


def test_takeover_outcome_is_cancelled_when_a_cancel_was_requested():
    run = Run(id=RUN_ID, argv=["/bin/true"], cancel_requested_at=datetime(2024, 5, 1, tzinfo=UTC))
    outcome = fleet.takeover_outcome(run, DEAD, "web-1")
    assert outcome == Outcome("cancelled", None, "cancel requested; host web-3 was silent for 75s (its "
                                                 "host_dead_after is 60s); declared dead by host web-1")


def test_takeover_outcome_shows_fractional_dead_after():
    run = Run(id=RUN_ID, argv=["/bin/true"])
    reason = fleet.takeover_outcome(run, store.DeadHost("h", 31.6, 30.5), "me").reason
    assert "silent for 32s" in reason and "host_dead_after is 30.5s" in reason


@pytest.mark.parametrize("outcome", [
    Outcome("signal", "signal:TERM", "killed by SIGTERM"),
    Outcome("success", "exit:0", "exited 0"),
    Outcome("exit-code", "exit:143", "exited 143"),
    Outcome("lost", None, "the unit disappeared"),
])
def test_cut_off_outcome_is_lost_and_keeps_the_exit_status(outcome):
    assert fleet.cut_off_outcome(outcome, 48.0) == Outcome(
        "lost", outcome.exit_status,
        "stopped by this host after 48s cut off from the database (stop_runs_when_cut_off)")


# -- a host's state for people ------------------------------------------------------------------

def host(state="active", age=1.0, poll=10.0, conflict_age=None):
    return {"state": state, "heartbeat_age": age, "poll_interval_sec": poll, "conflict_age": conflict_age}


@pytest.mark.parametrize(("row", "shown"), [
    (host(), "active"),
    (host(age=20.0), "active"),  # exactly two intervals: not yet
    (host(age=20.01), "active (stale)"),
    (host(age=59.0, poll=30.0), "active"),
    (host(age=61.0, poll=30.0), "active (stale)"),
    (host("draining", age=25.0), "draining (stale)"),
    (host("draining", age=5.0), "draining"),
    (host("dead", age=10_000.0), "dead"),
    (host("stopped", age=10_000.0), "stopped"),
    (host(conflict_age=0.0), "active (conflict)"),
    (host(conflict_age=29.9), "active (conflict)"),
    (host(conflict_age=30.0), "active"),  # three poll intervals after the last refusal: over
    (host(conflict_age=5.0, age=50.0), "active (stale, conflict)"),
    (host("dead", age=10_000.0, conflict_age=1.0), "dead"),
    (host("stopped", age=10_000.0, conflict_age=1.0), "stopped (conflict)"),
    (host("draining", conflict_age=1.0), "draining (conflict)"),
    (host(age=25.0, poll=None), "active (stale)"),  # an old row without a poll interval: 10 s
    (host(age=15.0, poll=None), "active"),
])
def test_host_display_state(row, shown):
    assert fleet.host_display_state(row) == shown


def test_host_display_state_without_conflict_column():
    assert fleet.host_display_state({"state": "active", "heartbeat_age": 1.0}) == "active"


# -- a waiting run names the hosts that hold it (issue 24) ------------------------------------------


def _host(host_id: str, state: str = "active", age: float = 1.0, dead_after: float | None = 60.0) -> dict:
    return {"id": host_id, "state": state, "heartbeat_age": age, "dead_after_sec": dead_after}


def test_a_run_held_by_a_drain_names_the_host() -> None:
    assert fleet.name_the_hosts(fleet.NO_LIVE_HOST, [_host("web-1", "draining")]) == (
        "no live host: host web-1 is draining")


def test_every_host_that_claims_nothing_is_named_with_why() -> None:
    hosts = [_host("a", "dead"), _host("b", "stopped"), _host("c", age=75.0), _host("d", "draining"),
             _host("e", age=30.0, dead_after=None)]
    assert fleet.name_the_hosts(fleet.NO_LIVE_HOST, hosts) == (
        "no live host: host a is dead; host b is stopped; host c has been silent for 1m15s; host d is draining")


def test_a_long_list_is_cut_and_counted() -> None:
    hosts = [_host(f"old-{n}", "dead") for n in range(8)]
    said = fleet.name_the_hosts(fleet.NO_LIVE_HOST, hosts)
    assert said.startswith("no live host: host old-0 is dead; ")
    assert said.endswith("; host old-4 is dead; and 3 more hosts that claim nothing")


def test_no_host_at_all_says_so_and_other_reasons_stay_as_they_are() -> None:
    assert fleet.name_the_hosts(fleet.NO_LIVE_HOST, []) == (
        "no live host: no host has registered (see `unitvisor hosts`)")
    other = "no live host accepts it: executable /bin/sh is not allowed (web-1)"
    assert fleet.name_the_hosts(other, [_host("web-2", "draining")]) == other
    assert fleet.name_the_hosts(None, []) is None
    # The hosts changed since the reason was recorded (one is live now): the database's words stand.
    assert fleet.name_the_hosts(fleet.NO_LIVE_HOST, [_host("web-1")]) == fleet.NO_LIVE_HOST
