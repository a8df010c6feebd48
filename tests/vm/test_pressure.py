"""Admission by pressure, seen to act on a real kernel (a Debian 13 guest, cgroup v2, PSI on): a memory
hog in unitvisor.slice makes the slice stall, the daemon stops claiming (with the defaults, [host]
pressure_stop_at = 40), queued runs wait and say why, and the host claims them once the hog has ended.

The hog is a unit of its own in the slice (systemd-run --slice), not a run: MemoryHigh= throttles it
(the kernel makes it sleep in reclaim, counted as memory stall) without ever killing it, so the
pressure lasts as long as the test wants. Times are read from the guest's own clocks (the hog unit's
monotonic timestamps and the daemon's journal), never from this machine's, whose load under software
emulation says nothing of the daemon. Printed for docs/benchmarks.md (Admission by pressure).

Without admission by pressure the runs would be claimed while the hog runs, and the test fails."""

from __future__ import annotations

import json
import time

from tests.vm.conftest import SERVICE, VmHost

PY = "/usr/bin/python3"
HOG_UNIT = "uv-pressure-hog.service"
# Allocates past its MemoryHigh= and then keeps replacing its oldest MiB: every new page is charged
# over the limit, so the kernel keeps throttling it (memory stall) for as long as it runs.
HOG = ("import sys\n"
       "blocks = [b'x' * (1 << 20) for _ in range(int(sys.argv[1]))]\n"
       "while True:\n"
       "    blocks.pop(0); blocks.append(b'y' * (1 << 20))\n")
# Generous bounds: under TCG a guest second is slow and the machine is shared. avg10 crosses 40% about
# 5 s into a full stall, and the daemon reads every 2 s.
STOP_WITHIN = 30.0
RESUME_WITHIN = 60.0


def journal_events(host: VmHost, name: str, since_usec: int) -> list[tuple[int, str]]:
    """(monotonic µs, message) of the daemon's `name` events since a monotonic time of this boot."""
    out = host.run("journalctl", "-u", SERVICE, "-o", "json", "--output-fields=MESSAGE,__MONOTONIC_TIMESTAMP",
                   "--no-pager").stdout
    found = []
    for line in out.splitlines():
        entry = json.loads(line)
        message, at = entry.get("MESSAGE"), int(entry["__MONOTONIC_TIMESTAMP"])
        if isinstance(message, str) and message.startswith(name + " ") and at >= since_usec:
            found.append((at, message))
    return found


def hosts_pressure(host: VmHost) -> dict:
    return json.loads(host.unitvisor("hosts", "--json").stdout)[0]["pressure"] or {}


def wait_for(what: str, check, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.5)


def test_a_memory_hog_stops_the_claims_until_it_ends(vm_host: VmHost) -> None:
    wait_for("the host reports open", lambda: hosts_pressure(vm_host).get("state") == "open", 120)
    vm_host.run("systemd-run", "--unit", HOG_UNIT, "--slice", "unitvisor.slice", "-p", "MemoryHigh=32M",
                "-p", "MemorySwapMax=0", "--", PY, "-c", HOG, "96")
    try:
        hog_started = int(vm_host.prop(HOG_UNIT, "ActiveEnterTimestampMonotonic"))
        wait_for("the host reports stopped", lambda: hosts_pressure(vm_host).get("state") == "stopped", 180)
        stopped = journal_events(vm_host, "admission", hog_started)
        stopped_at = next(at for at, message in stopped if "state=stopped" in message)
        # Said in systemctl status and the metrics as well.
        assert "claiming nothing" in vm_host.prop(SERVICE, "StatusText")
        metrics = vm_host.run(PY, "-c", "import urllib.request; print(urllib.request.urlopen("
                              "'http://127.0.0.1:9863/metrics').read().decode())").stdout
        assert 'unitvisor_admission{state="stopped"} 1.0' in metrics, metrics
        assert 'unitvisor_slice_pressure_ratio{resource="memory"}' in metrics

        runs = [vm_host.submit("--", PY, "-c", "pass") for _ in range(2)]
        # Two poll intervals after they became due, the fleet's upkeep records why they wait.
        reason = wait_for("the wait reason", lambda: vm_host.show(runs[0]).get("wait_reason"), 120)
        assert "claims nothing under memory pressure (vm-1)" in str(reason), reason
        for run_id in runs:
            shown = vm_host.show(run_id)
            assert shown["state"] == "queued" and shown["attempts"] == [], shown
        assert hosts_pressure(vm_host)["state"] == "stopped"  # the hog still stalls the slice
    finally:
        vm_host.run("systemctl", "stop", HOG_UNIT, check=False)
    hog_ended = int(vm_host.prop(HOG_UNIT, "InactiveEnterTimestampMonotonic") or 0)
    if not hog_ended:  # a unit that ended is collected at once: its stop was just now
        hog_ended = int(float(vm_host.run("cat", "/proc/uptime").stdout.split()[0]) * 1e6)
    for run_id in runs:
        assert vm_host.wait_ended(run_id, timeout=240)["state"] == "succeeded"
    resumed_at = next(at for at, message in journal_events(vm_host, "admission", hog_ended)
                      if "state=stopped" not in message)
    claims = [at for at, message in journal_events(vm_host, "claimed", hog_started)
              if any(f"run={run_id}" in message for run_id in runs)]
    assert len(claims) == 2 and min(claims) >= hog_ended, (claims, hog_ended)
    figures = {"stop": (stopped_at - hog_started) / 1e6, "resume": (resumed_at - hog_ended) / 1e6,
               "claim": (min(claims) - hog_ended) / 1e6}
    print(f"\nadmission by pressure (guest seconds): stopped {figures['stop']:.1f} s after the hog started; "
          f"open again {figures['resume']:.1f} s after it ended; first queued run claimed "
          f"{figures['claim']:.1f} s after it ended")
    assert figures["stop"] <= STOP_WITHIN, figures
    assert figures["resume"] <= RESUME_WITHIN and figures["claim"] <= RESUME_WITHIN, figures
    assert hosts_pressure(vm_host)["state"] in ("open", "slowed")
