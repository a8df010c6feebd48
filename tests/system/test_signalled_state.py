"""Issue 27: the daemon decides on a unit's state as its PropertiesChanged signals said it
(Watcher.signalled) and reads back only its accounting. Proven here against the real PID 1, for each way
a run ends: what the signals said is what systemd says when the unit is read in full."""

from __future__ import annotations

import json

import pytest

from tests.harness import testbed as testbed_mod
from tests.harness.host import REPO, VENV_BIN

pytestmark = pytest.mark.system

CASES = {
    "uv-signalled-success.service": (["/bin/sh", "-c", "sleep 0.2"], None, ("inactive", "success", 1, 0)),
    "uv-signalled-exit.service": (["/bin/sh", "-c", "sleep 0.2; exit 3"], None, ("failed", "exit-code", 1, 3)),
    # (Not `kill -9 $$` in a shell: ExecStart= expands `$$` to `$`.)
    "uv-signalled-killed.service": (
        ["/usr/bin/python3", "-c", "import os, time; time.sleep(0.2); os.kill(os.getpid(), 9)"], None,
        ("failed", "signal", 2, 9)),
    "uv-signalled-timeout.service": (["/bin/sleep", "30"], 300_000, ("failed", "timeout", 2, 15)),
    "uv-signalled-quick.service": (["/bin/true"], None, ("inactive", "success", 1, 0)),
}


def test_the_state_a_units_signals_say_is_the_state_systemd_says(testbed: testbed_mod.Testbed) -> None:
    given = {name: [argv, runtime_max] for name, (argv, runtime_max, _) in CASES.items()}
    result = testbed.run(str(VENV_BIN / "python"), str(REPO / "tests" / "harness" / "signalled.py"),
                         input=json.dumps(given), timeout=90)
    states = json.loads(result.stdout)
    for name, (_, _, (active, outcome, code, status)) in CASES.items():
        signalled, read = states[name]["signalled"], states[name]["read"]
        assert signalled is not None, f"{name}: its signals never said it ended"
        assert signalled == read, name
        assert (signalled["active_state"], signalled["result"], signalled["exec_main_code"],
                signalled["exec_main_status"]) == (active, outcome, code, status), name
        assert signalled["invocation_id"] and signalled["exec_main_exit_usec"], name
