"""The one place that repairs state: it compares this host's open attempts with systemd's units and
acts on each pair. `decide` is pure and holds the whole policy; `Reconciler` carries decisions out.

Decision table (every row has a unit test in tests/unit/test_reconciler.py; decide_unstarted's rows,
over every answer of the journal, in tests/unit/test_journal_unreadable.py):

| attempt row                        | systemd has                 | action                                   |
|------------------------------------|-----------------------------|------------------------------------------|
| not started, run not cancelled     | no unit, none in a journal  | START it under the same name             |
|                                    | that reaches back to the    |                                          |
|                                    | claim (decide_unstarted)    |                                          |
| not started, run not cancelled     | no unit, but PID 1 logged it| GONE: started before a crash, then ended |
|                                    | (started, then collected)   | and collected: the journal's outcome     |
| not started, run not cancelled     | no unit, none in a journal  | GONE as lost: it may have run; never     |
|                                    | that does not reach back to | started again (the run retries by its    |
|                                    | the claim, or an older boot | policy, as a new attempt)                |
| not started, run not cancelled     | no unit, journal unreadable | WAIT: nothing proves it never started;   |
|                                    |                             | a later pass decides                     |
| not started, cancel requested      | no unit                     | SETTLE as cancelled, start nothing       |
| any                                | unit, process still running | ADOPT (record start and invocation id)   |
| any, cancel requested              | unit, process still running | STOP it; it settles as cancelled         |
| any, cancel requested              | unit, stopping with a job   | NOTHING: the stop is on its way          |
| any, cancel requested              | unit, stopping by itself    | STOP it all the same: a stop job thaws a |
|                                    | (no job: its runtime limit) | frozen unit, systemd's own stop does not |
| any                                | unit, ended                 | SETTLE with the unit's outcome, release  |
| started                            | no unit (reboot, reset, a   | GONE: cancelled if requested, else the   |
|                                    | clean end collected while   | journal's outcome, else lost; WAIT while |
|                                    | no daemon held it)          | the journal cannot be read               |
| outcome already recorded           | unit ended                  | RELEASE the unit (crash before release)  |
| outcome already recorded           | unit still running          | STOP_STALE: taken over while this host   |
|                                    |                             | was cut off, or cancelled; stop it       |
| open, on this host (claimed while  | unit with our prefix        | NOTHING: the next pass sees it as ours   |
| the pass listed units)             |                             |                                          |
| open, on another host              | unit with our prefix        | LEAVE it: never ours to stop             |
| no attempt row yet, run in flight  | unit with the attempt's name| LEAVE it: the claim will adopt it        |
| no attempt row at all              | unit with our prefix        | STOP_ORPHAN (or leave it, by config)     |

Ended units stay loaded for the daemon (AddRef at creation, Ref when adopted: a reference PID 1
holds for the daemon's bus connection) until their outcome is recorded; then they are released
(Unref, and reset-failed for a failed one). A unit of 0.3.0 (RemainAfterExit=yes) that ended is
`active/exited`: settled the same way, and released with a stop job as 0.3.0 did.

Between passes (the daemon's loop: a unit that changed, a run an operator cancelled) one row differs
(decide_on_change): a started attempt's running unit is left alone (NOTHING) even when its invocation id
is not recorded yet; the outcome or the next pass records it.

Time alone never proves a run of this host dead: an attempt is only settled from what systemd (or its
absence) says about its unit. Across hosts, time is all there is: a host silent for longer than its
host_dead_after is declared dead by the database (one live daemon at a time), and this module settles
its open attempts as `lost` (take_over_dead_hosts); fencing makes sure the dead host cannot write over it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import random
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import psycopg

from supervisor import faults, fence, fleet, outcomes, riversource, runenv, stopsignals, store, taskspeak, unitspec
from supervisor.config import Settings, cut_off_after
from supervisor.journal import History, Journal, TailReader, Unreadable
from supervisor.log import event
from supervisor.model import Accounting, Attempt, Run
from supervisor.outcomes import (
    Outcome,
    classify,
    failure_verdict,
    is_setup_exit,
    retry_delay,
    run_state_after,
    timeout_cause,
)
from supervisor.systemd import Systemd, SystemdError, SystemdUnavailable, UnitBrief, UnitRefused, UnitState

if TYPE_CHECKING:  # the CLI's passes count nothing, and need not import prometheus_client
    from supervisor.metrics import Metrics


class Action(enum.Enum):
    NOTHING = "nothing"
    START = "start"
    ADOPT = "adopt"
    STOP = "stop"
    SETTLE = "settle"
    GONE = "gone"
    RELEASE = "release"
    STOP_ORPHAN = "stop-orphan"
    LEAVE_ORPHAN = "leave-orphan"
    STOP_STALE = "stop-stale"
    WAIT = "wait"  # nothing can be decided until the journal can be read again: the next pass tries


@dataclass(frozen=True)
class Decision:
    action: Action
    unit_name: str
    reason: str
    outcome: Outcome | None = None
    invocation_id: str | None = None
    # What systemd said about the unit (None: not loaded), for its own timestamps and exit details.
    unit: UnitState | None = None
    # An orphan's ActiveState as listed (RELEASE: how to release it).
    unit_state: str | None = None
    # RELEASE of a unit whose outcome this host recorded: its output tail is read (again) as well.
    keep_output: bool = False


def is_stub(unit: UnitState) -> bool:
    """Whether a unit's state is that of an object PID 1 loaded afresh for a name it had just
    collected, not of any invocation: a D-Bus call on a unit's path loads the unit (LoadState
    not-found), which then reads inactive, Result=success, with no invocation and no main process
    (systemd 252 in the test bed). Systemd.state reads a unit with GetUnit, then a Get per property,
    so a unit collected between them reads so; an operator's `systemctl status` on a gone unit loads
    one too. Taken for an ended unit, it settled the attempt `lost` (its run retried, though it may
    have succeeded); taken for a loaded unit, a start "again" would create the unit anew."""
    return (unit.has_ended and not unit.invocation_id and unit.result == "success" and unit.exec_main_code == 0
            and not unit.exec_main_start_usec)


def decide(run: Run, attempt: Attempt, unit: UnitState | None) -> Decision:
    """What to do about one open attempt, given its unit's state (None: not loaded, or a stub)."""
    name = attempt.unit_name
    cancelled = run.cancel_requested_at is not None
    if unit is not None and is_stub(unit):
        unit = None  # the unit is gone: what is left to say how it ended is the journal
    if unit is None:
        if attempt.started_at is None:
            if cancelled:
                return Decision(Action.SETTLE, name, "cancelled before its unit started",
                                Outcome("cancelled", None, "cancelled before its unit started"))
            return Decision(Action.START, name, "claimed but no unit yet")
        return gone(run, name, "unit gone after a cancel request" if cancelled
                    else "unit is gone and left no outcome in systemd")
    if unit.has_ended:
        refused = fence.refused_start_outcome(unit.result, cancelled)
        if refused is not None:  # the lease check refused the start: the command never ran
            return Decision(Action.SETTLE, name, f"unit ended: {refused.reason}", refused,
                            unit.invocation_id or None, unit)
        # A Type=exec unit that ever became active had its command exec'd (see the note in outcomes.py).
        ran = True if unit.active_enter_usec else None
        outcome = classify(unit.result, unit.exec_main_code, unit.exec_main_status, cancel_requested=cancelled,
                           program_ran=ran, stop_signal=stopsignals.stop_signal(run),
                           timed_out_by=timeout_cause(run.runtime_max_sec, unit.active_enter_usec,
                                                       unit.exec_main_exit_usec))
        return Decision(Action.SETTLE, name, f"unit ended: {outcome.reason}", outcome, unit.invocation_id or None,
                        unit)
    if cancelled:
        if unit.active_state == "deactivating" and unit.job_pending:
            return Decision(Action.NOTHING, name, "stopping after a cancel request")
        if unit.active_state == "deactivating":
            # systemd stops it on its own, without a job: its RuntimeMaxSec= ran out. A frozen unit is not
            # thawed for that stop (service_dispatch_timer() calls service_enter_stop(), not unit_stop()),
            # so its processes never see the stop signal and it stays stopping. A StopUnit is a job, and
            # systemd thaws a unit before a job acts on it (systemctl(1), freeze): the cancel ends it.
            # For a unit that is not frozen it changes nothing: the stop under way goes on.
            return Decision(Action.STOP, name, "cancel requested while systemd stops the unit on its own",
                            invocation_id=unit.invocation_id or None, unit=unit)
        return Decision(Action.STOP, name, "cancel requested", invocation_id=unit.invocation_id or None, unit=unit)
    if attempt.started_at is None or (unit.invocation_id and not attempt.invocation_id):
        return Decision(Action.ADOPT, name, "unit is running; adopted", invocation_id=unit.invocation_id or None,
                        unit=unit)
    return Decision(Action.NOTHING, name, "unit is running")


