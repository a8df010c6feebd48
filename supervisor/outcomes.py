"""The closed outcome vocabulary, and systemd's (Result, ExecMainCode, ExecMainStatus) -> outcome.

Pure. The attempt row stores `outcome` (one word from OUTCOMES) and `exit_status` (`exit:N` or
`signal:NAME`), so operators and scripts never have to know systemd's codes.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta

from supervisor.model import Run

OUTCOMES = (
    "success", "exit-code", "signal", "core-dump", "timeout", "oom-kill", "watchdog",
    "start-failed", "lost", "cancelled", "refused",
)

# waitid(2) si_code values, as systemd reports them in ExecMainCode.
CLD_EXITED, CLD_KILLED, CLD_DUMPED = 1, 2, 3

# systemd's own exit codes for "could not set up or exec the process" (systemd.exec(5), PROCESS EXIT
# CODES): the command never ran.
_SYSTEMD_SETUP_EXITS = {
    200: "CHDIR", 201: "NICE", 202: "FDS", 203: "EXEC", 204: "MEMORY", 205: "LIMITS",
    206: "OOM_ADJUST", 207: "SIGNAL_MASK", 208: "STDIN", 209: "STDOUT", 210: "CHROOT", 211: "IOPRIO",
    212: "TIMERSLACK", 213: "SECUREBITS", 214: "SETSCHEDULER", 215: "CPUAFFINITY", 216: "GROUP",
    217: "USER", 218: "CAPABILITIES", 219: "CGROUP", 220: "SETSID", 221: "CONFIRM", 222: "STDERR",
    224: "PAM", 225: "NETWORK", 226: "NAMESPACE", 227: "NO_NEW_PRIVILEGES", 228: "SECCOMP",
    229: "SELINUX_CONTEXT", 230: "PERSONALITY", 231: "APPARMOR_PROFILE", 232: "ADDRESS_FAMILIES",
    233: "RUNTIME_DIRECTORY", 235: "CHOWN", 236: "SMACK_PROCESS_LABEL", 237: "KEYRING",
    238: "STATE_DIRECTORY", 239: "CACHE_DIRECTORY", 240: "LOGS_DIRECTORY",
    241: "CONFIGURATION_DIRECTORY", 242: "NUMA_POLICY", 243: "CREDENTIALS",
}

# An exit status in 200-243 is ambiguous: systemd's forked child exits with it when a setup step fails
# before execve() (the command never ran), and a command may exit with it on its own. systemd 252 keeps
# no property that says which (ExecMainHandoffTimestamp only arrived in 255). Measured in the test bed
# (systemd 252, Type=exec, RemainAfterExit=yes, as 0.3.0 started every run's unit; units are now
# RemainAfterExit=no and kept loaded by the daemon's reference instead, which changes how a clean end
# shows, `inactive/dead` instead of `active/exited`, not these fields, set when the process is reaped):
#
#   unit                                 Result     ExecMainStatus  ExecMainPID  ActiveEnterTimestamp
#   /bin/sh -c 'exit 203'                exit-code  203             set          set (26 of 30 times)
#   /bin/sh -c 'exit 200'                exit-code  200             set          0 (seen once)
#   missing executable (EXEC)            exit-code  203             set          0
#   User=no-such-user (USER)             exit-code  217             set          0
#   WorkingDirectory=/no/such (CHDIR)    exit-code  200             set          0
#
# ExecMainStartTimestamp, ExecMainExitTimestamp, ExecMainPID, Result and InactiveExitTimestamp are set
# the same way in every row. What differs:
#
# 1. ActiveEnterTimestamp. A Type=exec unit becomes active only once PID 1 sees the close-on-exec pipe
#    of a child that reached execve() ("exec-fd"): a setup failure never makes the unit active, so a
#    non-zero ActiveEnterTimestamp proves the command ran. Its absence proves nothing: a command that
#    exits at once can be reaped before PID 1 reads the pipe (4 of 30 runs of `exit 203` here).
# 2. The journal. On a setup failure the child logs "Failed at step STEP spawning PATH: ..." with
#    MESSAGE_ID 641257651c1b4ec9a8624d7a40a9e1e7 (SD_MESSAGE_SPAWN_FAILED), UNIT= and INVOCATION_ID=,
#    before it exits; a command's own exit never logs it. It reaches journald on the same datagram
#    socket as PID 1's later "Main process exited" record, so while the unit is still loaded, once that
#    record is in the journal the absence of a spawn failure is proof too (journal.exec_evidence).
#    PID 1's "Started" record (same moment as ActiveEnterTimestamp) is positive proof the command ran.
#
# After a reboot (the unit is gone) only the positive records count: a power cut can keep a later
# journal page and lose an earlier one, so a missing spawn-failure record proves nothing there, and an
# exit of 200-243 without a "Started" record stays `start-failed` (it may be the command's own).
# Where neither proof is available (journal unreadable), 200-243 stays `start-failed`, as before.

# Results that mean "systemd could not start it", whatever the process did.
_START_FAILED_RESULTS = {"start-limit-hit", "resources", "protocol", "exec-condition"}
_RESULT_OUTCOMES = {"timeout": "timeout", "oom-kill": "oom-kill", "watchdog": "watchdog"}


@dataclass(frozen=True)
class Outcome:
    outcome: str
    exit_status: str | None
    reason: str

    @property
    def succeeded(self) -> bool:
        return self.outcome == "success"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name.removeprefix("SIG")
    except ValueError:
        return str(number)


def exit_status(code: int, status: int) -> str | None:
    if code == CLD_EXITED:
        return f"exit:{status}"
    if code in (CLD_KILLED, CLD_DUMPED):
        return f"signal:{signal_name(status)}"
    return None


def is_setup_exit(result: str, code: int, status: int) -> bool:
    """Whether this ended unit's exit status may be systemd's setup failure (see the note above)."""
    return code == CLD_EXITED and status in _SYSTEMD_SETUP_EXITS and result != "success"


def stop_detail(code: int, status: int, stop_signal: str | None) -> str:
    """What ended a unit that systemd stopped (a cancel, runtime_max_sec) with `stop_signal` (its short
    name; None: not known, as from the journal alone), for the outcome's reason: the signal that ended
    it, and whether its stop timed out into SIGKILL (a SIGKILL where the stop signal was another: systemd
    sends it only once stop_timeout has passed). Empty when nothing is known."""
    if stop_signal is None:
        return ""
    if code in (CLD_KILLED, CLD_DUMPED):
        ended_by = signal_name(status)
        if ended_by == "KILL" and stop_signal != "KILL":
            return f"SIG{stop_signal} did not end it within its stop timeout: killed by SIGKILL"
        return f"ended by SIG{ended_by}"
    if code == CLD_EXITED:
        return f"exited {status} after SIG{stop_signal}"
    return ""


def stop_timed_out(outcome: Outcome) -> bool:
    """Whether an outcome says its stop (a cancel, runtime_max_sec) timed out into SIGKILL (stop_detail)."""
    return outcome.outcome in ("cancelled", "timeout") and outcome.reason.endswith(": killed by SIGKILL")


# How early before its runtime limit a command may end and still be taken as ended by it (timeout_cause):
# the two timestamps are systemd's, taken as it handles each event, and the limit's timer fires late,
# never early; the slack only absorbs their rounding.
_RUNTIME_SLACK_USEC = 10_000


def timeout_cause(runtime_max_sec: int | None, active_enter_usec: int, exec_main_exit_usec: int) -> str:
    """Which of systemd's timers gave an ended unit its `timeout` result, by the unit's own timestamps:

    - "runtime": RuntimeMaxSec, the run's runtime limit, ended the command (it ran that long);
    - "start": TimeoutStartSec: the unit never became active, so the command was never exec'd (Type=exec);
    - "after": the command ended on its own before any runtime limit, and a timeout came after it. The
      ExecStopPost that keeps pids.peak (taskspeak) runs in the run's cgroup, under its CPU quota, within
      TimeoutStopSec: on a loaded VM guest under `--cpu 20%` it once took longer than the 10 s, and the
      run, which had exited 0, was recorded as a runtime limit it did not have. An outside
      `systemctl stop` whose stop timed out is the other way here.

    Judged by the unit, not the run's row alone: a run with a runtime limit may still end before it."""
    if not active_enter_usec:
        return "start"
    if runtime_max_sec is not None and (
            not exec_main_exit_usec
            or exec_main_exit_usec - active_enter_usec >= runtime_max_sec * 1_000_000 - _RUNTIME_SLACK_USEC):
        return "runtime"
    return "after"


