"""Migration 019 (issue 23, points 1 and 2) against the real schema: the fleet upkeep's turn, once per
interval for the whole fleet; explain_waiting computing each refusal once per kind of run and going on
where its last pass stopped; declare_dead's guards (the declarer late, most of the fleet late, the cap;
most of the fleet silent at once, and the operator's confirmation, since 036); the heartbeat alone.

Every test here fails on the schema before 019 (the functions, or the behaviour, are new). Time is moved
with SQL (heartbeat_at, turn_at), never slept through.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import psycopg
import pytest

from supervisor import heartbeat, store
from tests.integration.conftest import bind_host_role, connected, declared, register, session_as, silence

MINUTE = timedelta(minutes=1)


def submit(conn: psycopg.Connection, argv0: str, host_pin: str | None = None) -> uuid.UUID:
    return conn.execute("SELECT unitvisor.submit_run(argv => %s::text[], host_pin => %s::text)",
                        ([argv0], host_pin)).fetchone()[0]


def waited_for_long(conn: psycopg.Connection) -> None:
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = scheduled_at - interval '1 hour' "
                 "WHERE state = 'available'")


def reasons(conn: psycopg.Connection) -> dict[uuid.UUID, str]:
    return dict(conn.execute("SELECT run_id, reason FROM unitvisor.run_waits").fetchall())


@contextmanager
def connection(dsn: str) -> Iterator[psycopg.Connection]:
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        yield other
        # Its host locks go with the session, but only once its backend ends, after close() returns: a
        # host registered again at once on a new session could find its own lock still held.
        other.execute("SELECT pg_advisory_unlock_all()")


# -- the turn ------------------------------------------------------------------------------------


def test_one_host_of_the_fleet_gets_the_upkeeps_turn_per_interval(conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as other:
        h1, h2 = register(conn, "h1"), register(other, "h2")
        every = timedelta(seconds=10)
        assert store.fleet_upkeep_turn(conn, h1, every) is True
        assert store.fleet_upkeep_turn(other, h2, every) is False  # h1 has it for this interval
        assert store.fleet_upkeep_turn(conn, h1, every) is False  # and so has nobody else, h1 included
        conn.execute("UPDATE unitvisor.fleet_upkeep SET turn_at = now() - interval '11 seconds'")
        assert store.fleet_upkeep_turn(other, h2, every) is True  # whoever asks first after the interval
        assert conn.execute("SELECT turn_host FROM unitvisor.fleet_upkeep").fetchone()[0] == "h2"


def test_a_host_that_does_not_act_for_the_fleet_never_gets_the_turn(conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as other:
        h1, h2 = register(conn, "h1"), register(other, "h2")
        silence(conn, "h1", 120)  # past its host_dead_after: any peer may declare it dead
        assert store.fleet_upkeep_turn(conn, h1, MINUTE) is False
        assert store.fleet_upkeep_turn(other, h2, MINUTE) is True


def test_the_turn_is_fenced(conn: psycopg.Connection, dsn: str) -> None:
    h1 = register(conn, "h1")
    with pytest.raises(store.Fenced):
        store.fleet_upkeep_turn(conn, store.Fence("h1", h1.epoch + 1000), MINUTE)


# -- explain_waiting -----------------------------------------------------------------------------


def fleet_refusal_calls(conn: psycopg.Connection, work) -> int:
    """How many times unitvisor.fleet_refusal ran during `work` (the transaction's own function
    statistics; fleet_refusal is never inlined: its body has a WITH)."""
    conn.execute("SET track_functions = 'all'")
    with conn.transaction():
        work()
        calls = conn.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions "
                             "WHERE schemaname = 'unitvisor' AND funcname = 'fleet_refusal'").fetchone()[0]
    return int(calls)


def test_each_kind_of_waiting_run_is_refused_once_not_each_run(conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as o1, connection(dsn) as o2:
        for c, host in ((conn, "h1"), (o1, "h2"), (o2, "h3")):
            register(c, host, allowed=("/usr/bin/*",))
        new = [submit(conn, "/opt/new/tool") for _ in range(40)]  # a rollout no allowlist covers yet
        other = [submit(conn, "/srv/x") for _ in range(10)]
        pinned = [submit(conn, "/usr/bin/ok", host_pin="gone") for _ in range(5)]
        waited_for_long(conn)
        written: list[int] = []
        calls = fleet_refusal_calls(conn, lambda: written.append(store.explain_waiting(conn, MINUTE)))
        assert written == [55]
        assert calls == 3  # three kinds; before 019, one per run: 55
        why = reasons(conn)
        assert {why[r] for r in new} == {
            "no live host accepts it: executable /opt/new/tool is not allowed (h1, h2, h3)"}
        assert {why[r] for r in other} == {"no live host accepts it: executable /srv/x is not allowed (h1, h2, h3)"}
        assert {why[r] for r in pinned} == {"pinned to host gone, which is not known (see unitvisor hosts)"}


def test_a_backlog_longer_than_one_pass_is_explained_a_batch_a_pass(conn: psycopg.Connection) -> None:
    register(conn, "h1", allowed=("/usr/bin/*",))
    runs = [submit(conn, "/opt/new/tool") for _ in range(5)]
    waited_for_long(conn)
    explained = []
    for _ in range(3):
        store.explain_waiting(conn, MINUTE, batch=2)
        explained.append(len(reasons(conn)))
    assert explained == [2, 4, 5]  # before 019: [2, 2, 2], the same first two for ever
    assert set(reasons(conn)) == set(runs)
    # Having reached the end, the next pass starts from the beginning again (a reason can change).
    register(conn, "h1", allowed=("/usr/bin/*", "/opt/new/*"))
    store.explain_waiting(conn, MINUTE, batch=2)
    assert len(reasons(conn)) == 3


def test_a_pass_takes_only_as_many_kinds_as_its_refusal_budget_allows(conn: psycopg.Connection) -> None:
    """About 10,000 host_refusal calls a pass: with 2,500 live hosts, 4 kinds of run. Runs of many
    kinds (each its own argv[0]) on a big fleet are explained a few kinds a pass, where one pass over
    all of them would outlive the statement_timeout, be rolled back, and never end."""
    register(conn, "h1", allowed=("/usr/bin/*",))
    conn.execute("""INSERT INTO unitvisor.hosts
                    SELECT (jsonb_populate_record(h, jsonb_build_object(
                               'id', 'c' || g, 'instance', 'inst-c' || g, 'epoch', nextval('unitvisor.host_epochs')))).*
                    FROM unitvisor.hosts h, generate_series(1, 2499) g WHERE h.id = 'h1'""")
    for kind in range(10):
        submit(conn, f"/opt/tool{kind}")
    waited_for_long(conn)
    explained = []
    for _ in range(3):
        store.explain_waiting(conn, MINUTE)
        explained.append(len(reasons(conn)))
    assert explained == [4, 8, 10]  # before 019: [10, 10, 10], whatever it cost


# -- declare_dead --------------------------------------------------------------------------------


@pytest.fixture
def fleet(conn: psycopg.Connection, dsn: str) -> Iterator[dict[str, store.Fence]]:
    """A declarer (registered an hour ago, on `conn`) and hosts a..e, each on a connection of its own."""
    fences = {"declarer": register(conn, "declarer")}
    connected(conn, "declarer")
    others = [store.connect(dsn) for _ in range(5)]
    try:
        for name, c in zip("abcde", others, strict=True):
            fences[name] = register(c, name)
        yield fences
    finally:
        for c in others:
            c.close()


def declare(conn: psycopg.Connection, fence: store.Fence, cap: int = 5) -> store.Declaration:
    with conn.transaction():
        return store.declare_dead(conn, fence, 3600, cap)


def states(conn: psycopg.Connection) -> dict[str, str]:
    return dict(conn.execute("SELECT id, state FROM unitvisor.hosts").fetchall())


def disrupted(conn: psycopg.Connection, seconds: float) -> None:
    """Pretend the fleet's last disruption was `seconds` ago: its last hold, and any silent host's
    return (036)."""
    conn.execute("UPDATE unitvisor.fleet_upkeep SET fleet_held_at = now() - make_interval(secs => %s)", (seconds,))
    conn.execute("UPDATE unitvisor.hosts SET returned_late_at = now() - make_interval(secs => %s) "
                 "WHERE returned_late_at IS NOT NULL", (seconds,))


def grace_over(conn: psycopg.Connection, declarer: store.Fence, held: int) -> list[str]:
    """After a hold because something was behind, the silent hosts get their host_dead_after again
    (036): the next pass holds them ('fleet-recovering'); moved past it, the pass declares them."""
    declaration = declare(conn, declarer)
    assert (declaration.dead, declaration.held, declaration.held_why) == ([], held, "fleet-recovering")
    assert "get their host_dead_after again from the fleet's last disruption" in declaration.held_detail
    disrupted(conn, 61)
    return sorted(d.host_id for d in declare(conn, declarer).dead)


def test_a_silent_host_is_declared_dead_as_before(conn: psycopg.Connection, fleet) -> None:
    silence(conn, "a", 100)
    declaration = declare(conn, fleet["declarer"])
    assert declared(declaration.dead, {"a": 100}) == [("a", 60.0)]
    assert (declaration.held, declaration.held_why) == (0, None)
    assert states(conn)["a"] == "dead"
    assert declare(conn, fleet["declarer"]) == store.Declaration([])


def test_nobody_is_declared_while_the_declarers_own_heartbeat_is_late(conn: psycopg.Connection, fleet) -> None:
    silence(conn, "a", 100)
    silence(conn, "declarer", 25)  # two of its 10 s polls, but not half its 60 s host_dead_after: on time
    assert [d.host_id for d in declare(conn, fleet["declarer"]).dead] == ["a"]
    silence(conn, "b", 100)
    silence(conn, "declarer", 31)  # two of its polls and half its host_dead_after: the database is behind
    declaration = declare(conn, fleet["declarer"])
    assert (declaration.dead, declaration.held, declaration.held_why) == ([], 1, "declarer-late")
    assert "own heartbeat is 31 s old" in declaration.held_detail
    assert states(conn)["b"] == "active"
    silence(conn, "declarer", 0)
    assert grace_over(conn, fleet["declarer"], 1) == ["b"]


def test_nobody_is_declared_while_most_of_the_fleet_is_late_too(conn: psycopg.Connection, fleet) -> None:
    silence(conn, "a", 100)
    for host in ("b", "c", "d"):
        silence(conn, host, 40)  # late (over half their host_dead_after), not overdue: three of the other four
    declaration = declare(conn, fleet["declarer"])
    assert (declaration.dead, declaration.held, declaration.held_why) == ([], 1, "fleet-late")
    assert declaration.held_detail.startswith("3 of the 4 other live hosts are late too")
    assert states(conn)["a"] == "active"
    silence(conn, "d", 25)  # two polls, but not half of host_dead_after: not late; and half late is not most
    assert grace_over(conn, fleet["declarer"], 1) == ["a"]


def test_one_late_peer_is_not_the_fleet(conn: psycopg.Connection, dsn: str) -> None:
    """Three hosts, one of them silent: the one other peer being late holds nothing back (at least two)."""
    declarer = register(conn, "declarer")
    connected(conn, "declarer")
    with connection(dsn) as c1, connection(dsn) as c2:
        register(c1, "a")
        register(c2, "b")
        silence(conn, "a", 100)
        silence(conn, "b", 40)
        assert [d.host_id for d in declare(conn, declarer).dead] == ["a"]


def test_a_fleet_that_mostly_died_is_still_declared(conn: psycopg.Connection, fleet) -> None:
    """The hosts that are overdue do not count as late: a rack that lost power is declared, not held."""
    for host in "abcd":
        silence(conn, host, 100)
    assert sorted(d.host_id for d in declare(conn, fleet["declarer"]).dead) == ["a", "b", "c", "d"]


def test_at_most_the_cap_is_declared_at_once_the_longest_silent_first(conn: psycopg.Connection, dsn: str,
                                                                      fleet) -> None:
    """Five silent past a cap of two, with five more hosts on time: not most of the fleet (a rack of a
    large one), so paced by the cap, not held as fleet-silent."""
    with contextlib.ExitStack() as stack:
        for host in "fghij":
            register(stack.enter_context(connection(dsn)), host)
        for seconds, host in enumerate("abcde"):
            silence(conn, host, 100 + seconds)
        declaration = declare(conn, fleet["declarer"], cap=2)
        assert sorted(d.host_id for d in declaration.dead) == ["d", "e"]
        assert (declaration.held, declaration.held_why) == (3, "cap")
        assert "max_dead_per_pass is 2" in declaration.held_detail
        declaration = declare(conn, fleet["declarer"], cap=2)
        assert (sorted(d.host_id for d in declaration.dead), declaration.held) == (["b", "c"], 1)
        declaration = declare(conn, fleet["declarer"], cap=2)
        assert ([d.host_id for d in declaration.dead], declaration.held, declaration.held_why) == (["a"], 0, None)


def test_nobody_is_declared_while_most_of_the_fleet_is_silent_at_once(conn: psycopg.Connection, fleet) -> None:
    """Three of the five others overdue, past a cap of two: the database (or its network) is more likely
    behind than three hosts dead; the two others on time do not make the fleet late (036)."""
    for host in "abc":
        silence(conn, host, 100)
    declaration = declare(conn, fleet["declarer"], cap=2)
    assert (declaration.dead, declaration.held, declaration.held_why) == ([], 3, "fleet-silent")
    assert declaration.held_detail.startswith("3 of the 5 other hosts are silent at once")
    assert "unitvisor hosts confirm-down HOST" in declaration.held_detail
    assert {h: states(conn)[h] for h in "abc"} == dict.fromkeys("abc", "active")
    # One comes back: two silent are within the cap, and declared once the grace after the hold is over.
    silence(conn, "c", 0)
    assert grace_over(conn, fleet["declarer"], 2) == ["a", "b"]


def test_a_host_confirmed_down_is_declared_whatever_the_fleet_wide_guards_say(conn: psycopg.Connection,
                                                                               fleet) -> None:
    for host in "abc":
        silence(conn, host, 100)
    assert store.confirm_host_down(conn, "b") == "active"
    declaration = declare(conn, fleet["declarer"], cap=2)
    assert ([d.host_id for d in declaration.dead], declaration.held, declaration.held_why) == (["b"], 2,
                                                                                              "fleet-silent")
    assert declaration.held_detail.startswith("2 of the 5 other hosts are silent at once")
    reason, confirmed = conn.execute("SELECT dead_reason, down_confirmed_at FROM unitvisor.hosts "
                                     "WHERE id = 'b'").fetchone()
    assert reason.endswith(f"declared dead by host declarer, confirmed down by {conn.info.user}"), reason
    assert confirmed is None  # declared: the confirmation is spent
    # Under fleet-late too (d and e late, not overdue), and first under the cap.
    for host in "de":
        silence(conn, host, 40)
    store.confirm_host_down(conn, "c")
    declaration = declare(conn, fleet["declarer"], cap=1)
    assert ([d.host_id for d in declaration.dead], declaration.held, declaration.held_why) == (["c"], 1, "fleet-late")
    assert store.confirm_host_down(conn, "c") == "dead"  # nothing to confirm; no such host: None
    assert store.confirm_host_down(conn, "nobody") is None


def test_after_a_disruption_a_silent_host_gets_its_host_dead_after_again_unless_confirmed_down(
        conn: psycopg.Connection, fleet) -> None:
    """The bench's 1,000 hosts: once most came back, the cap declared those still silent at once, and
    most of them came back a pass later. After a hold every silent host gets host_dead_after again."""
    for host in "abc":
        silence(conn, host, 300)
    assert declare(conn, fleet["declarer"], cap=2).held_why == "fleet-silent"
    silence(conn, "c", 0)  # the fleet comes back, but for a and b (silent for 300 s)
    store.confirm_host_down(conn, "b")
    declaration = declare(conn, fleet["declarer"], cap=2)
    assert ([d.host_id for d in declaration.dead], declaration.held, declaration.held_why) == (
        ["b"], 1, "fleet-recovering")
    disrupted(conn, 59)
    assert declare(conn, fleet["declarer"], cap=2).held_why == "fleet-recovering"  # a's host_dead_after is 60 s
    disrupted(conn, 61)
    assert [d.host_id for d in declare(conn, fleet["declarer"], cap=2).dead] == ["a"]


def test_a_silent_host_heard_from_again_gives_the_others_their_host_dead_after_again(
        conn: psycopg.Connection, fleet) -> None:
    """No hold, but a host silent past its host_dead_after and not declared yet heartbeats: silence is
    not death just now (a fleet reconnecting after the database's trouble, a few hosts at a time, the
    last of them after the guards have let go: bench.scale's 1,000 hosts, 0.11.0). The other silent
    hosts get their host_dead_after again from then; a host confirmed down does not."""
    for host in "abc":
        silence(conn, host, 100)
    store.confirm_host_down(conn, "c")
    assert store.renew_heartbeat(conn, fleet["a"]) == "active"
    declaration = declare(conn, fleet["declarer"])
    assert ([d.host_id for d in declaration.dead], declaration.held, declaration.held_why) == (
        ["c"], 1, "fleet-recovering")
    assert "a silent host heard from again, 0 s ago" in declaration.held_detail
    disrupted(conn, 61)
    assert [d.host_id for d in declare(conn, fleet["declarer"]).dead] == ["b"]


def test_a_host_back_from_late_holds_the_silent_ones_as_in_the_1000_host_storm(conn: psycopg.Connection,
                                                                               fleet) -> None:
    """0.11.0's 1,000 hosts (docs/benchmarks.md, "0.11.0 with 043"): a minute after the last host came back
    from past its host_dead_after, the cap declared 5 hosts still silent, while the storm still let others
    back from shorter spells. With 044, such a return (late, not overdue) holds them: each silent host is
    declared only once it has been silent for its host_dead_after since the last one."""
    for host in "ab":
        silence(conn, host, 130)
    disrupted(conn, 70)  # the last return from past host_dead_after, 70 s ago
    silence(conn, "c", 45)  # c has been out for 45 s: late, not overdue
    assert store.renew_heartbeat(conn, fleet["c"]) == "active"  # ... and gets back
    declaration = declare(conn, fleet["declarer"])
    assert (declaration.dead, declaration.held, declaration.held_why) == ([], 2, "fleet-recovering")
    assert "a silent host heard from again, 0 s ago" in declaration.held_detail
    disrupted(conn, 61)  # no host back from late since: a and b are declared
    assert sorted(d.host_id for d in declare(conn, fleet["declarer"]).dead) == ["a", "b"]


def test_only_a_late_return_is_a_disruption(conn: psycopg.Connection, dsn: str, fleet) -> None:
    """A heartbeat on time, or behind but not late (within two poll intervals and half host_dead_after:
    30 s here), marks nothing; nor does a dead host's registration (it was declared: its return is a new
    registration, not evidence about the others). A heartbeat from late but within host_dead_after marks
    it (044: 0.11.0's 1,000 hosts, a storm of reconnections that let hosts back after spells of every
    length), and so does a daemon that registers again after being silent past it (restarted, not
    declared)."""
    silence(conn, "a", 28)
    store.renew_heartbeat(conn, fleet["a"])
    store.renew_heartbeat(conn, fleet["b"])
    assert late_returns(conn) == {}
    silence(conn, "c", 32)
    store.renew_heartbeat(conn, fleet["c"])
    assert list(late_returns(conn)) == ["c"]
    conn.execute("UPDATE unitvisor.hosts SET returned_late_at = NULL")
    for host in "fg":
        with connection(dsn) as first:
            register(first, host)
    silence(conn, "f", 100)
    assert [d.host_id for d in declare(conn, fleet["declarer"]).dead] == ["f"]
    silence(conn, "g", 100)
    for host in "fg":
        with connection(dsn) as again:
            register(again, host)
    assert list(late_returns(conn)) == ["g"]


def late_returns(conn: psycopg.Connection) -> dict[str, object]:
    return dict(conn.execute("SELECT id, returned_late_at FROM unitvisor.hosts "
                             "WHERE returned_late_at IS NOT NULL").fetchall())


def test_a_confirmation_ends_when_the_host_is_heard_from(conn: psycopg.Connection, fleet) -> None:
    """A host confirmed down that heartbeats was not down: the fleet-wide guards hold it again."""
    for host in "abc":
        silence(conn, host, 100)
    for host in "ab":
        store.confirm_host_down(conn, host)
    assert store.renew_heartbeat(conn, fleet["a"]) == "active"
    heard = conn.execute("SELECT id, down_confirmed_at IS NOT NULL FROM unitvisor.hosts WHERE id IN ('a', 'b') "
                         "ORDER BY id").fetchall()
    assert heard == [("a", False), ("b", True)]
    silence(conn, "a", 100)  # silent again: moving the heartbeat back is not hearing from it
    declaration = declare(conn, fleet["declarer"], cap=2)
    assert ([d.host_id for d in declaration.dead], declaration.held_why) == (["b"], "fleet-silent")


def test_only_the_database_owner_confirms_a_host_down(conn: psycopg.Connection, postgres, fleet) -> None:
    """A host role may not: one broken (or hostile) host could have the whole fleet declared."""
    role = bind_host_role(conn, postgres, "a")
    with session_as(conn, role), pytest.raises(psycopg.errors.InsufficientPrivilege):
        store.confirm_host_down(conn, "b")


def test_a_declaration_and_an_old_daemons_never_overlap(conn: psycopg.Connection, dsn: str, fleet) -> None:
    """declare_dead takes declare_dead_hosts' lock: a 0.7 daemon and this one never both declare."""
    silence(conn, "a", 100)
    with connection(dsn) as old:
        connected(conn, "b")
        with old.transaction():
            assert [d.host_id for d in store.declare_dead_hosts(old, fleet["b"], 3600)] == ["a"]
            with conn.transaction():
                assert store.declare_dead(conn, fleet["declarer"], 3600, 5) == store.Declaration([])


