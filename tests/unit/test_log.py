"""supervisor.log: one event per line, `event key=value ...`, with a syslog priority prefix under journald."""

from __future__ import annotations

import logging
import sys
import uuid

import pytest

from supervisor import log
from supervisor.log import event, setup

LOGGER = logging.getLogger("unitvisor")


@pytest.fixture(autouse=True)
def _restore_logger(monkeypatch):
    """setup() replaces the 'unitvisor' logger's handlers; put them back after each test."""
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    saved = (LOGGER.handlers[:], LOGGER.level, LOGGER.propagate)
    # Start from a plain logger whatever ran before: records propagate to caplog's handler.
    LOGGER.handlers[:], LOGGER.level, LOGGER.propagate = [], logging.NOTSET, True
    yield
    LOGGER.handlers[:], LOGGER.level, LOGGER.propagate = saved[0], saved[1], saved[2]


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "unitvisor"]


# -- event(): the message -----------------------------------------------------------------------

def test_event_name_and_fields(caplog):
    with caplog.at_level(logging.DEBUG, logger="unitvisor"):
        event("claimed", run="abc", attempt=2, unit="u.service")
    assert messages(caplog) == ["claimed run=abc attempt=2 unit=u.service"]
    assert caplog.records[-1].levelno == logging.INFO


def test_event_without_fields(caplog):
    with caplog.at_level(logging.DEBUG, logger="unitvisor"):
        event("ready")
    assert messages(caplog) == ["ready"]


def test_event_keeps_field_order(caplog):
    with caplog.at_level(logging.DEBUG, logger="unitvisor"):
        event("e", z=1, a=2, m=3)
    assert messages(caplog) == ["e z=1 a=2 m=3"]


def test_event_skips_none_but_keeps_falsy_values(caplog):
    with caplog.at_level(logging.DEBUG, logger="unitvisor"):
        event("e", a=None, b=0, c=False, d=None)
    assert messages(caplog) == ["e b=0 c=False"]


def test_event_level(caplog):
    with caplog.at_level(logging.DEBUG, logger="unitvisor"):
        event("degraded", level=logging.ERROR, detail="x")
    assert caplog.records[-1].levelno == logging.ERROR
    assert messages(caplog) == ["degraded detail=x"]


def test_event_values_are_str_of_objects(caplog):
    run_id = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")
    with caplog.at_level(logging.DEBUG, logger="unitvisor"):
        event("started", run=run_id, ratio=0.5)
    assert messages(caplog) == ["started run=12345678-9abc-4def-8123-456789abcdef ratio=0.5"]


@pytest.mark.parametrize(("value", "rendered"), [
    ("plain", "plain"),
    ("a/b:c,d", "a/b:c,d"),
    ("with space", '"with space"'),
    ("", '""'),
    ('say "hi"', '"say \\"hi\\""'),
    ('"', '"\\""'),
    ("a=b", '"a=b"'),
    ("line1\nline2", '"line1\\nline2"'),
    ("back\\slash and space", '"back\\\\slash and space"'),
    ("back\\slash", "back\\slash"),
    (42, "42"),
])
def test_value_quoting(value, rendered):
    assert log._value(value) == rendered


def test_value_quoted_exactly_when_a_character_is_whitespace_a_quote_or_equals():
    """The regex agrees with the rule it replaced (str.isspace(), '"' or '=') on every code point."""
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        expected = char.isspace() or char in '"='
        assert (log._value("a" + char + "b") != "a" + char + "b") is expected, hex(code)


def test_value_of_a_str_subclass_is_its_str():
    class Loud(str):
        def __str__(self) -> str:
            return "LOUD"

    assert log._value(Loud("quiet")) == "LOUD"


def test_disabled_level_formats_nothing(caplog):
    class Exploding:
        def __str__(self) -> str:
            raise AssertionError("formatted")

    with caplog.at_level(logging.INFO, logger="unitvisor"):
        event("noise", level=logging.DEBUG, value=Exploding())
    assert messages(caplog) == []


def test_event_with_awkward_values_is_one_line(caplog):
    with caplog.at_level(logging.DEBUG, logger="unitvisor"):
        event("failed", reason='exec "x" failed\nsee log', empty="", ok="yes")
    (message,) = messages(caplog)
    assert message == 'failed reason="exec \\"x\\" failed\\nsee log" empty="" ok=yes'
    assert "\n" not in message


# -- setup(): the line on stderr ------------------------------------------------------------------

def test_plain_format_without_journald(capsys):
    setup()
    event("starting", host="h1", config="/etc/unitvisor/unitvisor.toml")
    event("degraded", level=logging.WARNING, detail="db down")
    event("broken", level=logging.ERROR)
    assert capsys.readouterr().err == (
        "info: starting host=h1 config=/etc/unitvisor/unitvisor.toml\n"
        'warning: degraded detail="db down"\n'
        "error: broken\n")


def test_empty_journal_stream_is_not_journald(capsys, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "")
    setup()
    event("x")
    assert capsys.readouterr().err == "info: x\n"


@pytest.mark.parametrize(("level", "prefix"), [
    (logging.INFO, "<6>"),
    (logging.WARNING, "<4>"),
    (logging.ERROR, "<3>"),
    (logging.CRITICAL, "<2>"),
])
def test_journald_priority_prefix(capsys, monkeypatch, level, prefix):
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    setup()
    event("settled", level=level, run="r1", outcome="exit-code")
    assert capsys.readouterr().err == f"{prefix}settled run=r1 outcome=exit-code\n"


def test_journald_unknown_level_is_info(capsys, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    setup()
    event("custom", level=25)
    assert capsys.readouterr().err == "<6>custom\n"


def test_debug_hidden_by_default(capsys, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    setup()
    event("noise", level=logging.DEBUG)
    event("signal")
    assert capsys.readouterr().err == "<6>signal\n"


def test_debug_shown_with_debug(capsys, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    setup(debug=True)
    event("noise", level=logging.DEBUG, n=1)
    assert capsys.readouterr().err == "<7>noise n=1\n"


def test_plain_debug(capsys):
    setup(debug=True)
    event("noise", level=logging.DEBUG)
    assert capsys.readouterr().err == "debug: noise\n"


def test_journald_line_with_newline_value_stays_one_line(capsys, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    setup()
    event("failed", reason="a\nb", argv="x y")
    err = capsys.readouterr().err
    assert err == '<6>failed reason="a\\nb" argv="x y"\n'
    assert err.count("\n") == 1


def test_raw_newlines_in_a_message_are_escaped_onto_one_line(capsys, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    setup()
    LOGGER.warning("first\nsecond\r\nthird")
    assert capsys.readouterr().err == "<4>first\\nsecond\\r\\nthird\n"


def test_traceback_is_folded_into_one_line(capsys):
    setup()
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        LOGGER.exception("crashed")
    err = capsys.readouterr().err
    assert err.startswith("error: crashed\\nTraceback (most recent call last):\\n")
    assert err.endswith("RuntimeError: boom\n")
    assert err.count("\n") == 1


def test_setup_replaces_handlers_and_stops_propagation(capsys):
    setup()
    setup()
    assert len(LOGGER.handlers) == 1
    assert LOGGER.propagate is False
    assert LOGGER.level == logging.INFO
    event("once")
    assert capsys.readouterr().err == "info: once\n"


def test_setup_debug_level():
    setup(debug=True)
    assert LOGGER.level == logging.DEBUG


def test_quoted_value_whitespace_is_preserved(capsys):
    setup()
    event("e", detail="a  b")
    assert capsys.readouterr().err == 'info: e detail="a  b"\n'