# systemd's result for a main process that ended this way on its own (what "after" classifies by).
_RESULT_OF_EXIT = {CLD_KILLED: "signal", CLD_DUMPED: "core-dump"}


def classify(result: str, code: int, status: int, *, cancel_requested: bool,
             program_ran: bool | None = None, stop_signal: str | None = None,
             timed_out_by: str = "runtime") -> Outcome:
    """The outcome of an ended unit.

    `program_ran` is what is known about whether the command itself ran (execve() succeeded): True,
    False, or None when unknown. It only matters for an exit status of 200-243: the command's own
    (`exit-code`) when it ran, systemd's setup failure (`start-failed`) otherwise, and when unknown.

    Cancellation wins over everything: an attempt that ends after an operator asked to cancel it is
    `cancelled`, even if the stop made it exit 0 (a stopped unit looks successful to systemd).
    A kill by a signal that systemd counts as clean (SIGTERM, SIGINT, SIGHUP, SIGPIPE) is reported
    as `signal`, not `success`: the run did not finish on its own, and nobody here asked it to stop.

    `stop_signal`: the run's stop signal (schema 026), when known: the reason of a cancel or of a
    runtime limit then says which signal ended the run and whether the stop timed out into SIGKILL.

    `timed_out_by`: for a `timeout` result, which timer it was (timeout_cause()): only "runtime" is the
    outcome `timeout`; "start" is start-failed, and "after" the command's own end.
    """
    status_text = exit_status(code, status)
    if cancel_requested:
        detail = stop_detail(code, status, stop_signal)
        return Outcome("cancelled", status_text, "cancelled by request" + (f": {detail}" if detail else ""))
    if result == "timeout" and timed_out_by == "start":
        return Outcome("start-failed", status_text,
                       "systemd's start timeout (TimeoutStartSec) passed before the command was started")
    if result == "timeout" and timed_out_by == "after" and code in (CLD_EXITED, CLD_KILLED, CLD_DUMPED):
        own = _RESULT_OF_EXIT.get(code, "success" if status == 0 else "exit-code")
        ended = classify(own, code, status, cancel_requested=False, program_ran=program_ran)
        return replace(ended, reason=ended.reason + "; systemd timed out after it ended (TimeoutStopSec: its "
                                                    "ExecStopPost, or a stop from outside unitvisor)")
    if result in _RESULT_OUTCOMES:
        timeout = "runtime limit reached" if timed_out_by == "runtime" else "systemd's stop timeout (TimeoutStopSec)"
        reason = {"timeout": timeout, "oom-kill": "killed by the OOM killer", "watchdog": "watchdog timeout"}[result]
        detail = stop_detail(code, status, stop_signal) if result == "timeout" else ""
        return Outcome(_RESULT_OUTCOMES[result], status_text, reason + (f": {detail}" if detail else ""))
    if result in _START_FAILED_RESULTS:
        return Outcome("start-failed", status_text, f"systemd result {result}")
    if is_setup_exit(result, code, status) and program_ran is not True:
        step = _SYSTEMD_SETUP_EXITS[status]
        unproven = "" if program_ran is False else "; not proven: the command may have exited with it itself"
        return Outcome("start-failed", status_text,
                       f"systemd could not start the command: step {step} failed ({status}/{step}){unproven}")
    if code == CLD_EXITED:
        if status == 0:
            return Outcome("success", status_text, "exited 0")
        return Outcome("exit-code", status_text, f"exited with status {status}")
    if code == CLD_DUMPED or result == "core-dump":
        return Outcome("core-dump", status_text, f"killed by signal {signal_name(status)}, core dumped")
    if code == CLD_KILLED:
        return Outcome("signal", status_text, f"killed by signal {signal_name(status)}")
    return Outcome("lost", status_text, f"unit ended with result {result or 'unknown'} and no exit status")


