"""The closed outcome vocabulary, and systemd's (Result, ExecMainCode, ExecMainStatus) -> outcome.

Pure. The attempt row stores `outcome` (one word from OUTCOMES) and `exit_status` (`exit:N` or
`signal:NAME`), so operators and scripts never have to know systemd's codes.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
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


def classify(result: str, code: int, status: int, *, cancel_requested: bool) -> Outcome:
    """The outcome of an ended unit.

    Cancellation wins over everything: an attempt that ends after an operator asked to cancel it is
    `cancelled`, even if the stop made it exit 0 (a stopped unit looks successful to systemd).
    A kill by a signal that systemd counts as clean (SIGTERM, SIGINT, SIGHUP, SIGPIPE) is reported
    as `signal`, not `success`: the run did not finish on its own, and nobody here asked it to stop.
    """
    status_text = exit_status(code, status)
    if cancel_requested:
        return Outcome("cancelled", status_text, "cancelled by request")
    if result in _RESULT_OUTCOMES:
        reason = {"timeout": "runtime limit reached", "oom-kill": "killed by the OOM killer",
                  "watchdog": "watchdog timeout"}[result]
        return Outcome(_RESULT_OUTCOMES[result], status_text, reason)
    if result in _START_FAILED_RESULTS:
        return Outcome("start-failed", status_text, f"systemd result {result}")
    if code == CLD_EXITED and status in _SYSTEMD_SETUP_EXITS and result != "success":
        step = _SYSTEMD_SETUP_EXITS[status]
        return Outcome("start-failed", status_text,
                       f"systemd could not start the command: step {step} failed ({status}/{step})")
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


def retry_delay(run: Run, attempt: int, outcome: str, rand: Callable[[], float]) -> timedelta | None:
    """How long until the next attempt, or None when this outcome ends the run.

    Backoff doubles per attempt from the run's retry_backoff_sec, capped at retry_backoff_max_sec,
    then jittered into [half, all] of that, so that runs that failed together do not retry together.
    """
    if run.cancel_requested_at is not None or attempt >= run.max_attempts:
        return None
    allowed = RETRYABLE_BY_DEFAULT if run.retry_on is None else frozenset(run.retry_on) & RETRYABLE_BY_DEFAULT
    if outcome not in allowed:
        return None
    capped = min(run.retry_backoff_sec * 2 ** min(attempt - 1, 32), run.retry_backoff_max_sec)
    return timedelta(seconds=capped * (0.5 + rand() / 2))
