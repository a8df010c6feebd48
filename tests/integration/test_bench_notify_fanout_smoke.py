"""`python -m bench.notify_fanout --tiny` works: it boots its own PostgreSQL, opens the other listening
sessions, and writes every figure for each layout and number of sessions. The figures themselves are never
asserted (benchmarks are not tests; docs/benchmarks.md has the real runs); that every notification reached
its target, the bench asserts (it waits for each)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench import notify_fanout
from tests.harness.host import REPO


def test_bench_notify_fanout_tiny_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "notify_fanout.json"
    result = subprocess.run([sys.executable, "-m", "bench.notify_fanout", "--tiny", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert sorted(figures, key=int) == [str(n) for n in notify_fanout.TINY.others]
    for by_layout in figures.values():
        assert sorted(by_layout) == sorted(notify_fanout.LAYOUTS)
        for f in by_layout.values():
            for key in ("latency_ms_p50", "latency_ms_p99", "server_cpu_us_per_notify"):
                assert len(f[key]) == notify_fanout.TINY.rounds
                assert all(math.isfinite(v) and v >= 0 for v in f[key]), (key, f)
            assert all(v > 0 for v in f["latency_ms_p50"])
    assert "commit -> target" in result.stdout, result.stdout
