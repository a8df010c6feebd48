"""What a cgroup-v2 host is, for pressure.py, taskspeak.py and doctor.py alike (supervisor/cgroup.py)."""

from __future__ import annotations

from pathlib import Path

from supervisor import cgroup


def test_a_v2_root_offers_the_controllers_its_file_names(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    assert cgroup.controllers(tmp_path) == {"cpuset", "cpu", "io", "memory", "hugetlb", "pids", "rdma", "misc"}


def test_a_v2_root_without_controllers_is_v2_all_the_same(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("\n")
    assert cgroup.controllers(tmp_path) == frozenset()


def test_a_v1_or_hybrid_root_has_no_controllers_file_and_is_not_v2(tmp_path: Path) -> None:
    # A hybrid host's /sys/fs/cgroup: v1 trees and a controller-less `unified`, no file at the root.
    (tmp_path / "pids").mkdir()
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("")
    assert cgroup.controllers(tmp_path) is None


def test_an_unreadable_controllers_file_is_not_v2(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").mkdir()  # read_text raises IsADirectoryError, an OSError
    assert cgroup.controllers(tmp_path) is None


def test_every_module_that_reads_the_tree_reads_it_at_the_one_root() -> None:
    # Each takes the root as a parameter (for the tests); by default they must all look at the same one.
    import inspect

    from supervisor import doctor, pressure, taskspeak

    for function in (pressure.read, taskspeak.available, taskspeak.stop_post_script, doctor.cgroup_check,
                     doctor.pressure_check, doctor.tasks_peak_check):
        defaults = [p.default for p in inspect.signature(function).parameters.values()
                    if p.name in ("root", "cgroup_root")]
        assert defaults == [cgroup.ROOT], function.__qualname__
