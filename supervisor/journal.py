"""Reading journald: what PID 1 recorded about a unit that is no longer loaded.

Used by the reconciler when an attempt's unit is gone: the host rebooted, someone ran reset-failed,
or the unit ended cleanly while no daemon held a reference on it (the daemon was stopped or crashed:
PID 1 collects a cleanly ended unit at once then, see unitspec.build). PID 1 logs a failed unit's
exit ("Main process exited", EXIT_CODE/EXIT_STATUS) and result ("Failed with result", UNIT_RESULT) at
info level, so a failure survives in the journal. A clean exit's own record is debug level, not
stored; what is stored is the unit's "Deactivated successfully" (MSG_UNIT_SUCCESS, systemd >= 248),
logged when the unit ends with Result=success. That proves a success only when the same invocation
has no stop job: a unit stopped (a cancel, `systemctl stop`, the host's shutdown) whose command dies
of SIGTERM ends with Result=success and the same record, after "Stopping ..." (JOB_TYPE=stop). An
exit that follows a stop job is the stop's doing, not the run's, and is `lost`. What a clean
"Deactivated successfully" cannot tell apart (measured with systemd 252): an exit 0, and a death by
SIGHUP, SIGINT, SIGTERM or SIGPIPE sent by something other than a stop job (a `kill` by hand, the
command signalling itself), which systemd also counts as a success; such a rare run is recorded as
the success systemd saw. The exit record's (or the success record's) own time
(__REALTIME_TIMESTAMP) is the attempt's end; the figures of PID 1's resource-usage record, when it
logged one (only above its thresholds: 1 s of CPU, 1 MB of IO), are its accounting.

This needs the journal of the boot in which the unit ended. Within a boot journald always has it
(in /run/log/journal at least); across a reboot only a persistent journal does: `Storage=persistent`,
or the default `Storage=auto` with /var/log/journal present (as on this project's Debian 12 test
machines). With a volatile journal, an attempt whose unit ended while the daemon was down and the
host then rebooted has no record left and stays `lost` (its run retries by its policy), as any
attempt of a rebooted host did before. Even a persistent journal may lose what PID 1 logs late in a
shutdown (seen once in about twenty reboots of the test bed: likely logged after journald let go of
/var/log/journal, systemd-journal-flush.service's ExecStop, which nothing orders after the runs'
units): a run stopped then has no end in the journal and is `lost`. What is lost that way is
everything from some record on, so a kept success record keeps the stop job that came before it.

It also says whether an attempt claimed here, whose start was never recorded, may be started
(unit_history): only when the journal reaches back to its claim and knows no unit of that name. A
journal rotated or vacuumed since the claim, or one that cannot be read, proves nothing either way,
and the reconciler then never starts the attempt (issue 21).

It also tells a command's own exit status of 200-243 from systemd's setup failure (see the note in
supervisor/outcomes.py): the child PID 1 forked logs a spawn failure, PID 1 logs "Started" only once the
command was exec'd.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from supervisor import fence
from supervisor.model import Accounting
from supervisor.outcomes import CLD_DUMPED, CLD_EXITED, CLD_KILLED, Outcome, classify
from supervisor.systemd import from_usec

MSG_PROCESS_EXIT = "98e322203f7a4ed290d09fe03c09fe15"
# systemd's sd-messages.h (252): SD_MESSAGE_UNIT_FAILURE_RESULT, _UNIT_STOPPING, _UNIT_STOPPED,
# _UNIT_SUCCESS, _UNIT_RESOURCES. (Before 0.4.0 MSG_UNIT_STOPPING had a wrong value, so a stop job was
# never seen.)
MSG_UNIT_FAILED = "d9b373ed55a64feb8242e02dbe79a49c"
MSG_UNIT_STOPPING = "de5b426a63be47a7b6ac3eaac82e2f6f"
MSG_UNIT_STOPPED = "9d1aaa27d60140bd96365438aad20286"
MSG_UNIT_SUCCESS = "7ad2d189f7e94e70a38c781354912448"
MSG_UNIT_RESOURCES = "ae8f7b866b0347b9af31fe1c80b127c0"
MSG_UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
MSG_SPAWN_FAILED = "641257651c1b4ec9a8624d7a40a9e1e7"
# "Skipped due to 'exec-condition'." (UNIT_RESULT): the unit's lease check refused its start (fence.py),
# after which PID 1 also logs, under MSG_UNIT_STARTED, "Condition check resulted in ... being skipped":
# that record proves no start.
MSG_UNIT_SKIPPED = "0e4284a0caca4bfc81c0bb6786972673"
_CODES = {"exited": CLD_EXITED, "killed": CLD_KILLED, "dumped": CLD_DUMPED}
# The records after which PID 1 writes nothing more about an invocation that ended.
_FINAL = {MSG_UNIT_SUCCESS, MSG_UNIT_FAILED, MSG_UNIT_STOPPED}
# The resource-usage record's fields (systemd's unit_log_resources) -> Accounting.
_RESOURCE_FIELDS = {"cpu_usage_nsec": "CPU_USAGE_NSEC", "io_read_bytes": "IO_METRIC_READ_BYTES",
                    "io_write_bytes": "IO_METRIC_WRITE_BYTES"}


@dataclass(frozen=True)
class Found:
    """An outcome read from the journal, when the main process ended by the journal's clock, and what
    PID 1's resource-usage record says it consumed (NULLs when it logged none)."""

    outcome: Outcome
    ended_at: datetime | None
    accounting: Accounting = Accounting()


