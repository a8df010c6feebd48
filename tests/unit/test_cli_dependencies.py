"""`show`'s lines for a run's dependencies (schema 035): what it needs, each run it names with its state
in words, and the runs after it; nothing for a run that names none and that none names."""

from __future__ import annotations

from supervisor.cli.runs import _dependency_lines

RUN = "7c1e0d2a-0000-4000-8000-000000000001"
A = "1b2c3d4e-0000-4000-8000-000000000002"
B = "9f8e7d6c-0000-4000-8000-000000000003"


def test_a_run_without_dependencies_or_dependants_shows_nothing() -> None:
    assert _dependency_lines({"id": RUN, "after_policy": None, "after": [], "dependants": []}) == []


def test_each_run_it_runs_after_is_shown_with_its_state_in_words() -> None:
    data = {"id": RUN, "after_policy": "succeeded", "dependants": [],
            "after": [{"id": A, "state": "succeeded", "met": True}, {"id": B, "state": "running", "met": None}]}
    assert _dependency_lines(data) == ["  after:     succeeded of each:", f"    {A} succeeded (met)",
                                       f"    {B} running (waiting)"]
    data["after"][1] = {"id": B, "state": "failed", "met": False}
    assert _dependency_lines(data)[2] == f"    {B} failed (can no longer be met)"


def test_the_runs_after_it_are_counted_with_the_command_that_lists_them() -> None:
    data = {"id": RUN, "after_policy": None, "after": [], "dependants": [A, B]}
    assert _dependency_lines(data) == ["  run after it: 2 (unitvisor runs --after 7c1e0d2a)"]
