"""Reading journald: what PID 1 recorded about a unit that is no longer loaded.

Used by the reconciler when an attempt's unit is gone (host reboot, someone ran reset-failed): PID 1
logs a failed unit's exit ("Main process exited", EXIT_CODE/EXIT_STATUS) and result ("Failed with
result", UNIT_RESULT) at info level, so a failure survives in the journal. A clean exit is logged at
debug level only, which is not stored: success cannot be proven from the journal, and such an
attempt stays `lost`. An exit that follows a stop job (a shutdown stopping the unit) is the stop's
doing, not the run's, and is `lost` too.
"""

from __future__ import annotations

import json
import subprocess

from supervisor.outcomes import CLD_DUMPED, CLD_EXITED, CLD_KILLED, Outcome, classify

MSG_PROCESS_EXIT = "98e322203f7a4ed290d09fe03c09fe15"
MSG_UNIT_FAILED = "d9b373ed55a64feb8242e02dbe79a49c"
MSG_UNIT_STOPPING = "de5b426a63be47a7b6ac3eb1a5b1e6ba"
_CODES = {"exited": CLD_EXITED, "killed": CLD_KILLED, "dumped": CLD_DUMPED}


def outcome_from_records(records: list[dict[str, str]]) -> Outcome | None:
    """Pure: the outcome PID 1's records about one unit invocation show, if they show one."""
    result = code = status = None
    for record in records:
        message_id = record.get("MESSAGE_ID")
        if message_id == MSG_UNIT_STOPPING and record.get("JOB_TYPE") == "stop" and code is None:
            return None
        if message_id == MSG_PROCESS_EXIT and record.get("EXIT_CODE") in _CODES:
            code = _CODES[record["EXIT_CODE"]]
            try:
                status = int(record.get("EXIT_STATUS", ""))
            except ValueError:
                return None
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
        found = classify(result or "", code, status, cancel_requested=False)
    return Outcome(found.outcome, found.exit_status, f"{found.reason} (from the journal; the unit was gone)")


class Journal:
    def __init__(self, timeout: float = 10.0) -> None:
        self.timeout = timeout

    def outcome(self, unit_name: str, invocation_id: str | None) -> Outcome | None:
        matches = ["_PID=1", f"UNIT={unit_name}"]
        if invocation_id:
            matches.append(f"INVOCATION_ID={invocation_id}")
        try:
            out = subprocess.run(["journalctl", "--no-pager", "-q", "-o", "json", *matches],
                                 capture_output=True, text=True, timeout=self.timeout, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        records = []
        for line in out.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            records.append({k: v for k, v in entry.items() if isinstance(v, str)})
        return outcome_from_records(records)


def log_command(run_id: str, attempt: int | None, follow: bool, lines: int | None) -> list[str]:
    """The journalctl command that shows a run's output (its processes' stdout, stderr and syslog),
    found by the LogExtraFields every run's unit carries, so it works long after the unit is gone."""
    cmd = ["journalctl", f"UNITVISOR_RUN={run_id}"]
    if attempt is not None:
        cmd.append(f"UNITVISOR_ATTEMPT={attempt}")
    if follow:
        cmd.append("--follow")
    if lines is not None:
        cmd.append(f"--lines={lines}")
    return cmd
