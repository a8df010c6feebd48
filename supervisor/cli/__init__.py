"""The `unitvisor` command: parse, call one function, print. No SQL and no D-Bus here.

Conventions (as systemctl and git): tables for people, --json for scripts; exit 0 on success, 1 on
failure, 2 on bad usage; errors on stderr in one line, no traceback unless --debug.

The commands live by concern: runs.py (submit, show, runs, cancel, resume, logs, wait), hosts.py
(hosts, hosts add, hosts forget, drain, undrain), schedules.py (schedules), limits.py (limits, limits set,
limits drop), operations.py (reconcile,
doctor, prune, migrate, daemon, fence, version); app.py holds the group and the Context they share, params.py the option
types, output.py tables, colours and JSON. This module puts them together and turns every failure
into one line and an exit status (main).
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click
import psycopg

from supervisor import store

# Importing the command modules registers their commands on the group.
from supervisor.cli import hold, hosts, limits, operations, runs, schedules
from supervisor.cli.app import WAIT_UNKNOWN, CouldNotTell, Failure, Unreachable, add_global_options, cli, invocation

__all__ = ["WAIT_UNKNOWN", "CouldNotTell", "Failure", "Unreachable", "cli", "hold", "hosts", "limits", "main",
           "operations",
           "runs", "schedules"]

# Last, once every command exists: each gets its hidden copies of the group's options (app.py).
add_global_options(cli)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"unitvisor: {' '.join(message.split())}", err=True)
    sys.exit(code)


def _usage_message(exc: click.UsageError) -> str:
    """`--memory: 256 bytes is out of range (...)`: a bad option's value names the option first."""
    if (isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter)
            and isinstance(exc.param, click.Option) and exc.param.opts):
        return f"{max(exc.param.opts, key=len)}: {exc.message}".rstrip(".")
    # click ends most of its sentences with a period, and "; see ..." follows: no ".;" in between.
    return exc.format_message().rstrip(".")


# PostgreSQL's "undefined table / function / schema": a schema that is missing or behind. The CLI
# checks the schema when it connects; this covers whatever slips past that check.
_SCHEMA_SQLSTATES = {"42P01", "42883", "3F000"}


# insufficient_privilege: PostgreSQL's own refusals and unitvisor.require_host's (sql/004_roles.sql).
_DENIED_SQLSTATE = "42501"
_SUBMITTER = "unitvisor_submitter or unitvisor_admin (a control plane's or the admin's role)"
_ADMIN = "unitvisor_admin"
_HOST = "the role bound to this host's id (unitvisor hosts add) or unitvisor_admin"
_MAY_CREATE_ROLES = "unitvisor_admin and the right to create roles (a superuser, or CREATEROLE)"
# How to come in with that role, said after it (issue 24: a refusal named the role, not how to use it).
# The admin's and a control plane's DSN belong in a private file, not on the command line
# (README, The operator's credentials); the right to create roles is the postgres superuser's, over
# the database machine's local socket (README, Install); a host's role is in its own DSN file.
_PASS_DSN = "pass its DSN with --dsn-file or UNITVISOR_DSN_FILE"
_AS_POSTGRES = "run it as postgres on the database's machine: runuser -u postgres -- unitvisor --dsn " \
               "'host=/var/run/postgresql dbname=unitvisor' {command}"
_HOST_DSN = "its DSN goes in /etc/unitvisor/dsn"
# The role each command needs and how to pass its DSN, for the one line that says why the database
# refused it. A command that knows more (drain: which host) says it in invocation["needs"].
_NEEDED_ROLE = {
    "submit": (_SUBMITTER, _PASS_DSN), "cancel": (_SUBMITTER, _PASS_DSN), "resume": (_SUBMITTER, _PASS_DSN),
    "hold": (_SUBMITTER, _PASS_DSN), "release": (_SUBMITTER, _PASS_DSN), "freeze": (_SUBMITTER, _PASS_DSN),
    "thaw": (_SUBMITTER, _PASS_DSN), "limits set": (_SUBMITTER, _PASS_DSN), "limits drop": (_SUBMITTER, _PASS_DSN),
    "drain": (_ADMIN, _PASS_DSN), "undrain": (_ADMIN, _PASS_DSN), "prune": (_ADMIN, _PASS_DSN),
    "hosts forget": (_MAY_CREATE_ROLES, _AS_POSTGRES), "hosts add": (_MAY_CREATE_ROLES, _AS_POSTGRES),
    "migrate": ("a role that may create roles (a superuser, or CREATEROLE) for migration 004, then unitvisor_admin",
                _AS_POSTGRES),
    "daemon": (_HOST, _HOST_DSN), "reconcile": (_HOST, _HOST_DSN),
}


def needed_role(command: str, needs: str | None = None) -> str:
    """What `unitvisor COMMAND` needs that the session's role lacks, and how to pass a DSN that has it."""
    role, how = _NEEDED_ROLE.get(command, ("a role allowed to (README, Roles: who may do what)", _PASS_DSN))
    return f"{needs or role}: {how.format(command=command)}"


def main() -> None:
    invocation["debug"], invocation["needs"] = False, None
    try:
        cli.main(prog_name="unitvisor", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        _fail("aborted", 1)
    except click.UsageError as exc:
        # Never a traceback, --debug or not: the parser's stack says nothing about the mistake.
        _fail(f"{_usage_message(exc)}; see '{exc.ctx.command_path if exc.ctx else 'unitvisor'} --help'", 2)
    except click.ClickException as exc:
        if invocation["debug"]:
            raise
        _fail(exc.format_message(), exc.exit_code)
    except store.DatabaseError as exc:
        if invocation["debug"]:
            raise
        _fail(str(exc), 1)
    except psycopg.Error as exc:
        if invocation["debug"]:
            raise
        if exc.sqlstate == _DENIED_SQLSTATE:
            command = invocation["command"]
            _fail(f"the database refused `unitvisor {command}` to this role ({store.one_line(exc)}): it needs "
                  f"{needed_role(command, invocation.get('needs'))}", 1)
        if exc.sqlstate in _SCHEMA_SQLSTATES:
            _fail(f"the database schema is missing or behind ({store.one_line(exc)}): run `unitvisor migrate`", 1)
        _fail(f"database error: {store.one_line(exc)}", 1)
    except Exception as exc:  # the last line of defence: one line, not a traceback
        if invocation["debug"]:
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (run with --debug for details)", 1)
