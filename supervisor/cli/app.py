"""What every command shares: the `unitvisor` group and its options, the Context that carries them
to a command (configuration, DSN, connection), and the failures a command raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from supervisor import __version__, config, store


class Failure(click.ClickException):
    """A command that ran and failed: exit 1, one line on stderr."""

    exit_code = 1


class Unreachable(Failure):
    """The database cannot be reached (exit 1; `wait` turns it into WAIT_UNKNOWN)."""


# `unitvisor wait` exits 75 (sysexits' EX_TEMPFAIL, "try again later") when it could not tell how the
# run ended: the database was unreachable, or lost while waiting. The run's fate is unknown, not bad:
# it may still be running, or have succeeded, and waiting again is the cure. EX_TEMPFAIL says exactly
# that; 69 (EX_UNAVAILABLE) would name the cause but not the remedy. 1 stays "the run failed or was
# cancelled" and 124 "timed out", so a script never mistakes a database outage for either.
WAIT_UNKNOWN = 75


class CouldNotTell(Failure):
    exit_code = WAIT_UNKNOWN


# What main() must know before the command's own Context exists, or after it is gone: set by the
# --debug option wherever it was given (before or after the subcommand), never by a scan of argv,
# which would also see a run's own `--debug` after `--`.
# A command that knows better than main() which role a refusal means sets "needs" (drain: which host).
invocation: dict[str, Any] = {"debug": False, "command": "", "needs": None}


class Context:
    def __init__(self, config_path: Path | None, dsn: str | None, debug: bool, dsn_file: Path | None = None) -> None:
        self.config_path = config_path
        self.dsn_override = dsn
        self.dsn_file_override = dsn_file
        self.debug = debug
        self._settings: config.Settings | None = None

    @property
    def settings(self) -> config.Settings:
        if self._settings is None:
            try:
                self._settings = config.load(self.config_path)
            except config.ConfigError as exc:
                raise Failure(str(exc)) from None
        return self._settings

    def dsn(self) -> str:
        try:
            return config.resolve_dsn(self.settings, self.dsn_override, self.dsn_file_override)
        except config.ConfigError as exc:
            raise Failure(str(exc)) from None

    def connect(self, schema: bool = True) -> store.Connection:
        """A connection to the database; with `schema`, one whose schema is current (else a Failure that
        says to run `unitvisor migrate`, instead of an UndefinedTable from the first query)."""
        dsn = self.dsn()
        try:
            conn = store.connect(dsn)
        except store.DatabaseUnavailable as exc:
            raise Unreachable(str(exc)) from None
        except store.DatabaseError as exc:
            raise Failure(str(exc)) from None
        if schema:
            try:
                _check_schema(conn, dsn)
            except BaseException:
                conn.close()
                raise
        return conn


def _check_schema(conn: store.Connection, dsn: str) -> None:
    pending = store.pending_migrations(conn)
    if not pending:
        return
    where = store.dsn_location(dsn)
    if len(pending) == len(store.migration_files()):
        raise Failure(f"the database at {where} has no unitvisor schema yet: run `unitvisor migrate`")
    raise Failure(f"the database at {where} lacks migration{'s' if len(pending) > 1 else ''} "
                  f"{', '.join(pending)}: run `unitvisor migrate`")


pass_ctx = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help=f"Configuration file [default: {config.DEFAULT_PATH}].")
# $UNITVISOR_DSN and $UNITVISOR_DSN_FILE are read by config.resolve_dsn, not by click: a --dsn-file on
# the command line must win over $UNITVISOR_DSN, which click would have made a --dsn beside it.
@click.option("--dsn", default=None,
              help="PostgreSQL connection string (also $UNITVISOR_DSN).")
@click.option("--dsn-file", type=click.Path(path_type=Path), default=None, metavar="PATH",
              help="A file holding the DSN, readable by its owner only: the admin's password stays off "
                   "the command line (also $UNITVISOR_DSN_FILE).")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(__version__, prog_name="unitvisor")
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None, dsn: str | None, dsn_file: Path | None, debug: bool) -> None:
    """unitvisor: run commands as limited, supervised systemd units, queued in PostgreSQL.

    --config, --dsn, --dsn-file and --debug may also follow the command (`unitvisor runs --dsn ...`);
    there they win over the same option given before it. Nothing after `--` is read as an option.
    The DSN is the first of --dsn, --dsn-file, $UNITVISOR_DSN, $UNITVISOR_DSN_FILE, the config's
    [database] dsn and its dsn_file (/etc/unitvisor/dsn: the host's own).

    \b
    Example:
      unitvisor submit --memory 256M --cpu 50% -- /usr/bin/python3 -c 'print("hello")'
      unitvisor show 3f2a9c
    """
    invocation["debug"] = invocation["debug"] or debug
    invocation["command"] = ctx.invoked_subcommand or ""
    ctx.obj = Context(config_path, dsn, debug, dsn_file)


# -- global options after the subcommand ---------------------------------------------------------
#
# `unitvisor runs --dsn X` works as `unitvisor --dsn X runs` does: every command carries hidden copies
# of the group's --config, --dsn, --dsn-file and --debug, whose callbacks write into the one Context (made by the
# group's callback, which click runs before it parses the subcommand's arguments). Click parses them
# as the command's own options, so `--` ends them as it ends any option: a run's command after it
# (`submit -- /bin/sh -c ... --dsn x --debug`) is never read. The copies have no $UNITVISOR_DSN: the
# environment must not override a --dsn given before the command.


def _global_option_callback(attribute: str) -> Any:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None or value is False:
            return value
        obj = ctx.find_object(Context)
        if obj is not None:
            setattr(obj, attribute, value)
            # A DSN given after the command wins over the other kind given before it, as over its own.
            if attribute in _DSN_SOURCES:
                setattr(obj, _DSN_SOURCES[attribute], None)
        if attribute == "debug":
            invocation["debug"] = True
        return value
    return callback


_DSN_SOURCES = {"dsn_override": "dsn_file_override", "dsn_file_override": "dsn_override"}


def _global_options() -> list[click.Option]:
    return [
        click.Option(["--config", "global_config"], type=click.Path(path_type=Path), hidden=True,
                     expose_value=False, callback=_global_option_callback("config_path")),
        click.Option(["--dsn", "global_dsn"], hidden=True, expose_value=False,
                     callback=_global_option_callback("dsn_override")),
        click.Option(["--dsn-file", "global_dsn_file"], type=click.Path(path_type=Path), hidden=True,
                     expose_value=False, callback=_global_option_callback("dsn_file_override")),
        click.Option(["--debug", "global_debug"], is_flag=True, hidden=True, expose_value=False,
                     callback=_global_option_callback("debug")),
    ]


def add_global_options(group: click.Group) -> None:
    for command in group.commands.values():
        command.params.extend(_global_options())
        if isinstance(command, click.Group):
            add_global_options(command)
