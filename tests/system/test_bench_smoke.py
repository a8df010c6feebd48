"""The benchmark command itself works: `python -m bench.run --tiny` boots its own test bed and
database, prints its table and writes a JSON with every figure. Only the command is tested here; the
figures are never asserted (benchmarks are not tests; docs/benchmarks.md has the real run)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import testbed as testbed_mod
from tests.harness.host import REPO

FIGURES = [
    ("limit", "bare", "starts_per_s"), ("limit", "bare", "call_ms", "p50"), ("limit", "bare", "call_ms", "p99"),
    ("limit", "product", "starts_per_s"), ("limit", "product", "start_to_active_ms", "p50"),
    ("throughput", "n"), ("throughput", "seconds"), ("throughput", "runs_per_s"), ("throughput", "ratio_to_limit"),
    ("throughput", "statements_per_run"),
    ("latency", "to_active_ms", "p50"), ("latency", "to_active_ms", "p99"),
    ("latency", "to_recorded_ms", "p50"), ("latency", "to_recorded_ms", "p99"),
    ("latency", "to_active_minus_raw_call_p50_ms"),
    ("reconcile", "runs"), ("reconcile", "units"), ("reconcile", "plan", "seconds"),
    ("reconcile", "plan", "statements"), ("reconcile", "plan", "dbus_calls"),
    ("idle", "statements"), ("idle", "xact_commits"), ("idle", "cpu_seconds"), ("idle", "vmhwm_mb"),
    ("machine", "nproc"), ("machine", "memory_mb"), ("machine", "kernel"), ("machine", "cgroup"),
    ("versions", "python"), ("versions", "psycopg"), ("versions", "pystemd"), ("versions", "systemd"),
    ("versions", "postgresql"), ("date",),
]


def _get(data: dict, path: tuple[str, ...]) -> object:
    for key in path:
        data = data[key]
    return data


def test_bench_tiny_writes_every_figure(tmp_path: Path) -> None:
    reason = testbed_mod.available()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"required in CI but unavailable: {reason}", pytrace=False)
        pytest.skip(reason)
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "bench.run", "--tiny", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(2) throughput" in result.stdout and "(5) idle" in result.stdout, result.stdout
    data = json.loads(out.read_text())
    for path in FIGURES:
        value = _get(data, path)
        assert value not in (None, ""), path
        if isinstance(value, float):
            assert not math.isnan(value), path
    assert [row["n"] for row in data["scaling"]["throughput"]] == data["sizes"]["scaling"]
    assert [row["runs"] for row in data["scaling"]["reconcile"]] == data["sizes"]["scaling"]
    assert set(data["throughput"]["outcomes"]) == {"success"}
    assert set(data["targets"]) >= {"throughput_ratio", "latency_to_active", "reconcile_time", "idle_memory"}