def without_stop_command(records: list[dict[str, str]]) -> list[dict[str, str]]:
    """Pure: the records less the exit record of the unit's own stop command (the tasks-peak copy,
    supervisor/taskspeak.py: ExecStopPost=, which exits 0). PID 1 logs it at debug level only, so on
    a host that logs at debug it follows the run's own exit record and would be taken for it: a run
    that exited 3 would read as exit 0, and a unit whose command never ran as one that did."""
    return [r for r in records
            if not (r.get("MESSAGE_ID") == MSG_PROCESS_EXIT
                    and (r.get("COMMAND") == "ExecStopPost" or "Control process exited" in r.get("MESSAGE", "")))]


def program_ran(records: list[dict[str, str]], trust_absence: bool) -> bool | None:
    """Pure: whether one invocation's records prove its command was exec'd (True), prove systemd
    failed to set it up (False), or neither (None).

    `trust_absence`: the unit is still loaded and PID 1's exit record is in the journal, so a spawn
    failure (sent before it, on the same socket) would be there too. Never after a reboot: a power cut
    can keep a later journal page and lose an earlier one.
    """
    ids = {record.get("MESSAGE_ID") for record in without_stop_command(records)}
    if MSG_SPAWN_FAILED in ids or MSG_UNIT_SKIPPED in ids:
        return False
    if MSG_UNIT_STARTED in ids:
        return True
    if trust_absence and MSG_PROCESS_EXIT in ids:
        return True
    return None


class Unreadable(Exception):
    """journalctl failed, timed out, or printed what is not its JSON: the journal said nothing either way."""


class History(enum.Enum):
    """What the journal says about whether a unit not loaded now was ever started (unit_history)."""

    KNOWN = "known"  # PID 1 logged about it: it was started
    UNKNOWN = "unknown"  # nothing about it, and the journal reaches back to its attempt's claim
    INCOMPLETE = "incomplete"  # nothing about it, but the journal may have lost what it would say
    UNREADABLE = "unreadable"  # journalctl failed, timed out, or printed what is not its JSON


