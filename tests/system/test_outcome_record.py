"""What an outcome keeps besides the outcome, under a real systemd: what systemd measured of the run
(where this test bed's systemd and cgroup layout can measure it, NULL where they cannot, each decided
by what the test bed is), and the end of its output, which `unitvisor logs` shows once the journal no
longer has it."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.harness.host import VENV_BIN, Host, wait_for

# Burns CPU for a moment in the shell itself, then has a process hold 64 MiB it has written to.
BUSY = ["/bin/sh", "-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; "
        "/usr/bin/python3 -c 'b = bytearray(64 << 20); b[::4096] = b\"x\" * len(b[::4096])'; echo done"]


def only_attempt(data: dict) -> dict:
    [attempt] = data["attempts"]
    return attempt


def kept_tail(host: Host, run_id: str) -> str:
    """The attempt's output tail, once the daemon has read it (TailReader.DELAY after the outcome)."""
    return wait_for(lambda: only_attempt(host.show(run_id))["output_tail"], timeout=30,
                    what="the output tail to be kept")


def kept_tail_or_empty(host: Host, run_id: str) -> str:
    """The attempt's output tail once read, "" included (a run that printed nothing)."""
    wait_for(lambda: only_attempt(host.show(run_id))["output_tail"] is not None, timeout=30,
             what="the output tail to be kept")
    return only_attempt(host.show(run_id))["output_tail"]


def measurable(host: Host) -> dict[str, bool]:
    """Which figures this test bed's systemd can give an ended unit, from what the test bed is: with
    the unified hierarchy (cgroup v2) CPU and IO counters are kept after the unit's cgroup is gone, and
    the peak of memory from systemd 256 on (MemoryPeak). In a container that sees the cgroup v1
    controllers read-only (this project's test beds, shared/TESTBED.md), systemd realizes no
    controller for the unit and reports every figure as unavailable. The peak of tasks is the kernel's
    pids.peak (cgroup v2, Linux 6.1 on), which the unit's own stop command copies out."""
    unified = host.tb.run("stat", "-fc", "%T", "/sys/fs/cgroup").stdout.strip() == "cgroup2fs"
    version = int(host.tb.run("systemctl", "--version").stdout.split()[1])
    cpuacct = host.tb.run("findmnt", "-no", "OPTIONS", "/sys/fs/cgroup/cpuacct", check=False).stdout
    cpu_v1 = bool(cpuacct) and "rw" in cpuacct.split(",")
    kernel = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2])
    return {"cpu_usage_nsec": unified or cpu_v1, "memory_peak_bytes": unified and version >= 256,
            "io_read_bytes": unified, "io_write_bytes": unified, "tasks_peak": unified and kernel >= (6, 1)}


@pytest.fixture
def tails(host: Host) -> Host:
    host.configure(runs_extra="output_tail_lines = 20\noutput_tail_bytes = 50")
    host.start()
    return host


def test_a_busy_run_records_what_systemd_measured_where_it_can(tails: Host) -> None:
    run_id = tails.submit("--", *BUSY)
    attempt = only_attempt(tails.wait_run(run_id))
    assert attempt["outcome"] == "success", attempt
    expected = measurable(tails)
    measured = attempt["accounting"]
    assert set(measured) == set(expected)
    for key, can in expected.items():
        if can:
            assert isinstance(measured[key], int) and measured[key] >= 0, (key, measured)
        else:
            assert measured[key] is None, (key, measured)
    if expected["cpu_usage_nsec"]:
        assert measured["cpu_usage_nsec"] > 10_000_000  # the loop alone takes more than 10 ms of CPU
    if expected["memory_peak_bytes"]:
        assert measured["memory_peak_bytes"] >= 64 << 20
    # Each figure it could not measure is named, with what it needs.
    assert set(attempt["not_measured"]) == {key for key, can in expected.items() if not can}, attempt
    # The unit asked for every figure; this systemd recorded the request, whatever it could measure.
    shown = tails.cli("show", run_id).stdout
    if not any(expected.values()):
        assert "    measured: -\n" in shown
    else:
        assert "CPU" in shown or "read" in shown


def test_a_run_printing_1000_lines_keeps_only_its_last_lines_within_the_bytes(tails: Host) -> None:
    run_id = tails.submit("--", "/usr/bin/seq", "1", "1000")
    attempt = only_attempt(tails.wait_run(run_id))
    assert attempt["outcome"] == "success"
    # 20 lines are 80 bytes; the 50-byte bound keeps the last 12 whole ones (48 bytes)
    assert kept_tail(tails, run_id) == "\n".join(str(i) for i in range(989, 1001))
    shown = tails.cli("show", run_id).stdout
    assert "    output:   the last 12 lines kept with the outcome\n" in shown
    # the whole output stays in journald
    full = tails.cli("logs", run_id)
    assert [line.split(": ", 1)[1] for line in full.stdout.splitlines()] == [str(i) for i in range(1, 1001)]
    assert full.stderr == ""


