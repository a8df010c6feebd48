"""A Debian root file system made with debootstrap and apt, the steps the VM tier's guest image
(vm.py) and the trixie chroot (trixie.py) share: each adds its own around them (the guest its masked
units, fstab and disk image; the chroot nothing more) and caches the result under a name hashed from
its recipe.

RECIPE is part of both recipes: bump it when `bootstrap()` changes what it builds, so that both images
are made again (an image is rebuilt exactly when its recipe changes; a change here is a change of both).
The clean room (cleanroom.py) makes its bookworm otherwise (no chroot install, the package lists kept)
and keeps its own steps.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

# The clean room's helpers: the mirror apt uses, and what a maintainer script left running in a chroot;
# and the one way of running a build's commands (tests/harness/commands.py), the clean room's too.
from tests.harness.cleanroom import _stop_processes_under, mirror
from tests.harness.commands import run

RECIPE = 1
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}


def key(suite: str, include: Sequence[str], packages: Sequence[str]) -> list[object]:
    """What of an image's recipe is decided here, for the image's cache key."""
    return [RECIPE, suite, mirror(), sorted(include), sorted(packages)]


def bootstrap(root: Path, suite: str, packages: Sequence[str], include: Sequence[str] = (),
              then: Sequence[Sequence[str]] = ()) -> None:
    """A minimal `suite` at `root` (debootstrap's minbase, with `include`), then `packages` installed
    in a chroot without their recommends, then each command of `then` run in the chroot, then apt's
    downloads removed. Nothing installed starts (a policy-rc.d that refuses, left in place: remove it
    where the tree will boot); the chroot resolves names with this machine's resolv.conf."""
    options = [f"--include={','.join(include)}"] if include else []
    run(["debootstrap", "--variant=minbase", *options, suite, str(root), mirror()], timeout=1800)
    (root / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    (root / "usr/sbin/policy-rc.d").chmod(0o755)
    shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
    with chroot_mounts(root):
        run(["chroot", str(root), "apt-get", "-q", "update"], timeout=600, env=CHROOT_ENV)
        run(["chroot", str(root), "apt-get", "-q", "-y", "install", "--no-install-recommends", *packages],
            timeout=1800, env=CHROOT_ENV)
        for command in then:
            run(["chroot", str(root), *command], timeout=600, env=CHROOT_ENV)
        run(["chroot", str(root), "apt-get", "clean"], timeout=60, env=CHROOT_ENV)


@contextlib.contextmanager
def chroot_mounts(root: Path) -> Iterator[None]:
    """/proc, /sys, /dev and /dev/pts in the tree while the block runs (maintainer scripts need them);
    then whatever a script left running there is killed, and they are unmounted."""
    mounted: list[Path] = []
    try:
        for fs, sub, options in (("proc", "proc", []), ("sysfs", "sys", []), ("devtmpfs", "dev", []),
                                 ("devpts", "dev/pts", ["-o", "gid=5,mode=620"])):
            target = root / sub
            target.mkdir(parents=True, exist_ok=True)
            run(["mount", "-t", fs, *options, fs, str(target)], timeout=30)
            mounted.append(target)
        yield
    finally:
        _stop_processes_under(root)
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)

