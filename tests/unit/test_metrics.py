"""supervisor.metrics: the values after each event, the exposition text (parsed back, and linted by
promtool where it is installed), the server (a real socket on 127.0.0.1), [metrics] listen, and the
daemon's and reconciler's hooks, with the daemon going on when its port is taken."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import subprocess
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from supervisor import __version__, config, store
from supervisor import daemon as daemon_mod
from supervisor import metrics as metrics_mod
from supervisor import reconciler as reconciler_mod
from supervisor.config import ConfigError, HostSettings, MetricsSettings, RunSettings, Settings, parse_listen
from supervisor.daemon import Daemon
from supervisor.metrics import Metrics, State, claim_latency
from supervisor.model import Attempt, Pruned, Run
from supervisor.outcomes import OUTCOMES, Outcome
from supervisor.reconciler import Reconciler
from supervisor.systemd import Systemd, UnitState
from supervisor.unitspec import unit_name
from tests.harness import prometheus as prometheus_mod
from tests.harness.postgres import free_port

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def pair(n: int = 1, attempt: int = 1, queued: datetime | None = T0, claimed: datetime | None = T0):
    run_id = uuid.UUID(f"00000000-0000-4000-8000-{n:012d}")
    run = Run(id=run_id, argv=["/bin/true"], created_at=T0, updated_at=queued)
    return run, Attempt(run_id=run_id, attempt=attempt, host_id="h1", unit_name=unit_name(run_id, attempt),
                        claimed_at=claimed)


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, parsed back from the exposition text: (name, labels) -> value."""
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(m: Metrics, name: str, **labels: str) -> float:
    return samples(m)[(name, tuple(sorted(labels.items())))]


# -- values after events ----------------------------------------------------------------------------

def test_a_fresh_registry_has_every_outcome_at_zero_and_the_version():
    m = Metrics()
    for outcome in OUTCOMES:
        assert value(m, "unitvisor_outcomes_total", outcome=outcome) == 0
    assert value(m, "unitvisor_runs_started_total") == 0
    assert value(m, "unitvisor_build_info", version=__version__) == 1
    assert value(m, "unitvisor_host_state", state="unregistered") == 1
    assert value(m, "unitvisor_database_up") == 0 and value(m, "unitvisor_systemd_up") == 0


def test_outcomes_count_by_kind():
    m = Metrics()
    for outcome in ("success", "exit-code", "success", "lost"):
        m.settled(outcome)
    assert value(m, "unitvisor_outcomes_total", outcome="success") == 2
    assert value(m, "unitvisor_outcomes_total", outcome="exit-code") == 1
    assert value(m, "unitvisor_outcomes_total", outcome="lost") == 1
    assert value(m, "unitvisor_outcomes_total", outcome="signal") == 0


def test_claim_latency_is_from_queued_to_claimed_by_the_database_clock(mocker):
    clock = mocker.patch.object(metrics_mod.time, "monotonic", return_value=100.25)
    m = Metrics()
    m.claimed([pair(1, queued=T0, claimed=T0 + timedelta(seconds=3)),
               pair(2, queued=T0, claimed=T0 + timedelta(seconds=700))], sent=100.0)
    assert value(m, "unitvisor_claim_latency_seconds_count") == 2
    assert value(m, "unitvisor_claim_latency_seconds_sum") == 703
    assert value(m, "unitvisor_claim_latency_seconds_bucket", le="5.0") == 1
    assert value(m, "unitvisor_claim_latency_seconds_bucket", le="1800.0") == 2
    # The claim statement itself: from sending it to its answer.
    assert value(m, "unitvisor_claim_duration_seconds_count") == 1
    assert value(m, "unitvisor_claim_duration_seconds_sum") == 0.25
    clock.return_value = 101.0
    m.claimed([], sent=100.5)  # a claim that found nothing is a claim all the same
    assert value(m, "unitvisor_claim_duration_seconds_count") == 2


