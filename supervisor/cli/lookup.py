"""From what a person typed to a run: a full id or a unique prefix; and what to say when none is
found, which on a host's own DSN may mean "hidden", not "absent"."""

from __future__ import annotations

import re
import uuid

import click

from supervisor import store
from supervisor.cli.app import Failure
from supervisor.model import Run

_RUN_ID_PREFIX_RE = re.compile(r"^[0-9a-f][0-9a-f-]{5,35}\Z")

# Where the admin's DSN goes (README, Roles): what a person on a host should use instead of its own.
ADMIN_DSN_HINT = "use the admin's DSN (--dsn-file or UNITVISOR_DSN_FILE)"


def resolve_run_id(conn: store.Connection, text: str) -> uuid.UUID:
    """A full UUID, or a unique prefix of at least 6 characters."""
    candidate = text.strip().lower()
    try:
        return uuid.UUID(candidate) if len(candidate) >= 32 else _by_prefix(conn, text, candidate)
    except ValueError:
        return _by_prefix(conn, text, candidate)


def _by_prefix(conn: store.Connection, text: str, prefix: str) -> uuid.UUID:
    if not _RUN_ID_PREFIX_RE.match(prefix):
        raise click.UsageError(f"invalid run id {text!r}: expected a UUID or at least 6 of its first characters")
    found = store.find_run_ids(conn, prefix)
    if not found:
        raise no_run(conn, text)
    if len(found) > 1:
        raise Failure(f"run id {text} is ambiguous: {', '.join(str(r) for r in found)}")
    return found[0]


def load_run(conn: store.Connection, text: str) -> Run:
    run = store.get_run(conn, resolve_run_id(conn, text))
    if run is None:
        raise no_run(conn, text)
    return run


def no_run(conn: store.Connection, text: str) -> Failure:
    """"no run with id X" where this role reads every run; else (a host's own DSN, the default on a
    host) the run may well exist, pinned to another host and hidden by row-level security: say so,
    and whose DSN shows it, rather than send a person looking for a run that was never lost."""
    role, sees_all = store.sees_every_run(conn)
    if sees_all:
        return Failure(f"no run with id {text}")
    return Failure(f"run {text} is not visible to role {role} (a host's role sees no run pinned to another "
                   f"host), or does not exist; {ADMIN_DSN_HINT}")


def partial_list_note(conn: store.Connection) -> str | None:
    """What `runs` says when its list may lack runs this role cannot read; None when it reads all."""
    role, sees_all = store.sees_every_run(conn)
    if sees_all:
        return None
    return (f"role {role} is not shown runs pinned to other hosts (row-level security): this list may be "
            f"partial; {ADMIN_DSN_HINT}")
