"""What differs between systemd 252 (Debian 12, the system tier's test beds) and 257 (Debian 13, this
guest), where unitvisor depends on it, checked on 257 here as the system tier checks it on 252:

- the adapter (supervisor/systemd.py) against trixie's PID 1 and python3-pystemd 0.13: its D-Bus
  error mapping (NoSuchUnit, UnitExists, a refused property) and MemoryPeak, which 252 answers with
  UnknownProperty (tests/unit/test_systemd_mapping.py has that answer as pystemd 0.11 raised it, and
  tests/system/test_outcome_record.py sees NULL on 252);
- a root run's confinement (unitspec.root_confinement), which tests/system/test_sandbox.py checks on
  252: PID 1's private socket, the bus, the DSN and a read-only /run on 257 too, and PID 1's Varlink
  socket (/run/systemd/io.systemd.Manager) where this systemd has one (Debian's 257.13 was first seen
  without it at that path: the test says which sockets the guest has).
"""

from __future__ import annotations

import json
import time

from supervisor.unitspec import ROOT_RUN_VARLINK
from tests.system.test_sandbox import ROOT_ESCAPES
from tests.vm.conftest import CONFIG, SERVICE, VmHost

PY = "/usr/bin/python3"

# The package's own modules, as the daemon imports them (debian/rules: /usr/share/unitvisor), on
# trixie's python3 and python3-pystemd. Each step prints what the adapter made of PID 1's answer.
ADAPTER = r"""
import json, sys, time
sys.path.insert(0, "/usr/share/unitvisor")
from supervisor import systemd as sd
s = sd.Systemd()
found = {}
missing = "uv-probe-missing.service"
found["state of a missing unit"] = s.state(missing)
found["stop of a missing unit"] = s.stop(missing)
found["ref of a missing unit"] = s.ref(missing)
name = "uv-probe-peak.service"
exec_start = [(PY.encode(), [PY.encode(), b"-c", b"b = b'x' * (48 << 20)"], [])]
props = {b"Description": b"unitvisor probe", b"Type": b"exec", b"ExecStartEx": exec_start, b"AddRef": True,
         b"MemoryAccounting": True, b"CPUAccounting": True, b"RemainAfterExit": False}
found["started"] = s.start_transient(name, props)
found["started again"] = s.start_transient(name, props)
deadline = time.monotonic() + 120
while not (state := s.state(name)).has_ended:
    assert time.monotonic() < deadline, state
    time.sleep(0.2)
found["result"] = state.result
found["memory peak"] = state.accounting.memory_peak_bytes
found["cpu"] = state.accounting.cpu_usage_nsec
found["unknown properties"] = sorted(p.decode() for p in s._unknown)
try:
    s.start_transient("uv-probe-refused.service", {**props, b"Type": b"no-such-type"})
    found["refused"] = None
except sd.SystemdError as exc:
    found["refused"] = type(exc).__name__
found["unref"] = s.unref(name)
deadline = time.monotonic() + 30
while s.state(name) is not None and time.monotonic() < deadline:
    time.sleep(0.2)
found["state after unref"] = s.state(name)
print(json.dumps(found))
""".replace("PY.encode()", repr(PY.encode()))


def test_the_adapter_reads_systemd_257_as_it_reads_252(vm_host: VmHost) -> None:
    result = vm_host.run(PY, "-c", ADAPTER, timeout=300)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # MemoryPeak is a property here (UnknownProperty on 252, remembered as such): asked and measured.
    assert found.pop("unknown properties") == [], found
    peak = found.pop("memory peak")
    assert peak is not None and peak >= 48 << 20, (peak, found)
    assert found.pop("cpu") > 0, found
    assert found == {
        "state of a missing unit": None,  # NoSuchUnit
        "stop of a missing unit": False,  # NoSuchUnit from StopUnit: nothing to stop
        "ref of a missing unit": False,
        "started": True,
        "started again": False,  # UnitExists: adoption, never a second start
        "result": "success",
        "refused": "UnitRefused",  # InvalidArgs: PID 1 said no, the bus is fine
        "unref": True,
        "state after unref": None,  # collected once no one holds it
    }


