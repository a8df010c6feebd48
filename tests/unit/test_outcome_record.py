"""What an outcome keeps besides the outcome (schema 007): systemd's measurements of the unit, the end
of the attempt's output, and how `show` prints them. The store, systemd and journalctl are mocks at
their boundary: what is checked is what reaches them."""

from __future__ import annotations

import subprocess
import uuid
from datetime import UTC, datetime
from unittest import mock

import pytest

from supervisor import fleet, store, taskspeak
from supervisor.cli.output import accounting_text, not_measured, not_measured_text
from supervisor.config import RunSettings, Settings
from supervisor.journal import Journal, TailReader, cut_tail, log_command, log_matches
from supervisor.model import Accounting, Attempt, Run
from supervisor.outcomes import CLD_EXITED, Outcome
from supervisor.quantities import format_bytes, format_cpu_time
from supervisor.reconciler import Action, Reconciler, decide
from supervisor.systemd import Systemd, UnitState, accounting_from_properties
from supervisor.unitspec import unit_name

UNSET = 2**64 - 1
RUN_ID = uuid.UUID("00000000-0000-4000-8000-000000000007")
NAME = unit_name(RUN_ID, 1)
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
MEASURED = Accounting(cpu_usage_nsec=1_200_000_000, memory_peak_bytes=35_651_584, io_read_bytes=4096,
                      io_write_bytes=0)


# -- cut_tail: the last lines, then the last bytes, on a character boundary -------------------------

@pytest.mark.parametrize(("text", "lines", "size", "expected"), [
    ("a\nb\nc\n", 0, 4096, None),  # off
    ("a\nb\nc\n", 20, 0, None),  # off
    ("", 20, 4096, ""),  # printed nothing: kept as nothing, not as "not kept"
    ("a\nb\nc\n", 20, 4096, "a\nb\nc"),
    ("a\nb\nc", 2, 4096, "b\nc"),
    ("a\r\nb\r\n", 20, 4096, "a\nb"),
    ("one\ntwo\nthree\n", 3, 9, "two\nthree"),  # the cut lands on a line's start: kept whole
    ("one\ntwo\nthree\n", 3, 8, "three"),  # the cut lands inside "two": that partial line is dropped
    ("one\ntwo\nthree\n", 3, 10, "two\nthree"),  # inside "one", at its end: only its newline is dropped
    ("x" * 100, 20, 10, "x" * 10),  # one line longer than the bound: its end
    ("é" * 10, 20, 5, "é" * 2),  # 2-byte characters: never half of one
    ("✓✓✓", 20, 4, "✓"),  # 3-byte characters
    ("🙂🙂", 20, 7, "🙂"),  # 4-byte characters
    ("\n".join(str(i) for i in range(1, 1001)) + "\n", 20, 4096, "\n".join(str(i) for i in range(981, 1001))),
])
def test_cut_tail(text, lines, size, expected):
    assert cut_tail(text, lines, size) == expected
    if expected is not None:
        assert len(expected.encode()) <= size and len(expected.splitlines()) <= lines


def test_cut_tail_of_1000_long_lines_keeps_whole_last_lines_within_the_bytes():
    text = "".join(f"{i:04d} {'y' * 244}\n" for i in range(1, 1001))  # 250 bytes a line with its newline
    # 20 lines are 4999 bytes: the last 16 (3999 bytes) are what fits whole in 4096
    assert cut_tail(text, 20, 4096) == "\n".join(f"{i:04d} {'y' * 244}" for i in range(985, 1001))


# -- the journal: the matches of `unitvisor logs`, journalctl once, nothing when off ---------------

def test_log_matches_are_those_of_the_logs_command():
    assert log_matches("r1", 2) == ["UNITVISOR_RUN=r1", "UNITVISOR_ATTEMPT=2"]
    assert log_matches("r1", None) == ["UNITVISOR_RUN=r1"]
    assert log_command("r1", 2, False, None) == ["journalctl", *log_matches("r1", 2)]


