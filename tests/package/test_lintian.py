"""lintian on the built .deb, that of Debian 12 (this machine's) and that of Debian 13 (in the trixie
chroot, tests/harness/trixie.py): no error and no warning from either; what is overridden says why."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import _unavailable
from tests.harness import trixie
from tests.harness.host import REPO

OVERRIDES = REPO / "debian" / "unitvisor.lintian-overrides"
LINTIAN = ["lintian", "--allow-root", "--info", "--show-overrides", "--fail-on", "error,warning"]


def _lintian(release: str, deb: Path) -> subprocess.CompletedProcess[str]:
    if release == "bookworm":
        if not shutil.which("lintian"):
            _unavailable("lintian is not installed (apt-get install lintian)")
        return subprocess.run([*LINTIAN, str(deb)], capture_output=True, text=True, timeout=600, check=False)
    reason = trixie.available()
    if reason:
        _unavailable(reason)
    return trixie.run([*LINTIAN, str(deb)], binds=[str(deb.parent)], timeout=600)


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_lintian_reports_no_error_and_no_warning(deb: Path, release: str) -> None:
    result = _lintian(release, deb)
    print(result.stdout)  # the whole report, overrides and infos included, in the test log
    tags = [line for line in result.stdout.splitlines() if re.match(r"[EW]: ", line)]
    assert not tags, "\n".join(tags)
    assert "unused-override" not in result.stdout, "an override no longer matches: remove it"
    assert result.returncode == 0, result.stderr


def test_every_lintian_override_has_a_reason() -> None:
    lines = OVERRIDES.read_text().splitlines()
    for number, line in enumerate(lines):
        if line.strip() and not line.startswith("#"):
            assert number > 0 and lines[number - 1].startswith("#"), f"override without a reason comment: {line}"
