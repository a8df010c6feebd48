"""The daemon's River steps (issue 26) at the unit level, the database and systemd mocked at their
boundary as in test_daemon.py: River's notifications as hints, the schema check at connect, and when
the loop claims River jobs."""

from __future__ import annotations

import dataclasses
import uuid
from unittest import mock

import psycopg
import pytest

from supervisor import daemon as daemon_mod
from supervisor import pressure, riversource, store
from supervisor.config import RiverSettings
from supervisor.reconciler import Reconciler
from supervisor.systemd import Systemd
from tests.unit.test_daemon import boundaries, events, make, make_settings, psi, statuses  # noqa: F401 (fixtures)

RIVER = RiverSettings(schema="platform", queues=("spawn",), kinds=("tm_spawn_run",), spec_function="p.spec")


def river_settings(river: RiverSettings = RIVER):
    return dataclasses.replace(make_settings(), river=river)


@pytest.fixture
def served(make):  # noqa: F811
    """A connected daemon serving a River source whose schema it checked."""
    d = make(river_settings())
    d.reconciler = mock.Mock(river_ready=True, in_flight=0)
    return d


# -- River's notifications -------------------------------------------------------------------------------


@pytest.mark.parametrize(("channel", "payload", "noted"), [
    ("platform.river_insert", '{"queue": "spawn"}', {daemon_mod.RIVER_CLAIM}),
    ("platform.river_insert", '{"queue": "default"}', set()),  # a queue this host does not serve
    ("platform.river_insert", "garbage", set()),
    ("platform.river_control", '{"action": "cancel", "job_id": 3, "queue": "spawn"}', {daemon_mod.RIVER_FINISH}),
    ("platform.river_control", '{"action": "pause", "queue": "*"}', set()),
    ("platform.river_leadership", '{"action": "resigned"}', set()),
    ("other.river_insert", '{"queue": "spawn"}', {"other.river_insert"}),  # not River's schema: as any channel
])
def test_rivers_notifications_are_hints_for_the_queues_served(served, channel, payload, noted) -> None:
    served._heard(channel, payload)
    assert served.notified == noted


def test_without_river_a_river_channel_is_nothing_special(make) -> None:  # noqa: F811
    d = make()
    d._heard("platform.river_insert", '{"queue": "spawn"}')
    assert d.notified == {"platform.river_insert"}


# -- the schema check at connect -------------------------------------------------------------------------


def test_an_unknown_river_version_is_refused_said_once_and_not_listened_to(make, events, mocker) -> None:  # noqa: F811
    d = make(river_settings())
    mocker.patch.object(store, "river_grant", return_value=("uv_web_1", True))
    mocker.patch.object(store, "river_versions", return_value=[1, 2, 3, 4, 5, 6, 7, 8])
    listen = mocker.patch.object(store, "listen")
    d._check_river()
    d._check_river()
    assert "River schema version 8 is not one this unitvisor knows" in d.river_problem
    assert [c.args[0] for c in events.call_args_list].count("river-refused") == 1
    listen.assert_not_called()
    d._status()
    assert "River source: [river] schema platform: River schema version 8" in statuses(d)[-1]


def test_a_known_river_version_is_listened_to(make, mocker) -> None:  # noqa: F811
    d = make(river_settings())
    mocker.patch.object(store, "river_grant", return_value=("uv_web_1", True))
    mocker.patch.object(store, "river_versions", return_value=[1, 2, 3, 4, 5, 6, 7])
    listen = mocker.patch.object(store, "listen")
    d._check_river()
    assert d.river_problem == ""
    listen.assert_called_once_with(d.conn, "platform.river_insert", "platform.river_control")


