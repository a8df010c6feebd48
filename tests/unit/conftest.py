"""Unit tests never touch the machine: a run's environment files, its tasks peak, the fence's lease and
its record of stopped units go to a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import fence, runenv, taskspeak


@pytest.fixture(autouse=True)
def environment_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "run-unitvisor" / "environment"
    monkeypatch.setattr(runenv, "DIRECTORY", directory)
    return directory


@pytest.fixture(autouse=True)
def runtime_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the daemon writes its lease and reads what the fence stopped (supervisor/fence.py)."""
    directory = tmp_path / "run-unitvisor"
    monkeypatch.setattr(fence, "LEASE", directory / "lease")
    monkeypatch.setattr(fence, "FENCED", directory / "fenced")
    return directory


@pytest.fixture(autouse=True)
def tasks_peak_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where units leave their peak number of tasks (supervisor/taskspeak.py)."""
    directory = tmp_path / "run-unitvisor" / "tasks-peak"
    monkeypatch.setattr(taskspeak, "DIRECTORY", directory)
    return directory
