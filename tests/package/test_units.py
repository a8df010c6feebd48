"""The units in units/ (the source of truth the package installs) as systemd reads them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from supervisor import __version__, runenv
from tests.conftest import _unavailable
from tests.harness.host import REPO

UNITS = ("unitvisor.service", "unitvisor-fence.service", "unitvisor.slice")


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


def unit_settings(name: str) -> dict[str, list[str]]:
    """Every Key=value of the unit file, by key, in order (comments and continuations left out)."""
    settings: dict[str, list[str]] = {}
    for line in (REPO / "units" / name).read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, f"not a plain time span: {value}"
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def start_limit_can_trip(interval: float, burst: int, restart_sec: float) -> bool:
    """Whether restarts alone can hit the start limit: starts are at least restart_sec apart, so at
    most interval // restart_sec + 1 fit in one interval. (interval 0 turns the limit off.)"""
    return interval > 0 and interval // restart_sec + 1 > burst


def test_the_restart_policy_is_what_the_units_comments_promise() -> None:
    """Never left permanently failed (the start limit cannot trip), every unasked exit restarted,
    and a configuration that does not parse restarts at most 6 times a minute."""
    unit = unit_settings("unitvisor.service")
    assert unit["Restart"] == ["always"]
    restart_sec = seconds(unit["RestartSec"][-1])
    assert 60 / restart_sec <= 6, "a broken configuration would spin hot"
    # systemd's defaults (DefaultStartLimitIntervalSec=10s, Burst=5) apply when the unit says nothing.
    interval = seconds(unit.get("StartLimitIntervalSec", ["10s"])[-1])
    burst = int(unit.get("StartLimitBurst", ["5"])[-1])
    assert not start_limit_can_trip(interval, burst, restart_sec)
    # The old policy (2 s, 10 in 300 s) could: a database outage that made the daemon crash for
    # 20 s left the host failed for good.
    assert start_limit_can_trip(300, 10, 2)
    # Nothing else stops the restarts.
    for key in ("RestartPreventExitStatus", "StartLimitAction"):
        assert key not in unit, f"{key}= would undo the promise; say why in the unit and here"


def test_the_runtime_directory_holds_the_runs_environment_files_root_only() -> None:
    """supervisor/runenv.py writes each run's environment under /run/unitvisor, which ProtectSystem=
    strict leaves writable only as the daemon's RuntimeDirectory=: root-only, and kept when the
    daemon stops, because a run whose start job PID 1 has not run yet still needs its file."""
    unit = unit_settings("unitvisor.service")
    assert unit["ProtectSystem"] == ["strict"]
    assert unit["RuntimeDirectory"] == ["unitvisor"]
    assert unit["RuntimeDirectoryMode"] == ["0700"]
    assert unit["RuntimeDirectoryPreserve"] == ["yes"]
    assert runenv.DIRECTORY.parent == Path("/run") / unit["RuntimeDirectory"][0]


def test_the_fence_outlives_the_daemon_and_shares_its_runtime_directory() -> None:
    """unitvisor-fence.service (supervisor/fence.py) keeps stop_runs_when_cut_off's promise while the
    daemon is down: started with the daemon and at boot, never stopped with it, always restarted, and
    reading the lease where the daemon writes it."""
    fence, daemon = unit_settings("unitvisor-fence.service"), unit_settings("unitvisor.service")
    assert "unitvisor-fence.service" in " ".join(daemon["Wants"])
    assert fence["WantedBy"] == ["multi-user.target"]
    for key in ("PartOf", "BindsTo", "Requisite", "StopWhenUnneeded"):
        assert key not in fence, f"{key}= would stop the fence with the daemon"
    assert fence["Restart"] == ["always"]
    assert not start_limit_can_trip(seconds(fence.get("StartLimitIntervalSec", ["10s"])[-1]),
                                    int(fence.get("StartLimitBurst", ["5"])[-1]), seconds(fence["RestartSec"][-1]))
    for key in ("RuntimeDirectory", "RuntimeDirectoryMode", "RuntimeDirectoryPreserve"):
        assert fence[key] == daemon[key]
    assert fence["ExecStart"] == ["/usr/bin/unitvisor fence"]


def test_documentation_points_at_what_the_package_installs() -> None:
    """Documentation= of every unit is the man page and files under /usr/share/doc/unitvisor, which
    `systemctl help` opens on a host (test_deb_contents.py checks that the .deb ships each file).
    (Failed before: https://example.invalid/unitvisor.)"""
    for name in UNITS:
        urls = " ".join(unit_settings(name)["Documentation"]).split()
        assert "man:unitvisor(1)" in urls, name
        assert all(re.fullmatch(r"man:unitvisor\(1\)|file:///usr/share/doc/unitvisor/[\w.-]+", u) for u in urls), urls
