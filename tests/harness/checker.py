"""The nemesis's checker: a pure function from what was collected after a schedule of faults (every
host's journal, the database's attempt and run rows, the per-second samples of live units) to the
list of broken promises. Nothing here touches a container or a database, so that every rule is
unit-tested on hand-made histories (tests/unit/test_checker.py), and the same function audits a real
fleet (tests/harness/nemesis.py).

What it checks (docs/fleet.md, "Nemesis"):

- `started-twice`, `start-without-attempt`, `started-on-wrong-host`: every journal "Started" record of
  a run's unit (unitvisor-run-<run id>-<attempt>.service), on every machine and every boot, maps to
  exactly one attempt row, of the host id that machine runs as (a start the unit's lease check refused,
  "Skipped due to 'exec-condition'", is no start: its command never ran);
- `live-copies`: no two live units of one run at one sampled instant (with self-fencing on);
  `overlap-in-journal`: no two invocations of one run whose journal intervals (Started .. end)
  overlap, which catches copies that lived less than a sampling period;
- `unexplained-state`, `unsettled`, `bad-attempts`: every run ends in a state its attempts and its
  retry policy (max_attempts, retry_on, a cancel, resumes) explain;
- `outcome-contradicts-journal`: no recorded success, exit status or signal that the unit's own
  journal contradicts;
- `action-not-refused`: an operator command whose documented guard should have refused it went
  ahead (`apt remove` while a run unit stayed loaded; `hosts add --new-password` without `--force`
  while the host was live). A refused command is what the guard promises, not a violation;
- `host-to-host`: during a partition of two hosts from each other (`partition_hosts`), a socket of a
  host's daemon or fence led somewhere other than that host's own way to PostgreSQL (its proxies): a
  path between hosts that such a partition would cut. There is none by construction (hosts only ever
  talk to PostgreSQL), and this is what shows it;
- `declared-in-stall`: no host declared dead (its daemon's peers' `host-dead` event) while the database
  answered nothing (`pg_stall`: every server process stopped, its connections kept) or within
  host_dead_after after, unless a fault of that host's own could have silenced it (issue 23: a busy
  database never kills a live host; docs/fleet.md, "Declaring a host dead").

A sampled overlap that the journal proves was not one (the two invocations' intervals are disjoint:
the hosts were listed a fraction of a second apart, one copy ended and the retry started in between)
is dropped and counted as `sampler_artifacts`. The journal's timestamps are comparable across the
test bed's machines: they share one kernel clock.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

UNIT_RE = re.compile(r"^unitvisor-run-([0-9a-f-]{36})-([0-9]+)\.service$")
# systemd's catalogue ids (systemd/sd-messages.h) of the records the checker reads.
MSG_STARTED = "39f53479d3a045ac8e11786248231fbf"     # "Started X." (JOB_TYPE=start, JOB_RESULT=done)
MSG_EXITED = "98e322203f7a4ed290d09fe03c09fe15"      # "Main process exited, code=..., status=..."
MSG_FAILED = "d9b373ed55a64feb8242e02dbe79a49c"      # "Failed with result 'X'." (UNIT_RESULT)
MSG_SUCCEEDED = "7ad2d189f7e94e70a38c781354912448"   # "Deactivated successfully."
# "Skipped due to 'exec-condition'." (UNIT_RESULT): the lease check refused the start (fence.py). PID 1
# then also logs "Condition check resulted in X being skipped." under MSG_STARTED with JOB_RESULT=done
# (systemd 252, seen in tests/system/test_fence.py): that invocation never ran, and is no start.
MSG_SKIPPED = "0e4284a0caca4bfc81c0bb6786972673"

# The states a run ends in, written out here (not the product's list) so that the checker stays
# independent of the code it checks; skipped (schema 035): a run it runs after could no longer succeed.
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired", "skipped"})
# As supervisor/outcomes.py RETRYABLE_BY_DEFAULT: every failure but a refusal or a cancel.
RETRYABLE_BY_DEFAULT = frozenset({"exit-code", "signal", "core-dump", "timeout", "oom-kill", "watchdog",
                                  "start-failed", "lost"})
FAILURES = RETRYABLE_BY_DEFAULT | {"refused"}


@dataclass(frozen=True)
class JournalRecord:
    """One record of PID 1 about a run's unit on one machine."""
    machine: str        # the container (a clone has a machine of its own and another's host id)
    host_id: str        # the host id that machine's daemon runs as
    boot: str
    unit: str
    invocation: str
    kind: str           # started | exited | failed | succeeded | skipped
    at: float           # realtime seconds (one kernel clock for every test bed machine)
    exit_code: str = ""     # exited | killed | dumped (kind exited)
    exit_status: str = ""   # the number, as journald gives it (kind exited)
    result: str = ""        # UNIT_RESULT (kind failed)


