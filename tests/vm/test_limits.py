"""The limits, seen to act: each through `unitvisor submit` and the outcome unitvisor recorded, on a real
cgroup-v2 kernel (a Debian 13 guest). Each would fail where the limit is only recorded, not enforced,
as in the system tier's cgroup-v1 containers: the run would finish, or use what it asked for.

Figures are compared with what the kernel measured in the guest (CPU time, bytes), never with
wall-clock speed: the guest runs under software emulation beside whatever else the machine does."""

from __future__ import annotations

import json
import re

import pytest

from tests.vm.conftest import SERVICE, VmHost

PY = "/usr/bin/python3"
MiB = 1 << 20

# Touches every page it allocates (bytearray(n) alone maps zero pages the kernel never charges).
ALLOCATE = "import sys; blocks = [b'x' * (1 << 20) for _ in range(int(sys.argv[1]))]; print('allocated')"
# Spins for a number of seconds of the guest's wall clock, then prints the CPU time the loop got
# (the interpreter's start-up, slow under emulation and throttled too, is left out).
SPIN = ("import sys, time; start = time.process_time(); end = time.monotonic() + float(sys.argv[1])\n"
        "while time.monotonic() < end: pass\n"
        "print('loop cpu', round(time.process_time() - start, 3), flush=True)")
# Forks children that sleep, until a fork fails; prints how many it made and exits 0.
FORK = ("import os, sys, time\n"
        "made = 0\n"
        "try:\n"
        "    for _ in range(int(sys.argv[1])):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        made += 1\n"
        "except OSError as exc:\n"
        "    print('fork failed after', made, exc.strerror, flush=True)\n"
        "    sys.exit(75)\n"
        "print('forked', made, flush=True)")
# Writes and reads back (with O_DIRECT semantics avoided: fsync, then drop nothing) a file in /var/tmp.
IO = ("import os; path = '/var/tmp/io-test'\n"
      "with open(path, 'wb') as f:\n"
      "    for _ in range(32): f.write(os.urandom(1 << 20))\n"
      "    f.flush(); os.fsync(f.fileno())\n"
      "os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)\n"
      "with open(path, 'rb') as f:\n"
      "    while f.read(1 << 20): pass\n"
      "print('done')")


def attempt(shown: dict) -> dict:
    assert len(shown["attempts"]) == 1, shown
    return shown["attempts"][0]


def test_the_guest_is_a_cgroup_v2_host(vm_host: VmHost) -> None:
    """What the rest of the tier relies on: systemd 257 on cgroup v2 with the controllers delegated to
    unitvisor.slice, and the daemon running as the package installed it."""
    assert vm_host.run("stat", "-f", "-c", "%T", "/sys/fs/cgroup").stdout.strip() == "cgroup2fs"
    assert vm_host.prop(SERVICE, "ActiveState") == "active"
    version = vm_host.run("systemctl", "--version").stdout.split()[1]
    assert int(version) >= 257, version
    doctor = vm_host.unitvisor("doctor", check=False)
    assert "cgroup" in doctor.stdout
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    # What doctor says of PSI and pids.peak is the truth here: trixie's 6.12 has both.
    assert re.search(r"^ok\s+pressure\s+PSI read from .*admission by pressure active \(memory, io;", doctor.stdout,
                     re.M), doctor.stdout
    assert re.search(r"^ok\s+tasks peak\s+measured \(", doctor.stdout, re.M), doctor.stdout


def test_a_run_over_its_memory_is_killed_and_recorded_oom_kill(vm_host: VmHost) -> None:
    daemon_pid = vm_host.prop(SERVICE, "MainPID")
    run_id = vm_host.submit("--memory", "64M", "--", PY, "-c", ALLOCATE, "512")
    shown = vm_host.wait_ended(run_id)
    ended = attempt(shown)
    assert ended["outcome"] == "oom-kill", ended
    assert shown["state"] == "failed", shown
    # The peak is the limit's, not the 512 MiB the run asked for: the kernel stopped it there.
    peak = ended["accounting"]["memory_peak_bytes"]
    assert peak is not None and 32 * MiB <= peak <= 64 * MiB, ended["accounting"]
    # Nothing else on the host was touched: the daemon is the same process, PostgreSQL still serves.
    assert vm_host.prop(SERVICE, "MainPID") == daemon_pid
    assert vm_host.prop(SERVICE, "ActiveState") == "active"
    assert vm_host.prop("postgresql@17-main.service", "ActiveState") == "active"


def test_memory_max_bounds_swap_too(vm_host: VmHost) -> None:
    """memory_max is all the memory a run may use: with swap on the host, a run over its limit is
    still killed rather than pushed into swap (MemorySwapMax=0 beside MemoryMax=)."""
    vm_host.run("sh", "-c", "test -e /swapfile || (dd if=/dev/zero of=/swapfile bs=1M count=256 status=none "
                "&& chmod 600 /swapfile && mkswap -q /swapfile)")
    vm_host.run("swapon", "/swapfile", check=False)
    try:
        assert "/swapfile" in vm_host.run("cat", "/proc/swaps").stdout
        run_id = vm_host.submit("--memory", "64M", "--", PY, "-c", ALLOCATE, "128")
        ended = attempt(vm_host.wait_ended(run_id))
        assert ended["outcome"] == "oom-kill", ended
        # The kernel's own limit on the run's cgroup, read while it runs (an ended unit has no cgroup).
        # Ten minutes, cancelled below: on a loaded machine the guest (software emulation) once took over
        # the minute the sleeper had between its start and the cancel, and it had succeeded.
        sleeper = vm_host.submit("--memory", "64M", "--", PY, "-c", "import time; time.sleep(600)")
        cgroup = vm_host.prop(_running_unit(vm_host, sleeper), "ControlGroup")
        assert vm_host.run("cat", f"/sys/fs/cgroup{cgroup}/memory.swap.max").stdout.strip() == "0"
        assert vm_host.run("cat", f"/sys/fs/cgroup{cgroup}/memory.max").stdout.strip() == str(64 * MiB)
        vm_host.operator("cancel", sleeper)
        vm_host.wait_ended(sleeper)
    finally:
        vm_host.run("swapoff", "/swapfile", check=False)


