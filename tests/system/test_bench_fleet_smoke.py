"""The fleet benchmark command itself works: `python -m bench.fleet --tiny` boots its own database and
three-host fleets, runs one power-off drill and one burst, prints its table and writes a JSON with
every figure. Only the command is tested here; the figures are never asserted (benchmarks are not
tests; docs/benchmarks.md has the real run)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.conftest import _unavailable
from tests.harness import testbed as testbed_mod
from tests.harness.host import REPO

FIGURES = [
    ("power_off", "last_running_s", "p50"), ("power_off", "last_running_s", "max"),
    ("power_off", "ratio_to_dead_after", "p50"), ("power_off", "declared_dead_s", "p50"),
    ("power_off", "dead_to_last_running_s", "max"), ("power_off", "silence_at_declaration_s", "min"),
    ("spread", "per_host_min"), ("spread", "per_host_max"), ("spread", "fair_share"),
    ("spread", "all_running_s", "p50"),
    ("sizes", "dead_after"), ("sizes", "poll"), ("machine", "nproc"), ("versions", "systemd"),
    ("versions", "postgresql"), ("date",),
]


def _get(data: dict, path: tuple[str, ...]) -> object:
    for key in path:
        data = data[key]
    return data


def test_bench_fleet_tiny_writes_every_figure(tmp_path: Path) -> None:
    reason = testbed_mod.available()
    if reason:
        _unavailable(reason)
    out = tmp_path / "fleet.json"
    result = subprocess.run([sys.executable, "-m", "bench.fleet", "--tiny", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(F1) power-off" in result.stdout and "(F2) spread" in result.stdout, result.stdout
    data = json.loads(out.read_text())
    for path in FIGURES:
        value = _get(data, path)
        assert value not in (None, ""), path
        if isinstance(value, float):
            assert not math.isnan(value), path
    [drill] = data["power_off"]["drills"]
    assert len(drill["respawns"]) == data["sizes"]["runs"]
    assert drill["first_attempt_outcomes"] == {"lost": data["sizes"]["runs"]}
    assert all(r["host"] in ("fleet-2", "fleet-3") for r in drill["respawns"])
    [burst] = data["spread"]["drills"]
    assert sum(burst["per_host"].values()) == burst["attempts"] == data["sizes"]["spread_runs"]
    assert set(data["targets"]) == {"declared_dead", "spread"}
