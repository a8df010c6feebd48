"""supervisor/freezer.py: each pending freeze request carried out through systemd and answered in the
database, a refusal included (a cgroup v1 host), with the database and systemd mocked at their boundary."""

from __future__ import annotations

import logging
import re
import uuid
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

import pytest

from supervisor import freezer, store
from supervisor.systemd import Systemd, SystemdError, SystemdUnavailable

FENCE = store.Fence("h1", 3)
DOCS = Path(__file__).resolve().parents[2] / "docs"


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


# -- the runtime clock of a frozen run (README, Hold and freeze) ---------------------------------------


def test_freeze_and_thaw_leave_the_runtime_clock_alone(st) -> None:
    """Decided: a frozen run's runtime clock counts on. The freezer asks systemd for FreezeUnit and
    ThawUnit and nothing else: no property of the unit (RuntimeMaxUSec) is set to pause or move it."""
    st.freeze_requests.return_value = [request("frozen"), request("thawed")]
    systemd = mock.create_autospec(Systemd, instance=True)
    systemd.freeze.return_value = systemd.thaw.return_value = True
    freezer.act_on_requests(mock.Mock(), FENCE, systemd)
    assert [name for name, _, _ in systemd.mock_calls] == ["freeze", "thaw"]


def test_the_runtime_clock_is_documented_the_same_everywhere() -> None:
    """The decision is said where operators read it: the README, the SQL API and `freeze --help` (in
    docs/cli.md) all say the clock counts on, and that a frozen run is to be thawed or cancelled before
    its runtime is over (systemd's runtime stop does not end it while frozen)."""
    cli = (DOCS / "cli.md").read_text()
    freeze_help = cli.split("## unitvisor freeze", 1)[1].split("## unitvisor", 1)[0]
    for name, text in (("README.md", (DOCS.parent / "README.md").read_text()),
                       ("docs/sql-api.md", (DOCS / "sql-api.md").read_text()), ("freeze --help", freeze_help)):
        flat = " ".join(text.replace("*", "").replace("`", "").split())
        assert "clock counts on" in flat, name
        assert re.search(r"[Tt]haw or cancel (it|a frozen run) before its (--runtime|runtime_max_sec) is over",
                         flat), name
