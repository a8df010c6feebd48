"""The nemesis: a fleet of three test bed hosts on one PostgreSQL under a random, seeded schedule of
faults and operator actions while runs flow, then an audit of the whole history by the checker
(tests/harness/checker.py). docs/fleet.md, "Nemesis", says what it does and what it found.

    python -m tests.harness.nemesis --minutes 30 --seed 7      # make nemesis NEMESIS_MINUTES=30 NEMESIS_SEED=7

The seed fixes the schedule (which fault, on which host, for how long, in which order) and the shape
of every submitted run (its command, retries, concurrency key); the interleaving of threads, and so
the exact history, is the machine's. Every container, proxy and PostgreSQL is removed on the way out,
also on a failure or Ctrl-C (SIGTERM is turned into KeyboardInterrupt for that).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from supervisor import store
from tests.harness import testbed as testbed_mod
from tests.harness.checker import (
    Attempt,
    Contact,
    Declaration,
    Fault,
    JournalRecord,
    Operation,
    Report,
    Run,
    Sample,
    check,
    format_report,
    parse_declarations,
    parse_journal,
)
from tests.harness.fleet import Fleet, Member, fleet_config
from tests.harness.host import REPO, VENV_BIN, wait_for
from tests.harness.postgres import Postgres, free_port, multi_host_dsn

POLL = 1
DEAD_AFTER = 10      # host_dead_after; cut-off stop at 10 - 1 - 2 = 7 s of silence
STOP_GRACE = 1
DB = "unitvisor_nemesis"
HOST_IDS = ("nem-1", "nem-2", "nem-3")
MAX_IN_FLIGHT = 12   # the submitter waits while this many runs are not finished (a short quiesce)
# Runs that have not ended, in the database's own list of the states a run ends in (skipped too, 035):
# the driver waits on the product's states; the checker (checker.TERMINAL) keeps its own.
UNENDED_RUNS = "SELECT count(*) FROM unitvisor.runs WHERE state <> ALL (unitvisor.retention_states())"

# Faults and operator actions: name -> weight in the random part of a schedule. `clone`, `stop_long`
# and `wrong_dsn` break promises on 0.5.1 (issue 21: a clone takes a restarting host's id; self-fencing
# is armed only by a running, registered daemon).
FAULTS: dict[str, int] = {
    "kill9": 3, "restart": 2, "stop_long": 1, "power_cut": 2, "reboot": 1, "partition_reset": 2,
    "partition_blackhole": 2, "pg_restart": 1, "clone": 1, "wrong_dsn": 1, "drain": 2, "cancel": 2, "resume": 2,
    "failover": 1, "rotate_password": 1, "apt_upgrade": 1, "apt_remove": 1, "partition_hosts": 1, "pg_stall": 1,
}
ON_ONE_HOST = frozenset(FAULTS) - {"pg_restart", "failover", "cancel", "resume", "pg_stall"}
# Added after CI's compact schedule had its length (every fault above once, about 3 minutes): the
# compact schedule does every one of the others once and a seeded COMPACT_NEW of these, so that CI
# time stays about the same and every seed still tries some of them; the long schedule does all.
LATE_ACTIONS = ("failover", "rotate_password", "apt_upgrade", "apt_remove")
COMPACT_NEW = 2
# Added after those, and cheap (a few seconds, no restart): the compact schedule always does them, each
# put at a seeded place (a generator of its own, so the places LATE_ACTIONS get stay as they were).
NEWEST_ACTIONS = ("partition_hosts", "pg_stall")


@dataclass(frozen=True)
class Action:
    at: float            # planned offset from the start of the schedule, seconds
    name: str
    target: int          # 0-based member index (ignored by fleet-wide actions)
    seconds: float       # how long the fault lasts (0 for instant actions)
    pick: float          # a draw in [0, 1) for actions that choose a run

    @property
    def partner(self) -> int:
        """The other host of a host-to-host partition: one of the two that are not `target`."""
        return (self.target + 1 + int(self.pick * 2)) % len(HOST_IDS)

    def describe(self) -> str:
        where = f" {HOST_IDS[self.target]}" if self.name in ON_ONE_HOST else ""
        if self.name == "partition_hosts":
            where += f"|{HOST_IDS[self.partner]}"
        lasting = f" for {self.seconds:.0f}s" if self.seconds else ""
        return f"t+{self.at:4.0f}s {self.name}{where}{lasting}"


def _duration(name: str, rng: random.Random) -> float:
    """How long a fault lasts: around host_dead_after where that is what decides."""
    spans = {
        "kill9": (0.5, 4), "stop_long": (DEAD_AFTER + 4, DEAD_AFTER + 8), "power_cut": (2, DEAD_AFTER + 8),
        "partition_reset": (3, DEAD_AFTER + 10), "partition_blackhole": (3, DEAD_AFTER + 10),
        "pg_restart": (0, 6), "clone": (4, 10), "wrong_dsn": (DEAD_AFTER + 4, DEAD_AFTER + 8), "drain": (3, 12),
        # no primary between its crash and the standby's promotion; the old password in the DSN file
        # after a rotation; the package removed (runs drained first)
        "failover": (0, 6), "rotate_password": (1, DEAD_AFTER + 8), "apt_remove": (2, DEAD_AFTER + 8),
        "partition_hosts": (2, 6),
        # the database answering nothing for longer than host_dead_after (issue 23: a busy database
        # never kills a live host), shorter than the daemon's 20 s before it gives a connection up
        "pg_stall": (DEAD_AFTER + 2, DEAD_AFTER + 8),
    }
    low, high = spans.get(name, (0, 0))
    return round(rng.uniform(low, high), 1) if high else 0.0


OVERHEAD = {"power_cut": 6, "reboot": 8, "clone": 10, "kill9": 2, "restart": 2, "stop_long": 2, "wrong_dsn": 4,
            "failover": 6, "rotate_password": 6, "apt_upgrade": 3, "apt_remove": 12}


def clone_target(seed: int) -> int:
    """Which host the clone machine copies (its id), for the whole schedule: a machine's journal
    records are mapped to one host id."""
    return random.Random(seed ^ 0x5EED).randrange(len(HOST_IDS))


def plan(seed: int, seconds: float, faults: dict[str, int] | None = None, compact: bool = False) -> list[Action]:
    """The schedule for `seconds`: every fault once first (in a seeded order, so that even a short
    schedule covers them all), then weighted random draws; a pause of 2 to 6 s after each.
    `compact` (CI's): every fault exactly once, whatever `seconds`, none lasting longer than
    host_dead_after + 3 s, with pauses of 1 to 2 s; but of LATE_ACTIONS only a seeded COMPACT_NEW
    (unless `faults` names them), each put at a seeded place into what the schedule was before they
    existed, which stays as it was for a seed (drawn from the same generator in the same order)."""
    weights = dict(faults or FAULTS)
    added: list[str] = []
    if compact and faults is None:
        extra = random.Random(seed ^ 0xC1)
        added = extra.sample(LATE_ACTIONS, COMPACT_NEW)
        weights = {name: weight for name, weight in weights.items()
                   if name not in LATE_ACTIONS and name not in NEWEST_ACTIONS}
    rng = random.Random(seed)
    names = sorted(weights)
    rng.shuffle(names)
    steps: list[tuple[str, int, float, float, float]] = []  # name, target, seconds, pick, pause after
    at = 3.0
    while (names if compact else at < seconds):
        name = names.pop(0) if names else rng.choices(list(weights), list(weights.values()))[0]
        steps.append(_step(seed, name, rng, compact))
        at += steps[-1][2] + OVERHEAD.get(name, 1) + steps[-1][4]
    for name in added:
        steps.insert(extra.randrange(len(steps) + 1), _step(seed, name, extra, compact))
    if compact and faults is None:
        newest = random.Random(seed ^ 0xC2)
        for name in NEWEST_ACTIONS:
            steps.insert(newest.randrange(len(steps) + 1), _step(seed, name, newest, compact))
    actions: list[Action] = []
    at = 3.0
    for name, target, lasting, pick, pause in steps:
        actions.append(Action(round(at, 1), name, target, lasting, pick))
        at += lasting + OVERHEAD.get(name, 1) + pause
    return actions


def _step(seed: int, name: str, rng: random.Random, compact: bool) -> tuple[str, int, float, float, float]:
    target = clone_target(seed) if name == "clone" else rng.randrange(len(HOST_IDS))
    lasting = _duration(name, rng)
    if compact:
        lasting = min(lasting, DEAD_AFTER + 3)
    pick = rng.random()
    return name, target, lasting, pick, rng.uniform(1, 2) if compact else rng.uniform(2, 6)


@dataclass
class Figures:
    submitted: int = 0
    submitted_by_cli: int = 0
    submit_errors: int = 0
    actions_done: Counter = field(default_factory=Counter)
    action_errors: list[str] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)  # e.g. apt_remove refused, rotate_password forced


class Nemesis:
    """One schedule on one fleet: setup, faults, quiesce, collection, audit."""

    def __init__(self, seed: int, seconds: float, faults: dict[str, int] | None = None,
                 out: Path | None = None, log: Callable[[str], None] = print, compact: bool = False,
                 packaged: bool | None = None) -> None:
        self.seed = seed
        # The hosts run the real .deb (dpkg -i, /usr/bin/unitvisor, the package's units and maintainer
        # scripts), and apt_upgrade/apt_remove are real dpkg runs: in the long schedule. CI's compact one
        # keeps the checkout's virtualenv and the stand-ins (_prerm_stand_in): building the .deb (half a
        # minute idle, minutes under CI's load, and CI's package pass builds its own) and three
        # installs would not fit its time budget; tests/package checks the maintainer scripts there.
        self.packaged = (not compact) if packaged is None else packaged
        self.deb: Path | None = None           # the .deb as built (packaged)
        self.debs: dict[str, Path] = {}        # host id -> the .deb installed there now (packaged)
        self.upgrades = 0
        self.scratch = Path(tempfile.mkdtemp(prefix="unitvisor-nemesis-"))
        self.schedule = plan(seed, seconds, faults, compact)
        self.seconds = self.schedule[-1].at + self.schedule[-1].seconds if compact and self.schedule else seconds
        self.out = out
        self.log = log
        self.runs_rng = random.Random(seed * 7919 + 1)  # the submitted runs' shapes
        self.clone_of = clone_target(seed)
        self.figures = Figures()
        self.samples: list[Sample] = []
        self.stop = threading.Event()          # no more actions, no more submits
        self.stop_sampling = threading.Event()
        self.started = 0.0
        self.pg: Postgres | None = None        # the primary now
        self.standby: Postgres | None = None   # its synchronous standby (none between a failover and its rebuild)
        self.failovers = 0
        self.operations: list[Operation] = []
        self.contacts: list[Contact] = []       # sockets listed during host-to-host partitions
        self.faults: list[Fault] = []           # each action as carried out, on the journal's clock
        self.declarations: list[Declaration] = []  # the hosts each daemon declared dead (collected at the end)
        self.passwords: dict[str, str] = {}    # host id -> its role's password now
        self.fleet: Fleet | None = None
        self.clone: Fleet | None = None
        self.clone_booted = False
        self.dsn = ""
        self.boots: dict[str, int] = {}  # machine -> boots its journal knows, for the figures

    # -- the whole thing --------------------------------------------------------------------------

    def run(self) -> tuple[Report, str]:
        with self.environment():
            threads = [threading.Thread(target=self._submitter, name="submitter", daemon=True),
                       threading.Thread(target=self._sampler, name="sampler", daemon=True)]
            self.started = time.monotonic()
            for thread in threads:
                thread.start()
            try:
                self._execute()
                self._quiesce()
            finally:
                self.stop.set()
                self.stop_sampling.set()
                for thread in threads:
                    thread.join(timeout=60)
            records, attempts, runs = self._collect()
        report = check(records, attempts, runs, self.samples, operations=self.operations, contacts=self.contacts,
                       declarations=self.declarations, faults=self.faults, dead_after=DEAD_AFTER)
        text = format_report(self.seed, self._schedule_text(), report, self._figures(attempts, runs))
        if self.out:
            self._dump(records, attempts, runs, text)
        return report, text

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """PostgreSQL, the fleet of three (each behind its own proxy) and the clone's machine; all of
        it removed on the way out, whatever happened."""
        reason = testbed_mod.available()
        if reason:
            raise RuntimeError(reason)
        testbed_mod.cleanup_stale()
        with contextlib.ExitStack() as stack:
            # A primary and its synchronous standby (tests/harness/postgres.py, make_standby: a failover
            # then loses no commit a daemon was told of); every role but the harness's superuser logs in
            # with its password, so that a rotated password locks the old one out.
            self.pg = Postgres(settings={"synchronous_commit": "on"})
            stack.callback(self._stop_databases)
            self.pg.init()
            self.pg.require_passwords()
            self.pg.start()
            with store.connect(self.pg.dsn) as conn:
                conn.execute(f"CREATE DATABASE {DB}")
            self.standby = self.pg.make_standby(synchronous=True, name="gen0")
            # Both servers, whichever accepts writes: every host has a proxy in front of each.
            self.dsn = multi_host_dsn(self.pg, self.standby, dbname=DB)
            with store.connect(self.dsn) as conn:
                store.migrate(conn)
                for host_id in HOST_IDS:  # `unitvisor hosts add`: each host its own role, as installed
                    self.passwords[host_id] = random.SystemRandom().randbytes(18).hex()
                    store.add_host_role(conn, host_id, store.default_host_role_name(host_id), self.passwords[host_id])
            configs = {h: fleet_config(h, poll=POLL, dead_after=DEAD_AFTER, stop_grace=STOP_GRACE, cut_off=True)
                       for h in HOST_IDS}
            fleet = Fleet(self.dsn, size=3, prefix="uv-nem", host_ids=HOST_IDS, proxied=True, configs=configs)
            for member in fleet:
                member.host.dsn = self._role_dsn(member.host.dsn, member.host_id)
            self.fleet = stack.enter_context(fleet)
            clone_id = HOST_IDS[self.clone_of]
            self.clone = Fleet(self.dsn, size=1, prefix="uv-nemclone", host_ids=[clone_id],
                               configs={clone_id: configs[clone_id]})
            self.clone[0].host.dsn = self._role_dsn(self.dsn, clone_id)
            stack.callback(self.clone.destroy)
            stack.callback(shutil.rmtree, self.scratch, True)
            if self.packaged:
                self.deb = ensure_deb()
                with ThreadPoolExecutor(max_workers=len(HOST_IDS)) as pool:
                    list(pool.map(lambda m: self._install(m, self.deb), self.fleet))  # type: ignore[arg-type]
            for member in self.fleet:
                self._start_daemon(member)
            self.log(f"nemesis seed {self.seed}: {len(self.schedule)} actions in {self.seconds:.0f}s; "
                     f"fleet booted in {self.fleet.boot_seconds:.1f}s; the clone is {clone_id}'s")
            yield

    def _execute(self) -> None:
        for action in self.schedule:
            if self.stop.is_set():
                break
            delay = action.at - (time.monotonic() - self.started)
            if delay > 0:
                time.sleep(delay)
            self.log(f"[{time.monotonic() - self.started:6.1f}s] {action.describe()}")
            began, began_at = time.monotonic(), time.time()
            try:
                getattr(self, f"_do_{action.name}")(action)
                self.figures.actions_done[action.name] += 1
            except Exception as exc:  # an action that could not be done is reported, never fatal
                self.figures.action_errors.append(f"{action.describe()}: {exc!r}"[:300])
                self.log(f"    failed: {exc!r}"[:300])
            self.faults.append(Fault(action.name, HOST_IDS[action.target] if action.name in ON_ONE_HOST else "",
                                     began_at, time.time()))
            self.log(f"    done in {time.monotonic() - began:.1f}s")

    def _role_dsn(self, dsn: str, host_id: str) -> str:
        """`dsn` (the servers, or the host's proxies) logged in as the host's own role."""
        return make_conninfo(dsn, user=store.default_host_role_name(host_id), password=self.passwords[host_id])

    def _stop_databases(self) -> None:
        try:
            if self.standby is not None:
                self.standby.stop()
        finally:
            if self.pg is not None:
                self.pg.stop()

    # -- faults and operator actions --------------------------------------------------------------

    def _member(self, action: Action) -> Member:
        assert self.fleet is not None
        return self.fleet[action.target]

    def _start_daemon(self, member: Member, timeout: float = 300) -> None:
        """Start the daemon and wait until it is up. Without blocking on the start job: on this
        shared 2-core machine a start once took longer than the harness's 120 s bound for a call."""
        member.tb.run("systemctl", "reset-failed", "unitvisor.service", check=False)
        # The clone keeps the virtualenv's units: its daemon is refused the id while the real host
        # holds it, and dpkg would take that refused start for a failed postinst (a half-installed
        # package on the clone, the action reported as failed).
        if not self.packaged or (self.clone is not None and member is self.clone[0]):
            member.host.install_units()
        elif not (member.tb.root / "usr/lib/systemd/system/unitvisor.service").exists():
            self._install(member, self.debs[member.host_id])  # removed (an apt_remove cut short): back
        member.tb.run("systemctl", "start", "--no-block", "unitvisor.service")
        wait_for(lambda: member.tb.run("systemctl", "is-active", "unitvisor.service", check=False).stdout.strip()
                 in ("active", "failed"), timeout=timeout, interval=0.5, what=f"{member.host_id}'s daemon to start")

    def _do_kill9(self, action: Action) -> None:
        member = self._member(action)
        member.host.kill()
        time.sleep(action.seconds)
        self._start_daemon(member)

    def _do_restart(self, action: Action) -> None:
        self._member(action).tb.run("systemctl", "restart", "unitvisor.service", timeout=120)

    def _do_stop_long(self, action: Action) -> None:
        """`systemctl stop unitvisor` for longer than host_dead_after, runs in flight."""
        member = self._member(action)
        member.host.stop()
        try:
            time.sleep(action.seconds)
        finally:
            self._start_daemon(member)

    def _do_power_cut(self, action: Action) -> None:
        member = self._member(action)
        member.power_cut()
        try:
            time.sleep(action.seconds)
        finally:
            member.boot()
            self._start_daemon(member)

    def _do_reboot(self, action: Action) -> None:
        member = self._member(action)
        member.tb.reboot(timeout=120)
        self._start_daemon(member)

    def _partition(self, action: Action, how: str) -> None:
        member = self._member(action)
        member.cut(how)  # type: ignore[arg-type]
        try:
            time.sleep(action.seconds)
        finally:
            member.heal()

    def _do_partition_reset(self, action: Action) -> None:
        self._partition(action, "reset")

    def _do_partition_blackhole(self, action: Action) -> None:
        self._partition(action, "blackhole")

    def _do_partition_hosts(self, action: Action) -> None:
        """Two hosts partitioned from each other, both still reaching PostgreSQL. The test beds share
        the machine's network namespace and each reaches PostgreSQL only through proxies of its own,
        so there is no link between two of them to cut: what the action does is show that there is
        nothing to cut. Every second for `seconds`, every socket of both hosts' daemon and fence is
        listed (`ss`, inside the host); the checker reports one that leads anywhere but the host's own
        proxies (`host-to-host`). The rest of the audit shows that nothing else changes (no start
        twice, no second live copy; no declaration is possible without a silence towards PostgreSQL)."""
        assert self.fleet is not None
        pair = (self._member(action), self.fleet[action.partner])
        until = time.monotonic() + action.seconds
        listed = 0
        while True:
            for member in pair:
                found = host_sockets(member)
                listed += len(found)
                self.contacts += found
            if time.monotonic() >= until:
                break
            time.sleep(1)
        self.log(f"    {listed} sockets of {pair[0].host_id} and {pair[1].host_id}'s daemons and fences listed, "
                 f"{sum(1 for c in self.contacts if not c.database)} not to PostgreSQL so far")

    def _do_pg_restart(self, action: Action) -> None:
        assert self.pg is not None
        self.pg.stop_server()
        try:
            time.sleep(action.seconds)
        finally:
            self.pg.start()

    def _do_pg_stall(self, action: Action) -> None:
        """The database answers nothing for a while but keeps every connection: an overloaded server, or
        one whose storage stalls, as its clients see it; the daemons' heartbeats are as late as a dead
        host's. Without burning CPU, which on CI's two cores would slow the fleet itself (issue 23)."""
        assert self.pg is not None
        with self.pg.stalled():
            time.sleep(action.seconds)

    def _do_clone(self, action: Action) -> None:
        """A second machine with the same host id comes up, and meanwhile the operator restarts the
        real host's daemon (the moment 0.5.1 lets a clone take the id); then the clone is unplugged."""
        assert self.clone is not None and self.fleet is not None
        clone = self.clone[0]
        if not clone.tb.running:
            if self.clone_booted:
                clone.configure()  # the DSN of now (a rotated password)
                clone.boot()
            else:
                self.clone.boot()
                self.clone_booted = True
        try:
            self._start_daemon(clone)
            time.sleep(2)
            self.fleet[self.clone_of].tb.run("systemctl", "restart", "unitvisor.service", timeout=120)
            time.sleep(action.seconds)
        finally:
            if clone.tb.running:
                clone.power_cut()

    def _do_wrong_dsn(self, action: Action) -> None:
        """The daemon restarted with a DSN that names a port nobody listens on, fixed later."""
        member = self._member(action)
        ports = ",".join(str(free_port()) for _ in member.proxies)  # one per server the DSN names
        wrong = make_conninfo(member.dsn, port=ports)
        member.tb.write("/etc/unitvisor/dsn", wrong + "\n")
        member.tb.run("systemctl", "restart", "unitvisor.service", check=False, timeout=120)
        try:
            time.sleep(action.seconds)
        finally:
            member.configure()
            member.tb.run("systemctl", "reset-failed", "unitvisor.service", check=False)
            member.tb.run("systemctl", "restart", "unitvisor.service", timeout=120)

    def _do_failover(self, action: Action) -> None:
        """The primary's machine dies (an immediate stop: sessions cut, no shutdown checkpoint) and,
        `seconds` later, its synchronous standby is promoted. A new standby is then made from the new
        primary on the old one's port, behind the same proxies, so that the next failover has one."""
        assert self.pg is not None
        if self.standby is None:
            raise RuntimeError("no standby to fail over to")
        old, new = self.pg, self.standby
        old.stop_server("immediate")
        time.sleep(action.seconds)
        new.promote()
        self.pg, self.standby = new, None
        port = old.port
        old.stop()
        self.failovers += 1
        try:
            self.standby = new.make_standby(synchronous=True, name=f"gen{self.failovers}", port=port)
        except BaseException:
            # It may already be named in synchronous_standby_names: every commit would wait for it forever.
            with new.connect() as conn:
                conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
                conn.execute("SELECT pg_reload_conf()")
            raise
        self.log(f"    {new.application_name} promoted; new standby gen{self.failovers} on port {port}")

    def _host_live(self, host_id: str) -> bool:
        """Live beyond doubt: active or draining, heartbeat within half of host_dead_after."""
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
            row = next((r for r in store.list_hosts(conn) if r["id"] == host_id), None)
        return bool(row and row["state"] in ("active", "draining") and row["heartbeat_age"] < DEAD_AFTER / 2)

    def _do_rotate_password(self, action: Action) -> None:
        """`unitvisor hosts add HOST --new-password`: its guard refuses while the host is live, so the
        operator forces it; the daemon is restarted with the old password still in its DSN file (locked
        out, a wrong DSN) for `seconds`; then the file gets the new DSN and the daemon is restarted."""
        member = self._member(action)
        host_id = member.host_id
        live = self._host_live(host_id)
        first = self._cli_result("hosts", "add", host_id, "--new-password", "--json")
        refused = first.returncode != 0
        self.operations.append(Operation(time.time(), "rotate_password", host_id, live, refused,
                                         f"{host_id} was live (heartbeat within host_dead_after / 2)"))
        out = first.stdout
        if refused:
            self.figures.outcomes["rotate_password refused"] += 1
            forced = self._cli_result("hosts", "add", host_id, "--new-password", "--force", "--json")
            if forced.returncode != 0:
                raise RuntimeError(f"hosts add --new-password --force: {forced.stderr.strip()[:200]}")
            out = forced.stdout
        self.figures.outcomes["rotate_password forced" if refused else "rotate_password done"] += 1
        self.passwords[host_id] = str(conninfo_to_dict(json.loads(out)["dsn"])["password"])
        member.tb.run("systemctl", "restart", "unitvisor.service", check=False, timeout=120)  # locked out
        try:
            time.sleep(action.seconds)
        finally:
            member.host.dsn = self._role_dsn(member.host.dsn, host_id)
            member.configure()
            member.tb.run("systemctl", "reset-failed", "unitvisor.service", check=False)
            member.tb.run("systemctl", "restart", "unitvisor.service", timeout=120)
            if host_id == HOST_IDS[self.clone_of]:  # a clone is a copy of the host's disk: it gets the new one
                assert self.clone is not None
                self.clone[0].host.dsn = self._role_dsn(self.dsn, host_id)

    def _install(self, member: Member, deb: Path) -> None:
        """`dpkg -i` of `deb` on the host, as an administrator installs or upgrades it: the package's
        own maintainer scripts run (an upgrade's prerm, postinst's enable and (re)start of the daemon
        and the fence). The configuration the harness wrote is kept (--force-confold, as answering
        "keep" to dpkg's question). Restart=no (a drop-in, written once) so that, as with the
        virtualenv's units, a drill decides when the daemon comes back."""
        if not (member.tb.root / "etc/systemd/system/unitvisor.service.d/nemesis.conf").exists():
            member.tb.write("/etc/systemd/system/unitvisor.service.d/nemesis.conf", "[Service]\nRestart=no\n")
            # The machine's / (the test bed's lower layer) is a container image whose policy-rc.d
            # forbids maintainer scripts to start or stop services: a host's own dpkg must.
            member.tb.run("rm", "-f", "/usr/sbin/policy-rc.d")
            member.tb.run("systemctl", "daemon-reload")
        target = member.tb.root / "var/cache/unitvisor-nemesis" / deb.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copyfile(deb, target)
        inside = f"/{target.relative_to(member.tb.root)}"
        inside = f"/{target.relative_to(member.tb.root)}"
        result = member.tb.run("dpkg", "-i", "--force-confold", "--force-confdef", inside, check=False, timeout=300,
                               env={"DEBIAN_FRONTEND": "noninteractive"})
        if result.returncode != 0:
            raise RuntimeError(f"dpkg -i {deb.name} on {member.host_id} exited {result.returncode}: "
                               f"{(result.stdout + result.stderr).strip()[-300:]}")
        self.debs[member.host_id] = deb

    def _prerm(self, member: Member, *args: str) -> subprocess.CompletedProcess:
        """The package's own prerm (debian/unitvisor.prerm), as dpkg runs it. Its #DEBHELPER# line is a
        comment in the source: what debhelper puts there (stopping the services) the callers do."""
        return member.tb.run("sh", str(REPO / "debian" / "unitvisor.prerm"), *args, check=False, timeout=60)

    def _do_apt_upgrade(self, action: Action) -> None:
        """`apt install` of a newer .deb, runs in flight, as its maintainer scripts do it: the prerm
        (`upgrade`: never refused), the files replaced (the unit files written again; the test beds run
        the daemon from this checkout, so the code itself does not change), daemon-reload, and both
        services restarted (dh_installsystemd's postinst)."""
        member = self._member(action)
        if self.packaged:
            assert self.deb is not None
            self.upgrades += 1
            newer = versioned_deb(self.deb, f"+nemesis{self.upgrades}", self.scratch)
            self._install(member, newer)  # the old prerm `upgrade`, unpack, postinst `configure`: restarts
            self.log(f"    {member.host_id} upgraded to {newer.name} by dpkg -i")
            return
        result = self._prerm(member, "upgrade", "0.6.0")
        if result.returncode != 0:
            raise RuntimeError(f"prerm upgrade refused: {result.stderr.strip()[:200]}")
        member.host.install_units()
        member.tb.run("systemctl", "restart", "unitvisor-fence.service", "unitvisor.service", timeout=120)

    def _do_apt_remove(self, action: Action) -> None:
        """`apt remove unitvisor`, with a run in flight if one comes within 10 s: the prerm refuses while
        a run unit is loaded. For half the draws the operator then does what its message says (drain,
        wait until no run unit is loaded, remove); for the other half leaves it installed. Removed is
        what the package's scripts do: both services stopped, the unit files gone, systemd reloaded;
        `seconds` later it is installed again (and undrained)."""
        member = self._member(action)
        # With runs in flight, the case the guard is for (issue 21): wait a little for one if none is.
        with contextlib.suppress(AssertionError):
            wait_for(member.host.loaded_run_units, timeout=10, interval=0.5, what=f"a run on {member.host_id}")
        drained = False
        try:
            removed = self._remove(member)
            if not removed and action.pick < 0.5:
                self._cli("drain", member.host_id)
                drained = True
                with contextlib.suppress(AssertionError):
                    wait_for(lambda: not member.host.loaded_run_units(), timeout=40, interval=1,
                             what=f"{member.host_id}'s run units to end")
                removed = self._remove(member)
            if removed:
                try:
                    time.sleep(action.seconds)
                finally:
                    self._start_daemon(member)  # installed again: the unit files, daemon-reload, start
        finally:
            if drained:
                self._cli("undrain", member.host_id)

    def _remove(self, member: Member) -> bool:
        before = set(member.host.loaded_run_units())
        if self.packaged:  # the real thing: dpkg runs the prerm, removes the files, runs the postrm
            result = member.tb.run("dpkg", "-r", "unitvisor", check=False, timeout=300,
                                   env={"DEBIAN_FRONTEND": "noninteractive"})
            if result.returncode != 0 and "refusing to remove" not in result.stderr:
                raise RuntimeError(f"dpkg -r unitvisor exited {result.returncode}: {result.stderr.strip()[-300:]}")
        else:
            result = self._prerm(member, "remove")
        held = before & set(member.host.loaded_run_units())  # loaded throughout: the prerm saw them
        refused = result.returncode != 0
        self.operations.append(Operation(time.time(), "apt_remove", member.host_id, bool(held), refused,
                                         f"run units stayed loaded: {', '.join(sorted(held)[:3])}"))
        self.figures.outcomes["apt_remove refused" if refused else "apt_remove removed"] += 1
        self.log(f"    apt remove on {member.host_id}: {'refused' if refused else 'removed'} "
                 f"({len(before)} run units loaded before)")
        if refused or self.packaged:
            return not refused
        # What dh_installsystemd's prerm and postrm do after the package's own check.
        member.tb.run("systemctl", "stop", "unitvisor.service", "unitvisor-fence.service", check=False, timeout=120)
        member.tb.run("rm", "-rf", "/etc/systemd/system/unitvisor.service", "/etc/systemd/system/unitvisor.service.d",
                      "/etc/systemd/system/unitvisor-fence.service", "/etc/systemd/system/unitvisor-fence.service.d",
                      "/etc/systemd/system/unitvisor.slice", check=False)
        member.tb.run("systemctl", "daemon-reload", check=False)
        return True

    def _do_drain(self, action: Action) -> None:
        host_id = HOST_IDS[action.target]
        self._cli("drain", host_id)
        try:
            time.sleep(action.seconds)
        finally:
            self._cli("undrain", host_id)

    def _do_cancel(self, action: Action) -> None:
        self._act_on_a_run(action, "cancel", ("queued", "starting", "running"))

    def _do_resume(self, action: Action) -> None:
        self._act_on_a_run(action, "resume", ("failed", "cancelled"))

    def _act_on_a_run(self, action: Action, verb: str, states: tuple[str, ...]) -> None:
        rows = self._sql("SELECT id FROM unitvisor.runs WHERE state = ANY(%s) ORDER BY created_at, id", (list(states),))
        if not rows:
            self.log(f"    no run to {verb}")
            return
        run_id = str(rows[int(action.pick * len(rows))][0])
        try:
            self._cli(verb, run_id)
        except RuntimeError as exc:
            # The run moved on between the choice and the command (it ended; it was retried): the
            # CLI refuses, which is its documented answer, not a failed action.
            if "already" not in str(exc) and "nothing to" not in str(exc):
                raise
            self.log(f"    {verb} {run_id}: refused, the run moved on: {exc}"[:300])
            return
        self.log(f"    {verb} {run_id}")

    def _cli(self, *args: str) -> str:
        """The unitvisor command, run by an operator on a host that is up, straight to PostgreSQL."""
        result = self._cli_result(*args)
        if result.returncode != 0:
            raise RuntimeError(f"unitvisor {' '.join(args)}: {result.stderr.strip()[:200]}")
        return result.stdout

    def _cli_result(self, *args: str) -> subprocess.CompletedProcess:
        assert self.fleet is not None
        for member in self.fleet:
            if member.tb.running and member.tb.leader:
                return member.tb.run(str(VENV_BIN / "unitvisor"), "--dsn", self.dsn, *args, check=False, timeout=60)
        raise RuntimeError("no host is up to run the CLI on")

    def _sql(self, query: str, params: object = None) -> list[tuple]:
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    # -- runs flow ----------------------------------------------------------------------------------

    def _submitter(self) -> None:
        """Short runs, some failing, some with retries, some at most once, some with a concurrency key,
        mostly through SQL and some through the CLI, until the schedule ends."""
        rng = self.runs_rng
        while not self.stop.wait(rng.uniform(0.3, 1.2)):
            # Mostly short; one in six outlives host_dead_after (the runs a silent host's peers retry)
            # and always succeeds, so that its retries do not make the final wait long.
            sleep = rng.choice((1, 2, 3, 5, 8, 20))
            code = 3 if rng.random() < 0.15 and sleep < 20 else 0
            attempts = 3 if rng.random() < 0.6 else 1
            retry_on = ["exit-code"] if rng.random() < 0.3 else None  # at most once for `lost`
            key = rng.choice(("nem-a", "nem-b")) if rng.random() < 0.1 else None
            by_cli = rng.random() < 0.1
            argv = ["/bin/sh", "-c", f"sleep {sleep}; exit {code}"]
            try:
                if self._sql(UNENDED_RUNS)[0][0] >= MAX_IN_FLIGHT:
                    continue
                if by_cli:
                    args = ["submit", "--max-attempts", str(attempts)]
                    args += ["--concurrency-key", key] if key else []
                    self._cli(*args, "--", *argv)
                    self.figures.submitted_by_cli += 1
                else:
                    self._sql("SELECT unitvisor.submit_run(%s, max_attempts => %s, retry_on => %s, "
                              "concurrency_key => %s, retry_backoff_sec => 2, retry_backoff_max_sec => 4)",
                              (argv, attempts, retry_on, key))
                self.figures.submitted += 1
            except Exception:  # PostgreSQL restarting, no host up for the CLI: the next one
                self.figures.submit_errors += 1

    def _sampler(self) -> None:
        """Every second, the live run units of every machine that is up, listed in parallel."""
        assert self.fleet is not None and self.clone is not None
        machines = [*self.fleet, self.clone[0]]
        with ThreadPoolExecutor(max_workers=len(machines)) as pool:
            number = 0
            while not self.stop_sampling.wait(1.0):
                number += 1
                for sample in pool.map(lambda m, n=number: self._sample(m, n), machines):
                    if sample is not None:
                        self.samples.append(sample)

    def _sample(self, member: Member, number: int) -> Sample | None:
        if not (member.tb.running and member.tb.leader):
            return None
        try:
            units = list_live_units(member)
        except Exception:  # powered off between the check and the call
            return None
        return Sample(number, time.time(), member.tb.name, self._host_id_of(member), units)

    def _host_id_of(self, member: Member) -> str:
        assert self.clone is not None
        return HOST_IDS[self.clone_of] if member is self.clone[0] else member.host_id

    # -- the end ---------------------------------------------------------------------------------------

    def _quiesce(self, timeout: float = 150) -> None:
        """Undo every fault, stop submitting, let every run end."""
        assert self.fleet is not None and self.pg is not None and self.clone is not None
        self.log(f"[{time.monotonic() - self.started:6.1f}s] quiesce: heal, boot, fix, start; wait for every run")
        self.stop.set()
        if not self.pg.running:
            self.pg.start()
        if self.clone[0].tb.running:
            self.clone[0].power_cut()
        for member in self.fleet:
            member.heal()
            if not member.tb.running:
                member.boot()
            member.configure()
            if member.tb.run("systemctl", "is-active", "unitvisor.service", check=False).stdout.strip() != "active":
                self._start_daemon(member)
        for host_id in HOST_IDS:
            with contextlib.suppress(Exception):
                self._cli("undrain", host_id)
        waited = time.monotonic()
        try:
            wait_for(lambda: self._sql(UNENDED_RUNS)[0][0] == 0,
                     timeout=timeout, interval=1, what="every run to end")
        except AssertionError as exc:
            self.log(f"    {exc} (the checker reports what is unsettled)")
        self.log(f"    every run ended after {time.monotonic() - waited:.0f}s")
        time.sleep(2)  # one more sample of a settled fleet

    def _collect(self) -> tuple[list[JournalRecord], list[Attempt], list[Run]]:
        assert self.fleet is not None and self.clone is not None
        records: list[JournalRecord] = []
        machines = [*self.fleet] + ([self.clone[0]] if self.clone_booted else [])
        for member in machines:
            records += parse_journal(member.tb.name, self._host_id_of(member), read_journal(member).splitlines())
            self.declarations += parse_declarations(self._host_id_of(member),
                                                    read_journal(member, DAEMON_UNIT).splitlines())
        attempts, runs = database_history(self.dsn)
        self.boots = {member.tb.name: len(member.boots()) for member in machines if member.tb.running}
        return records, attempts, runs

    def _schedule_text(self) -> list[str]:
        return [a.describe() for a in self.schedule] + [f"not done: {e}" for e in self.figures.action_errors]

    def _figures(self, attempts: list[Attempt], runs: list[Run]) -> dict[str, object]:
        done = self.figures.actions_done
        return {
            "seconds": round(time.monotonic() - self.started),
            "actions": sum(done.values()),
            "by_kind": dict(sorted(done.items())),
            "submitted": self.figures.submitted,
            "by_cli": self.figures.submitted_by_cli,
            "submit_errors": self.figures.submit_errors,
            "failovers": self.failovers,
            "operator_outcomes": dict(sorted(self.figures.outcomes.items())),
            "states": dict(Counter(r.state for r in runs)),
            "outcomes": dict(Counter(a.outcome for a in attempts)),
            "boots": self.boots,
        }

    def _dump(self, records: list[JournalRecord], attempts: list[Attempt], runs: list[Run], text: str) -> None:
        """Everything the checker read, so that it can be audited again without a fleet."""
        assert self.out is not None
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "report.txt").write_text(text + "\n")
        (self.out / "history.json").write_text(json.dumps({
            "seed": self.seed, "schedule": self._schedule_text(),
            "journal": [asdict(r) for r in records], "attempts": [asdict(a) for a in attempts],
            "runs": [asdict(r) for r in runs], "samples": [asdict(s) for s in self.samples],
            "operations": [asdict(o) for o in self.operations],
            "contacts": [asdict(c) for c in self.contacts], "faults": [asdict(f) for f in self.faults],
            "declarations": [asdict(d) for d in self.declarations], "dead_after": DEAD_AFTER}))


def ensure_deb() -> Path:
    """build/deb/unitvisor_<version>_all.deb of this checkout as it is now (HEAD and uncommitted
    edits of tracked files), built by packaging/build-deb when the one there is of another source.
    Under an flock, so that two nemeses of one checkout build it once. Without the unit tests
    (DEB_BUILD_OPTIONS=nocheck): they are CI's first pass; here they would double the build."""
    out = REPO / "build" / "deb"
    out.mkdir(parents=True, exist_ok=True)
    source = hashlib.sha256()
    for cmd in (["git", "rev-parse", "HEAD^{tree}"], ["git", "diff", "HEAD", "--binary"]):
        source.update(subprocess.run(cmd, cwd=REPO, capture_output=True, check=True).stdout)
    stamp = out / ".nemesis-source"
    with open(out / ".nemesis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        debs = sorted(out.glob("unitvisor_*_all.deb"))
        if len(debs) == 1 and stamp.exists() and stamp.read_text() == source.hexdigest():
            return debs[0]
        result = subprocess.run([str(REPO / "packaging" / "build-deb")], capture_output=True, text=True,
                                env={**os.environ, "DEB_BUILD_OPTIONS": "nocheck"}, timeout=1800, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"packaging/build-deb exited {result.returncode}: {result.stderr[-2000:]}")
        stamp.write_text(source.hexdigest())
        return Path(result.stdout.strip().splitlines()[-1])


def versioned_deb(deb: Path, suffix: str, scratch: Path) -> Path:
    """`deb` again with `suffix` appended to its version (0.7.0 -> 0.7.0+nemesis1), so that dpkg -i of
    it is an upgrade (the old prerm's `upgrade`, the new postinst's restart) of the same code."""
    tree = scratch / f"tree{suffix}"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True, capture_output=True, timeout=120)
    control = tree / "DEBIAN" / "control"
    text = control.read_text()
    version = re.search(r"^Version: (\S+)$", text, re.M)
    assert version is not None, text
    control.write_text(text.replace(version.group(0), f"Version: {version.group(1)}{suffix}"))
    target = scratch / deb.name.replace(f"_{version.group(1)}_", f"_{version.group(1)}{suffix}_")
    subprocess.run(["dpkg-deb", "-Zgzip", "--build", str(tree), str(target)], check=True, capture_output=True,
                   timeout=120)
    shutil.rmtree(tree)
    return target


def database_history(dsn: str) -> tuple[list[Attempt], list[Run]]:
    """Every attempt row, and every run with what explains its state (policy, cancel, resumes)."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        attempts = [Attempt(str(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7]) for r in conn.execute(
            "SELECT run_id, attempt, host_id, unit_name, invocation_id, outcome, exit_status, reason "
            "FROM unitvisor.attempts ORDER BY run_id, attempt")]
        runs = [Run(str(r[0]), r[1], r[2], tuple(r[3]) if r[3] is not None else None, r[4], r[5], r[6], r[7], r[8])
                for r in conn.execute(
                    "SELECT r.id, r.state, r.max_attempts, r.retry_on, r.cancel_requested_at IS NOT NULL, "
                    "(SELECT count(*) FROM unitvisor.run_events e WHERE e.run_id = r.id "
                    "AND e.reason LIKE 'resumed by an operator%') ::int, r.concurrency_key, r.count_lost, "
                    "r.max_lost_attempts FROM unitvisor.runs r")]
    return attempts, runs


def list_live_units(member: Member) -> tuple[str, ...]:
    out = member.tb.run("systemctl", "list-units", "--all", "--plain", "--no-legend", "unitvisor-run-*",
                        check=False, timeout=10).stdout
    return live_units(out)


def live_units(list_units_output: str) -> tuple[str, ...]:
    """Run units whose process may run now (`systemctl list-units` lines; an exited, dead or failed
    unit is not live, nor a unit of 0.3.0 kept `active/exited`)."""
    live = []
    for line in list_units_output.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].startswith("unitvisor-run-") and parts[3] not in ("exited", "dead", "failed"):
            live.append(parts[0])
    return tuple(sorted(live))


def host_sockets(member: Member) -> list[Contact]:
    """Every TCP and UDP socket of the host's daemon and fence that has a peer, and whether that peer
    is one of the host's own proxies to PostgreSQL. `ss` runs inside the host: the network namespace
    is the machine's (every host's sockets are listed), but only the host's own processes are named."""
    pids: dict[int, str] = {}
    for unit in ("unitvisor.service", "unitvisor-fence.service"):
        out = member.tb.run("systemctl", "show", "-p", "MainPID", "--value", unit, check=False, timeout=10).stdout
        if out.strip().isdigit() and int(out) > 0:
            pids[int(out)] = unit
    if not pids:
        return []
    out = member.tb.run("ss", "-H", "-t", "-u", "-a", "-n", "-p", check=False, timeout=10).stdout
    ports = {str(proxy.port) for proxy in member.proxies}
    now = time.time()
    return [Contact(now, member.host_id, pids[pid], peer, peer.rsplit(":", 1)[1] in ports and
                    peer.rsplit(":", 1)[0] in ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]"))
            for pid, peer in socket_peers(out) if pid in pids]


