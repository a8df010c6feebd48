"""docs/alerts.yml, the example alert set, checked by Prometheus's own promtool: the rules parse and
lint clean (`check rules`), and each alert fires on the series it is written for, after its `for:`,
and not on a healthy fleet (`test rules` with tests/unit/alerts_test.yml). No server, no root: a static
check like lint, so it runs with the unit tests."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.harness import prometheus as prometheus_mod

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parents[1] / "docs" / "alerts.yml"
RULE_TESTS = HERE / "alerts_test.yml"


@pytest.fixture
def promtool() -> str:
    prometheus_mod.require()
    return "promtool"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_alert_rules_check_clean(promtool):
    result = run(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout
    assert "WARNING" not in (result.stdout + result.stderr).upper()


def test_alert_rules_fire_as_written(promtool):
    result = run(promtool, "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_for_a_severity_annotations_and_a_test_case():
    # By the text's shape, not a YAML parser: .venv has none, and promtool has parsed it above.
    blocks = re.split(r"(?m)^      - alert: ", ALERTS.read_text())[1:]
    assert len(blocks) == 13
    tested = set(re.findall(r"(?m)^\s+alertname: (\w+)$", RULE_TESTS.read_text()))
    for block in blocks:
        name = block.split("\n", 1)[0].strip()
        for key in ("expr:", "for:", "labels:", "severity:", "summary:", "description:"):
            assert f" {key}" in block, f"{name} has no {key}"
        assert name in tested, f"{name} has no case in {RULE_TESTS.name}"
