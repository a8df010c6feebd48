"""README's Install section carried out on two clean Debian 12 hosts, as an operator would: web-1 with
the database, web-2 on another machine over TLS with `sslmode=verify-full`; a run submitted from
web-1 and pinned to web-2, watched, web-2 drained with its own DSN, its package removed and purged,
the host forgotten and its login refused; then the database's machine taken apart. (issue 24: "a
person following only the installed README ... without a question".)

The shell blocks are taken from the README the .deb installs (/usr/share/doc/unitvisor/README.md),
section by section, and run as they are, so that this test fails when the README drifts from what
works. What an operator fills in is substituted, and nothing else:

- the server's name and address: `db.example.com` is DB_NAME, which both hosts resolve through
  /etc/hosts to this machine's own address (the two containers share its network namespace), and
  `10.0.0.5` / `10.0.0.0/24` are that address and /32;
- the port: PostgreSQL listens on a free port, not 5432 (other tests share the network), so the DSNs
  name it and PGPORT is set for psql, createuser and createdb;
- `PASSWORD`, and the password typed at `createuser --pwprompt`;
- `editor FILE  # what goes in` is the operator writing what the comment says, from what the
  commands before printed (the DSN line of `hosts add`); `apt install` answers yes.

Where a step is prose (copy the CA certificate, `unitvisor drain`, `apt purge unitvisor`), the test
runs the command the README names and checks the README still names it. Then, after each step, what
the README promises of it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import _unavailable
from tests.harness import cleanroom, testbed
from tests.harness.cleanroom import PG_CONF, Cleanroom
from tests.harness.host import wait_for
from tests.package.test_cleanroom import say

DB_NAME = "db.unitvisor.test"  # README's db.example.com
PASSWORD = "Operator-Secret-24"  # the admin's login role's, typed at createuser --pwprompt
README = "/usr/share/doc/unitvisor/README.md"
SERVICE = "unitvisor.service"
GATE = "/etc/unitvisor-readme-gate"  # the run on web-2 ends when this file exists (a run may read /etc)
ADMIN_DSN_FILE = "/root/.config/unitvisor/admin.dsn"  # README's ~/.config/unitvisor/admin.dsn, for root


def server_address() -> str:
    """This machine's first global IPv4 address: web-2 connects to it from the same network namespace,
    so its connections come from that address, not 127.0.0.1, and only README's `hostssl` line can
    admit them (Debian's own `host` lines are for 127.0.0.1 and ::1). 127.0.0.1 where there is none:
    then Debian's line admits a connection without TLS too, and the test says so."""
    result = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                            check=False)
    match = re.search(r"\binet (\d+\.\d+\.\d+\.\d+)/", result.stdout)
    return match.group(1) if match else "127.0.0.1"


# -- the README, as installed -------------------------------------------------------------------------

def section(readme: str, heading: str) -> str:
    """The text under `heading` (a heading line, without its #s) up to the next heading, code blocks'
    `# comment` lines not counting as headings."""
    lines, out, inside, fenced = readme.splitlines(), [], False, False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        is_heading = not fenced and re.match(r"#{1,6} ", line)
        if is_heading and inside:
            break
        if is_heading and line.lstrip("#").strip() == heading:
            inside = True
            continue
        if inside:
            out.append(line)
    assert inside, f"README has no heading {heading!r}"
    return "\n".join(out)


def sh_blocks(text: str) -> list[str]:
    return [textwrap.dedent(block) for block in re.findall(r"^[ \t]*```sh\n(.*?)^[ \t]*```", text, re.S | re.M)]


def commands(block: str) -> list[str]:
    """A block's commands: continuation lines joined, a here-document kept with its command. A comment
    line `# on HOST...` is kept: the commands after it are typed on that host."""
    lines, out = block.splitlines(), []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or (line.lstrip().startswith("#") and not ON_HOST.match(line)):
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            body = []
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                body.append(lines[i])
                i += 1
            line = "\n".join([line, *body, heredoc.group(1)])
            i += 1
        out.append(line)
    return out


