"""The cost of keeping a run's output tail with its outcome: one journalctl per outcome, timed in a
throwaway test bed (bench/inside.py tails). Prints one JSON object; docs/benchmarks.md has the figures.

    .venv/bin/python -m bench.tails            # 200 runs of 1000 lines each, 200 reads
    .venv/bin/python -m bench.tails --tiny     # 20 runs of 100 lines, 20 reads (the smoke test)
"""

from __future__ import annotations

import argparse
import json

from tests.harness import testbed as testbed_mod
from tests.harness.host import REPO, VENV_BIN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, in seconds (smoke test)")
    args = parser.parse_args()
    sizes = ["--units", "20", "--lines", "100", "--reads", "20"] if args.tiny else []
    reason = testbed_mod.available()
    if reason:
        raise SystemExit(f"cannot run the benchmark here: {reason}")
    testbed_mod.cleanup_stale()
    with testbed_mod.Testbed("uv-bench-tails", binds=[REPO]) as tb:
        out = tb.run(str(VENV_BIN / "python"), str(REPO / "bench" / "inside.py"), "tails", *sizes, timeout=600)
    print(json.dumps(json.loads(out.stdout), indent=2))


if __name__ == "__main__":
    main()