def test_claim_latency_leaves_out_what_the_claim_does_not_tell():
    assert claim_latency(*pair(attempt=2, claimed=T0 + timedelta(seconds=30))) is None  # a retry: backoff unknown
    assert claim_latency(*pair(queued=None)) is None
    assert claim_latency(*pair(claimed=None)) is None
    # A clock that went backwards between two transactions is not a negative latency.
    assert claim_latency(*pair(queued=T0, claimed=T0 - timedelta(seconds=1))) == 0.0
    m = Metrics()
    m.claimed([pair(attempt=3)], sent=0.0)
    assert value(m, "unitvisor_claim_latency_seconds_count") == 0


def test_spawn_latency_only_for_units_of_the_latest_claim(mocker):
    clock = mocker.patch.object(metrics_mod.time, "monotonic", return_value=50.0)
    m = Metrics()
    (_, a1), (_, a2) = pair(1), pair(2)
    m.claimed([pair(1), pair(2)], sent=49.9)
    clock.return_value = 50.02
    m.started(a1.unit_name)
    m.started(a1.unit_name)  # counted again (a second unit), but its claim was used up
    m.started("unitvisor-run-started-by-a-reconcile-pass-1.service")
    assert value(m, "unitvisor_runs_started_total") == 3
    assert value(m, "unitvisor_spawn_latency_seconds_count") == 1
    assert value(m, "unitvisor_spawn_latency_seconds_sum") == pytest.approx(0.02)
    m.claimed([], sent=60.0)  # the next claim forgets a2, which never started (refused)
    m.started(a2.unit_name)
    assert value(m, "unitvisor_spawn_latency_seconds_count") == 1


def test_state_is_read_at_scrape_time():
    state = State()
    m = Metrics(lambda: state)
    state = State(in_flight=7, database_up=True, systemd_up=True, host_state="draining")
    assert value(m, "unitvisor_runs_in_flight") == 7
    assert value(m, "unitvisor_database_up") == 1 and value(m, "unitvisor_systemd_up") == 1
    assert {k[1][0][1]: v for k, v in samples(m).items() if k[0] == "unitvisor_host_state"} == {
        "active": 0, "draining": 1, "unregistered": 0}


def test_named_limits_are_read_at_scrape_time_one_series_per_limit():
    state = State()
    m = Metrics(lambda: state)
    assert not [k for k in samples(m) if k[0] in ("unitvisor_limit_live", "unitvisor_limit_max")]
    state = State(limits={"batch": (20, 20), "gpu": (1, 4)})
    assert value(m, "unitvisor_limit_live", limit="batch") == 20
    assert value(m, "unitvisor_limit_max", limit="batch") == 20
    assert (value(m, "unitvisor_limit_live", limit="gpu"), value(m, "unitvisor_limit_max", limit="gpu")) == (1, 4)


def test_admission_and_the_slices_pressure_are_read_at_scrape_time():
    state = State()
    m = Metrics(lambda: state)
    assert {k[1][0][1]: v for k, v in samples(m).items() if k[0] == "unitvisor_admission"} == {
        "off": 0, "open": 1, "slowed": 0, "stopped": 0}
    assert not [k for k in samples(m) if k[0] == "unitvisor_slice_pressure_ratio"]
    state = State(admission="stopped", pressure={"memory": 55.0, "io": 2.5})
    assert {k[1][0][1]: v for k, v in samples(m).items() if k[0] == "unitvisor_admission"} == {
        "off": 0, "open": 0, "slowed": 0, "stopped": 1}
    assert value(m, "unitvisor_slice_pressure_ratio", resource="memory") == 0.55
    assert value(m, "unitvisor_slice_pressure_ratio", resource="io") == 0.025


def test_declared_dead_and_reconcile_duration():
    m = Metrics()
    m.declared_dead(2)
    m.reconciled(0.3)
    assert value(m, "unitvisor_hosts_declared_dead_total") == 2
    assert value(m, "unitvisor_reconcile_duration_seconds_count") == 1
    assert value(m, "unitvisor_reconcile_duration_seconds_bucket", le="0.5") == 1


