"""unitvisor(1), as supervisor/manpage.py renders it and man shows it: every command with its whole
help, examples line by line, short code spans never broken across lines, summaries never cut at
"...", and no warning from groff (lintian runs the same man command and fails on one).

(Failed on the help2man page the package shipped until 0.7.0: `--dsn ...` on a line of its own, the
two lines of the group's example joined into one, and nine summaries ending in "...".)
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
from pathlib import Path

import click

from supervisor import manpage
from supervisor.cli import cli
from tests.conftest import _unavailable


def commands() -> list[tuple[str, click.Command]]:
    """Every command by its path (`hosts add`), groups included."""
    found = []
    for name, command in sorted(cli.commands.items()):
        found.append((name, command))
        for sub, leaf in sorted(getattr(command, "commands", {}).items()):
            found.append((f"{name} {sub}", leaf))
    return found


def help_texts() -> list[str]:
    return [inspect.cleandoc(c.help or "").split("\f", 1)[0] for c in (cli, *(c for _, c in commands()))]


def example_lines() -> list[str]:
    """The lines of click's \\b blocks (examples), each of which must stay a line of its own."""
    lines = []
    for text in help_texts():
        for block in re.split(r"\n\s*\n", text):
            rows = block.splitlines()
            if rows and rows[0].strip() == "\b":
                lines += [" ".join(row.split()) for row in rows[1:] if row.strip()]
    return lines


def short_code_spans() -> set[str]:
    """Code spans of the help paragraphs (outside \\b blocks) that manpage keeps on one line."""
    spans = set()
    for text in help_texts():
        for block in re.split(r"\n\s*\n", text):
            if not block.startswith("\b"):
                spans |= {s for s in re.findall(r"`([^`]+)`", " ".join(block.split()))
                          if " " in s and len(s) <= manpage.KEEP_TOGETHER}
    return spans


def problems(page: str) -> list[str]:
    """What is wrong with a man page as man shows it (plain text, one line a line)."""
    lines = [" ".join(line.split()) for line in page.splitlines()]
    found = [f"example line not on a line of its own: {ex!r}" for ex in example_lines() if ex not in lines]
    found += [f"code span broken across lines: {span!r}" for span in sorted(short_code_spans())
              if not any(span in line for line in lines)]
    found += [f"summary cut short: {line!r}" for line in lines
              if line.endswith("...") and not line.endswith(("[ARGS]...", "[ARG]..."))]
    for path, command in commands():
        usage_line = manpage.usage(command, click.Context(command, info_name=path)).replace("\\", "")
        if f"unitvisor {usage_line}" not in lines:
            found.append(f"no section for `unitvisor {path}`")
    return found


def render_with_man(roff: Path) -> tuple[str, str]:
    """man as lintian runs it (--warnings, UTF-8), 80 columns; text without the overstrikes."""
    if not shutil.which("man"):
        _unavailable("man is not installed (apt-get install man-db)")
    result = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", str(roff)],
                            capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8"})
    assert result.returncode == 0, result.stderr
    shown = subprocess.run(["man", "-l", str(roff)], capture_output=True, text=True, timeout=60, check=True,
                           env={**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8", "MAN_KEEP_FORMATTING": "0",
                                "GROFF_NO_SGR": "1"})
    # Overstrikes (bookworm's groff 1.22) or, where GROFF_NO_SGR is not honoured, SGR escapes (trixie's
    # groff 1.23 writes them by default: the trixie pass failed on them).
    plain = re.sub(r"\x1b\[[0-9;]*m", "", re.sub(r".\x08", "", shown.stdout))
    return plain.replace("\u2010", "-").replace("\u2212", "-"), result.stderr


def test_man_shows_every_command_whole_and_without_warnings(tmp_path: Path) -> None:
    roff = tmp_path / "unitvisor.1"
    roff.write_text(manpage.render("0.0-test", "December 2026"))
    text, warnings = render_with_man(roff)
    assert warnings == "", warnings
    assert problems(text) == [], text
    assert "unitvisor - run commands as limited, supervised systemd units" in text
    for heading in ("SYNOPSIS", "COMMANDS", "EXIT STATUS", "FILES", "SEE ALSO"):
        assert heading in text.splitlines()
    assert "/usr/share/doc/unitvisor/" in text


def test_the_roff_source_is_one_page_with_a_section_per_command() -> None:
    """What a reader without man can check: the page's structure, and nothing that roff would take
    for a request (a text line starting with a dot)."""
    roff = manpage.render("0.0-test", "December 2026").splitlines()
    assert roff[1].startswith('.TH UNITVISOR 1 "December 2026" "unitvisor 0.0\\-test"')
    sections = [line for line in roff if line.startswith(".SS ")]
    assert len(sections) == len(commands())
    requests = re.compile(r"^\.(\\\"|TH|SH|SS|PP|TP|RS|RE|nf|fi|B|BR|ad|nh)( |$)")
    assert [line for line in roff if line.startswith((".", "'")) and not requests.match(line)] == []


def test_the_checks_catch_what_help2man_did() -> None:
    """The check itself, on what help2man 1.49 made of the same help: the group's example in one line,
    a code span split over two paragraphs, click's summaries cut at "..."."""
    garbled = ("unitvisor submit --memory 256M --cpu 50% -- /usr/bin/env echo hello unitvisor show 3f2a9c\n"
               "--config, --dsn and --debug may also follow the command (`unitvisor runs\n\n--dsn ...`)\n"
               "cancel Cancel a run: a queued one at once, a running one is stopped...\n")
    found = problems(garbled)
    assert any("unitvisor show 3f2a9c" in p for p in found)
    assert any("cut short" in p for p in found)
    assert any("no section for" in p for p in found)
