"""The run sandbox under a real systemd: the exposure score of a live run's unit, commands that a
batch job runs still working inside it, --private-network, and a root run without capabilities."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
from collections.abc import Iterator

from tests.conftest import _unavailable
from tests.harness.host import Host, wait_for

# The goal of issue 11: a run's unit rates 3.0 or lower with the network allowed (8.1 before).
EXPOSURE_GOAL = 3.0


def exposure(host: Host, unit: str) -> float:
    out = host.tb.run("systemd-analyze", "security", "--no-pager", unit, timeout=120).stdout
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
    assert match, out
    return float(match.group(1))


def output(host: Host, run_id: str, last: str) -> list[str]:
    """The run's lines in the journal, once the line it ends with has arrived (journald may lag)."""
    def lines() -> list[str] | None:
        out = host.tb.run("journalctl", f"UNITVISOR_RUN={run_id}", "--no-pager", "-o", "cat", check=False).stdout
        found = out.splitlines()
        return found if last in found else None
    return wait_for(lines, what=f"the output of run {run_id}")


def only_attempt(data: dict) -> dict:
    [attempt] = data["attempts"]
    return attempt


def test_a_live_run_with_the_defaults_rates_at_most_3(host: Host) -> None:
    host.start()
    run_id = host.submit("--", *host.gated("sandbox-score"))
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: host.show(run_id)["state"] == "running", what="the run to be running")
    score = exposure(host, unit)
    print(f"systemd-analyze security {unit}: {score}")
    assert score <= EXPOSURE_GOAL
    props = host.unit_props(unit, "PrivateNetwork", "CapabilityBoundingSet", "SystemCallErrorNumber", "UMask")
    assert props == {"PrivateNetwork": "no", "CapabilityBoundingSet": "", "SystemCallErrorNumber": "1",
                     "UMask": "0077"}
    host.open_gate("sandbox-score")
    assert host.wait_run(run_id)["state"] == "succeeded"


# What a batch command does: write files in its working directory and /tmp, resolve localhost and
# talk TCP over it, fork children and threads, run a shell pipeline. Each step prints its result.
BATCH_JOB = r"""
import os, socket, subprocess, sys, threading
with open("in-workdir.txt", "w") as f:
    f.write("x")
with open("/tmp/in-tmp.txt", "w") as f:
    f.write("y")
print("mode", oct(os.stat("in-workdir.txt").st_mode & 0o777))
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
child = os.fork()
if child == 0:
    conn, _ = server.accept()
    conn.sendall(conn.recv(16).upper())
    os._exit(0)
family, kind, proto, _, address = socket.getaddrinfo("localhost", port, socket.AF_INET, socket.SOCK_STREAM)[0]
with socket.socket(family, kind, proto) as client:
    client.connect(address)
    client.sendall(b"ping")
    print("tcp", client.recv(16).decode())
print("child exit", os.waitpid(child, 0)[1])
results = []
threads = [threading.Thread(target=lambda: results.append(1)) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("threads", len(results))
print("shell", subprocess.run("ls /tmp | sort | tr a-z A-Z | head -n 5", shell=True, capture_output=True,
                             text=True, check=True).stdout.split())
print("done")
"""


def test_a_batch_command_works_inside_the_sandbox(host: Host) -> None:
    host.start()
    run_id = host.submit("--workdir", "/tmp", "--", "/usr/bin/python3", "-c", BATCH_JOB)
    data = host.wait_run(run_id)
    lines = output(host, run_id, "done")
    assert data["state"] == "succeeded", (data, lines)
    assert lines == ["mode 0o600", "tcp PING", "child exit 0", "threads 4", "shell ['IN-TMP.TXT', 'IN-WORKDIR.TXT']",
                     "done"]


def non_loopback_address() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                         check=False).stdout
    addresses = re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", out)
    if not addresses:
        _unavailable("this machine has no non-loopback IPv4 address to connect to")
    return addresses[0]


@contextlib.contextmanager
def listener() -> Iterator[tuple[str, int]]:
    """A TCP port on the machine's own non-loopback address; the test bed shares its network."""
    with socket.create_server((non_loopback_address(), 0), backlog=16) as server:
        yield server.getsockname()[:2]


def reach(address: str, port: int) -> list[str]:
    """A command that exits 0 when it reaches address:port over TCP, 3 when it cannot."""
    script = (f"import socket, sys\ntry:\n    socket.create_connection(({address!r}, {port}), timeout=10).close()\n"
              f"except OSError as exc:\n    print('unreachable:', exc)\n    sys.exit(3)\nprint('reached')\n")
    return ["/usr/bin/python3", "-c", script]


