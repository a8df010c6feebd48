"""Several unitvisor hosts on one PostgreSQL: test beds booted side by side, each a `Host` with its
own host id, machine id and DSN, optionally through a `Proxy` of its own so that the host can be cut
off from the database (shared/TESTBED.md, "A fleet").

    with Fleet(dsn, size=3, proxied=[2]) as fleet:      # fleet[0..2]: uv-fleet-1..3, fleet-1..3
        fleet[0].host.start()
        fleet[2].cut("blackhole")                       # the third host loses the database
        fleet[1].power_cut(); fleet[1].boot()           # the second host loses power and comes back

The configuration of each host is the harness's DEFAULT_CONFIG for its host id, with `config_extra`
appended (e.g. a `[fleet]` section), unless `configs` gives a host its whole text. Nothing here knows
the keys of any section: the tests say what they configure.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.harness.host import DEFAULT_CONFIG, REPO, Host
from tests.harness.proxy import Proxy
from tests.harness.testbed import Testbed


def proxied_dsn(dsn: str, proxies: Sequence[Proxy]) -> str:
    """`dsn` with each of its servers replaced by the proxy in front of it (same order)."""
    params = conninfo_to_dict(dsn)
    params["host"] = ",".join("127.0.0.1" for _ in proxies)
    params["port"] = ",".join(str(proxy.port) for proxy in proxies)
    return make_conninfo(**params)


def servers(dsn: str) -> list[tuple[str, int]]:
    """The (host, port) pairs a libpq DSN names; a multi-host DSN names several."""
    params = conninfo_to_dict(dsn)
    if "hostaddr" in params:
        raise ValueError("a fleet DSN names its servers with host=, not hostaddr=")
    hosts = str(params.get("host", "127.0.0.1")).split(",")
    ports = str(params.get("port", "5432")).split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    if len(ports) != len(hosts):
        raise ValueError(f"the DSN names {len(hosts)} hosts but {len(ports)} ports")
    return [(host, int(port)) for host, port in zip(hosts, ports, strict=True)]


# A fleet host's config for the drills and the benchmark: short timings, so that a host is declared
# dead in seconds; everything else as packaged.
FLEET_CONFIG = """
[host]
id = "{host_id}"
name = "{host_id}"

[daemon]
poll_interval = "{poll}s"
reconcile_interval = "10s"

[systemd]
stop_grace = "{stop_grace}s"

[fleet]
host_dead_after = "{dead_after}s"
stop_runs_when_cut_off = {cut_off}

[runs]
allowed_executables = {allowed}
"""
ALLOW_DRILLS = '["/bin/sh", "/bin/true", "/bin/sleep"]'


def fleet_config(host_id: str, *, poll: float = 1, dead_after: float = 6, stop_grace: float = 1,
                 cut_off: bool = False, allowed: str = ALLOW_DRILLS) -> str:
    return FLEET_CONFIG.format(host_id=host_id, poll=poll, dead_after=dead_after, stop_grace=stop_grace,
                               cut_off=str(cut_off).lower(), allowed=allowed)


def submit_many(conn: psycopg.Connection, argv: list[str], count: int = 1, **args: object) -> list[uuid.UUID]:
    """`count` runs in one statement (one transaction, one wake-up for the fleet), as a burst arrives."""
    named = "".join(f", {name} => %({name})s" for name in args)
    rows = conn.execute(f"SELECT unitvisor.submit_run(%(argv)s{named}) FROM generate_series(1, %(count)s)",
                        {"argv": argv, "count": count, **args}).fetchall()
    return [row[0] for row in rows]


class Member:
    """One host of the fleet: its test bed, its `Host`, and the proxies between it and PostgreSQL."""

    def __init__(self, index: int, host: Host, proxies: list[Proxy], config: str) -> None:
        self.index = index  # 1-based, as in its names: uv-fleet-<index>, fleet-<index>
        self.host = host
        self.proxies = proxies
        self.config = config

    def __repr__(self) -> str:
        return f"<Member {self.host_id} on {self.tb.name}{' proxied' if self.proxies else ''}>"

    @property
    def tb(self) -> Testbed:
        return self.host.tb

    @property
    def host_id(self) -> str:
        return self.host.host_id

    @property
    def dsn(self) -> str:
        """What the host's daemon and CLI use: through its proxies when it has them."""
        return self.host.dsn

    @property
    def proxy(self) -> Proxy:
        if len(self.proxies) != 1:
            raise AttributeError(f"{self.host_id} has {len(self.proxies)} proxies; use .proxies")
        return self.proxies[0]

    def cut(self, how: Literal["reset", "blackhole"]) -> None:
        """Cut this host off from every database server it names (a partition)."""
        if not self.proxies:
            raise RuntimeError(f"{self.host_id} is not behind a proxy (Fleet(proxied=...))")
        for proxy in self.proxies:
            proxy.cut(how)

    def heal(self) -> None:
        for proxy in self.proxies:
            proxy.heal()

    def configure(self, config: str | None = None) -> None:
        """(Re)write /etc/unitvisor/unitvisor.toml and the DSN file; `config` replaces the text."""
        if config is not None:
            self.config = config
        self.host.configure(config=self.config)

    def power_cut(self) -> None:
        self.tb.power_cut()

    def boot(self, timeout: float = 120) -> None:
        """Boot (again, after a power cut or a clean power-off) on the same disk."""
        self.tb.boot(timeout)

    def machine_id(self) -> str:
        return self.tb.run("cat", "/etc/machine-id").stdout.strip()

    def boots(self) -> list[str]:
        """The boot ids the host's journal knows, oldest first (journalctl --list-boots)."""
        out = self.tb.run("journalctl", "--list-boots", "--no-pager", "-q").stdout
        return [line.split()[1] for line in out.splitlines() if len(line.split()) > 1]


