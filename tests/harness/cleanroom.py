"""A clean-room Debian host for the package tests: a minimal bookworm made with debootstrap from the
mirror apt uses, with PostgreSQL in it, booted as a throwaway container (tests/harness/testbed.py).

The image is a directory under CACHE named after a hash of everything that went into it (suite,
mirror, packages, recipe): a change of any of them makes a new one, and a missing one is built
(a few minutes, it downloads). Tests never change it: it is the read-only lower layer of the test
bed's overlay, whose writes land in memory. Downloaded packages are kept in CACHE/apt-archives,
bound into every container at /var/cache/apt/archives, so the second run downloads nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.harness.commands import run, run_in_session
from tests.harness.postgres import free_port
from tests.harness.testbed import Testbed, TestbedError

CACHE = Path(os.environ.get("UNITVISOR_TEST_CACHE", "/var/cache/unitvisor-tests"))
SUITE = "bookworm"
# systemd as PID 1 and a system bus; PostgreSQL for the daemon; man-db so that `systemd-analyze
# verify` can check the unit's Documentation=man:unitvisor(1). No python3: the package's
# dependencies must bring it.
INCLUDE = ("systemd", "systemd-sysv", "dbus", "postgresql", "man-db")
RECIPE = 1  # bump when _build() changes, so that old images are not reused
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# How long apt-get waits for the shared archive cache that another clean room holds (apt_get).
APT_LOCK_WAIT = 600
# Not wanted in a test host: logins, and timers that would do maintenance in the middle of a test.
MASKED = (
    "getty@tty1.service", "console-getty.service", "apt-daily.timer", "apt-daily-upgrade.timer",
    "man-db.timer", "e2scrub_all.timer", "systemd-tmpfiles-clean.timer", "dpkg-db-backup.timer",
    "fstrim.timer",
)
PG_CONF = "/etc/postgresql/15/main/conf.d/zz-unitvisor-tests.conf"
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}


class CleanroomError(RuntimeError):
    pass


def available() -> str | None:
    """None when a clean room can be made here, else the reason why not."""
    if os.geteuid() != 0:
        return "the clean-room test needs root (debootstrap, mounts, systemd-nspawn)"
    for tool in ("debootstrap", "systemd-nspawn", "chroot"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install debootstrap systemd-container)"
    return None


def built_once(done: Path, lock_name: str, what: str, build: Callable[[], None],
               log: Callable[[str], None]) -> None:
    """Build what the file `done` marks as built, unless it is: several test sessions may ask at once
    (the passes of `make test` do); one builds, under an flock of CACHE/lock_name, the others wait."""
    if done.is_file():
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / lock_name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return
        started = time.monotonic()
        log(f"building {what} with debootstrap from {mirror()} (cached for later runs)")
        build()
        log(f"built {what} in {time.monotonic() - started:.0f}s")


def mirror() -> str:
    """The Debian mirror this machine's apt uses (deb.debian.org unless configured otherwise)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.sources")),
               *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]
    for path in sources:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                if line.lstrip().startswith("#"):
                    continue
                match = re.search(r"(https?://\S+/debian)/?(\s|$)", line)
                if match:
                    return match.group(1)
    return DEFAULT_MIRROR


def image_path() -> Path:
    key = json.dumps([RECIPE, SUITE, mirror(), sorted(INCLUDE)])
    return CACHE / f"{SUITE}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_image(log: Callable[[str], None] = print) -> Path:
    """The cached image, built first if it is missing. Safe from several test sessions at once."""
    path = image_path()
    CACHE.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        with open(CACHE / ".lock", "w") as lock:
            # Tidy up after an interrupted build, unless another session is building right now.
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _remove_half_built()
        return path
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building the same image
        if path.is_dir():
            return path
        _remove_half_built()
        started = time.monotonic()
        log(f"building the clean-room image {path} with debootstrap from {mirror()} (cached for later runs)")
        _build(path)
        log(f"built {path} in {time.monotonic() - started:.0f}s")
    return path


def _build(path: Path) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(INCLUDE)}", SUITE, str(tmp), mirror()],
            timeout=1800)
        # The package lists, so that `apt-get install ./unitvisor_*.deb` in a container can resolve
        # the dependencies without an `apt-get update` each time.
        shutil.copy("/etc/resolv.conf", tmp / "etc/resolv.conf")
        (tmp / "etc/apt/apt.conf.d/80unitvisor-tests").write_text('Acquire::Retries "3";\n')
        run(["chroot", str(tmp), "apt-get", "-q", "update"], timeout=600, env=CHROOT_ENV)
        _stop_processes_under(tmp)
        if _mounts_under(tmp):
            raise CleanroomError(f"mounts left under {tmp} after debootstrap: {_mounts_under(tmp)}")
        tmp.rename(path)
    except BaseException:
        _discard(tmp)
        raise


def _remove_half_built() -> None:
    """What an interrupted build left (called under the lock, so no build is under way). Complete
    images of other hashes stay: a session of another checkout may have one mounted right now."""
    for other in CACHE.glob(f"{SUITE}-*.tmp-*"):
        if other.is_dir():
            _discard(other)


def _discard(path: Path) -> None:
    _stop_processes_under(path)
    for mount in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
    if _mounts_under(path):
        raise CleanroomError(f"cannot remove {path}: still mounted inside")  # never rm -rf across a mount
    shutil.rmtree(path, ignore_errors=True)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1].replace("\\040", " ") for line in mounts]
    return [p for p in points if p == str(path) or p.startswith(prefix)]


