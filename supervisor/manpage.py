"""Renders the manual page unitvisor(1) from the commands themselves, as clidoc.py renders docs/cli.md:

    python -m supervisor.manpage --version 0.7.0 --date 'December 2026' > unitvisor.1

One page: what `unitvisor --help` says, then every command (and `hosts`' subcommands) with its whole
help and options, the exit codes, the files, and where the rest of the documentation is installed.
debian/rules builds the package's page with it; tests/unit/test_manpage.py renders it with man.

It replaced help2man, which read `--help` output as if it were GNU's: it took click's indented lines
for new paragraphs (a line broken inside a code span became two paragraphs), joined the lines of an
example into one, and copied click's command list with its summaries cut at "...". Here each part of
click's help is rendered as what it is: a paragraph is filled by the man reader (a code span is never
broken at its spaces when short), a click `\\b` block (examples) keeps its lines, and a command's
summary is its whole first sentence.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from datetime import UTC, datetime

import click

from supervisor import __version__
from supervisor.cli import cli
from supervisor.clidoc import JSON_FORMATS

NAME = "run commands as limited, supervised systemd units, queued in PostgreSQL"
DOC_DIR = "/usr/share/doc/unitvisor"
# A code span up to this long is kept on one line (its spaces unbreakable); a longer one may be
# broken at its spaces: an unbreakable span wider than the page makes groff warn, and lintian fail.
KEEP_TOGETHER = 40
_CODE = re.compile(r"`([^`\n]+)`")


def escape(text: str) -> str:
    """Plain text for roff: a backslash is \\e, a minus is \\- (so that options copy as ASCII)."""
    return text.replace("\\", "\\e").replace("-", "\\-")


def inline(text: str) -> str:
    """One paragraph's text for a filled roff line: code spans bold, short ones unbreakable."""
    out, last = [], 0
    for match in _CODE.finditer(text):
        out.append(escape(text[last:match.start()]))
        code = escape(match.group(1))
        if len(match.group(1)) <= KEEP_TOGETHER:
            code = code.replace(" ", "\\~")
        out.append(f"\\fB{code}\\fR")
        last = match.end()
    out.append(escape(text[last:]))
    return _protect("".join(out))


def _protect(line: str) -> str:
    """A line that begins with . or ' would be a roff request."""
    return "\\&" + line if line.startswith((".", "'")) else line


def paragraphs(help_text: str) -> list[str]:
    """click's help text as roff: paragraphs filled, a \\b block (click's "do not rewrap") kept line
    by line and indented, as `--help` shows it."""
    text = inspect.cleandoc(help_text).split("\f", 1)[0]
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.splitlines()
        if lines and lines[0].strip() == "\b":
            out += [".PP", ".nf", ".RS 4"]
            out += [_protect(escape(line.rstrip())) for line in lines[1:]]
            out += [".RE", ".fi"]
        else:
            out += [".PP", inline(" ".join(line.strip() for line in lines))]
    return out


def summary(command: click.Command) -> str:
    """A command's first sentence, whole (click's own short help cuts it at 45 characters)."""
    text = inspect.cleandoc(command.help or "").split("\f", 1)[0].strip()
    first = re.split(r"\n\s*\n", text)[0]
    first = " ".join(first.split())
    match = re.match(r"(.+?\.)(\s|$)", first)
    return match.group(1) if match else first


def options(command: click.Command, ctx: click.Context) -> list[str]:
    out: list[str] = []
    for param in command.get_params(ctx):
        # An argument is in the usage line; click 8.2 gives it a record with no help.
        record = None if isinstance(param, click.Argument) else param.get_help_record(ctx)
        if record is None:
            continue
        names, help_text = record
        out += [".TP", f"\\fB{escape(names)}\\fR", inline(" ".join(help_text.split())) or "\\&"]
    return out


def usage(command: click.Command, ctx: click.Context) -> str:
    return " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])


def _context(command: click.Command, name: str, parent: click.Context | None) -> click.Context:
    settings = cli.context_settings if parent is None else {}
    return click.Context(command, info_name=name, parent=parent, terminal_width=100, max_content_width=100,
                         **settings)