def run_state_after(outcome: str) -> str:
    """The run's state once its last attempt has this outcome (retries are decided elsewhere)."""
    if outcome == "success":
        return "succeeded"
    if outcome == "cancelled":
        return "cancelled"
    return "failed"


# Every failure is worth another attempt by default, except the two that would fail the same way
# again or that a person chose: `refused` (the host's policy) and `cancelled`.
RETRYABLE_BY_DEFAULT = frozenset(OUTCOMES) - {"success", "refused", "cancelled"}

# The signal names retry_on and fail_on accept (`signal:TERM`): those signal_name gives on Linux, as
# unitvisor.failure_rules_problem lists them (tests/unit/test_failure_rules.py holds the two together).
SIGNAL_NAMES = ("HUP", "INT", "QUIT", "ILL", "TRAP", "ABRT", "BUS", "FPE", "KILL", "USR1", "SEGV", "USR2", "PIPE",
                "ALRM", "TERM", "STKFLT", "CHLD", "CONT", "STOP", "TSTP", "TTIN", "TTOU", "URG", "XCPU", "XFSZ",
                "VTALRM", "PROF", "WINCH", "IO", "PWR", "SYS", "RTMIN", "RTMAX")


@dataclass(frozen=True)
class Verdict:
    """Whether a run is tried again after an attempt, and why (None: as before the failure rules)."""

    retry: bool
    why: str | None = None
    # The failure rule that ended the run before max_attempts did (fail_on, max_lost_attempts): the label
    # of unitvisor_runs_ended_by_rule_total. Not compared: it restates `why`.
    ended_by: str | None = field(default=None, compare=False)


