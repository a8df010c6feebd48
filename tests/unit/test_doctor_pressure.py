"""doctor's lines on admission by pressure (is PSI readable under the slice, so does the daemon claim
by it) and on the peak tasks (is pids.peak there, so is tasks_peak measured): each branch, on cgroup
trees the test writes. The VM tier checks the real answer on Debian 13 (tests/vm/test_limits.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import config
from supervisor.doctor import pressure_check, tasks_peak_check

SLICE = "unitvisor.slice"
PSI = "some avg10={:.2f} avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
DEFAULTS = config.HostSettings()


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A cgroup-v2 root with the slice and its pressure files, and /proc/pressure."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc-pressure"
    (root / SLICE).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    proc.mkdir()
    for name in ("memory", "io", "cpu"):
        (proc / name).write_text(PSI.format(0))
        (root / SLICE / f"{name}.pressure").write_text(PSI.format(0))
    return root, proc


def check(tree: tuple[Path, Path], host: config.HostSettings = DEFAULTS):
    return pressure_check(host, SLICE, tree[0], tree[1])


def test_psi_under_the_slice_means_admission_by_pressure_is_active(tree: tuple[Path, Path]) -> None:
    got = check(tree)
    assert got.status == "ok", got
    assert f"PSI read from {SLICE}'s pressure files: admission by pressure active" in got.message
    assert "memory, io; slows at 10%, stops at 40%" in got.message


def test_a_slice_without_a_cgroup_yet_is_active_through_proc_pressure(tree: tuple[Path, Path]) -> None:
    for path in (tree[0] / SLICE).iterdir():
        path.unlink()
    (tree[0] / SLICE).rmdir()
    got = check(tree)
    assert got.status == "ok" and "admission by pressure active" in got.message, got
    assert f"no run in {SLICE} yet" in got.message


def test_a_cgroup_v1_host_has_no_psi_and_admission_by_pressure_is_off(tree: tuple[Path, Path]) -> None:
    (tree[0] / "cgroup.controllers").unlink()
    got = check(tree)
    assert got.status == "warn", got
    assert got.message.startswith("PSI unavailable (") and "is not cgroup v2" in got.message
    assert "admission by pressure is off" in got.message


def test_a_kernel_without_psi_turns_it_off_and_says_why(tree: tuple[Path, Path]) -> None:
    for name in ("memory", "io", "cpu"):
        (tree[1] / name).unlink()
    got = check(tree)
    assert got.status == "warn" and "psi=1" in got.message and "off" in got.message, got


def test_a_pressure_file_missing_under_the_slice_turns_it_off(tree: tuple[Path, Path]) -> None:
    (tree[0] / SLICE / "io.pressure").unlink()
    got = check(tree)
    assert got.status == "warn" and "io.pressure does not exist" in got.message, got


def test_off_by_the_administrators_choice_is_no_warning(tree: tuple[Path, Path]) -> None:
    got = check(tree, config.HostSettings(pressure_resources=()))
    assert (got.status, got.message) == ("ok", "admission by pressure off by [host] pressure_resources = []")


def test_a_slice_under_pressure_now_is_said(tree: tuple[Path, Path]) -> None:
    (tree[0] / SLICE / "memory.pressure").write_text(PSI.format(55))
    got = check(tree)
    assert got.status == "warn", got
    assert "admission by pressure active" in got.message
    assert got.message.endswith("now memory pressure 55.0% (avg10) >= 40%: claiming nothing")


def test_tasks_peak_is_measured_on_cgroup_v2_with_pids_on_linux_6_1(tree: tuple[Path, Path]) -> None:
    got = tasks_peak_check(tree[0], "6.12.48+deb13-amd64")
    assert (got.status, got.message) == ("ok", "measured (each run's cgroup's pids.peak, read as its unit ends)")


@pytest.mark.parametrize("controllers, release, why", [
    # a cgroup-v1 or hybrid host: no cgroup.controllers at the root
    (None, "6.12.48+deb13-amd64", "is not cgroup v2 (a v1 or hybrid hierarchy)"),
    ("cpuset cpu io memory\n", "6.12.48+deb13-amd64", "without the pids controller"),
    # Debian 11's kernel, before pids.peak (Linux 6.1)
    ("cpuset cpu io memory pids\n", "5.10.0-30-amd64", "Linux 5.10.0-30-amd64 is older than 6.1"),
])
def test_tasks_peak_is_not_measured_and_says_why_and_what_it_needs(tree: tuple[Path, Path], controllers: str | None,
                                                                 release: str, why: str) -> None:
    if controllers is None:
        (tree[0] / "cgroup.controllers").unlink()
    else:
        (tree[0] / "cgroup.controllers").write_text(controllers)
    got = tasks_peak_check(tree[0], release)
    assert got.status == "warn", got
    assert "not measured" in got.message and "pids.peak" in got.message and "NULL" in got.message
    assert why in got.message and "Linux 6.1 or later" in got.message, got.message
