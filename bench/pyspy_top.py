"""The daemon's loop in a py-spy profile: where its time goes, waiting and on the CPU.

`bench.run --profile` records the daemon with `py-spy record --native --idle --format raw`: every
sample of every thread, with the C frames under the Python ones. The C frames are what tells a wait
from work: pystemd holds the GIL while it waits for PID 1's reply, so py-spy's own idle detection
counts that wait as work, and inside the test bed's PID namespace it does not tell idle threads
apart at all. Here a sample of the loop (the stacks through `Daemon.run`) is a wait when one of its
innermost frames is a blocking call (poll, ppoll, select, or a wait for the GIL), and on the CPU
otherwise. The CPU shares are of the on-CPU samples only: where the daemon's CPU per run goes.

    .venv/bin/python -m bench.pyspy_top bench/results/profile-throughput-1000.txt
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

LOOP = "Daemon.run"
# Innermost native frames that mean the thread is blocked, not working.
WAITS = frozenset({"poll", "ppoll", "select", "pselect6", "epoll_wait", "pthread_cond_wait",
                   "pthread_cond_timedwait", "__futex_abstimed_wait_common", "nanosleep", "clock_nanosleep"})
GIL_WAITS = frozenset({"pthread_cond_wait", "pthread_cond_timedwait", "__futex_abstimed_wait_common"})
INNERMOST = 4  # how many innermost frames are looked at for a blocking call (libc's own helpers sit below it)
_PY_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*\.py|unitvisor):\d+\)$")


@dataclass
class Summary:
    samples: int = 0  # of the loop's thread
    on_cpu: int = 0
    waits: Counter = field(default_factory=Counter)  # "<python function>" or "GIL" -> samples
    self_cpu: Counter = field(default_factory=Counter)  # innermost Python function -> on-CPU samples
    total_cpu: Counter = field(default_factory=Counter)  # Python function anywhere in the stack -> on-CPU samples


def _python_frame(frame: str) -> str | None:
    match = _PY_FRAME.match(frame)
    if not match:
        return None
    path = match["file"]
    for marker in ("/site-packages/", "/dist-packages/"):
        path = path.rsplit(marker, 1)[-1]
    if "/supervisor/" in path:
        path = "supervisor/" + path.rsplit("/supervisor/", 1)[1]
    elif "/lib/python3" in path:
        path = path.rsplit("/", 1)[1]
    return f"{match['name']} ({path})"


def summarize(lines: list[str]) -> Summary:
    """Pure: the loop's samples of a raw (collapsed) py-spy profile, split into waits and CPU."""
    out = Summary()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not any(f.startswith(LOOP + " ") for f in frames):
            continue
        n = int(count)
        out.samples += n
        python = [p for p in map(_python_frame, frames) if p]
        innermost = [f.split(" (")[0] for f in frames[-INNERMOST:]]
        if any(name in WAITS for name in innermost):
            kind = "the GIL" if any(name in GIL_WAITS for name in innermost) else python[-1] if python else "?"
            out.waits[kind] += n
            continue
        out.on_cpu += n
        if python:
            out.self_cpu[python[-1]] += n
            for function in set(python):
                out.total_cpu[function] += n
    return out


def report(summary: Summary, top: int = 20) -> str:
    if not summary.samples:
        return "no samples of the daemon's loop (Daemon.run) in this profile\n"
    s, cpu = summary.samples, max(summary.on_cpu, 1)
    lines = [f"the loop's thread: {s} samples; on the CPU {100 * summary.on_cpu / s:.1f}%, waiting "
             f"{100 * (s - summary.on_cpu) / s:.1f}%", "", "waiting, as a share of all the loop's samples:"]
    lines += [f"  {100 * n / s:5.1f}%  in {kind}" for kind, n in summary.waits.most_common(8)]
    lines += ["", f"on the CPU, as a share of the on-CPU samples (self: innermost Python function, C below it "
              f"included; total: anywhere in the stack), top {top} by self:", f"  {'self':>6} {'total':>6}  function"]
    lines += [f"  {100 * n / cpu:5.1f}% {100 * summary.total_cpu[f] / cpu:5.1f}%  {f}"
              for f, n in summary.self_cpu.most_common(top)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(report(summarize(Path(args[0]).read_text().splitlines())), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
