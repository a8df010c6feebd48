"""Placement (issue 25, item 4; sql/migrations/033_placement.sql) against the real schema: hosts register
their [host] labels, a run's host_labels decide which hosts claim it (the claim, the heartbeat's probe),
a run no live host matches says why it waits (refusals_now, explain_waiting, `show`, submit's warning),
and a retry prefers another host than the one its last attempt failed on, for avoid_failed_host_grace
only. Each refused value is named. Each test here failed before 033: submit_run had no host_labels."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from supervisor import store, unitspec
from supervisor.model import Attempt
from supervisor.outcomes import Outcome
from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration.conftest import CliResult, age_jobs, host_profile, silence, wait_notifies
from tests.integration.test_sql_api_example import assert_example_prints_its_out

pytestmark = pytest.mark.usefixtures("as_bound_roles")

FMT = unitspec.UNIT_NAME_FORMAT
LOST = Outcome("lost", None, "the host rebooted")
FAILED = Outcome("exit-code", "exit:1", "exited with status 1")
WAITED = timedelta(hours=1)


def host(conn: psycopg.Connection, host_id: str, **labels: str) -> store.Fence:
    """Register host_id with these [host] labels, as its daemon does (store.register_host)."""
    registration = store.register_host(conn, dataclasses.replace(host_profile(host_id), labels=labels))
    assert registration.registered, registration.detail
    return store.Fence(host_id, registration.epoch)


def submit(conn: psycopg.Connection, **values: Any) -> uuid.UUID:
    return store.submit_run(conn, argv=["/bin/true"], **values)


def claim(conn: psycopg.Connection, fence: store.Fence) -> list[uuid.UUID]:
    return [attempt.run_id for _, attempt in store.claim(conn, fence, 10, FMT)]


def claimable(conn: psycopg.Connection, fence: store.Fence) -> bool:
    return store.probe(conn, fence, WAITED).claimable


def started(conn: psycopg.Connection, fence: store.Fence, run_id: uuid.UUID) -> Attempt:
    age_jobs(conn, 30)
    [(_, attempt)] = store.claim(conn, fence, 1, FMT)
    assert attempt.run_id == run_id
    store.mark_started(conn, fence, attempt, f"inv-{run_id.hex[:8]}-{attempt.attempt}")
    return attempt


def ended(conn: psycopg.Connection, fence: store.Fence, attempt: Attempt, outcome: Outcome) -> None:
    """The attempt's own host records how it ended; the run's policy retries it at once."""
    assert store.record_outcome(conn, fence, attempt, outcome, "queued", timedelta(0))
    assert store.get_run(conn, attempt.run_id).state == "queued"


def avoid_host(conn: psycopg.Connection, run_id: uuid.UUID) -> str | None:
    return conn.execute("SELECT avoid_host FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (run_id,)).fetchone()[0]


def last_event(conn: psycopg.Connection, run_id: uuid.UUID) -> str:
    return store.get_events(conn, run_id)[-1]["reason"]


# -- host labels ---------------------------------------------------------------------------------------


def test_a_host_registers_its_labels_and_they_last_as_long_as_its_registration(conn: psycopg.Connection) -> None:
    host(conn, "h1", zone="a", disk="ssd")
    [row] = store.list_hosts(conn)
    assert row["labels"] == {"zone": "a", "disk": "ssd"}
    # A daemon without placement (0.9.0) registers again and no labels: its host has none, not stale ones.
    conn.execute("""SELECT unitvisor.register_host('h1', 'box-h1', 'inst-h1', 10, NULL, '0.9.0', 'boot', '{/*}',
                        '{^/[^/]*$}', '', '{}', true, NULL, 10, 60)""")
    assert store.list_hosts(conn)[0]["labels"] == {}
    run_id = submit(conn, host_labels={"zone": "a"})
    assert "has no label zone=a (h1)" in store.fleet_refusals(conn, [run_id])[run_id]


@pytest.mark.parametrize("labels", [["zone"], {"zone": 1}, {"-zone": "a"}, {"k" * 64: "a"}, {"zone": "a\nb"},
                                    {f"k{i}": "v" for i in range(65)}, None])
def test_a_bad_host_label_is_refused_by_name(conn: psycopg.Connection, labels: object) -> None:
    fence = host(conn, "h1")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="^labels: must be a JSON object of at most 64"):
        conn.execute("SELECT unitvisor.register_host_labels(%s, %s, %s)", (fence.host_id, fence.epoch, Jsonb(labels)))


def test_only_its_own_host_registers_its_labels(conn: psycopg.Connection) -> None:
    fence = host(conn, "h1")
    with pytest.raises(psycopg.DatabaseError, match="^host h1 is fenced"):
        conn.execute("SELECT unitvisor.register_host_labels('h1', %s, '{}')", (fence.epoch + 1000,))


# -- a run's host_labels ---------------------------------------------------------------------------------


def test_a_run_goes_only_to_a_host_with_every_one_of_its_host_labels(conn: psycopg.Connection) -> None:
    a = host(conn, "ha", zone="a", disk="hdd")
    b = host(conn, "hb", zone="b", disk="ssd")
    both = host(conn, "hab", zone="a", disk="ssd", extra="x")
    run_id = submit(conn, host_labels={"zone": "a", "disk": "ssd"})
    age_jobs(conn)
    assert store.get_run(conn, run_id).host_labels == {"zone": "a", "disk": "ssd"}
    assert not claimable(conn, a) and not claimable(conn, b) and claimable(conn, both)
    assert claim(conn, a) == [] and claim(conn, b) == []
    assert claim(conn, both) == [run_id]


def test_a_run_without_host_labels_goes_anywhere(conn: psycopg.Connection) -> None:
    labelled = host(conn, "h1", zone="a")
    run_id = submit(conn)
    assert store.get_run(conn, run_id).host_labels == {}
    age_jobs(conn)
    assert claim(conn, labelled) == [run_id]


def test_runs_of_one_command_with_other_host_labels_are_judged_each_by_its_own(conn: psycopg.Connection) -> None:
    """The claim's memo and the probe's kinds hold host_labels: a refusal of one is not another's."""
    a = host(conn, "ha", zone="a")
    for_b = submit(conn, host_labels={"zone": "b"}, priority=1)
    for_a = submit(conn, host_labels={"zone": "a"})
    keyed = submit(conn, host_labels={"zone": "a"}, concurrency_key="k")
    age_jobs(conn)
    assert claimable(conn, a)
    assert set(claim(conn, a)) == {for_a, keyed}
    assert store.get_run(conn, for_b).state == "queued"


