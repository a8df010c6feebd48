"""Plain values that cross module boundaries: a run row and an attempt row, as the store reads them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

# expired (schema 006): not started by its start deadline; skipped (schema 035): a run it runs after
# can no longer succeed (or end, as it needs), so it never started.
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "expired", "skipped"})
RUN_STATES = ("queued", "starting", "running", "succeeded", "failed", "cancelled", "expired", "skipped")


@dataclass(frozen=True)
class Run:
    id: uuid.UUID
    argv: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    working_directory: str | None = None
    run_user: str | None = None
    memory_max: int | None = None
    cpu_quota_percent: int | None = None
    tasks_max: int | None = None
    io_weight: int | None = None
    runtime_max_sec: int | None = None
    max_attempts: int = 1
    retry_backoff_sec: int = 10
    retry_backoff_max_sec: int = 600
    retry_on: list[str] | None = None
    host_pin: str | None = None
    priority: int = 0
    private_network: bool = False  # PrivateNetwork=yes: the run has no network but loopback
    state: str = "queued"
    cancel_requested_at: datetime | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    finished_at: datetime | None = None
    wait_reason: str | None = None  # why no live host accepts it, while it is queued
    labels: dict[str, str] = field(default_factory=dict)  # the control plane's own tags (schema 005)
    # When it may start (schema 006): never beside a live run of the same key; not before not_before;
    # expired if it has not started by start_deadline.
    concurrency_key: str | None = None
    not_before: datetime | None = None
    start_deadline: datetime | None = None
    # MemoryHigh= (schema 017): over it the kernel throttles the run and reclaims its memory, never
    # kills it; at most memory_max.
    memory_high: int | None = None
    # Graceful stop (schema 026, supervisor/stopsignals.py): the unit's KillSignal= (None: TERM) and
    # TimeoutStopSec= in seconds (None: systemd's default), then SIGKILL; warn_signal sent warn_before
    # seconds before runtime_max_sec ends the run.
    stop_signal: str | None = None
    stop_timeout: int | None = None
    warn_before: int | None = None
    warn_signal: str | None = None
    # Failure rules (schema 027): exit statuses and signals that end the run at once; whether an
    # attempt lost with its host counts against max_attempts; the cap on those that do not.
    fail_on: list[str] | None = None
    count_lost: bool = False
    max_lost_attempts: int = 3
    # How many runs of its concurrency_key may be live at once, this one among them (schema 032).
    concurrency_limit: int = 1
    # Placement (schema 033): labels every host that runs it must have; whether a retry prefers another
    # host than its last attempt's (None: after a lost attempt only; True: after any failure; False: never).
    host_labels: dict[str, str] = field(default_factory=dict)
    avoid_failed_host: bool | None = None
    # Its attempts settled `lost` so far (not a column: counted from attempts when the run is read).
    lost_attempts: int = 0


@dataclass(frozen=True)
class Attempt:
    run_id: uuid.UUID
    attempt: int
    host_id: str
    unit_name: str
    invocation_id: str | None = None
    claimed_at: datetime | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    outcome: str | None = None
    exit_status: str | None = None
    reason: str | None = None
    warned_at: datetime | None = None  # when its host sent the run's warn_signal (schema 026)


@dataclass(frozen=True)
class Accounting:
    """What systemd and the kernel measured of one attempt's unit (sql/migrations/007_outcome_record.sql,
    sql/migrations/017_accounting.sql); None: not measured (this systemd, kernel or cgroup layout has no such
    figure, or the outcome was recorded without the unit)."""

    cpu_usage_nsec: int | None = None
    memory_peak_bytes: int | None = None
    io_read_bytes: int | None = None
    io_write_bytes: int | None = None
    # The most tasks the unit had at once: its cgroup's pids.peak, copied by its ExecStopPost=
    # before the cgroup is removed (supervisor/taskspeak.py).
    tasks_peak: int | None = None


@dataclass(frozen=True)
class OutcomeRecord:
    """What an ended attempt keeps besides its outcome: systemd's measurements and its output's tail."""

    attempt: int
    accounting: Accounting = field(default_factory=Accounting)
    output_tail: str | None = None


@dataclass(frozen=True)
class RunStatus:
    """A run's status as unitvisor.run_status reports it to any control plane (sql/migrations/005_sql_api.sql):
    the run's state and its latest attempt's, if any."""
    id: uuid.UUID
    state: str
    created_at: datetime
    finished_at: datetime | None
    attempts: int  # how many attempts it has had
    attempt: int | None  # the latest attempt's number; None until a host claims the run
    host_id: str | None
    outcome: str | None
    exit_status: str | None
    reason: str | None
    cancel_requested: bool
    wait_reason: str | None  # why no live host accepts it, while it is queued
    labels: dict[str, str]


@dataclass(frozen=True)
class Pruned:
    """What one call of unitvisor.prune deleted (or, dry, would delete). busy: another session is
    pruning right now (one pruner of the fleet at a time); nothing was deleted."""

    runs: int
    attempts: int
    events: int
    jobs: int
    busy: bool = False

    def __add__(self, other: Pruned) -> Pruned:
        return Pruned(self.runs + other.runs, self.attempts + other.attempts, self.events + other.events,
                      self.jobs + other.jobs, self.busy and other.busy)

    def full(self, batch_size: int) -> bool:
        """Whether the batch was full: more history of that age may be left."""
        return self.runs >= batch_size or self.jobs >= batch_size