@dataclass(frozen=True)
class Attempt:
    run_id: str
    attempt: int
    host_id: str
    unit_name: str
    invocation_id: str | None
    outcome: str | None
    exit_status: str | None
    reason: str | None = None


@dataclass(frozen=True)
class Run:
    id: str
    state: str
    max_attempts: int
    retry_on: tuple[str, ...] | None = None
    cancel_requested: bool = False
    resumes: int = 0                 # "resumed by an operator" events
    concurrency_key: str | None = None
    # Failure rules (schema 027): whether a lost attempt counts against max_attempts, and the cap on
    # those that do not. True for a history from before 027, when every lost attempt counted.
    count_lost: bool = True
    max_lost_attempts: int = 3


@dataclass(frozen=True)
class Sample:
    """One listing of one machine's live run units (`systemctl list-units`), at `at`."""
    round: int          # samples of one round were taken together (every machine, once a second)
    at: float
    machine: str
    host_id: str
    units: tuple[str, ...]


@dataclass(frozen=True)
class Operation:
    """An operator command with a documented guard (README, "What each operator action does to runs
    in flight"), as the nemesis saw it: whether the guard's condition held throughout (a run unit
    loaded before and after the command; the host live), and whether the command refused."""
    at: float
    action: str         # apt_remove | rotate_password
    host_id: str
    guarded: bool
    refused: bool
    detail: str = ""


@dataclass(frozen=True)
class Contact:
    """A socket of a host's daemon or fence, listed while that host was partitioned from another
    (the nemesis's `partition_hosts`): where it leads, and whether that is one of the host's own
    proxies to PostgreSQL (the only peer a host ever has)."""
    at: float
    host_id: str
    unit: str           # unitvisor.service | unitvisor-fence.service
    peer: str           # address:port
    database: bool


@dataclass(frozen=True)
class Declaration:
    """A host declared dead, by the `host-dead` event in the declaring daemon's journal."""
    at: float           # realtime seconds
    host_id: str        # the host declared dead
    by: str             # the host id of the daemon that declared it


@dataclass(frozen=True)
class Fault:
    """One action of the schedule as it was carried out, on one host or (host_id "") the fleet."""
    name: str
    host_id: str
    began: float        # realtime seconds
    ended: float


# The faults that leave every host's daemon running and able to reach the database's address, but the
# database answering nothing: no host is silent for any reason of its own.
STALLS = frozenset({"pg_stall"})


@dataclass(frozen=True)
class Violation:
    kind: str
    run_id: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: run {self.run_id}: {self.detail}"


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def parse_unit(unit: str) -> tuple[str, int] | None:
    match = UNIT_RE.match(unit)
    return (match.group(1), int(match.group(2))) if match else None


_HOST_DEAD = re.compile(r"^host-dead host=(\S+)")


def _entries(lines: Iterable[str]) -> Iterable[dict]:
    """The records of `journalctl -o json` output, less blank lines and records torn by a power cut."""
    for line in lines:
        if line.strip():
            with contextlib.suppress(json.JSONDecodeError):
                yield json.loads(line)


