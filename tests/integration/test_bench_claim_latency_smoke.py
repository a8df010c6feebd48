"""`python -m bench.claim_latency --tiny` works: it boots its own PostgreSQL, builds each schema it compares
side by side, and writes every figure for each. The figures themselves are never asserted (benchmarks are
not tests; docs/benchmarks.md has the real runs); each claim it timed took a run (the bench asserts it,
so that it never times a claim that found nothing)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench import claim_latency
from tests.harness.host import REPO


def test_bench_claim_latency_tiny_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "claim_latency.json"
    result = subprocess.run([sys.executable, "-m", "bench.claim_latency", "--tiny", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    shapes = [(s["hosts"], s["open_per_host"]) for s in data["shapes"]]
    assert shapes == [tuple(shape) for shape in claim_latency.TINY.shapes]
    schemas = [f"to {upto:03d}" for upto in claim_latency.BASELINES] + ["current"]
    for shape in data["shapes"]:
        assert sorted(shape["figures"]) == sorted(schemas)
        for figures in shape["figures"].values():
            for name in ("claim_1", "claim_burst", "submit_commit"):
                assert figures[name]["n"] == claim_latency.TINY.rounds
                assert math.isfinite(figures[name]["p50"]) and figures[name]["p50"] > 0, (name, figures)
    assert "current" in result.stdout and "claim of 1" in result.stdout, result.stdout
