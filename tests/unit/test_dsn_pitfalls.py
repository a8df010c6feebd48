"""DSN pitfalls (issue 24, item 8): a URI whose password holds '@' or '/' parses, but wrongly, and the
connection then fails against a host named after half the password; an unparsable DSN said nothing
of how to write one. Both now say how, in one line, without quoting any of the DSN."""

from __future__ import annotations

import pytest

from supervisor import store
from tests.unit.test_cli_args import config, run_cli  # noqa: F401 (fixtures)


@pytest.mark.parametrize("dsn", [
    "postgresql://unitvisor:p@ss@db.example.com/unitvisor",   # read as the host ss@db.example.com
    "postgresql://unitvisor:p/ss@db.example.com/unitvisor",   # read as the host unitvisor, port p
    "postgres://unitvisor:a@b/c@db.example.com:5432/unitvisor",
])
def test_a_uri_whose_password_holds_at_or_slash_says_to_percent_encode(dsn: str) -> None:
    with pytest.raises(store.DatabaseError) as caught:
        store.parse_dsn(dsn)
    message = str(caught.value)
    assert "percent-encoded" in message and "%40" in message and "key=value" in message
    assert "postgresql://unitvisor:PASS%40WORD@db.example.com/unitvisor" in message  # an example
    assert "p@ss" not in message and "p/ss" not in message and "ss@db" not in message  # no piece of the password
    assert "\n" not in message


@pytest.mark.parametrize("dsn", [
    "postgresql://unitvisor:p%40ss%2F%23@db.example.com/unitvisor",
    "postgresql://unitvisor:p#ss@db.example.com:5432,db2.example.com:5433/unitvisor",
    "host=db.example.com user=unitvisor password='p@ss/#1' dbname=unitvisor",
    "postgresql:///unitvisor?host=/var/run/postgresql",
])
def test_a_dsn_written_right_is_read(dsn: str) -> None:
    assert store.parse_dsn(dsn)["dbname"] == "unitvisor"


def test_a_dsn_that_cannot_be_parsed_shows_both_forms_and_no_piece_of_it() -> None:
    with pytest.raises(store.DatabaseError) as caught:
        store.parse_dsn("host=db.example.com password=se cret")
    message = str(caught.value)
    assert message.startswith("the database DSN cannot be parsed: write it as postgresql://")
    assert "host=db.example.com port=5432 user=unitvisor password=PASSWORD dbname=unitvisor" in message
    assert "cret" not in message


def test_the_cli_says_it_in_one_line(run_cli, config) -> None:  # noqa: F811
    result = run_cli("--config", str(config), "--dsn", "postgresql://u:p@ss@db.example.com/x", "runs")
    assert result.code == 1
    assert "percent-encoded" in result.line and "ss@db" not in result.line