def _stop_processes_under(path: Path) -> None:
    """Kill what a package's maintainer script may have left running in the chroot."""
    prefix = str(path)
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            root = os.readlink(pid_dir / "root")
            if root == prefix or root.startswith(prefix + "/"):
                os.kill(int(pid_dir.name), signal.SIGKILL)


def release_deb(repo: Path, commit: str, log: Callable[[str], None] = print) -> Path:
    """The .deb of an earlier release: `git archive COMMIT` built by that commit's own
    packaging/build-deb, the way it was released. Cached in CACHE/release-debs/<full commit id>: a
    commit never changes, so neither does its package. Its unit tests are skipped (nocheck): they
    passed when it was released, and today's Debian packages are not what it is being tested for."""
    full = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                          capture_output=True, text=True, check=True).stdout.strip()
    out = CACHE / "release-debs" / full
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building the same release
        debs = sorted(out.glob("unitvisor_*_all.deb"))
        if len(debs) == 1:
            return debs[0]
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="unitvisor-release-") as tmp:
            src = Path(tmp) / "src"
            src.mkdir()
            archive = subprocess.run(["git", "-C", str(repo), "archive", full], capture_output=True, check=True).stdout
            subprocess.run(["tar", "-C", str(src), "-xf", "-"], input=archive, check=True)
            built = Path(tmp) / "out"
            env = {**os.environ, "OUT": str(built), "DEB_BUILD_OPTIONS": "nocheck"}
            # In a session of its own: a timeout kills dpkg-buildpackage with build-deb.
            result = run_in_session([str(src / "packaging" / "build-deb")], 1200, env)
            if result.returncode != 0:
                raise CleanroomError(f"building the release {full[:12]} exited {result.returncode}:\n"
                                     f"{result.stderr[-3000:]}")
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(built, out.with_name(out.name + ".tmp"))
            out.with_name(out.name + ".tmp").rename(out)
        (deb,) = out.glob("unitvisor_*_all.deb")
        log(f"built the release {full[:12]} as {deb.name} in {time.monotonic() - started:.0f}s (cached)")
        return deb


class Cleanroom:
    """A booted clean-room host. Its PostgreSQL listens on a free port on 127.0.0.1: the network
    namespace is the machine's, shared with other tests.

    Several at once are a fleet: give each its own name; each has its own machine id (so its own
    default host id). With postgres=False its PostgreSQL is masked, and its daemon uses another
    clean room's, at 127.0.0.1:that room's pg_port."""

    def __init__(self, name: str = "uv-cleanroom", postgres: bool = True) -> None:
        self.image = ensure_image()
        archives = CACHE / "apt-archives"
        (archives / "partial").mkdir(parents=True, exist_ok=True)
        self.postgres = postgres
        self.pg_port = free_port() if postgres else 0
        masked = MASKED if postgres else (*MASKED, "postgresql.service", "postgresql@15-main.service")
        self.tb = Testbed(name, binds=[], lower=self.image, masked=masked,
                          nspawn_args=[f"--bind={archives}:/var/cache/apt/archives"])

    @property
    def machine_id(self) -> str:
        """This host's machine id: the daemon's default host id."""
        return (self.tb.root / "etc/machine-id").read_text().strip()

    def __enter__(self) -> Cleanroom:
        try:
            self.tb.prepare()
            if self.postgres:
                self.tb.write(PG_CONF, f"listen_addresses = '127.0.0.1'\nport = {self.pg_port}\n")
            self.tb.boot(timeout=120)
        except BaseException:
            self.tb.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.tb.destroy()

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return self.tb.run(*cmd, check=check, timeout=timeout, input=input, env=env)

    def apt_get(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """apt-get in the host; when the cached package lists name versions the mirror no longer has
        (a point release came out), update them and try once more. The archive cache is shared by
        every clean room on this machine, those of another test run included: while one of them holds
        its lock, wait for it (up to APT_LOCK_WAIT seconds) instead of failing."""
        cmd = ("apt-get", "-y", "-q", "-o", "Dpkg::Options::=--force-confdef", *args)
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        waited_until = time.monotonic() + APT_LOCK_WAIT
        while True:
            result = self.run(*cmd, check=False, timeout=timeout, env=env)
            locked = "Could not get lock /var/cache/apt/archives/lock" in result.stdout + result.stderr
            if result.returncode == 0 or not locked or time.monotonic() > waited_until:
                break
            time.sleep(2)
        if result.returncode != 0 and re.search(r"Failed to fetch|Unable to fetch|404", result.stdout + result.stderr):
            self.run("apt-get", "-q", "update", timeout=600)
            result = self.run(*cmd, check=False, timeout=timeout, env=env)
        if result.returncode != 0:
            raise TestbedError(f"apt-get {' '.join(args)} exited {result.returncode}:\n"
                               f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def psql(self, sql: str, database: str = "postgres") -> str:
        """SQL as the postgres superuser, over the socket (peer authentication)."""
        return self.run("runuser", "-u", "postgres", "--", "psql", "-p", str(self.pg_port), "-d", database,
                        "-v", "ON_ERROR_STOP=1", "-At", "-c", sql).stdout.strip()