# A block's `# on the database's machine: ...` or `# on web-2` line.
ON_HOST = re.compile(r"\s*# on ([^:]+?)\s*(?::.*)?$")


def code_span(text: str, containing: str) -> str:
    """The one inline code span of `text` that contains `containing` (a span may break across lines)."""
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.S | re.M)  # fences are not spans
    spans = {re.sub(r"\s+", " ", span).strip() for span in re.findall(r"`([^`]+)`", prose)}
    found = [span for span in spans if containing in span]
    assert len(found) == 1, f"README names no single `...{containing}...` here (found {found})"
    return found[0]


# -- an operator at a host's shell --------------------------------------------------------------------

@dataclass
class Operator:
    """root at one host's shell, who types README's commands with the placeholders filled in."""

    room: Cleanroom
    name: str
    subs: list[tuple[str, str]]
    port: int
    printed: list[str] = field(default_factory=list)  # every command's output, for `editor` to copy from
    # The other machines by the names a block's `# on ...` lines and `scp` give them (Fleet sets it).
    peers: dict[str, Operator] = field(default_factory=dict)

    def fill(self, text: str) -> str:
        for old, new in self.subs:
            text = text.replace(old, new)
        return text

    def sh(self, command: str, cwd: str = "/root", check: bool = True, input: str | None = None,
           timeout: float = 300, exports: str = "") -> subprocess.CompletedProcess:
        script = f"set -e\ncd {cwd}\n{exports}{command}\n"
        result = self.room.run("bash", "-c", script, check=False, timeout=timeout, input=input,
                               env={"HOME": "/root", "PGPORT": str(self.port), "TERM": "dumb",
                                    "SYSTEMD_PAGER": "", "PAGER": "cat"})
        if check and result.returncode != 0:
            raise AssertionError(f"on {self.name}: {command}\nexited {result.returncode}:\n{result.stdout[-3000:]}\n"
                                 f"{result.stderr[-3000:]}\n{self.daemon_log()}")
        self.printed.append(result.stdout)
        return result

    def daemon_log(self) -> str:
        return self.room.run("journalctl", "-u", SERVICE, "--no-pager", "-o", "cat", "-n", "40", check=False).stdout

    def block(self, block: str, editors: Callable[[Operator, str, str], str]) -> list[str]:
        """Run a README block command by command (cd and export carry on to the next, as in one shell);
        `editor FILE  # what` writes what `editors(self, FILE, what)` says goes in. Returns each
        command's stdout. After a line `# on HOST`, the commands are typed on that host, in a new shell."""
        cwd, exports, outputs, here = "/root", "", [], self
        for raw in commands(block):
            on = ON_HOST.match(raw)
            if on:
                assert on.group(1) in self.peers, f"README's block says `{raw.strip()}`: which host is that?"
                cwd, exports, here = "/root", "", self.peers[on.group(1)]
                continue
            if here is not self:
                outputs.append("\n".join(here.block(raw, editors)))
                continue
            command = self.fill(raw)
            scp = re.fullmatch(r"scp (\S+) (?:\w+@)?([\w.-]+):(\S+)", command)
            if scp:  # between two containers, through each one's shell (its /tmp is its own tmpfs)
                source, target, dest = scp.groups()
                assert target in self.peers, f"`{command}`: no host {target} here"
                self.peers[target].room.run("sh", "-c", f"cat > {dest}", input=self.room.run("cat", source).stdout)
                outputs.append("")
                continue
            edit = re.fullmatch(r"(\(umask \d+; )?editor (\S+?)(\))?\s*(?:#\s*(.*))?", command, re.S)
            if edit:
                path = edit.group(2).replace("~", "/root", 1)
                content = editors(self, path, edit.group(4) or "")
                wrapped = f"{edit.group(1) or ''}cat > {path}{edit.group(3) or ''}"
                outputs.append(self.sh(wrapped, cwd=cwd, input=content, exports=exports).stdout)
                continue
            apt = re.fullmatch(r"apt (install|remove|purge) (.*?)(\s+#.*)?", command)
            if apt:
                outputs.append(self.apt(apt.group(1), apt.group(2).split(), cwd).stdout)
                continue
            pwprompt = f"{PASSWORD}\n{PASSWORD}\n" if "--pwprompt" in command else None
            outputs.append(self.sh(command, cwd=cwd, input=pwprompt, exports=exports).stdout)
            if command.startswith("cd "):
                cwd = command.split()[1]
            if command.startswith("export "):
                exports += command.split("#")[0].strip() + "\n"
        return outputs

    def apt(self, verb: str, args: list[str], cwd: str = "/root") -> subprocess.CompletedProcess:
        """`apt VERB ...`, answering yes (the cleanroom's apt-get waits for the shared archive cache);
        a glob as the shell would expand it in cwd."""
        expanded = []
        for arg in args:
            if "*" in arg:
                matches = sorted((self.room.tb.root / cwd.lstrip("/")).glob(arg.removeprefix("./")))
                assert len(matches) == 1, f"{arg} matches {matches} on {self.name}"
                arg = "/" + str(matches[0].relative_to(self.room.tb.root))
            expanded.append(arg)
        return self.room.apt_get(verb, *expanded)

    def unitvisor(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.sh(" ".join(shlex.quote(a) for a in ("unitvisor", *args)), check=check)

    def prop(self, unit: str, name: str) -> str:
        return self.room.run("systemctl", "show", unit, f"--property={name}", "--value").stdout.strip()

    def read(self, path: str) -> str:
        return (self.room.tb.root / path.lstrip("/")).read_text()

    def exists(self, path: str) -> bool:
        return self.room.run("test", "-e", path, check=False).returncode == 0


def edit_config(op: Operator, path: str, what: str) -> str:
    """What the README's `editor ...  # what` comments say goes in each file."""
    if path == "/etc/unitvisor/dsn":
        # "the DSN line it printed", with any parameters the comment adds (sslmode=..., sslrootcert=...)
        printed = [line for out in op.printed for line in out.splitlines() if " user=unitvisor_host_" in line
                   and not line.startswith("#")]
        assert printed, f"on {op.name}: README says to write the DSN `hosts add` printed, but none was printed"
        dsn = printed[-1]
        keys = {part.split("=", 1)[0] for part in dsn.split()}
        extra = [p for p in what.split() if re.fullmatch(r"\w+=\S+", p) and p.split("=", 1)[0] not in keys]
        return " ".join([dsn, *extra]) + "\n"
    if path.endswith("/unitvisor.toml"):
        text = op.read(path)
        host_id = re.search(r'id = "([^"]+)"', what)
        assert host_id, f"README's comment names no host id for {path}: {what!r}"
        text, n = re.subn(r'^# id = ""$', f'id = "{host_id.group(1)}"', text, count=1, flags=re.M)
        assert n == 1, f"{path} has no `# id = \"\"` line under [host] to set"
        allowed = re.search(r"allowed_executables = (\[[^\]]*\])", what)
        # web-2's comment says only "its [runs] allowed_executables": the same as web-1's example
        allowed_value = allowed.group(1) if allowed else '["/usr/bin/python3", "/opt/jobs/bin/*"]'
        assert "allowed_executables" in what, f"README's comment does not say to set allowed_executables: {what!r}"
        text, n = re.subn(r"^# allowed_executables = \[\]$", f"allowed_executables = {allowed_value}", text,
                          count=1, flags=re.M)
        assert n == 1, f"{path} has no `# allowed_executables = []` line under [runs] to set"
        return text
    if path == ADMIN_DSN_FILE:
        dsn = what.strip()
        assert re.fullmatch(r"postgresql://\S+", dsn), f"README's comment is not a DSN to write: {what!r}"
        return dsn + "\n"
    raise AssertionError(f"README asks the operator to edit {path} ({what!r}): this test does not know what goes there")


# -- the two hosts ------------------------------------------------------------------------------------

@dataclass
class Fleet:
    web1: Operator
    web2: Operator
    readme: str
    address: str
    state: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def fleet(deb: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    reason = cleanroom.available()
    if reason:
        _unavailable(reason)
    testbed.cleanup_stale()
    started = time.monotonic()
    readme = subprocess.run(f"dpkg-deb --fsys-tarfile {deb} | tar -xO .{README}", shell=True, capture_output=True,
                            text=True, check=True).stdout
    assert "## Install" in readme, f"the .deb has no {README}"
    address = server_address()
    with Cleanroom("uv-readme-web1") as room1, Cleanroom("uv-readme-web2", postgres=False) as room2:
        port = room1.pg_port
        subs = [
            ("host=/var/run/postgresql dbname=unitvisor", f"host=/var/run/postgresql port={port} dbname=unitvisor"),
            ("unitvisor:PASSWORD@localhost/", f"unitvisor:{PASSWORD}@localhost:{port}/"),
            ("unitvisor:PASSWORD@db.example.com/", f"unitvisor:{PASSWORD}@{DB_NAME}:{port}/"),
            ("db.example.com", DB_NAME),
            ("10.0.0.0/24", f"{address}/32"),
            ("10.0.0.5", address),
        ]
        fleet = Fleet(Operator(room1, "web-1", subs, port), Operator(room2, "web-2", subs, port), readme, address)
        peers = {"web-1": fleet.web1, "the database's machine": fleet.web1, "web-2": fleet.web2}
        fleet.web1.peers = fleet.web2.peers = peers
        for room in (room1, room2):
            (room.tb.root / "root/build/deb").mkdir(parents=True)
            shutil.copy(deb, room.tb.root / "root/build/deb" / deb.name)  # "from a checkout": build/deb/
        # The clean room's own conf.d file pins listen_addresses to 127.0.0.1; README's sets it: keep
        # only the port here (a later file in conf.d wins).
        room1.tb.write(PG_CONF, f"port = {port}\n")
        say(request, f"two clean rooms booted in {time.monotonic() - started:.1f}s; the server is {DB_NAME} at "
                     f"{address}:{port}")
        yield fleet
    say(request, f"the README's two-host story took {time.monotonic() - started:.1f}s")


def install_block(readme: str) -> str:
    blocks = sh_blocks(section(readme, "Install"))
    assert len(blocks) == 2, f"README's Install has {len(blocks)} shell blocks, this test knows 2"
    return blocks[0]


def apt_install_line(readme: str) -> str:
    (line,) = [c for c in commands(install_block(readme)) if c.startswith("apt install ")]
    return line


def test_web1_installed_as_the_readme_says(fleet: Fleet, request: pytest.FixtureRequest) -> None:
    started = time.monotonic()
    build, install = commands(install_block(fleet.readme))
    assert build.startswith("packaging/build-deb"), build  # built once for every package test (conftest.py)
    fleet.web1.block(install, edit_config)
    say(request, f"web-1: apt install took {time.monotonic() - started:.1f}s")
    assert fleet.web1.read(README) == fleet.readme
    wait_for(lambda: "waiting for a database" in fleet.web1.prop(SERVICE, "StatusText"), timeout=60,
             what="web-1's daemon to wait for a database")
    setup = sh_blocks(section(fleet.readme, "Install"))[1]
    outputs = fleet.web1.block(setup, edit_config)
    doctor = outputs[-1]
    assert re.search(r"^ok\s+role\s+host, bound to web-1$", doctor, re.M), doctor
    assert fleet.web1.room.run("stat", "-c", "%a %U", "/etc/unitvisor/dsn").stdout.split() == ["600", "root"]


def test_the_operators_credentials_in_a_dsn_file(fleet: Fleet) -> None:
    text = section(fleet.readme, "The operator's credentials")
    (block,) = sh_blocks(text)
    hosts = fleet.web1.block(block, edit_config)[-1]
    assert re.search(r"^web-1\s", hosts, re.M), hosts
    assert fleet.web1.room.run("stat", "-c", "%a", ADMIN_DSN_FILE).stdout.strip() == "600"
    # "On a host, give that file with --dsn-file for those commands" (submit, cancel, ... below): root's
    # own `unitvisor` keeps the host's DSN.
    assert "give that file with `--dsn-file`" in " ".join(text.split())
    assert fleet.web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "hosts").returncode == 0


def test_web2_over_the_network_with_tls(fleet: Fleet, request: pytest.FixtureRequest) -> None:
    started = time.monotonic()
    text = section(fleet.readme, "Every further host: PostgreSQL over the network, with TLS")
    certificate, listen, on_web2 = sh_blocks(text)
    web1, web2 = fleet.web1, fleet.web2
    # The name every host resolves to the server: README's /etc/hosts line, on both.
    resolve = code_span(text, ">> /etc/hosts")
    for host in (web1, web2):
        host.sh(host.fill(resolve))
    assert fleet.address in web2.read("/etc/hosts") and DB_NAME in web2.read("/etc/hosts")
    # On the database's machine: 1. the certificates, 2. listen with TLS, 3. web-2's role.
    web1.block(certificate, edit_config)
    web1.block(listen, edit_config)
    added = web1.sh(web1.fill(code_span(text, "hosts add web-2"))).stdout
    assert f"host={DB_NAME}" in added and "user=unitvisor_host_web_2" in added, added
    web2.printed.append(added)  # the operator carries the printed DSN line over to web-2
    # On web-2: "install the .deb as above, then copy unitvisor-ca.crt ... to /etc/unitvisor/db-ca.crt"
    assert "install the `.deb` as above" in text
    web2.block(apt_install_line(fleet.readme), edit_config)
    assert "`unitvisor-ca.crt`" in text and "`/etc/unitvisor/db-ca.crt`" in text
    if "unitvisor-ca.crt" not in on_web2:  # the README says to copy it, and not how: as an operator would
        shutil.copy(web1.room.tb.root / "etc/postgresql/15/main/unitvisor-ca.crt",
                    web2.room.tb.root / "etc/unitvisor/db-ca.crt")
    doctor = web2.block(on_web2, edit_config)[-1]
    say(request, f"web-2 set up over TLS in {time.monotonic() - started:.1f}s")
    assert re.search(r"^ok\s+database\b", doctor, re.M), doctor
    assert re.search(r"^ok\s+role\s+host, bound to web-2$", doctor, re.M), doctor
    dsn = web2.read("/etc/unitvisor/dsn").strip()
    assert "sslmode=verify-full" in dsn and "sslrootcert=/etc/unitvisor/db-ca.crt" in dsn, dsn
    fleet.state["web2_dsn"] = dsn
    # web-2's daemon is connected, over TLS, and from the machine's address (the hostssl line's).
    wait_for(lambda: web1.room.psql(
        "SELECT count(*) FILTER (WHERE s.ssl), count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
        "WHERE a.usename = 'unitvisor_host_web_2'") in ("1|1", "2|2", "3|3"),
        timeout=60, what="web-2's daemon's session over TLS")
    # A client without TLS is refused (the first error README names), and one that verifies the wrong
    # name is too.
    plain = dsn.replace("sslmode=verify-full", "sslmode=disable")
    refused = web2.sh(f"unitvisor --dsn '{plain}' runs", check=False)
    if fleet.address != "127.0.0.1":
        assert refused.returncode == 1 and "no pg_hba.conf entry" in refused.stderr \
            and "no encryption" in refused.stderr, refused.stderr
    else:
        say(request, "no global address: Debian's 127.0.0.1 line admits a client without TLS, not checked")
    by_address = dsn.replace(f"host={DB_NAME}", f"host={fleet.address}")
    refused = web2.sh(f"unitvisor --dsn '{by_address}' runs", check=False)
    assert refused.returncode == 1 and "does not match host name" in refused.stderr, refused.stderr


def test_a_run_submitted_on_web1_pinned_to_web2_runs_there_and_is_watched(fleet: Fleet) -> None:
    web1, web2 = fleet.web1, fleet.web2
    code = (f"import os, time\nprint('hello from web-2', flush=True)\n"
            f"while not os.path.exists('{GATE}'): time.sleep(0.2)\n")
    run_id = web1.unitvisor("submit", "--dsn-file", ADMIN_DSN_FILE, "--host", "web-2", "--",
                            "/usr/bin/python3", "-c", code).stdout.strip()
    fleet.state["run"] = run_id

    def show() -> dict:
        return json.loads(web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "show", run_id, "--json").stdout)
    wait_for(lambda: show()["state"] == "running", timeout=90, what="the run to be running on web-2")
    data = show()
    assert data["host_pin"] == "web-2" and data["attempts"][0]["host"] == "web-2", data
    unit = data["attempts"][0]["unit"]
    assert web2.prop(unit, "ActiveState") == "active"
    fleet.state["unit"] = unit
    # On web-2, with its own DSN: its run, and its output from its journal.
    assert run_id in web2.unitvisor("show", run_id).stdout
    wait_for(lambda: "hello from web-2" in web2.unitvisor("logs", run_id).stdout, timeout=30,
             what="the run's output in web-2's journal")


