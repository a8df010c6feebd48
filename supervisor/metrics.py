"""The daemon's Prometheus metrics: every metric object, and the HTTP server that serves them.

The metrics live in a registry of their own, not prometheus_client's global one: what a scrape shows
is exactly what this module adds (plus the process collector, on purpose), and tests can make as many
as they like side by side. docs/metrics.md lists every metric and what it means; the daemon and the
reconciler call the few methods of `Metrics` where the facts are known.

The server must never take the daemon down: an address it cannot listen on is logged once, and the
daemon goes on without metrics. It runs in a thread of its own; a scrape reads the daemon's state
(`State`) from there, attributes only, without locks, which the GIL makes safe for these plain values.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, ProcessCollector, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric

from supervisor import __version__, pressure
from supervisor.config import parse_listen
from supervisor.freezer import RESULTS as FREEZE_RESULTS
from supervisor.log import event
from supervisor.model import Attempt, Pruned, Run
from supervisor.outcomes import OUTCOMES

# The states a daemon can know its host in: the database's own (as the last registration or heartbeat
# said; a live daemon never reads its own host as stopped or dead), and `unregistered` while it has
# no registration it can vouch for (no database, fenced and registering again, host id held by another).
PRUNED_TABLES = ("runs", "attempts", "events", "jobs")  # the counts of a retention batch (model.Pruned)
# Why a schedule's due time made no run: its last run was still live (overlap skip), or submit_run refused it.
SCHEDULE_SKIPPED_REASONS = ("overlap", "refused")
# Why the fleet upkeep held a silent host's declaration back (unitvisor.declare_dead, sql/019_fleet_upkeep.sql, 036).
HELD_REASONS = ("declarer-late", "fleet-late", "fleet-silent", "fleet-recovering", "cap")
HOST_STATES = ("active", "draining", "unregistered")

# Buckets that suit each quantity. A claim's latency is NOTIFY-fast when a host is free (well under a
# second), a poll interval when a notification is lost, and minutes to hours in a backlog.
CLAIM_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# One StartTransientUnit is about 5 ms (p99 18 ms) on a quiet host (TESTBED.md); a batch waits its turn.
SPAWN_LATENCY_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# One claim statement: milliseconds; the server ends it after its statement_timeout (15 s).
CLAIM_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15)
# A pass over thousands of runs takes seconds (docs/benchmarks.md); an idle one milliseconds.
RECONCILE_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True)
class State:
    """The daemon's state at the moment of a scrape."""

    in_flight: int = 0
    database_up: bool = False
    systemd_up: bool = False
    host_state: str = "unregistered"
    admission: str = pressure.OPEN  # what a daemon that has not read its pressure yet does
    pressure: dict[str, float] = field(default_factory=dict)  # avg10 of `some`, percent, by resource
    # The fleet's named limits (schema 032) as the last reconcile pass read them: name -> (live, max_live).
    limits: dict[str, tuple[int, int]] = field(default_factory=dict)


class _StateCollector:
    """The gauges, read from the daemon when scraped rather than set by it: they are always current,
    and the loop carries no hook for them."""

    def __init__(self, state: Callable[[], State]) -> None:
        self.state = state

    def describe(self) -> Iterable[Metric]:
        # Described without calling `state`, which the registry would otherwise do at registration.
        return self._families()

    def collect(self) -> Iterable[Metric]:
        return self._families(self.state())

    def _families(self, state: State | None = None) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("unitvisor_runs_in_flight",
                                      "Attempts of this host without an outcome yet, as the daemon counts them")
        database = GaugeMetricFamily("unitvisor_database_up",
                                     "1 while the daemon holds its PostgreSQL connections, 0 while it retries")
        systemd = GaugeMetricFamily("unitvisor_systemd_up",
                                    "1 while the daemon holds its D-Bus connections to systemd, 0 while it retries")
        host = GaugeMetricFamily("unitvisor_host_state", "This host's state as its daemon knows it: 1 for the "
                                 "current state, 0 for the others", labels=["state"])
        admission = GaugeMetricFamily("unitvisor_admission", "Admission by pressure: 1 for what this host claims "
                                      "now (open, slowed: fewer, stopped: none, off: PSI not read), 0 for the "
                                      "others", labels=["state"])
        stall = GaugeMetricFamily("unitvisor_slice_pressure_ratio", "avg10 of `some` in the runs' slice's PSI "
                                  "file, by resource: the share of the last 10 s in which a task of the slice "
                                  "waited for it (absent while admission by pressure is off)", labels=["resource"])
        # Fleet-wide figures, the same on every daemon (unitvisor.limit_status): one series per limit the
        # operator set, so the label stays bounded by what the operator made.
        limit_live = GaugeMetricFamily("unitvisor_limit_live", "Runs live (starting or running) in the fleet "
                                       "under each named limit, as this daemon's last reconcile pass counted them",
                                       labels=["limit"])
        limit_max = GaugeMetricFamily("unitvisor_limit_max", "Each named limit's maximum of live runs (max_live)",
                                      labels=["limit"])
        if state is not None:
            for name, (live, most) in sorted(state.limits.items()):
                limit_live.add_metric([name], live)
                limit_max.add_metric([name], most)
            for name in pressure.STATES:
                admission.add_metric([name], 1 if name == state.admission else 0)
            for resource, figure in sorted(state.pressure.items()):
                stall.add_metric([resource], figure / 100.0)
            in_flight.add_metric([], state.in_flight)
            database.add_metric([], 1 if state.database_up else 0)
            systemd.add_metric([], 1 if state.systemd_up else 0)
            # A state the database may add one day shows up as itself rather than vanishing: the
            # label stays bounded by the database's own constraint on host states.
            for name in dict.fromkeys((*HOST_STATES, state.host_state)):
                host.add_metric([name], 1 if name == state.host_state else 0)
        yield from (in_flight, database, systemd, host, admission, stall, limit_live, limit_max)


