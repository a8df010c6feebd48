"""supervisor.journal: the outcome PID 1's journal records show for a unit that is gone, and the journalctl
call that reads them (subprocess.run mocked).

The records are shaped like `journalctl -o json` prints PID 1's messages (systemd's unit_log_process_exit,
unit_log_failure and the job's "Stopping..." message): every value a string, EXIT_STATUS a number even for a
signal, trusted fields with a leading underscore, binary fields as lists of numbers.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from supervisor import journal
from supervisor.journal import (
    MSG_PROCESS_EXIT,
    MSG_SPAWN_FAILED,
    MSG_UNIT_FAILED,
    MSG_UNIT_STOPPED,
    MSG_UNIT_STOPPING,
    MSG_UNIT_SUCCESS,
    Journal,
    found_from_records,
    outcome_from_records,
)
from supervisor.model import Accounting
from supervisor.outcomes import Outcome

UNIT = "unitvisor-run-00000000-0000-4000-8000-000000000001-1.service"
INV = "5a3c1f0e9b8d4c7a8e6f2b1d0c9a8b7e"
OTHER_INV = "0f0e0d0c0b0a09080706050403020100"
SUFFIX = " (from the journal; the unit was gone)"
# No spawn-failure record among them: after a reboot that proves nothing (supervisor/outcomes.py).
NOT_PROVEN = "; not proven: the command may have exited with it itself"


def pid1(message, invocation=INV, **fields):
    record = {"_PID": "1", "_UID": "0", "_COMM": "systemd", "_SYSTEMD_UNIT": "init.scope", "_TRANSPORT": "journal",
              "SYSLOG_IDENTIFIER": "systemd", "PRIORITY": "5", "UNIT": UNIT, "INVOCATION_ID": invocation,
              "MESSAGE": f"{UNIT}: {message}", "__REALTIME_TIMESTAMP": "1714564800000000"}
    record.update(fields)
    return record


def process_exit(code, status, text, invocation=INV):
    return pid1(f"Main process exited, code={code}, status={text}", invocation, MESSAGE_ID=MSG_PROCESS_EXIT,
                EXIT_CODE=code, EXIT_STATUS=str(status), COMMAND="/bin/job")


def failed(result, invocation=INV):
    return pid1(f"Failed with result '{result}'.", invocation, PRIORITY="4", MESSAGE_ID=MSG_UNIT_FAILED,
                UNIT_RESULT=result)


def stopping(invocation=INV):
    return pid1(f"Stopping unitvisor run {UNIT}...", invocation, PRIORITY="6", MESSAGE_ID=MSG_UNIT_STOPPING,
                JOB_ID="812", JOB_TYPE="stop")


def started():
    return pid1("Started unitvisor run.", PRIORITY="6", MESSAGE_ID="39f53479d3a045ac8e11786248231fbf",
                JOB_ID="811", JOB_TYPE="start", JOB_RESULT="done")


def deactivated(invocation=INV, at="1714564801000000"):
    return pid1("Deactivated successfully.", invocation, PRIORITY="6", MESSAGE_ID=MSG_UNIT_SUCCESS,
                __REALTIME_TIMESTAMP=at)


def stopped(invocation=INV):
    return pid1(f"Stopped unitvisor run {UNIT}.", invocation, PRIORITY="6", MESSAGE_ID=MSG_UNIT_STOPPED,
                JOB_ID="812", JOB_TYPE="stop", JOB_RESULT="done")


def consumed(cpu="1.5s"):
    return pid1(f"Consumed {cpu} CPU time.", PRIORITY="6", MESSAGE_ID="ae8f7b866b0347b9af31fe1c80b127c0",
                CPU_USAGE_NSEC="1500000000")


# -- outcome_from_records -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("records", "expected"), [
    ([started(), process_exit("exited", 3, "3/n/a"), failed("exit-code"), consumed()],
     Outcome("exit-code", "exit:3", "exited with status 3")),
    ([started(), process_exit("killed", 9, "9/KILL"), failed("signal")],
     Outcome("signal", "signal:KILL", "killed by signal KILL")),
    ([started(), process_exit("killed", 15, "15/TERM"), failed("signal")],
     Outcome("signal", "signal:TERM", "killed by signal TERM")),
    ([started(), process_exit("dumped", 11, "11/SEGV"), failed("core-dump")],
     Outcome("core-dump", "signal:SEGV", "killed by signal SEGV, core dumped")),
    ([started(), pid1("Service reached runtime time limit. Stopping."),
      process_exit("killed", 15, "15/TERM"), failed("timeout")],
     Outcome("timeout", "signal:TERM", "runtime limit reached")),
    ([started(), pid1("A process of this unit has been killed by the OOM killer."),
      process_exit("killed", 9, "9/KILL"), failed("oom-kill")],
     Outcome("oom-kill", "signal:KILL", "killed by the OOM killer")),
    ([process_exit("exited", 203, "203/EXEC"), failed("exit-code")],
     Outcome("start-failed", "exit:203",
             "systemd could not start the command: step EXEC failed (203/EXEC)" + NOT_PROVEN)),
    ([process_exit("exited", 217, "217/USER"), failed("exit-code")],
     Outcome("start-failed", "exit:217",
             "systemd could not start the command: step USER failed (217/USER)" + NOT_PROVEN)),
    ([process_exit("exited", 200, "200/CHDIR"), failed("exit-code")],
     Outcome("start-failed", "exit:200",
             "systemd could not start the command: step CHDIR failed (200/CHDIR)" + NOT_PROVEN)),
    # A clean exit is logged at debug level; when a journal does store it, it proves success.
    ([started(), process_exit("exited", 0, "0/SUCCESS")], Outcome("success", "exit:0", "exited 0")),
    # The exit record alone, without the result (rate-limited, or lost): still the exit's outcome.
    ([process_exit("exited", 1, "1/FAILURE")], Outcome("exit-code", "exit:1", "exited with status 1")),
], ids=["exit-code", "killed", "sigterm", "core-dump", "timeout", "oom-kill", "exec", "user", "chdir",
        "success", "no-result"])
def test_outcome_from_pid1s_records(records, expected):
    assert outcome_from_records(records) == Outcome(expected.outcome, expected.exit_status,
                                                    expected.reason + SUFFIX)


@pytest.mark.parametrize("records", [
    [],
    [started(), consumed()],
    [failed("exit-code")],  # a result without an exit: no exit status to report
    [process_exit("continued", 18, "18/CONT"), failed("exit-code")],  # not an end
    [{**process_exit("exited", 1, "1/FAILURE"), "EXIT_CODE": "garbage"}],
    [{k: v for k, v in process_exit("exited", 1, "1/FAILURE").items() if k != "EXIT_CODE"}],
    [{k: v for k, v in process_exit("exited", 1, "1/FAILURE").items() if k != "EXIT_STATUS"}],
    [{**process_exit("exited", 1, "1/FAILURE"), "EXIT_STATUS": "n/a"}, failed("exit-code")],
    [{**process_exit("killed", 9, "9/KILL"), "EXIT_STATUS": "KILL"}],
    [{**process_exit("exited", 1, "1/FAILURE"), "MESSAGE_ID": "somethingelse"}],
], ids=["none", "nothing-about-the-end", "result-only", "continued", "garbage-code", "no-code", "no-status",
        "garbage-status", "signal-name-as-status", "other-message-id"])
def test_records_that_show_no_outcome(records):
    assert outcome_from_records(records) is None


def test_a_garbage_status_spoils_the_set_even_after_a_good_exit():
    records = [process_exit("exited", 1, "1/FAILURE"), {**process_exit("exited", 2, "2"), "EXIT_STATUS": ""}]
    assert outcome_from_records(records) is None


def test_an_exit_after_a_stop_job_is_the_stops_doing_and_lost():
    records = [started(), stopping(), process_exit("killed", 15, "15/TERM"), failed("signal")]
    assert outcome_from_records(records) is None


def test_a_stop_job_after_the_exit_does_not_hide_the_exit():
    records = [process_exit("exited", 4, "4/NOPERMISSION"), failed("exit-code"), stopping()]
    assert outcome_from_records(records) == Outcome("exit-code", "exit:4", "exited with status 4" + SUFFIX)


def test_a_starting_message_is_not_a_stop():
    start_job = {**stopping(), "MESSAGE_ID": MSG_UNIT_STOPPING, "JOB_TYPE": "restart"}
    assert outcome_from_records([start_job, process_exit("exited", 1, "1/FAILURE")]).outcome == "exit-code"


def test_the_result_wins_over_the_exit_code():
    # A RuntimeMaxSec stop whose process exited 143 on SIGTERM: timeout, not exit-code.
    records = [process_exit("exited", 143, "143/n/a"), failed("timeout")]
    assert outcome_from_records(records) == Outcome("timeout", "exit:143", "runtime limit reached" + SUFFIX)


def test_the_journal_never_reports_cancelled():
    records = [process_exit("killed", 15, "15/TERM"), failed("signal")]
    assert outcome_from_records(records).outcome == "signal"


def test_the_last_exit_of_the_records_given_counts():
    # outcome_from_records trusts its caller to pass one invocation (Journal.outcome matches INVOCATION_ID).
    records = [process_exit("exited", 1, "1/FAILURE", OTHER_INV), failed("exit-code", OTHER_INV),
               process_exit("killed", 9, "9/KILL"), failed("signal")]
    assert outcome_from_records(records).exit_status == "signal:KILL"


@pytest.mark.parametrize("result", ["resources", "start-limit-hit"])
def test_a_start_failure_without_a_process_is_start_failed(result):
    records = [pid1("Failed to spawn 'start' task: Resource temporarily unavailable", PRIORITY="3"),
               failed(result)]
    found = outcome_from_records(records)
    assert found is not None and found.outcome == "start-failed"


# -- Journal.outcome: the journalctl call ---------------------------------------------------------------------

def json_lines(*records):
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture
def run(mocker):
    fake = mocker.patch.object(journal.subprocess, "run")
    fake.return_value = subprocess.CompletedProcess([], 0, stdout="", stderr="")
    return fake


def test_journalctl_is_asked_for_pid1s_records_and_the_spawn_failure_of_this_invocation(run):
    run.return_value.stdout = json_lines(process_exit("exited", 3, "3/n/a"), failed("exit-code"))
    found = Journal(timeout=4.0).outcome(UNIT, INV)
    assert found.outcome == Outcome("exit-code", "exit:3", "exited with status 3" + SUFFIX)
    scope = [f"UNIT={UNIT}", f"INVOCATION_ID={INV}"]
    run.assert_called_once_with(
        ["journalctl", "--no-pager", "-q", "-o", "json", "_PID=1", *scope, "+", f"MESSAGE_ID={MSG_SPAWN_FAILED}",
         *scope], capture_output=True, text=True, timeout=4.0, check=False)


def test_without_an_invocation_id_every_record_of_the_unit_is_read(run):
    Journal().outcome(UNIT, None)
    assert run.call_args.args[0] == ["journalctl", "--no-pager", "-q", "-o", "json", "_PID=1", f"UNIT={UNIT}", "+",
                                     f"MESSAGE_ID={MSG_SPAWN_FAILED}", f"UNIT={UNIT}"]
    assert run.call_args.kwargs["timeout"] == 10.0
    Journal().outcome(UNIT, "")
    assert run.call_args.args[0][-1] == f"UNIT={UNIT}"


def test_the_match_on_pid_1_is_a_trusted_field():
    # _PID is set by journald from the sender's credentials; a run's own process cannot write it. A run that
    # logs UNIT=/MESSAGE_ID=/EXIT_CODE= itself is filtered out by journalctl, not by the parser.
    forged = {**process_exit("exited", 0, "0/SUCCESS"), "_PID": "4242"}
    assert outcome_from_records([forged]).outcome == "success"  # the parser does not look at _PID


def test_journalctl_that_finds_nothing_shows_nothing(run):
    run.return_value = subprocess.CompletedProcess([], 0, stdout="", stderr="")  # -q and no entries
    assert Journal().outcome(UNIT, INV) is None


@pytest.mark.parametrize(("returncode", "stdout"), [
    (1, ""),  # "No journal files were found." on stderr
    (1, "Failed to add match 'INVOCATION_ID=x': Invalid argument\n"),
    # What it printed before failing may be cut short: a missing record would then prove nothing.
    (1, json_lines(process_exit("killed", 9, "9/KILL"), failed("signal"))),
])
def test_a_failed_journalctl_is_no_answer(run, returncode, stdout):
    # Unreadable, not "nothing proven": settled `lost`, the run would retry though it may have succeeded.
    run.return_value = subprocess.CompletedProcess([], returncode, stdout=stdout, stderr="No journal files were found.")
    with pytest.raises(journal.Unreadable):
        Journal().outcome(UNIT, INV)


@pytest.mark.parametrize("exc", [
    subprocess.TimeoutExpired(["journalctl"], 10.0),
    FileNotFoundError(2, "No such file or directory", "journalctl"),
    PermissionError(13, "Permission denied"),
])
def test_journalctl_that_hangs_or_is_missing_is_no_answer(run, exc):
    run.side_effect = exc
    with pytest.raises(journal.Unreadable):
        Journal().outcome(UNIT, INV)


@pytest.mark.parametrize("garbage", ["-- Boot 3f1e... --", "{not json", json.dumps(failed("exit-code"))[:-5], "[1, 2]"],
                         ids=["separator", "not-json", "cut-short", "not-a-record"])
def test_a_line_that_is_not_a_record_makes_the_read_unreadable(run, garbage):
    # Skipped, it might have been the stop job that spoils a success, or the "Started" that proves a start.
    run.return_value.stdout = "\n".join([json.dumps(started()), garbage, json.dumps(deactivated())]) + "\n"
    with pytest.raises(journal.Unreadable):
        Journal().outcome(UNIT, INV)


def test_blank_lines_and_binary_fields_are_skipped(run):
    exit_record = {**process_exit("exited", 2, "2/INVALIDARGUMENT"), "MESSAGE": [98, 105, 110, 0]}
    run.return_value.stdout = "\n".join([
        json.dumps(started()),
        "",
        json.dumps(exit_record),
        json.dumps({**failed("exit-code"), "UNIT_RESULT": ["exit-code", "exit-code"]}),  # repeated field
    ]) + "\n"
    assert Journal().outcome(UNIT, INV).outcome == Outcome("exit-code", "exit:2", "exited with status 2" + SUFFIX)


def test_non_string_values_are_dropped_before_parsing(run):
    # A field journald could not store as text comes as a list of bytes: EXIT_STATUS then counts as missing.
    run.return_value.stdout = json_lines({**process_exit("exited", 1, "1"), "EXIT_STATUS": [49]})
    assert Journal().outcome(UNIT, INV) is None


# -- a clean end: "Deactivated successfully" (records as systemd 252 wrote them in the test bed) -------------

SUCCESS = Outcome("success", "exit:0", "exited 0 (from the journal: systemd recorded the unit's success and no "
                  "stop job; the unit was gone)")


def test_the_message_ids_are_systemds():
    # sd-messages.h: SD_MESSAGE_UNIT_STOPPING, _UNIT_STOPPED, _UNIT_SUCCESS (before 0.4.0 STOPPING was wrong).
    assert (MSG_UNIT_STOPPING, MSG_UNIT_STOPPED, MSG_UNIT_SUCCESS) == (
        "de5b426a63be47a7b6ac3eaac82e2f6f", "9d1aaa27d60140bd96365438aad20286", "7ad2d189f7e94e70a38c781354912448")


def test_a_clean_end_without_a_stop_job_is_a_success_ended_when_pid1_saw_it():
    found = found_from_records([started(), deactivated()])
    assert found.outcome == SUCCESS
    assert found.ended_at.isoformat() == "2024-05-01T12:00:01+00:00"
    assert found.accounting == Accounting()  # no resource-usage record: NULLs


def test_a_success_keeps_the_resource_usage_record():
    usage = {**consumed(), "IO_METRIC_READ_BYTES": "4096", "IO_METRIC_WRITE_BYTES": "18446744073709551615"}
    found = found_from_records([started(), deactivated(), usage])
    assert found.outcome == SUCCESS
    assert found.accounting == Accounting(cpu_usage_nsec=1_500_000_000, io_read_bytes=4096)


@pytest.mark.parametrize("records", [
    # systemctl stop, the host's shutdown: the stop job's records around the same success record
    [started(), stopping(), deactivated(), stopped()],
    [started(), deactivated(), stopped()],  # the "Stopping" record lost
    [started(), stopping(), deactivated()],  # the "Stopped" record not written
    # two invocations of one attempt's unit: nothing says which one ended how
    [started(), deactivated(), deactivated(OTHER_INV)],
    [deactivated(), failed("exit-code")],
    [{**deactivated(), "MESSAGE_ID": MSG_SPAWN_FAILED}, deactivated()],
], ids=["stopped", "stopped-only", "stopping-only", "two-invocations", "with-a-failure", "spawn-failed"])
def test_a_clean_end_that_proves_no_success(records):
    assert found_from_records(records) is None


def test_a_stop_job_of_another_type_does_not_spoil_a_success():
    assert found_from_records([{**stopping(), "JOB_TYPE": "restart"}, deactivated()]).outcome == SUCCESS


def test_a_kept_exit_record_decides_over_the_success_record():
    # A journal that keeps PID 1's debug records: a SIGTERM from outside a stop job ends Result=success too.
    records = [started(), process_exit("killed", 15, "15/TERM"), deactivated()]
    assert outcome_from_records(records) == Outcome("signal", "signal:TERM", "killed by signal TERM" + SUFFIX)
    records = [started(), process_exit("exited", 0, "0/SUCCESS"), deactivated()]
    assert outcome_from_records(records) == Outcome("success", "exit:0", "exited 0" + SUFFIX)


def test_the_stop_commands_exit_record_is_not_the_runs():
    """A host logging at debug keeps the exit record of the unit's own stop command (the tasks-peak
    copy, ExecStopPost=, exit 0) after the run's: the run's decides."""
    stop_command = pid1("Control process exited, code=exited, status=0/SUCCESS", MESSAGE_ID=MSG_PROCESS_EXIT,
                        EXIT_CODE="exited", EXIT_STATUS="0", COMMAND="ExecStopPost")
    records = [started(), process_exit("exited", 3, "3"), stop_command, failed("exit-code")]
    assert outcome_from_records(records) == Outcome("exit-code", "exit:3", "exited with status 3" + SUFFIX)
    assert journal.program_ran([stop_command], trust_absence=True) is None


def test_a_failures_resource_usage_is_kept_too():
    found = found_from_records([started(), process_exit("exited", 3, "3"), failed("exit-code"), consumed()])
    assert found.accounting.cpu_usage_nsec == 1_500_000_000


# -- Journal.outcome waits for this boot's last record ---------------------------------------------

BOOT = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def this_boot(mocker):
    mocker.patch.object(journal, "_boot_id", return_value=BOOT)
    return BOOT


def test_a_unit_of_this_boot_without_its_last_record_is_waited_for(run, this_boot, mocker):
    mocker.patch.object(journal.time, "sleep")
    run.side_effect = [subprocess.CompletedProcess([], 0, stdout=json_lines({**started(), "_BOOT_ID": BOOT}),
                                                   stderr=""),
                       subprocess.CompletedProcess([], 0, stdout=json_lines({**started(), "_BOOT_ID": BOOT},
                                                                            {**deactivated(), "_BOOT_ID": BOOT}),
                                                   stderr="")]
    assert Journal(settle_wait=5.0).outcome(UNIT, None).outcome == SUCCESS
    assert run.call_count == 2


def test_a_unit_of_this_boot_whose_end_never_comes_is_lost_after_the_wait(run, this_boot, mocker):
    run.return_value.stdout = json_lines({**started(), "_BOOT_ID": BOOT})
    assert Journal(settle_wait=0.3).outcome(UNIT, None) is None
    assert run.call_count >= 2


def test_an_earlier_boots_unit_is_never_waited_for(run, this_boot):
    run.return_value.stdout = json_lines({**started(), "_BOOT_ID": "f" * 32})
    assert Journal(settle_wait=5.0).outcome(UNIT, None) is None
    assert run.call_count == 1