def parse_declarations(by: str, lines: Iterable[str]) -> list[Declaration]:
    """`journalctl -o json -u unitvisor.service` output of the daemon running as host `by` -> the hosts
    it declared dead (its `host-dead` events)."""
    out = []
    for entry in _entries(lines):
        message = entry.get("MESSAGE")
        match = _HOST_DEAD.match(message) if isinstance(message, str) else None
        if match:
            out.append(Declaration(_when(entry), match.group(1), by))
    return out


def parse_journal(machine: str, host_id: str, lines: Iterable[str]) -> list[JournalRecord]:
    """`journalctl -o json _PID=1` output (any boots) -> the records about run units."""
    records = []
    for entry in _entries(lines):
        unit = entry.get("UNIT")
        invocation = entry.get("INVOCATION_ID")
        if not isinstance(unit, str) or not unit.startswith("unitvisor-run-") or not isinstance(invocation, str):
            continue
        message_id = entry.get("MESSAGE_ID")
        if message_id == MSG_STARTED and entry.get("JOB_RESULT") == "done":
            kind = "started"
        elif message_id == MSG_EXITED:
            kind = "exited"
        elif message_id == MSG_FAILED:
            kind = "failed"
        elif message_id == MSG_SUCCEEDED:
            kind = "succeeded"
        elif message_id == MSG_SKIPPED:
            kind = "skipped"
        else:
            continue
        records.append(JournalRecord(
            machine=machine, host_id=host_id, boot=str(entry.get("_BOOT_ID", "")), unit=unit,
            invocation=invocation, kind=kind, at=_when(entry),
            exit_code=str(entry.get("EXIT_CODE", "")), exit_status=str(entry.get("EXIT_STATUS", "")),
            result=str(entry.get("UNIT_RESULT", ""))))
    return records


def _when(entry: dict) -> float:
    """When PID 1 wrote the record (_SOURCE_REALTIME_TIMESTAMP), not when journald received it
    (__REALTIME_TIMESTAMP): on a loaded machine a container's journald lagged 20 s behind its PID 1,
    which moved a unit's Started record past the moment the sampler had already seen it live."""
    value = entry.get("_SOURCE_REALTIME_TIMESTAMP") or entry.get("__REALTIME_TIMESTAMP") or 0
    return int(value) / 1e6


@dataclass
class Invocation:
    """What one machine's journal says about one start of a unit."""
    machine: str
    host_id: str
    boot: str
    unit: str
    invocation: str
    started: float | None = None
    ended: float | None = None
    exit_code: str = ""
    exit_status: str = ""
    result: str = ""         # "success" when it deactivated successfully
    skipped: bool = False    # its start was refused by the unit's condition: the command never ran

    @property
    def where(self) -> str:
        return f"{self.machine} ({self.host_id}) boot {self.boot[:8]} invocation {self.invocation[:8]}"


def invocations(records: Iterable[JournalRecord]) -> dict[tuple[str, str], Invocation]:
    """(machine, invocation id) -> what its records say."""
    found: dict[tuple[str, str], Invocation] = {}
    for rec in sorted(records, key=lambda r: r.at):
        inv = found.setdefault((rec.machine, rec.invocation),
                               Invocation(rec.machine, rec.host_id, rec.boot, rec.unit, rec.invocation))
        if rec.kind == "started":
            inv.started = rec.at if inv.started is None else min(inv.started, rec.at)
        elif rec.kind == "exited":
            inv.exit_code, inv.exit_status = rec.exit_code, rec.exit_status
            inv.ended = rec.at if inv.ended is None else min(inv.ended, rec.at)
        elif rec.kind == "failed":
            inv.result = rec.result
            inv.ended = rec.at if inv.ended is None else min(inv.ended, rec.at)
        elif rec.kind == "succeeded":
            inv.result = "success"
            inv.ended = rec.at if inv.ended is None else min(inv.ended, rec.at)
        elif rec.kind == "skipped":
            inv.skipped = True
    for inv in found.values():
        if inv.skipped:  # its "Started" record says "Condition check resulted in ... being skipped"
            inv.started = None
            inv.ended = None
    return found