class Metrics:
    """The metric objects of one daemon, in a registry of their own, and their server."""

    def __init__(self, state: Callable[[], State] = State) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.runs_started = Counter("unitvisor_runs_started", "Units this daemon started, one per attempt "
                                    "(an existing unit adopted is not counted)", registry=r)
        self.outcomes = Counter("unitvisor_outcomes", "Attempt outcomes this daemon recorded, by kind (those "
                                "of a host it declared dead included: they count as lost here)", ["outcome"],
                                registry=r)
        for outcome in OUTCOMES:
            # Every kind from the start, at 0: increase() and rate() then see the first one happen.
            self.outcomes.labels(outcome)
        self.runs_ended_by_rule = Counter(
            "unitvisor_runs_ended_by_rule", "Runs this daemon's outcomes ended by a failure rule with attempts "
            "left: fail_on named the exit status, or max_lost_attempts of its attempts were lost with their host "
            "(a run that kills its hosts)", ["rule"], registry=r)
        for rule in ("fail_on", "max_lost_attempts"):
            self.runs_ended_by_rule.labels(rule)
        self.hosts_declared_dead = Counter("unitvisor_hosts_declared_dead", "Silent hosts this daemon declared "
                                           "dead (their open attempts became lost)", registry=r)
        self.dead_declarations_held = Counter(
            "unitvisor_dead_declarations_held", "Silent hosts this daemon's fleet upkeep found and did not declare "
            "dead in a pass, by why: declarer-late (its own heartbeat was late), fleet-late (most hosts were), "
            "fleet-silent (most hosts were silent at once), fleet-recovering (within host_dead_after of such a hold), "
            "cap ([fleet] max_dead_per_pass)", ["reason"], registry=r)
        for reason in HELD_REASONS:
            self.dead_declarations_held.labels(reason)
        self.upkeep_failures = Counter("unitvisor_fleet_upkeep_failures", "Fleet upkeep passes of this daemon that "
                                       "failed (a statement timeout, a lock): the claim and the rest of the loop "
                                       "went on", registry=r)
        self.heartbeats_aside = Counter("unitvisor_heartbeats_aside", "Heartbeats sent on a connection of their own "
                                        "because the loop was late with its probe (busy on a slow database)",
                                        registry=r)
        # Outcomes count attempts; an expired run has none that started, so its end is counted here.
        self.runs_expired = Counter("unitvisor_runs_expired", "Queued runs past their start deadline that this "
                                    "daemon's fleet upkeep ended as expired (the one caller that expires runs "
                                    "from schema 12 on: summed over the fleet, every expiry)", registry=r)
        # A skipped run (schema 035) has no attempt either; it is skipped by whatever session ended the run it
        # needed, and counted here by the daemon that takes it from the database (count_skips).
        self.runs_skipped = Counter("unitvisor_runs_skipped", "Runs ended skipped (a run they run after can no "
                                    "longer be what they need) that this daemon counted; each skip is counted by "
                                    "one daemon: summed over the fleet, every skip", registry=r)
        # Schedules (sql/migrations/028_schedules.sql): what this daemon's upkeep did with due times.
        self.schedule_runs = Counter("unitvisor_schedule_runs_submitted", "Runs of schedules this daemon's fleet "
                                     "upkeep submitted, one per due time (summed over the fleet: every one)",
                                     registry=r)
        self.schedule_missed = Counter("unitvisor_schedule_times_missed", "Due times of schedules that this "
                                       "daemon's upkeep reached more than a minute late (no daemon was up): "
                                       "dropped, or caught up by one run (catch_up one)", registry=r)
        self.schedule_skipped = Counter("unitvisor_schedule_times_skipped", "Due times of schedules passed over "
                                        "because the schedule's last run was still live (overlap skip), or whose "
                                        "run submit_run refused", ["reason"], registry=r)
        for reason in SCHEDULE_SKIPPED_REASONS:
            self.schedule_skipped.labels(reason)
        self.pruned_rows = Counter("unitvisor_pruned_rows", "History rows this daemon deleted for [retention], by "
                                   "table (runs, attempts, events, jobs)", ["table"], registry=r)
        for table in PRUNED_TABLES:
            self.pruned_rows.labels(table)
        # Graceful stop (schema 026): warnings sent before runtime_max_sec, and stops (a cancel, the
        # runtime limit) that a run did not obey within its stop_timeout, ended by SIGKILL.
        self.stop_warnings = Counter("unitvisor_stop_warnings", "Warnings (a run's warn_signal, warn_before "
                                     "seconds before its runtime_max_sec) this daemon sent", registry=r)
        self.stop_kills = Counter("unitvisor_stop_kills", "Attempts whose stop (a cancel, or runtime_max_sec) "
                                  "timed out into SIGKILL: the run did not end within its stop_timeout after "
                                  "its stop_signal", registry=r)
        # A refused freeze (a cgroup v1 host, a unit gone) is what to alert on: the run was not frozen.
        self.freezes = Counter("unitvisor_freezes", "Freeze and thaw requests (unitvisor freeze/thaw) this daemon "
                               "answered, by result: frozen, thawed, refused (its host could not)", ["result"],
                               registry=r)
        for result in FREEZE_RESULTS:
            self.freezes.labels(result)
        self.claim_latency = Histogram("unitvisor_claim_latency_seconds", "From a first attempt's spawn job being "
                                       "due (its run queued) to its claim by this host, by the database's clock",
                                       buckets=CLAIM_LATENCY_BUCKETS, registry=r)
        self.spawn_latency = Histogram("unitvisor_spawn_latency_seconds", "From a claim's return to its unit "
                                       "started (StartTransientUnit answered)", buckets=SPAWN_LATENCY_BUCKETS,
                                       registry=r)
        self.claim_duration = Histogram("unitvisor_claim_duration_seconds", "One claim statement, from sending it "
                                        "to its answer (claims that found nothing included)",
                                        buckets=CLAIM_DURATION_BUCKETS, registry=r)
        self.reconcile_duration = Histogram("unitvisor_reconcile_duration_seconds", "One full reconcile pass of "
                                            "this host's attempts and units", buckets=RECONCILE_DURATION_BUCKETS,
                                            registry=r)
        Info("unitvisor_build", "The running daemon's version", registry=r).info({"version": __version__})
        ProcessCollector(registry=r)  # the daemon's CPU, memory, open files and start time
        r.register(_StateCollector(state))
        # Units of the latest claim not yet started, with when the claim returned: one batch at most,
        # replaced by the next claim, so that a unit never started (refused) is not kept for ever.
        self._claimed: dict[str, float] = {}
        self._server: WSGIServer | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- facts, as the daemon and the reconciler learn them ---------------------------------------

    def claimed(self, pairs: list[tuple[Run, Attempt]], sent: float) -> None:
        """A claim statement sent at monotonic `sent` has returned `pairs`."""
        now = time.monotonic()
        self.claim_duration.observe(max(0.0, now - sent))
        self._claimed = {attempt.unit_name: now for _, attempt in pairs}
        for run, attempt in pairs:
            latency = claim_latency(run, attempt)
            if latency is not None:
                self.claim_latency.observe(latency)

    def started(self, unit_name: str) -> None:
        """This daemon created an attempt's unit."""
        self.runs_started.inc()
        claimed = self._claimed.pop(unit_name, None)
        if claimed is not None:
            self.spawn_latency.observe(max(0.0, time.monotonic() - claimed))

    def settled(self, outcome: str, ended_by: str | None = None) -> None:
        """An outcome this daemon recorded; `ended_by`: the failure rule that ended its run, if one did."""
        self.outcomes.labels(outcome).inc()
        if ended_by is not None:
            self.runs_ended_by_rule.labels(ended_by).inc()

    def declared_dead(self, hosts: int) -> None:
        self.hosts_declared_dead.inc(hosts)

    def declarations_held(self, reason: str, hosts: int) -> None:
        self.dead_declarations_held.labels(reason).inc(hosts)

    def expired(self, runs: int) -> None:
        """This daemon's call of unitvisor.expire_runs committed, ending `runs` runs as expired."""
        self.runs_expired.inc(runs)

    def skipped(self, runs: int) -> None:
        """This daemon took `runs` skips that no daemon had counted (unitvisor.count_skips committed)."""
        self.runs_skipped.inc(runs)

    def schedules(self, submitted: int, missed: int, overlapping: int, refused: int) -> None:
        """This daemon's call of unitvisor.submit_due_schedules committed."""
        self.schedule_runs.inc(submitted)
        self.schedule_missed.inc(missed)
        self.schedule_skipped.labels("overlap").inc(overlapping)
        self.schedule_skipped.labels("refused").inc(refused)

    def pruned(self, pruned: Pruned) -> None:
        """One retention batch of this daemon's committed (nothing, when another daemon was pruning)."""
        for table in PRUNED_TABLES:
            self.pruned_rows.labels(table).inc(getattr(pruned, table))

    def reconciled(self, seconds: float) -> None:
        self.reconcile_duration.observe(max(0.0, seconds))

    # -- the server -------------------------------------------------------------------------------

    def serve(self, listen: str) -> bool:
        """Serve /metrics on `listen` ("ADDRESS:PORT", validated by the config; "" for none) from a
        thread of its own. False, after one event saying why, when it cannot: never an exception."""
        try:
            address = parse_listen(listen)  # validated with the config; a Settings made in code is not
            if address is None:
                event("metrics-off", detail="[metrics] listen is empty: no metrics are served")
                return False
            host, port = address
            server_class = _Server6 if ":" in host else _Server
            server = make_server(host, port, make_wsgi_app(self.registry), server_class, handler_class=_QuietHandler)
        except (OSError, ValueError) as exc:
            event("metrics-unavailable", level=logging.WARNING, listen=listen,
                  detail=f"cannot listen on {listen}: {getattr(exc, 'strerror', None) or exc}; the daemon goes on "
                  "without metrics (set [metrics] listen to a free address, or empty for none)")
            return False
        self._server, self._closing = server, False
        self._thread = threading.Thread(target=self._serve, args=(server,), name="metrics", daemon=True)
        self._thread.start()
        event("metrics-listening", listen=listen, url=f"http://{listen}/metrics")
        return True

    @property
    def address(self) -> tuple[str, int] | None:
        """Where the server listens, None when it does not."""
        return self._server.server_address[:2] if self._server else None

    def _serve(self, server: WSGIServer) -> None:
        # Not serve_forever, which wakes twice a second to look for a shutdown: an idle daemon wakes
        # for nothing (docs/benchmarks.md), so this one waits for a request, and close() sends one.
        server.timeout = None
        while not self._closing:
            server.handle_request()

    def close(self) -> None:
        if self._server is None:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            socket.create_connection(self._server.server_address[:2], timeout=2).close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server.server_close()
        self._server = self._thread = None


