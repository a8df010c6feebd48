"""`python -m bench.claim_slots --tiny` works: it boots its own PostgreSQL, claims a backlog with each case's
hosts and claim slots, and writes every figure. The figures themselves are never asserted (benchmarks are
not tests; docs/benchmarks.md has the real runs); that every run was claimed exactly once, the bench
asserts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench import claim_slots
from tests.harness.host import REPO


def test_bench_claim_slots_tiny_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "claim_slots.json"
    result = subprocess.run([sys.executable, "-m", "bench.claim_slots", "--tiny", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert [(c["hosts"], c["claim_slots"]) for c in cases] == list(claim_slots.TINY.cases)
    for c in cases:
        assert c["runs"] == claim_slots.TINY.runs and c["claims"] >= c["runs"] / claim_slots.BATCH, c
        assert math.isfinite(c["server_cpu_ms_per_run"]) and c["server_cpu_ms_per_run"] > 0, c
        assert c["seconds_to_last_claim"] > 0, c
    assert "claim_slots" in result.stdout and "none" in result.stdout, result.stdout
