"""The accounting's peak tasks and the memory_high throttle, on a real cgroup-v2 kernel (the Debian 13
guest): each through `unitvisor submit` and what unitvisor recorded. Both would fail without the
feature: tasks_peak would be NULL (systemd keeps no task figure of an ended unit, and the cgroup's
pids.peak is gone with it), and without MemoryHigh= the kernel never counts a `high` event."""

from __future__ import annotations

from tests.vm.conftest import VmHost
from tests.vm.test_limits import PY, attempt

MiB = 1 << 20

# Forks N children that each sleep 2 s (so that all are alive together), waits for them, exits 0.
FORK_N = ("import os, sys, time\n"
          "n = int(sys.argv[1]); kids = []\n"
          "for _ in range(n):\n"
          "    pid = os.fork()\n"
          "    if pid == 0:\n"
          "        time.sleep(2); os._exit(0)\n"
          "    kids.append(pid)\n"
          "for pid in kids: os.waitpid(pid, 0)\n"
          "print('forked', n, flush=True)")
# Writes N MiB to a file (page cache the kernel charges to the run's cgroup and can reclaim), written back
# every 8 MiB so that the pages are clean and reclaim needs no IO of its own, then prints its own
# cgroup's memory.events `high` count, read while the cgroup still exists.
WRITE_N = ("import os, sys\n"
           "with open('/var/tmp/memory-high-test', 'wb') as f:\n"
           "    for i in range(int(sys.argv[1])):\n"
           "        f.write(b'x' * (1 << 20))\n"
           "        if i % 8 == 7: f.flush(); os.fsync(f.fileno())\n"
           "cg = open('/proc/self/cgroup').read().strip().split('::')[-1]\n"
           "events = dict(line.split() for line in open('/sys/fs/cgroup' + cg + '/memory.events'))\n"
           "print('high events', events['high'], flush=True)")


def test_a_run_records_its_peak_number_of_tasks(vm_host: VmHost) -> None:
    """20 children alive at once, and the Python process: 21 tasks. Tolerance: 21 to 23 (the kernel
    counts every task of the cgroup, and the unit's own stop command, one more, runs after the run's
    processes are gone; nothing else runs in the cgroup)."""
    run_id = vm_host.submit("--", PY, "-c", FORK_N, "20")
    ended = attempt(vm_host.wait_ended(run_id))
    assert ended["outcome"] == "success", ended
    peak = ended["accounting"]["tasks_peak"]
    assert peak is not None and 21 <= peak <= 23, ended["accounting"]
    # systemd 257 on cgroup v2 knows every figure: none is explained away.
    assert ended["not_measured"] == {}, ended
    # The unit's file was read into the outcome and removed.
    left = vm_host.run("ls", "-A", "/run/unitvisor/tasks-peak").stdout.split()
    assert ended["unit"] not in left, left
    text = vm_host.unitvisor("show", run_id).stdout
    assert "tasks at most" in text and "not measured" not in text, text


def test_memory_high_throttles_a_run_without_killing_it(vm_host: VmHost) -> None:
    """64 MiB written under `--memory-high 32M`: the kernel reclaims the run's page cache each time it
    goes over (memory.events `high` > 0) and keeps its peak near the throttle (at most 56 MiB, where
    the same writes without it leave their 64 MiB of cache charged, and the interpreter's own memory
    besides), and the run ends as a success."""
    run_id = vm_host.submit("--memory-high", "32M", "--memory", "256M", "--", PY, "-c", WRITE_N, "64")
    shown = vm_host.wait_ended(run_id, tail=True)
    ended = attempt(shown)
    assert ended["outcome"] == "success" and shown["state"] == "succeeded", ended
    assert shown["limits"]["memory_high"] == 32 * MiB, shown["limits"]
    lines = [line for line in (ended["output_tail"] or "").splitlines() if line.startswith("high events ")]
    assert lines and int(lines[-1].split()[-1]) > 0, ended
    assert ended["accounting"]["memory_peak_bytes"] <= 56 * MiB, ended["accounting"]
    assert "memory-high=32M" in vm_host.unitvisor("show", run_id).stdout
