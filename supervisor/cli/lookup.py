"""From what a person typed to a run: a full id or a unique prefix."""

from __future__ import annotations

import re
import uuid

import click

from supervisor import store
from supervisor.cli.app import Failure
from supervisor.model import Run

_RUN_ID_PREFIX_RE = re.compile(r"^[0-9a-f][0-9a-f-]{5,35}\Z")


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
        raise Failure(f"no run with id {text}")
    if len(found) > 1:
        raise Failure(f"run id {text} is ambiguous: {', '.join(str(r) for r in found)}")
    return found[0]


def load_run(conn: store.Connection, text: str) -> Run:
    run = store.get_run(conn, resolve_run_id(conn, text))
    if run is None:
        raise Failure(f"no run with id {text}")
    return run