def socket_peers(ss_output: str) -> list[tuple[int, str]]:
    """(pid, peer address:port) of every socket with a peer in `ss -H -tuanp` output; a listening or
    unconnected socket (peer `*`) has none."""
    found = []
    for line in ss_output.splitlines():
        parts = line.split()
        if len(parts) < 7 or parts[5].endswith(":*"):
            continue
        for pid in re.findall(r"pid=(\d+)", line):
            found.append((int(pid), parts[5]))
    return found


DAEMON_UNIT = "unitvisor.service"


def read_journal(member: Member, unit: str | None = None) -> str:
    """PID 1's records of every boot of a machine (or, with `unit`, that unit's own), read from its disk
    (the overlay's upper layer is on the harness's tmpfs), so that a machine that is powered off is read too."""
    match = f"_SYSTEMD_UNIT={unit}" if unit else "_PID=1"
    journal_dir = member.tb.root / "var/log/journal"
    if journal_dir.is_dir():
        result = subprocess.run(["journalctl", "-D", str(journal_dir), "-o", "json", "--no-pager", match],
                                capture_output=True, text=True, timeout=120, check=False)
        if result.stdout:
            return result.stdout
    if member.tb.running:
        return member.tb.run("journalctl", "-o", "json", "--no-pager", match, check=False, timeout=120).stdout
    return ""