# -- the heartbeat alone -------------------------------------------------------------------------


def test_renew_heartbeat_renews_and_a_fenced_host_renews_nothing(conn: psycopg.Connection, fleet) -> None:
    silence(conn, "a", 40)
    assert store.renew_heartbeat(conn, fleet["a"]) == "active"
    age = conn.execute("SELECT extract(epoch FROM now() - heartbeat_at) FROM unitvisor.hosts WHERE id = 'a'")
    assert age.fetchone()[0] < 5
    silence(conn, "a", 100)
    assert declare(conn, fleet["declarer"]).held_why == "fleet-recovering"  # its return from 40 s (044)
    disrupted(conn, 61)
    assert [d.host_id for d in declare(conn, fleet["declarer"]).dead] == ["a"]
    assert store.renew_heartbeat(conn, fleet["a"]) is None
    assert states(conn)["a"] == "dead"


def test_a_late_loops_heartbeat_is_sent_aside_on_a_connection_of_its_own(conn: psycopg.Connection, dsn: str) -> None:
    """supervisor/heartbeat.py against the real database: the loop's connection stays busy (a lock held
    in an open transaction, as a statement waiting on a slow database), yet the heartbeat lands."""
    fence = register(conn, "h1")
    silence(conn, "h1", 40)
    renewals: list[float] = []
    now = time.monotonic()
    loop = heartbeat.Loop(fence=lambda: fence, dsn=lambda: dsn, renewed_at=lambda: now - 40,
                          alive_at=lambda: now, renewed=lambda sent, boot: bool(renewals.append(sent)) or True)
    aside = heartbeat.AsideHeartbeat(loop, poll_interval=10.0, dead_after=60.0)
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(4242)")  # the loop's connection, busy in a transaction
            assert aside.check(time.monotonic()) is True
        age = conn.execute("SELECT extract(epoch FROM now() - heartbeat_at) FROM unitvisor.hosts WHERE id = 'h1'")
        assert age.fetchone()[0] < 5
        assert len(renewals) == 1 and aside.conn is not None and aside.conn is not conn
    finally:
        aside.stop()