def test_a_run_without_host_labels_keeps_the_kind_it_had_before_033(conn: psycopg.Connection) -> None:
    """Jobs queued before 033 keep their kind (spawn_jobs.kind, 020's formula): a run without host_labels
    is of the kind it was; one with them is of another."""
    plain = submit(conn, environment={"LANG": "C"})
    labelled = submit(conn, environment={"LANG": "C"}, host_labels={"zone": "a"})
    rows = dict(conn.execute(
        """SELECT r.id, (unitvisor.run_kind(r), md5(jsonb_build_array(r.argv[1], r.run_user, r.memory_max, r.host_pin,
                      (SELECT coalesce(jsonb_agg(e.name ORDER BY e.name), '[]')
                       FROM jsonb_object_keys(r.environment) AS e(name)))::text))
           FROM unitvisor.runs r""").fetchall())
    kind, before_033 = rows[plain]
    assert kind == before_033
    assert rows[labelled][0] != kind


def test_a_run_no_live_host_matches_waits_and_says_why(conn: psycopg.Connection) -> None:
    host(conn, "ha", zone="a")
    host(conn, "hb", zone="b", disk="ssd")
    run_id = submit(conn, host_labels={"zone": "c", "disk": "ssd"})
    said = store.fleet_refusals(conn, [run_id])[run_id]
    assert said == "no live host accepts it: has no label disk=ssd, zone=c (ha); has no label zone=c (hb)"
    age_jobs(conn, 3600)
    assert store.explain_waiting(conn, timedelta(seconds=1)) == 1
    assert store.get_run(conn, run_id).wait_reason == said
    assert last_event(conn, run_id) == "waiting: " + said


