"""The peak-tasks stop command (run here by the shell a unit runs it with, /bin/sh) and the files it
leaves (supervisor/taskspeak.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from supervisor import taskspeak

UNIT = "unitvisor-run-0b7e8f5a-6a53-4c53-9a0e-8c2b1e8d1a11-1.service"
V2 = f"0::/unitvisor.slice/{UNIT}\n"
# A hybrid (cgroup v1) host: the controllers' own lines, and the unified line of systemd's tree alone.
HYBRID = f"12:pids:/unitvisor.slice/{UNIT}\n4:memory:/unitvisor.slice/{UNIT}\n0::/unitvisor.slice/{UNIT}\n"


def run_script(tmp_path: Path, proc_cgroup: str, peak: str | None) -> tuple[subprocess.CompletedProcess, Path]:
    """The script against a fake /proc/self/cgroup and cgroup tree, as PID 1 would run it."""
    out, root = tmp_path / "tasks-peak", tmp_path / "cgroup"
    out.mkdir()
    cgroup = root / "unitvisor.slice" / UNIT
    cgroup.mkdir(parents=True)
    if peak is not None:
        (cgroup / "pids.peak").write_text(peak)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_cgroup)
    script = taskspeak.stop_post_script(out, root, proc)
    done = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=10, check=False)
    return done, out


def test_the_command_copies_the_units_pids_peak_under_its_name(tmp_path: Path) -> None:
    done, out = run_script(tmp_path, V2, "21\n")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert (out / UNIT).read_text() == "21\n"
    assert taskspeak.TasksPeakFiles(out).read(UNIT) == 21


@pytest.mark.parametrize("proc_cgroup, peak", [
    (HYBRID, None),  # cgroup v1: no pids.peak in the unified tree
    (V2, None),  # a kernel before 6.1
    ("0::/\n", "5\n"),  # the root cgroup: no unit's
    ("", "5\n"),
])
def test_no_pids_peak_writes_nothing_prints_nothing_and_exits_0(tmp_path: Path, proc_cgroup: str,
                                                                 peak: str | None) -> None:
    """A figure that cannot be copied never changes how the run ended, nor its output."""
    done, out = run_script(tmp_path, proc_cgroup, peak)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert os.listdir(out) == []


def test_no_directory_writes_nothing_and_exits_0(tmp_path: Path) -> None:
    _, out = run_script(tmp_path, V2, "3\n")
    (out / UNIT).unlink()
    out.rmdir()
    done = subprocess.run(["/bin/sh", "-c", taskspeak.stop_post_script(out, tmp_path / "cgroup",
                                                                       tmp_path / "proc-self-cgroup")],
                          capture_output=True, text=True, timeout=10, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert not out.exists()


def test_the_command_is_fixed_privileged_unexpanded_and_holds_no_run_data() -> None:
    path, argv, flags = taskspeak.STOP_POST_COMMAND
    assert path == b"/bin/sh" and argv[:2] == [b"/bin/sh", b"-c"]
    assert set(flags) == {b"privileged", b"ignore-failure", b"no-env-expand"}
    # No specifier (%) for systemd to expand, and the directory is the daemon's root-only one.
    assert b"%" not in argv[2] and b"/run/unitvisor/tasks-peak" in argv[2]


@pytest.mark.parametrize("text, value", [
    ("21\n", 21), ("0", 0), ("", None), ("max\n", None), ("-1", None), ("2\n3", None), (str(2**63), None),
    ("١٢", None),  # digits, but not ASCII ones
])
def test_parse(text: str, value: int | None) -> None:
    assert taskspeak.parse(text) == value


def test_files_read_remove_and_list(tmp_path: Path) -> None:
    files = taskspeak.TasksPeakFiles(tmp_path / "unitvisor" / "tasks-peak")
    files.ensure_directory()
    files.ensure_directory()  # again: nothing to do
    assert files.read(UNIT) is None and files.listing() == []
    files.path(UNIT).write_text("7\n")
    (files.directory / "other.service").mkdir()  # not a regular file: never believed
    assert files.read(UNIT) == 7 and files.read("other.service") is None
    assert files.listing() == sorted([UNIT, "other.service"])
    assert files.remove(UNIT) and not files.remove(UNIT)
    with pytest.raises(ValueError):
        files.path("../etc/passwd")


@pytest.mark.parametrize(("controllers", "release", "expected"), [
    ("cpuset cpu io memory hugetlb pids rdma misc\n", "6.12.118-amd64", True),  # Debian 13
    ("cpuset cpu io memory pids\n", "6.1.0-28-amd64", True),  # Debian 12 on cgroup v2: pids.peak came with 6.1
    ("cpuset cpu io memory pids\n", "5.19.0", False),
    ("cpuset cpu io memory\n", "6.12.0", False),  # no pids controller
    ("", "6.12.0", False),  # a hybrid host's unified tree: no controllers
    (None, "6.12.0", False),  # cgroup v1 alone: no cgroup.controllers at all
    ("pids\n", "not-a-version", False),
])
def test_available_only_where_the_kernel_keeps_a_pids_peak(tmp_path: Path, controllers: str | None, release: str,
                                                            expected: bool) -> None:
    if controllers is not None:
        (tmp_path / "cgroup.controllers").write_text(controllers)
    assert taskspeak.available(tmp_path, release) is expected
