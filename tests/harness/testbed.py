"""A real systemd for tests: the host's own OS booted as a throwaway container (systemd-nspawn).

The recipe and its traps are in shared/TESTBED.md. In short: a tmpfs holds the upper layer of an
overlay whose lower layer is `/`, so every write of the container lands in memory and the machine's
disk is never touched; the container gets a machine id of its own; the repository (with its
virtualenv) is bound at the same path inside, so its scripts' absolute paths work there. The network
namespace is shared, so a PostgreSQL on the machine's 127.0.0.1 is reachable from inside.

Never boot systemd against the machine's real root: its boot services would run on the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.harness.postgres import owner_alive

PREFIX = "unitvisor-tb-"
MASKED = (
    "postgresql.service", "getty@tty1.service", "console-getty.service", "apt-daily.timer",
    "apt-daily-upgrade.timer", "man-db.timer", "e2scrub_all.timer", "systemd-tmpfiles-clean.timer",
    # Installed for the metrics tests, which start a Prometheus of their own: the package's service
    # would listen on the machine's shared network (every test bed's, on one port) for nothing.
    "prometheus.service", "prometheus-node-exporter.service",
)


class TestbedError(RuntimeError):
    pass


def available() -> str | None:
    """None when a test bed can be booted here, else the reason why not."""
    if os.geteuid() != 0:
        return "system tests need root (mounts and systemd-nspawn)"
    for tool in ("systemd-nspawn", "nsenter", "systemd-id128"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install systemd-container)"
    return None


def _run(*cmd: str, timeout: float = 60) -> None:
    subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _mounted(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)], check=False).returncode == 0


class Testbed:
    """One booted container. Use as a context manager, or call boot() and destroy()."""

    __test__ = False  # not a test class, whatever pytest makes of its name

    def __init__(self, name: str, binds: list[Path], lower: Path = Path("/"), masked: tuple[str, ...] = MASKED,
                 nspawn_args: list[str] | None = None) -> None:
        """`lower` is the OS tree to boot (default: this machine's own); it is never written to.
        `masked` are the units masked at boot; `nspawn_args` go to systemd-nspawn as they are."""
        if not re.fullmatch(r"[a-z0-9-]{1,40}", name):
            raise ValueError(f"bad test bed name {name!r}")
        self.name = name
        self.binds = binds
        self.lower = lower
        self.masked = masked
        self.nspawn_args = list(nspawn_args or [])
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir="/tmp"))
        self.root = self.dir / "root"
        self.log_path = Path(str(self.dir) + ".log")
        self.owner_path = Path(str(self.dir) + ".owner")
        self.owner_path.write_text(str(os.getpid()))
        self.proc: subprocess.Popen | None = None
        self.leader = 0
        self._layers_ready = False

    def __enter__(self) -> Testbed:
        try:
            self.boot()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # -- lifecycle --------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Mount the layers without booting, so that files can be written before the first boot."""
        if not self._layers_ready:
            self._prepare_layers()

    def _prepare_layers(self) -> None:
        _run("mount", "-t", "tmpfs", "-o", "size=4g,mode=0755", "tmpfs", str(self.dir))
        for sub in ("upper", "work", "root"):
            (self.dir / sub).mkdir()
        _run("mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={self.lower},upperdir={self.dir}/upper,workdir={self.dir}/work", str(self.root))
        machine_id = subprocess.run(["systemd-id128", "new"], check=True, capture_output=True,
                                    text=True).stdout.strip()
        (self.root / "etc/machine-id").write_text(machine_id + "\n")
        self._layers_ready = True

    def boot(self, timeout: float = 60) -> None:
        if self.running:
            # A second nspawn would replace self.proc, and destroy() would then stop only that one: the
            # first container outlived its session, its directory removed, out of cleanup_stale()'s reach.
            raise TestbedError(f"test bed {self.name} is running already: boot() it again after a power cut "
                               "or a reboot, not before")
        if not self._layers_ready:
            self._prepare_layers()
        cmd = ["systemd-nspawn", "-q", "-D", str(self.root), "--register=no", "--keep-unit",
               "-M", self.name]
        cmd += [f"--bind={path}" for path in self.binds]
        cmd += self.nspawn_args
        cmd += ["-b", "--"] + [f"systemd.mask={unit}" for unit in self.masked]
        log = open(self.log_path, "ab")  # the child keeps its own copy of the fd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        self.leader = 0
        while not self.leader:
            if self.proc.poll() is not None:
                raise TestbedError(f"systemd-nspawn exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise TestbedError(f"the container did not start: {self.log_tail()}")
            self.leader = self._find_init()
            time.sleep(0.05)
        while True:
            result = self.run("systemctl", "is-system-running", "--wait", check=False,
                              timeout=max(1.0, deadline - time.monotonic()))
            state = result.stdout.strip()
            if state in ("running", "degraded"):
                return
            if time.monotonic() > deadline:
                raise TestbedError(f"boot did not finish (state {state!r}): {self.log_tail()}")
            time.sleep(0.2)

    def _find_init(self) -> int:
        """The container's PID 1, seen from outside: the nspawn child that runs systemd. (nspawn
        forks short-lived helpers too, so "the first child" is not enough.)"""
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError, ValueError):
            for pid in children.read_text().split():
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return int(pid)
        return 0

    def log_tail(self, lines: int = 20) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def reboot(self, timeout: float = 60) -> None:
        """Reboot the host: transient units vanish, the disk (the tmpfs upper layer) stays."""
        assert self.proc is not None
        self.run("systemctl", "reboot", check=False)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TestbedError("the container did not power off for the reboot") from exc
        self.boot(timeout)

    def power_cut(self, timeout: float = 30) -> None:
        """Pull the plug: SIGKILL to the container's PID 1 (with it the kernel kills every process of
        its PID namespace at once) and to the nspawn process. Nothing is stopped cleanly, no unit runs
        its ExecStop, the journal keeps only what journald had written. The disk (the tmpfs upper layer)
        stays, so boot() again is the host coming back after the outage. (SIGTERM to nspawn, as
        destroy() sends, is a clean power-off instead: systemd stops every unit first.)"""
        if self.proc is None or self.proc.poll() is not None or not self.leader:
            raise TestbedError("the container is not running")
        namespace = _pid_namespace(self.leader)
        _kill_container(self.proc.pid, self.leader)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TestbedError("systemd-nspawn survived SIGKILL") from exc
        self.proc = None
        self.leader = 0
        _wait_until_empty(namespace, timeout, "its power cut")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _stop_container(self) -> None:
        if self.proc is None:
            return
        namespace = _pid_namespace(self.leader) if self.leader else ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # powers the container off cleanly
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # nspawn's child (the container's PID 1) does not die with nspawn: kill both.
                _kill_container(self.proc.pid, self.leader)
                self.proc.wait(timeout=10)
        self.proc = None
        self.leader = 0
        # nspawn may exit while the kernel is still killing what was left in the namespace (its PID 1
        # gone, the rest get SIGKILL and take a moment to exit): wait for them, as power_cut does, so
        # that "no process left" holds when destroy() returns, not a few milliseconds later.
        _wait_until_empty(namespace, 30, "its power-off")

    def destroy(self) -> None:
        """Power off and remove every trace: no process, no mount, no directory left."""
        try:
            self._stop_container()
        finally:
            cleanup_dir(self.dir)
            for path in (self.log_path, self.owner_path):
                with contextlib.suppress(OSError):
                    path.unlink()

    # -- inside -----------------------------------------------------------------------------------

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a command inside the container (all its namespaces)."""
        if not self.leader:
            raise TestbedError("the container is not running")
        prefix = ["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i",
                  "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
        prefix += [f"{key}={value}" for key, value in (env or {}).items()]
        result = subprocess.run(prefix + list(cmd), capture_output=True, text=True, timeout=timeout,
                                input=input, check=False)
        if check and result.returncode != 0:
            raise TestbedError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def write(self, path: str, text: str) -> None:
        """Write a file inside the container (through the overlay's merged view, which it shares)."""
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def cleanup_dir(path: Path) -> None:
    """Unmount and remove one test bed directory; safe to call on a half-built or stale one."""
    root = path / "root"
    for mount in (root, path):
        if _mounted(mount):
            result = subprocess.run(["umount", str(mount)], check=False, capture_output=True)
            if result.returncode != 0:
                subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def _pid_namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _namespace_members(namespace: str) -> list[int]:
    """The live processes of a PID namespace. Zombies do not count: the killed container's PID 1 is
    an orphan once nspawn is dead, and it is for the machine's init to reap it, which may take a while."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _pid_namespace(int(entry.name)) == namespace:
            with contextlib.suppress(OSError, IndexError):
                if Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    pids.append(int(entry.name))
    return pids


def _wait_until_empty(namespace: str, timeout: float, after: str) -> None:
    deadline = time.monotonic() + timeout
    while namespace and _namespace_members(namespace):
        if time.monotonic() > deadline:
            raise TestbedError(f"processes of the container outlived {after}: {_namespace_members(namespace)}")
        time.sleep(0.02)


def _kill_container(nspawn_pid: int, leader: int) -> None:
    """SIGKILL a container's PID 1 and its nspawn process. Killing nspawn alone is not enough: its
    child, the container's systemd, does not die with it (no parent-death signal) and would run on,
    orphaned, with every service in it. The PID 1 is signalled through a pidfd, and only while it is
    still nspawn's child, so that a reused PID is never hit."""
    if leader:
        with contextlib.suppress(OSError):
            pidfd = os.pidfd_open(leader)
            try:
                if _parent(leader) == nspawn_pid:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
    with contextlib.suppress(OSError):
        os.killpg(nspawn_pid, signal.SIGKILL)  # nspawn runs in a session (and group) of its own
    with contextlib.suppress(OSError):
        os.kill(nspawn_pid, signal.SIGKILL)


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _container_inits(path: Path) -> list[int]:
    """PID 1s of containers booted on this test bed directory's overlay, seen from outside, whether
    their nspawn is alive or not: a namespace's init whose root mount is that overlay."""
    signature = f"upperdir={path}/upper,".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            nspid = next(line for line in Path(f"/proc/{entry.name}/status").read_text().splitlines()
                         if line.startswith("NSpid:")).split()[1:]
            if len(nspid) > 1 and nspid[-1] == "1" and signature in Path(f"/proc/{entry.name}/mountinfo").read_bytes():
                pids.append(int(entry.name))
    return pids


def cleanup_stale() -> None:
    """Remove what an interrupted earlier session left behind: its nspawn processes, the containers
    they ran (also those whose nspawn is already gone), and their mounts."""
    for path in Path("/tmp").glob(PREFIX + "*"):
        if owner_alive(Path(str(path).removesuffix(".log").removesuffix(".owner") + ".owner")):
            continue  # another test session's, still running
        if not path.is_dir():
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        root = str(path / "root")
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (pid_dir / "cmdline").read_bytes().split(b"\0")
                if cmdline and cmdline[0].endswith(b"systemd-nspawn") and root.encode() in cmdline:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
        for pid in _container_inits(path):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # the kernel kills the rest of its PID namespace with it
        time.sleep(0.2)
        cleanup_dir(path)