class Fleet:
    """N test beds side by side (uv-fleet-1..N), each a Host (fleet-1..N) on `dsn`.

    `proxied`: True for every host, or the 1-based indexes of the hosts that get a Proxy per database
    server between them and PostgreSQL. `config_extra` is appended to every host's DEFAULT_CONFIG;
    `configs` maps a host id to the whole text of its config instead. `host_ids` overrides the ids
    (the names of the test beds stay uv-fleet-N). Boots the test beds in parallel unless told not to.
    Use as a context manager, or call boot() and destroy(): destroy() leaves no process, mount,
    proxy thread or directory behind, whatever state the hosts are in.
    """

    def __init__(self, dsn: str, size: int = 3, *, prefix: str = "uv-fleet", host_ids: Sequence[str] | None = None,
                 proxied: bool | Collection[int] = False, config_extra: str = "",
                 configs: Mapping[str, str] | None = None, binds: Sequence[Path] = (REPO,),
                 parallel: bool = True) -> None:
        if size < 1:
            raise ValueError("a fleet has at least one host")
        ids = list(host_ids) if host_ids is not None else [f"fleet-{n}" for n in range(1, size + 1)]
        if len(ids) != size:
            raise ValueError(f"{size} hosts but {len(ids)} host ids")
        if configs and set(configs) - set(ids):
            raise ValueError(f"configs for hosts that are not in the fleet: {sorted(set(configs) - set(ids))}")
        wanted = set(range(1, size + 1)) if proxied is True else set(proxied or ())
        self.parallel = parallel
        self.members: list[Member] = []
        self.boot_seconds: float | None = None
        try:
            for n, host_id in enumerate(ids, start=1):
                proxies = [Proxy(host, port) for host, port in servers(dsn)] if n in wanted else []
                tb = Testbed(f"{prefix}-{n}", binds=list(binds))
                host = Host(tb, proxied_dsn(dsn, proxies) if proxies else dsn, host_id=host_id)
                config = (configs or {}).get(host_id)
                if config is None:
                    config = DEFAULT_CONFIG.format(host_id=host_id, runs_extra="") + config_extra
                self.members.append(Member(n, host, proxies, config))
        except BaseException:
            self.destroy()
            raise

    def __enter__(self) -> Fleet:
        try:
            self.boot()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __getitem__(self, index: int) -> Member:
        """0-based: fleet[0] is uv-fleet-1 / fleet-1."""
        return self.members[index]

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    @property
    def hosts(self) -> list[Host]:
        return [member.host for member in self.members]

    def by_id(self, host_id: str) -> Member:
        return next(member for member in self.members if member.host_id == host_id)

    def _each(self, action: Callable[[Member], None]) -> None:
        """`action` on every member, in parallel threads if the fleet is; the first error is raised
        once all have finished (no thread is left running)."""
        if not self.parallel or len(self.members) == 1:
            for member in self.members:
                action(member)
            return
        with ThreadPoolExecutor(max_workers=len(self.members)) as pool:
            futures = [pool.submit(action, member) for member in self.members]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]

    def boot(self, timeout: float = 120) -> None:
        """Mount, configure and boot every host; the configs and DSN files are in place before boot."""
        def boot_one(member: Member) -> None:
            member.tb.prepare()
            member.configure()
            member.tb.boot(timeout)

        started = time.monotonic()
        self._each(boot_one)
        self.boot_seconds = time.monotonic() - started

    def destroy(self) -> None:
        def destroy_one(member: Member) -> None:
            try:
                member.tb.destroy()
            finally:
                for proxy in member.proxies:
                    proxy.close()

        # Every member is destroyed even if one fails (each destroy is idempotent, so a failed
        # parallel pass is simply done again one by one); the first failure is raised at the end.
        if self.parallel and len(self.members) > 1:
            try:
                self._each(destroy_one)
                return
            except Exception:
                pass
        errors: list[BaseException] = []
        for member in self.members:
            try:
                destroy_one(member)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