def test_web2_drains_itself_with_its_own_dsn(fleet: Fleet) -> None:
    web1, web2 = fleet.web1, fleet.web2
    text = section(fleet.readme, "Retiring a host")
    drain = code_span(text, "unitvisor drain")
    assert drain == "unitvisor drain", drain
    said = web2.sh(drain).stdout
    assert "web-2" in said and "draining" in said, said
    journal = code_span(text, "host-state")  # what README says the journal says
    wait_for(lambda: journal in web2.daemon_log(), timeout=30, what=f"`{journal}` in web-2's journal")
    wait_for(lambda: re.search(r'Status: ".*; draining', web2.room.run("systemctl", "status", "unitvisor",
                                                                        "--no-pager", check=False).stdout),
             timeout=30, what="web-2's systemctl status to say draining")
    # Its run goes on; a new run pinned to it waits, and show says why.
    assert web2.prop(fleet.state["unit"], "ActiveState") == "active"
    waiting = web1.unitvisor("submit", "--dsn-file", ADMIN_DSN_FILE, "--host", "web-2", "--",
                             "/usr/bin/python3", "-c", "pass").stdout.strip()
    shown = web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "show", waiting).stdout
    assert "pinned to host web-2, which is draining" in shown, shown
    web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "cancel", waiting)
    # 2. Wait until nothing runs: the run ends, recorded; no run unit left; RUNS 0.
    web2.room.run("touch", GATE)
    run_id = fleet.state["run"]
    assert web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "wait", run_id, "--timeout", "90s").returncode == 0
    assert "systemctl list-units 'unitvisor-run-*'" in text
    wait_for(lambda: "0 loaded units listed" in web2.sh("systemctl list-units 'unitvisor-run-*'").stdout,
             timeout=60, what="no unitvisor-run-* unit left on web-2")
    hosts = json.loads(web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "hosts", "--json").stdout)
    (row,) = [h for h in hosts if h["id"] == "web-2"]
    assert (row["state"], row["in_flight"]) == ("draining", 0), row  # "shows 0 in its RUNS column"
    # Watched from web-1: its output's kept tail (written a moment after the outcome: the daemon reads
    # the journal off its loop), and the outcome.
    wait_for(lambda: "hello from web-2" in web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "logs", run_id,
                                                          check=False).stdout,
             timeout=30, what="the run's kept output tail, read from web-1")
    assert web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "show", run_id, "--json").stdout.count('"succeeded"') >= 1