def check(records: Sequence[JournalRecord], attempts: Sequence[Attempt], runs: Sequence[Run],
          samples: Sequence[Sample], settled: bool = True, operations: Sequence[Operation] = (),
          contacts: Sequence[Contact] = (), declarations: Sequence[Declaration] = (),
          faults: Sequence[Fault] = (), dead_after: float = 0.0) -> Report:
    """Every broken promise in one history; `stats` counts what was looked at. `settled`: the
    history is complete (the fleet healed and every run had time to end), so a run that has not
    ended is a violation; False audits a history still being written (runs still running)."""
    report = Report()
    invs = invocations(records)
    by_unit: dict[str, list[Invocation]] = defaultdict(list)
    for inv in invs.values():
        by_unit[inv.unit].append(inv)
    rows = {(a.run_id, a.attempt): a for a in attempts}
    runs_by_id = {r.id: r for r in runs}
    v = report.violations
    v += _check_starts(by_unit, rows)
    v += _check_journal_overlaps(invs.values())
    sampled, artifacts = _check_samples(samples, by_unit, runs_by_id)
    v += sampled
    v += _check_states([r for r in runs if settled or r.state in TERMINAL], attempts)
    v += _check_outcomes(attempts, by_unit)
    v += _check_operations(operations)
    v += _check_contacts(contacts)
    v += _check_stalls(declarations, faults, dead_after)
    report.stats = {
        "runs": len(runs),
        "attempts": len(attempts),
        "journal_starts": sum(1 for inv in invs.values() if inv.started is not None),
        "samples": len({s.round for s in samples}),
        "sampler_artifacts": artifacts,
        "operations_refused": sum(1 for op in operations if op.refused),
        "partition_sockets": len(contacts),
        "hosts_declared_dead": len(declarations),
        "outcomes_unverified": sum(1 for a in attempts if a.outcome in ("success", "exit-code", "signal")
                                   and not _ended_invocations(a, by_unit)),
    }
    return report


def _check_starts(by_unit: dict[str, list[Invocation]], rows: dict[tuple[str, int], Attempt]) -> list[Violation]:
    out = []
    for unit, invs in sorted(by_unit.items()):
        parsed = parse_unit(unit)
        started = [inv for inv in invs if inv.started is not None]
        if parsed is None or not started:
            continue
        run_id, number = parsed
        row = rows.get((run_id, number))
        places = "; ".join(inv.where for inv in started)
        if row is None:
            out.append(Violation("start-without-attempt", run_id,
                                 f"{unit} started with no attempt row for attempt {number}: {places}"))
            continue
        if len(started) > 1:
            out.append(Violation("started-twice", run_id, f"{unit} started {len(started)} times: {places}"))
        wrong = [inv for inv in started if inv.host_id != row.host_id]
        if wrong:
            out.append(Violation("started-on-wrong-host", run_id,
                                 f"{unit}: attempt {number} is {row.host_id}'s but started on "
                                 + "; ".join(inv.where for inv in wrong)))
    return out


def _overlap(a: Invocation, b: Invocation) -> bool | None:
    """True/False when both intervals are known from the journal; None when an end or start is missing
    (a power cut loses what journald had not written; a unit still running has no end)."""
    if a.started is None or b.started is None or a.ended is None or b.ended is None:
        return None
    return a.started < b.ended and b.started < a.ended