def test_runs_expired_counts_from_zero():
    m = Metrics()
    assert value(m, "unitvisor_runs_expired_total") == 0  # there from the start: increase() sees the first
    m.expired(0)
    m.expired(3)
    assert value(m, "unitvisor_runs_expired_total") == 3


def test_runs_skipped_counts_from_zero():
    m = Metrics()
    assert value(m, "unitvisor_runs_skipped_total") == 0  # there from the start, as the expiries
    m.skipped(0)
    m.skipped(4)
    assert value(m, "unitvisor_runs_skipped_total") == 4


def test_pruned_rows_are_counted_by_table_from_zero():
    m = Metrics()
    assert value(m, "unitvisor_pruned_rows_total", table="events") == 0
    m.pruned(Pruned(runs=2, attempts=3, events=9, jobs=4))
    m.pruned(Pruned(0, 0, 0, 0, busy=True))
    m.pruned(Pruned(runs=1, attempts=1, events=3, jobs=1))
    assert {t: value(m, "unitvisor_pruned_rows_total", table=t) for t in ("runs", "attempts", "events", "jobs")} == {
        "runs": 3, "attempts": 4, "events": 12, "jobs": 5}


def test_freeze_answers_are_counted_by_result_from_zero():
    m = Metrics()
    assert value(m, "unitvisor_freezes_total", result="refused") == 0
    m.freezes.labels("refused").inc()
    assert {r: value(m, "unitvisor_freezes_total", result=r) for r in ("frozen", "thawed", "refused")} == {
        "frozen": 0, "thawed": 0, "refused": 1}


def test_names_and_labels_follow_the_conventions():
    m = Metrics()
    m.claimed([pair(1)], sent=0.0)
    m.started(pair(1)[1].unit_name)
    for outcome in OUTCOMES:
        m.settled(outcome)
    text = generate_latest(m.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # The parser names a counter's family without _total, and the client adds a _created gauge to
    # counters and histograms (the time each began, so that a restart is told from a reset).
    ours = {name for name in families if name.startswith("unitvisor_") and not name.endswith("_created")}
    assert ours == {
        "unitvisor_admission", "unitvisor_slice_pressure_ratio",
        "unitvisor_runs_started", "unitvisor_outcomes", "unitvisor_hosts_declared_dead",
        "unitvisor_claim_latency_seconds", "unitvisor_spawn_latency_seconds", "unitvisor_claim_duration_seconds",
        "unitvisor_reconcile_duration_seconds", "unitvisor_build_info", "unitvisor_runs_in_flight",
        "unitvisor_database_up", "unitvisor_systemd_up", "unitvisor_host_state", "unitvisor_pruned_rows",
        "unitvisor_runs_expired", "unitvisor_dead_declarations_held", "unitvisor_fleet_upkeep_failures",
        "unitvisor_heartbeats_aside", "unitvisor_schedule_runs_submitted", "unitvisor_schedule_times_missed",
        "unitvisor_schedule_times_skipped",
        "unitvisor_stop_warnings", "unitvisor_stop_kills",  # graceful stop (schema 026)
        "unitvisor_runs_ended_by_rule",  # failure rules (schema 027)
        "unitvisor_freezes",  # hold and freeze (schema 030)
        "unitvisor_limit_live", "unitvisor_limit_max",  # concurrency limits (schema 032)
        "unitvisor_runs_skipped",  # dependencies (schema 035)
    }
    assert {f.type for name, f in families.items() if name in ("unitvisor_runs_started", "unitvisor_outcomes")} == {
        "counter"}
    # Only bounded labels: no run id, no unit name anywhere in a scrape.
    assert str(pair(1)[0].id) not in text and "unitvisor-run-" not in text
    label_names = {key for f in families.values() for s in f.samples for key in s.labels}
    # `limit`: the operator's own limit names (schema 032), as many as it set.
    assert label_names <= {"outcome", "state", "version", "le", "table", "reason", "rule", "result", "limit"}


def test_runs_ended_by_a_failure_rule_are_counted_by_rule():
    """Schema 27: the alert on a run that kills its hosts reads the max_lost_attempts series."""
    m = Metrics()
    assert value(m, "unitvisor_runs_ended_by_rule_total", rule="max_lost_attempts") == 0  # there from the start
    m.settled("lost", "max_lost_attempts")
    m.settled("exit-code", "fail_on")
    m.settled("exit-code")
    assert value(m, "unitvisor_runs_ended_by_rule_total", rule="max_lost_attempts") == 1
    assert value(m, "unitvisor_runs_ended_by_rule_total", rule="fail_on") == 1
    assert value(m, "unitvisor_outcomes_total", outcome="exit-code") == 2


def test_exposition_passes_promtool():
    prometheus_mod.require()
    m = Metrics(lambda: State(2, True, True, "active"))
    m.claimed([pair(1)], sent=0.0)
    m.settled("success")
    result = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(m.registry), capture_output=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), result