def test_removing_and_purging_the_package_on_web2(fleet: Fleet) -> None:
    web2 = fleet.web2
    removing = section(fleet.readme, "Removing the package")
    assert "`apt remove unitvisor` keeps `/etc/unitvisor`" in removing
    web2.apt("remove", ["unitvisor"])
    assert web2.exists("/etc/unitvisor/dsn") and web2.exists("/etc/unitvisor/db-ca.crt")
    assert not web2.exists("/usr/bin/unitvisor")
    assert web2.prop(SERVICE, "ActiveState") == "inactive"
    assert web2.prop("unitvisor.slice", "ActiveState") == "inactive"
    retiring = section(fleet.readme, "Retiring a host")
    assert code_span(retiring, "apt purge") == "apt purge unitvisor"
    web2.apt("purge", ["unitvisor"])
    assert not web2.exists("/etc/unitvisor"), "purge left /etc/unitvisor"
    assert web2.prop(SERVICE, "LoadState") == "not-found"


def test_web2_forgotten_and_its_login_refused(fleet: Fleet) -> None:
    web1 = fleet.web1
    text = section(fleet.readme, "Retiring a host")
    # 3. After the purge `unitvisor hosts` "shows it `...`": then forget takes it.
    shown = re.search(r"`unitvisor hosts`\s+shows\s+it\s+`([^`]+)`", text)
    assert shown, "README's retirement no longer says what `unitvisor hosts` shows of the removed host"
    state = shown.group(1)
    wait_for(lambda: re.search(rf"^web-2\s.*{re.escape(state)}",
                               web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "hosts").stdout, re.M),
             timeout=90, what=f"web-2 to show {state}")
    (block,) = sh_blocks(text)
    said = web1.block(block, edit_config)[0].strip()
    promised = re.search(r"^# (host web-2 forgotten.*)$", block, re.M)
    assert promised and said == promised.group(1), f"README promises {promised and promised.group(1)!r}, got {said!r}"
    hosts = web1.unitvisor("--dsn-file", ADMIN_DSN_FILE, "hosts").stdout
    assert not re.search(r"^web-2\s", hosts, re.M), hosts
    assert web1.room.psql("SELECT count(*) FROM pg_roles WHERE rolname = 'unitvisor_host_web_2'") == "0"
    # web-2's DSN as it was, from web-1 (purge took web-2's copy of the CA certificate with /etc/unitvisor)
    dsn = fleet.state["web2_dsn"].replace("/etc/unitvisor/db-ca.crt", "/etc/postgresql/15/main/unitvisor-ca.crt")
    refused = web1.sh(f"psql '{dsn}' -c 'SELECT 1'", check=False)
    assert refused.returncode != 0 and "password authentication failed" in refused.stderr, refused.stderr


def test_the_database_machine_taken_apart(fleet: Fleet) -> None:
    """Removing the package, its last block: once every host is retired or removed, the database and
    the roles. web-1 is removed (purged) first, as the section says."""
    web1 = fleet.web1
    web1.apt("purge", ["unitvisor"])
    text = section(fleet.readme, "Removing the package")
    (block,) = sh_blocks(text)
    listed = web1.block(block, edit_config)[0].split()
    assert listed == ["unitvisor_host_web_1"], listed
    assert web1.room.psql("SELECT count(*) FROM pg_database WHERE datname = 'unitvisor'") == "0"
    left = web1.room.psql("SELECT string_agg(rolname, ' ') FROM pg_roles WHERE rolname LIKE 'unitvisor%'")
    assert left == "", f"roles left after README's teardown: {left}"
