"""The units in units/ (the source of truth the package installs) as systemd reads them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from supervisor import __version__
from tests.conftest import _unavailable
from tests.harness.host import REPO

UNITS = ("unitvisor.service", "unitvisor.slice")


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    if not shutil.which("systemd-analyze"):
        _unavailable("systemd-analyze is not installed (apt-get install systemd)")
    # verify checks that ExecStart= exists, and /usr/bin/unitvisor exists only where the package is
    # installed: here the unit points at a stand-in, every other line is as shipped. (The clean-room
    # test verifies the installed units unchanged, man page included.)
    stub = tmp_path / "unitvisor"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    for name in UNITS:
        text = (REPO / "units" / name).read_text()
        (tmp_path / name).write_text(re.sub(r"(?m)^ExecStart=/usr/bin/unitvisor ", f"ExecStart={stub} ", text))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(tmp_path / n) for n in UNITS)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_package_version_is_the_code_version() -> None:
    first = (REPO / "debian" / "changelog").read_text().splitlines()[0]
    version = re.match(r"unitvisor \(([^)]+)\)", first)
    assert version and version.group(1) == __version__, "debian/changelog and supervisor.__version__ differ"