def test_logs_shows_the_kept_tail_once_the_journal_has_lost_the_output(tails: Host) -> None:
    run_id = tails.submit("--", "/bin/sh", "-c", "echo first; echo 'ünïcode ✓'; echo last >&2; exit 3")
    assert only_attempt(tails.wait_run(run_id))["outcome"] == "exit-code"
    assert kept_tail(tails, run_id) == "first\nünïcode ✓\nlast"
    # The journal rotates and its old files are removed, as on a busy host after a while.
    tails.tb.run("journalctl", "--rotate")
    time.sleep(1.1)
    tails.tb.run("journalctl", "--vacuum-time=1s")
    wait_for(lambda: not tails.tb.run("journalctl", "-q", "--no-pager", f"UNITVISOR_RUN={run_id}").stdout,
             what="the run's output to be gone from the journal")
    shown = tails.cli("logs", run_id)
    assert shown.stdout == "first\nünïcode ✓\nlast\n"
    assert shown.stderr == ("attempt 1 on host testhost-1: the last 3 lines of its output, kept with its outcome; "
                            "the whole output is in that host's journal while it keeps it\n")
    assert tails.cli("logs", run_id, "--lines", "1").stdout == "last\n"
    data = json.loads(tails.cli("show", run_id, "--json").stdout)
    assert only_attempt(data)["output_tail"] == "first\nünïcode ✓\nlast"


def test_a_daemon_stopped_right_after_an_outcome_still_keeps_the_tail(tails: Host) -> None:
    """The tail is read a moment after the outcome, off the loop; stopping the daemon reads and writes
    what is queued first (TailReader.close), whether the stop comes before that moment or after."""
    run_id = tails.submit("--", "/bin/sh", "-c", "echo one; echo two")
    assert only_attempt(tails.wait_run(run_id))["outcome"] == "success"
    tails.stop()
    assert only_attempt(tails.show(run_id))["output_tail"] == "one\ntwo"


# What no line of a tail has had before: tabs, an escape sequence, a byte that is not UTF-8, a
# character cut in half, no newline at the end; and a line of 5000 bytes, which journalctl -o json
# leaves out (one of 4096 or more).
ODD = (r"printf 'plain\n\tindented\nesc \033[1mbold\033[0m\nbad \377 byte\nhalf \342\234\n'; "
       r"printf 'no newline at the end'")
LONG = r"head -c 5000 /dev/zero | tr '\0' x; echo; echo after"
# In the test bed, with the host's bounds: each attempt's tail read alone (journalctl -o cat, as before
# issue 14), then all of them with one journalctl (TailReader's batches), and how many it read alone.
READ_BOTH = """
import json, sys
from supervisor.journal import Journal

class Counting(Journal):
    alone = 0

    def output_tail(self, *args):
        self.alone += 1
        return super().output_tail(*args)

ids, max_bytes = json.loads(sys.argv[1]), int(sys.argv[2])
journal = Counting()
alone = [journal.output_tail(run_id, 1, 20, max_bytes) for run_id in ids]
journal.alone = 0
together = journal.output_tails([(run_id, 1) for run_id in ids], 20, max_bytes)
print(json.dumps({"alone": alone, "together": together, "read_alone": journal.alone}))
"""


def read_both(host: Host, run_ids: list[str], max_bytes: int) -> dict:
    out = host.tb.run(str(VENV_BIN / "python"), "-c", READ_BOTH, json.dumps(run_ids), str(max_bytes))
    return json.loads(out.stdout)


def test_tails_read_together_are_those_read_alone(tails: Host) -> None:
    """Runs that end together have their tails read with one journalctl (-o json): each is the tail
    its own read (-o cat) gives, byte for byte, and an attempt a chatty run crowded out of the batch
    is read alone."""
    commands = {
        "odd": ["/bin/sh", "-c", "sleep 1; " + ODD],
        "long": ["/bin/sh", "-c", "sleep 1; " + LONG],
        "quiet": ["/bin/sh", "-c", "sleep 1; echo one; echo two >&2"],
        "silent": ["/bin/sleep", "1"],
        "chatty": ["/bin/sh", "-c", "sleep 2; seq 1 3000"],  # its lines come after all the others'
    }
    run_ids = {name: tails.submit("--", *argv) for name, argv in commands.items()}
    for run_id in run_ids.values():
        tails.wait_run(run_id)
    kept = {name: kept_tail_or_empty(tails, run_id) for name, run_id in run_ids.items()}
    assert (kept["quiet"], kept["silent"], kept["chatty"]) == ("one\ntwo", "", "\n".join(map(str, range(2991, 3001))))
    # The daemon's tails (with its 50 bytes) are what each attempt's read alone keeps.
    assert read_both(tails, list(run_ids.values()), 50)["alone"] == list(kept.values())
    # One journalctl proves the tails of the odd, quiet and silent runs; the long run's is read alone
    # (the JSON left its long line out); with the chatty run, its 3000 lines fill the batch's 100
    # records and the four others are read alone.
    reads = {}
    for names, read_alone in ((["odd", "quiet", "silent"], 0), (["long", "quiet"], 1), (list(run_ids), 4)):
        both = read_both(tails, [run_ids[name] for name in names], 65536)
        assert both["together"] == both["alone"]
        assert both["read_alone"] == read_alone
        reads.update(zip(names, both["together"], strict=True))
    assert reads["odd"] == ("plain\n\tindented\nesc \x1b[1mbold\x1b[0m\nbad \ufffd byte\nhalf \ufffd\n"
                            "no newline at the end")
    assert reads["long"] == "x" * 5000 + "\nafter"