# -- the server ---------------------------------------------------------------------------------------

@pytest.fixture
def events(mocker):
    return mocker.patch.object(metrics_mod, "event")


def test_serves_metrics_over_http_and_close_frees_the_port(events):
    m = Metrics()
    m.settled("signal")
    listen = f"127.0.0.1:{free_port()}"
    assert m.serve(listen)
    try:
        with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as response:
            body = response.read().decode()
        assert 'unitvisor_outcomes_total{outcome="signal"} 1.0' in body
        assert events.call_args.args[0] == "metrics-listening"
    finally:
        m.close()
    again = Metrics()  # as a restarted daemon would
    assert again.serve(listen)
    again.close()


def test_serves_on_ipv6_loopback(events):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    m = Metrics()
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        port = probe.getsockname()[1]
    assert m.serve(f"[::1]:{port}")
    try:
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as response:
            assert b"unitvisor_build_info" in response.read()
    finally:
        m.close()


def test_a_port_in_use_logs_one_line_and_serves_nothing(events):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        m = Metrics()
        assert m.serve(listen) is False
    [call] = events.call_args_list
    assert call.args[0] == "metrics-unavailable"
    assert call.kwargs["level"] == logging.WARNING
    assert call.kwargs["listen"] == listen
    assert "in use" in call.kwargs["detail"] and "without metrics" in call.kwargs["detail"]
    assert m.address is None
    m.close()  # nothing to close: no error


def test_a_malformed_address_made_in_code_logs_and_serves_nothing(events):
    m = Metrics()
    assert m.serve("localhost:9863") is False  # the config refuses it at start; Settings made in code do not
    [call] = events.call_args_list
    assert call.args[0] == "metrics-unavailable" and "not an IP address" in call.kwargs["detail"]


def test_a_failed_scrape_is_one_event_not_a_traceback(events, capsys):
    m = Metrics()
    listen = f"127.0.0.1:{free_port()}"
    assert m.serve(listen)
    try:
        try:
            raise BrokenPipeError("the scraper went away")
        except BrokenPipeError:
            m._server.handle_error(None, ("127.0.0.1", 1))
    finally:
        m.close()
    assert events.call_args_list[-1].args[0] == "metrics-scrape-failed"
    assert events.call_args_list[-1].kwargs["detail"] == "BrokenPipeError: the scraper went away"
    assert capsys.readouterr().err == ""


def test_empty_listen_serves_nothing(events):
    m = Metrics()
    assert m.serve("") is False
    assert events.call_args.args[0] == "metrics-off"
    assert m.address is None


# -- [metrics] listen ---------------------------------------------------------------------------------

def test_listen_default_is_loopback():
    assert Settings().metrics.listen == "127.0.0.1:9863"
    assert parse_listen(Settings().metrics.listen) == ("127.0.0.1", 9863)