def test_output_tail_reads_the_last_lines_of_the_attempt_once(mocker):
    run = mocker.patch.object(subprocess, "run", return_value=subprocess.CompletedProcess(
        [], 0, stdout=b"1\n2\n3\n\xff\n", stderr=b""))
    assert Journal().output_tail("r1", 2, 3, 4096) == "2\n3\n\ufffd"  # not UTF-8: replaced, not dropped
    (call,) = run.call_args_list
    assert call.args[0] == ["journalctl", "--no-pager", "-q", "-o", "cat", "--lines=3",
                            "UNITVISOR_RUN=r1", "UNITVISOR_ATTEMPT=2"]


@pytest.mark.parametrize(("lines", "size"), [(0, 4096), (20, 0)])
def test_output_tail_off_reads_nothing(mocker, lines, size):
    run = mocker.patch.object(subprocess, "run")
    assert Journal().output_tail("r1", 1, lines, size) is None
    run.assert_not_called()


@pytest.mark.parametrize("failure", [
    subprocess.CompletedProcess([], 1, stdout=b"", stderr=b"No journal files were found."),
    OSError(2, "No such file or directory"),
    subprocess.TimeoutExpired("journalctl", 10),
])
def test_an_unreadable_journal_keeps_no_tail(mocker, failure):
    kwargs = {"side_effect": failure} if isinstance(failure, BaseException) else {"return_value": failure}
    mocker.patch.object(subprocess, "run", **kwargs)
    assert Journal().output_tail("r1", 1, 20, 4096) is None
    assert Journal().has_output("r1", 1) is False


@pytest.mark.parametrize(("stdout", "expected"), [(b"", False), (b"\n", True), (b"last\n", True)])
def test_has_output(mocker, stdout, expected):
    run = mocker.patch.object(subprocess, "run", return_value=subprocess.CompletedProcess([], 0, stdout=stdout))
    assert Journal().has_output("r1", None) is expected
    assert "--lines=1" in run.call_args.args[0] and "UNITVISOR_RUN=r1" in run.call_args.args[0]


# -- systemd's properties -> values ---------------------------------------------------------------

@pytest.mark.parametrize(("props", "expected"), [
    ({}, Accounting()),  # a systemd that knows none of them
    ({b"CPUUsageNSec": UNSET, b"MemoryPeak": UNSET, b"IOReadBytes": UNSET, b"IOWriteBytes": UNSET},
     Accounting()),  # systemd 252 in the test bed: cgroup v1 controllers it may not use
    ({b"CPUUsageNSec": 1_200_000_000, b"IOReadBytes": 4096, b"IOWriteBytes": 0, b"MemoryCurrent": 99},
     Accounting(cpu_usage_nsec=1_200_000_000, io_read_bytes=4096, io_write_bytes=0)),  # < 256: no MemoryPeak
    ({b"CPUUsageNSec": 0, b"MemoryPeak": 35_651_584}, Accounting(cpu_usage_nsec=0, memory_peak_bytes=35_651_584)),
    ({b"CPUUsageNSec": 2**63}, Accounting()),  # beyond a bigint: no real counter, not measured
    ({b"CPUUsageNSec": 2**63 - 1}, Accounting(cpu_usage_nsec=2**63 - 1)),
    ({b"CPUUsageNSec": True, b"MemoryPeak": b"12"}, Accounting()),  # not a number
])
def test_accounting_from_properties(props, expected):
    assert accounting_from_properties(props) == expected


# -- show -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("nsec", "text"), [
    (0, "0us"), (999, "0us"), (850_000, "850us"), (12_345_678, "12ms"), (1_200_000_000, "1.2s"),
    (59_940_000_000, "59.9s"), (185_000_000_000, "3m05s"), (3_720_000_000_000, "1h02m"),
])
def test_format_cpu_time(nsec, text):
    assert format_cpu_time(nsec) == text


