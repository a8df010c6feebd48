"""Admission by pressure: the pure policy (decide), the parser of a PSI file, and the shell that reads
them (read), with every way a read can fail."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from supervisor import config, pressure
from supervisor.pressure import OFF, OPEN, SLOWED, STOPPED, Admission, PressureError, Reading

PSI = ("some avg10={some:.2f} avg60=1.00 avg300=0.50 total=123456\n"
       "full avg10={full:.2f} avg60=0.00 avg300=0.00 total=2345\n")


def psi(some: float, full: float = 0.0) -> str:
    return PSI.format(some=some, full=full)


# -- parse --------------------------------------------------------------------------------------


def test_parse_takes_avg10_of_some_not_of_full() -> None:
    assert pressure.parse(psi(12.34, 99.0)) == 12.34


def test_parse_reads_a_file_with_some_alone_as_the_cpu_file_of_older_kernels() -> None:
    assert pressure.parse("some avg10=3.50 avg60=0.00 avg300=0.00 total=1\n") == 3.5


@pytest.mark.parametrize("text", [
    "",
    "full avg10=1.00 avg60=0.00 avg300=0.00 total=1\n",
    "some avg60=1.00 avg300=0.00 total=1\n",
    "some avg10=abc avg60=1.00\n",
    "some avg10=-1.00\n",
    "some avg10=100.01\n",
    "some avg10=nan\n",
    "\x00\x00",
])
def test_parse_refuses_what_the_kernel_does_not_write(text: str) -> None:
    with pytest.raises(PressureError):
        pressure.parse(text)


# -- decide -------------------------------------------------------------------------------------


def reading(**figures: float) -> Reading:
    return Reading(dict(figures))


@pytest.mark.parametrize("figure, state, limit", [
    (0.0, OPEN, None),
    (9.99, OPEN, None),
    (10.0, SLOWED, 32),      # at the slow level: the whole batch, but one claim a poll interval
    (25.0, SLOWED, 16),      # halfway: half the batch
    (39.0, SLOWED, 1),       # just under the stop level: one run
    (39.99, SLOWED, 1),
    (40.0, STOPPED, 0),
    (100.0, STOPPED, 0),
])
def test_decide_opens_slows_then_stops_as_the_figure_rises(figure: float, state: str, limit: int | None) -> None:
    admission = pressure.decide(reading(memory=figure), 10.0, 40.0, 32)
    assert (admission.state, admission.limit) == (state, limit)
    assert admission.resource == (None if state == OPEN else "memory") and admission.figure == figure


def test_decide_resumes_as_soon_as_the_figure_falls() -> None:
    """No memory of its own: a figure under the slow level opens the host again, whatever it was before
    (avg10 is already a 10 s average, which is the hysteresis)."""
    assert pressure.decide(reading(memory=80.0), 10.0, 40.0, 32).state == STOPPED
    assert pressure.decide(reading(memory=20.0), 10.0, 40.0, 32).state == SLOWED
    assert pressure.decide(reading(memory=1.0), 10.0, 40.0, 32).state == OPEN


def test_decide_the_highest_watched_figure_decides_and_is_named() -> None:
    admission = pressure.decide(reading(memory=5.0, io=45.0, cpu=0.0), 10.0, 40.0, 32)
    assert (admission.state, admission.resource, admission.figure) == (STOPPED, "io", 45.0)
    assert admission.detail == "io pressure 45.0% (avg10) >= 40%: claiming nothing"


def test_decide_a_tie_names_one_resource_always_the_same() -> None:
    assert pressure.decide(reading(memory=50.0, io=50.0), 10.0, 40.0, 32).resource == "io"
    assert pressure.decide(reading(io=50.0, memory=50.0), 10.0, 40.0, 32).resource == "io"


def test_decide_equal_levels_go_from_open_to_stopped() -> None:
    assert pressure.decide(reading(memory=29.9), 30.0, 30.0, 32).state == OPEN
    assert pressure.decide(reading(memory=30.0), 30.0, 30.0, 32).state == STOPPED


def test_decide_a_batch_of_one_slows_to_one() -> None:
    admission = pressure.decide(reading(memory=10.0), 10.0, 40.0, 1)
    assert (admission.state, admission.limit) == (SLOWED, 1)
    assert "at most 1 run(s) a poll interval" in admission.detail


def test_decide_off_where_nothing_could_be_read() -> None:
    admission = pressure.decide(Reading({}, "no PSI here"), 10.0, 40.0, 32)
    assert admission == Admission(OFF, None, detail="admission by pressure off: no PSI here")
    assert pressure.decide(Reading({}), 10.0, 40.0, 32).state == OFF


# -- read: the shell ----------------------------------------------------------------------------


@pytest.fixture
def cgroup(tmp_path: Path) -> tuple[Path, Path]:
    """A cgroup-v2 root with unitvisor.slice, and /proc/pressure, as files the test writes."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc-pressure"
    (root / "unitvisor.slice").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    proc.mkdir()
    for name in pressure.RESOURCES:
        (proc / name).write_text(psi(0.0))
        (root / "unitvisor.slice" / f"{name}.pressure").write_text(psi(0.0))
    return root, proc


def read(cgroup: tuple[Path, Path], resources: tuple[str, ...] = ("memory", "io")) -> Reading:
    return pressure.read("unitvisor.slice", resources, cgroup_root=cgroup[0], proc_pressure=cgroup[1])


