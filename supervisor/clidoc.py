"""Renders docs/cli.md from the commands themselves, so the reference cannot drift from the code.

    python -m supervisor.clidoc > docs/cli.md

tests/unit/test_clidoc.py fails when docs/cli.md is not what this prints.
"""

from __future__ import annotations

import click

from supervisor.cli import cli

JSON_FORMATS = """\
## JSON output

`--json` output is stable: fields are only ever added, never renamed or removed. Times are ISO 8601
in UTC; absent values are `null`.

`unitvisor show RUN --json`: one object.

| field | meaning |
|---|---|
| `id` | the run's UUID |
| `state` | `queued`, `starting`, `running`, `succeeded`, `failed`, `cancelled`, `expired` (not started by \
its start deadline) or `skipped` (a run it runs after can no longer be what it needs) |
| `argv` | the command, exactly as it runs |
| `environment` | object of NAME: value |
| `working_directory`, `user`, `host_pin`, `priority` | as submitted |
| `private_network` | `true`: the run asked for no network but its loopback (a host's `[runs] \
private_network` takes it from every run) |
| `limits` | `memory_max` (bytes), `memory_high` (bytes), `cpu_quota_percent`, `tasks_max`, `io_weight`, \
`runtime_max_sec` |
| `stop` | graceful stop: `stop_signal` (the one in effect: `TERM` unless the run names another), \
`stop_timeout` (seconds before SIGKILL; `null`: the host's `[systemd] stop_grace`), `warn_before` (seconds before \
`runtime_max_sec`; `null`: no warning), `warn_signal` |
| `max_attempts` | attempts in all |
| `concurrency_key` | runs with the same key never run at the same time (`null`: none) |
| `host_labels` | placement: labels every host that runs it must have (`{}`: any host) |
| `avoid_failed_host` | whether a retry prefers another host than the one its last attempt failed on: \
`null` after a lost attempt only (the default), `true` after any failed attempt, `false` never |
| `not_before`, `start_deadline` | when the run may first start, and by when it must have (`null`: none) |
| `cancel_requested_at`, `created_at`, `finished_at` | times |
| `wait_reason` | while queued: why it has not started: its `not_before` still ahead, the run of its \
concurrency key it waits for, or why no live host accepts it (`null`: none of these) |
| `no_host_accepts` | while queued: why no live host accepts it now (`unitvisor.refusals_now`, asked when \
`show` runs, where `wait_reason` has it only after two poll intervals); `null` when one does |
| `attempts` | list, oldest first: `attempt`, `host`, `unit`, `invocation_id`, `claimed_at`, `started_at`, \
`ended_at`, `outcome`, `exit_status`, `reason`, `accounting` (`cpu_usage_nsec`, `memory_peak_bytes`, `io_read_bytes`, \
`io_write_bytes`, `tasks_peak`: null where not measured), `not_measured` (an ended attempt's null figures, each with \
what its host would need to measure it), `output_tail`, `warned_at` (when its host sent the run's `warn_signal`; \
`null`: not sent) |
| `after_policy`, `after` | what the run needs of the runs it runs after (`succeeded` or `finished`; \
`null`: it names none), and those runs: `id`, `state`, `met` (`true`; `false`: can no longer be; `null`: not \
ended yet) |
| `dependants` | the ids of the runs that run after this one |
| `events` | the recent history, oldest first: `at`, `attempt`, `host`, `state`, `reason` |
| `logs_command` | the journalctl command that shows the run's output |

`outcome` is one of `success`, `exit-code`, `signal`, `core-dump`, `timeout`, `oom-kill`, `watchdog`,
`start-failed`, `lost`, `cancelled`, `refused`; `exit_status` is `exit:N` or `signal:NAME`.

`unitvisor runs --json`: a list, newest first, of `id`, `state`, `host`, `attempt`, `created_at`,
`started_at`, `ended_at`, `outcome`, `exit_status` (the latest attempt's values, as
`unitvisor.run_status` returns them: an expired run's `outcome` is `expired`, a skipped run's `skipped`),
`argv`, `labels`,
`concurrency_key`, `not_before`, `start_deadline`, `wait_reason` and `no_host_accepts` (as in `show`).
A role that cannot read every run (a host's own, the default DSN on a host) gets the runs it may read,
and a note on stderr says the list may be partial; the JSON on stdout stays a list.

`unitvisor hosts --json`: a list of `id`, `name`, `state` (`active`, `draining`, `stopped`, `dead`),
`display_state` (the state with `(drained)`, `(stale)` or `(conflict)`), `max_runs`, `memory_budget`,
`version`, `started_at`, `heartbeat_at`, `heartbeat_age_seconds`, `in_flight`, `epoch`, `instance`,
`can_start`, `cannot_start_reason`, `allowed_executables`, `run_user`, `allowed_users`,
`poll_interval_seconds`, `host_dead_after_seconds`, `dead_at`, `dead_reason`, `comes_back_draining`
(a stopped or dead host whose next registration makes it `draining`: it was drained when it stopped
or died, or drained while stopped), `conflict` (what a refused second daemon said, while it lasts),
`down_confirmed_at` and `down_confirmed_by` (`hosts confirm-down`: `null` unless an operator confirmed
the host down and it was not heard from since), `returned_late_at` (when it was last heard from
after its heartbeat was older than two poll intervals and half its `host_dead_after`, without being
declared: every silent host then gets its `host_dead_after` again, [fleet.md](fleet.md#dead-hosts)),
`labels` (its `[host] labels`, `{}` for none: what a run's `host_labels` must be among).

`unitvisor schedules --json`: a list of `name`, `cron`, `timezone`, `run` (the schedule's submit_run
arguments), `overlap`, `catch_up`, `paused`, `next_due` (`null`: never again), `last_due`, `last_result`,
`last_at`, `last_run_id`, `last_run_state` (`null` once the run is pruned), `submitted`, `skipped`, `missed`,
`created_at`, `created_by`.

## Exit codes

0 success; 1 failure (including "nothing to do" refusals such as cancelling a finished run, and a
database without the schema or behind it: run `unitvisor migrate`); 2 bad usage. `wait` exits 0 when
the run succeeded and 1 when it failed, was cancelled, expired or was skipped. `wait` also exits
124 when its `--timeout` passed first, and 75 (EX_TEMPFAIL) when it could not tell how the run ended:
the database was unreachable, or lost while waiting; the run may still be running, so wait again.
Errors are one line on stderr; `--debug` shows tracebacks (never for bad usage).

`--config`, `--dsn`, `--dsn-file` and `--debug` may come before or after the command (`unitvisor --dsn X
runs` or `unitvisor runs --dsn X`); after it they win. Nothing after `--` is read as an option.
"""