def _restart_with(vm_host: VmHost, config: str) -> None:
    vm_host.guest.write("/etc/unitvisor/unitvisor.toml", config.encode(), mode=0o644)
    vm_host.run("systemctl", "restart", SERVICE, timeout=300)
    deadline = time.monotonic() + 180
    while "waiting" in vm_host.prop(SERVICE, "StatusText") or vm_host.prop(SERVICE, "ActiveState") != "active":
        assert time.monotonic() < deadline, vm_host.prop(SERVICE, "StatusText")
        time.sleep(1)


# ROOT_ESCAPES (the system tier's), PID 1's Varlink socket, which systemd 257 may listen on beside its
# private D-Bus socket (root_confinement keeps it out where it exists), the other sockets that act for
# user id 0 (unitspec.ROOT_RUN_VARLINK: kept out where they exist), and, to be seen, not judged here,
# udev's Varlink socket (see the test).
ROOT_ESCAPES_257 = ROOT_ESCAPES.replace(
    'print("done")',
    'print("varlink", outcome(connect("/run/systemd/io.systemd.Manager")))\n'
    + "".join(f'print("kept-out:{path}", outcome(connect("{path}")))\n' for path in ROOT_RUN_VARLINK)
    + 'print("udev-varlink", outcome(connect("/run/udev/io.systemd.udev")))\n'
    'print("done")')


def test_a_root_run_cannot_reach_pid_1_the_bus_the_dsn_or_a_writable_run_on_257(vm_host: VmHost) -> None:
    sockets = vm_host.run("find", "/run/systemd", "/run/udev", "-maxdepth", "2", "-type", "s").stdout.split()
    # Where this PID 1 has no Varlink socket, the confinement's "-" prefix skips it: nothing to reach.
    varlink = "EACCES" if "/run/systemd/io.systemd.Manager" in sockets else "ENOENT"
    # The script prints 19 lines, and the tail also holds systemd's own about the unit: more than the
    # default 20 kept.
    _restart_with(vm_host, CONFIG + 'allowed_users = ["root"]\noutput_tail_lines = 100\n')
    try:
        run_id = vm_host.submit("--user", "root", "--", PY, "-c", ROOT_ESCAPES_257)
        ended = vm_host.wait_ended(run_id, tail=True)
    finally:
        _restart_with(vm_host, CONFIG)
    assert ended["state"] == "succeeded", ended
    # The tail has systemd's own lines about the unit too ("Starting ...", "Consumed ..."): the
    # script's are "step outcome", one each, then "done".
    steps = ("uid", "private", "bus", "var-bus", "busctl", "dsn", "drop-in", "run", "varlink", "udev-varlink", "done")
    lines = [line for line in (ended["attempts"][0]["output_tail"] or "").splitlines()
             if line.split(" ")[0] in steps or line.startswith("kept-out:")]
    assert lines and lines[-1] == "done", ended
    results = dict(line.split(" ", 1) for line in lines[:-1])
    print(f"sockets under /run/systemd and /run/udev: {sockets}; the root run got: {results}")
    assert results.pop("uid") == "0"
    assert int(results.pop("busctl")) != 0
    # udev's Varlink socket: reported above, not asserted (its control socket is kept out, below).
    results.pop("udev-varlink")
    # EACCES: an inaccessible node; EROFS: /run read-only; ENOENT: a socket this guest does not have.
    # "done" would be an escape.
    assert results == {"private": "EACCES", "bus": "EACCES", "var-bus": "EACCES", "dsn": "EACCES",
                       "drop-in": "EROFS", "run": "EROFS", "varlink": varlink,
                       **{f"kept-out:{path}": "EACCES" if path in sockets else "ENOENT" for path in ROOT_RUN_VARLINK},
                       }, (sockets, ended)
    assert vm_host.run("test", "-e", "/run/systemd/system/unitvisor.service.d/escape.conf",
                       check=False).returncode != 0
