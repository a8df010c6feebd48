"""bench/inside.py unit-cost on the VM tier's Debian 13 guest (systemd 257, cgroup v2), where the
tasks-peak stop command does all its work (pids.peak is there to copy), unlike in the cgroup-v1 test
bed. The checkout's `supervisor` package and bench/inside.py are copied into the guest (no .deb):
the guest has every dependency. Under software emulation: compare the kinds with each other only.

    .venv/bin/python -m bench.vm_unit_cost --n 100 --rounds 2 --only "packaged,tasks-peak"
    .venv/bin/python -m bench.vm_unit_cost --n 40 --rounds 1 --each-property
    .venv/bin/python -m bench.vm_unit_cost --n 100 --rounds 2 --outcome-loops

`--outcome-loops` runs instead what bench.run's (1) runs for issue 27, sandbox off: the raw loop, then
inside.py's outcome-loop with the signals only, held, and split (the daemon's side of systemd alone),
each kind once a round, in turn.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tarfile
from collections.abc import Iterator

from tests.harness import vm as vm_mod
from tests.harness.host import REPO


def _tree() -> bytes:
    """supervisor/ and bench/inside.py as a tar, for the guest's /root/uv."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.add(REPO / "supervisor", "supervisor", filter=lambda t: None if "__pycache__" in t.name else t)
        tar.add(REPO / "bench" / "inside.py", "bench/inside.py")
    return out.getvalue()


@contextlib.contextmanager
def _guest() -> Iterator[vm_mod.Guest]:
    """The VM tier's guest with the checkout's supervisor package and bench/inside.py in /root/uv."""
    reason = vm_mod.available()
    if reason:
        raise SystemExit(f"cannot run the benchmark here: {reason}")
    with vm_mod.Guest() as guest:
        guest.write("/root/uv.tar", _tree())
        guest.run("mkdir", "-p", "/root/uv")
        guest.run("tar", "-C", "/root/uv", "-xf", "/root/uv.tar")
        yield guest


def outcome_loops(n: int, rounds: int) -> None:
    """Issue 27's steps on systemd 257: runs/s of the raw loop and of each outcome loop, sandbox-off units."""
    kinds = {"raw loop": ("limit", "--props", "unsandboxed"), "signals": ("outcome-loop",),
             "held": ("outcome-loop", "--hold"), "split": ("outcome-loop", "--split")}
    out: dict[str, list[float]] = {kind: [] for kind in [*kinds, "raw loop, all ran"]}
    with _guest() as guest:
        for round_ in range(rounds):
            for kind, args in kinds.items():
                raw = json.loads(guest.run("python3", "/root/uv/bench/inside.py", *args, "--n", str(n), "--prefix",
                                           f"vm-{round_}-{kind.replace(' ', '-')}-", timeout=3600).stdout)
                if kind == "raw loop":  # its starts (what bench.run compares with), and until all ran
                    out[kind].append(n / raw["loop_s"])
                    out["raw loop, all ran"].append(n / raw["drain_s"])
                else:
                    out[kind].append(raw["runs_per_s"])
        version = guest.run("systemctl", "--version").stdout.split()[1]
    print(json.dumps({"systemd": version, "n": n, "runs_per_s": out}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", help="comma-separated words: only the kinds whose label holds one "
                        "[default: packaged,tasks-peak, or every kind with --each-property]")
    parser.add_argument("--each-property", action="store_true",
                        help="the packaged units less each sandbox property in turn, and less all of them")
    parser.add_argument("--outcome-loops", action="store_true",
                        help="the raw loop and the outcome loops of sandbox-off units (issue 27), not unit-cost")
    args = parser.parse_args()
    if args.outcome_loops:
        return outcome_loops(args.n, args.rounds)
    if args.only is None and not args.each_property:
        args.only = "packaged,tasks-peak"
    with _guest() as guest:
        out = guest.run("python3", "/root/uv/bench/inside.py", "unit-cost", "--n", str(args.n), "--rounds",
                        str(args.rounds), *(["--only", args.only] if args.only else []),
                        *(["--each-property"] if args.each_property else []), timeout=3600)
        version = guest.run("systemctl", "--version").stdout.split()[1]
    print(json.dumps({"systemd": version, **json.loads(out.stdout)}, indent=2))


if __name__ == "__main__":
    main()