def _check_journal_overlaps(invs: Iterable[Invocation]) -> list[Violation]:
    per_run: dict[str, list[Invocation]] = defaultdict(list)
    for inv in invs:
        parsed = parse_unit(inv.unit)
        if parsed:
            per_run[parsed[0]].append(inv)
    out = []
    for run_id, group in sorted(per_run.items()):
        group.sort(key=lambda i: i.started or 0)
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if _overlap(a, b):
                    seconds = min(a.ended, b.ended) - max(a.started, b.started)  # type: ignore[arg-type,type-var]
                    out.append(Violation("overlap-in-journal", run_id,
                                         f"{a.unit} on {a.where} and {b.unit} on {b.where} were live together "
                                         f"for {seconds:.1f}s"))
    return out


def _check_samples(samples: Sequence[Sample], by_unit: dict[str, list[Invocation]],
                   runs: dict[str, Run]) -> tuple[list[Violation], int]:
    """Two live units of one run (or of one concurrency key) in one round of samples."""
    rounds: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        rounds[sample.round].append(sample)
    seen: dict[tuple[str, str, frozenset[tuple[str, str]]], list[float]] = {}
    artifacts = 0
    for number in sorted(rounds):
        groups: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
        for sample in rounds[number]:
            for unit in sample.units:
                parsed = parse_unit(unit)
                if parsed is None:
                    continue
                groups[("run", parsed[0])].add((sample.machine, unit))
                key = runs[parsed[0]].concurrency_key if parsed[0] in runs else None
                if key:
                    groups[("key", key)].add((sample.machine, unit))
        at = min(s.at for s in rounds[number])
        for (what, name), places in groups.items():
            if len(places) < 2 or (what == "key" and len({parse_unit(u)[0] for _, u in places}) < 2):  # type: ignore[index]
                continue  # two attempts of one run under one key are live-copies, reported as such
            if _disproved(places, by_unit):
                artifacts += 1
                continue
            seen.setdefault((what, name, frozenset(places)), []).append(at)
    out = []
    for (what, name, places), times in seen.items():
        where = ", ".join(f"{unit} on {machine}" for machine, unit in sorted(places))
        span = f"in {len(times)} samples from {_clock(times[0])} to {_clock(times[-1])} UTC"
        if what == "run":
            out.append(Violation("live-copies", name, f"two live units {span}: {where}"))
        else:
            run_ids = sorted({parse_unit(unit)[0] for _, unit in places})  # type: ignore[index]
            out.append(Violation("key-overlap", run_ids[0],
                                 f"concurrency key {name!r}: live units of {len(run_ids)} runs {span}: {where}"))
    return out, artifacts


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at))


def _disproved(places: set[tuple[str, str]], by_unit: dict[str, list[Invocation]]) -> bool:
    """The journal shows that no two of these (machine, unit) copies were live at the same moment."""
    chosen = []
    for machine, unit in places:
        candidates = [inv for inv in by_unit.get(unit, []) if inv.machine == machine]
        if len(candidates) != 1:
            return False  # cannot tell which start the sample saw
        chosen.append(candidates[0])
    pairs = [(a, b) for i, a in enumerate(chosen) for b in chosen[i + 1:]]
    return all(_overlap(a, b) is False for a, b in pairs)


def _retryable(run: Run, mine: list[Attempt], a: Attempt) -> bool:
    """Whether the run's policy retries it after attempt `a` of `mine` (its attempts in order), a cancel
    aside (the caller weighs it): retry_on names the outcome, or its exit status (`exit:N` of an
    exit-code, `signal:NAME` of a kill); and attempts are left, where a lost one counts against
    max_attempts only with count_lost, and otherwise against max_lost_attempts (schema 027). Written
    from docs/sql-api.md, Failure rules, not from the code (fail_on: the nemesis submits none)."""
    if a.outcome not in RETRYABLE_BY_DEFAULT:
        return False
    code = a.exit_status if (a.outcome == "exit-code" and (a.exit_status or "").startswith("exit:")) or (
        a.outcome in ("signal", "core-dump") and (a.exit_status or "").startswith("signal:")) else None
    if run.retry_on is not None and a.outcome not in run.retry_on and code not in run.retry_on:
        return False
    lost = 0 if run.count_lost else sum(1 for b in mine if b.attempt <= a.attempt and b.outcome == "lost")
    if a.outcome == "lost" and not run.count_lost:
        return lost < run.max_lost_attempts
    return a.attempt - lost < run.max_attempts