def _boot_started() -> float:
    """When this boot began, on this host's realtime clock (seconds since the epoch)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
    except OSError:
        return ""


def _of_this_boot(records: list[dict[str, str]]) -> bool:
    """Whether the last of these records was written in the running boot (by its trusted _BOOT_ID)."""
    return bool(records) and records[-1].get("_BOOT_ID", "") == _boot_id() != ""


def _realtime(record: dict[str, str]) -> datetime | None:
    try:
        return from_usec(int(record.get("__REALTIME_TIMESTAMP", "")))
    except ValueError:
        return None


def _stop_job(record: dict[str, str]) -> bool:
    return record.get("MESSAGE_ID") in (MSG_UNIT_STOPPING, MSG_UNIT_STOPPED) and record.get("JOB_TYPE") == "stop"


def accounting_from_records(records: list[dict[str, str]]) -> Accounting:
    """Pure: the figures of the last resource-usage record among them; NULL for any it lacks."""
    usage = [r for r in records if r.get("MESSAGE_ID") == MSG_UNIT_RESOURCES]
    if not usage:
        return Accounting()
    values: dict[str, int | None] = {}
    for key, name in _RESOURCE_FIELDS.items():
        raw = usage[-1].get(name, "")
        values[key] = int(raw) if raw.isdigit() and int(raw) < 2**63 else None
    return Accounting(**values)


def success_from_records(records: list[dict[str, str]]) -> Found | None:
    """Pure: a success that PID 1's records prove, where they hold no exit record (a clean exit's
    is debug level): one invocation, its "Deactivated successfully", no stop job at all (a stopped
    unit whose command died of SIGTERM logs the same record), no failure record. Anything else
    proves nothing (None)."""
    successes = [r for r in records if r.get("MESSAGE_ID") == MSG_UNIT_SUCCESS]
    if not successes or len({r["INVOCATION_ID"] for r in records if r.get("INVOCATION_ID")}) > 1:
        return None
    if any(_stop_job(r) or r.get("MESSAGE_ID") in (MSG_UNIT_FAILED, MSG_SPAWN_FAILED) for r in records):
        return None
    return Found(Outcome("success", "exit:0", "exited 0 (from the journal: systemd recorded the unit's success and "
                         "no stop job; the unit was gone)"), _realtime(successes[-1]), accounting_from_records(records))


def found_from_records(records: list[dict[str, str]]) -> Found | None:
    """Pure: the outcome PID 1's records about one unit invocation show, if they show one."""
    records = without_stop_command(records)
    ids = {r.get("MESSAGE_ID") for r in records}
    skipped = [r for r in records if r.get("MESSAGE_ID") == MSG_UNIT_SKIPPED]
    if skipped and (refused := fence.refused_start_outcome(skipped[-1].get("UNIT_RESULT", ""), False)) is not None:
        return Found(Outcome(refused.outcome, None, f"{refused.reason} (from the journal; the unit was gone)"),
                     _realtime(skipped[-1]), Accounting())
    if MSG_UNIT_SUCCESS in ids and MSG_PROCESS_EXIT not in ids:
        return success_from_records(records)
    result = code = status = None
    ended_at = None
    for record in records:
        message_id = record.get("MESSAGE_ID")
        if _stop_job(record) and code is None:
            return None
        if message_id == MSG_PROCESS_EXIT and record.get("EXIT_CODE") in _CODES:
            code = _CODES[record["EXIT_CODE"]]
            try:
                status = int(record.get("EXIT_STATUS", ""))
            except ValueError:
                return None
            ended_at = _realtime(record)
        elif message_id == MSG_UNIT_FAILED and record.get("UNIT_RESULT"):
            result = record["UNIT_RESULT"]
    if code is None or status is None:
        if result is None:
            return None
        # No process ever ran (resources, start-limit-hit, ...): the result alone says start-failed.
        found = classify(result, 0, 0, cancel_requested=False)
        if found.outcome != "start-failed":
            return None
    else:
        found = classify(result or "", code, status, cancel_requested=False,
                         program_ran=program_ran(records, trust_absence=False))
    return Found(Outcome(found.outcome, found.exit_status, f"{found.reason} (from the journal; the unit was gone)"),
                 ended_at, accounting_from_records(records))


def outcome_from_records(records: list[dict[str, str]]) -> Outcome | None:
    found = found_from_records(records)
    return found.outcome if found else None