def test_a_role_without_unitvisor_river_is_a_problem_said_at_connect_and_not_listened_to(make, events,  # noqa: F811
                                                                                         mocker) -> None:
    """Schema 34: a River host's role must be a member of unitvisor_river; without it the daemon says so
    (journal and status), serves no River job, and goes on with its own runs (the problem is no error)."""
    d = make(river_settings())
    mocker.patch.object(store, "river_grant", return_value=("uv_web_1", False))
    versions = mocker.patch.object(store, "river_versions")
    listen = mocker.patch.object(store, "listen")
    d._check_river()
    assert d.river_problem == ("[river]: role uv_web_1 is not a member of unitvisor_river, which may create runs "
                               "from River jobs: GRANT unitvisor_river TO uv_web_1 (docs/river.md, Privileges)")
    assert [c.args[0] for c in events.call_args_list].count("river-refused") == 1
    versions.assert_not_called()
    listen.assert_not_called()
    d._status()
    assert "River source: [river]: role uv_web_1 is not a member of unitvisor_river" in statuses(d)[-1]


def test_without_river_nothing_is_checked(make, mocker) -> None:  # noqa: F811
    versions = mocker.patch.object(store, "river_versions")
    make()._check_river()
    versions.assert_not_called()


# -- when the loop claims River jobs ---------------------------------------------------------------------


def claimed(made: bool) -> list[store.RiverClaim]:
    return [store.RiverClaim(1, 1, uuid.uuid4() if made else None, None if made else "refused")]


@pytest.mark.parametrize(("made", "result"), [(True, True), (False, False)])
def test_a_claim_says_whether_it_made_runs(served, mocker, made, result) -> None:
    claim = mocker.patch.object(riversource, "claim", return_value=claimed(made))
    assert served._river_claim() is result
    claim.assert_called_once_with(served.conn, served.fence, RIVER, served.settings.daemon.claim_batch)


def test_a_claim_takes_no_more_than_the_free_slots(served, mocker) -> None:
    served.reconciler.in_flight = served.settings.host.max_runs - 2
    claim = mocker.patch.object(riversource, "claim", return_value=[])
    served._river_claim()
    assert claim.call_args.args[3] == 2


@pytest.mark.parametrize("state", ["draining", "stopping", "not root", "pressure", "not ready"])
def test_no_river_claim_when_this_host_would_claim_nothing(served, mocker, state) -> None:
    claim = mocker.patch.object(riversource, "claim")
    if state == "draining":
        served.host_state = "draining"
    elif state == "stopping":
        served.stopping = True
    elif state == "not root":
        served.is_root = False
    elif state == "pressure":
        served.admission = pressure.Admission(pressure.STOPPED, "memory")
    else:
        served.reconciler.river_ready = False
    assert served._river_claim() is False
    claim.assert_not_called()


def test_a_misconfigured_platform_is_said_and_tried_again(served, mocker, events) -> None:  # noqa: F811
    mocker.patch.object(riversource, "claim", side_effect=store.RiverMisconfigured("River source: permission denied"))
    assert served._river_claim() is False
    assert served._river_claim() is False
    assert served.river_problem == "River source: permission denied"
    assert [c.args[0] for c in events.call_args_list].count("river-refused") == 1
    mocker.patch.object(riversource, "claim", return_value=[])
    served._river_claim()
    assert served.river_problem == ""


# -- the reconciler's finish: River's tables never stop this host's own work ------------------------------


def river_reconciler(ready: bool = True) -> Reconciler:
    rec = Reconciler(river_settings(), store.Fence("h1", 4), mock.Mock(), mock.Mock(spec=Systemd))
    rec.river_ready = ready
    return rec


def test_the_finish_is_skipped_while_river_is_not_ready(mocker) -> None:
    finish = mocker.patch.object(riversource, "finish_held")
    assert river_reconciler(ready=False).finish_river_jobs() == []
    finish.assert_not_called()


def test_a_river_error_in_the_finish_is_said_and_contained(mocker) -> None:
    said = mocker.patch("supervisor.reconciler.event")
    mocker.patch.object(riversource, "finish_held", side_effect=psycopg.errors.InsufficientPrivilege("no"))
    assert river_reconciler().finish_river_jobs() == []
    assert said.call_args.args[0] == "river-finish-failed"


@pytest.mark.parametrize("lost", [store.Fenced("epoch over"), store.CONNECTION_LOST[1]("gone")])
def test_a_lost_connection_or_a_fence_is_the_loops(mocker, lost) -> None:
    mocker.patch.object(riversource, "finish_held", side_effect=lost)
    with pytest.raises(type(lost)):
        river_reconciler().finish_river_jobs()
