"""Dependencies between runs (schema 035): submit_run's after and after_policy, the settling of a run's
dependants when it ends (released, or skipped down the chain), hold beside it, resume with and without
the dependants, expiry, retention, submit_run_spec, two sessions ending two dependencies at once, and
the CLI."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.model import Attempt
from supervisor.outcomes import Outcome
from tests.integration.conftest import CliResult, register, wait_notifies

SUCCESS = Outcome("success", "exit:0", "exited with status 0")
FAILURE = Outcome("exit-code", "exit:3", "exited with status 3")


def submit(conn: psycopg.Connection, **values: object) -> uuid.UUID:
    values.setdefault("argv", ["/bin/true"])
    return store.submit_run(conn, **values)


def jobs(conn: psycopg.Connection, run_id: uuid.UUID) -> int:
    return conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (run_id,)).fetchone()[0]


def state(conn: psycopg.Connection, run_id: uuid.UUID) -> str:
    return conn.execute("SELECT state FROM unitvisor.runs WHERE id = %s", (run_id,)).fetchone()[0]


def reasons(conn: psycopg.Connection, run_id: uuid.UUID) -> list[str]:
    return [e["reason"] for e in store.get_events(conn, run_id, limit=100)]


def claim(conn: psycopg.Connection, host: str = "h1") -> dict[uuid.UUID, Attempt]:
    fence = register(conn, host)
    return {run.id: attempt for run, attempt in store.claim(conn, fence, 100, unitspec.UNIT_NAME_FORMAT)}


def end(conn: psycopg.Connection, attempt: Attempt, outcome: Outcome = SUCCESS, host: str = "h1") -> None:
    fence = register(conn, host)
    store.mark_started(conn, fence, attempt, "inv-" + attempt.run_id.hex[:8])
    assert store.record_outcome(conn, fence, attempt, outcome, "succeeded" if outcome is SUCCESS else "failed")


def run_once(conn: psycopg.Connection, run_id: uuid.UUID, outcome: Outcome = SUCCESS) -> None:
    """Claim the run (it must be claimable now) and end its attempt with `outcome`."""
    claimed = claim(conn)
    assert run_id in claimed, f"{run_id} was not claimed: {claimed}"
    end(conn, claimed[run_id], outcome)


# -- the order -----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("as_bound_roles")
def test_a_fan_out_and_fan_in_run_in_order(conn: psycopg.Connection) -> None:
    a = submit(conn)
    b = submit(conn, after=[a])
    d = submit(conn, after=[a])
    e = submit(conn, after=[b, d, b])  # a run named twice counts once

    for waiting in (b, d):
        assert jobs(conn, waiting) == 0
        assert store.run_status(conn, waiting).wait_reason == f"waits for run {a} (queued)"
    assert store.run_status(conn, e).wait_reason == f"waits for run {b} (queued) and 1 more"
    assert store.dependencies_of(conn, e) == ("succeeded", [{"id": b, "state": "queued", "met": None},
                                                          {"id": d, "state": "queued", "met": None}])
    assert store.dependants_of(conn, a) == [b, d]

    claimed = claim(conn)
    assert set(claimed) == {a}  # nothing else has a job
    end(conn, claimed[a])
    assert (jobs(conn, b), jobs(conn, d), jobs(conn, e)) == (1, 1, 0)
    assert "the runs it runs after have ended (1 succeeded)" in reasons(conn, b)

    claimed = claim(conn)
    assert set(claimed) == {b, d}
    end(conn, claimed[b])
    assert store.run_status(conn, e).wait_reason == f"waits for run {d} (starting)"
    assert jobs(conn, e) == 0
    end(conn, claimed[d])
    assert store.run_status(conn, e).wait_reason is None and jobs(conn, e) == 1
    assert "the runs it runs after have ended (2 succeeded)" in reasons(conn, e)
    run_once(conn, e)
    assert state(conn, e) == "succeeded"


@pytest.mark.usefixtures("as_bound_roles")
def test_a_failed_run_skips_the_chain_below_it_naming_the_run(conn: psycopg.Connection, dsn: str) -> None:
    a = submit(conn)
    b = submit(conn, after=[a])
    c = submit(conn, after=[b])
    with store.connect(dsn) as listener:
        listener.execute("LISTEN unitvisor_run_finished")
        run_once(conn, a, FAILURE)
        notes = wait_notifies(listener, count=3)
    assert {json.loads(n.payload)["state"] for n in notes} == {"failed", "skipped"}
    assert {json.loads(n.payload)["run_id"] for n in notes} == {str(a), str(b), str(c)}

    assert (state(conn, b), state(conn, c)) == ("skipped", "skipped")
    status = store.run_status(conn, b)
    assert (status.outcome, status.wait_reason, status.finished_at is not None) == ("skipped", None, True)
    assert status.reason == f"run {a}, which it runs after, ended failed; it needed it to succeed"
    assert store.run_status(conn, c).reason == f"run {b}, which it runs after, ended skipped; it needed it to succeed"
    assert jobs(conn, b) == jobs(conn, c) == 0


@pytest.mark.usefixtures("as_bound_roles")
def test_after_policy_finished_runs_after_a_failure_too(conn: psycopg.Connection) -> None:
    a = submit(conn)
    cleanup = submit(conn, after=[a], after_policy="finished")
    run_once(conn, a, FAILURE)
    assert state(conn, cleanup) == "queued" and jobs(conn, cleanup) == 1
    assert "the runs it runs after have ended (1 failed)" in reasons(conn, cleanup)
    assert store.dependencies_of(conn, cleanup) == ("finished", [{"id": a, "state": "failed", "met": True}])


@pytest.mark.usefixtures("as_bound_roles")
def test_runs_already_ended_at_submit_release_or_skip_it_at_once(conn: psycopg.Connection) -> None:
    done = submit(conn)
    run_once(conn, done)
    broken = submit(conn)
    store.cancel_run(conn, broken)

    released = submit(conn, after=[done])
    assert jobs(conn, released) == 1 and store.run_status(conn, released).wait_reason is None
    skipped = submit(conn, after=[done, broken])
    assert state(conn, skipped) == "skipped"
    assert store.run_status(conn, skipped).reason == (
        f"run {broken}, which it runs after, ended cancelled; it needed it to succeed")
    assert reasons(conn, skipped)[0] == "submitted"


@pytest.mark.usefixtures("as_bound_roles")
def test_cancelling_a_waiting_run_skips_what_waits_for_it(conn: psycopg.Connection) -> None:
    a = submit(conn)
    b = submit(conn, after=[a])
    c = submit(conn, after=[b])
    assert store.cancel_run(conn, b) == store.Transition("cancelled", True)
    assert state(conn, c) == "skipped"
    assert state(conn, a) == "queued" and jobs(conn, a) == 1


@pytest.mark.usefixtures("as_bound_roles")
def test_each_skip_is_counted_by_one_daemon(conn: psycopg.Connection) -> None:
    a = submit(conn)
    b = submit(conn, after=[a])
    submit(conn, after=[b])
    h1, h2 = register(conn, "h1"), register(conn, "h2")
    assert store.pass_figures(conn, h1) == store.PassFigures(0, {})
    store.cancel_run(conn, a)
    assert (store.pass_figures(conn, h2).skipped, store.pass_figures(conn, h1).skipped) == (2, 0)


# -- hold ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("as_bound_roles")
def test_held_and_waiting_both_must_clear(conn: psycopg.Connection) -> None:
    # Released while it still waits: no job until the run it names has ended.
    a = submit(conn)
    b = submit(conn, after=[a], hold=True)
    reason = store.run_status(conn, b).wait_reason
    assert reason.startswith("held since ") and reason.endswith(f"; and waits for run {a} (queued)")
    assert store.release_run(conn, b) == store.Transition("queued", True)
    assert jobs(conn, b) == 0 and store.run_status(conn, b).wait_reason == f"waits for run {a} (queued)"
    assert "released by" in reasons(conn, b)[-1] and "still waits" in reasons(conn, b)[-1]
    run_once(conn, a)
    assert jobs(conn, b) == 1

    # Its dependency ended while it is held: still no job until its release.
    c = submit(conn)
    d = submit(conn, after=[c], hold=True)
    run_once(conn, c)
    assert jobs(conn, d) == 0 and store.run_status(conn, d).wait_reason.startswith("held since ")
    assert reasons(conn, d)[-1] == "the runs it runs after have ended (1 succeeded); it is still held"
    store.release_run(conn, d)
    assert jobs(conn, d) == 1


# -- resume -------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("as_bound_roles")
def test_resume_reopens_the_skipped_dependants_only_when_asked(conn: psycopg.Connection) -> None:
    a = submit(conn)
    b = submit(conn, after=[a])
    c = submit(conn, after=[b])
    run_once(conn, a, FAILURE)

    assert store.resume_run(conn, a) == store.Transition("queued", True)
    assert (state(conn, b), state(conn, c)) == ("skipped", "skipped")
    run_once(conn, a, FAILURE)

    assert store.resume_with_dependants(conn, a) == (store.Transition("queued", True), 2)
    assert (state(conn, b), state(conn, c)) == ("queued", "queued")
    assert jobs(conn, b) == jobs(conn, c) == 0
    assert store.run_status(conn, c).wait_reason == f"waits for run {b} (queued)"
    assert f"resumed by an operator with run {a}, which it runs after" in reasons(conn, c)
    run_once(conn, a)
    run_once(conn, b)
    run_once(conn, c)
    assert state(conn, c) == "succeeded"
    # Nothing to resume: refused as any resume of a run that did not fail.
    assert store.resume_with_dependants(conn, a) == (store.Transition("succeeded", False), 0)


@pytest.mark.usefixtures("as_bound_roles")
def test_resuming_a_skipped_run_waits_again_or_skips_again(conn: psycopg.Connection) -> None:
    a = submit(conn)
    b = submit(conn, after=[a])
    run_once(conn, a, FAILURE)
    # a still failed: b is skipped again at once, and says why.
    assert store.resume_run(conn, b) == store.Transition("skipped", True)
    store.resume_run(conn, a)
    assert store.resume_run(conn, b) == store.Transition("queued", True)
    assert jobs(conn, b) == 0
    run_once(conn, a)
    assert jobs(conn, b) == 1


# -- expiry and retention ----------------------------------------------------------------------------


@pytest.mark.usefixtures("as_bound_roles")
def test_a_waiting_run_expires_at_its_deadline_saying_what_it_waited_for(conn: psycopg.Connection) -> None:
    a = submit(conn)
    b = submit(conn, after=[a], start_deadline="2099-01-01T00:00Z")
    conn.execute("UPDATE unitvisor.runs SET start_deadline = now() - interval '1 second' WHERE id = %s", (b,))
    assert store.expire_runs(conn, register(conn, "h1")) == 1
    assert state(conn, b) == "expired"
    assert f"it was waiting for the runs it runs after: run {a} (queued)" in store.run_status(conn, b).reason


def test_a_run_that_a_live_run_names_is_not_pruned(conn: psycopg.Connection) -> None:
    old = submit(conn)
    run_once(conn, old)
    other = submit(conn)
    waiting = submit(conn, after=[old, other])
    conn.execute("UPDATE unitvisor.runs SET finished_at = now() - interval '30 days' WHERE id = %s", (old,))

    dry = conn.execute("SELECT runs FROM unitvisor.prune(interval '1 day', 1000, true)").fetchone()[0]
    assert dry == 0
    assert conn.execute("SELECT runs FROM unitvisor.prune(interval '1 day')").fetchone()[0] == 0
    assert state(conn, old) == "succeeded"
    # Once the run that named it has ended, it goes (and the dependency with it).
    store.cancel_run(conn, waiting)
    assert conn.execute("SELECT runs FROM unitvisor.prune(interval '1 day')").fetchone()[0] == 1
    assert store.dependencies_of(conn, waiting) == ("succeeded", [{"id": other, "state": "queued", "met": None}])



@pytest.mark.usefixtures("as_bound_roles")
def test_resuming_a_run_whose_dependencies_were_all_pruned_releases_it_saying_so(conn: psycopg.Connection) -> None:
    """Its dependency's row went with the pruned run: nothing is left to wait for, so the resumed run is
    released (a spawn job), not left queued for ever with no reason, and its event says why."""
    a = submit(conn)
    b = submit(conn, after=[a])
    run_once(conn, a, FAILURE)
    assert state(conn, b) == "skipped"
    conn.execute("UPDATE unitvisor.runs SET finished_at = now() - interval '30 days' WHERE id = %s", (a,))
    assert conn.execute("SELECT runs FROM unitvisor.prune(interval '1 day')").fetchone()[0] == 1
    assert store.dependencies_of(conn, b) == ("succeeded", [])

    assert store.resume_run(conn, b) == store.Transition("queued", True)
    assert jobs(conn, b) == 1
    assert reasons(conn, b)[-1] == "the runs it runs after were pruned (retention): nothing is left to wait for"
    run_once(conn, b)
    assert state(conn, b) == "succeeded"


# -- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "message"), [
    ({"after": [uuid.UUID(int=7)]}, f"after: no run {uuid.UUID(int=7)} (only a run that exists can be named)"),
    ({"after": [None]}, "after: must not hold NULL"),
    ({"after": [uuid.UUID(int=n) for n in range(1001)]}, "after: names 1001 runs, at most 1000 may be named"),
    ({"after_policy": "finished"}, "after_policy: only with after"),
    ({"after": "EXISTING", "after_policy": "whenever"}, "after_policy: must be succeeded or finished, not 'whenever'"),
])
@pytest.mark.usefixtures("as_bound_roles")
def test_bad_after_arguments_are_refused_by_name(conn: psycopg.Connection, values: dict, message: str) -> None:
    if values.get("after") == "EXISTING":
        values = {**values, "after": [submit(conn)]}
    before = conn.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0]
    with pytest.raises(store.DatabaseError, match="the database refused the run: " + message.replace("(", r"\(")
                       .replace(")", r"\)")):
        submit(conn, **values)
    assert conn.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0] == before


def test_a_schedule_spec_takes_after_and_after_policy(conn: psycopg.Connection) -> None:
    a = submit(conn)
    b = conn.execute("SELECT unitvisor.submit_run_spec(%s)", (json.dumps(
        {"argv": ["/bin/true"], "after": [str(a)], "after_policy": "finished"}),)).fetchone()[0]
    assert store.dependencies_of(conn, b) == ("finished", [{"id": a, "state": "queued", "met": None}])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="after: not a valid uuid"):
        conn.execute("SELECT unitvisor.submit_run_spec(%s)",
                     (json.dumps({"argv": ["/bin/true"], "after": ["not-a-run"]}),))


def test_an_idempotent_retry_finds_its_run_whatever_after_says_now(conn: psycopg.Connection) -> None:
    a = submit(conn)
    b = submit(conn, after=[a], idempotency_key="nightly-2")
    assert submit(conn, after=[uuid.UUID(int=9)], idempotency_key="nightly-2") == b


# -- two sessions -------------------------------------------------------------------------------------


def _blocked_on_a_lock(conn: psycopg.Connection, pid: int) -> bool:
    return conn.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]


@pytest.mark.parametrize("first", [0, 1])
def test_two_sessions_ending_the_two_dependencies_at_once_release_it_once(
        conn: psycopg.Connection, dsn: str, first: int) -> None:
    """Session 1 ends one dependency and, before it commits, session 2 ends the other: session 2 waits
    for the dependant's row, then sees session 1's commit and releases it. Read with session 2's first
    snapshot, it would see the other dependency still running and release nothing: the run would wait
    for ever. The two run on two hosts, so that the dependant's row is the one row both sessions write
    (one host's two outcomes would also wait for each other on the host's count of open attempts)."""
    parents = [submit(conn, host_pin="h1"), submit(conn, host_pin="h2")]
    child = submit(conn, after=parents)
    claimed, fences = {}, {}
    for run_id, host in zip(parents, ("h1", "h2"), strict=True):
        claimed.update(claim(conn, host))
        fences[run_id] = register(conn, host)
        store.mark_started(conn, fences[run_id], claimed[run_id], "inv-" + run_id.hex[:8])

    errors: list[BaseException] = []
    with store.connect(dsn) as one, store.connect(dsn) as two:
        with one.transaction():
            assert store.record_outcome(one, fences[parents[first]], claimed[parents[first]], SUCCESS,
                                        "succeeded")

            def second() -> None:
                try:
                    with two.transaction():
                        other = parents[1 - first]
                        store.record_outcome(two, fences[other], claimed[other], SUCCESS, "succeeded")
                except BaseException as exc:  # reported below
                    errors.append(exc)

            thread = threading.Thread(target=second)
            thread.start()
            deadline = time.monotonic() + 30
            while not _blocked_on_a_lock(conn, two.info.backend_pid):
                assert time.monotonic() < deadline, "session 2 never waited for the dependant's row"
                time.sleep(0.05)
        thread.join(timeout=30)
    assert not errors, errors
    assert jobs(conn, child) == 1
    assert [r for r in reasons(conn, child) if "have ended" in r] == ["the runs it runs after have ended (2 succeeded)"]


def test_many_sessions_ending_many_dependencies_release_each_dependant_once(conn: psycopg.Connection,
                                                                          dsn: str) -> None:
    """Nine sessions end nine runs at once, each of its own host (so that nothing but the dependants'
    rows orders them); four dependants each name eight of them (and one also the ninth, which fails, so
    it is skipped): each is settled exactly once."""
    hosts = [f"h{n}" for n in range(1, 10)]
    parents = [submit(conn, host_pin=host) for host in hosts[:8]]
    failing = submit(conn, host_pin=hosts[8])
    children = [submit(conn, after=parents) for _ in range(3)] + [submit(conn, after=[*parents, failing])]
    claimed, fences = {}, {}
    for run_id, host in zip([*parents, failing], hosts, strict=True):
        claimed.update(claim(conn, host))
        fences[run_id] = register(conn, host)
        store.mark_started(conn, fences[run_id], claimed[run_id], "inv-" + run_id.hex[:8])
    start = threading.Barrier(9)

    def ender(run_id: uuid.UUID, outcome: Outcome) -> Callable[[], None]:
        def work() -> None:
            with store.connect(dsn) as mine:
                start.wait(timeout=30)
                store.record_outcome(mine, fences[run_id], claimed[run_id], outcome,
                                     "succeeded" if outcome is SUCCESS else "failed")
        return work

    threads = [threading.Thread(target=ender(p, SUCCESS)) for p in parents]
    threads.append(threading.Thread(target=ender(failing, FAILURE)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for child in children[:3]:
        assert jobs(conn, child) == 1
        assert [r for r in reasons(conn, child) if "have ended" in r] == [
            "the runs it runs after have ended (8 succeeded)"]
    assert state(conn, children[3]) == "skipped" and jobs(conn, children[3]) == 0
    assert [r for r in reasons(conn, children[3]) if "ended failed" in r] == [
        f"run {failing}, which it runs after, ended failed; it needed it to succeed"]


# -- the CLI ------------------------------------------------------------------------------------------


@pytest.fixture
def uv(dsn: str, cli: Callable[..., CliResult]) -> Callable[..., CliResult]:
    """The real `unitvisor` on the test's database; a command that should succeed must."""
    def run(*args: str, check: bool = True) -> CliResult:
        result = cli(*args, dsn=dsn)
        assert not check or result.returncode == 0, result.stderr
        return result
    return run


