"""The River source's pure decisions (supervisor/river.py) and its [river] settings, exhaustively."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from supervisor import river
from supervisor.config import ConfigError, RiverSettings, parse
from supervisor.model import RUN_STATES
from supervisor.river import Decision, Finish, HeldJob, LinkedRun, decide_finish

HELD = HeldJob(job_id=7, attempt=1, cancel_attempted=False)
CANCELLED = HeldJob(job_id=7, attempt=1, cancel_attempted=True)
STATES = RUN_STATES


def linked(state: str, started: bool, reason: str | None = None) -> LinkedRun:
    return LinkedRun(run_id="r-1", state=state, started=started, reason=reason)


# -- decide_finish: every (cancel asked, run state, started) -------------------------------------------------


@pytest.mark.parametrize("job", [HELD, CANCELLED])
@pytest.mark.parametrize("state", STATES)
def test_a_started_run_completes_its_job_whatever_happens_next(job: HeldJob, state: str) -> None:
    assert decide_finish(job, linked(state, started=True)) == Decision(Finish.COMPLETED)


@pytest.mark.parametrize("state", ["queued", "starting"])
def test_a_run_not_yet_started_keeps_its_job_held(state: str) -> None:
    assert decide_finish(HELD, linked(state, started=False)) == river.WAIT


@pytest.mark.parametrize("state", ["failed", "cancelled", "expired", "succeeded", "skipped"])
def test_a_run_ended_without_starting_discards_its_job_with_the_reason(state: str) -> None:
    decision = decide_finish(HELD, linked(state, started=False, reason="systemd refused the unit"))
    assert decision == Decision(Finish.DISCARDED,
                                f"unitvisor run r-1 ended {state} without starting: systemd refused the unit")


def test_an_ended_run_without_a_reason_still_says_how_it_ended() -> None:
    decision = decide_finish(HELD, linked("expired", started=False))
    assert decision.error == "unitvisor run r-1 ended expired without starting"


@pytest.mark.parametrize("state", ["queued", "starting"])
def test_a_river_cancel_while_held_cancels_the_run_and_the_job(state: str) -> None:
    decision = decide_finish(CANCELLED, linked(state, started=False))
    assert decision == Decision(Finish.CANCELLED, "cancelled through River before unitvisor run r-1 started",
                                cancel_run=True)


@pytest.mark.parametrize("state", ["failed", "cancelled", "expired", "skipped"])
def test_a_river_cancel_of_an_ended_run_only_cancels_the_job(state: str) -> None:
    decision = decide_finish(CANCELLED, linked(state, started=False))
    assert decision.finish == Finish.CANCELLED and not decision.cancel_run


@pytest.mark.parametrize("job", [HELD, CANCELLED])
def test_a_job_without_a_run_is_discarded(job: HeldJob) -> None:
    decision = decide_finish(job, None)
    assert decision.finish == Finish.DISCARDED and "no unitvisor run holds this River job" in decision.error


# -- River's shapes ------------------------------------------------------------------------------------------


def test_attempt_error_is_rivers_attempt_error() -> None:
    at = datetime(2026, 12, 2, 13, 4, 5, 123456, tzinfo=timezone(timedelta(hours=2)))
    assert river.attempt_error(at, 3, "boom") == {
        "at": "2026-12-02T11:04:05.123456Z", "attempt": 3, "error": "boom", "trace": ""}


def test_client_id_is_stable_and_names_the_host() -> None:
    assert river.client_id("h1") == "unitvisor:h1"


def test_channels_are_rivers() -> None:
    assert river.insert_channel("platform") == "platform.river_insert"
    assert river.control_channel("platform") == "platform.river_control"


@pytest.mark.parametrize(("payload", "queue"), [
    ('{"queue": "spawn"}', "spawn"), ('{"queue": 5}', None), ("[]", None), ("not json", None), ("{}", None)])
def test_insert_queue(payload: str, queue: str | None) -> None:
    assert river.insert_queue(payload) == queue


@pytest.mark.parametrize(("payload", "job_id"), [
    ('{"action": "cancel", "job_id": 12, "queue": "q"}', 12),
    ('{"action": "pause", "queue": "q"}', None),
    ('{"action": "cancel", "job_id": "12"}', None),
    ('{"action": "cancel", "job_id": true}', None),
    ("nope", None), ("3", None)])
def test_control_cancel(payload: str, job_id: int | None) -> None:
    assert river.control_cancel(payload) == job_id


@pytest.mark.parametrize(("versions", "words"), [
    (None, "no table river.river_migration; run River's migrations"),
    ([], "has no version of the main line"),
    ([1, 2, 3, 4, 5, 6, 7, 8], "River schema version 8 is not one this unitvisor knows (it knows 6, 7)"),
    ([1, 2, 3, 4, 5], "River schema version 5 is not one this unitvisor knows"),
])
def test_an_unknown_schema_is_refused(versions: list[int] | None, words: str) -> None:
    problem = river.version_problem("river", versions)
    assert problem is not None and words in problem and problem.startswith("[river] schema river:")


@pytest.mark.parametrize("newest", sorted(river.SUPPORTED_VERSIONS))
def test_a_supported_schema_is_served(newest: int) -> None:
    assert river.version_problem("river", list(range(1, newest + 1))) is None


@pytest.mark.parametrize(("sqlstate", "refused"), [
    ("P0001", True),   # the spec function raised
    ("22023", True),   # submit_run_spec refused a key
    ("23514", True),   # submit_run's checks
    ("55000", True),   # placement
    ("23505", True),   # idempotency_key named another run
    ("57014", True),   # the spec function ran past statement_timeout
    ("42883", False),  # no such spec function
    ("42501", False),  # no privilege on it
    ("28000", False),  # authorization
    (None, False),     # not the database's error
    ("", False),
])
def test_which_errors_are_the_jobs(sqlstate: str | None, refused: bool) -> None:
    assert river.refuses_job(sqlstate) is refused


# -- [river] -------------------------------------------------------------------------------------------------

GOOD = {"schema": '"river"', "queues": '["spawn"]', "kinds": '["tm_spawn_run"]',
        "spec_function": '"platform.unitvisor_spec"'}


def river_toml(**values: str | None) -> str:
    keys = {**GOOD, **values}
    return "[river]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items() if v is not None)


def test_river_is_off_by_default() -> None:
    assert parse("").river == RiverSettings() and not RiverSettings().enabled


def test_a_whole_river_section() -> None:
    settings = parse(river_toml()).river
    assert settings == RiverSettings("river", ("spawn",), ("tm_spawn_run",), "platform.unitvisor_spec")
    assert settings.enabled


@pytest.mark.parametrize("missing", sorted(GOOD))
def test_every_key_is_required_once_one_is_set(missing: str) -> None:
    with pytest.raises(ConfigError, match=rf"\[river\] {missing}: required when \[river\] is set"):
        parse(river_toml(**{missing: None}))


@pytest.mark.parametrize(("key", "value", "words"), [
    ("schema", '"River"', r"\[river\] schema: 'River' is not a lower-case SQL name"),
    ("schema", '"a.b"', r"\[river\] schema: 'a.b' is not"),
    ("schema", '"' + "x" * 64 + '"', r"\[river\] schema: 'x+' is not"),
    ("schema", "3", r"\[river\] schema: expected a string"),
    ("spec_function", '"unitvisor_spec"', r"\[river\] spec_function: 'unitvisor_spec' is not a schema-qualified"),
    ("spec_function", '"p.f(x)"', r"\[river\] spec_function: 'p.f\(x\)' is not"),
    ("spec_function", '"p.f; drop table x"', r"\[river\] spec_function: .* is not"),
    ("queues", '[""]', r"\[river\] queues: '' is not a River queue name \(1 to 127"),
    ("queues", '["' + "q" * 128 + '"]', r"\[river\] queues: 'q+' is not a River queue name"),
    ("queues", '["a", "a"]', r"\[river\] queues: a name is listed twice"),
    ("queues", '"spawn"', r"\[river\] queues: expected a list of strings"),
    ("kinds", '["tab\\there"]', r"\[river\] kinds: 'tab\\there' is not a River kind name"),
    ("kinds", "[1]", r"\[river\] kinds: expected a list of strings"),
    ("color", '"red"', r"\[river\] color: unknown key"),
])
def test_a_bad_river_value_names_its_key(key: str, value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse(river_toml(**{key: value}))


def test_now_is_utc_in_errors() -> None:
    stamp = river.attempt_error(datetime(2026, 1, 1, tzinfo=UTC), 1, "x")["at"]
    assert stamp == "2026-01-01T00:00:00.000000Z"