@pytest.mark.parametrize(("size", "text"), [
    (0, "0B"), (512, "512B"), (1023, "1023B"), (1024, "1.0K"), (1536, "1.5K"), (35_651_584, "34.0M"),
    (2_254_857_830, "2.1G"), (2**50, "1.0P"), (2**62, "4096.0P"),
])
def test_format_bytes(size, text):
    assert format_bytes(size) == text


@pytest.mark.parametrize(("accounting", "text"), [
    (Accounting(), "-"),
    (MEASURED, "1.2s CPU, 34.0M peak memory, 4.0K read, 0B written"),
    (Accounting(cpu_usage_nsec=1_200_000_000), "1.2s CPU"),
    (Accounting(memory_peak_bytes=1024), "1.0K peak memory"),
    (Accounting(tasks_peak=21), "21 tasks at most"),
    (Accounting(cpu_usage_nsec=0, tasks_peak=1), "0us CPU, 1 task at most"),
])
def test_accounting_text(accounting, text):
    assert accounting_text(accounting) == text


# -- TailReader: off the loop, a moment later, written in batches --------------------------------

class FakeJournal:
    def __init__(self) -> None:
        self.reads: list[tuple[str, int, int, int]] = []
        self.batches = 0

    def output_tails(self, attempts: list[tuple[str, int]], max_lines: int, max_bytes: int) -> list[str | None]:
        self.batches += 1
        self.reads += [(run_id, attempt, max_lines, max_bytes) for run_id, attempt in attempts]
        return [None if attempt == 99 else f"tail of {run_id[-1]}/{attempt}" for run_id, attempt in attempts]


def test_tail_reader_reads_on_its_thread_and_hands_over_in_order():
    journal, woken = FakeJournal(), []
    reader = TailReader(journal, 20, 4096, delay=0.0, wake=lambda: woken.append(1))
    reader.add(uuid.UUID(int=1), 1)
    reader.add(uuid.UUID(int=2), 99)  # unreadable: nothing to keep
    reader.add(uuid.UUID(int=3), 2)
    reader.close(timeout=30)  # reads what is queued, then stops
    assert reader.take() == [(uuid.UUID(int=1), 1, "tail of 1/1"), (uuid.UUID(int=3), 2, "tail of 3/2")]
    assert reader.take() == []
    assert [r[1:] for r in journal.reads] == [(1, 20, 4096), (99, 20, 4096), (2, 20, 4096)]
    assert len(woken) == journal.batches  # once per batch read (how they are batched: test_output_tails.py)


def test_an_unthreaded_tail_reader_reads_at_once():
    journal = FakeJournal()
    reader = TailReader(journal, 5, 100, threaded=False)
    reader.add(uuid.UUID(int=4), 1)
    assert reader.take() == [(uuid.UUID(int=4), 1, "tail of 4/1")]
    reader.close(timeout=1)  # nothing to stop


@pytest.mark.parametrize(("lines", "size"), [(0, 4096), (20, 0)])
def test_a_tail_reader_that_keeps_none_reads_nothing(lines, size):
    journal = FakeJournal()
    reader = TailReader(journal, lines, size, delay=0.0)
    reader.add(uuid.UUID(int=1), 1)
    reader.close(timeout=30)
    assert (journal.reads, reader.take(), reader.enabled) == ([], [], False)


# -- the reconciler passes them on -------------------------------------------------------------

@pytest.fixture
def st(mocker):
    return mocker.patch.object(store, "record_outcome", return_value=True)


@pytest.fixture
def rec(mocker):
    journal = mock.Mock(spec=Journal)
    journal.outcome.return_value = None
    settings = Settings(runs=RunSettings(allowed_executables=("/bin/*",), output_tail_lines=7, output_tail_bytes=99))
    r = Reconciler(settings, store.Fence("me", 1), mock.MagicMock(), mocker.Mock(spec=Systemd), journal=journal,
                   cut_off_units=set())
    r.output_tails = mock.Mock(spec=TailReader)
    return r


