"""The long commands of the harness's builds (packaging/build-deb, debootstrap, apt in a chroot,
qemu-img), run so that a timeout ends all of what they started.

subprocess.run(timeout=...) kills only the process it started: dpkg-buildpackage under build-deb, or
dpkg and a maintainer script under debootstrap, went on running after the session had given up on
them, holding the 2-core machine (and the build's lock or the chroot's mounts) for a build nobody
waits for. Here each command leads a session (and so a process group) of its own, and a timeout
kills the whole group. A process that leaves the group on purpose (setsid, a daemon) is not reached:
none of these builds start one, and chroot_mounts() (rootfs.py) still kills what is left in a chroot.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


class CommandFailed(RuntimeError):
    """A command of a build exited with a status other than 0."""


def run_in_session(cmd: list[str], timeout: float,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `cmd` to its end in a session of its own, its output captured as text. Past `timeout`
    seconds (or when the caller is interrupted) its whole process group is killed with SIGKILL, and
    the exception (subprocess.TimeoutExpired) goes on up."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException:
            # The group's id is the leader's pid, which cannot be reused before it is waited for
            # (below, by Popen's exit): the kill reaches this command's group and no other.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> None:
    """Run a command of a build (run_in_session); an exit other than 0 raises CommandFailed with the
    command and the last 30 lines of its output, where a build says what went wrong."""
    result = run_in_session(cmd, timeout, env)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
        raise CommandFailed(f"{' '.join(cmd)} exited {result.returncode}:\n{tail}")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found