def test_a_run_with_host_labels_wakes_a_host_that_has_them(conn: psycopg.Connection, dsn: str,
                                                          spawn_listener: psycopg.Connection) -> None:
    """The submit's notification (note_spawn_jobs, notify_spawn_targets) names a host that matches, even
    when the hosts with the most room, its first choices, do not."""
    with contextlib.ExitStack() as stack:
        conns = [conn] + [stack.enter_context(store.connect(dsn)) for _ in range(3)]
        for each, (host_id, max_runs, labels) in zip(conns, (("h1", 9, {}), ("h2", 9, {}), ("h3", 2, {}),
                                                              ("h4", 2, {"zone": "a"})), strict=True):
            registration = store.register_host(each, dataclasses.replace(host_profile(host_id, max_runs=max_runs),
                                                                         labels=labels))
            assert registration.registered
        submit(conn, host_labels={"zone": "a"})
        [note] = wait_notifies(spawn_listener, timeout=2.0, count=100)
        targets = store.spawn_hint_targets(note.payload)
        assert targets is not None and "h4" in targets


@pytest.mark.parametrize(("value", "sql_value"), [
    ({"zone": 1}, None), ({"": "a"}, None), ({"zone": "x" * 256}, None), (["zone"], None),
    (None, "'\"zone\"'::jsonb"), (None, "'[]'::jsonb"),
])
def test_bad_host_labels_are_refused_by_name(conn: psycopg.Connection, value: object, sql_value: str | None) -> None:
    message = "host_labels: must be a JSON object of at most 64 key -> string pairs"
    if sql_value is None:
        with pytest.raises(store.DatabaseError, match=f"{message}.*runs_host_labels_valid"):
            submit(conn, host_labels=value)
    else:
        with pytest.raises(psycopg.errors.CheckViolation, match=message):
            conn.execute(f"SELECT unitvisor.submit_run(ARRAY['/bin/true'], host_labels => {sql_value})")
    conn.rollback()


def test_a_null_host_labels_is_none_and_a_row_written_another_way_is_checked_too(conn: psycopg.Connection) -> None:
    run_id = conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], host_labels => NULL)").fetchone()[0]
    assert store.get_run(conn, run_id).host_labels == {}
    with pytest.raises(psycopg.errors.CheckViolation, match="^host_labels: must be a JSON object") as info:
        conn.execute("UPDATE unitvisor.runs SET host_labels = '{\"a\": 2}' WHERE id = %s", (run_id,))
    assert info.value.diag.constraint_name == "runs_host_labels_valid"


def test_a_schedule_submits_with_host_labels(conn: psycopg.Connection) -> None:
    run_id = conn.execute("""SELECT unitvisor.submit_run_spec('{"argv": ["/bin/true"], "host_labels": {"zone": "a"},
                                                              "avoid_failed_host": true}')""").fetchone()[0]
    run = store.get_run(conn, run_id)
    assert (run.host_labels, run.avoid_failed_host) == ({"zone": "a"}, True)


# -- a retry prefers another host -------------------------------------------------------------------------


def test_a_lost_attempts_retry_goes_to_another_host(conn: psycopg.Connection) -> None:
    h1 = host(conn, "h1")
    run_id = submit(conn, max_attempts=3)
    attempt = started(conn, h1, run_id)
    h2 = host(conn, "h2")
    ended(conn, h1, attempt, LOST)
    assert avoid_host(conn, run_id) == "h1"
    age_jobs(conn, 30)
    assert claim(conn, h1) == []
    assert claim(conn, h2) == [run_id]
    assert last_event(conn, run_id) == "claimed by host h2"


def test_the_failed_host_takes_the_retry_at_once_when_no_other_live_host_accepts_it(
        conn: psycopg.Connection) -> None:
    """The only live host that matches is the one it failed on: waiting would gain nothing."""
    h1 = host(conn, "h1", zone="a")
    h2 = host(conn, "h2", zone="b")
    run_id = submit(conn, host_labels={"zone": "a"})
    attempt = started(conn, h1, run_id)
    ended(conn, h1, attempt, LOST)
    assert avoid_host(conn, run_id) == "h1"
    assert claim(conn, h2) == []
    assert claim(conn, h1) == [run_id]
    assert last_event(conn, run_id) == ("claimed by host h1, where its last attempt failed: no other live host "
                                        "accepts it")