def pair(started=True):
    run = Run(id=RUN_ID, argv=["/bin/true"], state="running" if started else "starting")
    return run, Attempt(run_id=RUN_ID, attempt=1, host_id="me", unit_name=NAME, claimed_at=T0,
                        started_at=T0 if started else None)


def ended(accounting=MEASURED):
    return UnitState(NAME, "failed", "failed", "exit-code", CLD_EXITED, 3, "inv", False, 1, 2, 1,
                     accounting=accounting)


def test_the_reconcilers_own_tail_reader_reads_at_once_with_the_hosts_bounds(rec):
    own = Reconciler(rec.settings, rec.fence, rec.conn, rec.systemd, journal=rec.journal).output_tails
    assert (own.threaded, own.max_lines, own.max_bytes) == (False, 7, 99)


def test_an_ended_unit_records_its_accounting_then_has_its_tail_read(rec, st):
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, ended()))
    assert st.call_args.kwargs["accounting"] == MEASURED
    rec.output_tails.add.assert_called_once_with(RUN_ID, 1)
    # the figures were read with the unit's state, before the release that discards them
    assert rec.systemd.release.called


def test_an_outcome_recorded_before_keeps_no_second_tail(rec, st):
    st.return_value = False
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, ended()))
    rec.output_tails.add.assert_not_called()


def test_a_gone_unit_records_no_accounting_but_the_tail_its_journal_still_has(rec, st):
    run, attempt = pair()
    decision = decide(run, attempt, None)
    assert decision.action is Action.GONE
    rec.apply(run, attempt, decision)
    assert st.call_args.kwargs["accounting"] is None
    rec.output_tails.add.assert_called_once_with(RUN_ID, 1)


def test_a_run_cancelled_before_its_unit_started_keeps_nothing(rec, st):
    _, attempt = pair(started=False)
    run = Run(id=RUN_ID, argv=["/bin/true"], state="starting", cancel_requested_at=T0)
    rec.apply(run, attempt, decide(run, attempt, None))
    assert st.call_args.kwargs["accounting"] is None
    rec.output_tails.add.assert_not_called()


def test_a_refused_run_keeps_nothing(rec, st):
    run = Run(id=RUN_ID, argv=["/usr/sbin/not-allowed"], state="starting")
    _, attempt = pair(started=False)
    rec.start(run, attempt)
    assert st.call_args.args[3].outcome == "refused"
    assert st.call_args.kwargs["accounting"] is None
    rec.output_tails.add.assert_not_called()


def test_a_dead_hosts_attempts_keep_nothing(rec, st, mocker):
    run, attempt = pair()
    dead = store.DeadHost("h2", 90.0, 60.0)
    mocker.patch.object(store, "declare_dead_hosts", return_value=[dead])
    mocker.patch.object(store, "open_attempts", return_value=[(run, attempt)])
    rec.take_over_dead_hosts(100.0)
    assert st.call_args.args[3] == fleet.takeover_outcome(run, dead, "me")
    assert "accounting" not in st.call_args.kwargs or st.call_args.kwargs["accounting"] is None
    rec.output_tails.add.assert_not_called()


def test_the_tails_read_are_written_together(rec, mocker):
    written = mocker.patch.object(store, "record_output_tails", return_value=2)
    rec.output_tails.take.return_value = [(RUN_ID, 1, "a"), (RUN_ID, 2, "b")]
    assert rec.write_output_tails() == 2
    written.assert_called_once_with(rec.conn, rec.fence, [(RUN_ID, 1, "a"), (RUN_ID, 2, "b")])


def test_the_outcome_is_unchanged_by_what_is_kept(rec, st):
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, ended(Accounting())))
    assert st.call_args.args[3] == Outcome("exit-code", "exit:3", "exited with status 3")