@pytest.mark.parametrize("text, expected", [
    ("0.0.0.0:9863", ("0.0.0.0", 9863)),
    ("[::1]:80", ("::1", 80)),
    ("[::]:65535", ("::", 65535)),
    ("10.1.2.3:1", ("10.1.2.3", 1)),
    ("", None),
])
def test_listen_accepts(text, expected):
    assert parse_listen(text) == expected
    assert config.parse(f'[metrics]\nlisten = "{text}"\n').metrics == MetricsSettings(listen=text)


@pytest.mark.parametrize("text, says", [
    ("9863", "is not ADDRESS:PORT"),
    (":9863", "is not an IP address"),
    ("127.0.0.1", "is not ADDRESS:PORT"),
    ("127.0.0.1:", "is not ADDRESS:PORT"),
    ("localhost:9863", "a host name is not accepted"),
    ("::1:9863", "is not ADDRESS:PORT"),
    ("[127.0.0.1]:9863", "an IPv6 address goes in brackets"),
    ("127.0.0.1:0", "port 0 is out of range (1 to 65535)"),
    ("127.0.0.1:65536", "port 65536 is out of range"),
    ("127.0.0.1:99999", "out of range"),
    ("127.0.0.1:98a", "is not ADDRESS:PORT"),
    ("127.0.0.1:9863\n", "is not ADDRESS:PORT"),
    ("300.1.2.3:9863", "is not an IP address"),
])
def test_listen_refuses_naming_the_key(text, says):
    with pytest.raises(ConfigError) as info:
        config.parse(f"[metrics]\nlisten = {json.dumps(text)}\n", "u.toml")  # a JSON string is a TOML one
    message = str(info.value)
    assert message.startswith("u.toml: [metrics] listen: "), message
    assert says in message


def test_listen_must_be_a_string():
    with pytest.raises(ConfigError, match=r"\[metrics\] listen: expected a string"):
        config.parse("[metrics]\nlisten = 9863\n")


def test_unknown_metrics_key():
    with pytest.raises(ConfigError, match=r"\[metrics\] port: unknown key \(known: listen\)"):
        config.parse("[metrics]\nport = 9863\n")


# -- the daemon's and the reconciler's hooks -----------------------------------------------------------

def daemon_settings(listen: str) -> Settings:
    return dataclasses.replace(Settings(), host=HostSettings(id="h1", name="host-1"),
                               runs=RunSettings(allowed_executables=("/bin/*",)), metrics=MetricsSettings(listen))


@pytest.fixture
def bare_daemon(mocker, monkeypatch):
    """A Daemon whose boundaries are mocks, as in test_daemon_loop.py; the metrics server is real."""
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    for name in ("Systemd", "Watcher", "sdnotify", "Reconciler", "signal"):
        mocker.patch.object(daemon_mod, name)
    mocker.patch.object(daemon_mod.os, "pipe2", return_value=(-1, -1))

    def build(listen: str) -> Daemon:
        d = Daemon(daemon_settings(listen), lambda: "host=db.example")
        d.guard = mock.MagicMock(cut_off=False, cut_off_units=set())
        return d
    return build


def test_the_daemon_goes_on_when_its_metrics_port_is_taken(bare_daemon, events, mocker):
    mocker.patch.object(daemon_mod, "event")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        d = bare_daemon(f"127.0.0.1:{taken.getsockname()[1]}")
        d._connect = mock.Mock(return_value=False)
        calls = []
        d._sleep = mock.Mock(side_effect=lambda s: (calls.append(s), setattr(d, "stopping", len(calls) >= 3)))
        assert d.run() == 0
    assert d._connect.call_count == 3  # it kept trying its database: the loop went on
    assert [c.args[0] for c in events.call_args_list] == ["metrics-unavailable"]


