"""`python -m bench.heartbeat_cost --tiny` works: it boots its own PostgreSQL, builds the schema before 045 and
the current one side by side, and writes every figure for each. The figures themselves are never asserted
(benchmarks are not tests; docs/benchmarks.md has the real runs); that each round counted exactly its own
heartbeats, and one require_host each, the bench asserts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench import heartbeat_cost
from tests.harness.host import REPO


def test_bench_heartbeat_cost_tiny_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "heartbeat_cost.json"
    result = subprocess.run([sys.executable, "-m", "bench.heartbeat_cost", "--tiny", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert sorted(figures) == sorted([f"to {heartbeat_cost.BASELINE:03d}", "current"])
    for by_phase in figures.values():
        assert sorted(by_phase) == sorted(heartbeat_cost.PHASES)
        for by_name in by_phase.values():
            for name in heartbeat_cost.FUNCTIONS:
                assert by_name[name]["n"] == heartbeat_cost.TINY.rounds
                assert math.isfinite(by_name[name]["p50"]) and by_name[name]["p50"] > 0, (name, by_name)
    assert "require_host" in result.stdout and "refused" in result.stdout, result.stdout