def audit_history(history: dict) -> tuple[Report, str]:
    """The checker again over a history.json that a nemesis wrote."""
    report = check([JournalRecord(**r) for r in history["journal"]],
                   [Attempt(**a) for a in history["attempts"]],
                   [Run(**{**r, "retry_on": tuple(r["retry_on"]) if r["retry_on"] is not None else None})
                    for r in history["runs"]],
                   [Sample(**{**s, "units": tuple(s["units"])}) for s in history["samples"]],
                   operations=[Operation(**o) for o in history.get("operations", [])],
                   contacts=[Contact(**c) for c in history.get("contacts", [])],
                   declarations=[Declaration(**d) for d in history.get("declarations", [])],
                   faults=[Fault(**f) for f in history.get("faults", [])], dead_after=history.get("dead_after", 0.0))
    return report, format_report(history["seed"], history["schedule"], report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--seed", type=int, default=None, help="default: a new one, printed")
    parser.add_argument("--faults", default="", help="comma-separated fault names (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.txt and history.json")
    parser.add_argument("--audit", type=Path, default=None, metavar="HISTORY",
                        help="audit a history.json again (no fleet, no root) and exit")
    args = parser.parse_args(argv)
    if args.audit:
        report, text = audit_history(json.loads(args.audit.read_text()))
        print(text)
        return 1 if report.violations else 0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    faults = {name: FAULTS[name] for name in args.faults.split(",") if name} if args.faults else None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    out = args.out or Path("build/nemesis") / f"seed-{seed}"
    report, text = Nemesis(seed, args.minutes * 60, faults, out=out, log=lambda s: print(s, flush=True)).run()
    print(text)
    print(f"(history and report in {out})")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