def _check_states(runs: Sequence[Run], attempts: Sequence[Attempt]) -> list[Violation]:
    per_run: dict[str, list[Attempt]] = defaultdict(list)
    for a in attempts:
        per_run[a.run_id].append(a)
    out = []
    for run in runs:
        mine = sorted(per_run.get(run.id, []), key=lambda a: a.attempt)
        numbers = [a.attempt for a in mine]
        if numbers != list(range(1, len(mine) + 1)):
            out.append(Violation("bad-attempts", run.id, f"attempt numbers {numbers}"))
            continue
        if run.state not in TERMINAL:
            last = f"; last attempt {mine[-1].attempt} on {mine[-1].host_id}: {mine[-1].outcome}" if mine else ""
            out.append(Violation("unsettled", run.id, f"still {run.state} after the fleet healed{last}"))
            continue
        if any(a.outcome is None for a in mine):
            out.append(Violation("bad-attempts", run.id, f"{run.state} with an open attempt "
                                 f"{[a.attempt for a in mine if a.outcome is None]}"))
            continue
        # Each attempt after another needs a reason: its predecessor's outcome was retryable, or an
        # operator resumed the run (each resume explains one).
        unexplained = [a for a in mine[:-1] if not _retryable(run, mine, a)]
        if any(a.outcome == "success" for a in mine[:-1]):
            out.append(Violation("unexplained-state", run.id, "an attempt after a success: "
                                 + _history(mine)))
            continue
        if len(unexplained) > run.resumes:
            out.append(Violation("unexplained-state", run.id, f"attempts after non-retryable outcomes "
                                 f"{[(a.attempt, a.outcome) for a in unexplained]} with {run.resumes} resumes "
                                 f"(max_attempts {run.max_attempts}, retry_on {run.retry_on}): " + _history(mine)))
            continue
        reason = _final_state_problem(run, mine)
        if reason:
            out.append(Violation("unexplained-state", run.id, f"{run.state}: {reason}: " + _history(mine)))
    return out


def _final_state_problem(run: Run, mine: list[Attempt]) -> str:
    last = mine[-1] if mine else None
    outcome = last.outcome if last else None
    if run.state == "succeeded":
        return "" if outcome == "success" else "without a successful last attempt"
    if run.state == "cancelled":
        if outcome == "cancelled" or run.cancel_requested or last is None:
            return ""
        return "with no cancel requested and a last attempt that was not cancelled"
    if run.state == "failed":
        if last is None:
            return "failed without any attempt"
        if outcome not in FAILURES:
            return f"failed after a last attempt {outcome}"
        if _retryable(run, mine, last) and not run.cancel_requested:
            return f"failed although attempt {last.attempt} ({outcome}) had a retry left"
        return ""
    return ""  # expired: nothing ran, or the checks above found the problem


def _history(mine: list[Attempt]) -> str:
    return ", ".join(f"{a.attempt}@{a.host_id}={a.outcome}" for a in mine) or "no attempts"


def _ended_invocations(a: Attempt, by_unit: dict[str, list[Invocation]]) -> list[Invocation]:
    found = [inv for inv in by_unit.get(a.unit_name, []) if inv.ended is not None and inv.host_id == a.host_id]
    if a.invocation_id:
        exact = [inv for inv in found if inv.invocation == a.invocation_id]
        if exact:
            return exact
    return found


