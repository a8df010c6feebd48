"""A real cgroup-v2 host for the VM tier: a throwaway Debian 13 (trixie) guest under qemu.

The test beds of the system level are containers on a cgroup-v1 machine: systemd records a unit's
limits there but the kernel enforces none, and the accounting reads NULL. What needs a real kernel
(a memory limit killing a run, CPU quota, a task limit, IO weight, accounting) is tested here, in a
guest whose PID 1 is trixie's systemd on trixie's kernel, with cgroup v2 (shared/TESTBED.md, "A
real cgroup-v2 host", has the recipe and its measured costs).

- The image (kernel, initramfs and a read-only qcow2 base) is built with debootstrap from the mirror
  apt uses and cached under CACHE, named after a hash of its recipe: a change of suite, packages or
  RECIPE builds a new one. It holds PostgreSQL and every dependency of the .deb, so the guest needs
  no network: it has no network card at all (`-nodefaults`), and PostgreSQL's traffic stays inside it.
- Each boot writes to its own qcow2 overlay in a temporary directory; the base is never written.
- The guest is driven through the qemu guest agent on a unix socket (guest-exec, guest-file-*), no
  login and no network: `Guest.run()` is the one way in.
- Software emulation (TCG): KVM is present on these machines but a guest hangs at boot there.
  Everything in the guest is slow (a fork+exec about 40 ms, `systemctl` about 200 ms), so tests
  share one boot and assert what the kernel measured, never a wall-clock speed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The clean room's helpers: a build directory removed only once nothing is mounted inside it, and one
# build at a time.
from tests.harness import rootfs
from tests.harness.cleanroom import CACHE, _discard, built_once
from tests.harness.commands import run

SUITE = "trixie"
# debootstrap's own set: systemd as PID 1, the bus, udev (the agent's virtio port is a device unit).
INCLUDE = ("systemd", "systemd-sysv", "dbus", "udev", "kmod", "iproute2", "procps", "ca-certificates")
# Installed in a chroot after debootstrap: the kernel and its initramfs, the agent, PostgreSQL, and
# every dependency of the .deb (debian/control), so that `dpkg -i` in the guest needs no network.
PACKAGES = (
    "linux-image-amd64", "initramfs-tools", "zstd", "qemu-guest-agent", "postgresql", "python3",
    "python3-psycopg", "python3-pystemd", "python3-sdnotify", "python3-click", "python3-prometheus-client",
    "python3-psycopg-c",  # the package's Recommends, which apt installs with it on trixie
)
RECIPE = 1  # bump when _build() changes, so that an old image is not reused (rootfs.RECIPE: its shared steps)
# Not wanted in a test guest: logins on the consoles, and timers that would do maintenance mid-test.
MASKED = (
    "getty@tty1.service", "serial-getty@ttyS0.service", "console-getty.service", "apt-daily.timer",
    "apt-daily-upgrade.timer", "man-db.timer", "e2scrub_all.timer", "systemd-tmpfiles-clean.timer",
    "dpkg-db-backup.timer", "fstrim.timer", "systemd-timesyncd.service",
)
IMAGE_SIZE = "4G"


class VmError(RuntimeError):
    pass


class GuestGone(VmError):
    """qemu ended (or closed the agent's socket) while the guest was in use: the guest rebooted or
    panicked (-no-reboot and panic=-1 make either end qemu), or qemu itself was killed. The message
    carries qemu's exit status, its stderr and the tail of the guest's console, which say which."""


def available() -> str | None:
    """None when a guest can be booted here, else the reason why not."""
    if os.geteuid() != 0:
        return "the VM tier needs root (debootstrap, chroot)"
    for tool, package in (("debootstrap", "debootstrap"), ("qemu-system-x86_64", "qemu-system-x86"),
                          ("qemu-img", "qemu-utils"), ("mkfs.ext4", "e2fsprogs")):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install {package})"
    return None


def image_dir() -> Path:
    key = json.dumps([RECIPE, *rootfs.key(SUITE, INCLUDE, PACKAGES), sorted(MASKED)])
    return CACHE / f"vm-{SUITE}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_image(log: Callable[[str], None] = print) -> Path:
    """The cached image directory (vmlinuz, initrd.img, base.qcow2), built first if it is missing.
    Safe from several test sessions at once (one builds, the others wait for it)."""
    path = image_dir()
    built_once(path / "base.qcow2", ".vm-lock", f"the VM image {path}", lambda: _build(path), log)
    return path


def _build(path: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="uv-vm-build-", dir=CACHE))
    root = work / "root"
    out = work / "out"
    out.mkdir()
    try:
        rootfs.bootstrap(root, SUITE, PACKAGES, include=INCLUDE, then=[["systemctl", "mask", *MASKED]])
        (root / "usr/sbin/policy-rc.d").unlink()
        (root / "etc/hostname").write_text("uv-vm\n")
        # Empty: systemd makes a fresh machine id at each first boot, so no two guests share one.
        (root / "etc/machine-id").write_text("")
        # The root file system is /dev/vda itself, mounted rw by the kernel's command line.
        (root / "etc/fstab").write_text("/dev/vda / ext4 rw,relatime 0 1\n")
        # A persistent journal, as a real host (and the README) has it.
        (root / "var/log/journal").mkdir(parents=True, exist_ok=True)
        shutil.copy(_newest(root / "boot", "vmlinuz-*"), out / "vmlinuz")
        shutil.copy(_newest(root / "boot", "initrd.img-*"), out / "initrd.img")
        raw = work / "base.raw"
        run(["truncate", "-s", IMAGE_SIZE, str(raw)], timeout=60)
        run(["mkfs.ext4", "-q", "-F", "-d", str(root), str(raw)], timeout=600)
        run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(out / "base.qcow2")], timeout=600)
        (out / "base.qcow2").chmod(0o444)
        if path.exists():
            shutil.rmtree(path)
        out.rename(path)
    finally:
        _discard(work)


def _newest(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    if not found:
        raise VmError(f"no {pattern} in {directory}: the kernel package did not install")
    return found[-1]


class Result:
    """What a command in the guest did: its exit status and both outputs, as text."""

    def __init__(self, cmd: tuple[str, ...], returncode: int, stdout: str, stderr: str) -> None:
        self.cmd = cmd
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr

    def __repr__(self) -> str:
        return f"Result({' '.join(self.cmd)!r} -> {self.returncode}, {self.stdout[-500:]!r}, {self.stderr[-500:]!r})"


class Guest:
    """One booted guest. `with Guest() as guest:` boots it and powers it off (and removes its overlay)
    however the block ends."""

    def __init__(self, memory_mb: int = 2048, cpus: int = 2) -> None:
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="uv-vm-"))
        self.console = self.dir / "console.log"
        self._qemu: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._buffer = b""

    def __enter__(self) -> Guest:
        try:
            self.boot()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def boot(self, timeout: float = 600) -> None:
        image = ensure_image()
        overlay = self.dir / "overlay.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(image / "base.qcow2"),
             str(overlay)], timeout=60)
        agent = self.dir / "qga.sock"
        cmd = [
            "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(self.cpus),
            "-m", str(self.memory_mb), "-no-reboot",
            # -nodefaults: no network card (qemu would otherwise add one on unrestricted user
            # networking), no display; the guest needs no network, its PostgreSQL is inside it.
            "-nodefaults", "-no-user-config", "-display", "none", "-serial", f"file:{self.console}",
            "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.img"),
            "-append", "root=/dev/vda rw console=ttyS0 panic=-1 quiet",
            "-drive", f"file={overlay},if=virtio,format=qcow2,cache=unsafe",
            "-device", "virtio-rng-pci",
            "-chardev", f"socket,id=qga0,path={agent},server=on,wait=off",
            "-device", "virtio-serial-pci", "-device", "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
        ]
        self._qemu = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=open(self.dir / "qemu.err", "wb"), start_new_session=True)
        deadline = time.monotonic() + timeout
        while not agent.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise VmError("qemu made no agent socket")
            time.sleep(0.1)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(agent))
        # The agent starts late in the boot; until then the socket takes bytes and answers nothing.
        while True:
            self._check_alive()
            if time.monotonic() > deadline:
                raise VmError(f"the guest agent did not answer within {timeout:.0f}s:\n{self.console_tail()}")
            with contextlib.suppress(TimeoutError, VmError):
                self._sync(timeout=5)
                break
        state = self.run("systemctl", "is-system-running", "--wait", timeout=max(deadline - time.monotonic(), 30),
                         check=False)
        if state.stdout.strip() not in ("running", "degraded"):
            raise VmError(f"the guest did not boot: {state!r}")

    def _check_alive(self) -> None:
        if self._qemu is not None and self._qemu.poll() is not None:
            raise self._gone(f"qemu exited {self._qemu.returncode}")

    def _gone(self, what: str) -> GuestGone:
        """Why the guest is gone, once qemu has had a few seconds to exit (a socket can break just
        before the process ends)."""
        if self._qemu is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._qemu.wait(timeout=10)
            code = self._qemu.poll()
            what += f"; qemu {'runs still' if code is None else f'exited {code}'}"
        with contextlib.suppress(OSError):
            what += f"\nqemu's stderr: {(self.dir / 'qemu.err').read_text(errors='replace')[-2000:]}"
        return GuestGone(f"{what}\nthe guest's console, last lines:\n{self.console_tail()}")

    def console_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-lines:])
        return ""

    # -- the agent's protocol: one JSON object a line each way -------------------------------------

    def _sync(self, timeout: float) -> None:
        token = int.from_bytes(os.urandom(4), "big")
        assert self._sock is not None
        self._sock.settimeout(timeout)
        # 0xFF first: the agent drops whatever half-read request it holds (its protocol's reset).
        self._sock.sendall(b"\xff" + json.dumps({"execute": "guest-sync-delimited", "arguments": {"id": token}})
                           .encode() + b"\n")
        end = time.monotonic() + timeout
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            reply = self._read_reply(remaining)
            if reply.get("return") == token:
                return

    def _read_reply(self, timeout: float) -> dict:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self._sock.recv(65536)
            except ConnectionError as error:
                raise self._gone(f"the agent's socket broke: {error}") from error
            if not chunk:
                raise self._gone("qemu closed the agent's socket")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        line = line.lstrip(b"\xff").strip()
        if not line:
            return {}
        return json.loads(line)

    def _call(self, command: str, timeout: float = 30, **arguments: object) -> object:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        message = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        try:
            self._sock.sendall(json.dumps(message).encode() + b"\n")
        except ConnectionError as error:
            raise self._gone(f"the agent's socket broke: {error}") from error
        end = time.monotonic() + timeout
        while True:
            reply = self._read_reply(max(end - time.monotonic(), 0.1))
            if "error" in reply:
                raise VmError(f"{command}: {reply['error']}")
            if "return" in reply:
                return reply["return"]

    # -- what tests use ----------------------------------------------------------------------------

    def run(self, *cmd: str, timeout: float = 120, check: bool = True, input: str | None = None) -> Result:
        """Run a command in the guest as root and wait for it (output captured, as text)."""
        args: dict[str, object] = {"path": cmd[0], "arg": list(cmd[1:]), "capture-output": True,
                                   "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]}
        if input is not None:
            args["input-data"] = base64.b64encode(input.encode()).decode()
        pid = self._call("guest-exec", **args)["pid"]  # type: ignore[index]
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            status = self._call("guest-exec-status", pid=pid)
            if status["exited"]:  # type: ignore[index]
                break
            if time.monotonic() > deadline:
                raise VmError(f"{' '.join(cmd)} did not end within {timeout:.0f}s in the guest")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        out = base64.b64decode(status.get("out-data", "")).decode(errors="replace")  # type: ignore[union-attr]
        err = base64.b64decode(status.get("err-data", "")).decode(errors="replace")  # type: ignore[union-attr]
        code = status.get("exitcode", 128 + status.get("signal", 0))  # type: ignore[union-attr]
        result = Result(cmd, code, out, err)
        if check and code != 0:
            raise VmError(f"in the guest: {result!r}")
        return result

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file in the guest (through the agent: no network, no shared folder)."""
        handle = self._call("guest-file-open", path=path, mode="w")
        try:
            for start in range(0, len(data), 1 << 20):
                self._call("guest-file-write", handle=handle,
                           **{"buf-b64": base64.b64encode(data[start:start + (1 << 20)]).decode()}, timeout=120)
        finally:
            self._call("guest-file-close", handle=handle)
        self.run("chmod", f"{mode:o}", path)

    def destroy(self) -> None:
        """Power the guest off (the agent first, then qemu itself) and remove its overlay."""
        if self._qemu is not None and self._qemu.poll() is None:
            with contextlib.suppress(Exception):
                if self._sock is not None:
                    self._sock.settimeout(5)
                    self._sock.sendall(json.dumps({"execute": "guest-shutdown"}).encode() + b"\n")
            try:
                self._qemu.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._qemu.kill()
                self._qemu.wait(timeout=30)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        shutil.rmtree(self.dir, ignore_errors=True)
