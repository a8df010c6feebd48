"""supervisor/freezer.py: each pending freeze request carried out through systemd and answered in the
database, a refusal included (a cgroup v1 host), with the database and systemd mocked at their boundary."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime
from unittest import mock

import pytest

from supervisor import freezer, store
from supervisor.systemd import SystemdError, SystemdUnavailable

FENCE = store.Fence("h1", 3)


def request(wanted: str) -> store.FreezeRequest:
    return store.FreezeRequest(uuid.uuid4(), 1, "unitvisor-run-x-1.service", wanted, datetime(2026, 12, 2, tzinfo=UTC))


@pytest.fixture
def st(mocker):
    patched = mocker.patch.object(freezer, "store")
    patched.record_freeze.return_value = True
    return patched


def answers(st) -> list[tuple[str, str | None]]:
    return [(c.args[3], c.args[4]) for c in st.record_freeze.call_args_list]


def test_a_freeze_and_a_thaw_done_are_recorded_and_counted(st) -> None:
    st.freeze_requests.return_value = [request("frozen"), request("thawed")]
    systemd = mock.Mock()
    systemd.freeze.return_value = systemd.thaw.return_value = True
    heard: list[str] = []
    assert freezer.act_on_requests(mock.Mock(), FENCE, systemd, heard.append) == 2
    systemd.freeze.assert_called_once_with("unitvisor-run-x-1.service")
    systemd.thaw.assert_called_once_with("unitvisor-run-x-1.service")
    assert answers(st) == [("frozen", None), ("thawed", None)]
    assert heard == ["frozen", "thawed"]


def test_a_host_that_cannot_freeze_answers_with_systemds_words(st) -> None:
    st.freeze_requests.return_value = [request("frozen")]
    systemd = mock.Mock()
    systemd.freeze.side_effect = SystemdError("FreezeUnit x: Unit freezing is not supported")
    heard: list[str] = []
    freezer.act_on_requests(mock.Mock(), FENCE, systemd, heard.append)
    [(state, refused)] = answers(st)
    assert state == "thawed" and "not supported" in refused and refused.startswith("systemd refused to freeze")
    assert heard == ["refused"]


def test_a_unit_gone_is_a_refusal_and_systemd_out_of_reach_leaves_the_request_pending(st) -> None:
    st.freeze_requests.return_value = [request("thawed")]
    systemd = mock.Mock()
    systemd.thaw.return_value = False
    freezer.act_on_requests(mock.Mock(), FENCE, systemd)
    assert answers(st) == [("frozen", "its unit unitvisor-run-x-1.service is not loaded (the run is ending)")]

    st.record_freeze.reset_mock()
    systemd.thaw.side_effect = SystemdUnavailable("gone")
    with pytest.raises(SystemdUnavailable):
        freezer.act_on_requests(mock.Mock(), FENCE, systemd)
    st.record_freeze.assert_not_called()


# -- a cancel wins over a freeze ----------------------------------------------------------------------


@pytest.mark.parametrize(("wanted", "answer"), [
    ("frozen", ("thawed", freezer.CANCELLED_FREEZE)),  # refused: the unit is being stopped
    ("thawed", ("thawed", None)),  # done: systemd thaws the unit to stop it
])
def test_a_request_on_a_run_being_cancelled_is_answered_for_the_stop(wanted, answer) -> None:
    assert freezer.answer_for_cancelled(wanted) == answer


def test_requests_on_runs_being_cancelled_are_answered_without_systemd_and_not_counted_as_refusals(st, mocker) -> None:
    said = mocker.patch.object(freezer, "event")
    freeze, thaw, other = request("frozen"), request("thawed"), request("frozen")
    st.freeze_requests.return_value = [freeze, thaw, other]
    systemd = mock.Mock()
    systemd.freeze.return_value = True
    heard: list[str] = []
    assert freezer.act_on_requests(mock.Mock(), FENCE, systemd, heard.append,
                                   cancelling={freeze.run_id, thaw.run_id}) == 3
    assert answers(st) == [("thawed", freezer.CANCELLED_FREEZE), ("thawed", None), ("frozen", None)]
    # Only the run that is not being cancelled reached systemd.
    systemd.freeze.assert_called_once_with(other.unit_name)
    systemd.thaw.assert_not_called()
    assert heard == ["thawed", "frozen"]  # the refusal of a cancelled run's freeze is no alert
    [refusal] = [c for c in said.call_args_list if c.args[0] == "freeze-refused"]
    assert refusal.kwargs["level"] == logging.INFO and refusal.kwargs["detail"] == freezer.CANCELLED_FREEZE
