"""piuparts on the built .deb, for Debian 12 (bookworm) and 13 (trixie): Debian's own check that the
package installs into a minimal system of that release with its dependencies, removes and purges,
and leaves no file behind and none of another package's changed. The upgrade from the previous
release is test_upgrade.py's (unitvisor is not in Debian's archive, so piuparts has nothing to
upgrade from).

Each release's base system (piuparts' minimal chroot, as a tarball) is cached under CACHE, named after
the release, the mirror and piuparts' version, and made by the first run that misses it (that run's
`--save`); later runs start from it (`--basetgz`). Each run still downloads the package's dependencies
from the mirror (18 to 28 MB: python3 and the python3-* libraries), as piuparts installs them in a
fresh copy of the base every time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import _unavailable
from tests.harness.cleanroom import CACHE, mirror

RELEASES = ("bookworm", "trixie")
# Not unitvisor's: what its dependency systemd leaves when piuparts installs it into its base (which
# has no systemd) and keeps after the purge, as piuparts removes only the package under test. systemd's
# postinst creates them with systemd-tmpfiles (DynamicUser's private directories, coredump, pstore;
# from 256 on /root/.ssh, provision.conf) and, on trixie, links /etc/vconsole.conf and
# /etc/default/locale; trixie's debconf leaves its temporary directory. bookworm's piuparts 1.1.7 knows
# none of them (piuparts.debian.org tests with systemd in its base). Every other file left is a failure.
DEPENDENCY_LEFTOVERS = (
    "/root/.ssh/", "/var/cache/private/", "/var/lib/private/", "/var/log/private/", "/var/lib/systemd/coredump/",
    "/var/lib/systemd/pstore/", "/etc/vconsole.conf", "/etc/default/locale", "/var/cache/debconf/tmp.ci/",
)


def _piuparts_version() -> str:
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", "piuparts"], capture_output=True, text=True,
                          check=False).stdout.strip()


def _base(suite: str) -> Path:
    key = json.dumps([suite, mirror(), _piuparts_version()])
    return CACHE / f"piuparts-{suite}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.tgz"


@pytest.mark.parametrize("suite", RELEASES)
def test_piuparts_installs_removes_and_purges_cleanly(deb: Path, suite: str, tmp_path: Path) -> None:
    if not shutil.which("piuparts"):
        _unavailable("piuparts is not installed (apt-get install piuparts)")
    base = _base(suite)
    log = tmp_path / "piuparts.log"
    cmd = ["piuparts", "--distribution", suite, "--mirror", mirror(), "--no-upgrade-test",
           "--log-file", str(log), "--tmpdir", str(tmp_path), *(f"--ignore={path}" for path in DEPENDENCY_LEFTOVERS)]
    CACHE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # Under a lock per release: a session that misses the base makes it while the others wait, then
    # starts from it.
    with open(CACHE / f".piuparts-{suite}-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = base.with_name(base.name + ".tmp")
        if base.is_file():
            fcntl.flock(lock, fcntl.LOCK_UN)
            cmd += ["--basetgz", str(base)]
        else:
            saved.unlink(missing_ok=True)
            cmd += ["--save", str(saved)]
        result = subprocess.run([*cmd, str(deb)], capture_output=True, text=True, timeout=1800, check=False)
        if saved.is_file():
            saved.rename(base)
    print(f"piuparts {suite}: {time.monotonic() - started:.0f}s")
    report = log.read_text(errors="replace") if log.is_file() else result.stdout + result.stderr
    problems = [line for line in report.splitlines() if " ERROR: " in line or " FAIL: " in line]
    assert result.returncode == 0, "\n".join(problems[-40:] or report.splitlines()[-60:])
    assert "PASS: All tests." in report, report[-5000:]
