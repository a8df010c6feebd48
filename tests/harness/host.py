"""A unitvisor host inside a test bed: the real unit files, the daemon from this checkout's
virtualenv, a config and a DSN file, and helpers to drive and observe it as an operator would."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tests.harness.testbed import Testbed

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
# The daemon and the CLI inside the test bed come from the virtualenv running the tests (.venv with
# PyPI's newest, or .venv-debian with bookworm's packages), bound in with the checkout.
_PREFIX = Path(sys.prefix).resolve()
VENV_BIN = (_PREFIX if _PREFIX.is_relative_to(REPO) else REPO / ".venv") / "bin"

DEFAULT_CONFIG = """
[host]
id = "{host_id}"
name = "{host_id}"

[daemon]
poll_interval = "2s"
reconcile_interval = "30s"

[systemd]
stop_grace = "3s"

[runs]
allowed_executables = ["/bin/sh", "/bin/true", "/bin/false", "/bin/sleep", "/usr/bin/*"]
{runs_extra}
"""


GATES = "/run/unitvisor-test-gates"
_GATE_NAME_RE = re.compile(r"^[a-z0-9-]{1,40}\Z")


def wait_for(predicate: Callable[[], T], timeout: float = 30, interval: float = 0.2, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


class Host:
    def __init__(self, testbed: Testbed, dsn: str, host_id: str = "testhost-1") -> None:
        self.tb = testbed
        self.dsn = dsn
        self.host_id = host_id

    def configure(self, runs_extra: str = "", config: str | None = None) -> None:
        text = config if config is not None else DEFAULT_CONFIG.format(host_id=self.host_id, runs_extra=runs_extra)
        self.tb.write("/etc/unitvisor/unitvisor.toml", text)
        self.tb.write("/etc/unitvisor/dsn", self.dsn + "\n")
        (self.tb.root / "etc/unitvisor/dsn").chmod(0o600)

    def install_units(self, environment: dict[str, str] | None = None, user: str | None = None) -> None:
        for name in ("unitvisor.service", "unitvisor-fence.service", "unitvisor.slice"):
            self.tb.write(f"/etc/systemd/system/{name}", (REPO / "units" / name).read_text())
        env_lines = "".join(f'Environment="{k}={v}"\n' for k, v in (environment or {}).items())
        if user:
            env_lines += f"User={user}\n"
        # The packaged unit runs /usr/bin/unitvisor; here the checkout's virtualenv stands in for the
        # package. Restart=no so that a drill decides when the daemon comes back. The checkout may be
        # anywhere (CI clones under /tmp or /root), which PrivateTmp= and ProtectHome= would hide:
        # bind it back in, read-only, with the unit's hardening otherwise as shipped.
        self.tb.write("/etc/systemd/system/unitvisor.service.d/test.conf",
                      f"[Service]\nExecStart=\nExecStart={VENV_BIN}/unitvisor daemon\nRestart=no\n"
                      f"BindReadOnlyPaths={REPO}\n{env_lines}")
        # The fence (supervisor/fence.py) as shipped, but for the same stand-in for the package; it keeps
        # its Restart=always: a drill stops the daemon, never the fence.
        self.tb.write("/etc/systemd/system/unitvisor-fence.service.d/test.conf",
                      f"[Service]\nExecStart=\nExecStart={VENV_BIN}/unitvisor fence\nBindReadOnlyPaths={REPO}\n")
        self.tb.run("systemctl", "daemon-reload")

    def start(self, environment: dict[str, str] | None = None, configure: bool = True, user: str | None = None) -> None:
        if configure and not (self.tb.root / "etc/unitvisor/unitvisor.toml").exists():
            self.configure()
        self.install_units(environment, user)
        result = self.tb.run("systemctl", "start", "unitvisor.service", check=False, timeout=120)
        if result.returncode != 0:
            raise AssertionError(f"unitvisor.service did not start: {result.stderr.strip()}\n{self.daemon_log()}")

    def stop(self) -> None:
        self.tb.run("systemctl", "stop", "unitvisor.service", check=False, timeout=60)

    def kill(self) -> None:
        """kill -9 the daemon, as a crash would."""
        self.tb.run("systemctl", "kill", "--signal=SIGKILL", "unitvisor.service", check=False)
        wait_for(lambda: self.tb.run("systemctl", "is-active", "unitvisor.service", check=False).stdout.strip()
                 in ("failed", "inactive"), what="the daemon to die")

    def fence_log(self) -> str:
        return self.tb.run("journalctl", "-u", "unitvisor-fence.service", "--no-pager", "-o", "cat", "-n", "200",
                           check=False).stdout

    def daemon_log(self) -> str:
        return self.tb.run("journalctl", "-u", "unitvisor.service", "--no-pager", "-o", "cat", "-n", "200",
                           check=False).stdout

    def cli(self, *args: str, check: bool = True) -> Any:
        """Run the unitvisor command inside the host, as an operator would."""
        result = self.tb.run(str(VENV_BIN / "unitvisor"), "--dsn", self.dsn, *args, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"unitvisor {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def submit(self, *args: str) -> str:
        return self.cli("submit", *args).stdout.strip()

    def show(self, run_id: str) -> dict[str, Any]:
        return json.loads(self.cli("show", run_id, "--json").stdout)

    def wait_run(self, run_id: str,
                 states: tuple[str, ...] = ("succeeded", "failed", "cancelled", "expired", "skipped"),
                 timeout: float = 60) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            data = self.show(run_id)
            return data if data["state"] in states else None
        try:
            return wait_for(check, timeout, what=f"run {run_id} to reach {states}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.show(run_id)}\n{self.daemon_log()}") from None

    def gated(self, name: str, exit_code: int = 0) -> list[str]:
        """A command that runs until the test opens its gate (`open_gate(name)`), then exits with
        `exit_code`: a run whose end the test decides, where a `sleep` could end before a loaded
        machine let the test see it running. (/run is shared with the units, read-only to them.)"""
        if not _GATE_NAME_RE.match(name):
            raise ValueError(f"bad gate name {name!r}")
        self.tb.run("mkdir", "-p", "-m", "0755", GATES)
        return ["/bin/sh", "-c", f"while [ ! -e {GATES}/{name} ]; do sleep 0.1; done; exit {exit_code}"]

    def open_gate(self, *names: str) -> None:
        self.tb.run("touch", *(f"{GATES}/{name}" for name in names))

    def unit_props(self, unit: str, *props: str) -> dict[str, str]:
        out = self.tb.run("systemctl", "show", unit, *(f"--property={p}" for p in props), check=False).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def loaded_run_units(self) -> list[str]:
        out = self.tb.run("systemctl", "list-units", "--all", "--plain", "--no-legend", "unitvisor-run-*",
                          check=False).stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def reset(self) -> None:
        """Back to a clean host between tests: daemon stopped, no run unit left."""
        self.stop()
        self.tb.run("systemctl", "stop", "unitvisor-fence.service", check=False, timeout=60)
        self.tb.run("systemctl", "stop", "unitvisor-run-*", check=False, timeout=60)
        self.tb.run("systemctl", "reset-failed", check=False)
        # /run/unitvisor outlives the daemon (RuntimeDirectoryPreserve=): no test sees another's files.
        self.tb.run("rm", "-rf", "/etc/unitvisor", "/etc/systemd/system/unitvisor.service.d",
                    "/etc/systemd/system/unitvisor-fence.service.d", GATES, "/run/unitvisor",
                    check=False)


def journal_invocations(host: Host, unit: str) -> set[str]:
    """Distinct invocation ids PID 1 ever logged for a unit: how many times it was really started."""
    out = host.tb.run("journalctl", "--no-pager", "-o", "json", "_PID=1", f"UNIT={unit}", check=False).stdout
    ids = set()
    for line in out.splitlines():
        value = json.loads(line).get("INVOCATION_ID")
        if isinstance(value, str) and value:
            ids.add(value)
    return ids


def daemon_active(host: Host) -> str:
    return host.tb.run("systemctl", "is-active", "unitvisor.service", check=False).stdout.strip()