class Journal:
    # After a journalctl that timed out, the reads that decide outcomes and starts answer "unreadable"
    # at once for this long. They run in the daemon's loop, which also renews the heartbeat: a pass
    # over twenty attempts whose journal hangs would otherwise wait 200 s, past host_dead_after, and
    # peers would declare this host dead and run its runs again. Shorter than the reconcile interval
    # (30 s by default) would let every pass pay one timeout; this lets about every other pass try.
    QUIET_AFTER_TIMEOUT = 30.0

    def __init__(self, timeout: float = 10.0, settle_wait: float = 1.0) -> None:
        self.timeout = timeout
        self.settle_wait = settle_wait
        self._quiet_until = 0.0

    def _journalctl(self, args: list[str]) -> str | None:
        """journalctl's standard output (text), or None when it failed, timed out or could not run."""
        if time.monotonic() < self._quiet_until:
            return None
        try:
            done = subprocess.run(["journalctl", *args], capture_output=True, text=True, timeout=self.timeout,
                                  check=False)
        except subprocess.TimeoutExpired:
            self._quiet_until = time.monotonic() + self.QUIET_AFTER_TIMEOUT
            return None
        except OSError:
            return None
        return done.stdout if done.returncode == 0 else None

    def _records(self, unit_name: str, invocation_id: str | None) -> list[dict[str, str]] | None:
        """PID 1's records about the unit, and its forked child's spawn failure; None when unreadable."""
        scope = [f"UNIT={unit_name}"]
        if invocation_id:
            scope.append(f"INVOCATION_ID={invocation_id}")
        # journalctl ORs the groups around "+": PID 1's own records, or the child's spawn failure.
        matches = ["_PID=1", *scope, "+", f"MESSAGE_ID={MSG_SPAWN_FAILED}", *scope]
        stdout = self._journalctl(["--no-pager", "-q", "-o", "json", *matches])
        if stdout is None:
            return None
        records = []
        for line in stdout.split("\n"):
            if not line:
                continue
            # Anything but journalctl's own JSON records means the read went wrong somewhere: what is
            # missing from it may be the very record that matters (a "Started" that proves the unit
            # ran, a stop job that spoils a success), so the whole read is unreadable, not a shorter one.
            try:
                entry = json.loads(line)
            except ValueError:
                return None
            if not isinstance(entry, dict):
                return None
            records.append({k: v for k, v in entry.items() if isinstance(v, str)})
        return records

    def _output(self, matches: list[str], lines: int) -> str | None:
        """The message text of the last `lines` records that match, one per line; None when the
        journal could not be read. Bytes that are not UTF-8 are replaced, not dropped."""
        try:
            done = subprocess.run(["journalctl", "--no-pager", "-q", "-o", "cat", f"--lines={lines}", *matches],
                                  capture_output=True, timeout=self.timeout, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        return done.stdout.decode(errors="replace")

    def output_tail(self, run_id: str, attempt: int, max_lines: int, max_bytes: int) -> str | None:
        """The end of an attempt's output, to keep with its outcome (cut_tail); None when kept off or
        the journal is unreadable, "" when the attempt printed nothing."""
        if max_lines <= 0 or max_bytes <= 0:
            return None
        # A record may hold several lines (a multi-line syslog message): the cut counts lines, not records.
        text = self._output(log_matches(run_id, attempt), max_lines)
        return None if text is None else cut_tail(text, max_lines, max_bytes)

    def output_tails(self, attempts: Sequence[tuple[str, int]], max_lines: int, max_bytes: int) -> list[str | None]:
        """output_tail of each attempt (run id, attempt number), in order, with one journalctl for all.

        That journalctl reads the last `len(attempts) * max_lines` records of any of their runs, as
        JSON, and splits them by their UNITVISOR_RUN and UNITVISOR_ATTEMPT. An attempt with at least
        `max_lines` records among them has its last `max_lines` there, as its own read would give;
        one with fewer has them all unless the read hit its bound, where another attempt's lines may
        have crowded it out: such an attempt is read alone (output_tail), so that no tail depends on
        what else was read with it. So is an attempt one of whose last `max_lines` records has a
        MESSAGE of 4096 bytes or more, which journalctl's JSON leaves out (null, without --all): a
        read holds at most `bound` records of less than that (about 10 MB of JSON if every byte is
        written as a number), and a rare long line costs its attempt today's read. A journalctl that
        fails or times out keeps no tail of any (None each), as output_tail's would; output it
        cannot parse has every attempt read alone.

        The matches name the runs only (journalctl ORs the values of one field): each attempt's own
        pair of matches, ORed with "+", made journalctl's CPU twice as much (43 against 21 ms for 64
        attempts of 10 lines, docs/benchmarks.md). Another attempt of the same run only counts
        against the bound, like any other run's lines."""
        unique = list(dict.fromkeys(attempts))
        if len(unique) <= 1 or max_lines <= 0 or max_bytes <= 0:
            return [self.output_tail(run_id, attempt, max_lines, max_bytes) for run_id, attempt in attempts]
        bound = len(unique) * max_lines
        matches = [f"UNITVISOR_RUN={run_id}" for run_id in dict.fromkeys(run_id for run_id, _ in unique)]
        try:
            done = subprocess.run(["journalctl", "--no-pager", "-q", "-o", "json", f"--lines={bound}",
                                   "--output-fields=MESSAGE,UNITVISOR_RUN,UNITVISOR_ATTEMPT", *matches],
                                  capture_output=True, timeout=self.timeout, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return [None] * len(attempts)
        if done.returncode != 0:
            return [None] * len(attempts)
        try:
            messages, count = split_output(done.stdout, unique)
        except ValueError:
            messages, count = [[] for _ in unique], bound
        tails = {}
        for (run_id, attempt), mine in zip(unique, messages, strict=True):
            last = mine[-max_lines:]
            if (len(mine) < max_lines and count >= bound) or any(m is LONG for m in last):
                tails[run_id, attempt] = self.output_tail(run_id, attempt, max_lines, max_bytes)
            else:
                text = b"".join(m + b"\n" for m in last if isinstance(m, bytes)).decode(errors="replace")
                tails[run_id, attempt] = cut_tail(text, max_lines, max_bytes)
        return [tails[a] for a in attempts]

    def has_output(self, run_id: str, attempt: int | None) -> bool:
        """Whether this host's journal holds any of the run's (or the attempt's) output records."""
        return bool(self._output(log_matches(run_id, attempt), 1))

    def outcome(self, unit_name: str, invocation_id: str | None) -> Found | None:
        """The outcome of a unit that is gone (host reboot, reset-failed, a clean end collected while
        no daemon held it), if the journal shows one.

        A unit of this boot may be gone a moment before journald has written PID 1's last records
        about it (they travel on a datagram socket, the unit's removal on D-Bus): when this boot's
        records of it show no end yet, wait for one a little (`settle_wait`). Never for an earlier
        boot's (nothing more will come), so a pass after a reboot does not wait per run.

        Raises Unreadable when journalctl fails, times out or prints what is not its JSON: "no
        outcome proven" (None, the attempt is `lost`) is an answer, and an unreadable journal gives
        none; settled `lost` then, a run that succeeded would run again by its retry policy."""
        deadline = time.monotonic() + self.settle_wait
        while True:
            records = self._records(unit_name, invocation_id)
            if records is None:
                raise Unreadable(f"the journal could not be read about {unit_name}")
            if (any(r.get("MESSAGE_ID") in _FINAL for r in records) or not _of_this_boot(records)
                    or time.monotonic() >= deadline):
                return found_from_records(records)
            time.sleep(0.1)

    def unit_history(self, unit_name: str, since: datetime | None) -> History:
        """What the journal can say about whether a unit was ever started, for an attempt claimed at
        `since` (this host's clock; None: unknown) whose unit is not loaded now.

        KNOWN: PID 1 logged about it, so it was started. UNKNOWN only when that absence proves
        something: the journal holds PID 1's records from before `since` (journald deletes whole
        files, oldest first, so everything after such a record is kept) and the claim is of this
        boot. INCOMPLETE otherwise: the records of the claim's time were rotated or vacuumed away,
        or the claim is older than this boot, whose journal a power cut may have left with a hole
        (a later page kept, an earlier one lost). UNREADABLE: journalctl failed, timed out, or
        printed what is not its JSON."""
        records = self._records(unit_name, None)
        if records is None:
            return History.UNREADABLE
        if records:
            return History.KNOWN
        if since is None or since.timestamp() < _boot_started():
            return History.INCOMPLETE
        reaches = self.reaches_back(since)
        if reaches is None:
            return History.UNREADABLE
        return History.UNKNOWN if reaches else History.INCOMPLETE

    def reaches_back(self, since: datetime) -> bool | None:
        """Whether the journal holds a record of PID 1's written at or before `since` (this host's
        clock); None when it cannot be read. PID 1 logs at every unit's start and end, so on a host
        that has run anything its records are a fair clock of how far back the journal goes."""
        # Whole seconds, rounded down: the record asked for may only be older than that, never newer.
        until = math.floor(since.timestamp())
        # --reverse with --until: read backwards from `until`, so the one record shown is the newest
        # at or before it. Not --lines=1 alone: journalctl 252 applies that from the journal's tail,
        # and shows nothing whenever PID 1 logged anything after `until` (as after every claim).
        stdout = self._journalctl(["--no-pager", "-q", "-o", "json", "--reverse", "--lines=1",
                                   "--output-fields=_PID", f"--until=@{until}", "_PID=1"])
        if stdout is None:
            return None
        lines = [line for line in stdout.split("\n") if line]
        if not lines:
            return False
        try:
            record = json.loads(lines[-1])
            written = int(record["__REALTIME_TIMESTAMP"])
        except (ValueError, TypeError, KeyError):
            return None
        # Checked here too, not only by --until: a record that is not older proves nothing.
        return written <= until * 1_000_000

    def exec_evidence(self, unit_name: str, invocation_id: str | None) -> bool | None:
        """For a loaded unit that just ended with an exit status of 200-243: did its command run?

        journald may not have written PID 1's exit record yet when the unit's state says it ended:
        wait for it a little (`settle_wait`), since only then does a missing spawn failure prove anything.
        """
        deadline = time.monotonic() + self.settle_wait
        while True:
            records = self._records(unit_name, invocation_id)
            if records is None:
                return None
            if (any(r.get("MESSAGE_ID") == MSG_PROCESS_EXIT for r in without_stop_command(records))
                    or time.monotonic() >= deadline):
                return program_ran(records, trust_absence=True)
            time.sleep(0.1)


class TailReader:
    """Reads ended attempts' output tails from the journal `delay` seconds after their outcomes, on a
    thread of its own, for the daemon to write in batches (Reconciler.write_output_tails).

    Why later: journald takes in a run's output from its stream asynchronously, and nothing tells
    that a stream is complete. Read at the moment the unit ended, a run's last lines are usually in
    the journal, but not always: in a burst of 200 runs of 1000 lines each on the 2-core test machine,
    journald was seconds behind and a tail read at once missed its last 460 lines. `journalctl
    --sync` would make it exact (journald answers only once it has read what is queued), but costs
    about 12 ms, and an fsync of the journal on a real disk, per outcome. A delay costs nothing, and
    a tail read DELAY seconds after its run ended still misses lines only when journald is that far
    behind; the whole output stays in journald either way.

    Why a thread: a journalctl costs milliseconds of wall time and of CPU (docs/benchmarks.md), as
    much as the rest of a run's cost to the daemon; the loop that claims, starts and settles runs
    never waits for it. A tail not read when the daemon stops or crashes stays NULL (the attempt keeps
    its outcome; `unitvisor logs` on its host still reads the journal).

    Why in batches: most of a journalctl's cost is the process and opening the journal, not the
    records it reads, and one per ended attempt (plus the daemon's fork, pipe and the GIL its thread
    holds) cost a burst of runs a third of its throughput (issue 14). So the thread reads every
    attempt that is due (never before its time) with one journalctl (Journal.output_tails, which
    reads an attempt alone only where the batch cannot prove its tail), at most `batch_size` a time,
    and leaves SPACING seconds between reads unless the last one was full, so that under load a read
    finds many attempts due: a tail is read DELAY to DELAY + SPACING seconds after its outcome. A
    read holds at most BATCH_RECORDS records (its memory and time), so a host that keeps many lines
    a tail reads fewer attempts at once (one above 320 lines). Measured (bench.tails, the
    2-core machine, docs/benchmarks.md): 32 attempts of runs that print fewer lines than a tail
    keeps, one journalctl of 11 ms wall, 0.29 ms of its CPU and 0.04 ms of the daemon's per attempt,
    against 3.4 and 0.22 ms read one at a time; runs that each print more than a tail keeps and end
    together crowd one another out of the batch, and cost a little more than one at a time (3.8
    and 0.25 ms). A burst of 1000 runs without sandbox: 138 runs/s against 112 before, 135 with
    tails off.

    `threaded=False` reads at once, in the caller (a reconcile pass run by hand, the tests)."""

    DELAY = 2.0
    SPACING = 0.5
    MAX_BATCH = 32
    BATCH_RECORDS = 640  # MAX_BATCH attempts at the default output_tail_lines (20)

    def __init__(self, journal: Journal, max_lines: int, max_bytes: int, *, threaded: bool = True,
                 delay: float = DELAY, spacing: float = SPACING,
                 wake: Callable[[], None] = lambda: None) -> None:
        """`wake` is called (from the thread) each time tails are ready, so that the loop writes them soon."""
        self.journal = journal
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self.threaded = threaded
        self.delay = delay
        self.spacing = spacing
        self.wake = wake
        self.batch_size = max(1, min(self.MAX_BATCH, self.BATCH_RECORDS // max(1, max_lines)))
        self._todo: queue.SimpleQueue[tuple[float, uuid.UUID, int] | None] = queue.SimpleQueue()
        self._done: list[tuple[uuid.UUID, int, str]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.max_lines > 0 and self.max_bytes > 0

    def add(self, run_id: uuid.UUID, attempt: int) -> None:
        """An attempt whose outcome is recorded and whose output is in this host's journal."""
        if not self.enabled:
            return
        if not self.threaded:
            self._read([(run_id, attempt)])
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="output-tails", daemon=True)
            self._thread.start()
        self._todo.put((time.monotonic() + self.delay, run_id, attempt))

    def take(self) -> list[tuple[uuid.UUID, int, str]]:
        """The tails read since the last call: (run id, attempt, tail)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def give_back(self, taken: list[tuple[uuid.UUID, int, str]]) -> None:
        """Tails taken whose write failed (the database lost): the next take() returns them again."""
        with self._lock:
            self._done[:0] = taken

    def close(self, timeout: float) -> None:
        """Read what is queued, for at most `timeout` seconds (the rest is left unread), and stop."""
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _work(self) -> None:
        held: tuple[float, uuid.UUID, int] | None = None  # taken from the queue, not yet due: the next batch's first
        next_read = 0.0  # when SPACING after the last read has passed
        while (first := held or self._todo.get()) is not None:
            held = None
            # Queued in order, so each is due after the last.
            time.sleep(max(0.0, first[0] - time.monotonic(), next_read - time.monotonic()))
            batch, stop = [first], False
            while len(batch) < self.batch_size:
                try:
                    item = self._todo.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                if item[0] > time.monotonic():
                    held = item
                    break
                batch.append(item)
            next_read = time.monotonic() + (self.spacing if len(batch) < self.batch_size else 0.0)
            self._read([(run_id, attempt) for _, run_id, attempt in batch])
            self.wake()
            if stop:
                return

    def _read(self, attempts: list[tuple[uuid.UUID, int]]) -> None:
        tails = self.journal.output_tails([(str(run_id), attempt) for run_id, attempt in attempts],
                                          self.max_lines, self.max_bytes)
        read = [(run_id, attempt, tail) for (run_id, attempt), tail in zip(attempts, tails, strict=True)
                if tail is not None]
        with self._lock:
            self._done.extend(read)


class _Long:
    """A MESSAGE that journalctl's JSON left out (null): 4096 bytes or more."""


LONG = _Long()


def split_output(stdout: bytes, attempts: Sequence[tuple[str, int]]) -> tuple[list[list[bytes | _Long | None]], int]:
    """Pure: journalctl's JSON records (one a line) split by attempt: each attempt's MESSAGEs in the
    journal's order, as the bytes journald holds (None for a record without one, which -o cat skips
    but --lines counts; LONG for one the JSON left out), and how many records there were. A record
    belongs to every attempt whose run id and number are among its UNITVISOR_RUN and
    UNITVISOR_ATTEMPT values, as journalctl's matches have it. ValueError when the output is not
    such records."""
    index = {(run_id.encode(), str(attempt).encode()): i for i, (run_id, attempt) in enumerate(attempts)}
    messages: list[list[bytes | _Long | None]] = [[] for _ in attempts]
    count = 0
    # Split on "\n" alone: JSON escapes a newline in a string, not U+2028 and its kin, which str.splitlines
    # would also split on. journalctl writes bytes that are not UTF-8 as numbers, so its output is UTF-8.
    for line in stdout.decode().split("\n"):
        if not line:
            continue
        record = json.loads(line)
        if not isinstance(record, dict):
            raise ValueError(f"not a journal record: {line[:80]!r}")
        count += 1
        value = record.get("MESSAGE", ())  # () when the record has none
        # null: left out, alone or among the values of a MESSAGE given twice (which -o cat shows the first of)
        message = LONG if value is None or isinstance(value, list) and None in value else next(
            iter(field_values(value)), None)
        pairs = itertools.product(field_values(record.get("UNITVISOR_RUN")),
                                  field_values(record.get("UNITVISOR_ATTEMPT")))
        for i in {index[pair] for pair in pairs if pair in index}:  # once each, whatever a value repeats
            messages[i].append(message)
    return messages, count


def field_values(value: object) -> list[bytes]:
    """Pure: the values of one field of a record in journalctl's JSON, as bytes: a string when the
    value is UTF-8 without control characters (a tab aside), else an array of its byte values, and an
    array of those when the record has the field more than once (the first is what -o cat shows).
    null (a value too long for JSON without --all: split_output) and a missing field have none."""
    if isinstance(value, str):
        return [value.encode()]
    if isinstance(value, list):
        if all(isinstance(b, int) for b in value):
            return [bytes(value)]
        return [v for item in value for v in field_values(item)]
    return []


def cut_tail(text: str, max_lines: int, max_bytes: int) -> str | None:
    """Pure: the end of an output that is kept with an outcome: its last `max_lines` lines, then at
    most the last `max_bytes` bytes of those (UTF-8), None when either bound is 0 (keep none).

    The byte cut keeps the end (the last lines are what explains how a run ended) and lands on a
    character boundary, never inside one; where it lands inside a line, that partial line is dropped,
    unless it is the only line (a single line longer than the bound keeps its end)."""
    if max_lines <= 0 or max_bytes <= 0:
        return None
    lines = text.splitlines()[-max_lines:]
    kept = "\n".join(lines)
    data = kept.encode()
    if len(data) <= max_bytes:
        return kept
    cut = start = len(data) - max_bytes
    while start < len(data) and data[start] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        start += 1
    if data[cut - 1] != ord("\n"):  # the cut is inside a line
        newline = data.find(b"\n", start)
        if newline != -1:
            start = newline + 1
    return data[start:].decode()


def log_matches(run_id: str, attempt: int | None) -> list[str]:
    """The journal matches of a run's output (of one attempt, or of all): the LogExtraFields every run's
    unit carries, which journald adds to its processes' records (stdout, stderr, syslog, native) and
    never to PID 1's own records about the unit."""
    matches = [f"UNITVISOR_RUN={run_id}"]
    if attempt is not None:
        matches.append(f"UNITVISOR_ATTEMPT={attempt}")
    return matches


def log_command(run_id: str, attempt: int | None, follow: bool, lines: int | None) -> list[str]:
    """The journalctl command that shows a run's output (its processes' stdout, stderr and syslog),
    found by the LogExtraFields every run's unit carries, so it works long after the unit is gone."""
    cmd = ["journalctl", *log_matches(run_id, attempt)]
    if follow:
        cmd.append("--follow")
    if lines is not None:
        cmd.append(f"--lines={lines}")
    return cmd
