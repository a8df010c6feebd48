"""A throwaway PostgreSQL cluster: initdb + pg_ctl from the installed PostgreSQL, in a temp dir under
/tmp, listening on a free port on 127.0.0.1 only. Removed again by `stop()`, whatever happened.

As root, the cluster runs as the `postgres` user (initdb refuses root), which Debian's postgresql
package creates.

A streaming standby of a running cluster, for failover drills: `standby = primary.make_standby()`,
then `standby.promote()`, and `multi_host_dsn(primary, standby)` for clients that must find whichever
is the primary (see make_standby for what "synchronous" buys and costs).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from tests.harness.commands import children


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


# A throwaway cluster need not survive a crash of the machine: no fsync, no full-page writes, commits
# that do not wait for the disk. Settings given to Postgres() override these.
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off", "max_connections": "200"}
_WAITING_COMMITS = ("on", "remote_write", "remote_apply")  # the values with which a commit waits for a standby


# Ports handed out by free_port(): below the kernel's ephemeral range (net.ipv4.ip_local_port_range,
# 32768-60999 by default), so that no client connection of another process takes one as its source
# port while its server is down (a drill stops PostgreSQL for 30 s and starts it on the same port).
PORTS = range(20000, 30000)
PORT_LOCKS = Path("/tmp/unitvisor-ports")
_held: dict[int, int] = {}  # port -> the fd of its lock, held until this process ends


def free_port() -> int:
    """A port on 127.0.0.1 that no other test session (this checkout's other pass of `make test`, a
    colleague's) is given while this process lives: each is reserved by an flock on
    /tmp/unitvisor-ports/<port>, which the kernel releases when the process ends, however it ends.
    The port was free when reserved; nothing else on the machine is expected to listen in PORTS.

    Before: a port the kernel picked for a socket bound and closed at once, from the ephemeral range,
    which two sessions at once could both be given, or a client's connection take in between."""
    PORT_LOCKS.mkdir(mode=0o1777, exist_ok=True)
    for _ in range(200):
        port = random.choice(PORTS)
        if port not in _held and _reserve(port):
            return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1} after 200 tries")