# How many settled units the loop remembers between passes (Reconciler.settled_units): over a minute of a
# busy host's runs (about 200 a second with the sandbox off), 2.3 MB when full (measured, 60-character
# names); a host with fewer runs between passes holds that many fewer.
MAX_SETTLED_UNITS = 16384

# A started attempt whose unit is gone: the journal may still prove its outcome (Reconciler.apply).
GONE_LOST = Outcome("lost", None, "the unit disappeared (host reboot, reset, or ended while no daemon held it) "
                    "before its outcome was read, and the journal does not prove one")


def gone(run: Run, name: str, reason: str) -> Decision:
    """An attempt whose unit ran and is gone: cancelled if that was requested, else lost unless the
    journal proves an outcome (Reconciler.apply reads it)."""
    if run.cancel_requested_at is not None:
        return Decision(Action.GONE, name, reason, Outcome("cancelled", None, "cancelled; the unit is gone"))
    return Decision(Action.GONE, name, reason, GONE_LOST)


# An attempt claimed here whose unit is not loaded and that may have run: what the journal would say is lost.
UNPROVEN_LOST = Outcome("lost", None, "its unit is gone and may have run (the daemon may have died between starting "
                        "it and recording that): the journal no longer reaches back to its claim (rotated or "
                        "vacuumed, or an earlier boot's), so nothing proves it never ran; not started again")


def decide_unstarted(run: Run, attempt: Attempt, history: History, loaded_now: bool) -> Decision:
    """For an attempt that decide() would START (claimed here, never marked started, run not cancelled,
    no unit in the pass's view): whether it may be started. `history` is what the journal says about
    its unit, `loaded_now` whether the unit is loaded when asked again, live.

    A second start of the same attempt is the one move that is never undone, so START needs proof
    that its unit never ran: a journal that reaches back to the claim and knows no unit of that name.
    A daemon killed between StartTransientUnit and recording the start leaves exactly this row, with a
    unit that a clean end lets PID 1 collect at once (no daemon holds it): only the journal remembers it.
    The pure policy; Reconciler._unless_seen asks the journal and systemd."""
    name = attempt.unit_name
    if loaded_now:
        # The pass's listing predates a unit another process started since (the daemon, beside
        # `unitvisor reconcile` by hand). A unit loaded now is started "again", which is adoption.
        return Decision(Action.START, name, "its unit is loaded now: adopted")
    if history is History.UNKNOWN:
        return Decision(Action.START, name, "claimed but no unit yet (the journal reaches back to the claim and "
                        "knows none)")
    if history is History.KNOWN:
        return gone(run, name, "its unit was started before and is gone")
    if history is History.INCOMPLETE:
        return Decision(Action.GONE, name, "its unit is gone and the journal does not reach back to its claim",
                        UNPROVEN_LOST)
    return Decision(Action.WAIT, name, "the journal cannot be read, so nothing proves its unit never started; "
                    "not started until a later pass can read it")


def decide_on_change(run: Run, attempt: Attempt, unit: UnitState | None) -> Decision:
    """decide() for the daemon's loop between passes (a unit that changed, a run an operator cancelled).

    One row differs: a running unit of an attempt already recorded as started needs no write, even
    when its invocation id is not recorded yet. The daemon marks a unit it created as started without
    one (Reconciler.start); writing it when the unit's first change arrives cost a second mark_started
    for nearly every run (docs/benchmarks.md, Statements per run). It is written with the outcome, or
    by the next reconcile pass (decide's ADOPT), which is where a running unit's invocation id is
    needed: the pass reads in full only the units without one."""
    decision = decide(run, attempt, unit)
    if decision.action is Action.ADOPT and attempt.started_at is not None:
        return Decision(Action.NOTHING, attempt.unit_name, "unit is running; its invocation id is written with "
                        "its outcome or by the next pass")
    return decision


def change_needs_rows(unit_name: str, signalled: UnitState | None, started_units: Collection[str],
                      settled_units: Collection[str] = ()) -> bool:
    """Whether a unit's change must be decided on with its attempt's rows (store.open_attempts). Not when
    its signals say it is not over and its attempt is recorded as started (`started_units`): then
    decide_on_change says NOTHING whatever the rows hold, but for a cancelled run, which the cancel
    channel acts on (its NOTIFY, or the heartbeat's flag at the next poll), never a unit's signal. A unit
    starting, running and stopping changes several times, each once a wake-up of the loop: with sandboxed
    units slow to start, each was a statement of its own (0.9 a run, issue 27). Read as before: a unit
    whose signals did not say all of its state, one that ended, and one whose attempt may not be marked
    yet (its mark after the batch, or lost), which decide() would ADOPT. Nor a change of a unit whose
    attempt this daemon settled (`settled_units`): its outcome is written, never overwritten, and the
    unit released; PID 1 then collects it and says so (UnitRemoved), which was one more statement a run."""
    if unit_name in settled_units:
        return False
    return signalled is None or signalled.has_ended or unit_name not in started_units


def _started_at(decision: Decision) -> datetime | None:
    return decision.unit.started_at if decision.unit is not None else None


def _holder(owner: store.UnitOwner) -> str:
    # No host id: the run is pinned to a host whose runs this one may not read (sql/migrations/014_host_reads.sql).
    return f"host {owner.host_id}" if owner.host_id is not None else "another host"


