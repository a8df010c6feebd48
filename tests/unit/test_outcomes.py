"""supervisor.outcomes: systemd's (Result, ExecMainCode, ExecMainStatus) -> outcome, and retry timing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from supervisor.model import Run
from supervisor.outcomes import (
    CLD_DUMPED,
    CLD_EXITED,
    CLD_KILLED,
    OUTCOMES,
    RETRYABLE_BY_DEFAULT,
    Outcome,
    classify,
    exit_status,
    is_setup_exit,
    retry_delay,
    run_state_after,
    signal_name,
)

RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")


def test_cld_constants_match_waitid():
    assert (CLD_EXITED, CLD_KILLED, CLD_DUMPED) == (1, 2, 3)


def test_outcome_vocabulary():
    assert OUTCOMES == ("success", "exit-code", "signal", "core-dump", "timeout", "oom-kill", "watchdog",
                        "start-failed", "lost", "cancelled", "refused")


# -- classify ---------------------------------------------------------------------------------------

def c(result, code, status, cancel=False, ran=None):
    return classify(result, code, status, cancel_requested=cancel, program_ran=ran)


def test_exit_zero_is_success():
    assert c("success", CLD_EXITED, 0) == Outcome("success", "exit:0", "exited 0")
    assert c("success", CLD_EXITED, 0).succeeded is True


def test_exit_nonzero_is_exit_code():
    assert c("exit-code", CLD_EXITED, 3) == Outcome("exit-code", "exit:3", "exited with status 3")
    assert c("exit-code", CLD_EXITED, 3).succeeded is False


@pytest.mark.parametrize("status", [1, 2, 126, 127, 199, 255])
def test_ordinary_exit_codes(status):
    assert c("exit-code", CLD_EXITED, status) == Outcome("exit-code", f"exit:{status}",
                                                         f"exited with status {status}")


def test_killed_by_sigkill_is_signal():
    assert c("signal", CLD_KILLED, 9) == Outcome("signal", "signal:KILL", "killed by signal KILL")


@pytest.mark.parametrize(("number", "name"), [(15, "TERM"), (2, "INT"), (1, "HUP"), (13, "PIPE")])
def test_clean_signals_with_result_success_are_signal_not_success(number, name):
    out = c("success", CLD_KILLED, number)
    assert out == Outcome("signal", f"signal:{name}", f"killed by signal {name}")
    assert out.succeeded is False


def test_core_dump():
    assert c("core-dump", CLD_DUMPED, 11) == Outcome("core-dump", "signal:SEGV", "killed by signal SEGV, core dumped")


def test_cld_dumped_is_core_dump_whatever_the_result():
    assert c("signal", CLD_DUMPED, 6) == Outcome("core-dump", "signal:ABRT", "killed by signal ABRT, core dumped")


def test_result_core_dump_with_cld_killed_is_core_dump():
    assert c("core-dump", CLD_KILLED, 6).outcome == "core-dump"


def test_timeout():
    assert c("timeout", CLD_KILLED, 15) == Outcome("timeout", "signal:TERM", "runtime limit reached")
    assert c("timeout", CLD_KILLED, 9) == Outcome("timeout", "signal:KILL", "runtime limit reached")


def test_timeout_without_exit_status():
    assert c("timeout", 0, 0) == Outcome("timeout", None, "runtime limit reached")


def test_oom_kill():
    assert c("oom-kill", CLD_KILLED, 9) == Outcome("oom-kill", "signal:KILL", "killed by the OOM killer")


def test_oom_kill_wins_over_exit_code():
    assert c("oom-kill", CLD_EXITED, 137) == Outcome("oom-kill", "exit:137", "killed by the OOM killer")


def test_watchdog():
    assert c("watchdog", CLD_KILLED, 6) == Outcome("watchdog", "signal:ABRT", "watchdog timeout")


def test_exec_failure_is_start_failed():
    out = c("exit-code", CLD_EXITED, 203, ran=False)
    assert out == Outcome("start-failed", "exit:203",
                          "systemd could not start the command: step EXEC failed (203/EXEC)")
    assert "EXEC" in out.reason


def test_user_failure_is_start_failed():
    assert c("exit-code", CLD_EXITED, 217, ran=False) == Outcome(
        "start-failed", "exit:217", "systemd could not start the command: step USER failed (217/USER)")


@pytest.mark.parametrize(("status", "step"), [(200, "CHDIR"), (216, "GROUP"), (226, "NAMESPACE"),
                                              (243, "CREDENTIALS")])
def test_other_setup_steps(status, step):
    assert c("exit-code", CLD_EXITED, status, ran=False) == Outcome(
        "start-failed", f"exit:{status}", f"systemd could not start the command: step {step} failed ({status}/{step})")


# Whether the command itself ran decides whose an exit status of 200-243 is (the note in outcomes.py).
@pytest.mark.parametrize(("result", "status", "ran", "outcome", "reason"), [
    # proven exec'd (ActiveEnterTimestamp, or the journal): the command's own exit
    ("exit-code", 203, True, "exit-code", "exited with status 203"),
    ("exit-code", 200, True, "exit-code", "exited with status 200"),
    ("exit-code", 243, True, "exit-code", "exited with status 243"),
    # proven not exec'd (a spawn failure in the journal): systemd's setup failure
    ("exit-code", 203, False, "start-failed", "systemd could not start the command: step EXEC failed (203/EXEC)"),
    ("exit-code", 217, False, "start-failed", "systemd could not start the command: step USER failed (217/USER)"),
    # unknown: start-failed, as before, and the reason says it is not proven
    ("exit-code", 203, None, "start-failed", "systemd could not start the command: step EXEC failed (203/EXEC); "
     "not proven: the command may have exited with it itself"),
    ("exit-code", 200, None, "start-failed", "systemd could not start the command: step CHDIR failed "
     "(200/CHDIR); not proven: the command may have exited with it itself"),
    # outside 200-243 or a success result, the evidence changes nothing
    ("exit-code", 7, None, "exit-code", "exited with status 7"),
    ("exit-code", 7, False, "exit-code", "exited with status 7"),
    ("exit-code", 244, None, "exit-code", "exited with status 244"),
    ("success", 203, None, "exit-code", "exited with status 203"),
])
def test_setup_exit_told_apart_by_whether_the_command_ran(result, status, ran, outcome, reason):
    assert c(result, CLD_EXITED, status, ran=ran) == Outcome(outcome, f"exit:{status}", reason)


@pytest.mark.parametrize("ran", [True, False, None])
def test_cancel_and_results_win_over_exec_evidence(ran):
    assert c("exit-code", CLD_EXITED, 203, cancel=True, ran=ran).outcome == "cancelled"
    assert c("timeout", CLD_EXITED, 203, ran=ran).outcome == "timeout"
    assert c("start-limit-hit", CLD_EXITED, 203, ran=ran).outcome == "start-failed"


def test_is_setup_exit():
    assert is_setup_exit("exit-code", CLD_EXITED, 203)
    assert not is_setup_exit("success", CLD_EXITED, 203)
    assert not is_setup_exit("exit-code", CLD_EXITED, 7)
    assert not is_setup_exit("signal", CLD_KILLED, 203)


def test_setup_exit_code_with_result_success_is_an_ordinary_exit():
    # Only when systemd itself counts the exit as a failure is it systemd's setup code.
    assert c("success", CLD_EXITED, 203) == Outcome("exit-code", "exit:203", "exited with status 203")


@pytest.mark.parametrize("status", [223, 234, 244])
def test_gaps_in_the_setup_table_are_ordinary_exits(status):
    assert c("exit-code", CLD_EXITED, status).outcome == "exit-code"


@pytest.mark.parametrize("result", ["start-limit-hit", "resources", "protocol", "exec-condition"])
def test_start_failed_results(result):
    assert c(result, 0, 0) == Outcome("start-failed", None, f"systemd result {result}")


def test_start_failed_result_keeps_exit_status():
    assert c("resources", CLD_EXITED, 1) == Outcome("start-failed", "exit:1", "systemd result resources")


@pytest.mark.parametrize(("result", "code", "status", "exit_text"), [
    ("success", CLD_EXITED, 0, "exit:0"),
    ("exit-code", CLD_EXITED, 3, "exit:3"),
    ("signal", CLD_KILLED, 9, "signal:KILL"),
    ("success", CLD_KILLED, 15, "signal:TERM"),
    ("core-dump", CLD_DUMPED, 11, "signal:SEGV"),
    ("timeout", CLD_KILLED, 15, "signal:TERM"),
    ("oom-kill", CLD_KILLED, 9, "signal:KILL"),
    ("watchdog", CLD_KILLED, 6, "signal:ABRT"),
    ("exit-code", CLD_EXITED, 203, "exit:203"),
    ("start-limit-hit", 0, 0, None),
    ("", 0, 0, None),
])
def test_cancel_requested_overrides_everything(result, code, status, exit_text):
    assert c(result, code, status, cancel=True) == Outcome("cancelled", exit_text, "cancelled by request")


@pytest.mark.parametrize(("result", "reason"), [
    ("", "unit ended with result unknown and no exit status"),
    ("success", "unit ended with result success and no exit status"),
    ("exit-code", "unit ended with result exit-code and no exit status"),
    ("weird-new-result", "unit ended with result weird-new-result and no exit status"),
])
def test_no_exit_status_is_lost(result, reason):
    assert c(result, 0, 0) == Outcome("lost", None, reason)


@pytest.mark.parametrize("code", [0, 4, 5, 6, -1, 99])
def test_unknown_code_is_lost(code):
    out = c("exit-code", code, 1)
    assert out.outcome == "lost"
    assert out.exit_status is None


def test_every_classified_outcome_is_in_the_vocabulary():
    for result in ("", "success", "exit-code", "signal", "core-dump", "timeout", "oom-kill", "watchdog",
                   "start-limit-hit", "resources", "protocol", "exec-condition", "other"):
        for code in (0, CLD_EXITED, CLD_KILLED, CLD_DUMPED, 9):
            for status in (0, 1, 9, 15, 203, 217):
                for cancel in (False, True):
                    assert c(result, code, status, cancel).outcome in OUTCOMES


# -- exit_status and signal_name --------------------------------------------------------------------

@pytest.mark.parametrize(("code", "status", "expected"), [
    (CLD_EXITED, 0, "exit:0"),
    (CLD_EXITED, 3, "exit:3"),
    (CLD_EXITED, 255, "exit:255"),
    (CLD_KILLED, 9, "signal:KILL"),
    (CLD_KILLED, 15, "signal:TERM"),
    (CLD_KILLED, 1, "signal:HUP"),
    (CLD_DUMPED, 11, "signal:SEGV"),
    (CLD_DUMPED, 6, "signal:ABRT"),
    (CLD_KILLED, 99, "signal:99"),
    (0, 0, None),
    (0, 9, None),
    (4, 1, None),
])
def test_exit_status(code, status, expected):
    assert exit_status(code, status) == expected


@pytest.mark.parametrize(("number", "name"), [(9, "KILL"), (15, "TERM"), (2, "INT"), (11, "SEGV"), (0, "0"),
                                              (1000, "1000")])
def test_signal_name(number, name):
    assert signal_name(number) == name


# -- run_state_after --------------------------------------------------------------------------------

@pytest.mark.parametrize(("outcome", "state"), [
    ("success", "succeeded"),
    ("cancelled", "cancelled"),
    ("exit-code", "failed"),
    ("signal", "failed"),
    ("core-dump", "failed"),
    ("timeout", "failed"),
    ("oom-kill", "failed"),
    ("watchdog", "failed"),
    ("start-failed", "failed"),
    ("lost", "failed"),
    ("refused", "failed"),
])
def test_run_state_after(outcome, state):
    assert run_state_after(outcome) == state


def test_run_state_after_covers_every_outcome():
    assert {o for o in OUTCOMES if run_state_after(o) == "failed"} == set(OUTCOMES) - {"success", "cancelled"}


# -- retry_delay ------------------------------------------------------------------------------------

def run(**fields):
    fields.setdefault("max_attempts", 100)
    return Run(id=RUN_ID, argv=["/bin/true"], **fields)


LOW, HIGH = (lambda: 0.0), (lambda: 1.0)


def test_retryable_by_default():
    assert RETRYABLE_BY_DEFAULT == frozenset({"exit-code", "signal", "core-dump", "timeout", "oom-kill", "watchdog",
                                              "start-failed", "lost"})


def test_no_retry_when_attempts_exhausted():
    r = run(max_attempts=3)
    assert retry_delay(r, 1, "exit-code", HIGH) == timedelta(seconds=10)
    assert retry_delay(r, 2, "exit-code", HIGH) == timedelta(seconds=20)
    assert retry_delay(r, 3, "exit-code", HIGH) is None
    assert retry_delay(r, 4, "exit-code", HIGH) is None


def test_single_attempt_default_never_retries():
    assert retry_delay(Run(id=RUN_ID, argv=["/bin/true"]), 1, "exit-code", HIGH) is None


@pytest.mark.parametrize("outcome", ["success", "refused", "cancelled"])
def test_never_retried_outcomes(outcome):
    assert retry_delay(run(), 1, outcome, HIGH) is None


@pytest.mark.parametrize("outcome", ["success", "refused", "cancelled"])
def test_never_retried_even_when_listed_in_retry_on(outcome):
    assert retry_delay(run(retry_on=[outcome]), 1, outcome, HIGH) is None


@pytest.mark.parametrize("outcome", sorted(RETRYABLE_BY_DEFAULT))
def test_every_failure_is_retried_by_default(outcome):
    assert retry_delay(run(), 1, outcome, HIGH) == timedelta(seconds=10)


def test_unknown_outcome_is_not_retried():
    assert retry_delay(run(), 1, "mystery", HIGH) is None


def test_retry_on_narrows():
    r = run(retry_on=["timeout", "lost"])
    assert retry_delay(r, 1, "timeout", HIGH) == timedelta(seconds=10)
    assert retry_delay(r, 1, "lost", HIGH) == timedelta(seconds=10)
    assert retry_delay(r, 1, "exit-code", HIGH) is None
    assert retry_delay(r, 1, "oom-kill", HIGH) is None


def test_empty_retry_on_retries_nothing():
    for outcome in RETRYABLE_BY_DEFAULT:
        assert retry_delay(run(retry_on=[]), 1, outcome, HIGH) is None


def test_cancel_requested_never_retries():
    r = run(cancel_requested_at=datetime(2024, 1, 1, tzinfo=UTC))
    for outcome in RETRYABLE_BY_DEFAULT:
        assert retry_delay(r, 1, outcome, HIGH) is None


@pytest.mark.parametrize(("attempt", "seconds"), [(1, 10), (2, 20), (3, 40), (4, 80), (5, 160), (6, 320), (7, 600),
                                                  (8, 600), (50, 600), (99, 600)])
def test_exponential_growth_and_cap(attempt, seconds):
    r = run(retry_backoff_sec=10, retry_backoff_max_sec=600)
    assert retry_delay(r, attempt, "exit-code", HIGH) == timedelta(seconds=seconds)
    assert retry_delay(r, attempt, "exit-code", LOW) == timedelta(seconds=seconds / 2)


def test_huge_attempt_number_stays_capped():
    r = run(max_attempts=10_000, retry_backoff_sec=86400, retry_backoff_max_sec=604800)
    assert retry_delay(r, 5000, "lost", HIGH) == timedelta(seconds=604800)


def test_cap_below_base():
    r = run(retry_backoff_sec=30, retry_backoff_max_sec=30)
    assert retry_delay(r, 1, "exit-code", HIGH) == timedelta(seconds=30)
    assert retry_delay(r, 5, "exit-code", HIGH) == timedelta(seconds=30)


def test_zero_backoff_retries_at_once():
    r = run(retry_backoff_sec=0, retry_backoff_max_sec=0)
    assert retry_delay(r, 3, "exit-code", HIGH) == timedelta(0)


def test_jitter_bounds():
    r = run(retry_backoff_sec=100, retry_backoff_max_sec=10_000)
    assert retry_delay(r, 1, "exit-code", LOW) == timedelta(seconds=50)
    assert retry_delay(r, 1, "exit-code", HIGH) == timedelta(seconds=100)
    assert retry_delay(r, 1, "exit-code", lambda: 0.5) == timedelta(seconds=75)
    assert retry_delay(r, 2, "exit-code", lambda: 0.5) == timedelta(seconds=150)


def test_rand_is_called_once_and_only_when_retrying():
    calls = []

    def rand():
        calls.append(1)
        return 0.0

    r = run(max_attempts=2)
    retry_delay(r, 1, "exit-code", rand)
    assert len(calls) == 1
    retry_delay(r, 2, "exit-code", rand)
    retry_delay(r, 1, "success", rand)
    assert len(calls) == 1
