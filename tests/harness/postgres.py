"""A throwaway PostgreSQL cluster: initdb + pg_ctl from the installed PostgreSQL, in a temp dir under
/tmp, listening on a free port on 127.0.0.1 only. Removed again by `stop()`, whatever happened.

As root, the cluster runs as the `postgres` user (initdb refuses root), which Debian's postgresql
package creates.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path


def find_bindir() -> Path:
    """The newest installed server's bin dir (Debian keeps it off PATH)."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                        key=lambda p: int(Path(p).parent.parent.name))
    if candidates:
        return Path(candidates[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise RuntimeError("PostgreSQL is not installed (no initdb): apt-get install postgresql")


PREFIX = "unitvisor-pg-"


def cleanup_stale() -> None:
    """Stop and remove clusters that an interrupted earlier session left under /tmp."""
    for path in Path("/tmp").glob(PREFIX + "*"):
        if owner_alive(path / "owner"):
            continue  # another test session's, still running
        pid_file = path / "data" / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGQUIT)  # immediate shutdown
        except (OSError, ValueError, IndexError):
            pass
        shutil.rmtree(path, ignore_errors=True)


def owner_alive(owner_file: Path) -> bool:
    """Whether the process that wrote this owner file (a test session) still runs."""
    try:
        os.kill(int(owner_file.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    def __init__(self, settings: dict[str, str] | None = None) -> None:
        """`settings` are extra server settings (`-c name=value`), e.g. the benchmark's
        shared_preload_libraries=pg_stat_statements; values must not contain spaces."""
        self.bindir = find_bindir()
        self.settings = dict(settings or {})
        if any(" " in f"{key}{value}" for key, value in self.settings.items()):
            raise ValueError("Postgres settings must not contain spaces")
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir="/tmp"))
        (self.dir / "owner").write_text(str(os.getpid()))
        self.data = self.dir / "data"
        self.port = free_port()
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.running = False

    def _run(self, *args: str) -> None:
        subprocess.run([str(self.bindir / args[0]), *args[1:]], check=True, user=self.user,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync", "--locale=C")

    def start(self) -> None:
        # fsync off: a test cluster need not survive a power cut, and it makes every commit cheap.
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        options += "".join(f" -c {key}={value}" for key, value in self.settings.items())
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"), "-w", "start")
        self.running = True

    def stop_server(self, mode: str = "fast") -> None:
        """Stop the server but keep the cluster (a database outage in a drill). Fast, not immediate:
        with synchronous_commit off, an immediate stop may lose the last commits, which a real
        server (synchronous_commit on) would not."""
        if self.running:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
            self.running = False

    def stop(self) -> None:
        try:
            self.stop_server()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
