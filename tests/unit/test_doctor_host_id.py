"""doctor's host id check: the same rule register_host applies, so that doctor never calls an id free
that the database would refuse, nor busy one it would give."""

from __future__ import annotations

import pytest

from supervisor.doctor import host_id_check


def row(**values):
    base = {"state": "active", "instance": "theirs", "heartbeat_age": 1.0, "poll_interval_sec": 10.0,
            "dead_after_sec": 60.0, "epoch": 7, "conflict_age": None, "conflict_detail": None, "dead_reason": None}
    return base | values


def test_an_unregistered_id_is_fine():
    assert host_id_check("h1", None, "mine").status == "ok"


@pytest.mark.parametrize(("age", "dead_after", "status"), [
    (1.0, 60.0, "fail"),
    (45.0, 60.0, "fail"),    # past 3 polls but within host_dead_after: register_host still refuses it
    (59.0, 60.0, "fail"),
    (61.0, 60.0, "ok"),      # silent past its host_dead_after: registering takes it over
    (100.0, None, "ok"),     # no value registered: the database's default of 60 s
    (50.0, None, "fail"),
])
def test_another_instance_holds_the_id_while_heard_from_within_its_host_dead_after(age, dead_after, status):
    check = host_id_check("h1", row(heartbeat_age=age, dead_after_sec=dead_after), "mine")
    assert check.status == status, check


def test_our_own_instance_is_fine():
    assert host_id_check("h1", row(instance="mine"), "mine").status == "ok"


def test_a_dead_host_warns():
    assert host_id_check("h1", row(state="dead", heartbeat_age=500.0, dead_reason="silent"), "mine").status == "warn"


@pytest.mark.parametrize(("state", "in_flight", "age", "status"), [
    ("stopped", 1, 5.0, "warn"),    # a restart or a reboot with runs open: held until host_dead_after
    ("stopped", 1, 61.0, "ok"),     # silent past it: registering takes it over
    ("stopped", 0, 5.0, "ok"),      # stopped with nothing open: anyone's at once
    ("dead", 0, 5.0, "warn"),       # declared dead: its attempts were settled
])
def test_another_instance_holds_a_stopped_host_with_runs_open(state, in_flight, age, status):
    check = host_id_check("h1", row(state=state, in_flight=in_flight, heartbeat_age=age, dead_reason="silent"),
                          "mine")
    assert check.status == status, check
    if status == "warn" and state == "stopped":
        assert "held by instance theirs" in check.message and "in 55s" in check.message