def test_the_failed_host_takes_the_retry_when_no_other_host_does_within_the_grace(conn: psycopg.Connection) -> None:
    """Another live host accepts it but does not claim it (it is full, say): the failed host passes it over
    for avoid_failed_host_grace (60 s) after the retry is due, then takes it, and the event says why."""
    h1 = host(conn, "h1", zone="a")
    host(conn, "h2", zone="a")  # live, accepts it, claims nothing here
    run_id = submit(conn, host_labels={"zone": "a"})
    attempt = started(conn, h1, run_id)
    ended(conn, h1, attempt, LOST)
    age_jobs(conn, 50)
    assert claim(conn, h1) == []
    age_jobs(conn, 61)
    assert claim(conn, h1) == [run_id]
    assert last_event(conn, run_id) == ("claimed by host h1, where its last attempt failed: no other host took it "
                                        "within 60 s of its retry")



def test_a_retry_pinned_to_its_failed_host_is_not_judged_by_an_unpinned_run_of_its_command(
        conn: psycopg.Connection) -> None:
    """Two retries of one command failed on h1: the unpinned one waits for h2 (which accepts it), the one
    pinned to h1 is taken at once, as no other host may take it. The claim's memo of whether another host
    accepts a kind must not let the first's answer stand for the second's (the kind holds host_pin)."""
    h1 = host(conn, "h1")
    unpinned = submit(conn, max_attempts=3, priority=1)
    pinned = submit(conn, max_attempts=3, host_pin="h1")
    unpinned_attempt = started(conn, h1, unpinned)
    pinned_attempt = started(conn, h1, pinned)
    h2 = host(conn, "h2")
    ended(conn, h1, unpinned_attempt, LOST)
    ended(conn, h1, pinned_attempt, LOST)
    assert avoid_host(conn, unpinned) == avoid_host(conn, pinned) == "h1"
    age_jobs(conn, 30)
    assert claim(conn, h1) == [pinned]
    assert last_event(conn, pinned) == ("claimed by host h1, where its last attempt failed: no other live host "
                                        "accepts it")
    assert claim(conn, h2) == [unpinned]


def test_a_draining_or_silent_other_host_is_no_reason_to_wait(conn: psycopg.Connection) -> None:
    h1 = host(conn, "h1")
    host(conn, "h2")
    host(conn, "h3")
    run_id = submit(conn, max_attempts=2)
    attempt = started(conn, h1, run_id)
    assert store.set_host_state(conn, "h2", "draining") == "active"
    silence(conn, "h3", 3600)
    ended(conn, h1, attempt, LOST)
    assert claim(conn, h1) == [run_id]


@pytest.mark.parametrize(("avoid", "outcome", "avoided"), [
    (None, LOST, True), (None, FAILED, False),
    (True, LOST, True), (True, FAILED, True),
    (False, LOST, False), (False, FAILED, False),
])
def test_avoid_failed_host_says_after_which_failures(conn: psycopg.Connection, avoid: bool | None,
                                                     outcome: Outcome, avoided: bool) -> None:
    h1 = host(conn, "h1")
    run_id = submit(conn, max_attempts=3, avoid_failed_host=avoid)
    assert store.get_run(conn, run_id).avoid_failed_host is avoid
    attempt = started(conn, h1, run_id)
    h2 = host(conn, "h2")
    ended(conn, h1, attempt, outcome)
    assert avoid_host(conn, run_id) == ("h1" if avoided else None)
    age_jobs(conn, 30)
    assert claim(conn, h1) == ([] if avoided else [run_id])
    assert claim(conn, h2) == ([run_id] if avoided else [])