def _check_outcomes(attempts: Sequence[Attempt], by_unit: dict[str, list[Invocation]]) -> list[Violation]:
    """An outcome the unit's journal contradicts. Only success, exit-code and signal say what the
    process did; `lost`, `cancelled`, `timeout` are the fleet's or an operator's decisions."""
    out = []
    for a in attempts:
        if a.outcome not in ("success", "exit-code", "signal"):
            continue
        for inv in _ended_invocations(a, by_unit):
            said = _journal_says(inv)
            if said and not _agrees(a, said):
                out.append(Violation("outcome-contradicts-journal", a.run_id,
                                     f"attempt {a.attempt} recorded {a.outcome} {a.exit_status or ''}".rstrip()
                                     + f" but the journal of {inv.where} says {said}"))
    return out


def _check_operations(operations: Sequence[Operation]) -> list[Violation]:
    """A guarded command that went ahead. The run id is empty: the promise broken is the command's."""
    return [Violation("action-not-refused", "-", f"{op.action} on {op.host_id} at {_clock(op.at)} UTC went ahead "
                      f"although {op.detail or 'its guard held'}")
            for op in operations if op.guarded and not op.refused]


def _journal_says(inv: Invocation) -> str:
    if inv.result == "success" and not inv.exit_code:
        return "success"
    if inv.exit_code == "exited":
        return f"exit:{inv.exit_status}"
    if inv.exit_code in ("killed", "dumped"):
        return f"signal {inv.exit_status}"
    return ""


def _agrees(a: Attempt, said: str) -> bool:
    if a.outcome == "success":
        return said in ("success", "exit:0")
    if a.outcome == "exit-code":
        return said == a.exit_status
    return said.startswith("signal")


def _check_contacts(contacts: Sequence[Contact]) -> list[Violation]:
    """A host that talked to anything but PostgreSQL while partitioned from a peer: one violation per
    (host, unit, peer), however many times it was listed."""
    seen = sorted({(c.host_id, c.unit, c.peer) for c in contacts if not c.database})
    return [Violation("host-to-host", "-", f"{unit} on {host_id} had a socket to {peer}, not to its database "
                      "proxies, while partitioned from a peer") for host_id, unit, peer in seen]


# How much later than host_dead_after after a stall a declaration may still be the stall's doing, and how
# long before a stall a host's own fault may still explain its silence: a poll interval and the upkeep's
# turn, with room for a loaded machine.
STALL_SLACK = 10.0


def _check_stalls(declarations: Sequence[Declaration], faults: Sequence[Fault], dead_after: float) -> list[Violation]:
    """A host declared dead during a stall of the database, or within `dead_after` (+ STALL_SLACK) of its
    end, while no fault of that host's own (a kill, a partition, a power cut ...) was under way from
    `dead_after` (+ STALL_SLACK) before the stall to the declaration: its silence was the database's."""
    out = []
    stalls = [f for f in faults if f.name in STALLS]
    for d in declarations:
        for stall in stalls:
            if not stall.began <= d.at <= stall.ended + dead_after + STALL_SLACK:
                continue
            own = [f for f in faults if f.host_id == d.host_id and f.began <= d.at
                   and f.ended >= stall.began - dead_after - STALL_SLACK]
            if not own:
                out.append(Violation("declared-in-stall", "-", f"{d.host_id} declared dead by {d.by} at "
                                     f"{_clock(d.at)} UTC, {d.at - stall.began:.1f} s after the database stalled "
                                     f"for {stall.ended - stall.began:.1f} s, with no fault of its own"))
    return out


def format_report(seed: int, schedule: Sequence[str], report: Report, figures: dict[str, object] | None = None) -> str:
    lines = [f"nemesis seed {seed}", f"schedule ({len(schedule)} actions):"]
    lines += [f"  {entry}" for entry in schedule]
    stats = {**(figures or {}), **report.stats}
    lines.append("figures: " + ", ".join(f"{k} {v}" for k, v in stats.items()))
    kinds: dict[str, int] = defaultdict(int)
    for violation in report.violations:
        kinds[violation.kind] += 1
    lines.append(f"violations: {len(report.violations)}" + (f" ({dict(kinds)})" if kinds else ""))
    lines += [f"  {violation}" for violation in report.violations]
    return "\n".join(lines)