def command_section(command: click.Command, ctx: click.Context) -> list[str]:
    out = [f'.SS "{escape(usage(command, ctx))}"', *paragraphs(command.help or "")]
    out += [".PP", "Options:", ".RS 4", *options(command, ctx), ".RE"]
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            leaf = command.commands[name]
            out += command_section(leaf, _context(leaf, name, ctx))
    return out


def markdown_section(title: str) -> list[str]:
    """A `## title` section of clidoc's JSON_FORMATS (the same words as docs/cli.md), as paragraphs."""
    text = JSON_FORMATS.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.split(r"\n\s*\n", text.strip())
            for line in (".PP", inline(" ".join(block.split())))]


def render(version: str = __version__, date: str | None = None) -> str:
    date = date or datetime.now(UTC).strftime("%B %Y")
    root = _context(cli, "unitvisor", None)
    out = [".\\\" Generated by `python -m supervisor.manpage`; do not edit by hand.",
           f'.TH UNITVISOR 1 "{date}" "unitvisor {escape(version)}" "User Commands"',
           # Left-aligned and unhyphenated: a command or a path split at a hyphen the man reader
           # added, or stretched by justification, reads as something else.
           ".ad l", ".nh",
           ".SH NAME", f"unitvisor \\- {escape(NAME)}",
           ".SH SYNOPSIS", f".B {escape(usage(cli, root))}",
           ".SH DESCRIPTION", *paragraphs(cli.help or ""),
           ".SH OPTIONS", *options(cli, root),
           ".SH COMMANDS"]
    for name in sorted(cli.commands):
        out += [".TP", f"\\fB{name}\\fR", inline(summary(cli.commands[name]))]
    for name in sorted(cli.commands):
        command = cli.commands[name]
        out += command_section(command, _context(command, name, root))
    out += [".SH \"EXIT STATUS\"", *markdown_section("Exit codes")]
    out += [".SH ENVIRONMENT", ".TP", "\\fBUNITVISOR_DSN\\fR",
            "The PostgreSQL connection string, where neither \\fB\\-\\-dsn\\fR nor \\fB\\-\\-dsn\\-file\\fR "
            "is given.",
            ".TP", "\\fBUNITVISOR_DSN_FILE\\fR",
            "A file holding the DSN (mode 0600 or 0400, owned by its reader or root), where neither "
            "\\fB\\-\\-dsn\\fR, \\fB\\-\\-dsn\\-file\\fR nor \\fBUNITVISOR_DSN\\fR is given: the operator's "
            "home for the admin's DSN, which keeps its password out of \\fBps\\fR and the shell's history "
            "(README.md, The operator's credentials).",
            ".TP", "\\fBPGPASSFILE\\fR",
            "libpq's password file [default: \\fI~/.pgpass\\fR, mode 0600]: a DSN without a password "
            "takes it from there."]
    out += [".SH FILES",
            ".TP", "\\fI/etc/unitvisor/unitvisor.toml\\fR",
            "The configuration; every key is documented in it, with its default.",
            ".TP", "\\fI/etc/unitvisor/dsn\\fR",
            "This host's PostgreSQL connection string (root\\-only, mode 0600), read by the daemon and by "
            "every command given no other.",
            ".TP", f"\\fI{DOC_DIR}/\\fR",
            "The rest of the documentation: \\fBREADME.md\\fR (install, a second host over TLS, upgrade, "
            "retiring a host, removal, roles, guarantees), \\fBcli.md\\fR (this page's commands and the "
            "\\fB\\-\\-json\\fR formats), \\fBsql\\-api.md\\fR (submitting from a control plane in SQL), "
            "\\fBfleet.md\\fR (many hosts), \\fBmetrics.md\\fR and \\fBalerts.yml\\fR (Prometheus), "
            "\\fBbenchmarks.md\\fR."]
    out += [".SH \"SEE ALSO\"",
            ".BR systemctl (1),", ".BR journalctl (1),", ".BR systemd.resource\\-control (5),",
            ".BR systemd.exec (5),", ".BR psql (1)"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the manual page unitvisor(1) in roff.")
    parser.add_argument("--version", default=__version__)
    parser.add_argument("--date", help="as the page's footer shows it, e.g. 'December 2026' [default: this month]")
    args = parser.parse_args(argv)
    sys.stdout.write(render(args.version, args.date))


if __name__ == "__main__":
    main()
