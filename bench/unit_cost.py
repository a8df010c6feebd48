"""What makes a run's unit dearer for systemd to start than a bare one, with the sandbox off: starts
per second (all ran) of bare units and of the daemon's units for several [runs] configs, in turn, in a
throwaway test bed (bench/inside.py unit-cost). Prints one JSON object; docs/benchmarks.md has the
figures ("Sandbox off: what a unit costs systemd").

    .venv/bin/python -m bench.unit_cost              # 300 starts of each, 2 rounds
    .venv/bin/python -m bench.unit_cost --n 40 --rounds 1
    .venv/bin/python -m bench.unit_cost --only "packaged,tasks-peak"   # two kinds only
    .venv/bin/python -m bench.unit_cost --each-property   # the packaged units less each sandbox property
"""

from __future__ import annotations

import argparse
import json

from tests.harness import testbed as testbed_mod
from tests.harness.host import REPO, VENV_BIN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="starts of each kind of unit per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each kind in turn")
    parser.add_argument("--only", help="comma-separated words: only the kinds whose label holds one")
    parser.add_argument("--each-property", action="store_true",
                        help="the packaged units less each sandbox property in turn, and less all of them")
    args = parser.parse_args()
    reason = testbed_mod.available()
    if reason:
        raise SystemExit(f"cannot run the benchmark here: {reason}")
    testbed_mod.cleanup_stale()
    with testbed_mod.Testbed("uv-bench-cost", binds=[REPO]) as tb:
        out = tb.run(str(VENV_BIN / "python"), str(REPO / "bench" / "inside.py"), "unit-cost", "--n", str(args.n),
                     "--rounds", str(args.rounds), *(["--only", args.only] if args.only else []),
                     *(["--each-property"] if args.each_property else []), timeout=3600)
    print(json.dumps(json.loads(out.stdout), indent=2))


if __name__ == "__main__":
    main()