def test_a_cpu_quota_throttles_a_busy_loop(vm_host: VmHost) -> None:
    """A 5 s busy loop under `--cpu 20%` gets about 1 s of CPU. Tolerance: 0.5 to 1.75 s for the loop
    (the quota is enforced per 100 ms period, so the loop's first and last periods may be whole or
    cut; the guest's clock and its CPU time both drift under emulation), and the whole run, its
    interpreter's start-up included, at most 35% of the time it ran. Without the limit the same loop
    gets several times as much."""
    run_id = vm_host.submit("--cpu", "20%", "--", PY, "-c", SPIN, "5")
    ended = attempt(vm_host.wait_ended(run_id, tail=True))
    # Said in full, with what systemd logged of the unit: a loaded CI machine twice saw `timeout` here,
    # and pytest cut short the dict that was all it said.
    assert ended["outcome"] == "success", _in_full(vm_host, ended)
    loop = _loop_cpu(ended)
    assert 0.5 <= loop <= 1.75, (loop, ended)
    cpu = ended["accounting"]["cpu_usage_nsec"] / 1e9
    assert cpu <= 0.35 * _elapsed(ended), (cpu, ended)

    free = attempt(vm_host.wait_ended(vm_host.submit("--", PY, "-c", SPIN, "5"), tail=True))
    assert _loop_cpu(free) >= 2.5, free


def _in_full(vm_host: VmHost, ended: dict) -> str:
    """An attempt as a string (pytest shortens any other object it is given to say) and the guest's
    journal of its unit, monotonic clock shown: which of systemd's timers fired, and when."""
    journal = vm_host.run("journalctl", "--no-pager", "-o", "short-monotonic", "-u", ended["unit"],
                          check=False).stdout
    return json.dumps(ended, sort_keys=True) + "\n" + journal[-4000:]


def _loop_cpu(ended: dict) -> float:
    """What SPIN printed: the CPU seconds its loop got."""
    tail = ended["output_tail"] or ""
    lines = [line for line in tail.splitlines() if line.startswith("loop cpu ")]
    assert lines, ended
    return float(lines[-1].split()[-1])


def test_a_fork_loop_stops_at_tasks_max(vm_host: VmHost) -> None:
    run_id = vm_host.submit("--tasks", "5", "--", PY, "-c", FORK, "50")
    ended = attempt(vm_host.wait_ended(run_id, timeout=300, tail=True))
    # The fifth task (the Python process and four children) is refused by the kernel: EAGAIN.
    assert ended["outcome"] == "exit-code" and ended["exit_status"] == "exit:75", ended
    tail = ended["output_tail"] or ""
    assert "fork failed after 4 Resource temporarily unavailable" in tail, tail


def test_runtime_max_ends_a_run_as_timeout(vm_host: VmHost) -> None:
    run_id = vm_host.submit("--runtime", "3s", "--", PY, "-c", "import time; time.sleep(120)")
    ended = attempt(vm_host.wait_ended(run_id))
    assert ended["outcome"] == "timeout", ended
    assert _elapsed(ended) < 60, ended


def test_io_weight_is_applied_to_the_cgroup(vm_host: VmHost) -> None:
    run_id = vm_host.submit("--io-weight", "50", "--", PY, "-c", "import time; time.sleep(60)")
    unit = _running_unit(vm_host, run_id)
    cgroup = vm_host.prop(unit, "ControlGroup")
    weight = vm_host.run("cat", f"/sys/fs/cgroup{cgroup}/io.weight").stdout
    assert weight.split("\n")[0].strip() == "default 50", weight
    vm_host.operator("cancel", run_id)
    vm_host.wait_ended(run_id)


def test_the_accounting_is_what_the_run_did(vm_host: VmHost) -> None:
    """CPU, memory peak and IO bytes, as systemd measured them, compared with what the run did."""
    alloc = attempt(vm_host.wait_ended(vm_host.submit("--", PY, "-c", ALLOCATE, "100")))
    assert alloc["outcome"] == "success", alloc
    figures = alloc["accounting"]
    assert 100 * MiB <= figures["memory_peak_bytes"] <= 400 * MiB, figures
    assert figures["cpu_usage_nsec"] > 0, figures

    io = attempt(vm_host.wait_ended(vm_host.submit("--", PY, "-c", IO)))
    assert io["outcome"] == "success", io
    figures = io["accounting"]
    assert figures["io_write_bytes"] >= 32 * MiB, figures
    assert figures["io_read_bytes"] >= 16 * MiB, figures


def _elapsed(attempt: dict) -> float:
    from datetime import datetime

    started = datetime.fromisoformat(attempt["started_at"])
    ended = datetime.fromisoformat(attempt["ended_at"])
    return (ended - started).total_seconds()


def _running_unit(vm_host: VmHost, run_id: str) -> str:
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        shown = vm_host.show(run_id)
        if shown["attempts"] and vm_host.prop(shown["attempts"][0]["unit"], "ActiveState") == "active":
            return shown["attempts"][0]["unit"]
        time.sleep(1)
    pytest.fail(f"run {run_id} did not start: {vm_host.show(run_id)}")