def test_read_gives_each_watched_figure_of_the_slice(cgroup: tuple[Path, Path]) -> None:
    (cgroup[0] / "unitvisor.slice" / "memory.pressure").write_text(psi(42.5, 10.0))
    (cgroup[0] / "unitvisor.slice" / "cpu.pressure").write_text(psi(99.0))
    assert read(cgroup) == Reading({"memory": 42.5, "io": 0.0})


def test_read_nothing_watched_is_off(cgroup: tuple[Path, Path]) -> None:
    assert read(cgroup, ()).unavailable == "[host] pressure_resources is empty"


def test_read_a_cgroup_v1_host_is_off(cgroup: tuple[Path, Path]) -> None:
    (cgroup[0] / "cgroup.controllers").unlink()
    assert "is not cgroup v2" in read(cgroup).unavailable


def test_read_a_kernel_with_psi_disabled_is_off_and_says_psi_1(cgroup: tuple[Path, Path], mocker) -> None:
    """CONFIG_PSI_DEFAULT_DISABLED without psi=1: /proc/pressure/* answers EOPNOTSUPP."""
    real = Path.read_text

    def refuse(path: Path, *args, **kwargs) -> str:
        if path.parent == cgroup[1]:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real(path, *args, **kwargs)

    mocker.patch.object(Path, "read_text", refuse)
    assert read(cgroup).unavailable == "the kernel's PSI is disabled (boot it with psi=1)"


def test_read_a_kernel_without_psi_at_all_is_off(cgroup: tuple[Path, Path]) -> None:
    for name in pressure.RESOURCES:
        (cgroup[1] / name).unlink()
    assert read(cgroup).unavailable == "the kernel's PSI is disabled (boot it with psi=1)"


def test_read_a_slice_not_made_yet_stalls_nothing(cgroup: tuple[Path, Path]) -> None:
    """systemd makes the slice's cgroup with its first unit: before that, nothing of it can stall."""
    for child in (cgroup[0] / "unitvisor.slice").iterdir():
        child.unlink()
    (cgroup[0] / "unitvisor.slice").rmdir()
    assert read(cgroup) == Reading({"memory": 0.0, "io": 0.0})


def test_read_a_missing_pressure_file_in_the_slice_is_off(cgroup: tuple[Path, Path]) -> None:
    (cgroup[0] / "unitvisor.slice" / "io.pressure").unlink()
    assert read(cgroup).unavailable.endswith("unitvisor.slice/io.pressure does not exist")


def test_read_an_unreadable_pressure_file_is_off_with_the_error(cgroup: tuple[Path, Path], mocker) -> None:
    real = Path.read_text

    def refuse(path: Path, *args, **kwargs) -> str:
        if path.name == "memory.pressure":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, *args, **kwargs)

    mocker.patch.object(Path, "read_text", refuse)
    assert read(cgroup).unavailable.endswith("unitvisor.slice/memory.pressure: Permission denied")


def test_read_a_pressure_file_that_is_a_directory_is_off(cgroup: tuple[Path, Path]) -> None:
    path = cgroup[0] / "unitvisor.slice" / "memory.pressure"
    path.unlink()
    path.mkdir()
    assert "memory.pressure: Is a directory" in read(cgroup).unavailable


def test_read_a_malformed_pressure_file_is_off_and_says_what_is_wrong(cgroup: tuple[Path, Path]) -> None:
    (cgroup[0] / "unitvisor.slice" / "memory.pressure").write_text("some avg10=lots\n")
    assert read(cgroup).unavailable.endswith("memory.pressure: no number in avg10 of 'some avg10=lots'")


def test_read_on_this_machine_never_raises() -> None:
    """Whatever this machine is (a cgroup-v1 test machine, a v2 host), read answers."""
    got = pressure.read("unitvisor.slice", ("memory", "io", "cpu"))
    assert got.unavailable is not None or set(got.figures) == {"memory", "io", "cpu"}


# -- the config's keys --------------------------------------------------------------------------


def test_config_defaults() -> None:
    host = config.Settings().host
    assert (host.pressure_slow_at, host.pressure_stop_at, host.pressure_resources) == (10.0, 40.0, ("memory", "io"))


def test_config_takes_whole_and_fractional_percentages() -> None:
    host = config.parse("[host]\npressure_slow_at = 5\npressure_stop_at = 62.5\n"
                        'pressure_resources = ["cpu", "memory"]\n').host
    assert (host.pressure_slow_at, host.pressure_stop_at, host.pressure_resources) == (5.0, 62.5, ("cpu", "memory"))


@pytest.mark.parametrize("text, message", [
    ("pressure_slow_at = 0", "[host] pressure_slow_at: expected a percentage above 0 and at most 100"),
    ("pressure_stop_at = 100.5", "[host] pressure_stop_at: expected a percentage above 0 and at most 100"),
    ("pressure_stop_at = true", "[host] pressure_stop_at: expected a percentage"),
    ('pressure_stop_at = "40%"', "[host] pressure_stop_at: expected a percentage"),
    ("pressure_slow_at = 50", "[host] pressure_slow_at (50) is above pressure_stop_at (40)"),
    ('pressure_resources = ["swap"]', "[host] pressure_resources: 'swap' is not one of memory, io, cpu"),
])
def test_config_refuses_bad_values_by_name(text: str, message: str) -> None:
    with pytest.raises(config.ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        config.parse(f"[host]\n{text}\n")
