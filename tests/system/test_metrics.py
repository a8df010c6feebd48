"""The daemon's metrics, scraped by a real Prometheus (Debian's binary, started by the test on this
machine with its own config and storage: tests/harness/prometheus.py) from the daemon running under
the real unitvisor.service in the test bed, which shares the machine's network. Asserted through
Prometheus's HTTP API, as a dashboard or an alert would see them; the scraped text passes `promtool
check metrics`, and docs/alerts.yml is loaded into the same Prometheus and judges a daemon that stops."""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from supervisor import __version__
from supervisor.outcomes import OUTCOMES
from tests.harness import prometheus as prometheus_mod
from tests.harness.host import DEFAULT_CONFIG, Host, daemon_active, wait_for
from tests.harness.postgres import free_port
from tests.harness.prometheus import Prometheus

ALERTS = Path(__file__).resolve().parents[2] / "docs" / "alerts.yml"


@pytest.fixture(autouse=True)
def tools() -> None:
    prometheus_mod.require()


def with_metrics(host: Host, port: int) -> None:
    host.configure(config=DEFAULT_CONFIG.format(host_id=host.host_id, runs_extra="")
                   + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')


def alerts(prom: Prometheus) -> dict[str, str]:
    """Active alerts of docs/alerts.yml: name -> state (pending, firing)."""
    return {a["labels"]["alertname"]: a["state"] for a in prom.api("alerts")["alerts"]}


def test_prometheus_scrapes_runs_outcomes_and_state(host: Host) -> None:
    port = free_port()
    with_metrics(host, port)
    target = f"127.0.0.1:{port}"
    with Prometheus([target], rule_files=[ALERTS]) as prom:
        host.start()
        wait_for(lambda: prom.value('up{job="unitvisor"}') == 1, timeout=60,
                 what=f"Prometheus to scrape the daemon at {target}")

        ok = host.submit("--", "/bin/true")
        bad = host.submit("--", "/bin/sh", "-c", "exit 3")
        assert host.wait_run(ok)["state"] == "succeeded"
        assert host.wait_run(bad)["state"] == "failed"

        def outcomes() -> dict[str, float]:
            return {dict(labels)["outcome"]: value for labels, value in prom.query("unitvisor_outcomes_total").items()}
        wait_for(lambda: outcomes().get("success") == 1 and outcomes().get("exit-code") == 1, timeout=60,
                 what="Prometheus to see both outcomes")
        # Every kind is there from the start, at 0: increase() sees the first of any.
        assert outcomes() == {kind: 0 for kind in OUTCOMES} | {"success": 1, "exit-code": 1}
        [labels] = prom.query('unitvisor_outcomes_total{outcome="success"}')
        assert dict(labels) == {"job": "unitvisor", "instance": target, "outcome": "success"}

        assert prom.value("unitvisor_runs_started_total") == 2
        assert prom.value("unitvisor_claim_latency_seconds_count") == 2  # both first attempts
        assert prom.value("unitvisor_spawn_latency_seconds_count") == 2
        assert prom.value("unitvisor_claim_duration_seconds_count") >= 1
        assert prom.value("unitvisor_reconcile_duration_seconds_count") >= 1  # the pass at connect
        wait_for(lambda: prom.value("unitvisor_runs_in_flight") == 0, timeout=30, what="no run in flight")
        assert prom.value("unitvisor_database_up") == 1
        assert prom.value("unitvisor_systemd_up") == 1
        states = {dict(labels)["state"]: value for labels, value in prom.query("unitvisor_host_state").items()}
        assert states == {"active": 1, "draining": 0, "unregistered": 0}
        assert prom.value(f'unitvisor_build_info{{version="{__version__}"}}') == 1
        # Expired runs are counted by the daemon whose fleet upkeep expired them, the one place that does.
        # A run no host may run (pinned to an unknown host):
        assert prom.value("unitvisor_runs_expired_total") == 0
        nowhere = host.submit("--host", "nowhere-9", "--start-deadline", "+4s", "--", "/bin/true")
        assert host.wait_run(nowhere)["state"] == "expired"
        wait_for(lambda: prom.value("unitvisor_runs_expired_total") == 1, timeout=30,
                 what="Prometheus to see the expired run")
        # A run this host could take, held back by its concurrency key until its deadline passes. Until
        # 0.5.0 the claim would expire it on its way, uncounted: the heartbeat offered its job as work
        # (sql/012_expiry_owner.sql).
        holder = host.submit("--concurrency-key", "metrics-k", "--", "/bin/sleep", "60")
        # Its deadline is closer than the 4 s after which a due job alone asks for the upkeep
        # (explain_after: 2 poll intervals here), so only 012's heartbeat flag gets it counted.
        behind = host.submit("--concurrency-key", "metrics-k", "--start-deadline", "+1s", "--", "/bin/true")
        assert host.wait_run(behind)["state"] == "expired"
        wait_for(lambda: prom.value("unitvisor_runs_expired_total") == 2, timeout=30,
                 what="Prometheus to see the second expired run")
        host.cli("cancel", holder)
        # A draining host says so at its next heartbeat (poll_interval 2s here).
        host.cli("drain", host.host_id)
        wait_for(lambda: prom.value('unitvisor_host_state{state="draining"}') == 1, timeout=30,
                 what="the host state to be draining")

        # The scraped text itself is clean by Prometheus's own linter.
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
            text = response.read()
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
        assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint

        # The example alerts load and evaluate here; none is active on a healthy host. A stopped
        # daemon is a host down: its alert goes pending at once (it fires after its `for:`).
        wait_for(lambda: all(rule["health"] == "ok" for group in prom.api("rules")["groups"]
                             for rule in group["rules"]), timeout=30, what="every alert rule to be evaluated")
        assert "UnitvisorHostDown" not in alerts(prom) and "UnitvisorAbsent" not in alerts(prom)
        host.stop()
        wait_for(lambda: prom.value('up{job="unitvisor"}') == 0, timeout=30, what="the scrape to fail")
        wait_for(lambda: alerts(prom).get("UnitvisorHostDown") in ("pending", "firing"), timeout=30,
                 what="UnitvisorHostDown to be pending")


def test_the_daemon_runs_on_when_its_metrics_port_is_taken(host: Host) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # the test bed shares this network: the daemon finds it in use
        taken.listen()
        port = taken.getsockname()[1]
        with_metrics(host, port)
        host.start()
        run_id = host.submit("--", "/bin/true")
        assert host.wait_run(run_id)["state"] == "succeeded"
        assert daemon_active(host) == "active"
        # This start's own lines: the journal also holds earlier tests' daemons.
        invocation = host.tb.run("systemctl", "show", "--property=InvocationID", "--value",
                                 "unitvisor.service").stdout.strip()
        log = host.tb.run("journalctl", f"_SYSTEMD_INVOCATION_ID={invocation}", "--no-pager", "-o", "cat").stdout
        lines = [line for line in log.splitlines() if "metrics-" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("metrics-unavailable ") and f"listen=127.0.0.1:{port}" in lines[0], lines
    assert "without metrics" in lines[0]
