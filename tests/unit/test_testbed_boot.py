"""tests/harness/testbed.py: boot() of a test bed that is running already is refused (a second nspawn
would orphan the first container, which then outlived its session out of cleanup_stale()'s reach)."""

from __future__ import annotations

from unittest import mock

import pytest

from tests.harness import testbed


def test_booting_a_running_test_bed_again_is_refused_before_any_nspawn(mocker) -> None:
    tb = object.__new__(testbed.Testbed)  # no directory, no mounts: only the state boot() reads
    tb.name, tb.proc, tb._layers_ready = "uv-host-1", mock.Mock(poll=mock.Mock(return_value=None)), True
    popen = mocker.patch.object(testbed.subprocess, "Popen")
    with pytest.raises(testbed.TestbedError, match="is running already"):
        tb.boot()
    popen.assert_not_called()