def test_not_measured_names_each_null_figure_with_what_its_host_lacked():
    assert not_measured(Accounting(cpu_usage_nsec=1, memory_peak_bytes=2, io_read_bytes=3, io_write_bytes=4,
                                   tasks_peak=5)) == {}
    # systemd 252 on cgroup v2 (Debian 12): all but the memory peak
    missing = not_measured(Accounting(cpu_usage_nsec=1, io_read_bytes=3, io_write_bytes=4, tasks_peak=5))
    assert list(missing) == ["memory_peak_bytes"] and "systemd 256" in missing["memory_peak_bytes"]
    # a cgroup v1 host: everything but the CPU
    missing = not_measured(Accounting(cpu_usage_nsec=1))
    assert list(missing) == ["memory_peak_bytes", "io_read_bytes", "io_write_bytes", "tasks_peak"]
    assert "pids.peak" in missing["tasks_peak"]
    assert not_measured_text({"tasks_peak": "needs x"}) == "peak tasks (needs x)"


# -- the peak number of tasks its unit left (taskspeak.py) ------------------------------------------

def test_an_ended_unit_records_the_tasks_peak_it_left_and_the_file_goes(rec, st, tasks_peak_directory):
    files = taskspeak.TasksPeakFiles()
    files.ensure_directory()
    files.path(NAME).write_text("21\n")
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, ended()))
    assert st.call_args.kwargs["accounting"] == Accounting(cpu_usage_nsec=1_200_000_000, memory_peak_bytes=35_651_584,
                                                           io_read_bytes=4096, io_write_bytes=0, tasks_peak=21)
    assert files.listing() == []


def test_a_gone_unit_records_the_tasks_peak_it_left_beside_its_journals_figures(rec, st, tasks_peak_directory):
    """After a restart the unit is gone (collected), its figures from the journal; the file outlives both."""
    files = taskspeak.TasksPeakFiles()
    files.ensure_directory()
    files.path(NAME).write_text("4\n")
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, None))
    assert st.call_args.kwargs["accounting"] == Accounting(tasks_peak=4)
    assert files.listing() == []


def test_no_file_records_no_tasks_peak(rec, st):
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, ended()))
    assert st.call_args.kwargs["accounting"] == MEASURED


@pytest.mark.parametrize("has_pids_peak", [True, False])
def test_a_unit_copies_its_tasks_peak_only_where_the_kernel_keeps_one(rec, mocker, tasks_peak_directory,
                                                                      has_pids_peak):
    """The stop command costs PID 1 a process per unit: none where it could copy nothing (cgroup v1)."""
    mocker.patch.object(store, "mark_started")
    mocker.patch.object(taskspeak, "available", return_value=has_pids_peak)
    rec = Reconciler(rec.settings, rec.fence, rec.conn, rec.systemd, journal=rec.journal)
    rec.systemd.start_transient.return_value = True
    run, attempt = pair(started=False)
    rec.start(run, attempt)
    props = rec.systemd.start_transient.call_args.args[1]
    assert tasks_peak_directory.is_dir() is has_pids_peak
    assert props.get(b"ExecStopPostEx") == ([taskspeak.STOP_POST_COMMAND] if has_pids_peak else None)


def test_the_sweep_removes_the_files_of_attempts_not_open_here(rec, mocker, tasks_peak_directory):
    files = taskspeak.TasksPeakFiles()
    files.ensure_directory()
    for name in ("open-here.service", "settled.service", "elsewhere.service", "unknown.service"):
        files.path(name).write_text("3\n")
    owner = mock.Mock
    mocker.patch.object(store, "unit_owners", return_value={
        "open-here.service": owner(outcome=None, host_id="me"),
        "settled.service": owner(outcome="success", host_id="me"),
        "elsewhere.service": owner(outcome=None, host_id="h2")})
    assert rec.sweep_tasks_peaks() == ["elsewhere.service", "settled.service", "unknown.service"]
    assert files.listing() == ["open-here.service"]
