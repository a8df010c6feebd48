"""[host] labels (schema 033, placement): parsed as a table of labels, each pair checked as a run's label
is (supervisor/labels.py, the database's labels_are_valid), every bad value refused with a message
naming the key; and registered with the host (fleet.host_profile)."""

from __future__ import annotations

import pytest

from supervisor import fleet
from supervisor.config import ConfigError, parse
from supervisor.labels import label_problem, labels_problem


def test_labels_are_a_table_of_strings() -> None:
    settings = parse('[host]\nlabels = { zone = "a", disk = "ssd", "team/batch" = "x.y-z_1" }\n', "u.toml")
    assert settings.host.labels == {"zone": "a", "disk": "ssd", "team/batch": "x.y-z_1"}


def test_no_labels_by_default() -> None:
    assert parse("", "u.toml").host.labels == {}
    assert parse("[host]\nlabels = {}\n", "u.toml").host.labels == {}


def test_the_host_registers_its_labels() -> None:
    settings = parse('[host]\nid = "h1"\nlabels = { zone = "a" }\n', "u.toml")
    profile = fleet.host_profile(settings, "0.0-test", "inst", "boot", is_root=True)
    assert profile.labels == {"zone": "a"}


@pytest.mark.parametrize(("toml", "message"), [
    ('labels = "zone=a"', r'\[host\] labels: expected a table of labels, like \{ zone = "a", disk = "ssd" \}'),
    ('labels = ["zone"]', r"\[host\] labels: expected a table of labels"),
    ('labels = { zone = 1 }', r"\[host\] labels: the value of label zone is not a string"),
    ('labels = { zone = true }', r"\[host\] labels: the value of label zone is not a string"),
    ('labels = { zone = { a = "b" } }', r"\[host\] labels: the value of label zone is not a string"),
    ('labels = { "-zone" = "a" }', r"\[host\] labels: '-zone' is not a label key \(1 to 63 letters"),
    ('labels = { "zone " = "a" }', r"\[host\] labels: 'zone ' is not a label key"),
    ('labels = { "" = "a" }', r"\[host\] labels: '' is not a label key"),
    (f'labels = {{ {"k" * 64} = "a" }}', r"\[host\] labels: 'k{64}' is not a label key"),
    (f'labels = {{ zone = "{"v" * 256}" }}', r"\[host\] labels: the value of label zone is over 255 characters"),
    ('labels = { zone = "a\\tb" }', r"\[host\] labels: the value of label zone is over 255 characters or has a "
                                    r"control character"),
    ("labels = { " + ", ".join(f'k{i} = "v"' for i in range(65)) + " }",
     r"\[host\] labels: 65 labels, over the limit of 64"),
])
def test_a_bad_label_is_refused_naming_the_key(toml: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^u\.toml: {message}"):
        parse(f"[host]\n{toml}\n", "u.toml")


def test_the_limits_are_the_databases() -> None:
    """As unitvisor.labels_are_valid: 63 characters of key, 255 of value, 64 pairs (tests/integration/
    test_placement.py registers the same edges with the database)."""
    assert label_problem("k" * 63, "v" * 255) is None
    assert label_problem("a.b/c_d-e", "") is None
    assert labels_problem({f"k{i}": "v" for i in range(64)}) is None
