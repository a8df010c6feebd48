"""The CLI's presentation: colour only on a terminal and never with NO_COLOR; aligned tables."""

import io
import sys

import pytest

from supervisor.cli import output


class Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def tty(monkeypatch):
    """Call it in the test body: pytest's output capture replaces sys.stdout after fixtures run."""
    def install():
        out = Tty()
        monkeypatch.setattr(sys, "stdout", out)
        return out
    monkeypatch.delenv("NO_COLOR", raising=False)
    return install


def test_colour_on_a_terminal(tty):
    tty()
    assert "\x1b[" in output.state_cell("failed")


def test_no_colour_with_no_color_even_on_a_terminal(tty, monkeypatch):
    tty()
    monkeypatch.setenv("NO_COLOR", "")
    assert output.state_cell("failed") == "failed"


def test_no_colour_when_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert output.state_cell("failed") == "failed"


def test_table_aligns_by_visible_width_not_escape_codes(tty, monkeypatch):
    tty = tty()
    monkeypatch.setattr(output.click, "echo", lambda text="", **kw: tty.write(text + "\n"))
    output.print_table([("ID", "STATE", "X"), ("a", output.state_cell("failed"), "1"),
                        ("bb", output.state_cell("succeeded"), "2")])
    plain = [line.replace("\x1b[31m", "").replace("\x1b[32m", "").replace("\x1b[0m", "")
             for line in tty.getvalue().splitlines()]
    assert plain == ["ID  STATE      X", "a   failed     1", "bb  succeeded  2"]