def render() -> str:
    # The group's context_settings (-h as well as --help), as `unitvisor` itself applies them: without
    # them the reference would show `--help` alone, or, since click 8.2 caches each command's help
    # option, whichever of the two was asked for first in this process.
    root = click.Context(cli, info_name="unitvisor", terminal_width=100, max_content_width=100,
                         **cli.context_settings)
    parts = ["# unitvisor command reference", "",
             "Generated by `python -m supervisor.clidoc > docs/cli.md`; do not edit by hand.", "",
             "```", cli.get_help(root), "```", ""]
    for name in sorted(cli.commands):
        command = cli.commands[name]
        sub = click.Context(command, info_name=name, parent=root, terminal_width=100, max_content_width=100)
        parts += [f"## unitvisor {name}", "", "```", command.get_help(sub), "```", ""]
        for sub_name in sorted(getattr(command, "commands", {})):
            leaf = command.commands[sub_name]
            leaf_ctx = click.Context(leaf, info_name=sub_name, parent=sub, terminal_width=100, max_content_width=100)
            parts += [f"## unitvisor {name} {sub_name}", "", "```", leaf.get_help(leaf_ctx), "```", ""]
    return "\n".join(parts) + "\n" + JSON_FORMATS


if __name__ == "__main__":
    print(render(), end="")