def test_the_cli_submits_after_shows_lists_and_resumes_with_dependants(
        conn: psycopg.Connection, uv: Callable[..., CliResult]) -> None:
    a = uuid.UUID(uv("submit", "--", "/bin/true").stdout.strip())
    b = uuid.UUID(uv("submit", "--after", str(a)[:8], "--", "/bin/true").stdout.strip())
    c = uuid.UUID(uv("submit", "--after", str(b), "--after", str(a), "--after-policy", "finished", "--",
                      "/bin/true").stdout.strip())

    shown = json.loads(uv("show", str(c), "--json").stdout)
    assert shown["after_policy"] == "finished"
    assert shown["after"] == [{"id": str(a), "state": "queued", "met": None},
                              {"id": str(b), "state": "queued", "met": None}]
    # Beside it, why no host would take it now (this test registers none): said by `show` as for any run.
    assert shown["wait_reason"].startswith(f"waits for run {a} (queued) and 1 more")
    text = uv("show", str(a)).stdout
    assert f"run after it: 2 (unitvisor runs --after {str(a)[:8]})" in text
    text = uv("show", str(c)).stdout
    assert "after:     finished of each:" in text and f"    {b} queued (waiting)" in text

    listed = json.loads(uv("runs", "--after", str(a), "--json").stdout)
    assert [r["id"] for r in listed] == [str(c), str(b)]
    assert f"{str(b)[:8]}: waits: waits for run {a} (queued)" in uv("runs", "--after", str(a)[:8]).stdout

    run_once(conn, a, FAILURE)
    assert json.loads(uv("show", str(b), "--json").stdout)["state"] == "skipped"
    assert json.loads(uv("runs", "--state", "skipped", "--json").stdout)[0]["outcome"] == "skipped"
    assert uv("wait", str(b), "--timeout", "5s", check=False).returncode == 1

    result = uv("resume", str(a), "--with-dependants")
    assert result.stdout.strip() == f"run {a} queued again, and 1 run skipped below it queued again too"
    # b waits for a again; c (finished: a failed, b skipped, both ended) had been released, and stays so.
    assert (state(conn, b), jobs(conn, b), state(conn, c), jobs(conn, c)) == ("queued", 0, "queued", 1)

    # Refusals: one line, naming what is wrong.
    result = uv("submit", "--after", str(uuid.UUID(int=5)), "--", "/bin/true", check=False)
    assert (result.returncode, result.stderr_lines) == (1, [
        f"unitvisor: the database refused the run: after: no run {uuid.UUID(int=5)} (only a run that exists can be "
        "named)"])
    result = uv("submit", "--after", "abcdef12", "--", "/bin/true", check=False)
    assert (result.returncode, result.stderr_lines) == (1, ["unitvisor: no run with id abcdef12"])
    result = uv("submit", "--after-policy", "finished", "--", "/bin/true", check=False)
    assert result.returncode == 2 and "--after-policy: needs --after" in result.stderr
    result = uv("resume", str(c), check=False)
    assert result.returncode == 1
    assert result.stderr_lines == [f"unitvisor: run {c} is queued; only a failed, cancelled, expired or skipped "
                                   "run can be resumed"]


def test_resume_of_a_skipped_run_whose_dependency_still_failed_says_so(
        conn: psycopg.Connection, uv: Callable[..., CliResult]) -> None:
    a = submit(conn)
    b = submit(conn, after=[a])
    run_once(conn, a, FAILURE)
    result = uv("resume", str(b), check=False)
    assert result.returncode == 1
    assert result.stderr_lines == [f"unitvisor: run {b} skipped again: a run it runs after still is not what it "
                                   f"needs (unitvisor show {str(b)[:8]})"]
    assert state(conn, b) == "skipped"
