"""The cost of keeping runs' output tails with their outcomes, timed in a throwaway test bed
(bench/inside.py tails), three ways: one journalctl per attempt (before issue 14), and TailReader's
batches (TailReader.MAX_BATCH attempts a journalctl) of runs that print fewer lines than a tail keeps (quiet: the
batch proves every tail) and of runs that print 1,000 (chatty: an attempt whose last lines another
crowded out of the batch is read alone). Prints one JSON object; docs/benchmarks.md has the figures.

    .venv/bin/python -m bench.tails            # 200 runs each way, 640 reads
    .venv/bin/python -m bench.tails --tiny     # 20 runs of 10 or 100 lines, 20 reads each way (the smoke test)
"""

from __future__ import annotations

import argparse
import json

from supervisor.journal import TailReader
from tests.harness import testbed as testbed_mod
from tests.harness.host import REPO, VENV_BIN

BATCH = str(TailReader.MAX_BATCH)
WAYS = {
    "one_at_a_time": ["--lines", "1000", "--reads", "640", "--batch", "1"],
    "batched_quiet": ["--lines", "10", "--reads", "640", "--batch", BATCH],
    "batched_chatty": ["--lines", "1000", "--reads", "640", "--batch", BATCH],
}
TINY = {
    "one_at_a_time": ["--units", "20", "--lines", "100", "--reads", "20", "--batch", "1"],
    "batched_quiet": ["--units", "20", "--lines", "10", "--reads", "20", "--batch", BATCH],
    "batched_chatty": ["--units", "20", "--lines", "100", "--reads", "20", "--batch", BATCH],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, in seconds (smoke test)")
    args = parser.parse_args()
    reason = testbed_mod.available()
    if reason:
        raise SystemExit(f"cannot run the benchmark here: {reason}")
    testbed_mod.cleanup_stale()
    result = {}
    with testbed_mod.Testbed("uv-bench-tails", binds=[REPO]) as tb:
        for way, sizes in (TINY if args.tiny else WAYS).items():
            out = tb.run(str(VENV_BIN / "python"), str(REPO / "bench" / "inside.py"), "tails", *sizes, timeout=600)
            result[way] = json.loads(out.stdout)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