def test_the_daemon_serves_its_state_while_it_runs_and_closes_the_port_at_stop(bare_daemon, events, mocker):
    mocker.patch.object(daemon_mod, "event")
    listen = f"127.0.0.1:{free_port()}"
    d = bare_daemon(listen)
    d._connect = mock.Mock(return_value=False)
    scraped = []

    def sleep(seconds: float) -> None:
        with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as response:
            scraped.append(response.read().decode())
        d.stopping = True
    d._sleep = mock.Mock(side_effect=sleep)
    assert d.run() == 0
    assert "unitvisor_database_up 0.0" in scraped[0]
    assert 'unitvisor_host_state{state="unregistered"} 1.0' in scraped[0]
    assert d.metrics.address is None  # closed at stop
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{listen}/metrics", timeout=10)


def test_daemon_state_for_a_scrape(bare_daemon):
    d = bare_daemon("")
    d.systemd.connected, d.watcher.connected = False, False
    assert d._metrics_state() == State(0, False, False, "unregistered")
    d.conn, d.fence = mock.Mock(), store.Fence("h1", 3)
    d.host_state = "draining"
    d.systemd.connected, d.watcher.connected = True, True
    d.reconciler = mock.Mock(in_flight=5)
    assert d._metrics_state() == State(5, True, True, "draining")
    d.watcher.connected = False
    assert d._metrics_state().systemd_up is False
    d.conn = None  # the database is lost: the daemon cannot vouch for its registration
    assert d._metrics_state() == State(5, False, False, "unregistered")


def test_claim_and_spawn_tells_the_metrics(bare_daemon, mocker):
    mocker.patch.object(daemon_mod, "event")
    d = bare_daemon("")
    d.is_root, d.conn, d.fence = True, mock.Mock(), store.Fence("h1", 3)
    d.reconciler = mock.Mock(in_flight=0)
    claimed = [pair(1), pair(2)]
    mocker.patch.object(daemon_mod.store, "claim", return_value=claimed)
    d.metrics = mock.Mock()
    d._claim_and_spawn()
    d.metrics.claimed.assert_called_once()
    assert d.metrics.claimed.call_args.args[0] == claimed


def test_reconcile_is_timed(bare_daemon):
    d = bare_daemon("")
    d.reconciler = mock.Mock()
    d.metrics = mock.Mock()
    d._reconcile()
    d.reconciler.reconcile_pass.assert_called_once()
    d.metrics.reconciled.assert_called_once()


@pytest.fixture
def rec(mocker):
    for name, value in {"record_outcome": True, "mark_started": None, "declare_dead": store.Declaration([]),
                        "open_attempts": []}.items():
        mocker.patch.object(store, name, return_value=value)
    mocker.patch("supervisor.reconciler.event")
    systemd = mocker.Mock(spec=Systemd)
    systemd.start_transient.return_value = True
    conn = mock.MagicMock()
    r = Reconciler(Settings(runs=RunSettings(allowed_executables=("/bin/*",))), store.Fence("h1", 3), conn, systemd,
                   journal=mock.Mock())
    r.metrics = Metrics()
    return r


def test_reconciler_counts_a_unit_it_created_and_not_one_it_adopted(rec):
    run, attempt = pair(1)
    rec.start(run, attempt)
    assert value(rec.metrics, "unitvisor_runs_started_total") == 1
    rec.systemd.start_transient.return_value = False  # the name existed: adopted
    rec.systemd.state.return_value = UnitState(pair(2)[1].unit_name, "active", "running", "success", 0, 0,
                                               "0123456789abcdef0123456789abcdef", False)
    rec.start(*pair(2))
    assert value(rec.metrics, "unitvisor_runs_started_total") == 1


def test_reconciler_counts_an_outcome_once_it_is_recorded(rec):
    run, attempt = pair(1)
    rec.settle(run, attempt, Outcome("exit-code", "exit:3", "exited 3"))
    assert value(rec.metrics, "unitvisor_outcomes_total", outcome="exit-code") == 1
    store.record_outcome.return_value = False  # already recorded (by an earlier pass): not counted again
    rec.settle(run, attempt, Outcome("exit-code", "exit:3", "exited 3"))
    assert value(rec.metrics, "unitvisor_outcomes_total", outcome="exit-code") == 1


