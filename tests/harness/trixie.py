"""Debian 13 (trixie) without booting it: a chroot with trixie's Python 3.13 and python3-* packages,
PostgreSQL 17 and lintian, for what needs trixie's userland but not its systemd (which refuses to boot
on this cgroup-v1 machine: that part is the VM tier's, tests/harness/vm.py).

- `make test-trixie` runs the unit and integration tests there (PostgreSQL 17 inside), with the
  checkout bound in read-only, as `make test-pass-debian` runs them with bookworm's packages
  (`python -m tests.harness.trixie PYTEST ARGS`).
- The package tests run trixie's lintian there on the .deb (tests/package/test_lintian.py).

The tree is built with debootstrap from the mirror apt uses and cached under CACHE, named after a
hash of its recipe, like the clean-room image; it is never written to: each use is a
`systemd-nspawn --volatile=overlay` whose writes land in memory, with systemd-nspawn's --as-pid2 stub
as PID 1 (no init, no bus: nothing here needs them) and a private network (loopback only: the
integration tests' PostgreSQL stays inside, and no port can clash with another session's).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.harness import rootfs
from tests.harness.cleanroom import CACHE, _discard, built_once

SUITE = "trixie"
# The .deb's dependencies and its Recommends (psycopg's C build) as trixie has them (debian/control), the
# test runner, PostgreSQL 17 for the integration tests, lintian for the package tests, and what
# tests/integration/test_wheel.py builds and installs the wheel with (git for the tracked files,
# python3-build and its backend, python3-venv for a virtualenv with pip): without them that test could
# not run there, and under CI=true it fails.
PACKAGES = (
    "python3", "python3-psycopg", "python3-psycopg-c", "python3-pystemd", "python3-sdnotify", "python3-click",
    "python3-prometheus-client", "python3-pytest", "python3-pytest-mock", "postgresql", "lintian",
    "git", "python3-build", "python3-setuptools", "python3-wheel", "python3-venv",
)
RECIPE = 1  # bump when _build() changes, so that an old tree is not reused (rootfs.RECIPE: its shared steps)
# Tools the tests call that are not what the pass is about (their version is not trixie's to test):
# bound in read-only from this machine (systemd-nspawn makes the mount points in the overlay).
# Prometheus and promtool (the unit tests of the metrics' exposition and of the example alerts) are Go
# binaries that need only libc; trixie's prometheus package would add 100 MB for them.
HOST_TOOLS = ("/usr/bin/promtool", "/usr/bin/prometheus", "/usr/share/prometheus")


class TrixieError(RuntimeError):
    pass


def available() -> str | None:
    """None when the tree can be built and entered here, else the reason why not."""
    if os.geteuid() != 0:
        return "the trixie chroot needs root (debootstrap, systemd-nspawn)"
    for tool, package in (("debootstrap", "debootstrap"), ("systemd-nspawn", "systemd-container")):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install {package})"
    return None


def image_path() -> Path:
    key = json.dumps([RECIPE, *rootfs.key(SUITE, (), PACKAGES)])
    return CACHE / f"{SUITE}-chroot-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_image(log: Callable[[str], None] = print) -> Path:
    """The cached tree, built first if it is missing. Safe from several sessions at once (one builds,
    the others wait for it)."""
    path = image_path()
    built_once(path / ".complete", ".trixie-lock", f"the trixie chroot {path}", lambda: _build(path), log)
    return path


def _build(path: Path) -> None:
    # Under the lock: whatever is at the path is an interrupted build's.
    if path.exists():
        _discard(path)
    work = Path(tempfile.mkdtemp(prefix="uv-trixie-build-", dir=CACHE))
    root = work / "root"
    try:
        rootfs.bootstrap(root, SUITE, PACKAGES)
        (root / ".complete").write_text(f"{SUITE} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        root.rename(path)
    finally:
        _discard(work)


def run(argv: Sequence[str], binds: Sequence[str] = (), chdir: str = "/", timeout: float = 3600,
        capture: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command in a throwaway container of the tree: `binds` are this machine's paths, bound
    read-only at the same place. Returns the command's result (not raised on a non-zero exit)."""
    root = ensure_image()
    # --keep-unit: no scope of its own (that would need this machine's bus); a machine name of its own,
    # so that sessions sharing the tree do not share nspawn's state under /run/systemd/nspawn.
    cmd = ["systemd-nspawn", "--quiet", "--as-pid2", "--register=no", "--keep-unit", "--volatile=overlay",
           "--private-network", "--console=pipe", f"--machine=uv-trixie-{os.getpid()}", "--directory", str(root),
           "--chdir", chdir, "--setenv=LANG=C.UTF-8",
           "--setenv=PATH=/usr/sbin:/usr/bin:/sbin:/bin",
           # The checkout is read-only in here; Python 3.13's bytecode stays in memory.
           "--setenv=PYTHONDONTWRITEBYTECODE=1"]
    if os.environ.get("CI"):
        cmd.append(f"--setenv=CI={os.environ['CI']}")
    for path in (*binds, *(t for t in HOST_TOOLS if Path(t).exists())):
        cmd.append(f"--bind-ro={path}")
    cmd += ["--", *argv]
    return subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout, check=False)


def pytest(args: Sequence[str], repo: Path) -> int:
    """pytest in the tree, on the checkout (bound read-only at its own path), with trixie's python3."""
    result = run(["python3", "-c", _TIMED, "python3", "-m", "pytest", "-p", "no:cacheprovider", *args],
                 binds=[str(repo), *_git_dirs(repo)], chdir=str(repo), capture=False)
    return result.returncode


def _git_dirs(repo: Path) -> list[str]:
    """Where the checkout's git data lies outside it (a `git worktree`'s: its .git is a file naming the
    main checkout's .git), to bind that in too; test_wheel.py asks git for the tracked files, and git
    in there would otherwise say "not a git repository". Empty for a plain clone, or without git."""
    if not (repo / ".git").is_file() or not shutil.which("git"):
        return []
    found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--path-format=absolute", "--git-common-dir"],
                           capture_output=True, text=True, check=False)
    common = Path(found.stdout.strip())
    if found.returncode != 0 or not common.is_dir() or common.is_relative_to(repo):
        return []
    return [str(common)]


# The CPU time the pass used, said from inside: what runs in the container is not nspawn's child (nspawn
# reaps the container's PID 1 from another PID namespace), so `time make test-trixie` outside misses it.
_TIMED = """import resource, subprocess, sys, time
started = time.monotonic()
code = subprocess.call(sys.argv[1:])
used = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"trixie pass: {time.monotonic() - started:.0f}s wall, {used.ru_utime:.0f}s user and "
      f"{used.ru_stime:.0f}s system CPU", flush=True)
sys.exit(code)
"""


def main(argv: list[str]) -> int:
    """`python -m tests.harness.trixie [PYTEST ARGS]`: the pass of `make test-trixie`."""
    from tests.harness.host import REPO

    reason = available()
    if reason:
        print(f"test-trixie: {reason}", file=sys.stderr)
        return 1
    ensure_image()
    versions = run(["python3", "-c", "import sys; from importlib.metadata import version; print('python', "
                    "sys.version.split()[0], *(f'{n} {version(n)}' for n in ('psycopg', 'pystemd', 'sdnotify', "
                    "'click', 'prometheus_client', 'pytest', 'pytest-mock')), "
                    "'psycopg_impl', __import__('psycopg').pq.__impl__)"])
    print(f"trixie: {versions.stdout.strip() or versions.stderr.strip()}", flush=True)
    return pytest(argv, REPO)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