def claim_latency(run: Run, attempt: Attempt) -> float | None:
    """Seconds from a first attempt's spawn job being due to its claim, or None where the claim does
    not tell. The claim returns the run as it was just before (its `updated_at` is when it was last
    queued: submitted, or resumed before it ever ran, the moment its job became due) and the attempt's
    `claimed_at`, both by the database's clock, so no host's clock skews it. A retry's job is due
    after a backoff that the host recording the failure chose at random and the claim does not
    return: retries are left out rather than counted with their backoff."""
    if attempt.attempt != 1 or attempt.claimed_at is None or run.updated_at is None:
        return None
    return max(0.0, (attempt.claimed_at - run.updated_at).total_seconds())


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A scrape at a time each in a thread of its own, so that a slow scraper holds up no other."""

    daemon_threads = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the address's name (socket.getfqdn), a DNS query that may
        # hang the daemon's start; WSGI needs no more than the address itself.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]
        self.setup_environ()

    def handle_error(self, request: object, client_address: object) -> None:
        # One event line, not socketserver's traceback on stderr (which the journal would split into
        # many lines): a failed scrape is the scraper's to see, and never the daemon's end.
        exc = sys.exc_info()[1]
        event("metrics-scrape-failed", level=logging.WARNING, detail=f"{type(exc).__name__}: {exc}")


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr for every scrape: the daemon's log is its events."""

    def log_message(self, format: str, *args: object) -> None:
        pass