def test_reconciler_counts_a_dead_hosts_runs_as_lost_after_the_takeover_commits(rec):
    dead = store.DeadHost("web-2", 75.0, 60.0)
    store.declare_dead.return_value = store.Declaration([dead])
    store.open_attempts.return_value = [pair(1), pair(2)]
    rec.take_over_dead_hosts(100.0)
    assert value(rec.metrics, "unitvisor_hosts_declared_dead_total") == 1
    assert value(rec.metrics, "unitvisor_outcomes_total", outcome="lost") == 2


def test_reconciler_counts_the_runs_its_expire_call_ended(rec, mocker):
    mocker.patch.object(store, "expire_runs", return_value=2)
    assert rec.expire_overdue() == 2
    assert value(rec.metrics, "unitvisor_runs_expired_total") == 2
    store.expire_runs.side_effect = store.Fenced("epoch over")  # refused: nothing expired, nothing counted
    with pytest.raises(store.Fenced):
        rec.expire_overdue()
    assert value(rec.metrics, "unitvisor_runs_expired_total") == 2


def test_reconciler_counts_the_skips_it_took_from_the_database(rec, mocker):
    events = reconciler_mod.event  # the rec fixture's mock
    mocker.patch.object(store, "pass_figures", return_value=store.PassFigures(3, {}))
    assert rec.pass_figures() == {}
    assert value(rec.metrics, "unitvisor_runs_skipped_total") == 3
    events.assert_called_with("runs-skipped", host=rec.host_id, runs=3)
    store.pass_figures.side_effect = store.Fenced("epoch over")  # refused: nothing taken, nothing counted
    with pytest.raises(store.Fenced):
        rec.pass_figures()
    assert value(rec.metrics, "unitvisor_runs_skipped_total") == 3


def test_reconciler_counts_what_its_schedules_call_did(rec, mocker):
    events = reconciler_mod.event  # the rec fixture's mock
    due = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)
    mocker.patch.object(store, "submit_due_schedules", return_value=[
        store.ScheduleTurn("a", due, uuid.uuid4(), "submitted", 0),
        store.ScheduleTurn("b", due, uuid.uuid4(), "submitted late, for 3 missed due time(s) (catch_up one)", 3),
        store.ScheduleTurn("c", due, None, "missed (2 due time(s), the latest 00:05:00 old; catch_up none)", 2),
        store.ScheduleTurn("d", due, None, "skipped: run x is still live (overlap skip)", 0),
        store.ScheduleTurn("e", due, None, "refused: memory_max: 5 is out of range", 0)])
    assert value(rec.metrics, "unitvisor_schedule_times_skipped_total", reason="overlap") == 0  # from the start
    assert len(rec.submit_due_schedules()) == 5
    assert value(rec.metrics, "unitvisor_schedule_runs_submitted_total") == 2
    assert value(rec.metrics, "unitvisor_schedule_times_missed_total") == 5
    assert value(rec.metrics, "unitvisor_schedule_times_skipped_total", reason="overlap") == 1
    assert value(rec.metrics, "unitvisor_schedule_times_skipped_total", reason="refused") == 1
    said = [c for c in events.call_args_list if c.args[0] == "schedule-due"]
    assert [c.kwargs["schedule"] for c in said] == ["a", "b", "c", "d", "e"]
    assert [c.kwargs["level"] for c in said] == [logging.INFO, logging.INFO, logging.WARNING, logging.INFO,
                                                 logging.WARNING]


def test_reconciler_counts_nothing_of_a_takeover_that_failed(rec):
    store.declare_dead.return_value = store.Declaration([store.DeadHost("web-2", 75.0, 60.0)])
    store.open_attempts.return_value = [pair(1), pair(2)]
    store.record_outcome.side_effect = [True, store.Fenced("epoch over")]
    with pytest.raises(store.Fenced):
        rec.take_over_dead_hosts(100.0)
    assert value(rec.metrics, "unitvisor_hosts_declared_dead_total") == 0
    assert value(rec.metrics, "unitvisor_outcomes_total", outcome="lost") == 0
