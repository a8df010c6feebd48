"""Hold and release a queued run, freeze and thaw a running one (schema 030)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import click

from supervisor import store
from supervisor.cli.app import Context, Failure, cli, pass_ctx
from supervisor.cli.lookup import no_run, resolve_run_id
from supervisor.cli.output import iso
from supervisor.cli.params import quantity
from supervisor.quantities import parse_duration

_JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _request(ctx: Context, run_id: str, request: Any) -> tuple[uuid.UUID, store.Transition]:
    """One request on one run; the database's refusal (wrong state) fails in its own words."""
    with ctx.connect() as conn:
        rid = resolve_run_id(conn, run_id)
        try:
            result = request(conn, rid)
        except store.Refused as exc:
            raise Failure(str(exc)) from None
        if result.state is None:
            raise no_run(conn, run_id)
    return rid, result


def _say(as_json: bool, rid: uuid.UUID, result: store.Transition, text: str, **extra: Any) -> None:
    if as_json:
        click.echo(json.dumps({"id": str(rid), "state": result.state, "changed": result.changed, **extra}, indent=2))
    else:
        click.echo(text)


@cli.command()
@click.argument("run_id", metavar="RUN")
@_JSON_OPTION
@pass_ctx
def hold(ctx: Context, run_id: str, as_json: bool) -> None:
    """Hold a queued run: it stays queued and no host claims it until `release`.

    A held run at the head of its --concurrency-key keeps its place: the runs behind it wait. It
    still expires at its --start-deadline. A starting, running or ended run is refused (freeze a
    running one instead). Holding a held run changes nothing (exit 0).

    \b
    Example:
      unitvisor hold 3f2a9c
    """
    rid, result = _request(ctx, run_id, store.hold_run)
    _say(as_json, rid, result, f"run {rid} held" if result.changed else f"run {rid} was held already")


@cli.command()
@click.argument("run_id", metavar="RUN")
@_JSON_OPTION
@pass_ctx
def release(ctx: Context, run_id: str, as_json: bool) -> None:
    """Release a held run: it is claimed as any queued run, at once (or at its --not-before).

    \b
    Example:
      unitvisor release 3f2a9c
    """
    rid, result = _request(ctx, run_id, store.release_run)
    if not result.changed:
        raise Failure(f"run {rid} is not held ({result.state}); nothing to release")
    _say(as_json, rid, result, f"run {rid} released")


def _await_answer(ctx: Context, rid: uuid.UUID, timeout: float) -> dict[str, Any] | None:
    """The run's open attempt's freeze once its host answered, or None if it has not within timeout."""
    deadline = time.monotonic() + timeout
    with ctx.connect() as conn:
        while True:
            freezes = store.freezes_of(conn, rid)
            latest = freezes[max(freezes)] if freezes else None
            if latest is not None and not latest["pending"]:
                return latest
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.25)


def _freeze_command(ctx: Context, run_id: str, timeout: float | None, as_json: bool, wanted: str) -> None:
    request = store.freeze_run if wanted == "frozen" else store.thaw_run
    verb = "freeze" if wanted == "frozen" else "thaw"
    rid, result = _request(ctx, run_id, request)
    if not result.changed:
        _say(as_json, rid, result, f"run {rid}: already {wanted} (or asked to be)", freeze=wanted, pending=False)
        return
    answer = _await_answer(ctx, rid, 10.0 if timeout is None else timeout)
    if answer is None:
        _say(as_json, rid, result, f"run {rid}: {verb} requested; its host has not acted on it yet "
             "(`unitvisor show` says when it does)", freeze=None, pending=True)
        return
    if answer["refused"]:
        if as_json:
            _say(True, rid, result, "", freeze=answer["state"], pending=False, refused=answer["refused"],
                 acted_at=iso(answer["acted_at"]))
        raise Failure(f"run {rid}: {answer['text']}")
    _say(as_json, rid, result, f"run {rid} {answer['state']}", freeze=answer["state"], pending=False,
         acted_at=iso(answer["acted_at"]))


_TIMEOUT_OPTION = click.option(
    "--timeout", callback=quantity(parse_duration, 0, 3600, "0s to 1h", "seconds"),
    help="How long to wait for the run's host to act, like 30s [default: 10s]; 0: do not wait.")


@cli.command()
@click.argument("run_id", metavar="RUN")
@_TIMEOUT_OPTION
@_JSON_OPTION
@pass_ctx
def freeze(ctx: Context, run_id: str, timeout: float | None, as_json: bool) -> None:
    """Freeze a running run where it is (systemd's FreezeUnit: the cgroup freezer), until `thaw`.

    The run's host does it (this command may run anywhere): it waits for the host's answer. A frozen
    run keeps its slot on its host and its memory. Its --runtime clock counts on while it is frozen,
    but it is not ended by it while frozen: thaw or cancel it before its --runtime is over (README,
    Hold and freeze). A host that cannot freeze (cgroup v1) refuses, and this says so (exit 1).

    \b
    Example:
      unitvisor freeze 3f2a9c && unitvisor thaw 3f2a9c
    """
    _freeze_command(ctx, run_id, timeout, as_json, "frozen")


@cli.command()
@click.argument("run_id", metavar="RUN")
@_TIMEOUT_OPTION
@_JSON_OPTION
@pass_ctx
def thaw(ctx: Context, run_id: str, timeout: float | None, as_json: bool) -> None:
    """Thaw a frozen run: its processes go on where they stopped (systemd's ThawUnit).

    \b
    Example:
      unitvisor thaw 3f2a9c
    """
    _freeze_command(ctx, run_id, timeout, as_json, "thawed")
