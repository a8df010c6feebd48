"""Run inside a test bed (tests/system/test_signalled_state.py): start one transient unit per case given
as JSON on stdin ({name: [argv, runtime_max_usec or null]}), follow the units' signals with the
daemon's own Watcher until each has ended, and print as JSON, for each, the state its signals said
(`Systemd.state(name, signalled)`, accounting read) and the state read back in full (`Systemd.state(name)`)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from supervisor import systemd


def main() -> int:
    cases = json.load(sys.stdin)
    watcher = systemd.Watcher("uv-signalled-")
    watcher.connect()
    pid1 = systemd.Systemd()
    pid1.connect()
    for name, (argv, runtime_max_usec) in cases.items():
        props = {b"Type": b"exec", b"AddRef": True,
                 b"ExecStart": [(argv[0].encode(), [a.encode() for a in argv], False)]}
        if runtime_max_usec:
            props[b"RuntimeMaxUSec"] = runtime_max_usec
        pid1.start_transient(name, props)
    said: dict[str, systemd.UnitState] = {}
    deadline = time.monotonic() + 30
    while len(said) < len(cases) and time.monotonic() < deadline:
        watcher.drain()
        said.update({n: s for n, s in watcher.signalled.items() if s.has_ended})
        time.sleep(0.05)
    out = {}
    for name in cases:
        read = pid1.state(name)
        out[name] = {"signalled": dataclasses.asdict(pid1.state(name, said[name])) if name in said else None,
                     "read": dataclasses.asdict(read) if read is not None else None}
        pid1.unref(name)
        pid1.reset_failed(name)
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