def decide_orphan(unit_name: str, owner: store.UnitOwner | None, host_id: str, stop_orphans: bool,
                  running: bool, awaiting_claim: bool = False, active_state: str | None = None) -> Decision:
    """A unit with our prefix and no open attempt of this host in the pass's snapshot. `owner` is its
    attempt row as read after the units were listed; `running` whether its process still runs;
    `active_state` its ActiveState as listed."""
    if owner is not None and owner.outcome is None:
        if owner.host_id == host_id:
            return Decision(Action.NOTHING, unit_name, "claimed by this host while the pass ran; the next pass "
                            "looks at it")
        # Never ours to stop, whatever made it appear here (a changed [host] id, a restored image): the
        # host that owns the attempt decides, or the fleet declares that host dead.
        return Decision(Action.LEAVE_ORPHAN, unit_name, f"its attempt is open on {_holder(owner)}; left running")
    if owner is not None:
        if running:
            return Decision(Action.STOP_STALE, unit_name, f"its attempt already has an outcome ({owner.outcome}, "
                            f"recorded by {_holder(owner)}) but the unit still runs; stopping it")
        # The release after an outcome's commit was cut short (the daemon killed, the bus lost, a
        # refusal): so may its tail's read have been. Read again; an attempt that has one keeps it.
        return Decision(Action.RELEASE, unit_name, "outcome already recorded; releasing the unit",
                        unit_state=active_state, keep_output=owner.host_id == host_id)
    if awaiting_claim:
        # Stopping it would be the one wrong move: its run is still to be started, and the claim
        # that starts it will find this unit and adopt it instead of running the command twice.
        return Decision(Action.LEAVE_ORPHAN, unit_name, "its run is in flight and this attempt not yet "
                        "claimed; the claim will adopt it")
    if stop_orphans:
        return Decision(Action.STOP_ORPHAN, unit_name, "no attempt in the database owns this unit")
    return Decision(Action.LEAVE_ORPHAN, unit_name, "no attempt in the database owns this unit; left running by "
                    "config")


@dataclass(frozen=True)
class _Ending:
    """An outcome to record, and what to do once it is (settle's arguments)."""

    run: Run
    settling: store.Settling
    unit_exists: bool
    keep_output: bool
    unit_state: str | None


@dataclass(frozen=True)
class Planned:
    """One decision of a pass, with the run it concerns (None for an orphan unit)."""

    decision: Decision
    run: Run | None = None
    attempt: Attempt | None = None


# How much earlier than its claim the journal must reach back (Reconciler._claimed_since): asking for
# more only ever settles a never-started attempt `lost` instead of starting it, never the reverse.
CLAIM_MARGIN = timedelta(seconds=1)


