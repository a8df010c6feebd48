"""The package level: build the .deb once per session with packaging/build-deb (as a user would),
then check it with lintian, systemd-analyze and a clean-room install (test_cleanroom.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import _unavailable
from tests.harness.host import REPO


@pytest.fixture(scope="session")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0 and not shutil.which("dpkg-buildpackage"):
        _unavailable("building the .deb needs dpkg-dev and debhelper (packaging/build-deb installs them as root)")
    # A directory of this session's own, so that a parallel session (another checkout's CI) building
    # into build/deb cannot swap the file under this one.
    out = tmp_path_factory.mktemp("deb")
    started = time.monotonic()
    result = subprocess.run([str(REPO / "packaging" / "build-deb")], env={**os.environ, "OUT": str(out)},
                            capture_output=True, text=True, timeout=1200, check=False)
    if result.returncode != 0:
        pytest.fail(f"packaging/build-deb exited {result.returncode}:\n{result.stderr[-5000:]}", pytrace=False)
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path.is_file() and path.name.endswith("_all.deb"), result.stdout
    print(f"built {path.name} in {time.monotonic() - started:.1f}s")
    return path