def test_a_private_network_run_cannot_reach_the_host_a_default_run_can(host: Host) -> None:
    host.start()
    with listener() as (address, port):
        networked = host.submit("--", *reach(address, port))
        networkless = host.submit("--private-network", "--", *reach(address, port))
        assert host.wait_run(networked)["state"] == "succeeded"
        attempt = only_attempt(host.wait_run(networkless))
        assert (attempt["outcome"], attempt["exit_status"]) == ("exit-code", "exit:3")
        assert output(host, networkless, "unreachable: [Errno 101] Network is unreachable")
        # A host default of true takes the network from every run, also one that did not ask.
        host.stop()
        host.configure(runs_extra="private_network = true")
        host.start()
        hostwide = host.submit("--", *reach(address, port))
        attempt = only_attempt(host.wait_run(hostwide))
        assert (attempt["outcome"], attempt["exit_status"]) == ("exit-code", "exit:3")


def test_a_root_run_has_an_empty_capability_set(host: Host) -> None:
    host.configure(runs_extra='allowed_users = ["root"]')
    host.start()
    run_id = host.submit("--user", "root", "--", "/bin/sh", "-c",
                         "id -u; grep -E '^Cap(Bnd|Eff|Prm|Amb):' /proc/self/status; echo done")
    data = host.wait_run(run_id)
    lines = output(host, run_id, "done")
    assert data["state"] == "succeeded", (data, lines)
    assert lines[0] == "0"
    caps = dict(line.split(":\t") for line in lines[1:-1])
    assert caps == {"CapBnd": "0000000000000000", "CapEff": "0000000000000000", "CapPrm": "0000000000000000",
                    "CapAmb": "0000000000000000"}


def test_a_refused_system_call_fails_with_eperm_instead_of_killing(host: Host) -> None:
    # ptrace(PTRACE_TRACEME) succeeds for any unprivileged process; @system-service leaves it out
    # (@debug), so inside the sandbox it is refused, and fails rather than killing with SIGSYS.
    host.start()
    script = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "rc = libc.ptrace(0, 0, None, None)\nprint('rc', rc, os.strerror(ctypes.get_errno()))\n")
    run_id = host.submit("--", "/usr/bin/python3", "-c", script)
    data = host.wait_run(run_id)
    assert data["state"] == "succeeded", data
    assert output(host, run_id, "rc -1 Operation not permitted")


# What a run as root tried in issue 21, each step printing how it ended: PID 1's private socket and the
# system bus (either one gave it a transient unit as root with every capability and no sandbox), the
# host's DSN, and a drop-in under /run/systemd/system (run as full root at the next daemon-reload).
ROOT_ESCAPES = r"""
import errno, os, socket, subprocess
def outcome(step):
    try:
        step()
        return "done"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
def connect(path):
    def step():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
    return step
def write(path):
    def step():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("[Service]\nExecStartPre=/bin/touch /etc/escaped\n")
    return step
def read(path):
    return lambda: open(path).read()
print("uid", os.getuid())
print("private", outcome(connect("/run/systemd/private")))
print("bus", outcome(connect("/run/dbus/system_bus_socket")))
print("var-bus", outcome(connect("/var/run/dbus/system_bus_socket")))
busctl = subprocess.run(["busctl", "--system", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                         "org.freedesktop.DBus.Peer", "Ping"], capture_output=True, text=True)
print("busctl", busctl.returncode)
print("dsn", outcome(read("/etc/unitvisor/dsn")))
print("drop-in", outcome(write("/run/systemd/system/unitvisor.service.d/escape.conf")))
print("run", outcome(write("/run/escape")))
print("done")
"""


def test_a_root_run_cannot_reach_pid_1_the_bus_the_dsn_or_a_writable_run(host: Host) -> None:
    host.configure(runs_extra='allowed_users = ["root"]')
    host.start()
    run_id = host.submit("--user", "root", "--", "/usr/bin/python3", "-c", ROOT_ESCAPES)
    data = host.wait_run(run_id)
    lines = output(host, run_id, "done")
    assert data["state"] == "succeeded", (data, lines)
    results = dict(line.split(" ", 1) for line in lines[:-1])
    assert results.pop("uid") == "0"
    assert int(results.pop("busctl")) != 0
    # EACCES: an inaccessible node over the socket or file; EROFS: /run read-only. Never "done".
    assert results == {"private": "EACCES", "bus": "EACCES", "var-bus": "EACCES", "dsn": "EACCES",
                       "drop-in": "EROFS", "run": "EROFS"}
    assert host.tb.run("test", "-e", "/run/systemd/system/unitvisor.service.d/escape.conf", check=False).returncode
    assert host.dsn not in "\n".join(lines)