class Reconciler:
    """Carries decisions out through the store and systemd. Every action is idempotent: a second
    start of a name adopts it, a second outcome write changes nothing, so a pass that is cut short
    by a crash is simply run again."""

    def __init__(self, settings: Settings, fence: store.Fence, conn: store.Connection, systemd: Systemd,
                 journal: Journal | None = None, cut_off_units: set[str] | None = None,
                 env_files: runenv.EnvironmentFiles | None = None,
                 tasks_peaks: taskspeak.TasksPeakFiles | None = None,
                 warnings: stopsignals.Schedule | None = None) -> None:
        """`cut_off_units`: units this host stopped itself while cut off from the database (the guard
        fills it); their outcome is `lost`, whatever the stop made them exit with. `env_files`: where
        runs' environments are written (runenv.DIRECTORY unless a test says otherwise); `tasks_peaks`:
        where units leave their peak number of tasks (taskspeak.DIRECTORY, likewise)."""
        self.settings = settings
        self.fence = fence
        self.host_id = fence.host_id
        self.conn = conn
        self.cut_off_units = cut_off_units if cut_off_units is not None else set()
        # Called once per run in a long pass: the daemon feeds systemd's watchdog there, so that a
        # pass over thousands of runs is not mistaken for a wedged loop.
        self.tick: Callable[[], None] = lambda: None
        self.metrics: Metrics | None = None  # the daemon's, which it sets
        self.systemd = systemd
        self.journal = journal or Journal()
        # Where the tails of this host's ended attempts are read; the daemon sets its threaded one,
        # which outlives a reconnect. Unthreaded (read at once) for a pass run by hand.
        self.output_tails = TailReader(self.journal, settings.runs.output_tail_lines, settings.runs.output_tail_bytes,
                                       threaded=False)
        self.env_files = env_files or runenv.EnvironmentFiles()
        self.tasks_peaks = tasks_peaks or taskspeak.TasksPeakFiles()
        # Read once: whether this host's kernel keeps a pids.peak for the units to copy (taskspeak.py).
        self.copy_tasks_peak = taskspeak.available()
        self.random = random.Random()
        self.settled = 0
        self.in_flight = 0
        # Units whose open attempt is recorded as started (change_needs_rows): marked by this daemon, or
        # found so by the last pass; dropped when the attempt settles, and by each pass when not open.
        self.started_units: set[str] = set()
        # Units whose attempt this daemon settled since the last pass (change_needs_rows); at most
        # MAX_SETTLED_UNITS, then forgotten (a change of one is read again: a statement, nothing more).
        self.settled_units: set[str] = set()
        # Whether an outcome recorded since the daemon last looked may have let a queued run start: one of
        # its concurrency key, or (a run with labels) under a named limit, which selects by labels. Those
        # runs become claimable with no NOTIFY; the daemon claims after such a settle (_claim_after_settle).
        self.freed_key = False
        self.freed_labelled = False
        self._batch: list[_Ending] | None = None  # inside batched_outcomes
        self.taken_over: list[tuple[str, str | None]] = []  # take_over_id's outcomes, counted after the commit
        # Warnings due to this host's running units (stopsignals.py): added when a unit is started, or
        # found by a pass (after a restart, from the unit's own start time); dropped once sent, or when
        # the attempt settles. The daemon's, which its loop's timer reads; a pass run by hand has its own.
        self.warnings = warnings if warnings is not None else stopsignals.Schedule()
        # Whether this host serves a River source whose schema it checked at connect (the daemon sets it):
        # then every pass finishes the River jobs it holds (finish_river_jobs).
        self.river_ready = False

    # -- planning ---------------------------------------------------------------------------------

    def plan(self) -> list[Planned]:
        """A whole pass, decided but not carried out (what `unitvisor reconcile --dry-run` prints)."""
        pairs = store.open_attempts(self.conn, self.host_id)
        units = self.systemd.list_units(unitspec.UNIT_GLOB)
        planned = [Planned(self._decide_in_pass(run, attempt, units, hold=False), run, attempt)
                   for run, attempt in pairs]
        planned += [Planned(d) for d in self._orphans(units, {a.unit_name for _, a in pairs})]
        return planned

    def _decide_in_pass(self, run: Run, attempt: Attempt, units: dict[str, UnitBrief], hold: bool = True) -> Decision:
        """decide(), reading a unit in full only when the listing does not already settle it: a pass
        over thousands of runs costs one D-Bus call, not two per run.

        `hold`: take this connection's reference on a listed unit it holds none on (adopted from a
        daemon before this one: its reference went with its connection), so that the unit stays
        loaded with its outcome when it ends. Once per unit and connection."""
        brief = units.get(attempt.unit_name)
        if brief is not None and hold and not self.systemd.ref(attempt.unit_name):
            brief = None  # ended and collected since the listing: the journal is what is left
        if (brief is not None and brief.plainly_running and attempt.started_at is not None
                and attempt.invocation_id and run.cancel_requested_at is None):
            return Decision(Action.NOTHING, attempt.unit_name, "unit is running")
        return self._unless_seen(run, attempt, decide(
            run, attempt, self.systemd.state(attempt.unit_name) if brief is not None else None))

    def _unless_seen(self, run: Run, attempt: Attempt, decision: Decision) -> Decision:
        """START only when the journal proves the unit never ran (decide_unstarted): a unit PID 1
        logged about was started (by a daemon that died before recording that) and is gone since, as
        a clean end is collected at once when no daemon holds the unit; a journal that cannot be read,
        or no longer reaches back to the claim, proves nothing either way."""
        if decision.action is not Action.START:
            return decision
        history = self.journal.unit_history(attempt.unit_name, self._claimed_since(attempt))
        loaded_now = history is not History.UNKNOWN and self._loaded(attempt.unit_name)
        return decide_unstarted(run, attempt, history, loaded_now)

    def _loaded(self, unit_name: str) -> bool:
        """Whether a unit of that name is loaded now, and is one (not a stub: is_stub)."""
        state = self.systemd.state(unit_name)
        return state is not None and not is_stub(state)

    def _claimed_since(self, attempt: Attempt) -> datetime | None:
        """When the attempt was claimed, on this host's clock: claimed_at is the database's, and the
        two clocks may be far apart (issue 21 saw a host 30 s behind). Its age is measured on the
        database's clock alone and taken from this host's now, so the skew drops out; CLAIM_MARGIN
        more covers the two reads of now() not being one instant. A host clock stepped since the
        claim is what this cannot see."""
        if attempt.claimed_at is None:
            return None
        age = store.now(self.conn) - attempt.claimed_at
        return datetime.now(UTC) - age - CLAIM_MARGIN

    def _orphans(self, units: dict[str, UnitBrief], owned: set[str]) -> list[Decision]:
        loaded = [name for name in units if name not in owned]
        if not loaded:
            return []
        # Read after the listing: an attempt claimed (and its unit started) while this pass ran is seen
        # here as open on this host, never as an orphan, even from a pass run by hand beside the daemon.
        owners = store.unit_owners(self.conn, loaded)
        parsed = {name: unitspec.parse_unit_name(name) for name in loaded}
        unclaimed = store.unclaimed_attempts(self.conn, [p for n, p in parsed.items() if p and n not in owners])
        return [decide_orphan(name, owners.get(name), self.host_id, self.settings.daemon.stop_orphans,
                              running=units[name].process_running, awaiting_claim=parsed[name] in unclaimed,
                              active_state=units[name].active_state)
                for name in loaded]

    # -- acting -----------------------------------------------------------------------------------

    def reconcile_pass(self) -> list[Planned]:
        """Compare every open attempt of this host with systemd, and every unit of ours with the rows."""
        done: list[Planned] = []
        pairs = store.open_attempts(self.conn, self.host_id)
        units = self.systemd.list_units(unitspec.UNIT_GLOB)
        # Exact before the attempts are acted on, so that each one this pass settles frees its slot
        # (_recorded). Set after them, as it was, it counted the pass's own settles as in flight until
        # the next pass: a host whose runs all ended just before a pass took itself for full for a
        # reconcile interval, claiming nothing and ignoring its wake-ups (bench.scale: a burst's last
        # runs waited 65 s on 100 idle hosts).
        self.in_flight = len(pairs)
        for index, (run, attempt) in enumerate(pairs):
            if index == 1:
                faults.point("mid-reconcile")
            self.tick()
            self.isolated(run, attempt, lambda r=run, a=attempt: done.append(
                Planned(self._act(r, a, self._decide_in_pass(r, a, units)), r, a)))
        for decision in self._orphans(units, {a.unit_name for _, a in pairs}):
            self.apply_orphan(decision)
            done.append(Planned(decision))
        # What the pass read, less what it settled, and what it marked itself (a start or an adoption:
        # not in its snapshot).
        self.started_units = {a.unit_name for _, a in pairs if a.unit_name in self.started_units or (
            a.started_at is not None and a.unit_name not in self.settled_units)}
        self.settled_units.clear()  # collected since, most of them: their last change has been read
        self.schedule_warnings(pairs)
        self.sweep_environment_files()
        self.sweep_tasks_peaks()
        self.write_output_tails()
        self.finish_river_jobs()
        return done

    def finish_river_jobs(self) -> list[riversource.Finished]:
        """Finish the River jobs this host holds whose runs moved on (riversource.finish_held): after
        each River claim, and in every pass, so that a daemon killed between a claim and its finish
        (or a run started by another host) finishes the job at the latest one pass later."""
        if not self.river_ready:
            return []
        try:
            return riversource.finish_held(self.conn, self.fence, self.settings.river)
        except psycopg.Error as exc:
            # River's tables are the platform's: a grant taken away or a table changed under us must not
            # stop this host's own runs (the pass it ends is theirs too). Said, and tried again next time;
            # a lost connection is the loop's to handle.
            if isinstance(exc, store.CONNECTION_LOST):
                raise
            event("river-finish-failed", level=logging.WARNING, host=self.host_id, detail=store.one_line(exc))
            return []

    def write_output_tails(self) -> int:
        """Keep the output tails read since the last call with their attempts, in one statement. A
        database lost (or this host fenced) in it gives them back to the reader, for the write after
        the reconnect: they are read only once. A statement the database refuses drops them, or the
        loop would fail on the same rows at every iteration."""
        tails = self.output_tails.take()
        try:
            return store.record_output_tails(self.conn, self.fence, tails)
        except (store.Fenced, *store.CONNECTION_LOST, psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable):
            self.output_tails.give_back(tails)
            raise

    def sweep_environment_files(self) -> list[str]:
        """Remove every environment file whose attempt is not open on this host: its outcome is
        recorded (the daemon died before removing it), it was taken over, or it never got further
        than the file (killed between writing it and the start, then settled elsewhere). Files are
        listed before the rows are read, as units are: an attempt claimed while the sweep runs has
        its row committed before its file is written, so it is seen as open, never removed."""
        try:
            listing = self.env_files.listing()
        except OSError as exc:  # a daemon that is not root: it starts nothing either, so wrote nothing
            event("environment-files-unreadable", level=logging.WARNING, detail=str(exc))
            return []
        if not listing:
            return []
        owners = store.unit_owners(self.conn, sorted({unit for unit in listing.values() if unit}))
        removed = []
        for filename, unit in sorted(listing.items()):
            owner = owners.get(unit) if unit else None
            if owner is not None and owner.outcome is None and owner.host_id == self.host_id:
                continue
            if self.env_files.remove_file(filename):
                removed.append(filename)
                event("environment-file-removed", unit=unit or "-", detail="its attempt is not open on this host")
        return removed

    def sweep_tasks_peaks(self) -> list[str]:
        """Remove every tasks-peak file whose attempt is not open on this host: its outcome was recorded
        without it (a unit released after its outcome, taskspeak.py), or by a daemon that died before
        removing it, or elsewhere. Listed before the rows are read, as sweep_environment_files does: a
        file is written at the end of its unit, whose attempt is open until the outcome that reads it."""
        try:
            listing = self.tasks_peaks.listing()
        except OSError:  # a daemon that is not root starts nothing, so no unit of it writes here
            return []
        if not listing:
            return []
        owners = store.unit_owners(self.conn, listing)
        removed = []
        for unit in listing:
            owner = owners.get(unit)
            if owner is not None and owner.outcome is None and owner.host_id == self.host_id:
                continue
            if self.tasks_peaks.remove(unit):
                removed.append(unit)
        return removed

    def reconcile_one(self, run: Run, attempt: Attempt, signalled: UnitState | None = None) -> Decision:
        """One attempt between passes: its unit changed, or its run was cancelled (decide_on_change).
        `signalled`: the unit's state as its signals said it (Watcher.signalled), read from systemd otherwise."""
        return self._act(run, attempt, self._unless_seen(
            run, attempt, decide_on_change(run, attempt, self.systemd.state(attempt.unit_name, signalled))))

    def _act(self, run: Run, attempt: Attempt, decision: Decision) -> Decision:
        self.apply(run, attempt, decision)
        return decision

    def isolated(self, run: Run, attempt: Attempt, work: Callable[[], object]) -> None:
        """One attempt's trouble stays that attempt's: it is logged with the run id, and the next
        pass tries again. A lost database or bus still aborts the whole pass (the caller reconnects)."""
        try:
            work()
        except (SystemdUnavailable, store.Fenced, *store.CONNECTION_LOST):
            raise  # the whole pass ends: reconnect (and, when fenced, register again) first
        except SystemdError as exc:
            event("systemd-error", level=logging.ERROR, run=run.id, attempt=attempt.attempt,
                  unit=attempt.unit_name, detail=str(exc))
        except fence.RecordsUnreadable as exc:
            event("outcome-deferred", level=logging.WARNING, run=run.id, attempt=attempt.attempt,
                  unit=attempt.unit_name, detail=f"{exc}: whether the fence stopped it is unknown")
        except Exception as exc:  # a bug or a row nobody foresaw must not stop the other runs
            event("internal-error", level=logging.ERROR, run=run.id, attempt=attempt.attempt,
                  unit=attempt.unit_name, detail=f"{type(exc).__name__}: {exc}")
            logging.getLogger("unitvisor").debug("traceback", exc_info=True)

    def start(self, run: Run, attempt: Attempt, created: list[Attempt] | None = None) -> None:
        """Start an attempt's unit; a name that already exists is adopted, never started twice.

        With `created`, a unit this call creates is added to it instead of being marked started at
        once: the caller marks a batch with one statement (mark_created). An attempt whose mark is
        lost (the process killed, the database gone first) is left `starting` with its unit loaded,
        which the next pass adopts, as after a kill right after the start."""
        try:
            props = unitspec.build(run, attempt, self.settings, copy_tasks_peak=self.copy_tasks_peak)
            environment = unitspec.environment(run, self.settings.runs)
        except unitspec.Refused as exc:
            self.settle(run, attempt, Outcome("refused", None, str(exc)), unit_exists=False)
            return
        # Where the unit's stop command leaves its peak number of tasks; it writes nothing without it.
        if self.copy_tasks_peak:
            try:
                self.tasks_peaks.ensure_directory()
            except OSError as exc:  # the run is started all the same: its tasks_peak is NULL, not measured
                event("tasks-peak-directory", level=logging.WARNING, unit=attempt.unit_name, detail=str(exc))
        if environment:
            # Written before every start, also one that turns out to be an adoption: the same attempt,
            # the same content. Removed when the outcome is recorded (settle), or by the sweep.
            path = self.env_files.write(attempt.unit_name, environment)
            props[b"EnvironmentFiles"] = [(str(path).encode(), False)]
            faults.point("after-environment-file")
        try:
            is_new = self.systemd.start_transient(attempt.unit_name, props)
        except UnitRefused as exc:
            self.settle(run, attempt, Outcome("start-failed", None, f"systemd refused the unit: {exc}"),
                        unit_exists=False)
            return
        if is_new and self.metrics is not None:
            self.metrics.started(attempt.unit_name)
        if is_new:
            # Its unit starts now (RuntimeMaxSec= counts from then): the warning is due from now.
            self.warnings.add(stopsignals.warning(run, attempt, datetime.now(UTC)))
        faults.point("after-start")
        event("started" if is_new else "adopted", run=run.id, attempt=attempt.attempt, unit=attempt.unit_name)
        if is_new:
            # A unit we just created is running (or about to fail, which its signals will say): no
            # need to read it back. Its invocation id is recorded with its outcome, or by the next pass.
            if created is None:
                store.mark_started(self.conn, self.fence, attempt, None, f"unit {attempt.unit_name} started")
                self.started_units.add(attempt.unit_name)
            else:
                created.append(attempt)
            return
        # An existing unit may be in any state, even ended: decide on what systemd says. Held first, so
        # that it stays loaded when it ends. Gone already (it ended and was collected since PID 1 said
        # it exists): it ran, so never started again; the journal says how it ended.
        if not self.systemd.ref(attempt.unit_name):
            self.apply(run, attempt, gone(run, attempt.unit_name, "its unit existed and is gone"))
            return
        decision = decide(run, attempt, self.systemd.state(attempt.unit_name))
        if decision.action is Action.START:
            # Read as no unit (a stub) although PID 1 said it exists and we hold it: it ran; never again.
            decision = gone(run, attempt.unit_name, "its unit existed and is gone")
        if decision.action is Action.ADOPT:
            decision = Decision(Action.ADOPT, attempt.unit_name, f"unit {attempt.unit_name} existed: adopted",
                                invocation_id=decision.invocation_id, unit=decision.unit)
        self.apply(run, attempt, decision)

    def mark_created(self, created: list[Attempt]) -> None:
        """Mark started, in one statement, the attempts whose units `start` created for a batch."""
        store.mark_started_many(self.conn, self.fence, created)
        self.started_units.update(attempt.unit_name for attempt in created)

    def apply(self, run: Run, attempt: Attempt, decision: Decision) -> None:
        action = decision.action
        if action is Action.START:
            self.start(run, attempt)
        elif action is Action.ADOPT:
            store.mark_started(self.conn, self.fence, attempt, decision.invocation_id, decision.reason,
                               started_at=_started_at(decision))
            self.started_units.add(attempt.unit_name)
        elif action is Action.STOP:
            store.mark_started(self.conn, self.fence, attempt, decision.invocation_id, f"adopted: {decision.reason}",
                               started_at=_started_at(decision))
            if self.systemd.stop(attempt.unit_name):
                # The unit's own KillSignal= and TimeoutStopSec= (unitspec.stop_properties) do the stop.
                grace = run.stop_timeout if run.stop_timeout is not None else self.settings.systemd.stop_grace
                store.record_event(self.conn, self.fence, attempt, run.state, f"stopping unit {attempt.unit_name}: "
                                   f"{decision.reason} (SIG{stopsignals.stop_signal(run)}, then SIGKILL after "
                                   f"{grace:g} s)")
                event("stopping-run", run=run.id, attempt=attempt.attempt, unit=attempt.unit_name,
                      detail=decision.reason)
        elif action is Action.GONE:
            assert decision.outcome is not None
            outcome, ended_at, accounting = decision.outcome, None, None
            if outcome.outcome == "lost":
                try:
                    found = self.journal.outcome(attempt.unit_name, attempt.invocation_id)
                except Unreadable as exc:
                    # `lost` now would retry a run that may have succeeded: it would run twice. A unit
                    # this host stopped while cut off is lost whatever the journal says.
                    if not self._was_cut_off(attempt):
                        self._wait(run, attempt, f"{exc}: its outcome is decided by a later pass")
                        return
                    found = None
                if found is not None:
                    outcome, ended_at, accounting = found.outcome, found.ended_at, found.accounting
            # The unit is gone, and systemd's measurements with it (but for what PID 1's resource-usage
            # record kept); its output may still be in this host's journal (a reboot keeps it), so the
            # tail is read all the same.
            self.settle(run, attempt, self._cut_off(attempt, outcome), unit_exists=False, ended_at=ended_at,
                        accounting=accounting, keep_output=True)
        elif action is Action.WAIT:
            self._wait(run, attempt, decision.reason)
        elif action is Action.SETTLE:
            assert decision.outcome is not None
            unit = decision.unit
            self.settle(run, attempt, self._cut_off(attempt, self._proven(attempt, decision)),
                        unit_exists=attempt.started_at is not None or decision.invocation_id is not None,
                        invocation_id=decision.invocation_id,
                        started_at=unit.started_at if unit else None, ended_at=unit.ended_at if unit else None,
                        accounting=unit.accounting if unit else None, keep_output=unit is not None,
                        unit_state=unit.active_state if unit else None)

    @staticmethod
    def _wait(run: Run, attempt: Attempt, reason: str) -> None:
        """Leave an attempt open for a later pass: the journal could not be read. Said at every pass
        that finds it so, as a warning: the attempt holds its slot until then, and a journal broken
        for good (journalctl missing, or hanging on a dead disk) needs an operator."""
        event("journal-unreadable", level=logging.WARNING, run=run.id, attempt=attempt.attempt,
              unit=attempt.unit_name, detail=reason)

    def _proven(self, attempt: Attempt, decision: Decision) -> Outcome:
        """The decision's outcome, with an exit status of 200-243 that the unit's state left unproven
        (start-failed, maybe the command's own) settled by the journal where it can."""
        outcome, unit = decision.outcome, decision.unit
        assert outcome is not None
        if (unit is None or outcome.outcome != "start-failed" or unit.active_enter_usec
                or not is_setup_exit(unit.result, unit.exec_main_code, unit.exec_main_status)):
            return outcome
        ran = self.journal.exec_evidence(attempt.unit_name, unit.invocation_id or attempt.invocation_id)
        if ran is None:
            return outcome
        return classify(unit.result, unit.exec_main_code, unit.exec_main_status, cancel_requested=False,
                        program_ran=ran)

    def _cut_off(self, attempt: Attempt, outcome: Outcome) -> Outcome:
        # A refused start the fence also stopped (it lists a unit whose lease check is running as one to
        # stop) says the more: its command never ran.
        if outcome.outcome == "cancelled" or outcome == fence.REFUSED_START or not self._was_cut_off(attempt):
            return outcome
        return fleet.cut_off_outcome(outcome, cut_off_after(self.settings))

    def _was_cut_off(self, attempt: Attempt) -> bool:
        """Whether this host stopped the attempt's unit while cut off (the guard or the fence). Raises
        fence.RecordsUnreadable when the fence's records could not be read: unknown, so the attempt is
        left for a later pass (isolated), never settled as killed when it was cut off."""
        if isinstance(self.cut_off_units, fence.FencedUnits):
            self.cut_off_units.check()
        return attempt.unit_name in self.cut_off_units

    def apply_orphan(self, decision: Decision) -> None:
        if decision.action is Action.RELEASE:
            if decision.keep_output and (parsed := unitspec.parse_unit_name(decision.unit_name)) is not None:
                self.output_tails.add(*parsed)
            self.systemd.release(decision.unit_name, decision.unit_state)
        elif decision.action in (Action.STOP_ORPHAN, Action.STOP_STALE):
            self.systemd.release(decision.unit_name)  # a stop job, reset-failed, and this daemon's reference
        if decision.action is Action.NOTHING:
            return
        event(decision.action.value, unit=decision.unit_name, detail=decision.reason,
              level=logging.INFO if decision.action is Action.RELEASE else logging.WARNING)

    def settle(self, run: Run, attempt: Attempt, outcome: Outcome, unit_exists: bool = True,
               invocation_id: str | None = None, started_at: datetime | None = None,
               ended_at: datetime | None = None, accounting: Accounting | None = None,
               keep_output: bool = False, unit_state: str | None = None) -> None:
        """Record an attempt's outcome (and the run's next step), then release its unit. `started_at` and
        `ended_at` are systemd's own times when known; the database's now() stands in otherwise.
        `accounting` is what systemd measured of the unit (read with its state, before the release
        discards it); `keep_output`: the attempt ran here, so the end of its output is read from this
        host's journal once the outcome is recorded, and kept with it (output_tails); `unit_state`: the
        ActiveState the unit ended in, which says how to release it (Systemd.release). Inside
        `batched_outcomes`, all of that waits for the batch's one statement."""
        self.warnings.drop(attempt.unit_name)
        ending = _Ending(run, self._settling(run, attempt, outcome, invocation_id, started_at, ended_at,
                                             self._with_tasks_peak(attempt, accounting)),
                         unit_exists, keep_output, unit_state)
        if self._batch is not None:
            self._batch.append(ending)
            return
        self._after(ending, self._record(run, ending.settling))

    def _with_tasks_peak(self, attempt: Attempt, accounting: Accounting | None) -> Accounting | None:
        """The accounting with the peak the attempt's unit left when it ended (taskspeak.py), read from
        the file whether systemd's figures came from the unit or its journal records. No file (a unit that
        never ran here, no pids.peak on this host, /run wiped by a reboot): as it was."""
        peak = self.tasks_peaks.read(attempt.unit_name)
        if peak is None:
            return accounting
        return replace(accounting or Accounting(), tasks_peak=peak)

    @contextlib.contextmanager
    def batched_outcomes(self) -> Iterator[None]:
        """Outcomes settled inside are recorded together, in one statement, when it ends (also when it
        ends with an error: what was read of the units is true), each unit released after that
        commit as settle() does. The daemon settles the units that ended together between two passes
        this way: one round trip to the database for all of them (issue 14)."""
        self._batch = []
        try:
            yield
        finally:
            endings, self._batch = self._batch, None
            self._record_batch(endings)

    def _record_batch(self, endings: list[_Ending]) -> None:
        """Write the batch's outcomes, then do what follows each one written (_after_all), also when
        the writes stop half way (the database lost after some of them). Every write comes before any
        release: a bus lost at a release must not cost a later outcome its write, since its unit is the
        only record of it until then, and PID 1 collects a clean one when this connection closes."""
        written: list[bool | None] = []  # per ending, in order, once its write is over (None: not written)
        try:
            self._write_outcomes(endings, written)
        finally:
            bus_lost = self._after_all(list(zip(endings, written, strict=False)))
        if bus_lost is not None:
            raise bus_lost  # the daemon reconnects; the next pass releases what was left

    def _write_outcomes(self, endings: list[_Ending], written: list[bool | None]) -> None:
        """The outcomes in one statement, or (one alone, or a batch the database refused) each with a
        statement of its own, one attempt's trouble staying that attempt's. Appends to `written`, in
        order, whether each took its outcome (None: its write failed, logged by isolated())."""
        if len(endings) > 1:
            faults.point("before-outcome")
            try:
                taken = store.record_outcomes(self.conn, self.fence, [e.settling for e in endings])
            except (store.Fenced, *store.CONNECTION_LOST):
                raise
            except psycopg.Error as exc:
                # One row the database refuses fails the statement, and with it every outcome of the
                # batch: each again on its own, so that one attempt's trouble stays that attempt's.
                event("outcome-batch-refused", level=logging.WARNING, host=self.host_id, runs=len(endings),
                      detail=f"{type(exc).__name__}: {exc}; recording each on its own")
            else:
                for ending, took in zip(endings, taken, strict=True):
                    if took:
                        self._settled_event(ending.run, ending.settling)
                written.extend(taken)
                return
        for ending in endings:
            took: list[bool] = []
            self.isolated(ending.run, ending.settling.attempt,
                          lambda e=ending, t=took: t.append(self._record(e.run, e.settling)))
            written.append(took[0] if took else None)

    def _after_all(self, written: list[tuple[_Ending, bool | None]]) -> SystemdUnavailable | None:
        """What follows the outcomes written, in two rounds: first what needs no systemd (each taken
        outcome's tail scheduled and counted, the environment files removed), for every one of them;
        then the releases. So a bus lost at the first release drops no committed outcome's tail (0.5.1
        left the batch there, issue 21). The releases stop at a lost bus, which is returned for the
        caller to raise: the units left are released by the next pass (RELEASE of a unit whose outcome
        is recorded), which schedules their tails again too."""
        done = [(ending, took) for ending, took in written if took is not None]
        for ending, took in done:
            self.isolated(ending.run, ending.settling.attempt, lambda e=ending, t=took: self._recorded(e, t))
        for ending, _ in done:
            try:
                self.isolated(ending.run, ending.settling.attempt, lambda e=ending: self._release(e))
            except SystemdUnavailable as exc:
                return exc
        return None

    def _settling(self, run: Run, attempt: Attempt, outcome: Outcome, invocation_id: str | None = None,
                  started_at: datetime | None = None, ended_at: datetime | None = None,
                  accounting: Accounting | None = None) -> store.Settling:
        """The outcome with the run's next step: another attempt after a delay, or its end."""
        delay = retry_delay(run, attempt.attempt, outcome.outcome, self.random.random, outcome.exit_status)
        next_state = "queued" if delay is not None else run_state_after(outcome.outcome)
        return store.Settling(attempt, outcome, next_state, delay, invocation_id, started_at, ended_at, accounting)

    def _record(self, run: Run, settling: store.Settling) -> bool:
        faults.point("before-outcome")
        recorded = store.record_outcome(self.conn, self.fence, settling.attempt, settling.outcome, settling.next_state,
                                        settling.retry_delay, settling.invocation_id, started_at=settling.started_at,
                                        ended_at=settling.ended_at, accounting=settling.accounting)
        if recorded:
            self._settled_event(run, settling)
        return recorded

    @staticmethod
    def _settled_event(run: Run, settling: store.Settling) -> None:
        attempt, outcome = settling.attempt, settling.outcome
        event("settled", run=run.id, attempt=attempt.attempt, unit=attempt.unit_name, host=attempt.host_id,
              outcome=outcome.outcome, exit_status=outcome.exit_status or "-", state=settling.next_state,
              detail=outcome.reason)

    def _after(self, ending: _Ending, recorded: bool) -> None:
        """What follows an outcome's write: counted once, if this write took it; the unit released."""
        self._recorded(ending, recorded)
        self._release(ending)

    def _recorded(self, ending: _Ending, recorded: bool) -> None:
        """What follows an outcome's write without systemd: its tail scheduled and its count, if this
        write took it; its environment file removed."""
        attempt = ending.settling.attempt
        if recorded:
            if ending.keep_output:
                self.output_tails.add(ending.run.id, attempt.attempt)
            self.settled += 1
            self.in_flight = max(0, self.in_flight - 1)  # exact again at the next pass
            self.freed_key = self.freed_key or ending.run.concurrency_key is not None
            self.freed_labelled = self.freed_labelled or bool(ending.run.labels)
            if self.metrics is not None:
                self.metrics.settled(ending.settling.outcome.outcome,
                                     _ended_by(ending.run, attempt, ending.settling.outcome))
                if outcomes.stop_timed_out(ending.settling.outcome):
                    self.metrics.stop_kills.inc()
        self.cut_off_units.discard(attempt.unit_name)
        self.started_units.discard(attempt.unit_name)
        if len(self.settled_units) >= MAX_SETTLED_UNITS:
            self.settled_units.clear()
        self.settled_units.add(attempt.unit_name)
        # Its process has been spawned (PID 1 read the file then) or never will be.
        self.env_files.remove(attempt.unit_name)
        # Read into this outcome, or stale (the attempt had one already): not needed again either way.
        self.tasks_peaks.remove(attempt.unit_name)

    def _release(self, ending: _Ending) -> None:
        """Released only once the outcome is committed: until then the unit is the only record of it."""
        attempt = ending.settling.attempt
        if ending.unit_exists:
            self.systemd.release(attempt.unit_name, ending.unit_state)

    # -- warnings before runtime_max_sec (stopsignals.py) -----------------------------------------

    def schedule_warnings(self, pairs: list[tuple[Run, Attempt]]) -> None:
        """After a pass: forget the warnings of attempts no longer open here, or whose run is being
        cancelled; find those of running units not known yet (a daemon that restarted, a unit adopted),
        due from the unit's own start time (the clock RuntimeMaxSec= counts on), one read of the unit
        each, once per unit and daemon. One already sent (warned_at) is never sent again."""
        open_now = {attempt.unit_name: run for run, attempt in pairs}
        for name in self.warnings.unit_names():
            run = open_now.get(name)
            if run is None or run.cancel_requested_at is not None:
                self.warnings.drop(name)
        for run, attempt in pairs:
            if attempt.unit_name in self.warnings or attempt.started_at is None:
                continue
            if stopsignals.warning(run, attempt, datetime.now(UTC)) is None:
                continue  # asks for none, or had it: no need to read its unit
            unit = self.systemd.state(attempt.unit_name)
            if unit is None or is_stub(unit) or unit.has_ended or unit.started_at is None:
                continue
            self.warnings.add(stopsignals.warning(run, attempt, unit.started_at))

    def send_due_warnings(self, now: datetime | None = None) -> list[stopsignals.Warning]:
        """Send every warning due by `now` to its unit's main process (KillUnit), then record it on the
        attempt (mark_warned), in that order: a daemon killed between the two sends it again after its
        restart (twice rather than never). A unit no longer loaded gets nothing: its outcome is coming.
        Each is dropped once tried: a failure is logged, not retried every iteration."""
        now = now or datetime.now(UTC)
        sent = []
        for warning in self.warnings.take_due(now):
            attempt = warning.attempt
            try:
                signum = stopsignals.number(warning.signal, "warn_signal")
                if not self.systemd.kill(attempt.unit_name, stopsignals.WARN_WHOM, signum):
                    continue
                late = (now - warning.due).total_seconds()
                reason = (f"sent SIG{warning.signal} to unit {attempt.unit_name}: runtime_max_sec ends it in about "
                          f"{max(0, warning.before - late):.0f} s (warn_before {warning.before} s)"
                          + (f", {late:.0f} s late: no daemon was running when it was due" if late >= 5 else ""))
                store.mark_warned(self.conn, self.fence, attempt, reason)
            except (SystemdUnavailable, store.Fenced, *store.CONNECTION_LOST):
                raise
            except (SystemdError, stopsignals.Refused, psycopg.Error) as exc:
                event("warning-failed", level=logging.ERROR, run=attempt.run_id, attempt=attempt.attempt,
                      unit=attempt.unit_name, detail=str(exc))
                continue
            sent.append(warning)
            event("warned", run=attempt.run_id, attempt=attempt.attempt, unit=attempt.unit_name,
                  detail=f"SIG{warning.signal}")
            if self.metrics is not None:
                self.metrics.stop_warnings.inc()
        return sent

    # -- the fleet --------------------------------------------------------------------------------

    def take_over_dead_hosts(self, connected_for: float) -> list[store.DeadHost]:
        """Declare every silent host dead (when this daemon is the one of the fleet doing it now) and
        settle its open attempts as lost, in one transaction: either a host is dead and all its attempts
        are settled, or nothing changed. Its runs then retry elsewhere or fail, by their own policy."""
        taken: list[tuple[str, str | None]] = []  # outcomes recorded, counted once the transaction committed
        settled: list[int] = []  # each dead host's attempts settled, said once the transaction committed
        with self.conn.transaction():
            declaration = store.declare_dead(self.conn, self.fence, connected_for,
                                             self.settings.fleet.max_dead_per_pass)
            dead = declaration.dead
            for host in dead:
                settled.append(self._settle_open_of(
                    host.host_id, lambda run, host=host: fleet.takeover_outcome(run, host, self.host_id), taken))
        # After the commit: a declaration rolled back (the connection lost, this host fenced meanwhile)
        # declared nobody, and a line saying otherwise would mislead an operator, and the nemesis's checker,
        # which takes these lines for the fleet's declarations (declared-in-stall).
        for host, count in zip(dead, settled, strict=True):
            event("host-dead", level=logging.WARNING, host=host.host_id, runs_lost=count,
                  detail=f"silent for {host.silent:.0f}s (host_dead_after {host.dead_after:g}s)")
        if declaration.held_why is not None:
            # Said each pass it holds: an operator sees silent hosts that are not being declared, and why.
            event("host-dead-held", level=logging.WARNING, held=declaration.held, why=declaration.held_why,
                  declared=len(dead), detail=declaration.held_detail)
        if self.metrics is not None:
            self.metrics.declared_dead(len(dead))
            if declaration.held_why is not None:
                self.metrics.declarations_held(declaration.held_why, declaration.held)
        self._count_settled(taken)
        return dead

    def take_over_id(self, previous: str, instance: str) -> int:
        """Settle `lost` (by their runs' policy) every open attempt of this host id, in the caller's
        transaction: the one in which this instance took the id over from `previous` (register_host
        lets it only after the id's host_dead_after of silence). As for a host declared dead, and by the
        same code: the previous instance may have started an attempt it claimed, on a machine whose
        journal this one cannot read, so none of them may be started, adopted or settled from here.
        Returns how many were settled; they are counted once the caller committed (`count_taken`)."""
        taken: list[tuple[str, str | None]] = []
        count = self._settle_open_of(self.host_id, lambda run: fleet.id_takeover_outcome(
            run, self.host_id, previous, instance), taken)
        self.taken_over = taken
        return count

    def count_taken(self) -> None:
        """After the takeover's commit: its outcomes in the metrics."""
        self._count_settled(self.taken_over)
        self.taken_over = []

    def _settle_open_of(self, host_id: str, outcome_for: Callable[[Run], Outcome],
                        taken: list[tuple[str, str | None]]) -> int:
        """Every open attempt of `host_id` settled with `outcome_for(run)` and its run moved on by its
        own policy (inside the caller's transaction); what was recorded is appended to `taken`."""
        pairs = store.open_attempts(self.conn, host_id)
        for run, attempt in pairs:
            self.tick()
            outcome = outcome_for(run)
            if self._record(run, self._settling(run, attempt, outcome)):
                taken.append((outcome.outcome, _ended_by(run, attempt, outcome)))
        return len(pairs)

    def _count_settled(self, taken: list[tuple[str, str | None]]) -> None:
        if self.metrics is not None:
            for kind, ended_by in taken:
                self.metrics.settled(kind, ended_by)

    def expire_overdue(self) -> int:
        """End as `expired` the queued runs past their start deadline that never started
        (unitvisor.expire_runs): the one place that does, claims do not (sql/migrations/012_expiry_owner.sql), so
        that the fleet's counters have every expiry."""
        expired = store.expire_runs(self.conn, self.fence)  # autocommit: committed on return
        if expired:
            event("runs-expired", host=self.host_id, runs=expired)
        if self.metrics is not None:
            self.metrics.expired(expired)
        return expired

    def pass_figures(self) -> dict[str, tuple[int, int]]:
        """The fleet-wide figures of a reconcile pass (store.pass_figures): the runs skipped since any
        daemon last looked (schema 035) are counted and said here, since a skip happens in whatever
        transaction ends the run it needed (an outcome, a cancel from the CLI, an expiry) and no daemon
        sees it happen; the named limits' live runs (schema 032) are returned, for the gauges."""
        figures = store.pass_figures(self.conn, self.fence)  # autocommit: the skips taken are committed
        if figures.skipped:
            event("runs-skipped", host=self.host_id, runs=figures.skipped)
        if self.metrics is not None:
            self.metrics.skipped(figures.skipped)
        return figures.limits

    def submit_due_schedules(self) -> list[store.ScheduleTurn]:
        """Submit the run of each schedule due now, once per due time across the fleet (the database
        locks each schedule's row and moves it on in the same statement), said in the journal and counted."""
        turns = store.submit_due_schedules(self.conn, self.fence)  # autocommit: committed on return
        for turn in turns:
            level = logging.WARNING if turn.result.startswith(("missed", "refused")) else logging.INFO
            event("schedule-due", level=level, host=self.host_id, schedule=turn.schedule, due=turn.due.isoformat(),
                  run=str(turn.run_id) if turn.run_id else "-", missed=turn.missed, result=turn.result)
        if self.metrics is not None:
            self.metrics.schedules(
                submitted=sum(1 for t in turns if t.run_id is not None),
                missed=sum(t.missed for t in turns),
                overlapping=sum(1 for t in turns if t.result.startswith("skipped")),
                refused=sum(1 for t in turns if t.result.startswith("refused")))
        return turns

    def explain_waiting(self) -> int:
        """Say why runs wait that no live host accepts (in unitvisor.run_waits, and one event each), a
        batch of them per pass (the next pass goes on where this one stopped)."""
        return store.explain_waiting(self.conn, fleet.explain_after(self.settings), fleet.EXPLAIN_BATCH)


def _ended_by(run: Run, attempt: Attempt, outcome: Outcome) -> str | None:
    """The failure rule that ended the run with this outcome (fail_on, max_lost_attempts), for the metric:
    the daemon's verdict, which is the database's (unitvisor.failure_verdict, its twin)."""
    lost = run.lost_attempts + (1 if outcome.outcome == "lost" else 0)
    return failure_verdict(run, attempt.attempt, lost, outcome.outcome, outcome.exit_status).ended_by