def test_a_resumed_run_prefers_another_host_than_its_failed_one(conn: psycopg.Connection) -> None:
    h1 = host(conn, "h1")
    run_id = submit(conn, avoid_failed_host=True)
    attempt = started(conn, h1, run_id)
    assert store.record_outcome(conn, h1, attempt, FAILED, "failed")
    assert store.resume_run(conn, run_id).changed
    assert avoid_host(conn, run_id) == "h1"


# -- the CLI ----------------------------------------------------------------------------------------------


def test_cli_submit_with_host_labels_warns_when_no_host_matches_and_show_says_where_it_may_go(
        conn: psycopg.Connection, dsn: str, cli: Callable[..., CliResult]) -> None:
    host(conn, "h1", zone="a")
    conn.commit()
    result = cli("submit", "--host-label", "zone=b", "--host-label", "disk=ssd", "--avoid-failed-host", "any",
                 "--", "/bin/true", dsn=dsn)
    assert result.returncode == 0, result.stderr
    run_id = uuid.UUID(result.stdout.strip())
    assert result.stderr_lines == [f"unitvisor: warning: run {run_id} waits: no live host accepts it: "
                                   "has no label disk=ssd, zone=b (h1)"]
    shown = cli("show", str(run_id), dsn=dsn)
    assert ("  placement: hosts with disk=ssd zone=b; a retry after any failed attempt prefers another host"
            in shown.stdout.splitlines()), shown.stdout
    data = json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)
    assert (data["host_labels"], data["avoid_failed_host"]) == ({"zone": "b", "disk": "ssd"}, True)
    assert data["no_host_accepts"] == "no live host accepts it: has no label disk=ssd, zone=b (h1)"

    matched = cli("submit", "--host-label", "zone=a", "--avoid-failed-host", "never", "--", "/bin/true", dsn=dsn)
    assert matched.returncode == 0 and matched.stderr == ""
    run = store.get_run(conn, uuid.UUID(matched.stdout.strip()))
    assert (run.host_labels, run.avoid_failed_host) == ({"zone": "a"}, False)
    plain = cli("submit", "--", "/bin/true", dsn=dsn)
    assert "placement:" not in cli("show", plain.stdout.strip(), dsn=dsn).stdout


@pytest.mark.parametrize(("args", "message"), [
    (("--host-label", "zone"), "zone"),
    (("--host-label", "-zone=a"), "'-zone' is not a label key"),
    (("--avoid-failed-host", "sometimes"), "'sometimes' is not one of 'any', 'lost', 'never'"),
])
def test_cli_submit_refuses_bad_placement_as_usage(dsn: str, cli: Callable[..., CliResult], args: tuple[str, ...],
                                                   message: str) -> None:
    result = cli("submit", *args, "--", "/bin/true", dsn=dsn)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_cli_hosts_shows_each_hosts_labels(conn: psycopg.Connection, dsn: str, cli: Callable[..., CliResult]) -> None:
    host(conn, "h1", zone="a", disk="ssd")
    host(conn, "h2")
    conn.commit()
    header, h1_line, h2_line = cli("hosts", dsn=dsn).stdout.splitlines()[:3]
    assert header.split()[-1] == "LABELS"
    assert h1_line.endswith("disk=ssd zone=a") and h2_line.split()[-1] == "-"
    data = json.loads(cli("hosts", "--json", dsn=dsn).stdout)
    assert [h["labels"] for h in data] == [{"zone": "a", "disk": "ssd"}, {}]


# -- the documented example ---------------------------------------------------------------------------------

EXAMPLE = REPO / "docs" / "examples" / "placement.sql"


def test_the_documented_placement_example_prints_what_the_docs_show(postgres: Postgres,
                                                                     conn: psycopg.Connection) -> None:
    """docs/examples/placement.sql, as test_sql_api_example does for sql_api.sql; and docs/sql-api.md
    shows it, as it is."""
    assert_example_prints_its_out(postgres, conn.info.dbname, EXAMPLE)
    doc = (REPO / "docs" / "sql-api.md").read_text()
    stdout, stderr = EXAMPLE.with_suffix(".out").read_text().split("-- stderr:\n")
    assert EXAMPLE.read_text() in doc and stdout.strip() in doc and stderr.splitlines()[0] in doc
