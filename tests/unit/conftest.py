"""Unit tests never touch the machine: a run's environment files go to a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import runenv


@pytest.fixture(autouse=True)
def environment_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "run-unitvisor" / "environment"
    monkeypatch.setattr(runenv, "DIRECTORY", directory)
    return directory
