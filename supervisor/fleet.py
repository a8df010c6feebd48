"""The fleet's own decisions: who this host is, what it tells the database it may run, what a run of a
dead host ends with, and how the hosts' states read to an operator. Pure: no I/O, no clock.

The database decides the rest from what hosts register (sql/migrations/002_fleet.sql): which host may claim
which run (host_refusal), when a host is dead (declare_dead_hosts) and whose writes still count
(check_fence). The reconciler is the one place that acts on a dead host's runs; the daemon registers.
docs/fleet.md says what the fleet promises, and why each timeout is what it is.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path

from supervisor import envpolicy, globs, store
from supervisor.config import Settings
from supervisor.model import Run
from supervisor.outcomes import Outcome
from supervisor.quantities import format_duration

# A claim takes only its fair share of jobs that became due less than this long ago (the rest are
# left for the other live hosts); the daemon claims again after it, so nothing waits on a share.
SPREAD_GRACE = 1.0
RECLAIM_AFTER = SPREAD_GRACE + 0.5
# A job just submitted is the work of the hosts its submit's NOTIFY woke, for as long as a claim keeps it to
# fair shares: until then another host's heartbeat does not count it (schema 047), where on 1,000 hosts one
# submit drew about a claim for every 10 ms it waited, all but one empty (issue 23). Under the reclaim's
# delay, so that the reclaim's probe still finds what the fair shares left.
LEFT_TO_WOKEN = timedelta(seconds=SPREAD_GRACE)


# Due jobs one explain_waiting pass looks at; a longer backlog is explained batch by batch, one batch a
# pass. With the refusal computed once per kind of run, 1,000 runs of a few kinds cost milliseconds.
EXPLAIN_BATCH = 1000


def boot_id(path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def instance_id(machine_id: str, boot: str) -> str:
    """This machine in this boot. A daemon restarted on the same machine keeps its host's epoch and
    adopts its runs; another machine with the same host id (a cloned machine id, a reused [host] id)
    has another instance, and may not take the id while its holder is alive."""
    return hashlib.sha256(f"{machine_id}\0{boot}".encode()).hexdigest()[:16]


def host_profile(settings: Settings, version: str, instance: str, boot: str, is_root: bool) -> store.HostProfile:
    """What this host registers: the claim in the database filters on exactly these facts."""
    runs = settings.runs
    return store.HostProfile(
        host_id=settings.host_id, name=settings.host_name, instance=instance, max_runs=settings.host.max_runs,
        memory_budget=settings.host.memory_budget, version=version, boot_id=boot,
        allowed_executables=runs.allowed_executables,
        executable_patterns=tuple(globs.glob_regex(p) for p in runs.allowed_executables),
        run_user=runs.user, allowed_users=runs.allowed_users,
        environment_denied=envpolicy.denied_regexes(),
        environment_names=envpolicy.allowed_names(runs.allowed_environment),
        environment_patterns=envpolicy.allowed_pattern_regexes(runs.allowed_environment),
        can_start=is_root,
        cannot_start_reason=None if is_root else "the daemon is not root; systemd starts units only for root",
        poll_interval=settings.daemon.poll_interval, dead_after=settings.fleet.host_dead_after,
        labels=settings.host.labels)


def explain_after(settings: Settings) -> timedelta:
    """A run due for longer than this and still unclaimed gets its reason for waiting recorded: two
    poll intervals, by which every live host that accepts it has had its chance to claim it."""
    return timedelta(seconds=2 * settings.daemon.poll_interval)


def takeover_outcome(run: Run, dead: store.DeadHost, declarer: str) -> Outcome:
    """The outcome of an open attempt of a host declared dead. Time across hosts is all there is to go
    on, so it is `lost` (retried by the run's retry_on and attempts, like any lost attempt), or
    `cancelled` when a cancel was already requested: nobody is left to stop it, and it must not run again."""
    silent = (f"host {dead.host_id} was silent for {dead.silent:.0f}s (its host_dead_after is "
              f"{dead.dead_after:g}s); declared dead by host {declarer}")
    if run.cancel_requested_at is not None:
        return Outcome("cancelled", None, f"cancel requested; {silent}")
    return Outcome("lost", None, silent)


def id_takeover_outcome(run: Run, host_id: str, previous: str, instance: str) -> Outcome:
    """The outcome of an open attempt of a host id that another instance took over after the id's
    host_dead_after of silence: as for a host declared dead (takeover_outcome), since the instance that
    claimed it (another machine, or this one before a reboot) may have started it, and this one cannot
    know; left open, this instance's reconcile pass could start a claimed attempt a second time."""
    why = (f"host id {host_id} was taken over by instance {instance} from instance {previous} after its "
           "host_dead_after of silence")
    if run.cancel_requested_at is not None:
        return Outcome("cancelled", None, f"cancel requested; {why}")
    return Outcome("lost", None, why)


def cut_off_outcome(outcome: Outcome, seconds: float) -> Outcome:
    """A unit this host stopped itself because it was cut off from the database: the run did not end
    on its own, and it may have been retried elsewhere, so it is `lost`, whatever the stop made it exit with."""
    return Outcome("lost", outcome.exit_status,
                   f"stopped by this host after {seconds:.0f}s cut off from the database (stop_runs_when_cut_off)")


# A host is shown `stale` once it missed this many heartbeats: before anyone may declare it dead (at
# least 3 polls), so an operator sees trouble coming.
STALE_AFTER_POLLS = 2


def host_display_state(row: dict) -> str:
    """A host's state for people: its state, `drained` for a stopped or dead host that comes back
    draining (schema 24), `stale` once it missed two heartbeats (before others may declare it dead),
    and `conflict` while a second daemon with its id keeps being refused."""
    state = row["state"]
    poll = row.get("poll_interval_sec") or 10.0
    notes = []
    if state in ("stopped", "dead") and row.get("comes_back_draining"):
        notes.append("drained")
    if state in ("active", "draining") and row["heartbeat_age"] > STALE_AFTER_POLLS * poll:
        notes.append("stale")
    conflict_age = row.get("conflict_age")
    if conflict_age is not None and conflict_age < 3 * poll and state != "dead":
        notes.append("conflict")
    return f"{state} ({', '.join(notes)})" if notes else state


# What unitvisor.fleet_refusal says of a run when no host at all is live (sql/002_fleet.sql). It names no
# host, so a run held by a drain read "every host is dead, stopped, draining or silent" (issue 24).
# The SQL text is left as it is (another migration reworks fleet_refusal); the CLI names the hosts.
NO_LIVE_HOST = "no live host (every host is dead, stopped, draining or silent)"
# More hosts than this are counted, not named: a long list of retired hosts hides the drained one.
NAMED_HOSTS = 5


def host_not_live(row: dict) -> str | None:
    """Why a host claims nothing at all, in words that name it ("host web-1 is draining"), from a row of
    store.list_hosts; None for a live host (active, heard from within its own host_dead_after: the rule
    of unitvisor.host_is_live)."""
    host, state = row["id"], row["state"]
    if state != "active":
        return f"host {host} is {state}"
    if row["heartbeat_age"] >= (row.get("dead_after_sec") or 60.0):
        return f"host {host} has been silent for {format_duration(row['heartbeat_age'])}"
    return None


def name_the_hosts(reason: str | None, hosts: list[dict]) -> str | None:
    """A waiting run's reason with the hosts named where the database's words name none: "no live host:
    host web-1 is draining; host web-2 is dead" instead of NO_LIVE_HOST. Any other reason as it is."""
    if reason != NO_LIVE_HOST:
        return reason
    said = [why for why in map(host_not_live, hosts) if why]
    if not said:
        return "no live host: no host has registered (see `unitvisor hosts`)" if not hosts else reason
    more = len(said) - NAMED_HOSTS
    return "no live host: " + "; ".join(said[:NAMED_HOSTS]) + (
        f"; and {more} more host{'s' if more > 1 else ''} that claim nothing" if more > 0 else "")