def _reserve(port: int) -> bool:
    fd = os.open(PORT_LOCKS / str(port), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # another live session's
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            os.close(fd)
            return False  # something outside the harness listens there
    _held[port] = fd
    return True


class Postgres:
    def __init__(self, settings: dict[str, str] | None = None, port: int | None = None) -> None:
        """`settings` are extra server settings (`-c name=value`), e.g. the benchmark's
        shared_preload_libraries=pg_stat_statements; values must not contain spaces. `port`: a given
        one (a new standby taking the place of a failed primary, behind the same proxies), else a free one."""
        self.bindir = find_bindir()
        self.settings = dict(settings or {})
        if any(" " in f"{key}{value}" for key, value in self.settings.items()):
            raise ValueError("Postgres settings must not contain spaces")
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir="/tmp"))
        (self.dir / "owner").write_text(str(os.getpid()))
        self.data = self.dir / "data"
        self.port = port or free_port()
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.running = False
        self.primary: Postgres | None = None  # set on a standby: the cluster it streams from
        self.application_name: str | None = None  # a standby's name in the primary's pg_stat_replication
        self.standbys: list[Postgres] = []
        self.sync_standbys: list[str] = []

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

    def require_passwords(self, trusted: str = "postgres") -> None:
        """Every role but `trusted` (the harness's superuser) logs in over TCP with its password
        (SCRAM), as a deployment's host roles do: a rotated password then locks the old one out,
        where initdb's `trust` would let any password in. Replication stays trusted (pg_basebackup and
        the standbys connect as `trusted`). A standby made afterwards copies this pg_hba.conf."""
        (self.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            f"host all {trusted} 127.0.0.1/32 trust\n"
            f"host replication {trusted} 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n")
        if self.running:
            self._run("pg_ctl", "-D", str(self.data), "reload")

    def require_tls(self, cert: Path, key: Path) -> None:
        """What README's Install sets up for hosts on other machines: the server speaks TLS with this
        certificate (`ssl = on`), and over TCP it admits only TLS sessions that log in with their
        password (`hostssl ... scram-sha-256`); a plain connection has no pg_hba.conf line. The
        superuser comes in over the cluster's socket (`socket_dsn_for`), as `runuser -u postgres`
        does on a real host. Takes effect at the next start (the server reads its key only then)."""
        tls = self.dir / "tls"
        tls.mkdir(exist_ok=True)
        # PostgreSQL refuses a key that group or others may read, and reads it as the cluster's owner.
        for source, mode in ((cert, 0o644), (key, 0o600)):
            target = tls / source.name
            shutil.copyfile(source, target)
            target.chmod(mode)
            if self.user:
                pw = pwd.getpwnam(self.user)
                os.chown(target, pw.pw_uid, pw.pw_gid)
        if self.user:
            os.chown(tls, pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid)
        self.settings.update({"ssl": "on", "ssl_cert_file": str(tls / cert.name),
                              "ssl_key_file": str(tls / key.name), "password_encryption": "scram-sha-256"})
        (self.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            "hostssl all all 127.0.0.1/32 scram-sha-256\n"
            "hostssl all all ::1/128 scram-sha-256\n")

    def socket_dsn_for(self, dbname: str) -> str:
        """The superuser over the cluster's Unix socket: no TCP, so no pg_hba.conf `host` line needed."""
        return f"host={self.dir} port={self.port} user=postgres dbname={dbname}"

    def start(self) -> None:
        # fsync off: a test cluster need not survive a power cut, and it makes every commit cheap.
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir}"
        options += "".join(f" -c {key}={value}" for key, value in {**FAST_SETTINGS, **self.settings}.items())
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"), "-w", "start")
        self.running = True

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        """Every process of the server stopped (SIGSTOP) for the block, then let go: it answers nothing
        but keeps every connection, as an overloaded server or one whose storage stalls does."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        stopped = [postmaster]
        try:
            os.kill(postmaster, signal.SIGSTOP)  # first: stopped, it forks no backend the list below misses
            for pid in children(postmaster):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            yield
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

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

    def restart(self) -> None:
        self.stop_server()
        self.start()

    def connect(self, dbname: str = "postgres", **kwargs: object) -> psycopg.Connection:
        return psycopg.connect(self.dsn_for(dbname), autocommit=True, connect_timeout=10, **kwargs)

    def in_recovery(self) -> bool:
        with self.connect() as conn:
            return conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]

    # -- streaming replication --------------------------------------------------------------------

    def make_standby(self, synchronous: bool = True, name: str | None = None, timeout: float = 60,
                     port: int | None = None) -> Postgres:
        """A streaming standby of this running cluster, started on its own free port and caught up.

        `pg_basebackup -R` copies the cluster (as the postgres user, like initdb) and writes
        standby.signal and primary_conninfo; a physical replication slot named after the standby keeps
        the WAL it still needs. The standby's name (its cluster_name, which the walreceiver uses as its
        application_name) is what the primary's pg_stat_replication and synchronous_standby_names show.
        The standby gets this cluster's extra settings too. Stop it with stop(), like any cluster; it has
        its own directory and owner file, so cleanup_stale() removes it after an interrupted session.

        Synchronous (the default): this cluster's synchronous_standby_names names the standby and its
        synchronous_commit is `on` (the harness otherwise starts clusters with synchronous_commit=off,
        under which a commit waits for nobody). A commit then returns only once the standby has the WAL,
        so a failover to the standby loses no committed claim or outcome: what a client was told is
        committed is on the new primary. If synchronous_commit was off, this cluster is restarted to
        turn it on (its clients are disconnected once); pass settings={"synchronous_commit": "on"} to
        Postgres() to avoid that.

        The cost: while the synchronous standby is not streaming (stopped, or promoted), every commit
        on this cluster blocks. After standby.promote() the old primary must therefore be stopped, as
        the drills do; a client still connected to it hangs on COMMIT (statement_timeout does not end
        that wait: it is disarmed before the commit), and if the wait is cancelled (a cancel request,
        pg_cancel_backend) PostgreSQL reports success with only a WARNING ("the transaction has already
        committed locally, but might not have been replicated"): a row the new primary does not have.
        Asynchronous (synchronous=False): commits never wait, and the last ones before a failover may be
        lost.
        """
        if not self.running:
            raise RuntimeError("make_standby needs a running primary")
        index = len(self.standbys) + 1
        name = name or f"standby{index}"
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,40}", name):
            raise ValueError(f"bad standby name {name!r}")
        if synchronous and self.settings.get("synchronous_commit", FAST_SETTINGS["synchronous_commit"]) \
                not in _WAITING_COMMITS:
            # synchronous_commit is on the server's command line, which ALTER SYSTEM cannot override.
            self.settings["synchronous_commit"] = "on"
            self.restart()
        standby = Postgres(settings={**self.settings, "cluster_name": name}, port=port)
        standby.primary = self
        standby.application_name = name
        try:
            subprocess.run([str(self.bindir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.port),
                            "-U", "postgres", "-D", str(standby.data), "-R", "-X", "stream", "-c", "fast",
                            "-C", "-S", name, "--no-sync"],
                           check=True, user=self.user, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=120)
            # The copy has this cluster's postgresql.auto.conf: a synchronous_standby_names set there for
            # an earlier standby would make the promoted standby wait for a standby of its own, forever.
            auto = standby.data / "postgresql.auto.conf"
            auto.write_text("".join(line for line in auto.read_text().splitlines(keepends=True)
                                    if not line.startswith("synchronous_standby_names")))
            standby.start()
            self.standbys.append(standby)
            if synchronous:
                self.sync_standbys.append(name)
                with self.connect() as conn:
                    # Priority order: the first one streaming is the synchronous one.
                    conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{','.join(self.sync_standbys)}'")
                    conn.execute("SELECT pg_reload_conf()")
            self._wait_streaming(name, synchronous, timeout)
        except BaseException:
            if standby in self.standbys:
                self.standbys.remove(standby)
            standby.stop()
            raise
        return standby

    def _wait_streaming(self, name: str, synchronous: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.connect() as conn:
            while True:
                row = conn.execute("SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                                   (name,)).fetchone()
                if row and row[0] == "streaming" and (not synchronous or row[1] in ("sync", "quorum")):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"standby {name} is not streaming (pg_stat_replication: {row})")
                time.sleep(0.05)

    def promote(self, timeout: float = 60) -> None:
        """Make this standby a primary, and return once it accepts writes."""
        if self.primary is None:
            raise RuntimeError("promote() is for a standby")
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", str(int(timeout)), "promote")
        deadline = time.monotonic() + timeout
        while self.in_recovery():
            if time.monotonic() > deadline:
                raise RuntimeError("the promoted standby is still in recovery")
            time.sleep(0.05)


def multi_host_dsn(*servers: Postgres, dbname: str = "postgres") -> str:
    """One libpq DSN naming every server, which connects to whichever of them accepts writes now:
    `host=127.0.0.1,127.0.0.1 port=P1,P2 ... target_session_attrs=read-write`. libpq tries them in
    order, so a stopped server only costs a refused connect."""
    hosts = ",".join("127.0.0.1" for _ in servers)
    ports = ",".join(str(server.port) for server in servers)
    return f"host={hosts} port={ports} dbname={dbname} user=postgres target_session_attrs=read-write"


@contextlib.contextmanager
def synchronous_pair() -> Iterator[tuple[Postgres, Postgres]]:
    """A primary (synchronous_commit on: set on its command line, so make_standby need not restart
    it) and its synchronous streaming standby; both stopped and removed afterwards."""
    primary = Postgres(settings={"synchronous_commit": "on"})
    standby = None
    try:
        primary.init()
        primary.start()
        standby = primary.make_standby(synchronous=True)
        yield primary, standby
    finally:
        if standby is not None:
            standby.stop()
        primary.stop()