def failure_code(outcome: str, exit_status: str | None) -> str | None:
    """The retry_on / fail_on entry an attempt matches: `exit:N` only the main process's own exit
    (exit-code), `signal:NAME` only a kill by that signal (signal, core-dump). A timeout's or an OOM
    kill's signal is named by its outcome, so that `signal:TERM` does not also retry every runtime_max."""
    if exit_status is None:
        return None
    if outcome == "exit-code" and exit_status.startswith("exit:"):
        return exit_status
    if outcome in ("signal", "core-dump") and exit_status.startswith("signal:"):
        return exit_status
    return None


def failure_verdict(run: Run, attempt: int, lost: int, outcome: str, exit_status: str | None) -> Verdict:
    """Whether the run goes on after this attempt: the twin of unitvisor.failure_verdict (sql/schema.sql),
    which record_outcome applies whatever the daemon proposes; tests/integration/test_failure_rules.py
    compares the two over every case. `lost` counts the run's attempts lost with their host, this one
    included. The first rule that applies decides:

    1. a cancel requested, or no failure (success, cancelled, refused): no retry;
    2. fail_on names the attempt's exit status or signal: no retry, whatever retry_on says;
    3. retry_on (None: every failure) names neither the outcome nor that code: no retry;
    4. lost, and lost attempts do not count (count_lost false): retried until max_lost_attempts of them;
    5. retried while the attempts that count are fewer than max_attempts.
    """
    code = failure_code(outcome, exit_status)
    if run.cancel_requested_at is not None or outcome not in RETRYABLE_BY_DEFAULT:
        return Verdict(False)
    if code is not None and code in (run.fail_on or ()):
        return Verdict(False, f"no retry: fail_on names {code}", "fail_on")
    if run.retry_on is not None and outcome not in run.retry_on and (code is None or code not in run.retry_on):
        return Verdict(False)
    if outcome == "lost" and not run.count_lost:
        if lost >= run.max_lost_attempts:
            return Verdict(False, f"no retry: max_lost_attempts reached ({lost} attempts lost with their host)",
                           "max_lost_attempts")
        return Verdict(True, f"lost with its host, not counted against max_attempts "
                             f"({lost} of max_lost_attempts {run.max_lost_attempts})")
    uncounted = 0 if run.count_lost else lost
    return Verdict(attempt - uncounted < run.max_attempts)


def retry_delay(run: Run, attempt: int, outcome: str, rand: Callable[[], float],
                exit_status: str | None = None) -> timedelta | None:
    """How long until the next attempt, or None when this outcome ends the run (failure_verdict).

    Backoff doubles per attempt from the run's retry_backoff_sec, capped at retry_backoff_max_sec,
    then jittered into [half, all] of that, so that runs that failed together do not retry together.
    `run.lost_attempts` is what the store read before this attempt was settled: this one is added.
    """
    lost = run.lost_attempts + (1 if outcome == "lost" else 0)
    if not failure_verdict(run, attempt, lost, outcome, exit_status).retry:
        return None
    capped = min(run.retry_backoff_sec * 2 ** min(attempt - 1, 32), run.retry_backoff_max_sec)
    return timedelta(seconds=capped * (0.5 + rand() / 2))
