"""supervisor.runenv: a run's environment as a root-only file that systemd reads back exactly.

`systemd_parse` below follows systemd's env-file parser (src/basic/env-file.c, parse_env_file_internal)
state by state, for the states our files reach and the ones a wrong encoding would fall into, so that
the encoding is checked against the parser's rules here, for many values; the system test
(tests/system/test_run_environment.py) checks it against the real systemd.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from supervisor import runenv
from supervisor.runenv import EnvironmentFileError, EnvironmentFiles, encode, quote, unit_of

UNIT = "unitvisor-run-12345678-9abc-4def-8123-456789abcdef-1.service"
WHITESPACE, NEWLINE, COMMENTS, NEED_ESCAPE = " \t\n\r", "\n\r", "#;", '"\\`$'


def systemd_parse(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    state, key, value = "PRE_KEY", "", ""
    key_ws = value_ws = None  # where trailing whitespace starts, if the text ends in it

    def push() -> None:
        k = key[:key_ws] if key_ws is not None else key
        v = value[:value_ws] if (state == "VALUE" and value_ws is not None) else value
        out[k] = v

    for c in text:
        if state == "PRE_KEY":
            if c in COMMENTS:
                state = "COMMENT"
            elif c not in WHITESPACE:
                state, key, key_ws = "KEY", c, None
        elif state == "KEY":
            if c in NEWLINE:
                state, key = "PRE_KEY", ""
            elif c == "=":
                state, value, value_ws = "PRE_VALUE", "", None
            else:
                if c not in WHITESPACE:
                    key_ws = None
                elif key_ws is None:
                    key_ws = len(key)
                key += c
        elif state == "PRE_VALUE":
            if c in NEWLINE:
                push()
                state, key = "PRE_KEY", ""
            elif c == "'":
                state = "SINGLE"
            elif c == '"':
                state = "DOUBLE"
            elif c == "\\":
                state = "VALUE_ESCAPE"
            elif c not in WHITESPACE:
                state, value = "VALUE", value + c
        elif state == "VALUE":
            if c in NEWLINE:
                push()
                state, key = "PRE_KEY", ""
            elif c == "\\":
                state, value_ws = "VALUE_ESCAPE", None
            else:
                if c not in WHITESPACE:
                    value_ws = None
                elif value_ws is None:
                    value_ws = len(value)
                value += c
        elif state == "VALUE_ESCAPE":
            state = "VALUE"
            if c not in NEWLINE:
                value += c
        elif state == "SINGLE":
            if c == "'":
                state = "PRE_VALUE"
            else:
                value += c
        elif state == "DOUBLE":
            if c == '"':
                state = "PRE_VALUE"
            elif c == "\\":
                state = "DOUBLE_ESCAPE"
            else:
                value += c
        elif state == "DOUBLE_ESCAPE":
            state = "DOUBLE"
            if c in NEED_ESCAPE:
                value += c
            elif c != "\n":
                value += "\\" + c
        elif state == "COMMENT":
            if c in NEWLINE:
                state = "PRE_KEY"
    if state not in ("PRE_KEY", "KEY", "COMMENT"):
        push()
    return out


HOSTILE = [
    "", " ", "  leading and trailing  ", "\t", "tab\tinside", "a\rb", "\\", "\\\\", "ends with \\", '"', '""',
    "'", "'single'", "$HOME", "${HOME}", "$(id)", "`id`", "\\$HOME", '\\"', "#not a comment", ";not either",
    "a=b=c", "=", "x # y", "grüß 🔑 ключ", "%n %i %%", "\\n\\t", "'\"`$\\#;= \t", "\x7f\x1b[31m",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_every_value_reads_back_exactly(value: str) -> None:
    assert systemd_parse(encode({"V": value}).decode()) == {"V": value}


def test_a_whole_environment_reads_back_exactly() -> None:
    env = {f"V{i}": value for i, value in enumerate(HOSTILE)} | {"SECRET": "s3cr3t", "_": "x"}
    assert systemd_parse(encode(env).decode()) == env


def test_the_encoding_is_sorted_one_double_quoted_line_per_name() -> None:
    assert encode({"B": 'x"$`\\y', "A": ""}) == b'A=""\nB="x\\"\\$\\`\\\\y"\n'
    assert encode({}) == b""


def test_only_the_four_characters_are_escaped() -> None:
    assert quote("'#;= \t%") == "\"'#;= \t%\""


@pytest.mark.parametrize("value", ["a\nb", "\n", "a\0b"])
def test_a_newline_or_nul_is_never_written(value: str) -> None:
    """The schema and unitspec refuse them; a newline would end the line, and systemd reads
    backslash-newline as a continuation, so there is no way to carry one."""
    with pytest.raises(ValueError):
        quote(value)


def test_unit_of_names_final_and_temporary_files() -> None:
    assert unit_of(UNIT + ".env") == UNIT
    assert unit_of(f".{UNIT}.env.0123456789abcdef.tmp") == UNIT
    assert unit_of("stray") is None
    assert unit_of(".hidden.env") is None
    assert unit_of(f".{UNIT}.env.xyz.tmp") is None


# -- the files -------------------------------------------------------------------------------------

def test_write_is_root_only_and_complete(environment_directory: Path) -> None:
    files = EnvironmentFiles()
    path = files.write(UNIT, {"SECRET": "it's $ecret"})
    assert path == environment_directory / f"{UNIT}.env"
    assert systemd_parse(path.read_text()) == {"SECRET": "it's $ecret"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(environment_directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(environment_directory.parent.stat().st_mode) == 0o700
    assert os.listdir(environment_directory) == [f"{UNIT}.env"]  # no temporary file left behind


def test_the_default_directory_is_under_the_daemons_runtime_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    assert EnvironmentFiles().directory == Path("/run/unitvisor/environment")


def test_a_second_write_replaces_the_first(environment_directory: Path) -> None:
    files = EnvironmentFiles()
    files.write(UNIT, {"A": "1"})
    files.write(UNIT, {"A": "2"})
    assert systemd_parse(files.path(UNIT).read_text()) == {"A": "2"}
    assert len(os.listdir(environment_directory)) == 1


def test_a_directory_others_may_enter_is_made_root_only(environment_directory: Path) -> None:
    environment_directory.mkdir(parents=True, mode=0o755)
    environment_directory.chmod(0o755)
    EnvironmentFiles().write(UNIT, {"A": "1"})
    assert stat.S_IMODE(environment_directory.stat().st_mode) == 0o700


def test_a_symlink_in_place_of_the_directory_is_refused(environment_directory: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    environment_directory.parent.mkdir(parents=True)
    environment_directory.symlink_to(elsewhere)
    with pytest.raises(EnvironmentFileError):
        EnvironmentFiles().write(UNIT, {"A": "1"})
    assert os.listdir(elsewhere) == []


def test_a_failed_write_leaves_no_file(environment_directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_rename(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runenv.os, "rename", broken_rename)
    with pytest.raises(OSError):
        EnvironmentFiles().write(UNIT, {"A": "1"})
    assert os.listdir(environment_directory) == []


def test_remove(environment_directory: Path) -> None:
    files = EnvironmentFiles()
    assert files.remove(UNIT) is False  # none yet: no environment, or already removed
    files.write(UNIT, {"A": "1"})
    assert files.remove(UNIT) is True
    assert os.listdir(environment_directory) == []


@pytest.mark.parametrize("name", ["", "../x.service", "a/b.service", ".hidden.service"])
def test_a_path_is_only_ever_inside_the_directory(name: str) -> None:
    with pytest.raises(ValueError):
        EnvironmentFiles().path(name)


def test_listing_maps_each_file_to_its_unit(environment_directory: Path) -> None:
    files = EnvironmentFiles()
    assert files.listing() == {}  # no directory yet
    files.write(UNIT, {"A": "1"})
    (environment_directory / f".{UNIT}.env.0123456789abcdef.tmp").write_text("A=\"half")
    (environment_directory / "stray").write_text("")
    assert files.listing() == {f"{UNIT}.env": UNIT, f".{UNIT}.env.0123456789abcdef.tmp": UNIT, "stray": None}
    assert files.remove_file("stray") is True
    assert files.remove_file("stray") is False
    with pytest.raises(ValueError):
        files.remove_file("../etc")
