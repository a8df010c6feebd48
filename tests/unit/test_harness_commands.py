"""The one way the harness runs a build's commands (tests/harness/commands.py): the clean room's
debootstrap, the chroot builds' apt (rootfs.py) and the VM image's qemu-img all go through it, so that
a failure reads the same everywhere and a timeout kills the whole tree of every one of them (the
timeout itself: tests/unit/test_deb_build.py, through build-deb)."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.harness import cleanroom, commands, rootfs, vm


def test_a_failed_command_is_named_with_the_last_lines_of_its_output() -> None:
    script = "for i in $(seq 40); do echo line $i; done; echo oops >&2; exit 3"
    with pytest.raises(commands.CommandFailed) as failed:
        commands.run(["/bin/sh", "-c", script], timeout=30)
    message = str(failed.value)
    assert message.startswith(f"/bin/sh -c {script} exited 3:\n")
    lines = message.splitlines()[1:]
    assert lines[0] == "line 12" and lines[-2:] == ["line 40", "oops"] and len(lines) == 30


def test_a_command_that_succeeds_returns_nothing_and_sees_its_environment() -> None:
    assert commands.run(["/bin/sh", "-c", 'test "$X" = y'], timeout=30, env={"X": "y"}) is None
    with pytest.raises(commands.CommandFailed, match="exited 1"):
        commands.run(["/bin/sh", "-c", 'test "$X" = y'], timeout=30, env={"X": "n"})


def test_every_build_runs_its_commands_through_the_one_helper() -> None:
    # Each module had its own copy (cleanroom._run, rootfs.run): one of them would have missed the
    # process-group kill.
    assert cleanroom.run is rootfs.run is vm.run is commands.run


@pytest.mark.parametrize("broken", ["sending", "reading"])
def test_a_guest_whose_qemu_went_away_says_how_and_what_its_console_printed(tmp_path, broken: str) -> None:
    # CI once saw only "BrokenPipeError" from the agent's socket in the middle of the VM tier's set-up,
    # with the console and qemu's stderr deleted with the guest: the error now carries both.
    guest = vm.Guest()
    guest.dir.rmdir()
    guest.dir = tmp_path
    guest.console = tmp_path / "console.log"
    guest.console.write_text("booting\nKernel panic - not syncing: an example\n")
    (tmp_path / "qemu.err").write_text("qemu: terminating on signal 15\n")
    ours, theirs = socket.socketpair()
    guest._sock = ours
    guest._qemu = subprocess.Popen(["/bin/sh", "-c", "exit 3"])
    theirs.close()
    try:
        with pytest.raises(vm.GuestGone) as gone:
            if broken == "sending":
                guest.run("true")
            else:
                guest._read_reply(timeout=5)
    finally:
        ours.close()
        guest._sock = None
    message = str(gone.value)
    assert ("the agent's socket broke" if broken == "sending" else "qemu closed the agent's socket") in message
    assert "qemu exited 3" in message
    assert "qemu: terminating on signal 15" in message and "Kernel panic - not syncing: an example" in message
