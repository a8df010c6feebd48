"""`make try`: the main job on real parts, narrated.

Starts a throwaway PostgreSQL, boots a throwaway systemd host, runs the unitvisor daemon in it under
the real unitvisor.service, submits a few runs with limits, shows them through `unitvisor runs`,
`systemctl status` and `journalctl`, then removes everything it made.
"""

from __future__ import annotations

import shlex
import sys
import time

from supervisor import store
from tests.harness import testbed as testbed_mod
from tests.harness.host import REPO, Host, wait_for
from tests.harness.postgres import Postgres


def step(host: Host, *cmd: str, cli: bool = False) -> str:
    shown = ("unitvisor",) + cmd if cli else cmd
    print(f"\n$ {shlex.join(shown)}", flush=True)
    result = host.cli(*cmd, check=False) if cli else host.tb.run(*cmd, check=False)
    text = (result.stdout + result.stderr).rstrip()
    print(text, flush=True)
    return result.stdout.strip()


def main() -> int:
    reason = testbed_mod.available()
    if reason:
        print(f"cannot run the demo: {reason}", file=sys.stderr)
        return 1
    testbed_mod.cleanup_stale()
    pg = Postgres()
    try:
        print("starting a throwaway PostgreSQL ...", flush=True)
        pg.init()
        pg.start()
        with store.connect(pg.dsn) as conn:
            print("schema:", ", ".join(store.migrate(conn)))
        print("booting a throwaway systemd host (systemd-nspawn) ...", flush=True)
        with testbed_mod.Testbed("uv-demo", binds=[REPO]) as tb:
            host = Host(tb, pg.dsn, host_id="demo-host")
            host.configure()
            host.start()
            step(host, "systemctl", "status", "unitvisor.service", "--no-pager", "--lines=0")
            ok = step(host, "submit", "--memory", "256M", "--cpu", "50%", "--tasks", "32", "--",
                      "/bin/sh", "-c", "echo hello from a run; sleep 4", cli=True)
            step(host, "submit", "--memory", "64M", "--", "/bin/sh", "-c", "echo failing on purpose >&2; exit 3",
                 cli=True)
            step(host, "submit", "--", "/usr/local/bin/not-allowed", cli=True)
            time.sleep(1.5)
            step(host, "runs", cli=True)
            unit = f"unitvisor-run-{ok}-1.service"
            step(host, "systemctl", "status", unit, "--no-pager")
            step(host, "systemctl", "show", unit, "-p", "MemoryMax", "-p", "CPUQuotaPerSecUSec", "-p", "TasksMax")
            wait_for(lambda: host.show(ok)["state"] == "succeeded", timeout=30, what="the first run")
            step(host, "runs", cli=True)
            step(host, "show", ok[:8], cli=True)
            step(host, "journalctl", f"UNITVISOR_RUN={ok}", "--no-pager", "-o", "short")
            step(host, "journalctl", "-u", "unitvisor.service", "--no-pager", "-o", "cat")
            host.stop()
        print("\ndemo done; the test bed and the database are gone.")
        return 0
    finally:
        pg.stop()


if __name__ == "__main__":
    sys.exit(main())
