"""Hold and release a queued run, freeze and thaw a running one (schema 030): the SQL functions, the
claim and the heartbeat around them, sessions racing, and the CLI."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.model import Attempt
from supervisor.outcomes import Outcome
from tests.integration.conftest import fence_of, register, wait_notifies

pytestmark = pytest.mark.usefixtures("as_bound_roles")

WAITED = timedelta(hours=1)


def submit(conn: psycopg.Connection, **values: object) -> uuid.UUID:
    values.setdefault("argv", ["/bin/true"])
    return store.submit_run(conn, **values)


def claim(conn: psycopg.Connection, host: str = "h1") -> list[uuid.UUID]:
    fence = register(conn, host)
    return [run.id for run, _ in store.claim(conn, fence, 10, unitspec.UNIT_NAME_FORMAT)]


def claimable(conn: psycopg.Connection, host: str = "h1") -> bool:
    return store.probe(conn, register(conn, host), WAITED).claimable


def jobs(conn: psycopg.Connection, run_id: uuid.UUID) -> int:
    return conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (run_id,)).fetchone()[0]


def running(conn: psycopg.Connection, host: str = "h1", **values: object) -> tuple[uuid.UUID, Attempt]:
    run_id = submit(conn, **values)
    fence = register(conn, host)
    [(_, attempt)] = store.claim(conn, fence, 1, unitspec.UNIT_NAME_FORMAT)
    store.mark_started(conn, fence, attempt, "inv-" + run_id.hex[:8])
    return run_id, attempt


def reasons(conn: psycopg.Connection, run_id: uuid.UUID) -> list[str]:
    return [e["reason"] for e in store.get_events(conn, run_id, limit=100)]


# -- hold ---------------------------------------------------------------------------------------------


def test_a_run_submitted_held_is_never_claimed_and_says_why(conn: psycopg.Connection) -> None:
    run_id = submit(conn, hold=True)

    run = store.get_run(conn, run_id)
    assert run.state == "queued" and jobs(conn, run_id) == 0
    assert run.wait_reason.startswith("held since ") and f"unitvisor release {run_id}" in run.wait_reason
    held_at, held_by = store.hold_of(conn, run_id)
    assert held_at is not None and held_by in run.wait_reason
    assert store.run_status(conn, run_id).wait_reason == run.wait_reason
    assert reasons(conn, run_id) == [f"submitted, held by {held_by}"]
    assert not claimable(conn) and claim(conn) == []

    assert store.release_run(conn, run_id) == store.Transition("queued", True)
    assert store.get_run(conn, run_id).wait_reason is None and store.hold_of(conn, run_id) == (None, None)
    assert claimable(conn) and claim(conn) == [run_id]
    assert f"released by {held_by}" in reasons(conn, run_id)


def test_hold_takes_a_queued_runs_job_and_release_gives_it_back(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    assert store.hold_run(conn, run_id) == store.Transition("queued", True)
    assert jobs(conn, run_id) == 0 and claim(conn) == []
    # Twice: nothing more happens, and it says so.
    assert store.hold_run(conn, run_id) == store.Transition("queued", False)
    assert store.release_run(conn, run_id) == store.Transition("queued", True)
    assert store.release_run(conn, run_id) == store.Transition("queued", False)
    assert jobs(conn, run_id) == 1 and claim(conn) == [run_id]


def test_hold_of_a_running_or_ended_run_is_refused_by_name(conn: psycopg.Connection) -> None:
    run_id, _ = running(conn)
    with pytest.raises(store.Refused, match=rf"hold: run {run_id} is running; only a queued run can be held "
                                            r"\(freeze a running run instead"):
        store.hold_run(conn, run_id)
    store.cancel_run(conn, run_id)
    ended = submit(conn)
    store.cancel_run(conn, ended)
    with pytest.raises(store.Refused, match="is cancelled; only a queued run can be held"):
        store.hold_run(conn, ended)
    assert store.hold_run(conn, uuid.uuid4()) == store.Transition(None, False)
    assert store.release_run(conn, uuid.uuid4()) == store.Transition(None, False)


def test_a_held_run_at_its_keys_head_blocks_the_key_until_released(conn: psycopg.Connection) -> None:
    """Decided (README, Hold and freeze): a key runs one at a time in submission order; a held run keeps
    its place, so the runs behind it wait, and the claim and the heartbeat agree on it."""
    first = submit(conn, concurrency_key="k", hold=True)
    second = submit(conn, concurrency_key="k")
    other = submit(conn, concurrency_key="other")
    assert claim(conn) == [other]
    assert not claimable(conn)
    store.explain_waiting(conn, timedelta(0))
    assert str(first) in store.get_run(conn, second).wait_reason

    store.release_run(conn, first)
    assert claim(conn) == [first]


def test_a_held_run_still_expires_and_says_it_was_held(conn: psycopg.Connection) -> None:
    run_id = submit(conn, hold=True, start_deadline=store.now(conn) + timedelta(hours=1))
    conn.execute("UPDATE unitvisor.runs SET start_deadline = now() - interval '1 second' WHERE id = %s", (run_id,))
    assert conn.execute("SELECT unitvisor.expire_overdue_runs()").fetchone()[0] == 1
    assert store.get_run(conn, run_id).state == "expired"
    assert "it was waiting for its release: held since" in reasons(conn, run_id)[-1]

    # Resumed: the operator's decision to run it, hold and all.
    assert store.resume_run(conn, run_id).changed
    assert store.hold_of(conn, run_id) == (None, None) and claim(conn) == [run_id]


def test_hold_waits_for_a_claim_in_flight_and_then_refuses(conn: psycopg.Connection, dsn: str) -> None:
    """Two sessions: a claim holds the run's job (its transaction open) while an operator holds the
    run. The hold waits for the claim, then finds the run starting and refuses; never both."""
    run_id = submit(conn)
    fence = register(conn, "h1")
    outcome: list[object] = []
    with store.connect(dsn) as claimer:
        claimer.autocommit = False
        claimed = store.claim(claimer, fence, 1, unitspec.UNIT_NAME_FORMAT)
        assert [r.id for r, _ in claimed] == [run_id]

        def hold() -> None:
            with store.connect(dsn) as operator:
                try:
                    outcome.append(store.hold_run(operator, run_id))
                except store.Refused as exc:
                    outcome.append(exc)

        thread = threading.Thread(target=hold)
        thread.start()
        time.sleep(0.5)
        assert outcome == [], "hold did not wait for the claim's transaction"
        claimer.commit()
        thread.join(10)
    [refused] = outcome
    assert isinstance(refused, store.Refused) and "is starting" in str(refused)
    assert store.hold_of(conn, run_id) == (None, None)


def test_a_hold_in_flight_keeps_a_claim_from_the_run(conn: psycopg.Connection, dsn: str) -> None:
    run_id = submit(conn)
    with store.connect(dsn) as operator:
        operator.autocommit = False
        assert store.hold_run(operator, run_id).changed
        assert claim(conn) == []  # the job is locked (SKIP LOCKED), then gone
        operator.commit()
    assert claim(conn) == [] and store.get_run(conn, run_id).state == "queued"


# -- freeze -------------------------------------------------------------------------------------------


def test_freeze_asks_the_owning_host_and_records_its_answer(conn: psycopg.Connection, dsn: str) -> None:
    run_id, attempt = running(conn)
    fence = fence_of(conn, "h1")
    with store.connect(dsn) as listener:
        store.listen(listener, store.CANCEL_CHANNEL)
        assert store.freeze_run(conn, run_id) == store.Transition("running", True)
        [note] = wait_notifies(listener)
    assert (note.channel, note.payload) == (store.CANCEL_CHANNEL, str(run_id))
    assert store.probe(conn, fence, WAITED).cancels  # the poll's fallback for a lost notification
    [request] = store.freeze_requests(conn, fence)
    assert (request.run_id, request.attempt, request.unit_name, request.wanted) == \
        (run_id, 1, attempt.unit_name, "frozen")
    assert store.freezes_of(conn, run_id)[1]["text"].startswith("freeze requested by ")
    # Asked again before the host acted: the same request.
    assert store.freeze_run(conn, run_id) == store.Transition("running", False)

    assert store.record_freeze(conn, fence, request, "frozen", None)
    assert store.freeze_requests(conn, fence) == [] and not store.probe(conn, fence, WAITED).cancels
    freeze = store.freezes_of(conn, run_id)[1]
    assert (freeze["state"], freeze["pending"], freeze["refused"]) == ("frozen", False, None)
    assert freeze["text"].startswith("frozen since ")
    assert store.freeze_run(conn, run_id) == store.Transition("running", False)  # frozen already
    assert store.get_run(conn, run_id).state == "running"  # it keeps its slot: its attempt stays open

    assert store.thaw_run(conn, run_id).changed
    [thaw] = store.freeze_requests(conn, fence)
    assert thaw.wanted == "thawed"
    assert store.record_freeze(conn, fence, thaw, "thawed", None)
    assert store.freezes_of(conn, run_id)[1]["text"].startswith("thawed since ")
    assert store.thaw_run(conn, run_id) == store.Transition("running", False)


def test_a_refused_freeze_says_so_and_may_be_asked_again(conn: psycopg.Connection) -> None:
    run_id, _ = running(conn)
    fence = fence_of(conn, "h1")
    store.freeze_run(conn, run_id)
    [request] = store.freeze_requests(conn, fence)
    assert store.record_freeze(conn, fence, request, "thawed", "systemd refused: not supported")
    text = store.freezes_of(conn, run_id)[1]["text"]
    assert "freeze refused by its host at " in text and "not supported (the unit is thawed)" in text
    assert any("freeze refused" in r for r in reasons(conn, run_id))
    assert store.freeze_run(conn, run_id).changed  # not frozen: asking again is a new request


def test_a_request_made_while_the_host_acts_stays_pending(conn: psycopg.Connection, dsn: str) -> None:
    run_id, _ = running(conn)
    fence = fence_of(conn, "h1")
    store.freeze_run(conn, run_id)
    [freeze] = store.freeze_requests(conn, fence)
    with store.connect(dsn) as other:  # a later transaction: a later now()
        store.thaw_run(other, run_id)
    assert store.record_freeze(conn, fence, freeze, "frozen", None)
    [thaw] = store.freeze_requests(conn, fence)
    assert thaw.wanted == "thawed"


def test_freeze_of_a_run_that_is_not_running_is_refused_by_name(conn: psycopg.Connection) -> None:
    queued = submit(conn)
    with pytest.raises(store.Refused, match=rf"freeze: run {queued} is queued; only a running run can be frozen "
                                            r"\(hold a queued run instead"):
        store.freeze_run(conn, queued)
    with pytest.raises(store.Refused, match="thaw: run .* is queued; only a running run can be thawed"):
        store.thaw_run(conn, queued)
    assert store.freeze_run(conn, uuid.uuid4()) == store.Transition(None, False)


def test_only_the_owning_host_answers_a_freeze(conn: psycopg.Connection) -> None:
    run_id, _ = running(conn, "h1")
    store.freeze_run(conn, run_id)
    [request] = store.freeze_requests(conn, fence_of(conn, "h1"))
    other = register(conn, "h2")
    assert store.freeze_requests(conn, other) == []
    assert not store.record_freeze(conn, other, request, "frozen", None)
    assert store.freezes_of(conn, run_id)[1]["pending"]
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="state: must be frozen or thawed"):
        store.record_freeze(conn, fence_of(conn, "h1"), request, "paused", None)


# -- cancelling a frozen run ----------------------------------------------------------------------
#
# A cancel is a stop, whatever the unit's freezer state: systemd thaws a frozen unit before it stops it
# ("Unit is automatically thawed just before we execute a job against the unit, e.g. before the unit
# is stopped", systemctl(1), freeze; unit_stop() in src/core/unit.c). So the database asks the host to
# stop the run as it does any running one, and the daemon answers a freeze still pending on a run
# being cancelled without freezing it (supervisor/freezer.py).

CANCELLED = Outcome("cancelled", "signal:TERM", "cancelled by request")


def stopping(conn: psycopg.Connection, host: str = "h1") -> list[uuid.UUID]:
    """The runs the host's cancel pass stops (the daemon's open_attempts(cancel_requested=True))."""
    return [a.run_id for _, a in store.open_attempts(conn, host, cancel_requested=True)]


def test_cancel_of_a_frozen_run_asks_its_host_to_stop_it(conn: psycopg.Connection, dsn: str) -> None:
    run_id, attempt = running(conn)
    fence = fence_of(conn, "h1")
    store.freeze_run(conn, run_id)
    [request] = store.freeze_requests(conn, fence)
    assert store.record_freeze(conn, fence, request, "frozen", None)

    with store.connect(dsn) as listener:
        store.listen(listener, store.CANCEL_CHANNEL)
        assert store.cancel_run(conn, run_id) == store.Transition("running", True)
        [note] = wait_notifies(listener)
    assert note.payload == str(run_id)
    assert store.probe(conn, fence, WAITED).cancels  # the poll's fallback finds it too
    assert stopping(conn) == [run_id]  # stopped as any running run: frozen or not, it has a unit
    assert store.freeze_requests(conn, fence) == []  # nothing else for the host to do

    # Its unit stopped (thawed by systemd first), the host records the cancel as for any run.
    assert store.record_outcome(conn, fence, attempt, CANCELLED, "cancelled")
    assert store.get_run(conn, run_id).state == "cancelled"
    assert stopping(conn) == [] and not store.probe(conn, fence, WAITED).cancels
    with pytest.raises(store.Refused, match="thaw: run .* is cancelled; only a running run can be thawed"):
        store.thaw_run(conn, run_id)


def test_cancel_of_a_run_whose_freeze_is_pending_is_a_stop_and_the_freeze_is_answered(
        conn: psycopg.Connection) -> None:
    run_id, attempt = running(conn)
    fence = fence_of(conn, "h1")
    store.freeze_run(conn, run_id)
    assert store.cancel_run(conn, run_id) == store.Transition("running", True)

    # The host's one pass after the notification sees both: the stop and the freeze still asked for.
    assert stopping(conn) == [run_id]
    [request] = store.freeze_requests(conn, fence)
    assert request.wanted == "frozen"
    # The daemon answers it without freezing (freezer.answer_for_cancelled): the request is no longer
    # pending, and show says why.
    assert store.record_freeze(conn, fence, request, "thawed", "the run is being cancelled: its unit is "
                               "stopped, not frozen")
    assert store.freeze_requests(conn, fence) == []
    freeze = store.freezes_of(conn, run_id)[1]
    assert not freeze["pending"] and "the run is being cancelled" in freeze["text"]

    assert store.record_outcome(conn, fence, attempt, CANCELLED, "cancelled")
    assert store.get_run(conn, run_id).state == "cancelled"
    with pytest.raises(store.Refused, match="freeze: run .* is cancelled; only a running run can be frozen"):
        store.freeze_run(conn, run_id)


def test_a_freeze_asked_after_the_cancel_is_still_taken(conn: psycopg.Connection) -> None:
    """What the database does today (schema 30): freeze_run does not look at cancel_requested_at, so a
    freeze of a run being stopped is written and waits for its host, which answers it as above. Kept
    here so that a migration that refuses it changes this test on purpose."""
    run_id, _ = running(conn)
    store.cancel_run(conn, run_id)
    assert store.freeze_run(conn, run_id) == store.Transition("running", True)
    [request] = store.freeze_requests(conn, fence_of(conn, "h1"))
    assert request.run_id == run_id


# -- the CLI ------------------------------------------------------------------------------------------


def test_cli_hold_release_and_freeze_refusal(conn: psycopg.Connection, dsn: str, cli) -> None:
    result = cli("submit", "--hold", "--", "/bin/true", dsn=dsn)
    assert result.returncode == 0, result.stderr
    run_id = result.stdout.strip()

    listed = json.loads(cli("runs", "--held", "--json", dsn=dsn).stdout)
    assert [r["id"] for r in listed] == [run_id] and listed[0]["held_at"]
    assert listed[0]["wait_reason"].startswith("held since ")
    shown = json.loads(cli("show", run_id, "--json", dsn=dsn).stdout)
    assert shown["held"]["by"] and shown["wait_reason"].startswith("held since ")
    assert "waiting:   held since " in cli("show", run_id, dsn=dsn).stdout

    refused = cli("freeze", run_id, dsn=dsn)
    assert refused.returncode == 1
    assert f"freeze: run {run_id} is queued; only a running run can be frozen" in refused.stderr

    released = json.loads(cli("release", run_id, "--json", dsn=dsn).stdout)
    assert released == {"id": run_id, "state": "queued", "changed": True}
    assert json.loads(cli("runs", "--held", "--json", dsn=dsn).stdout) == []
    again = cli("release", run_id, dsn=dsn)
    assert again.returncode == 1 and "is not held (queued); nothing to release" in again.stderr
    assert cli("hold", run_id, dsn=dsn).stdout.strip() == f"run {run_id} held"
